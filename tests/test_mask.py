"""The one visibility rule: the host's mirror (cuflash/_mask.py) against brute force and against the
reference's own statement of the rule, and the kernels' mask.cuh, compiled for the host with nvcc,
against the mirror."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from host_programs import host_program_output
from hypothesis import given
from hypothesis import strategies as st

from cuflash import _mask, reference

SIDES = st.one_of(st.none(), st.integers(0, 40), st.integers(0, 3000))


@st.composite
def masks(draw):
    nq, nk = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    window = (draw(SIDES), draw(SIDES))
    return _mask.Mask.of(nq, nk, window), window


def test_the_mirror_states_the_references_rule():
    for nq, nk in ((1, 1), (7, 3), (3, 7), (64, 64), (100, 37)):
        for window in ((None, None), (None, 0), (0, 0), (5, None), (2, 3), (0, 10**6), (-1, 4)):
            mask = _mask.Mask.of(nq, nk, reference.resolve_window(False, window))
            want = reference.visible_mask(nq, nk, window=window)
            np.testing.assert_array_equal(mask.visible(np.arange(nq), np.arange(nk)), want)
    # causal is a right bound of 0
    np.testing.assert_array_equal(
        reference.visible_mask(9, 5, causal=True), reference.visible_mask(9, 5, window=(None, 0))
    )
    np.testing.assert_array_equal(
        reference.visible_mask(9, 5, causal=True, window=(2, 7)),
        reference.visible_mask(9, 5, window=(2, 0)),
    )


def check_ranges(mask: _mask.Mask, bm: int, bn: int) -> None:
    seen = mask.visible(np.arange(mask.nq), np.arange(mask.nk))
    # key tiles of each query tile, rows from m0 (negative m0: the TMA forward's shifted blocks)
    for m0 in range(-bm + 1 if mask.nq > 1 else 0, mask.nq, bm):
        rows = slice(max(m0, 0), min(m0 + bm, mask.nq))
        t = mask.key_tiles(m0, bm, bn)
        block = seen[rows]
        tiles_seen = [block[:, j * bn : (j + 1) * bn].any() for j in range(-(-mask.nk // bn))]
        visited = set(range(t.begin, t.end))
        assert {j for j, s in enumerate(tiles_seen) if s} <= visited
        if t.count:  # no tile wasted at either end
            assert tiles_seen[t.begin] and tiles_seen[t.end - 1]
        for j in range(t.full_begin, t.full_end):  # full: every row sees every key, none padding
            assert (j + 1) * bn <= mask.nk and block[:, j * bn : (j + 1) * bn].all()
        assert sorted(t.order()) == sorted(visited) and len(t.order()) == t.count
        assert set(t.order()[t.masked :]) == set(range(t.full_begin, t.full_end))
    # query tiles of each key tile (padding rows and keys need no mask, mask.cuh)
    for n0 in range(0, mask.nk, bn):
        cols = slice(n0, min(n0 + bn, mask.nk))
        t = mask.query_tiles(n0, bn, bm)
        block = seen[:, cols]
        tiles_seen = [block[i * bm : (i + 1) * bm].any() for i in range(-(-mask.nq // bm))]
        assert {i for i, s in enumerate(tiles_seen) if s} <= set(range(t.begin, t.end))
        if t.count:
            assert tiles_seen[t.begin] and tiles_seen[t.end - 1]
        for i in range(t.full_begin, t.full_end):
            assert block[i * bm : (i + 1) * bm].all()
        # padding rows that hold another sequence's values (packed TMA dK/dV): the same tiles, and
        # a full one holds no padding row
        z = mask.query_tiles(n0, bn, bm, zero_padding=False)
        assert (z.begin, z.end, z.full_begin) == (t.begin, t.end, t.full_begin)
        for i in range(z.full_begin, z.full_end):
            assert (i + 1) * bm <= mask.nq and block[i * bm : (i + 1) * bm].all()
        first, last = mask.queries_of(np.arange(cols.start, cols.stop))
        for c, (f, la) in enumerate(zip(first, last, strict=True)):
            np.testing.assert_array_equal(
                np.flatnonzero(block[:, c]), np.arange(f, la + 1), err_msg=f"key {n0 + c}"
            )


@given(masks(), st.sampled_from([16, 64, 128]), st.sampled_from([16, 64, 128]))
def test_tile_ranges_cover_exactly_what_is_seen(mask_window, bm, bn):
    check_ranges(mask_window[0], bm, bn)


def test_tile_ranges_of_dense_and_causal_masks():
    for nq, nk in ((1, 1), (200, 70), (70, 200), (257, 257), (4096, 4096)):
        for window in ((None, None), (None, 0)):
            check_ranges(_mask.Mask.of(nq, nk, window), 64, 128)
    dense = _mask.Mask.of(300, 300, (None, None))
    assert not dense.local and not dense.bounded_right
    assert dense.key_tiles(0, 64, 64) == _mask.TileRange(0, 0, 4, 5)  # the ragged end is masked


# The kernels' mask.cuh, compiled for the host: it prints the tile ranges, their visit orders and
# the dK/dV kernels' steps, which the mirror must reproduce.
_PROGRAM = r"""
#include "mask.cuh"
#include <cstdio>
int main() {
  int nq, nk, left, right, bm, bn;
  while (std::scanf("%d %d %d %d %d %d", &nq, &nk, &left, &right, &bm, &bn) == 6) {
    cuflash::Mask<true> local{nq, nk, left, right};
    cuflash::Mask<false> plain{nq, nk, left, right};
    const bool is_local = left < nq + nk;
    for (int m0 = -bm + 1; m0 < nq; m0 += bm) {
      cuflash::TileRange t =
          is_local ? local.key_tiles(m0, bm, bn) : plain.key_tiles(m0, bm, bn);
      std::printf("k %d %d %d %d", t.begin, t.full_begin, t.full_end, t.end);
      for (int it = 0; it <= t.count(); ++it) std::printf(" %d", t.at(it));
      std::printf("\n");
    }
    for (int n0 = 0; n0 < nk; n0 += bn) {
      cuflash::TileRange t =
          is_local ? local.query_tiles(n0, bn, bm) : plain.query_tiles(n0, bn, bm);
      std::printf("q %d %d %d %d", t.begin, t.full_begin, t.full_end, t.end);
      for (int step = 0; step < 3 * t.count(); ++step) {  // the dK/dV kernels' steps, group of 3
        const cuflash::QueryStep s = cuflash::query_step_at(step, t, 3);
        std::printf(" %d:%d", s.head, s.tile);
      }
      std::printf("\n");
      cuflash::TileRange z = is_local ? local.query_tiles<false>(n0, bn, bm)
                                      : plain.query_tiles<false>(n0, bn, bm);
      std::printf("z %d %d %d %d\n", z.begin, z.full_begin, z.full_end, z.end);
    }
  }
  return 0;
}
"""


def _mirror_lines(mask: _mask.Mask, bm: int, bn: int) -> list[str]:
    lines = []
    for m0 in range(-bm + 1, mask.nq, bm):
        t = mask.key_tiles(m0, bm, bn)
        order = " ".join(str(x) for x in t.order() + [-1])
        lines.append(f"k {t.begin} {t.full_begin} {t.full_end} {t.end} {order}")
    for n0 in range(0, mask.nk, bn):
        t = mask.query_tiles(n0, bn, bm)
        # the dK/dV kernels' steps (group of 3 query heads): every head's masked tiles, then every
        # head's full ones, each in the visit order
        order = t.order()
        steps = [(h, j) for h in range(3) for j in order[: t.masked]]
        steps += [(h, j) for h in range(3) for j in order[t.masked :]]
        steps_text = "".join(f" {h}:{j}" for h, j in steps)
        lines.append(f"q {t.begin} {t.full_begin} {t.full_end} {t.end}{steps_text}")
        z = mask.query_tiles(n0, bn, bm, zero_padding=False)
        lines.append(f"z {z.begin} {z.full_begin} {z.full_end} {z.end}")
    return lines


def test_kernels_mask_equals_the_mirror(tmp_path: Path):
    rng = np.random.default_rng(0)
    cases, want = [], []
    for _ in range(300):
        nq, nk = (int(x) for x in rng.integers(1, 700, 2))
        window = tuple(None if rng.random() < 0.3 else int(rng.integers(0, 300)) for _ in range(2))
        bm, bn = (int(rng.choice([16, 64, 128, 192])) for _ in range(2))
        mask = _mask.Mask.of(nq, nk, window)
        cases.append(f"{nq} {nk} {mask.left} {mask.right} {bm} {bn}")
        want += _mirror_lines(mask, bm, bn)
    got = host_program_output(tmp_path, _PROGRAM, "\n".join(cases), "kernels_cu/mask.cuh")
    assert got.splitlines() == want
