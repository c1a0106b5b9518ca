"""The Hopper TMA kernels (kernels_cu/*_tma.cu): which calls take them, that they agree with the
reference as the other kernels do, their long-sequence tiles and causal row blocks, the O store,
and the tensor maps' address patching against the driver's own encoding (their determinism:
test_kernels.py). Skipped on GPUs other than sm_90."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_kernels import Case, check_case, make

from cuflash import _compile, _dispatch, _kernels, _plans, _tma, testing
from cuflash._dispatch import KernelChoice

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests make their inputs with PyTorch")
if _compile.device_arch(torch.cuda.current_device()) != "sm_90a":
    pytest.skip("the TMA kernels run on Hopper (sm_90) only", allow_module_level=True)


def inputs_of(case: Case) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    q = make(case, case.shape(case.seq_q, case.heads_q), gen)
    k = make(case, case.shape(case.seq_k, case.heads_kv), gen)
    v = make(case, case.shape(case.seq_k, case.heads_kv), gen)
    return q, k, v


def plans_of(case: Case) -> tuple:
    """The forward and backward plans that the public API built for the case (cuflash/_plans.py),
    after one call of each."""
    import cuflash

    q, k, v = inputs_of(case)
    o, lse = cuflash.attention_forward(q, k, v, causal=case.causal)
    cuflash.attention_backward(q, q, k, v, o, lse, causal=case.causal)
    fwd = _plans.get(_plans.signature("forward", (q, k, v), case.causal, None, None, None, "bshd"))
    bwd = _plans.get(
        _plans.signature("backward", (q, q, k, v, o, lse), case.causal, None, None, None, "bshd")
    )
    return fwd, bwd


@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_aligned_calls_take_the_tma_kernels_and_unaligned_ones_do_not(head_dim, causal):
    for storage, tma in (("contiguous", True), ("views", True), ("unaligned", False)):
        case = Case(2, 2, 2, 333, 517, head_dim, "bfloat16", "bshd", causal, None, storage, 7)
        check_case(case, "tma paths")  # against the float64 reference, either way
        fwd, bwd = plans_of(case)
        paths = (
            fwd.runs.aligned.launch.spec.path,
            bwd.dkdv.aligned.launch.spec.path,
            bwd.dq.aligned.launch.spec.path,
        )
        # the fused backward where the library chooses it (d = 40-128; at d <= 64 not under a
        # causal mask with more keys than queries)
        fused = tma and _dispatch.fused_backward_chosen(bwd.p)
        expected = ("tma", "fused", "fused") if fused else ("tma",) * 3
        assert (paths == expected) == tma, (storage, paths)
        if tma:  # and any pointers that are not 16-byte aligned take the others
            assert fwd.runs.pick(False).launch.spec.path != "tma"


@pytest.mark.parametrize(
    "seq_q,seq_k,causal",
    [
        (2300, 2300, False),
        (4100, 4100, True),
        (2100, 700, True),
        (1100, 1100, True),
        (1000, 1000, False),
    ],
)
def test_long_sequence_tiles(seq_q, seq_k, causal):
    # d = 64 forward: 192-row query tiles from 1024 rows, causal or not (cuflash/_kernels.py)
    case = Case(1, 1, 2, seq_q, seq_k, 64, "float16", "bshd", causal, None, "contiguous", 9)
    check_case(case, "long tiles")
    fwd, _ = plans_of(case)
    assert fwd.runs.aligned.launch.spec.rows_per_block == (192 if seq_q >= 1024 else 128)


@pytest.mark.parametrize(
    "seq_q,seq_k,causal,softcap,dtype",
    [
        (4100, 4100, False, None, "bfloat16"),
        (4096, 4200, True, None, "float16"),
        (4100, 1700, True, 5.0, "bfloat16"),
        (4200, 4100, False, 30.0, "float16"),
        (4000, 4000, False, None, "bfloat16"),
    ],
)
def test_long_key_tiles_at_d128(seq_q, seq_k, causal, softcap, dtype):
    # d = 128 forward: 160-key tiles from 4096 query rows, dense or with a softcap, O written from
    # registers (no room for the staging tile); the last key tile partial (4100 = 25 x 160 + 100)
    case = Case(1, 1, 2, seq_q, seq_k, 128, dtype, "bshd", causal, None, "contiguous", 13)
    case = replace(case, softcap=softcap)
    check_case(case, "long key tiles")
    # the plan that call built (cuflash/_plans.py: keyed by the options and the arrays' layout)
    signature = _plans.signature("forward", inputs_of(case), causal, None, softcap, None, "bshd")
    spec = _plans.get(signature).runs.aligned.launch.spec
    long_tiles = seq_q >= 4096
    assert (spec.rows_per_block, spec.rows_per_step) == (128, 160 if long_tiles else 128)
    assert spec.o_via_tma != long_tiles and spec.schedule == "turns"


@pytest.mark.parametrize(
    "batch,seq_q,seq_k,head_dim,causal,window,softcap,alibi,dtype",
    [
        (6, 1100, 1100, 64, False, None, None, None, "bfloat16"),
        (6, 1100, 900, 128, True, None, None, None, "float16"),
        (4, 1500, 300, 128, True, None, None, None, "bfloat16"),  # rows that see no key
        (6, 1000, 1200, 128, False, (300, 40), 20.0, "head", "bfloat16"),
        (2, 4100, 4100, 128, False, None, None, None, "bfloat16"),  # 160-key tiles
        (8, 1000, 1000, 40, True, (100, 0), None, None, "float16"),
        (4, 1100, 1000, 256, False, None, None, None, "bfloat16"),  # one Q buffer
    ],
)
def test_several_work_items_per_block(
    batch, seq_q, seq_k, head_dim, causal, window, softcap, alibi, dtype
):
    # At least twice as many work items as blocks, so that each persistent block of the TMA
    # forward runs several back to back (most other GPU tests give a block one item): the
    # producer loads the next item's Q and first tiles while the consumers finish this one, the
    # Q buffers and K/V stages go round across items, and items whose rows see no key (count 0,
    # where the causal rows outnumber the keys) sit between others.
    case = Case(batch, 4, 2, seq_q, seq_k, head_dim, dtype, "bshd", causal, None, "contiguous", 23)
    case = replace(case, window=window, softcap=softcap, alibi=alibi)
    check_case(case, "several items")
    launch = plans_of(case)[0].runs.aligned.launch  # the call without window, softcap, ALiBi
    assert launch.spec.path == "tma" and launch.num_work >= 2 * launch.grid


@pytest.mark.parametrize(
    "batch,group,seq_q,seq_k,softcap,alibi,dtype",
    [
        (2, 1, 1024, 1024, None, None, "bfloat16"),  # 5 x 192 + 64 rows
        (8, 1, 1200, 517, None, None, "float16"),  # 48 rows; a partial key tile; 2+ items a block
        (1, 2, 4096, 4096, 30.0, None, "bfloat16"),  # softcap (pinned rows); grouped heads
        (2, 1, 1024, 300, None, "head", "float16"),  # ALiBi; three key tiles, one a consumer
        (1, 1, 1024, 100, None, None, "bfloat16"),  # one key tile: two consumers see none
    ],
)
def test_last_row_block_split_by_keys(batch, group, seq_q, seq_k, softcap, alibi, dtype):
    # d = 64's 192-row tiles split each head's last block among the three consumers by key tiles
    # where its rows fit one (kernels_cu/forward_sm90_tma.cu, SPLIT_LAST) and merge their rows;
    # the walk takes those blocks first (common.cuh, decode_last_first_work). Against the float64
    # reference, every row written once, and the same bits on a second call.
    case = Case(batch, 2, group, seq_q, seq_k, 64, dtype, "bshd", False, None, "contiguous", 29)
    case = replace(case, softcap=softcap, alibi=alibi)
    check_case(case, "split last block")
    q, k, v = inputs_of(case)
    slopes = None
    if alibi:
        gen = torch.Generator(device="cuda").manual_seed(5)
        slopes = torch.rand(case.heads_q, device="cuda", generator=gen)
    runs = [
        testing.attention_forward_with(
            _dispatch.DEFAULT, q, k, v, softcap=softcap, alibi_slopes=slopes
        )
        for _ in range(2)
    ]
    launch = runs[0][2].runs.aligned.launch
    assert launch.spec.rows_per_block == 192 and launch.split_last
    (o, lse, _), (o2, lse2, _) = runs
    assert not torch.isnan(o).any() and torch.equal(o, o2) and torch.equal(lse, lse2)


def test_patched_tensor_maps_equal_the_drivers():
    x = torch.empty(4, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    base = x.data_ptr()
    tile_map = _tma.TileMap((128, 300, 8, 4), (8 * 128 * 2, 128 * 2, 300 * 8 * 128 * 2), 64, base)
    for address in (base, base + 16, base + 4096 * 16, base + (1 << 20)):
        assert tile_map.bytes_for(address) == tile_map.encode(address)


@pytest.mark.parametrize(
    "head_dim,tiles",
    [
        (64, None),
        (64, (192, 128, 2)),
        (128, None),
        (128, (128, 160, 2)),
        (256, None),
        (256, (128, 64, 2)),
    ],
)
@pytest.mark.parametrize(
    "seq_q,seq_k", [(64, 64), (193, 193), (333, 333), (1000, 1000), (517, 900), (900, 517)]
)
@pytest.mark.parametrize("causal", [True, False])
def test_row_blocks(head_dim, tiles, seq_q, seq_k, causal):
    # Causal: the row blocks are aligned to the end of the sequence, the partial block first (its
    # rows start before 0) and odd block counts get an empty slot; not causal, the last block is
    # the partial one. Either way every real row is written once, rows before 0 never (outputs
    # start as NaN), and the results pass the policy.
    case = Case(2, 2, 2, seq_q, seq_k, head_dim, "bfloat16", "bshd", causal, None, "contiguous", 5)
    choice = KernelChoice(tiles=((("forward", "tma"), tiles),)) if tiles else _dispatch.DEFAULT
    fwd, _ = check_case(case, "row blocks", choice)
    launch = fwd.runs.aligned.launch
    bm = launch.spec.rows_per_block
    if tiles:
        assert bm == tiles[0]
    assert launch.spec.path == "tma" and (launch.num_blocks, launch.row_shift) == (
        _dispatch.row_slots(seq_q, bm, end_aligned=causal)
    )
    assert launch.paired == causal


def test_end_aligned_first_block_with_a_nonfinite_key():
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
    fwd = _plans.get(_plans.signature("forward", (q, k, v), True, None, None, None, "bshd"))
    launch = fwd.runs.aligned.launch
    assert launch.spec.path == "tma" and (launch.num_blocks, launch.row_shift) == (2, 156)
    k2 = k.clone()
    k2[0, 150, 1, 7] = float("nan")
    o, lse = cuflash.attention_forward(q, k2, v, causal=True)
    assert bool(torch.isnan(o[0, :, 1]).all(-1).all())
    assert torch.equal(o[0, :, 0], clean_o[0, :, 0]) and torch.equal(lse[0, 0], clean_lse[0, 0])


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
    # registers) rounds the same floats as the store from registers (o_store="registers"), so
    # both give the same bits; outputs start as NaN, so an element that neither writes fails.
    case = Case(
        2, 2, group, seq_q, seq_k, head_dim, "bfloat16", layout, causal, None, "contiguous", 11
    )
    check_case(case, "tma store")  # the library's path against the float64 reference
    q, k, v = inputs_of(case)
    results = {}
    for store in ("tma", "registers"):
        o, lse, plan = testing.attention_forward_with(
            KernelChoice(o_store=store), q, k, v, causal=causal, layout=layout
        )
        spec = plan.runs.aligned.launch.spec
        assert spec.path == "tma" and spec.o_via_tma == (store == "tma" and head_dim in (64, 128))
        results[store] = (o, lse)
    (o_staged, lse_staged), (o_direct, lse_direct) = results["tma"], results["registers"]
    assert not torch.isnan(o_staged).any() and torch.equal(o_staged, o_direct)
    assert torch.equal(lse_staged, lse_direct)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("path", ["wgmma", "mma"])
def test_every_hopper_path_agrees_with_the_reference(head_dim, path):
    # The same calls through the kernels a TMA-readable call does not take by default (an
    # explicit choice of path), forward and backward, against the float64 reference. d = 256 has
    # no wgmma backward: mma.sync serves it.
    for causal in (False, True):
        case = Case(2, 2, 2, 333, 517, head_dim, "float16", "bshd", causal, None, "views", 13)
        fwd, bwd = check_case(case, "explicit paths", KernelChoice(path=path))
        assert fwd.runs.aligned.launch.spec.path == path
        backward_path = "mma" if head_dim == 256 else path
        assert bwd.dq.aligned.launch.spec.path == bwd.dkdv.aligned.launch.spec.path == backward_path


@pytest.mark.parametrize(
    "head_dim,tiles",
    [(40, (128, 128, 2)), (128, None), (128, (128, 160, 2)), (256, None), (64, (192, 64, 2))],
)
@pytest.mark.parametrize(
    "seq_q,seq_k,causal,window,softcap,alibi",
    [
        (333, 517, False, None, None, None),
        (1000, 1000, True, None, None, None),
        (517, 900, True, (200, 0), None, None),
        (300, 300, False, None, 20.0, "head"),
        (64, 1, False, None, None, None),  # one key tile
    ],
)
def test_every_forward_schedule_gives_the_same_bits(
    head_dim, tiles, seq_q, seq_k, causal, window, softcap, alibi
):
    # The TMA forward's key-tile loops (kernels_cu/forward_sm90_tma.cu, SCHEDULE) run the same
    # arithmetic in the same order per element (the rescale of O before each P V product, the
    # products' accumulation, the rows' finish: d = 128's 160-key tiles by the MUFU, under the
    # last P V where pipelined), only at other times: serial, pipelined ("overlap") and pipelined
    # with turns at the tensor cores give the same bits, and the library's choice passes the
    # policy against the float64 reference. Outputs start as NaN: an unwritten row fails.
    case = Case(
        2,
        2,
        2,
        seq_q,
        seq_k,
        head_dim,
        "bfloat16",
        "bshd",
        causal,
        None,
        "contiguous",
        17,
        window,
        softcap,
        alibi,
    )
    choice = KernelChoice(tiles=((("forward", "tma"), tiles),)) if tiles else _dispatch.DEFAULT
    check_case(case, "schedules", choice)
    q, k, v = inputs_of(case)
    gen = torch.Generator(device="cuda").manual_seed(3)
    slopes = torch.rand(case.heads_q, device="cuda", generator=gen) if alibi else None
    results = {}
    for schedule in _kernels.FORWARD_SCHEDULES:
        o, lse, plan = testing.attention_forward_with(
            KernelChoice(tiles=choice.tiles, schedule=schedule),
            q,
            k,
            v,
            causal=causal,
            window=window,
            softcap=softcap,
            alibi_slopes=slopes,
        )
        spec = plan.runs.aligned.launch.spec
        assert spec.path == "tma" and spec.schedule == schedule
        results[schedule] = (o, lse)
    o_serial, lse_serial = results["serial"]
    assert not torch.isnan(o_serial).any()
    for schedule, (o, lse) in results.items():
        assert torch.equal(o, o_serial) and torch.equal(lse, lse_serial), schedule


@pytest.mark.parametrize(
    "batch,heads,seq,head_dim,causal,window",
    [
        (1, 16, 2100, 128, True, (700, 0)),  # the first blocks cheap, the rest alike
        (2, 5, 1500, 64, False, (300, 200)),  # two-sided: cheap blocks at both ends
        (3, 3, 900, 256, True, (250, 0)),  # d = 256: the split dQ kernel too
        (1, 40, 700, 128, True, (130, 0)),  # more heads than a chunk, a partial last chunk
    ],
)
def test_every_walk_gives_the_same_bits(batch, heads, seq, head_dim, causal, window):
    # The persistent kernels' order of work items (cuflash/_dispatch.py, walk_heads; the
    # TMA forward and the split dQ kernel): decode_paired_work's and the block-major order over
    # chunks of 1, 3 and 16 heads visit every item once (an unwritten row of O or dQ keeps its
    # NaN poison, a repeated one races) and compute each alike, so they give the same bits; the
    # library's choice passes the policy against the float64 reference.
    case = Case(batch, heads, heads, seq, seq, head_dim, "bfloat16", "bshd", causal, None,
                "contiguous", 29, window)  # fmt: skip
    check_case(case, "walks")
    q, k, v = inputs_of(case)
    do = torch.randn_like(q)
    results = {}
    for chunk in (0, 1, 3, 16):
        choice = KernelChoice(walk_heads=chunk)
        o, lse, fwd = testing.attention_forward_with(choice, q, k, v, causal=causal, window=window)
        assert fwd.runs.aligned.launch.walk_heads == chunk
        dq, dk, dv, bwd = testing.attention_backward_with(
            choice, do, q, k, v, o, lse, causal=causal, window=window
        )
        if head_dim == 256:  # the split kernels: dQ walks the same order
            dq_launch = bwd.dq.aligned.launch
            assert dq_launch.spec.path == "tma" and dq_launch.walk_heads == chunk
        results[chunk] = (o, lse, dq, dk, dv)
    assert not torch.isnan(results[0][0]).any() and not torch.isnan(results[0][2]).any()
    names = ("o", "lse", "dq", "dk", "dv")
    for chunk, tensors in results.items():
        differ = {
            name: int((a != b).sum())  # NaN differs from everything, itself included
            for name, a, b in zip(names, tensors, results[0], strict=True)
            if not torch.equal(a, b)
        }
        assert not differ, f"walk_heads={chunk} against 0: elements that differ {differ}"
