"""The Hopper TMA kernels (kernels_cu/*_tma.cu): which calls take them, that they agree with the
reference as the other kernels do, their long-sequence tiles, and the tensor maps' address
patching against the driver's own encoding (their determinism: test_kernels.py). Skipped on GPUs
other than sm_90."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_kernels import Case, check_case, make

from cuflash import _cuda, _kernels, _plans, _tma, testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests make their inputs with PyTorch")
if _cuda.device_arch(torch.cuda.current_device()) != "sm_90a":
    pytest.skip("the TMA kernels run on Hopper (sm_90) only", allow_module_level=True)


def plans_of(case: Case) -> tuple:
    """The forward and backward plans of the case's last call (cuflash/_plans.py)."""
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    q = make(case, case.shape(case.seq_q, case.heads_q), gen)
    k = make(case, case.shape(case.seq_k, case.heads_kv), gen)
    v = make(case, case.shape(case.seq_k, case.heads_kv), gen)
    o, lse = _kernels_call(q, k, v, case)
    fwd = _plans.get(_plans.signature("forward", (q, k, v), case.causal, None, "bshd"))
    bwd = _plans.get(_plans.signature("backward", (q, q, k, v, o, lse), case.causal, None, "bshd"))
    return fwd, bwd


def _kernels_call(q, k, v, case):
    import cuflash

    o, lse = cuflash.attention_forward(q, k, v, causal=case.causal)
    cuflash.attention_backward(q, q, k, v, o, lse, causal=case.causal)
    return o, lse


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_aligned_calls_take_the_tma_kernels_and_unaligned_ones_do_not(head_dim, causal):
    for storage, tma in (("contiguous", True), ("views", True), ("unaligned", False)):
        case = Case(2, 2, 2, 333, 517, head_dim, "bfloat16", "bshd", causal, None, storage, 7)
        check_case(case, "tma paths")  # against the float64 reference, either way
        fwd, bwd = plans_of(case)
        assert bool(fwd.tma) == tma and bool(bwd.tma) == tma, (storage, fwd.tma, bwd.tma)
        if tma:
            assert fwd.tma_loaded.spec.source == "forward_sm90_tma.cu"
            assert bwd.tma_dq.spec.source == bwd.tma_dkdv.spec.source == "backward_sm90_tma.cu"


@pytest.mark.parametrize(
    "seq_q,seq_k,causal",
    [(2300, 2300, False), (4100, 4100, True), (2100, 700, True), (2000, 2000, True)],
)
def test_long_sequence_tiles(seq_q, seq_k, causal):
    # d = 64 forward: 192-row query tiles from 2048 rows, causal or not, cuflash/_kernels.py
    case = Case(1, 1, 2, seq_q, seq_k, 64, "float16", "bshd", causal, None, "contiguous", 9)
    check_case(case, "long tiles")
    fwd, _ = plans_of(case)
    want = 192 if seq_q >= 2048 else 128
    assert fwd.tma_loaded.spec.rows_per_block == want


