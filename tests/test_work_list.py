"""The persistent kernels' work lists, compiled for the host with nvcc. Dense calls
(kernels_cu/common.cuh, decode_paired_work): every (sequence, head, block) exactly once, each head's
items together, heavy blocks paired with light ones. Packed calls (kernels_cu/work_list.cuh,
SequenceItems, what build_work_list writes per sequence): each sequence's own blocks exactly once,
paired within the sequence, end-aligned where the forward asks, sorted by cost, and within the
capacity the host allocates (cuflash/_dispatch.py) for any well-formed offsets."""

from __future__ import annotations

import numpy as np
import pytest
from host_programs import host_program_output

_PROGRAM = r"""
#include "params.cuh"
#include <cstdio>
int main() {
  int batch, heads, blocks, paired;
  while (std::scanf("%d %d %d %d", &batch, &heads, &blocks, &paired) == 4) {
    cuflash::Params p{};
    p.num_blocks = blocks;
    p.paired = paired;
    const long long work = 1LL * batch * heads * blocks;
    for (long long item = 0; item < work; ++item) {
      const cuflash::BlockCoords c = cuflash::decode_paired_work(item, heads, p.num_blocks);
      std::printf("%d %d %d\n", c.batch, c.head, c.block);
    }
  }
  return 0;
}
"""

# (batch, heads, blocks, paired)
CASES = [
    (1, 1, 1, 0),
    (2, 3, 5, 0),
    (2, 3, 5, 1),
    (3, 2, 8, 1),
    (46, 16, 64, 1),
]


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> list[np.ndarray]:
    text = "\n".join(" ".join(str(x) for x in case) for case in CASES)
    out = host_program_output(
        tmp_path_factory.mktemp("work_list"), _PROGRAM, text, "kernels_cu/params.cuh"
    ).split()
    numbers = np.array([int(x) for x in out]).reshape(-1, 3)
    lists, start = [], 0
    for batch, heads, blocks, _ in CASES:
        work = batch * heads * blocks
        lists.append(numbers[start : start + work])
        start += work
    assert start == len(numbers)
    return lists


