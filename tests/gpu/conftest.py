"""GPU test fixtures: outputs poisoned with NaN, and a record of every comparison.

At the end of the session the largest error ratio (kernel error / naive same-precision error) per
dtype and output is printed, and written to $OUT/gpu_error_ratios.json when OUT is set.
"""

from __future__ import annotations

import json
import os

import pytest
from gpu_records import EXAMPLES, RECORD

# JAX takes 75% of the GPU's memory when it first runs unless told otherwise, and these tests run
# JAX beside CuPy and PyTorch in one process: with the default, the float64 references that
# follow a JAX test run out of memory (test_hopper.py's walk test at d = 128 asked CuPy for 9 GB
# with 28.7 GB allocated: docs/perf/NOTES.md, v39). Set before any test imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.fixture(autouse=True, scope="session")
def poisoned_outputs():
    """Every output buffer starts as NaN (plans built with CUFLASH_POISON_OUTPUTS=1: the
    allocator's poison argument), so an element no kernel writes fails the comparison."""
    from cuflash import _plans

    previous = os.environ.get("CUFLASH_POISON_OUTPUTS")
    os.environ["CUFLASH_POISON_OUTPUTS"] = "1"
    _plans.clear()
    yield
    if previous is None:
        del os.environ["CUFLASH_POISON_OUTPUTS"]
    else:
        os.environ["CUFLASH_POISON_OUTPUTS"] = previous
    _plans.clear()


@pytest.fixture(autouse=True)
def cached_device_memory_returned():
    """After each test, CuPy's pool and PyTorch's cache give their free blocks back to the
    driver: in one process the two allocators do not see each other's cached memory, so blocks
    that one test left in one of them could starve a large test's allocation in the other (the
    float64 references of tests/gpu/test_fused_backward.py's waves take several GB)."""
    yield
    from cuflash import testing

    if testing.gpu_unavailable_reason() is not None:
        return
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def pytest_terminal_summary(terminalreporter):
    if not RECORD:
        return
    summary: dict = {"examples": dict(EXAMPLES), "per_dtype": {}}
    for dt, outputs in RECORD.items():
        summary["per_dtype"][dt] = {
            name: {
                "comparisons": len(rows),
                "max_tolerance_used": max(r[0] for r in rows),
                "max_error_ratio": max((r[1] for r in rows if r[1] is not None), default=None),
                "max_relative_error": max(r[2] for r in rows),
            }
            for name, rows in outputs.items()
        }
    tr = terminalreporter
    tr.section("cuflash GPU errors: tolerance used (error / bound), error / naive error")
    tr.write_line(f"examples per test: {summary['examples']}")
    for dt, outputs in summary["per_dtype"].items():
        cells = []
        for name, st in sorted(outputs.items()):
            ratio = st["max_error_ratio"]
            cells.append(
                f"{name} {st['max_tolerance_used']:.2f}/{'-' if ratio is None else f'{ratio:.2f}'}"
            )
        n = max(st["comparisons"] for st in outputs.values())
        tr.write_line(f"{dt:9s} n={n:4d}: " + ", ".join(cells))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_errors.json"), "w") as f:
            json.dump(summary, f, indent=1)