def test_patched_tensor_maps_equal_the_drivers():
    x = torch.empty(4, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    base = x.data_ptr()
    tile_map = _tma.TileMap((128, 300, 8, 4), (8 * 128 * 2, 128 * 2, 300 * 8 * 128 * 2), 64, base)
    for address in (base, base + 16, base + 4096 * 16, base + (1 << 20)):
        assert tile_map.bytes_for(address) == tile_map.encode(address)


def _with_causal_alignment(end_aligned: bool):
    """Set the TMA forward's causal row-block alignment (NOTES v8) for one test, then restore it."""
    default = _kernels.causal_end_aligned()
    _kernels.set_causal_end_aligned(end_aligned)
    yield end_aligned
    _kernels.set_causal_end_aligned(default)


@pytest.fixture
def causal_end_aligned():
    """Causal row blocks aligned to the end of the sequence, whatever the default."""
    yield from _with_causal_alignment(True)


@pytest.fixture(params=[True, False], ids=["end-aligned", "start-aligned"])
def causal_alignment(request):
    """Both alignments: end (the default) and start (set_causal_end_aligned(False))."""
    yield from _with_causal_alignment(request.param)


@pytest.mark.parametrize(
    "head_dim,tiles", [(64, None), (64, (192, 128, 2)), (128, None), (256, None)]
)
@pytest.mark.parametrize(
    "seq_q,seq_k", [(64, 64), (193, 193), (333, 333), (1000, 1000), (517, 900), (900, 517)]
)
def test_causal_row_blocks(causal_alignment, head_dim, tiles, seq_q, seq_k):
    # End-aligned, the partial row block comes first (its rows start before 0) and odd block
    # counts get an empty slot; start-aligned, the last block is the partial one. Either way every
    # real row is written once, rows before 0 never (outputs start as NaN).
    if tiles:
        _kernels.set_tile_override("forward_tma", "bfloat16", head_dim, tiles)
    try:
        case = Case(
            2, 2, 2, seq_q, seq_k, head_dim, "bfloat16", "bshd", True, None, "contiguous", 5
        )
        check_case(case, "causal row blocks")
        fwd, _ = plans_of(case)
        bm = fwd.tma_loaded.spec.rows_per_block
        assert fwd.tma and (fwd.tma_slots, fwd.tma_row_shift) == _kernels.causal_row_slots(
            seq_q, bm, True
        )
        if causal_alignment:
            assert fwd.tma_slots % 2 == 0 and fwd.tma_row_shift == fwd.tma_slots * bm - seq_q
        else:
            assert fwd.tma_row_shift == 0 and fwd.tma_slots == -(-seq_q // bm)
    finally:
        if tiles:
            _kernels.set_tile_override("forward_tma", "bfloat16", head_dim, None)


def test_end_aligned_first_block_with_a_nonfinite_key(causal_end_aligned):
    # Fewer queries than keys (bottom-right causal: query i sees keys j <= i + 200). The first
    # block holds rows -28 .. 99 (128-row blocks, row_shift 156); its rows before 0 see the NaN
    # key too, so the repair path gets them flagged and must skip them (compute-sanitizer runs
    # this shape as well: tests/gpu/sanitize_cases.py). Head 1 sees the NaN key in every row;
    # head 0 is exactly as without it.
    import cuflash

    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (
        torch.randn(1, n, 2, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
        for n in (100, 300, 300)
    )
    clean_o, clean_lse = cuflash.attention_forward(q, k, v, causal=True)
    fwd = _plans.get(_plans.signature("forward", (q, k, v), True, None, "bshd"))
    assert fwd.tma and (fwd.tma_slots, fwd.tma_row_shift) == (2, 156)
    k2 = k.clone()
    k2[0, 150, 1, 7] = float("nan")
    o, lse = cuflash.attention_forward(q, k2, v, causal=True)
    assert bool(torch.isnan(o[0, :, 1]).all(-1).all())
    assert torch.equal(o[0, :, 0], clean_o[0, :, 0]) and torch.equal(lse[0, 0], clean_lse[0, 0])


def test_tensor_core_turns_agree_with_the_reference():
    # The forward whose consumer warpgroups take turns at the tensor cores (the fourth tile field;
    # kernels_cu/tma.cuh, TensorCoreTurns), both dtypes, both causal row-block alignments, run in
    # a child process with a time limit: a turn schedule that deadlocks fails here instead of
    # hanging the suite.
    root = Path(__file__).resolve().parents[2]
    items = ["64:128,128,2,1", "64:192,128,2,1", "128:128,128,2,1", "256:128,64,2,1"]
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "probe_sm90.py"), "--check-tiles", *items],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": ok") == 4 * 2 * 2, proc.stdout[-3000:]


@pytest.mark.parametrize(
    "head_dim,seq_q,seq_k,causal,layout,group",
    [
        (128, 333, 517, False, "bshd", 1),  # partial last block: its second warpgroup unstaged
        (128, 1000, 1000, True, "bhsd", 2),  # end-aligned: the first block's rows before 0
        (120, 517, 900, True, "bshd", 1),  # d below its bucket: never staged
        (64, 2100, 2100, True, "bshd", 1),  # 192-row tiles, three consumer warpgroups
        (64, 100, 64, False, "bhsd", 4),
        (40, 65, 65, True, "bshd", 1),
    ],
)
def test_tma_store_of_o_matches_the_register_store_bit_for_bit(
    head_dim, seq_q, seq_k, causal, layout, group
):
    # The forward's O through the staging tile and TMA stores (kernels_cu/forward_sm90_tma.cu,
    # d = 64 and 128; warpgroups whose rows reach past either end of the sequence write from
    # registers) rounds the same floats as the store from registers (set_tma_store(False)), so
    # both give the same bits; outputs start as NaN, so an element that neither writes fails.
    import cuflash

    case = Case(
        2, 2, group, seq_q, seq_k, head_dim, "bfloat16", layout, causal, None, "contiguous", 11
    )
    check_case(case, "tma store")  # the session's default path against the float64 reference
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    q = make(case, case.shape(seq_q, case.heads_q), gen)
    k = make(case, case.shape(seq_k, case.heads_kv), gen)
    v = make(case, case.shape(seq_k, case.heads_kv), gen)
    results = {}
    default = _kernels.tma_store_enabled()
    for staged in (True, False):
        _kernels.set_tma_store(staged)
        try:
            o, lse = cuflash.attention_forward(q, k, v, causal=causal, layout=layout)
            fwd = _plans.get(_plans.signature("forward", (q, k, v), causal, None, layout))
            want = staged and head_dim in (64, 128)
            assert fwd.tma and fwd.tma_loaded.spec.o_via_tma == want
            assert (fwd.o_map is not None) == want
            results[staged] = (o, lse)
        finally:
            _kernels.set_tma_store(default)
    (o_staged, lse_staged), (o_direct, lse_direct) = results[True], results[False]
    assert not torch.isnan(o_staged).any() and torch.equal(o_staged, o_direct)
    assert torch.equal(lse_staged, lse_direct)
