"""The persistent kernels' work list (kernels_cu/params.cuh, decode_sequence_work, and
common.cuh, decode_paired_work), compiled for the host with nvcc: every (sequence, head, block)
exactly once, each head's items together, heavy blocks paired with light ones, and packed lists
rotated by the head's index."""

from __future__ import annotations

import numpy as np
import pytest
from host_programs import host_program_output

_PROGRAM = r"""
#include "params.cuh"
#include <cstdio>
int main() {
  int batch, heads, blocks, paired, packed;
  while (std::scanf("%d %d %d %d %d", &batch, &heads, &blocks, &paired, &packed) == 5) {
    cuflash::Params p{};
    p.num_blocks = blocks;
    p.paired = paired;
    const long long work = 1LL * batch * heads * blocks;
    for (long long item = 0; item < work; ++item) {
      const cuflash::BlockCoords c = packed ? cuflash::decode_sequence_work<true>(p, item, heads)
                                            : cuflash::decode_sequence_work<false>(p, item, heads);
      std::printf("%d %d %d\n", c.batch, c.head, c.block);
    }
  }
  return 0;
}
"""

# (batch, heads, blocks, paired, packed); packed paired lists have an even block count (the host
# adds an empty block: cuflash/_dispatch.py)
CASES = [
    (1, 1, 1, 0, 0),
    (2, 3, 5, 0, 0),
    (2, 3, 5, 1, 0),
    (3, 2, 8, 1, 0),
    (1, 4, 7, 0, 1),
    (3, 5, 6, 1, 1),
    (46, 16, 64, 1, 1),
    (46, 2, 33, 0, 1),
    (4, 3, 2, 1, 1),
]


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> list[np.ndarray]:
    text = "\n".join(" ".join(str(x) for x in case) for case in CASES)
    out = host_program_output(
        tmp_path_factory.mktemp("work_list"), _PROGRAM, text, "kernels_cu/params.cuh"
    ).split()
    numbers = np.array([int(x) for x in out]).reshape(-1, 3)
    lists, start = [], 0
    for batch, heads, blocks, _, _ in CASES:
        work = batch * heads * blocks
        lists.append(numbers[start : start + work])
        start += work
    assert start == len(numbers)
    return lists


@pytest.mark.parametrize("index", range(len(CASES)))
def test_every_block_once_and_each_heads_items_together(decoded, index):
    batch, heads, blocks, _, _ = CASES[index]
    coords = decoded[index]
    seen = {tuple(c) for c in coords}
    assert len(seen) == len(coords) == batch * heads * blocks
    assert seen == {(b, h, k) for b in range(batch) for h in range(heads) for k in range(blocks)}
    # items g * blocks .. (g + 1) * blocks - 1 are head h of sequence b, g = b * heads + h
    group = coords[:, 0] * heads + coords[:, 1]
    np.testing.assert_array_equal(group, np.arange(len(coords)) // blocks)


# Pairs stay within a head where the block count is even; unpaired packed lists rotate instead.
PAIRED = [
    i
    for i, (_, _, blocks, paired, packed) in enumerate(CASES)
    if blocks % 2 == 0 and (paired or not packed)
]


@pytest.mark.parametrize("index", PAIRED)
def test_pairs_put_a_heavy_block_with_a_light_one(decoded, index):
    blocks = CASES[index][2]
    pairs = decoded[index][:, 2].reshape(-1, 2)  # the two items a block takes per round
    assert (pairs.sum(axis=1) == blocks - 1).all()
    assert (pairs[:, 0] >= pairs[:, 1]).all()  # the heavy (later) block first


@pytest.mark.parametrize("index", [i for i, c in enumerate(CASES) if c[4]])
def test_packed_lists_rotate_each_heads_blocks_by_its_index(decoded, index):
    _, _, blocks, paired, _ = CASES[index]
    coords = decoded[index]
    units = blocks // 2 if paired else blocks
    for g in range(len(coords) // blocks):
        head = coords[g * blocks : (g + 1) * blocks, 2]
        if paired:  # pair u of the head holds blocks (M - 1 - unit, unit), unit = (u + g) % units
            unit = (np.arange(units) + g) % units
            np.testing.assert_array_equal(head[1::2], unit)
            np.testing.assert_array_equal(head[0::2], blocks - 1 - unit)
        else:
            np.testing.assert_array_equal(head, (np.arange(blocks) + g) % blocks)
