"""GPU test fixtures: outputs poisoned with NaN, and a record of every comparison.

At the end of the session the largest error ratio (kernel error / naive same-precision error) per
dtype and output is printed, and written to $OUT/gpu_error_ratios.json when OUT is set.
"""

from __future__ import annotations

import json
import os

import pytest
from gpu_records import EXAMPLES, RECORD


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every output buffer starts as NaN, so an element no kernel writes fails the comparison."""
    from cuflash import _interop

    _interop.poison_outputs = True
    yield
    _interop.poison_outputs = False


def pytest_terminal_summary(terminalreporter):
    if not RECORD:
        return
    summary = {
        "examples": dict(EXAMPLES),
        "max_error_ratio": {
            dt: {name: max(v) for name, v in outs.items() if "relative" not in name}
            for dt, outs in RECORD.items()
        },
        "max_relative_error": {
            dt: {
                name.removesuffix(" relative"): max(v)
                for name, v in outs.items()
                if "relative" in name
            }
            for dt, outs in RECORD.items()
        },
        "comparisons": {dt: len(outs.get("o", [])) for dt, outs in RECORD.items()},
    }
    tr = terminalreporter
    tr.section("cuflash GPU error ratios (kernel error / naive same-precision error)")
    tr.write_line(f"examples per test: {summary['examples']}")
    for dt, outs in summary["max_error_ratio"].items():
        rel = summary["max_relative_error"][dt]
        cells = ", ".join(f"{n} {r:.2f} (rel {rel[n]:.1e})" for n, r in sorted(outs.items()))
        tr.write_line(f"{dt:9s} n={summary['comparisons'][dt]:4d}: {cells}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_error_ratios.json"), "w") as f:
            json.dump(summary, f, indent=1)
