"""The one dispatch point (cuflash/_dispatch.py), on the CPU: which kernels a call gets on each
architecture for aligned and unaligned arrays, the persistent kernels' work lists, and the
explicit choices that tests and benchmarks make."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_params import problem

from cuflash import _dispatch, _kernels
from cuflash._dispatch import KernelChoice


def strides_of(p, pad: int = 0) -> dict:
    """Contiguous bshd strides for every tensor of p (each row padded by `pad` elements)."""
    d = p.head_dim + pad
    q = (p.seq_q * p.heads_q * d, d, p.heads_q * d)
    kv = (p.seq_k * p.heads_kv * d, d, p.heads_kv * d)
    lse = (p.heads_q * p.seq_q, p.seq_q, 1)
    return {
        "q": q,
        "o": q,
        "dout": q,
        "dq": q,
        "k": kv,
        "v": kv,
        "dk": kv,
        "dv": kv,
        "lse": lse,
        "delta": lse,
    }


def test_a_choice_picks_the_tma_forwards_loop():
    p = problem(head_dim=128, window=(None, None))
    for loop in (None, *_kernels.FORWARD_SCHEDULES):
        pair = _dispatch.forward(p, strides_of(p), "sm_90a", 132, KernelChoice(schedule=loop))
        assert pair.aligned.spec.schedule == (loop or "turns")
        assert pair.unaligned.spec.schedule == ""  # the wgmma kernel has one loop


def test_forward_paths_by_architecture_and_strides():
    p = problem(head_dim=128, window=(None, None))
    pair = _dispatch.forward(p, strides_of(p), "sm_90a", 132)
    assert pair.aligned.spec.path == "tma" and pair.aligned.vec
    assert pair.unaligned.spec.path == "wgmma" and not pair.unaligned.vec
    assert pair.aligned.spec.o_via_tma  # d = 128 fills its bucket: O through TMA stores
    assert [name for name, _ in pair.aligned.maps] == ["q", "k", "v", "o"]
    # rows of 129 elements: no 16-byte chunks, no TMA, wgmma for any pointers
    odd = _dispatch.forward(p, strides_of(p, pad=1), "sm_90a", 132)
    assert odd.aligned.spec.path == odd.unaligned.spec.path == "wgmma" and not odd.aligned.vec
    # sm_80: mma.sync, 16-byte copies where the pointers allow them
    ampere = _dispatch.forward(p, strides_of(p), "sm_80", 108)
    assert ampere.aligned.spec.path == ampere.unaligned.spec.path == "mma"
    assert ampere.aligned.vec and not ampere.unaligned.vec
    # float32: the exact path everywhere
    exact = problem(dtype="float32", head_dim=128)
    assert _dispatch.forward(exact, strides_of(exact), "sm_90a", 132).aligned.spec.path == "exact"
    # d = 120 takes the TMA forward of bucket 128, writing O from registers (partial boxes)
    short = problem(head_dim=120)
    pair = _dispatch.forward(short, strides_of(short), "sm_90a", 132)
    assert pair.aligned.spec.path == "tma" and not pair.aligned.spec.o_via_tma
    assert [name for name, _ in pair.aligned.maps] == ["q", "k", "v", "q"]  # q stands in for o


def test_forward_work_list():
    for window, paired in (((None, None), False), ((None, 0), True)):
        p = problem(seq_q=1000, seq_k=1000, head_dim=64, window=window)
        launch = _dispatch.forward(p, strides_of(p), "sm_90a", 132).aligned
        bm = launch.spec.rows_per_block
        slots, shift = _dispatch.row_slots(1000, bm, end_aligned=paired)
        assert (launch.num_blocks, launch.row_shift, launch.paired) == (slots, shift, paired)
        assert launch.num_work == slots * p.batch * p.heads_q
        assert launch.grid == min(-(-launch.num_work // (2 if paired else 1)), 132)
    # long sequences take the taller tiles at d = 64, longer key tiles at d = 128 (O from
    # registers there)
    p = problem(seq_q=4096, seq_k=4096, head_dim=64)
    assert _dispatch.forward(p, strides_of(p), "sm_90a", 132).aligned.spec.rows_per_block == 192
    for seq_q, tiles in ((4095, (128, 128)), (4096, (128, 160))):
        for alibi in (False, True):  # ALiBi too since v33 (its one-sided form)
            p = problem(seq_q=seq_q, seq_k=4096, head_dim=128, alibi=alibi)
            spec = _dispatch.forward(p, strides_of(p), "sm_90a", 132).aligned.spec
            assert (spec.rows_per_block, spec.rows_per_step) == tiles
            assert spec.o_via_tma == (tiles[1] == 128)
            assert spec.features == (_kernels.FEATURE_ALIBI if alibi else 0)


def test_forward_splits_a_last_row_block_that_fits_one_warpgroup():
    # d = 64's 192-row tiles (three consumers, the serial loop) split each head's last block by
    # keys where its rows fit one consumer (kernels_cu/forward_sm90_tma.cu, SPLIT_LAST):
    # start-aligned blocks only, and not with a window, packed sequences or softcap with ALiBi
    def launch_of(seq_q, window=(None, None), **kw):
        p = problem(seq_q=seq_q, seq_k=seq_q, head_dim=64, window=window, **kw)
        return _dispatch.forward(p, strides_of(p), "sm_90a", 132).aligned

    cases = ((1024, True), (4096, True), (16384, True), (1100, False), (1200, True), (1300, False))
    for seq_q, split in cases:
        launch = launch_of(seq_q)
        assert launch.spec.rows_per_block == 192 and launch.split_last == split, seq_q
        assert launch.params_fields()["split_last"] == int(split)
    for seq_q in (1152, 2048, 8192):  # no partial block, or one of 128 rows
        assert not launch_of(seq_q).split_last
    assert not launch_of(1024, window=(None, 0)).split_last  # causal: the partial block first
    assert not launch_of(1024, window=(300, 200)).split_last
    assert launch_of(1024, softcap=30.0).split_last and launch_of(1024, alibi=True).split_last
    assert not launch_of(1024, softcap=30.0, alibi=True).split_last
    # below 1024 rows the 128-row tiles (two consumers) serve; an explicit serial (192, 128)
    # instance splits, the same tiles with turns do not, and the split instance holds the
    # partial rows' area (two consumers' O, max, sum and repair bits)
    assert not launch_of(1000 - 64).split_last
    serial, turns = (
        _kernels.instance("forward", "tma", "bfloat16", 64, (192, 128, 2), 0, True, loop)
        for loop in ("serial", "turns")
    )
    assert _kernels.splits_last_block(serial) and not _kernels.splits_last_block(turns)
    plain = _kernels.instance("forward", "tma", "bfloat16", 64, (192, 128, 2), 1, True, "serial")
    assert serial.smem_bytes - plain.smem_bytes == 2 * 128 * (64 // 2 + 5) * 4


def test_backward_launches():
    p = problem(head_dim=64)
    chosen = _dispatch.backward(p, strides_of(p), "sm_90a", 132)
    assert chosen.dkdv.aligned.spec.path == chosen.dq.aligned.spec.path == "tma"
    assert chosen.dkdv.unaligned.spec.path == chosen.dq.unaligned.spec.path == "wgmma"
    assert chosen.dkdv.aligned.num_blocks == -(-p.seq_k // chosen.dkdv.aligned.spec.rows_per_block)
    assert chosen.dkdv.aligned.paired  # causal
    # D = rowsum(dO * O): 8 lanes of 16-byte chunks per row at d = 64, a warp per row otherwise
    assert chosen.preprocess.aligned.lanes_per_row == 8 and chosen.preprocess.aligned.vec
    assert chosen.preprocess.unaligned.lanes_per_row == 32
    assert chosen.preprocess.aligned.grid == -(-p.rows_q // (8 * 4))
    # d = 256 backward: TMA kernels aligned, mma.sync otherwise (no wgmma instance)
    wide = problem(head_dim=256)
    chosen = _dispatch.backward(wide, strides_of(wide), "sm_90a", 132)
    assert (chosen.dq.aligned.spec.path, chosen.dq.unaligned.spec.path) == ("tma", "mma")


def test_explicit_choices():
    p = problem(head_dim=64, seq_q=4096, seq_k=4096)
    strides = strides_of(p)
    # the fastest path allowed; a family without it takes the next one
    pair = _dispatch.forward(p, strides, "sm_90a", 132, KernelChoice(path="wgmma"))
    assert pair.aligned.spec.path == pair.unaligned.spec.path == "wgmma"
    pair = _dispatch.forward(p, strides, "sm_90a", 132, KernelChoice(path="mma"))
    assert pair.aligned.spec.path == "mma"
    wide = problem(head_dim=256)
    chosen = _dispatch.backward(wide, strides_of(wide), "sm_90a", 132, KernelChoice(path="wgmma"))
    assert chosen.dq.aligned.spec.path == "mma"
    # tiles of one (family, path)
    tiles = KernelChoice(tiles=((("forward", "tma"), (128, 128, 2)),))
    assert _dispatch.forward(p, strides, "sm_90a", 132, tiles).aligned.spec.rows_per_block == 128
    # O from registers
    pair = _dispatch.forward(p, strides, "sm_90a", 132, KernelChoice(o_store="registers"))
    assert pair.aligned.spec.path == "tma" and not pair.aligned.spec.o_via_tma


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_every_chosen_instance_is_compile_checked(dtype):
    from cuflash import _kernels

    for arch in ("sm_80", "sm_90a"):
        checked = {s.name_expression for s in _kernels.all_specs(arch)}
        for d in (8, 40, 64, 100, 128, 200, 256):
            for seq in (100, 4096):
                for window in ((None, None), (None, 0)):
                    p = problem(dtype=dtype, head_dim=d, seq_q=seq, seq_k=seq, window=window)
                    for pad in (0, 1):
                        strides = strides_of(p, pad)
                        pair = _dispatch.forward(p, strides, arch, 132)
                        chosen = _dispatch.backward(p, strides, arch, 132)
                        launches = [pair.aligned, pair.unaligned]
                        for fam in (chosen.preprocess, chosen.dkdv, chosen.dq):
                            launches += [fam.aligned, fam.unaligned]
                        for launch in launches:
                            assert launch.spec.name_expression in checked, launch.spec


def test_features_of_a_problem_pick_the_instances():
    from cuflash import _kernels

    dense = problem(head_dim=128, window=(None, 0))
    assert _dispatch.features(dense) == 0  # causal: the right bound is in every instance
    window = problem(head_dim=128, window=(100, 0))
    assert _dispatch.features(window) == _kernels.FEATURE_LOCAL
    wide = problem(head_dim=128, seq_q=50, seq_k=60, window=(110, 0))  # wider than both
    assert _dispatch.features(wide) == 0
    mods = problem(head_dim=128, window=(100, 3), softcap=30.0, alibi=True)
    assert _dispatch.features(mods) == 7
    # windows take the fused backward at d = 128 and the split TMA kernels where asked; so do the
    # softcap (since v29: with tanh as one MUFU operation the Hopper backward kernels have the
    # registers for it) and the softcap with every other modifier; ALiBi takes the fused backward
    # at d = 128 (the split TMA kernels where asked) and at d = 64 (the wgmma kernels where the
    # split ones are asked)
    alibi = problem(head_dim=128, alibi=True, window=(None, None))
    launches = _dispatch.backward(alibi, strides_of(alibi), "sm_90a", 132)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "fused"
    assert launches.dkdv.aligned.spec.features == launches.dq.aligned.spec.features == 4
    split = KernelChoice(backward="split")
    launches = _dispatch.backward(alibi, strides_of(alibi), "sm_90a", 132, split)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "tma"
    alibi = problem(head_dim=128, alibi=True)  # causal, grouped heads
    launches = _dispatch.backward(alibi, strides_of(alibi), "sm_90a", 132)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "fused"
    assert launches.dkdv.aligned.spec.schedule == "bounded"
    alibi = problem(head_dim=64, alibi=True)  # the split TMA dK/dV kernel spills: fused
    launches = _dispatch.backward(alibi, strides_of(alibi), "sm_90a", 132)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "fused"
    launches = _dispatch.backward(alibi, strides_of(alibi), "sm_90a", 132, split)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "wgmma"
    launches = _dispatch.backward(window, strides_of(window), "sm_90a", 132)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "fused"
    assert launches.dq.aligned.spec.features == _kernels.FEATURE_LOCAL
    launches = _dispatch.backward(window, strides_of(window), "sm_90a", 132, split)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "tma"
    assert launches.dq.aligned.spec.features == _kernels.FEATURE_LOCAL
    launches = _dispatch.backward(mods, strides_of(mods), "sm_90a", 132)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "fused"
    assert launches.dkdv.aligned.spec.features == 7
    launches = _dispatch.backward(mods, strides_of(mods), "sm_90a", 132, split)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "tma"
    capped = problem(head_dim=64, softcap=30.0, window=(None, None))
    launches = _dispatch.backward(capped, strides_of(capped), "sm_90a", 132)
    assert launches.dkdv.aligned.spec.path == launches.dq.aligned.spec.path == "fused"
    assert launches.dkdv.aligned.spec.features == _kernels.FEATURE_SOFTCAP
    pair = _dispatch.forward(mods, strides_of(mods), "sm_90a", 132)
    assert pair.aligned.spec.path == "tma" and pair.aligned.spec.features == 7
    assert pair.unaligned.spec.path == "wgmma" and pair.unaligned.spec.features == 7


def test_packed_calls_take_the_tma_forward_over_the_packed_tensors():
    """A packed call (q (Tq, Hq, d), k and v (Tk, Hkv, d)) on Hopper: the TMA forward, its maps
    covering the packed tensors as one sequence, one work slot per row block of the longest
    sequence, slots of the longest sequence's blocks, end-aligned per sequence under causal
    masking; the backward on the TMA kernels too, over the same maps, paired under causal
    masking. Each launch walks a list that a build_work_list launch writes before it, within a
    capacity for any well-formed offsets, at its own place in the plan's workspace."""
    p = problem(
        batch=5, seq_q=2100, seq_k=3000, head_dim=64, packed=True, total_q=5000, total_k=7000
    )
    d = p.head_dim
    q, kv = (0, d, p.heads_q * d), (0, d, p.heads_kv * d)
    strides = dict(strides_of(p), q=q, o=q, dout=q, dq=q, k=kv, v=kv, dk=kv, dv=kv)
    assert p.map_shape("q") == (64, 5000, 8, 1) and p.map_shape("v") == (64, 7000, 2, 1)
    pair = _dispatch.forward(p, strides, "sm_90a", 132)
    spec = pair.aligned.spec
    assert spec.path == "tma" and spec.features & _kernels.FEATURE_PACKED
    assert spec.rows_per_block == 192  # the long sequences' tiles (2100 rows)
    assert pair.aligned.paired and pair.aligned.num_blocks == 12  # 11 blocks, even: end-aligned
    # capacity: every head's blocks of 192 rows of 5000, one partial and one filler a sequence
    assert pair.aligned.num_work == 8 * (27 + 2 * 5) and pair.aligned.grid == 132
    builder = pair.aligned.builder
    assert builder.spec == _kernels.work_list_instance() and builder.grid == 1
    assert builder.num_work == pair.aligned.num_work and builder.paired
    assert dict(builder.sizes) == dict(
        list_rows=192, list_cost_rows=128, list_heads=8, list_flags=2, list_base=0
    )
    assert dict(pair.aligned.sizes) == {"list_base": 0}
    assert pair.unaligned.builder is None
    assert _dispatch.work_list_bytes(p, "forward") == 32 * (1 + 8 * (79 + 10))
    alibi = replace(p, alibi=True)
    assert _dispatch.forward(alibi, strides, "sm_90a", 132).aligned.spec.rows_per_block == 128
    launches = _dispatch.backward(p, strides, "sm_90a", 132)
    dkdv, dq = launches.dkdv.aligned, launches.dq.aligned
    assert dkdv.spec.path == dq.spec.path == "tma"
    assert dkdv.spec.features & dq.spec.features & _kernels.FEATURE_PACKED
    assert dkdv.paired and dq.paired
    assert dkdv.num_blocks == 24 and dkdv.num_work == 2 * (55 + 10)  # blocks of 128 keys
    assert dq.num_blocks == 18 and dq.num_work == 8 * (40 + 10)  # blocks of 128 rows
    assert dict(dkdv.builder.sizes)["list_flags"] == 1  # key blocks, from each sequence's start
    assert dict(dq.builder.sizes)["list_flags"] == 0
    # the workspace: dK/dV's list (its bound), then dQ's
    assert dict(dkdv.sizes) == {"list_base": 0}
    assert dict(dq.sizes) == {"list_base": 1 + 2 * (110 + 10)}
    assert _dispatch.work_list_bytes(p, "backward") == 32 * (1 + 2 * 120 + 1 + 8 * 89)
    assert dict(dq.maps) == {"q": 64, "k": 64, "v": 64, "dout": 64}
    assert launches.dq.unaligned.spec.path != "tma"
    # not causal: the block counts as they come, taken one at a time
    plain = _dispatch.backward(replace(p, window=(None, None)), strides, "sm_90a", 132)
    assert plain.dq.aligned.num_blocks == 17 and not plain.dq.aligned.paired
    # d = 64 with ALiBi: the TMA dK/dV kernel spills, so both take the cp.async kernels
    with_alibi = _dispatch.backward(alibi, strides, "sm_90a", 132)
    assert with_alibi.dkdv.aligned.spec.path != "tma" and with_alibi.dq.aligned.spec.path != "tma"


