"""Running a C++ program built on the kernels' headers (kernels_cu/) on the host: the tests that
check a header's host-callable logic (mask.cuh's tile ranges, params.cuh's work list) against
Python compile it with nvcc and feed it cases on stdin."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cuflash import _kernels, compile_check


def host_program_output(directory: Path, program: str, stdin: str, what: str) -> str:
    """Builds `program` for the host with nvcc (the kernels' headers on its include path) in
    `directory`, runs it on `stdin` and returns its stdout; skips the calling test where nvcc is
    missing (`what`: the header it checks, for the reason)."""
    nvcc = compile_check.find_nvcc()
    if nvcc is None:
        pytest.skip(f"nvcc not found: this check compiles {what} for the host")
    source, binary = directory / "host_program.cu", directory / "host_program"
    source.write_text(program)
    subprocess.run(
        [nvcc, "-std=c++17", "-I", str(_kernels.kernel_dir()), "-o", str(binary), str(source)],
        check=True,
        capture_output=True,
    )
    return subprocess.run(
        [str(binary)], input=stdin, capture_output=True, text=True, check=True
    ).stdout
