"""Ahead-of-time check that every kernel instance builds, with no register spills.

Runs nvcc (no GPU needed) on one translation unit per (source file, architecture); each unit is the
same source the runtime hands to NVRTC (its headers inlined, then the static_asserts that hold the
kernels' Params to the host's mirror), followed by references to every instance the dispatch can
launch (``cuflash._kernels.all_specs``). ptxas's resource report (-Xptxas -v) is parsed per
kernel: a spill or a stack frame (a register array moved to local memory) fails the check.

    python -m cuflash.compile_check [--arch sm_80 sm_90a] [--jobs N] [--features 0 1 ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import _kernels

DEFAULT_ARCHS = ("sm_80", "sm_90a")


@dataclass(frozen=True)
class KernelReport:
    arch: str
    mangled_name: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def clean(self) -> bool:
        return self.stack_bytes == 0 and self.spill_store_bytes == 0 and self.spill_load_bytes == 0


@dataclass(frozen=True)
class UnitResult:
    source: str
    arch: str
    expected: int  # instances referenced in the unit
    kernels: tuple[KernelReport, ...]
    seconds: float
    error: str  # compiler output when the build failed, else ""


def find_nvcc() -> str | None:
    for candidate in (
        shutil.which("nvcc"),
        os.environ.get("CUDA_HOME", "") + "/bin/nvcc",
        "/usr/local/cuda/bin/nvcc",
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _gencode(arch: str) -> str:
    # The -gencode form, which also works for the "a" targets on nvcc 13.0 (see HOPPER notes).
    return f"-gencode=arch=compute_{arch[3:]},code={arch}"


def translation_unit(source: str, specs: list[_kernels.KernelSpec]) -> str:
    refs = ",\n".join(f"  (void*)&{spec.name_expression}" for spec in specs)
    return (
        _kernels.compiled_source(source)
        + "\n// Instances checked by cuflash.compile_check\n"
        + f"void* cuflash_compile_check_instances[] = {{\n{refs}\n}};\n"
    )


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(output: str) -> list[KernelReport]:
    reports, current, stack = [], None, None
    for line in output.splitlines():
        if m := _ENTRY.search(line):
            current, stack = (m.group(1), m.group(2)), None
        elif current and (m := _STACK.search(line)):
            stack = tuple(int(x) for x in m.groups())
        elif current and stack and (m := _REGS.search(line)):
            reports.append(KernelReport(current[1], current[0], int(m.group(1)), *stack))
            current, stack = None, None
    return reports


def compile_unit(nvcc: str, source: str, arch: str, specs: list[_kernels.KernelSpec]) -> UnitResult:
    import time

    with tempfile.TemporaryDirectory(prefix="cuflash-cc-") as tmp:
        cu = Path(tmp) / f"{Path(source).stem}_{arch}.cu"
        cu.write_text(translation_unit(source, specs))
        cmd = [
            nvcc,
            "-std=c++17",
            "-cubin",
            _gencode(arch),
            "-Xptxas",
            "-v",
            "-o",
            str(cu.with_suffix(".cubin")),
            str(cu),
        ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    error = "" if proc.returncode == 0 else output
    return UnitResult(source, arch, len(specs), tuple(parse_ptxas(output)), seconds, error)


def run(
    archs=DEFAULT_ARCHS,
    jobs: int | None = None,
    nvcc: str | None = None,
    features: tuple[int, ...] | None = None,
) -> list[UnitResult]:
    """Compiles every instance (those of the given feature sets only, where given)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    # One unit per (source, architecture), holding the instances that architecture launches.
    units: dict[tuple[str, str], list[_kernels.KernelSpec]] = defaultdict(list)
    for arch in archs:
        for spec in _kernels.all_specs(arch):
            if features is None or spec.features in features:
                units[(spec.source, arch)].append(spec)
    # Largest units first, so that the last one to finish is a short one.
    work = sorted(units, key=lambda w: -len(units[w]))
    jobs = jobs or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [
            pool.submit(compile_unit, nvcc, src, arch, units[(src, arch)]) for src, arch in work
        ]
        return [f.result() for f in futures]


def problems(results: list[UnitResult]) -> list[str]:
    """Every failure in words: build errors, missing instances, spills and stack frames."""
    found = []
    for unit in results:
        where = f"{unit.source} for {unit.arch}"
        if unit.error:
            found.append(f"{where}: build failed:\n{unit.error[-4000:]}")
            continue
        if len(unit.kernels) != unit.expected:
            found.append(f"{where}: {len(unit.kernels)} kernels compiled, {unit.expected} expected")
        for k in unit.kernels:
            if not k.clean:
                found.append(
                    f"{where}: {k.mangled_name}: {k.stack_bytes} bytes stack frame, "
                    f"{k.spill_store_bytes} B spill stores, {k.spill_load_bytes} B spill loads"
                )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS))
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument(
        "--features", type=int, nargs="+", default=None, help="only these FEATURES values"
    )
    args = parser.parse_args(argv)
    results = run(args.arch, args.jobs, features=args.features)
    for unit in results:
        regs = [k.registers for k in unit.kernels]
        span = f"{min(regs)}-{max(regs)} registers" if regs else "no kernels"
        print(
            f"{unit.source:28s} {unit.arch:7s} {len(unit.kernels):3d}/{unit.expected:<3d} kernels "
            f"{span:20s} {unit.seconds:6.1f} s"
        )
    found = problems(results)
    for line in found:
        print("FAIL:", line)
    print("compile check:", "FAILED" if found else "clean (no spills, no stack frames)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
