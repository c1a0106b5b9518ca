"""Who sees whom: the host's mirror of kernels_cu/mask.cuh.

Query i sees key j iff ``0 <= j < nk`` and ``diag(i) - left <= j <= diag(i) + right`` with
``diag(i) = i + nk - nq``: a band around the bottom-right diagonal. Dense attention leaves both
sides unbounded, ``causal`` means right = 0, a sliding window bounds both. The host's scheduling
(cuflash/_dispatch.py) and the blockwise reference (cuflash/reference.py) read the rule and its
tile ranges from here; the kernels from mask.cuh, written the same way line for line. The naive
reference keeps its own statement of the rule, so that the two are checked against each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Sequence lengths for which nq + 2 nk fits the kernels' 32-bit row arithmetic (mask.cuh).
MAX_SEQ = 1 << 29


@dataclass(frozen=True)
class TileRange:
    """Tiles [begin, end) to visit, of which [full_begin, full_end) need no mask."""

    begin: int
    full_begin: int
    full_end: int
    end: int

    @property
    def count(self) -> int:
        return self.end - self.begin

    @property
    def masked(self) -> int:
        return self.count - (self.full_end - self.full_begin)

    def order(self) -> list[int]:
        """The visit order of the kernels: the masked tiles after the full ones, then those before
        them, then the full ones (mask.cuh, TileRange::at)."""
        return (
            list(range(self.full_end, self.end))
            + list(range(self.begin, self.full_begin))
            + list(range(self.full_begin, self.full_end))
        )


_EMPTY = TileRange(0, 0, 0, 0)


@dataclass(frozen=True)
class Mask:
    """The visibility rule of one call, with unbounded sides stored as nq + nk (mask.cuh)."""

    nq: int
    nk: int
    left: int
    right: int

    @classmethod
    def of(cls, nq: int, nk: int, window: tuple[int | None, int | None]) -> Mask:
        """The mask of `window` = (left, right) for nq queries and nk keys; None is unbounded."""
        wide = nq + nk
        left, right = (wide if w is None else min(int(w), wide) for w in window)
        return cls(nq, nk, left, right)

    @property
    def local(self) -> bool:
        """Whether the left side is bounded: the kernels' LOCAL feature (features.cuh)."""
        return self.left < self.nq + self.nk

    @property
    def bounded_right(self) -> bool:
        """Whether the right side is bounded: row blocks further down see more keys (causal)."""
        return self.right < self.nq + self.nk

    def keys_of(self, i):
        """(first, last) key of query row(s) i; last < first: none. Works on NumPy arrays too."""
        diag = np.asarray(i) + self.nk - self.nq
        first = np.maximum(0, diag - self.left) if self.local else np.zeros_like(diag)
        return first, np.minimum(self.nk - 1, diag + self.right)

    def queries_of(self, j):
        """(first, last) query that sees key(s) j; none for j >= nk."""
        j = np.asarray(j)
        first = np.maximum(0, j - self.right - (self.nk - self.nq))
        last = np.minimum(self.nq - 1, j + self.left - (self.nk - self.nq))
        if not self.local:
            last = np.full_like(j, self.nq - 1)
        real = j < self.nk
        return np.where(real, first, self.nq), np.where(real, last, self.nq - 1)

    def visible(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Bool (len(rows), len(cols)): whether each query row sees each key column."""
        first, last = self.keys_of(np.asarray(rows)[:, None])
        cols = np.asarray(cols)[None, :]
        return (cols >= first) & (cols <= last)

    def key_tiles(self, m0: int, bm: int, bn: int) -> TileRange:
        """Key tiles of bn keys for query rows [m0, m0 + bm) (rows outside [0, nq) are padding)."""
        r0, r1 = max(m0, 0), min(m0 + bm, self.nq) - 1
        some = (int(self.keys_of(r0)[0]), int(self.keys_of(r1)[1]))
        if r1 < r0 or some[1] < some[0]:
            return _EMPTY
        every = (int(self.keys_of(r1)[0]), int(self.keys_of(r0)[1]))
        return _tiles_between(some, every, bn, to_end=False)

    def query_tiles(self, n0: int, bn: int, bm: int, zero_padding: bool = True) -> TileRange:
        """Query tiles of bm rows for the keys [n0, n0 + bn) (padding rows that read as zeros and
        padding keys need no mask; `zero_padding` False: the tile of padding rows is a masked one,
        as in the packed TMA dK/dV kernel: kernels_cu/mask.cuh says why)."""
        k1 = min(n0 + bn, self.nk) - 1
        some = (int(self.queries_of(n0)[0]), int(self.queries_of(k1)[1]))
        if k1 < n0 or some[1] < some[0]:
            return _EMPTY
        every = (int(self.queries_of(k1)[0]), int(self.queries_of(n0)[1]))
        return _tiles_between(some, every, bm, to_end=zero_padding and every[1] >= self.nq - 1)


def _tiles_between(some: tuple[int, int], every: tuple[int, int], size: int, to_end: bool):
    begin, end = some[0] // size, some[1] // size + 1
    full_begin = -(-every[0] // size)
    full_end = end if to_end else ((every[1] + 1) // size if every[1] >= 0 else 0)
    full_begin = min(max(full_begin, begin), end)
    full_end = min(max(full_end, full_begin), end)
    return TileRange(begin, full_begin, full_end, end)
