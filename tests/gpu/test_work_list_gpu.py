"""build_work_list on the GPU (kernels_cu/work_list.cu): the list that a packed launch of a
persistent kernel walks holds each sequence's real blocks of every head exactly once, each head's
blocks together, the costliest sequences first, pairs whole, each with its sequence's rows, and a
header with their count; the backward's two lists share one workspace without touching each
other. (That every row is then
computed, and right, is test_varlen_gpu.py's: its outputs start as NaN.)"""

from __future__ import annotations

import numpy as np
import pytest

from cuflash import _compile, _dispatch, _launch, _params, testing
from cuflash._problem import Problem

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
cupy = pytest.importorskip("cupy")

LIST_KEYS, LIST_END_ALIGNED = 1, 2  # kernels_cu/work_list.cuh


def _problem(lengths_q, lengths_k, causal: bool, head_dim: int) -> Problem:
    return Problem(
        batch=len(lengths_q),
        heads_q=8,
        heads_kv=2,
        seq_q=max(lengths_q),
        seq_k=max(lengths_k),
        head_dim=head_dim,
        dtype="bfloat16",
        layout="bshd",
        two_d=False,
        window=(None, 0 if causal else None),
        scale=0.125,
        device=("cuda", 0),
        library="cupy",
        packed=True,
        total_q=int(sum(lengths_q)),
        total_k=int(sum(lengths_k)),
    )


def _strides(p: Problem) -> dict:
    d = p.head_dim
    q, kv = (0, d, p.heads_q * d), (0, d, p.heads_kv * d)
    lse = (0, p.total_q, 1)
    return dict(q=q, o=q, dout=q, dq=q, k=kv, v=kv, dk=kv, dv=kv, lse=lse, delta=lse)


def _build(p: Problem, builder: _dispatch.Launch, pointers: tuple[int, int, int]) -> None:
    template = _params.fill(p, {}, **builder.params_fields())
    args = _params.Arguments(template, ("cu_seqlens_q", "cu_seqlens_k", "work_list"))
    args.set_pointers(pointers)
    loaded = _compile.load(builder.spec, 0)
    _launch.launch(loaded, builder.grid, 0, cupy.cuda.get_current_stream().ptr, args.address)


