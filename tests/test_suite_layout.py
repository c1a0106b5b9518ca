"""The test suite's own layout. pytest imports test modules by their file name (tests/ and
tests/gpu/ are not packages), so two test files of one name collide where both import: on a GPU
machine. Elsewhere the GPU file skips itself while importing, which hides the clash, so it is
checked here."""

from __future__ import annotations

from pathlib import Path


def test_no_two_test_modules_share_a_file_name():
    tests = Path(__file__).resolve().parent
    where: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        where.setdefault(path.name, []).append(str(path.relative_to(tests)))
    clashes = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not clashes, f"test modules that share a file name: {clashes}"
