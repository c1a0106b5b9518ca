"""Comparisons made by the GPU tests, summarised by conftest.py at the end of the session."""

from __future__ import annotations

from collections import defaultdict

# RECORD[dtype][output] -> list of (tolerance used = error / bound, error / naive error or None,
# relative error). The ratio to the naive error is kept only where the naive error dominates the
# bound (2 * naive >= the absolute noise term); elsewhere both errors sit at rounding noise.
RECORD: dict[str, dict[str, list[tuple]]] = defaultdict(lambda: defaultdict(list))
EXAMPLES: dict[str, int] = defaultdict(int)


def record(test: str, dtype: str, checks) -> None:
    EXAMPLES[test] += 1
    for c in checks:
        used = c.error / c.bound if c.bound > 0 else 0.0
        ratio = c.ratio if 2 * c.naive_error >= c.bound - 2 * c.naive_error else None
        RECORD[dtype][c.name].append((used, ratio, c.relative))