def test_the_fused_backward_serves_dense_and_causal_calls_at_d_128():
    p = problem(head_dim=128, seq_q=1000, seq_k=1024, window=(None, None))
    chosen = _dispatch.backward(p, strides_of(p), "sm_90a", 132)
    assert (chosen.dkdv.aligned.spec.path, chosen.dq.aligned.spec.path) == ("fused", "fused")
    assert chosen.dkdv.unaligned.spec.path == chosen.dq.unaligned.spec.path == "wgmma"
    assert chosen.dkdv.aligned.num_blocks == 1024 // 128 and not chosen.dkdv.aligned.paired
    tiles = -(-1000 // 64)
    assert chosen.dq.aligned.grid == p.batch * p.heads_q * tiles
    # the workspace: D, then a counter per (batch, query head, query tile: 64 rows at d = 128),
    # then the sums
    ws = _dispatch.backward_workspace(p)
    delta = p.batch * p.heads_q * p.seq_q * 4
    assert ws.semaphores >= delta and ws.accum >= ws.semaphores + 4 * p.batch * p.heads_q * tiles
    assert ws.nbytes == ws.accum + p.batch * p.heads_q * tiles * 64 * 128 * 4
    assert ws.semaphores % 256 == ws.accum % 256 == 0
    # an explicit choice of the split kernels, and other architectures
    split = _dispatch.backward(p, strides_of(p), "sm_90a", 132, KernelChoice(backward="split"))
    assert split.dkdv.aligned.spec.path == "tma"
    assert _dispatch.backward(p, strides_of(p), "sm_80", 132).dkdv.aligned.spec.path == "mma"
    # unaligned strides: no TMA, so no fused backward either
    assert _dispatch.backward(p, strides_of(p, 1), "sm_90a", 132).dkdv.aligned.spec.path != "fused"
    assert chosen.dkdv.aligned.spec.schedule == "rotated"
    assert chosen.dkdv.aligned.spec.name_expression.endswith("2, 0, 0>")
    # a partial last key block, and more key blocks than query steps under a right bound
    for change in (dict(seq_k=1000), dict(seq_q=64, seq_k=1024, window=(None, 0), heads_q=2)):
        assert _dispatch.fused_backward_fits(replace(p, **change))


@pytest.mark.parametrize(
    "window,heads_q",
    [((None, 0), 2), ((None, 5), 2), ((100, 0), 2), ((300, 20), 2), ((None, 0), 8), ((100, 3), 4)],
)
def test_the_fused_backward_takes_the_bounded_schedule_under_a_right_bound(window, heads_q):
    # heads_q / 2 KV heads: grouped heads too
    p = problem(head_dim=128, seq_q=1000, seq_k=1100, window=window, heads_q=heads_q)
    chosen = _dispatch.backward(p, strides_of(p), "sm_90a", 132)
    dkdv, dq = chosen.dkdv.aligned, chosen.dq.aligned
    assert (dkdv.spec.path, dq.spec.path) == ("fused", "fused")
    assert dkdv.spec.schedule == "bounded" and dkdv.paired
    local = _kernels.FEATURE_LOCAL if window[0] is not None else 0
    assert dkdv.spec.name_expression.endswith(f"2, 1, {local}>")
    assert dq.spec.name_expression.endswith(f", {local}>")
    assert _dispatch.backward_workspace(p).accum > 0


def test_the_fused_backward_at_d_64_leaves_causal_calls_with_more_keys_to_the_split_kernels():
    # where those are faster (fused 0.87-0.94x: _dispatch.fused_backward_chosen); an explicit
    # choice still gets the fused kernels, and the workspace follows the choice
    fused = KernelChoice(backward="fused")
    causal = problem(head_dim=64, seq_q=1000, seq_k=1100)
    assert _dispatch.fused_backward_fits(causal) and not _dispatch.fused_backward_chosen(causal)
    chosen = _dispatch.backward(causal, strides_of(causal), "sm_90a", 132)
    assert chosen.dkdv.aligned.spec.path == chosen.dq.aligned.spec.path == "tma"
    assert _dispatch.backward_workspace(causal).accum == 0
    asked = _dispatch.backward(causal, strides_of(causal), "sm_90a", 132, fused)
    assert asked.dkdv.aligned.spec.path == asked.dq.aligned.spec.path == "fused"
    assert _dispatch.backward_workspace(causal, fused).accum > 0
    # as many keys as queries, not causal, a window, ALiBi: fused
    changes = (dict(seq_k=1000), dict(window=(None, None)), dict(window=(200, 0)), dict(alibi=True))
    for change in changes:
        p = replace(causal, **change)
        assert _dispatch.fused_backward_chosen(p), change
        chosen = _dispatch.backward(p, strides_of(p), "sm_90a", 132)
        assert chosen.dkdv.aligned.spec.path == "fused", change
    # d = 128: causal calls too
    assert _dispatch.fused_backward_chosen(replace(causal, head_dim=128))
    # d = 256: without a right bound, and under a causal mask alone from 4096 query rows with no
    # more keys than queries (_dispatch.fused_backward_chosen); an explicit choice gets the fused
    # kernels under any bound
    wide = replace(causal, head_dim=256, seq_k=1000)
    assert _dispatch.fused_backward_fits(wide) and not _dispatch.fused_backward_chosen(wide)
    assert _dispatch.fused_backward_chosen(wide, fused)
    assert _dispatch.fused_backward_chosen(replace(wide, window=(None, None)))
    rows = _dispatch.FUSED_CAUSAL_ROWS_256
    long = replace(wide, seq_q=rows, seq_k=rows)
    assert _dispatch.fused_backward_chosen(long)
    assert _dispatch.fused_backward_chosen(replace(long, seq_k=rows - 1))
    for change in (
        dict(seq_q=rows - 1, seq_k=rows - 1),
        dict(seq_k=rows + 1),  # more keys than queries
        dict(alibi=True),
        dict(window=(500, 0)),
    ):
        assert not _dispatch.fused_backward_chosen(replace(long, **change)), change
        assert _dispatch.fused_backward_chosen(replace(long, **change), fused), change


@pytest.mark.parametrize(
    "change",
    [
        dict(window=(100, None)),  # a left bound alone
        dict(head_dim=256, softcap=30.0),  # d = 256's fused kernel lacks the softcap
        dict(head_dim=256, window=(300, 0), alibi=True),  # and a window with ALiBi
        dict(dtype="float32"),
        dict(seq_q=64, seq_k=1024),  # 8 key blocks, 1 query step a head, no bound
        dict(packed=True, total_q=1000, total_k=1024),
    ],
)
def test_the_fused_backward_leaves_the_other_calls(change):
    p = problem(**{"head_dim": 128, "seq_q": 1000, "seq_k": 1024, "window": (None, None), **change})
    assert not _dispatch.fused_backward_fits(p)
    assert _dispatch.backward_workspace(p).accum == 0
    chosen = _dispatch.backward(p, strides_of(p), "sm_90a", 132, KernelChoice(backward="fused"))
    assert chosen.dkdv.aligned.spec.path != "fused"


def fused_turns(item: int, n: int, tiles: int, steps: int, grid: int) -> tuple[list, list]:
    """The mirror of FusedDqOrder (kernels_cu/backward_sm90_fused.cu): an item's query step at each
    local step, and its turn at each query step."""
    base = item - item % n
    wave = item // grid
    lo, hi = max(base, wave * grid), min(base + n, (wave + 1) * grid)
    first, r, m = lo - base, item - lo, hi - lo
    span = tiles if m <= tiles else steps
    offset = r * span // m
    visits = [(offset + s) % steps for s in range(steps)]
    turns = []
    for q in range(steps):
        rq = min(m - 1, -(-(q + 1) * m // span) - 1)
        turns.append(first + (rq - r) % m)
    return visits, turns


@pytest.mark.parametrize(
    "n,tiles,group,grid,heads",
    [
        (1, 1, 1, 132, 3),
        (3, 5, 1, 132, 2),
        (47, 94, 1, 132, 3),
        (157, 40, 4, 132, 1),  # more items than a head's tiles: spread over every step
        (8, 16, 4, 132, 130),
        (8, 8, 1, 3, 4),
        (16, 40, 2, 7, 5),
        (5, 5, 3, 5, 2),
        (32, 64, 8, 100, 9),
    ],
)
def test_the_fused_backwards_turns_are_a_schedule_without_waits_on_later_work(
    n, tiles, group, grid, heads
):
    # Items heads x n, item i at step i // grid of its block. For every query step of every head:
    # the turns are 0 .. n - 1, and the item before each turn adds at an earlier (wave, local step),
    # so that the wait always ends.
    steps = group * tiles
    for head in range(heads):
        items = range(head * n, (head + 1) * n)
        schedule = {i: fused_turns(i, n, tiles, steps, grid) for i in items}
        for visits, _ in schedule.values():
            assert sorted(visits) == list(range(steps))
        for q in range(steps):
            by_turn = sorted(items, key=lambda i: schedule[i][1][q])
            assert [schedule[i][1][q] for i in by_turn] == list(range(n))
            when = [(i // grid, schedule[i][0].index(q)) for i in by_turn]
            assert when == sorted(when) and len(set(when)) == n


def paired_block(pos: int, n: int) -> int:
    """The key block at position `pos` of a head's n items (decode_paired_work)."""
    return (pos >> 1) if pos & 1 else n - 1 - (pos >> 1)


def round_positions(item: int, n: int, grid: int, paired: bool) -> tuple[int, int, int]:
    """(base, lo, hi): the first item of `item`'s head and the head's positions [lo, hi) in the
    item's round of the walk (FusedBoundedOrder::of)."""
    round_items = 2 * grid if paired else grid
    base, round0 = item - item % n, item // round_items * round_items
    return base, max(round0 - base, 0), min(round0 + round_items - base, n)


def bounded_turn(
    item: int, n: int, grid: int, paired: bool, rising: bool, block: int, jlo: int, jhi: int
) -> int:
    """The mirror of FusedBoundedOrder::turn (kernels_cu/backward_sm90_fused.cu); `rising`: the
    kernel's second_rising (grouped heads, no left bound nearer than half the keys)."""
    base, lo, hi = round_positions(item, n, grid, paired)
    parity = (item - base) & 1 if paired else -1
    first_parity = base & 1
    rising = rising and paired and parity != first_parity

    def blocks_in(a, b, par, jl, jh):
        # positions in [a, b) of parity par whose key block (decode_paired_work) is in [jl, jh]
        counted = sum(
            1
            for pos in range(a, b)
            if (par < 0 or pos & 1 == par) and jl <= paired_block(pos, n) <= jh
        )

        # the kernel's closed form
        def overlap(a0, a1, b0, b1):
            return max(0, min(a1, b1) - max(a0, b0))

        closed = overlap((a + 1) >> 1, (b + 1) >> 1, n - 1 - jh, n - jl) if par != 1 else 0
        closed += overlap(a >> 1, b >> 1, jl, jh + 1) if par != 0 else 0
        assert closed == counted
        return counted

    t = blocks_in(0, lo, -1, jlo, jhi)
    if parity >= 0 and parity != first_parity:
        t += blocks_in(lo, hi, first_parity, jlo, jhi)
    if rising:
        return t + blocks_in(lo, hi, parity, jlo, min(jhi, block - 1))
    return t + blocks_in(lo, hi, parity, max(jlo, block + 1), jhi)


def kernels_rising(mask, group: int) -> bool:
    """FusedSteps<true, LOCAL>::of's second_rising: grouped heads, no left bound nearer than half
    the keys."""
    return group > 1 and mask.left >= mask.nk - mask.left


def arrival_turn(
    item: int,
    n: int,
    grid: int,
    paired: bool,
    mask,
    group: int,
    bm: int,
    head: int,
    tile: int,
    bn: int = 128,
) -> int:
    """The mirror of FusedArrivalOrder::turn (kernels_cu/backward_sm90_fused.cu): the additions to
    query tile `tile` of head `head` (of the group) before `item`'s. Those of earlier rounds, then
    this round's in the order of their expected visits (start + step, ties by position), the
    second step's items starting after their SM's first item (+ 1) and visiting their lists from
    the end."""
    base, lo, hi = round_positions(item, n, grid, paired)
    pos, first_parity = item - base, base & 1

    def block_at(at):
        return paired_block(at, n)

    def arrival(at):
        t = mask.query_tiles(block_at(at) * bn, bn, bm)
        s = head * t.count + (tile - t.begin)
        if not paired or at & 1 == first_parity:
            return s
        first = block_at(at - 1 if at > 0 else n - 1)
        return group * mask.query_tiles(first * bn, bn, bm).count + 1 + (group * t.count - 1 - s)

    keys = mask.key_tiles(tile * bm, bm, bn)
    jlo, jhi = keys.begin, keys.end - 1
    earlier = sum(1 for at in range(lo) if jlo <= block_at(at) <= jhi)
    mine = (arrival(pos), pos)
    return earlier + sum(
        1
        for at in range(lo, hi)
        if at != pos and jlo <= block_at(at) <= jhi and (arrival(at), at) < mine
    )


def kernels_arrival(mask, bm: int, bn: int = 128) -> bool:
    """attention_backward_fused_tma's ARRIVAL for a mask without score modifiers: query tiles as
    tall as the key blocks are wide (d = 64's 128-row tiles, d = 256's 64-row ones), no left
    bound."""
    return bm == bn and not mask.local


# The fused kernel's (query tile rows, key block) pairs (_kernels.FUSED_ROWS, FUSED_BN).
FUSED_SHAPES = sorted(
    {(bm, _kernels.FUSED_BN[hd]) for hd, rows in _kernels.FUSED_ROWS.items() for bm in rows}
)


def bounded_walk(nq, nk, bounds, group, heads, grid, rising=None, bm=64, arrival=None, bn=128):
    """The fused kernel's bounded walk (common.cuh, WorkWalk, paired) with query tiles of `bm`
    rows, each block's items in walk order, an item being the (query tile, turn) of each of its
    steps: the lists (ascending query tiles of the block's rows, head by head; with the arrival
    order, from the end at a round's second step) and the turns. `rising`, `arrival`: None for
    the kernel's choice (kernels_rising, kernels_arrival), else forced (to show what the other
    order does)."""
    from cuflash._mask import Mask

    mask = Mask.of(nq, nk, bounds)
    n = -(-nk // bn)
    num_work = heads * n
    if rising is None:
        rising = kernels_rising(mask, group)
    if arrival is None:
        arrival = kernels_arrival(mask, bm, bn)

    def steps_of(item):
        block = paired_block(item % n, n)
        t = mask.query_tiles(block * bn, bn, bm)
        out = []
        for h in range(group):
            for q in range(t.begin, t.end):
                keys = mask.key_tiles(q * bm, bm, bn)
                assert keys.begin <= block < keys.end
                tile = ((item // n) * group + h, q)
                if arrival:
                    turn = arrival_turn(item, n, grid, True, mask, group, bm, h, q, bn)
                else:
                    turn = bounded_turn(
                        item, n, grid, True, rising, block, keys.begin, keys.end - 1
                    )
                out.append((tile, turn))
        return out[::-1] if arrival and item & 1 else out

    walks = []
    for b in range(grid):
        walk, step = [], 0
        while 2 * grid * (step >> 1) < num_work:
            item = 2 * grid * (step >> 1) + 2 * b + (step & 1)
            if item < num_work:
                walk.append(steps_of(item))
            step += 1
        walks.append(walk)
    return mask, walks


@pytest.mark.parametrize(
    "nq,nk,right,group,heads,grid",  # right: the right bound, or a window (left, right)
    [
        (1000, 1000, 0, 1, 3, 132),  # causal
        (1000, 1000, 0, 4, 2, 7),
        (512, 1100, 0, 2, 5, 6),  # more keys than queries: the first blocks see every row
        (1100, 300, 0, 1, 4, 3),  # more queries: the first rows see no key
        (700, 700, 130, 3, 3, 5),  # a right bound past the diagonal
        (64, 1024, 0, 1, 9, 4),  # one query tile, eight key blocks
        (257, 129, 0, 2, 7, 132),  # partial blocks and tiles
        (1000, 1000, (300, 0), 1, 3, 5),  # sliding windows
        (700, 900, (90, 40), 2, 2, 4),
        (2000, 600, (64, 0), 1, 5, 7),  # rows that see no key at both ends
        (1500, 1500, 0, 8, 3, 11),  # grouped heads, odd key blocks a head (rounds split heads)
    ],
)
@pytest.mark.parametrize("bm,bn", FUSED_SHAPES)
def test_the_fused_backwards_bounded_turns_end_and_order_every_tile(
    nq, nk, right, group, heads, grid, bm, bn
):
    # The kernel's walk run step by step: every turn of a tile comes once, every wait ends, and
    # the tiles that get sums are those the dQ pass reads (key_tiles(...).count > 0).
    bounds = right if isinstance(right, tuple) else (None, right)
    mask, walks = bounded_walk(nq, nk, bounds, group, heads, grid, bm=bm, bn=bn)
    queues = [[step for item in walk for step in item] for walk in walks]
    tiles_q = -(-nq // bm)
    turns = {}
    for walk in queues:
        for tile, turn in walk:
            turns.setdefault(tile, []).append(turn)
    for tile, got in turns.items():
        assert sorted(got) == list(range(len(got))), tile
    reached = {
        (hq, q)
        for hq in range(heads * group)
        for q in range(tiles_q)
        if mask.key_tiles(q * bm, bm, bn).count > 0
    }
    assert set(turns) == reached
    counters = dict.fromkeys(turns, 0)
    at = [0] * grid
    while any(at[b] < len(queues[b]) for b in range(grid)):
        moved = False
        for b in range(grid):
            while at[b] < len(queues[b]) and counters[queues[b][at[b]][0]] == queues[b][at[b]][1]:
                counters[queues[b][at[b]][0]] += 1
                at[b] += 1
                moved = True
        assert moved, "a wait that never ends"


def walk_time(walks, turns: bool = True, add: float = 0.15, epilogue: float = 1.0) -> float:
    """A timing model of the fused kernel: every query step takes 1, the writer's addition `add`
    after the step is staged, in its turn (turns=False: as if nobody waited); the consumers stage a
    step once the writer has taken the last one, and finish an item with an epilogue. The time
    the last block ends."""
    done = {}  # (tile, turn): when that addition ended
    clocks = [[0.0, 0.0, 0, 0] for _ in walks]  # consumers' time, writer's time, item, step
    left = sum(1 for walk in walks if walk)
    while left:
        moved = False
        for b, walk in enumerate(walks):
            c = clocks[b]
            while c[2] < len(walk):
                if not walk[c[2]]:  # a key block that no query sees: the epilogue alone
                    c[2], c[0] = c[2] + 1, c[0] + epilogue
                    moved = True
                    left -= c[2] == len(walk)
                    continue
                tile, turn = walk[c[2]][c[3]]
                ready = 0.0
                if turns and turn > 0:
                    if (tile, turn - 1) not in done:
                        break
                    ready = done[(tile, turn - 1)]
                staged = max(c[0] + 1.0, c[1])
                c[0], c[1] = staged, max(staged, ready) + add
                done[(tile, turn)] = c[1]
                c[3] += 1
                if c[3] == len(walk[c[2]]):
                    c[2], c[3], c[0] = c[2] + 1, 0, c[0] + epilogue
                moved = True
                if c[2] == len(walk):
                    left -= 1
        assert moved or not left, "a wait that never ends"
    return max(max(c[0], c[1]) for c in clocks)


@pytest.mark.parametrize(
    "nq,nk,bounds,group,heads,grid,other",
    [
        (2048, 2048, (None, 0), 4, 8, 64, 1.3),  # causal, 32 / 8 heads
        (2000, 2000, (None, 0), 2, 3, 12, 1.1),  # odd key blocks a head
        (1024, 1024, (None, 0), 8, 4, 16, 1.25),
        (1000, 1000, (None, 40), 3, 4, 16, 1.15),  # a right bound past the diagonal
        (2048, 2048, (1500, 0), 4, 8, 64, 1.15),  # a window wider than half the keys
        (2048, 2048, (511, 0), 4, 8, 64, 1.05),  # narrower ones
        (2048, 2048, (255, 255), 4, 8, 64, 1.1),
        (2048, 2048, (None, 0), 1, 8, 64, None),  # one head a group: either order
    ],
)
@pytest.mark.parametrize("bm,bn", FUSED_SHAPES)
def test_the_bounded_turns_follow_the_items_arrival(
    nq, nk, bounds, group, heads, grid, other, bm, bn
):
    # With the turns as the kernel takes them the walk ends within 2% of the same walk without
    # turns (nobody waits long), with query tiles of either height and key blocks of either width;
    # with grouped heads, the other order at the second step makes items wait: `other` x the walk
    # without turns, at least (the factors of 64-row tiles and 128-key blocks; 128-row ones:
    # within 0.05 of them).
    mask, walks = bounded_walk(nq, nk, bounds, group, heads, grid, bm=bm, bn=bn)
    free = walk_time(walks, turns=False)
    assert walk_time(walks) <= 1.02 * free
    if (bm, bn) != (64, 128):
        return
    rising = kernels_rising(mask, group)
    _, flipped = bounded_walk(nq, nk, bounds, group, heads, grid, rising=not rising)
    if other is None:
        assert walk_time(flipped) <= 1.02 * free
    else:
        assert walk_time(flipped) >= other * free


def test_the_arrival_order_keeps_a_slow_writer_off_the_consumers():
    # 128-row query tiles (d = 64), causal, one head a group, additions of 0.6 of a step (the
    # writer's round trip as the H200's d = 64 causal backward measured it: docs/perf/NOTES.md,
    # v38). In ascending order every item of a round's second step reaches each tile at once and
    # their additions queue; from the end (FusedArrivalOrder) they come a tile apart.
    nq, heads, grid = 2048, 32, 33
    _, walks = bounded_walk(nq, nq, (None, 0), 1, heads, grid, bm=128)
    _, ascending = bounded_walk(nq, nq, (None, 0), 1, heads, grid, bm=128, arrival=False)
    free = walk_time(walks, turns=False, add=0.6)
    assert walk_time(walks, add=0.6) <= 1.05 * free
    assert walk_time(ascending, add=0.6) >= walk_time(walks, add=0.6) + 0.04 * free


def test_the_fused_dkdv_kernels_tiles_come_from_the_table_or_the_choice():
    def tiles_of(spec):  # (BM, stages) of attention_backward_fused_tma<Elem, HD, BM, BN, ...>
        args = spec.name_expression.split(", ")
        return int(args[2]), int(args[4])

    tiles = {
        (hd, features): tiles_of(
            _kernels.instance("dkdv", "fused", "bfloat16", hd, None, features, schedule="bounded")
        )
        for hd in (64, 128)
        for features in (0, 1, 2, 4)  # none, LOCAL, SOFTCAP, ALIBI
    }
    # _kernels.FUSED_TILES: 128-row query tiles at d = 64, 64-row ones at d = 128
    assert {tiles[(64, f)] for f in (0, 1, 2, 4)} == {(128, 2)}
    assert {tiles[(128, f)] for f in (0, 1, 2, 4)} == {(64, 2)}
    p = problem(head_dim=128, seq_q=1000, seq_k=1000)
    three = KernelChoice(tiles=((("dkdv", "fused"), (64, 128, 3)),))
    chosen = _dispatch.backward(p, strides_of(p), "sm_90a", 132, three)
    assert tiles_of(chosen.dkdv.aligned.spec) == (64, 3)
    # other tiles than (64 or 128 at d = 64, 64 at d = 128; 128), stages past 2-4, or more shared
    # memory than sm_90 has: refused
    refused = (
        (128, (64, 64, 2)),
        (64, (64, 128, 5)),
        (128, (64, 128, 4)),
        (128, (128, 128, 2)),
        (64, (128, 128, 3)),
        (64, (96, 128, 2)),
    )
    for hd, tiles in refused:
        with pytest.raises(ValueError, match="fused dK/dV tiles"):
            _kernels.instance("dkdv", "fused", "bfloat16", hd, tiles, schedule="bounded")


@pytest.mark.parametrize(
    "head_dim,features,bm",
    [
        (64, 0, 128),
        (64, 1, 128),
        (64, 2, 128),
        (64, 4, 128),
        (64, 6, 128),  # the softcap with ALiBi, no bound
        (128, 0, 64),
        (128, 2, 64),
    ],
)
@pytest.mark.parametrize("seq", [1, 200, 1000])
def test_the_fused_backwards_query_tiles_size_its_counters_sums_and_dq_pass(
    head_dim, features, bm, seq
):
    # One BM through the call: the preprocess zeroes one counter per BM query rows, the workspace
    # holds that many counters and BM x d sums each, and the dQ pass takes a block of 2 BM threads
    # per tile; the split kernels' preprocess zeroes none.
    window = (64, 0) if features & _kernels.FEATURE_LOCAL else (None, None)
    p = problem(
        head_dim=head_dim,
        seq_q=seq,
        seq_k=seq,
        window=window,
        softcap=30.0 if features & _kernels.FEATURE_SOFTCAP else None,
        alibi=bool(features & _kernels.FEATURE_ALIBI),
    )
    assert _dispatch.fused_tiles(p)[0] == bm
    chosen = _dispatch.backward(p, strides_of(p), "sm_90a", 132)
    assert chosen.dkdv.aligned.spec.path == "fused"
    tiles = -(-seq // bm)
    assert chosen.preprocess.aligned.dq_tile_rows == chosen.preprocess.unaligned.dq_tile_rows == bm
    dq = chosen.dq.aligned
    assert (dq.spec.rows_per_block, dq.spec.threads) == (bm, 2 * bm)
    assert dq.grid == p.batch * p.heads_q * tiles
    ws = _dispatch.backward_workspace(p)
    assert ws.accum - ws.semaphores >= 4 * p.batch * p.heads_q * tiles
    assert ws.nbytes - ws.accum == p.batch * p.heads_q * tiles * bm * head_dim * 4
    split = _dispatch.backward(p, strides_of(p), "sm_90a", 132, KernelChoice(backward="split"))
    assert split.preprocess.aligned.dq_tile_rows == 0


def test_the_score_modifiers_whose_128_row_instances_spill_most_take_64_rows():
    # _kernels.FUSED_SHORT_FOR at d = 64: the softcap with ALiBi under a right bound (causal or a
    # window); the others, and d = 128, keep the table's tiles
    def rows(**kw):
        p = problem(head_dim=64, seq_q=1000, seq_k=1000, heads_q=8, heads_kv=8, **kw)
        return _dispatch.fused_tiles(p)[0]

    assert rows(window=(None, None), alibi=True) == 128
    assert rows(window=(None, 0), alibi=True) == 128
    assert rows(window=(None, None), alibi=True, softcap=5.0) == 128
    assert rows(window=(None, 0), alibi=True, softcap=5.0) == 64
    assert rows(window=(100, 0), alibi=True, softcap=5.0) == 64
    assert rows(window=(100, 0), alibi=True) == 128
    assert rows(window=(None, 0), softcap=5.0) == 128
    p = problem(head_dim=128, seq_q=1000, seq_k=1000, window=(None, None), alibi=True)
    assert _dispatch.fused_tiles(p)[0] == 64
    # every tile the dispatch takes by default has its instances in all_specs (the compile check)
    specs = {s.name_expression for s in _kernels.all_specs("sm_90a")}
    for window in ((None, None), (None, 0), (100, 0)):
        for alibi in (False, True):
            for softcap in (None, 5.0):
                for hd in (64, 128):
                    p = problem(head_dim=hd, window=window, alibi=alibi, softcap=softcap)
                    chosen = _dispatch.backward(p, strides_of(p), "sm_90a", 132)
                    for launch in (chosen.dkdv.aligned, chosen.dq.aligned):
                        assert launch.spec.name_expression in specs


def test_the_rotated_schedule_takes_64_row_tiles_where_128_give_too_few_query_steps():
    # d = 64, no bound: 156 key blocks a head need 156 query steps (group x query tiles): 4 x 40
    # with 64-row tiles, 4 x 20 with 128-row ones
    p = problem(head_dim=64, seq_q=2500, seq_k=19968, heads_q=4, heads_kv=1, window=(None, None))
    assert _dispatch.fused_tiles(p)[0] == 64 and _dispatch.fused_backward_fits(p)
    assert _dispatch.backward(p, strides_of(p), "sm_90a", 132).dkdv.aligned.spec.path == "fused"
    assert _dispatch.fused_tiles(replace(p, seq_k=4096))[0] == 128
    # an explicit choice of 128 rows: the fused kernels cannot serve it
    tall = KernelChoice(tiles=((("dkdv", "fused"), (128, 128, 2)),))
    assert not _dispatch.fused_backward_fits(p, tall)
    # past 4 x 40 key blocks: no tiles serve it
    assert not _dispatch.fused_backward_fits(replace(p, seq_k=20608))


def test_the_fused_backward_at_d_256_counts_turns_in_16_bits():
    # HALF_WRITERS (backward_sm90_fused.cu): each writer's turns in its half of the counter, so
    # fewer than 2^16 key blocks of 64 keys; other buckets count in all 32 bits
    blocks = 1 << 16
    p = problem(head_dim=256, seq_q=64 * blocks, seq_k=64 * (blocks - 1), window=(None, None))
    assert _dispatch.fused_backward_fits(p)
    assert not _dispatch.fused_backward_fits(replace(p, seq_k=64 * blocks))
    assert _dispatch.fused_backward_fits(replace(p, head_dim=128, seq_k=128 * blocks))
    # under a bound too (the writers poll their own halves' turns)
    causal = replace(p, seq_q=64 * blocks, window=(None, 0))
    assert _dispatch.fused_backward_fits(replace(causal, seq_k=64 * (blocks - 1)))
    assert not _dispatch.fused_backward_fits(replace(causal, seq_k=64 * blocks))
    # d = 128: under a bound only (128-key blocks)
    narrow = replace(causal, head_dim=128, seq_q=128 * blocks)
    assert _dispatch.fused_backward_fits(replace(narrow, seq_k=128 * (blocks - 1)))
    assert not _dispatch.fused_backward_fits(replace(narrow, seq_k=128 * blocks))


# The kernels whose rows go out from registers in 16-byte pieces with no alignment test of their
# own (kernels_cu/mma.cuh, store_accumulator_rows): they must run only as a Pair's launch for
# aligned pointers, over strides of whole 16-byte chunks.
WIDE_STORE_SOURCES = ("forward_sm90_tma.cu", "backward_sm90_tma.cu", "backward_sm90_fused.cu")


@pytest.mark.parametrize("head_dim", [8, 24, 40, 64, 72, 100, 128, 136, 200, 256])
@pytest.mark.parametrize("pad", [0, 1, 4, 8])
def test_wide_store_kernels_run_only_on_aligned_chunked_launches(head_dim, pad):
    for window in ((None, None), (None, 0), (64, 0)):
        p = problem(head_dim=head_dim, window=window)
        strides = strides_of(p, pad=pad)
        chunked = head_dim % 8 == 0 and pad % 8 == 0
        pairs = [_dispatch.forward(p, strides, "sm_90a", 132)]
        chosen = _dispatch.backward(p, strides, "sm_90a", 132)
        pairs += [chosen.dkdv, chosen.dq]
        for pair in pairs:
            assert pair.unaligned.spec.source not in WIDE_STORE_SOURCES
            if pair.aligned.spec.source in WIDE_STORE_SOURCES:
                assert chunked and pair.aligned.vec, (
                    head_dim,
                    pad,
                    pair.aligned.spec.name_expression,
                )


def test_the_chunked_walk_under_windows():
    # A causal window of 4096 keys at 16k, 16 heads, 128-row blocks: the first 32 blocks of a
    # head are cheap, the rest alike; strided over whole heads (15.5 items an SM) the busiest
    # block gets 1.17x the mean work. The block-major order over every head, in a snake, evens it
    # (cuflash/_dispatch.py, walk_heads; kernels_cu/common.cuh, decode_chunked_work).
    p = problem(batch=1, heads_q=16, heads_kv=16, seq_q=16384, seq_k=16384, head_dim=128,
                window=(4095, 0))  # fmt: skip
    launch = _dispatch.forward(p, strides_of(p), "sm_90a", 132).aligned
    assert launch.walk_heads == 16 and not launch.paired and launch.grid == 132
    costs = _dispatch._row_block_costs(p, launch.spec, launch.num_blocks, launch.row_shift)
    mean = sum(costs) * 16 / 132
    assert _dispatch.walk_makespan(costs, 16, True, 0, 132) > 1.15 * mean
    assert _dispatch.walk_makespan(costs, 16, False, 16, 132) < 1.01 * mean
    # without a window the order stays decode_paired_work's (in pairs under causal masking); a
    # choice can ask for either
    for window in ((None, 0), (None, None)):
        q = problem(batch=1, heads_q=16, heads_kv=16, seq_q=16384, seq_k=16384, head_dim=128,
                    window=window)  # fmt: skip
        assert _dispatch.forward(q, strides_of(q), "sm_90a", 132).aligned.walk_heads == 0
    choice = KernelChoice(walk_heads=0)
    assert _dispatch.forward(p, strides_of(p), "sm_90a", 132, choice).aligned.paired
    choice = KernelChoice(walk_heads=3)
    assert _dispatch.forward(p, strides_of(p), "sm_90a", 132, choice).aligned.walk_heads == 3
    with pytest.raises(ValueError, match="walk_heads 3 needs a window"):
        _dispatch.forward(q, strides_of(q), "sm_90a", 132, choice)  # the windowed instances only


def test_walk_makespan_follows_the_kernels_walk():
    # The simulation against a direct walk of WorkWalk and both decodes (common.cuh), item by
    # item: every (head, block) once, and each block's sum of costs.
    costs, heads, grid = [0, 3, 5, 7, 7, 7, 7], 5, 4
    nb = len(costs)
    for paired, chunk in ((True, 0), (False, 0), (False, 1), (False, 2), (False, 5)):
        loads, seen = [0] * grid, set()
        for block_id in range(grid):
            step = 0
            while True:
                rnd = step >> 1 if paired else step
                first = 2 * grid * rnd if paired else grid * rnd
                if first >= heads * nb:
                    break
                slot = grid - 1 - block_id if chunk and rnd & 1 else block_id
                item = 2 * (grid * rnd + slot) + (step & 1) if paired else grid * rnd + slot
                step += 1
                if item >= heads * nb:
                    continue
                if chunk:
                    first_bh = item // (chunk * nb) * chunk
                    size = min(chunk, heads - first_bh)
                    within = item - first_bh * nb
                    bh, block = first_bh + within % size, nb - 1 - within // size
                else:
                    bh, pos = divmod(item, nb)
                    block = paired_block(pos, nb)
                seen.add((bh, block))
                loads[block_id] += costs[block]
        assert len(seen) == heads * nb
        assert _dispatch.walk_makespan(costs, heads, paired, chunk, grid) == max(loads)
