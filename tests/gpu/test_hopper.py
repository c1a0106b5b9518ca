"""The Hopper TMA kernels (kernels_cu/*_tma.cu): which calls take them, that they agree with the
reference as the other kernels do, their long-sequence tiles, and the tensor maps' address
patching against the driver's own encoding (their determinism: test_kernels.py). Skipped on GPUs
other than sm_90."""

from __future__ import annotations

import pytest
from test_kernels import Case, check_case, make

from cuflash import _cuda, _plans, _tma, testing

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
    "seq_q,seq_k,causal", [(2300, 2300, False), (4100, 4100, True), (2100, 700, True)]
)
def test_long_sequence_tiles(seq_q, seq_k, causal):
    # d = 64 forward: 192-row query tiles from 2048 rows (4096 causal), kernels_cu/_kernels.py
    case = Case(1, 1, 2, seq_q, seq_k, 64, "float16", "bshd", causal, None, "contiguous", 9)
    check_case(case, "long tiles")
    fwd, _ = plans_of(case)
    want = 192 if seq_q >= (4096 if causal else 2048) else 128
    assert fwd.tma_loaded.spec.rows_per_block == want


def test_patched_tensor_maps_equal_the_drivers():
    x = torch.empty(4, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    base = x.data_ptr()
    tile_map = _tma.TileMap((128, 300, 8, 4), (8 * 128 * 2, 128 * 2, 300 * 8 * 128 * 2), 64, base)
    for address in (base, base + 16, base + 4096 * 16, base + (1 << 20)):
        assert tile_map.bytes_for(address) == tile_map.encode(address)
