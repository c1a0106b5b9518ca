"""Comparisons made by the GPU tests, summarised by conftest.py at the end of the session."""

from __future__ import annotations

from collections import defaultdict

RECORD: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
EXAMPLES: dict[str, int] = defaultdict(int)


def record(test: str, dtype: str, checks) -> None:
    EXAMPLES[test] += 1
    for check in checks:
        RECORD[dtype][check.name].append(check.ratio if check.naive_error > 0 else 0.0)
        RECORD[dtype][check.name + " relative"].append(check.relative)