def _expected(p: Problem, fields: dict, offsets_q, offsets_k, heads: int) -> list:
    """Per sequence: (bucket, [(head, block), ...]) as work_list.cuh lays out its run."""
    keys = fields["list_flags"] & LIST_KEYS
    end_aligned = fields["list_flags"] & LIST_END_ALIGNED
    rows, paired = fields["list_rows"], fields["paired"]
    runs = []
    for b in range(p.batch):
        nq, nk = offsets_q[b + 1] - offsets_q[b], offsets_k[b + 1] - offsets_k[b]
        n, streamed = (nk, nq) if keys else (nq, nk)
        items = -(-n // rows)
        items += items & 1 if paired else 0
        first = fields["num_blocks"] - items if end_aligned else 0
        blocks = list(range(items))
        if paired:
            blocks = [first + (i >> 1 if i & 1 else items - 1 - (i >> 1)) for i in range(items)]
        bucket = min(-(-streamed // fields["list_cost_rows"]), 1023)
        runs.append((bucket, [(h, blk) for h in range(heads) for blk in blocks]))
    return runs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_lists_hold_every_real_block_once_costliest_first(causal, head_dim):
    rng = np.random.default_rng(3)
    lengths_q = rng.lognormal(6.5, 1.2, 37).astype(int).clip(0, 5000)
    lengths_q[[3, 11]] = 0  # empty sequences
    lengths_k = lengths_q.copy()
    lengths_k[5] += 700  # Nk != Nq
    offsets_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    offsets_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    p = _problem(lengths_q.tolist(), lengths_k.tolist(), causal, head_dim)
    launches = {
        "forward": _dispatch.forward(p, _strides(p), "sm_90a", 132).aligned,
        **dict(zip(("dkdv", "dq"), _backward(p), strict=True)),
    }
    cu_q, cu_k = cupy.asarray(offsets_q), cupy.asarray(offsets_k)
    words = _dispatch.work_list_bytes(p, "backward") // 4
    for family, launch in launches.items():
        assert launch.builder is not None, family
    for group in (("forward",), ("dkdv", "dq")):  # a forward's workspace; a backward's
        workspace = cupy.full(words, -7, dtype=cupy.int32)
        for family in group:
            _build(p, launches[family].builder, (cu_q.data.ptr, cu_k.data.ptr, workspace.data.ptr))
        cupy.cuda.get_current_stream().synchronize()
        entries = workspace.get().reshape(-1, 8)  # two int4 an entry (params.cuh, work_item)
        for family in group:
            launch = launches[family]
            fields = launch.builder.params_fields()
            heads = fields["list_heads"]
            base = fields["list_base"]
            runs = _expected(p, fields, offsets_q, offsets_k, heads)
            count = entries[base, 0]
            assert count == sum(len(r) for _, r in runs) <= launch.num_work, family
            listed = entries[base + 1 : base + 1 + count]
            assert (listed[:, 3] == 0).all()
            # the second half: the sequence's (first query row, rows, first key, keys)
            seq = listed[:, 0]
            np.testing.assert_array_equal(listed[:, 4], offsets_q[seq])
            np.testing.assert_array_equal(listed[:, 5], offsets_q[seq + 1] - offsets_q[seq])
            np.testing.assert_array_equal(listed[:, 6], offsets_k[seq])
            np.testing.assert_array_equal(listed[:, 7], offsets_k[seq + 1] - offsets_k[seq])
            # each sequence's run: together, in its own order; the runs by cost, highest first
            position, last_bucket = 0, 1 << 30
            order = {}
            for row in range(count):
                order.setdefault(int(listed[row, 0]), row)
            for b in sorted(order, key=order.get):
                bucket, run = runs[b]
                assert bucket <= last_bucket, family
                last_bucket = bucket
                got = [tuple(x) for x in listed[position : position + len(run), :3]]
                assert got == [(b, h, blk) for h, blk in run], (family, b)
                assert position % 2 == 0 or not fields["paired"]  # pairs start even
                position += len(run)
            assert position == count
            assert sorted(order) == [b for b in range(p.batch) if runs[b][1]]
            # nothing written past the list's own capacity
            assert (entries[base + 1 + count : base + 1 + launch.num_work, :] == -7).all()


def _backward(p: Problem):
    launches = _dispatch.backward(p, _strides(p), "sm_90a", 132)
    return launches.dkdv.aligned, launches.dq.aligned


def test_offsets_that_claim_more_than_the_capacity_stop_at_it():
    """Overlapping sequences (malformed offsets on trust) claim more items than the host's bound:
    the list stops at its capacity, and the next list of the workspace is untouched."""
    p = _problem([1200, 0, 0, 0], [1200, 0, 0, 0], True, 128)
    dkdv, dq = _backward(p)
    # sequences 0 and 2 both claim all 1200 rows: 2 x 10 blocks of 128 keys for 2 heads, 40
    # items against a capacity of 2 x (10 + 2 x 4) = 36
    offsets = cupy.asarray(np.array([0, 1200, 0, 1200, 0], dtype=np.int32))
    assert dkdv.spec.rows_per_block == 128 and dkdv.num_work == 36
    words = _dispatch.work_list_bytes(p, "backward") // 4
    workspace = cupy.full(words, -7, dtype=cupy.int32)
    _build(p, dkdv.builder, (offsets.data.ptr, offsets.data.ptr, workspace.data.ptr))
    cupy.cuda.get_current_stream().synchronize()
    entries = workspace.get().reshape(-1, 8)
    assert entries[0, 0] == dkdv.num_work
    assert (entries[1 : 1 + dkdv.num_work, 0] >= 0).all()
    assert (entries[1 + dkdv.num_work :, :] == -7).all()  # the rest, dQ's list included
    assert dict(dq.sizes)["list_base"] >= 1 + dkdv.num_work