@pytest.mark.parametrize("index", range(len(CASES)))
def test_every_block_once_and_each_heads_items_together(decoded, index):
    batch, heads, blocks, _ = CASES[index]
    coords = decoded[index]
    seen = {tuple(c) for c in coords}
    assert len(seen) == len(coords) == batch * heads * blocks
    assert seen == {(b, h, k) for b in range(batch) for h in range(heads) for k in range(blocks)}
    # items g * blocks .. (g + 1) * blocks - 1 are head h of sequence b, g = b * heads + h
    group = coords[:, 0] * heads + coords[:, 1]
    np.testing.assert_array_equal(group, np.arange(len(coords)) // blocks)


# Pairs stay within a head where the block count is even.
PAIRED = [i for i, (_, _, blocks, paired) in enumerate(CASES) if blocks % 2 == 0 and paired]


@pytest.mark.parametrize("index", PAIRED)
def test_pairs_put_a_heavy_block_with_a_light_one(decoded, index):
    blocks = CASES[index][2]
    pairs = decoded[index][:, 2].reshape(-1, 2)  # the two items a block takes per round
    assert (pairs.sum(axis=1) == blocks - 1).all()
    assert (pairs[:, 0] >= pairs[:, 1]).all()  # the heavy (later) block first


# ---------------------------------------------------------------------------------------------
# Packed lists: what build_work_list (kernels_cu/work_list.cu) writes for each sequence

_PACKED_PROGRAM = r"""
#include "work_list.cuh"
#include <cstdio>
#include <vector>
int main() {
  int batch, rows, cost_rows, flags, paired, num_blocks, total_q, total_k, seq_q, seq_k;
  while (std::scanf("%d %d %d %d %d %d %d %d %d %d", &batch, &rows, &cost_rows, &flags, &paired,
                    &num_blocks, &total_q, &total_k, &seq_q, &seq_k) == 10) {
    std::vector<int> cu_q(batch + 1), cu_k(batch + 1);
    for (int& x : cu_q) std::scanf("%d", &x);
    for (int& x : cu_k) std::scanf("%d", &x);
    cuflash::Params p{};
    p.batch = batch;
    p.list_rows = rows;
    p.list_cost_rows = cost_rows;
    p.list_flags = flags;
    p.paired = paired;
    p.num_blocks = num_blocks;
    p.total_q = total_q;
    p.total_k = total_k;
    p.seq_q = seq_q;
    p.seq_k = seq_k;
    p.cu_seqlens_q = cu_q.data();
    p.cu_seqlens_k = cu_k.data();
    for (int b = 0; b < batch; ++b) {
      const cuflash::SequenceItems s = cuflash::SequenceItems::of(p, b);
      std::printf("%d %d", s.items, s.bucket);
      for (int i = 0; i < s.items; ++i) std::printf(" %d", s.block(p, i));
      std::printf("\n");
    }
  }
  return 0;
}
"""

LIST_KEYS, LIST_END_ALIGNED = 1, 2  # work_list.cuh


def _offsets(lengths) -> list[int]:
    return [0, *np.cumsum(lengths).tolist()]


def _packed_cases() -> list[dict]:
    """Long-tailed, tiny and empty sequences, Nq != Nk, every kind of list, and malformed
    offsets (decreasing, past the end, negative)."""
    rng = np.random.default_rng(7)
    cases = []
    draws = [
        (rng.lognormal(6.5, 1.2, 40).astype(int).clip(0, 8192), None),
        (rng.integers(0, 3, 30), rng.integers(0, 300, 30)),
        (
            np.array([0, 1, 63, 64, 65, 127, 128, 129, 0]),
            np.array([5, 0, 64, 1, 300, 128, 0, 7, 0]),
        ),
        (np.array([4096]), np.array([1000])),
    ]
    for lengths_q, lengths_k in draws:
        lengths_k = lengths_q if lengths_k is None else lengths_k
        for rows, cost_rows, flags, paired in (
            (128, 128, 0, 0),  # forward, not causal
            (128, 128, LIST_END_ALIGNED, 1),  # forward, causal
            (192, 128, LIST_END_ALIGNED, 1),
            (64, 64, 0, 1),  # dq, causal
            (128, 64, LIST_KEYS, 0),  # dK/dV
            (64, 128, LIST_KEYS, 1),
        ):
            keys = flags & LIST_KEYS
            longest = int(max(lengths_k if keys else lengths_q))
            blocks = -(-longest // rows)
            blocks += blocks & 1 if paired else 0
            cases.append(
                dict(
                    cu_q=_offsets(lengths_q),
                    cu_k=_offsets(lengths_k),
                    rows=rows,
                    cost_rows=cost_rows,
                    flags=flags,
                    paired=paired,
                    num_blocks=blocks,
                    seq_q=int(max(lengths_q)),
                    seq_k=int(max(lengths_k)),
                    malformed=False,
                )
            )
    for cu in ([0, 50, 20, 300, 100], [0, -40, 90, 5000, 100], [7, 7, 7, 7, 7]):
        cases.append(
            dict(
                cu_q=cu,
                cu_k=cu,
                rows=128,
                cost_rows=128,
                flags=LIST_END_ALIGNED,
                paired=1,
                num_blocks=2,
                seq_q=200,
                seq_k=200,
                malformed=True,
            )
        )
    return cases


PACKED_CASES = _packed_cases()


@pytest.fixture(scope="module")
def sequence_items(tmp_path_factory) -> list[list[list[int]]]:
    lines = []
    for c in PACKED_CASES:
        total_q = max(c["cu_q"][-1], 0) if not c["malformed"] else 100
        total_k = max(c["cu_k"][-1], 0) if not c["malformed"] else 100
        c["total_q"], c["total_k"] = total_q, total_k
        head = (len(c["cu_q"]) - 1, c["rows"], c["cost_rows"], c["flags"], c["paired"])
        head += (c["num_blocks"], total_q, total_k, c["seq_q"], c["seq_k"])
        lines.append(" ".join(map(str, (*head, *c["cu_q"], *c["cu_k"]))))
    out = host_program_output(
        tmp_path_factory.mktemp("packed_list"),
        _PACKED_PROGRAM,
        "\n".join(lines),
        "kernels_cu/work_list.cuh",
    ).splitlines()
    results, start = [], 0
    for c in PACKED_CASES:
        batch = len(c["cu_q"]) - 1
        results.append([[int(x) for x in line.split()] for line in out[start : start + batch]])
        start += batch
    assert start == len(out)
    return results


def _span(cu: list[int], b: int, total: int, longest: int) -> int:
    """Seq::span's clamped length of sequence b (kernels_cu/params.cuh)."""
    first = min(max(cu[b], 0), total)
    last = min(max(cu[b + 1], first), total)
    return min(last - first, longest)


@pytest.mark.parametrize("index", range(len(PACKED_CASES)))
def test_each_sequence_lists_its_own_blocks_once(sequence_items, index):
    c = PACKED_CASES[index]
    keys, end_aligned = c["flags"] & LIST_KEYS, c["flags"] & LIST_END_ALIGNED
    rows, blocks = c["rows"], c["num_blocks"]
    for b, (items, bucket, *listed) in enumerate(sequence_items[index]):
        nq = _span(c["cu_q"], b, c["total_q"], c["seq_q"])
        nk = _span(c["cu_k"], b, c["total_k"], c["seq_k"])
        n, streamed = (nk, nq) if keys else (nq, nk)
        real = -(-n // rows)
        assert items == real + (real & 1 if c["paired"] else 0)
        assert len(listed) == items
        assert bucket == min(-(-streamed // c["cost_rows"]), 1023)
        # the rows each listed block covers: every row of the sequence once, at most one block
        # empty (a pair's filler)
        covered, empty = [], 0
        for block in listed:
            assert 0 <= block < max(blocks, items)
            m0 = block * rows - (blocks * rows - n if end_aligned else 0)
            lo, hi = max(m0, 0), min(m0 + rows, n)
            if hi <= lo:
                empty += 1
            covered.extend(range(lo, hi))
        assert sorted(covered) == list(range(n))
        assert empty <= (1 if c["paired"] else 0)
        if c["paired"] and items:  # heavy with light: the later block first, pairs symmetric
            pairs = np.array(listed).reshape(-1, 2)
            assert (pairs[:, 0] > pairs[:, 1]).all()
            assert len(set(pairs.sum(axis=1).tolist())) == 1


@pytest.mark.parametrize("index", [i for i, c in enumerate(PACKED_CASES) if not c["malformed"]])
@pytest.mark.parametrize("heads", [1, 3, 16])
def test_the_list_fits_the_capacity_the_host_allocates(sequence_items, index, heads):
    from types import SimpleNamespace

    from cuflash import _dispatch

    c = PACKED_CASES[index]
    p = SimpleNamespace(batch=len(c["cu_q"]) - 1)
    total = c["total_k"] if c["flags"] & LIST_KEYS else c["total_q"]
    capacity = _dispatch._list_capacity(p, heads, total, c["rows"])
    capacity -= capacity & 1
    entries = heads * sum(s[0] for s in sequence_items[index])
    assert entries <= capacity
    # the workspace's bound (blocks of 64 rows) holds every kernel's list
    assert capacity <= _dispatch._list_capacity(p, heads, total, _dispatch._LIST_BOUND_ROWS)
