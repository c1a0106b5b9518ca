"""Ahead-of-time check that every kernel instance builds, with no register spills.

Compiles, with no GPU, one unit per (source file, architecture): the source the runtime hands to
NVRTC (its headers inlined, then the static_asserts that hold the kernels' Params to the host's
mirror) with every instance the dispatch can launch (``cuflash._kernels.all_specs``). ptxas's
resource report (-v) is parsed per kernel: a spill or a stack frame (a register array moved to
local memory) fails the check, except for the instances that ``local_memory.txt`` lists.

Two compilers:
- NVRTC (``--compiler nvrtc``, the default where the ``cuda-bindings`` package and NVRTC are
  installed, as the test extra installs them): the runtime's compiler with the runtime's options
  (``_kernels.runtime_options``: cuflash's and what CuPy adds, -ftz=true among them), the
  instances given as name expressions. Its report is the binaries that run (the H100's
  precompile read the same registers and local memory from the driver: docs/perf/NOTES.md, v17).
- nvcc (``--compiler nvcc``): the same units with references to every instance, as nvcc's
  front end builds them; at the register limit its registers and spills differ from NVRTC's. Its
  report also names the kernels whose wgmma ptxas serialised (C75xx), which fail the check;
  NVRTC's log leaves those messages out.

    python -m cuflash.compile_check [--arch sm_80 sm_90a] [--jobs N] [--features 0 1 ...]
                                    [--source forward_sm90_tma.cu ...] [--compiler nvrtc|nvcc]
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
from dataclasses import dataclass, replace
from pathlib import Path

from . import _kernels

DEFAULT_ARCHS = ("sm_80", "sm_90a")
NVRTC_UNIT = 128  # instances in one NVRTC program
# The runtime binaries that use local memory, kept so for now (each line: arch, bytes per thread,
# instance): the check holds the binaries to exactly this list.
KEPT_FILE = Path(__file__).with_name("local_memory.txt")


@dataclass(frozen=True)
class KernelReport:
    arch: str
    mangled_name: str
    registers: int
    stack_bytes: int  # the local memory a thread of the binary uses (spills go there too)
    spill_store_bytes: int
    spill_load_bytes: int
    name: str = ""  # the instance's name expression, where the compiler tells it (NVRTC)
    # Why ptxas serialised every wgmma of the kernel (its C75xx message), or "". Only nvcc's
    # output tells: NVRTC's log leaves these messages out.
    wgmma_serialized: str = ""

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
    compiler: str = "nvcc"


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
_SERIALIZED = re.compile(
    r"\((C75\d\d)\) Potential Performance Loss: wgmma.mma_async instructions are serialized "
    r"(due to .*?) in the function '([^']+)'"
)


def parse_ptxas(output: str) -> list[KernelReport]:
    serialized = {m.group(3): f"{m.group(1)}: {m.group(2)}" for m in _SERIALIZED.finditer(output)}
    reports, current, stack = [], None, None
    for line in output.splitlines():
        if m := _ENTRY.search(line):
            current, stack = (m.group(1), m.group(2)), None
        elif current and (m := _STACK.search(line)):
            stack = tuple(int(x) for x in m.groups())
        elif current and stack and (m := _REGS.search(line)):
            reports.append(
                KernelReport(
                    current[1],
                    current[0],
                    int(m.group(1)),
                    *stack,
                    wgmma_serialized=serialized.get(current[0], ""),
                )
            )
            current, stack = None, None
    return reports


def cubin_command(nvcc: str, unit: Path, cubin: Path, arch: str, *extra: str) -> list[str]:
    """nvcc's command that builds `unit` (a translation_unit) into `cubin` for `arch`; `extra`:
    more options (-Xptxas -v for the resource report)."""
    return [
        nvcc,
        "-std=c++17",
        _kernels.FLUSH_DENORMALS,  # as the runtime; nvcc's front end differs all the same
        "-cubin",
        _gencode(arch),
        *extra,
        "-o",
        str(cubin),
        str(unit),
    ]


def compile_unit(nvcc: str, source: str, arch: str, specs: list[_kernels.KernelSpec]) -> UnitResult:
    import time

    with tempfile.TemporaryDirectory(prefix="cuflash-cc-") as tmp:
        cu = Path(tmp) / f"{Path(source).stem}_{arch}.cu"
        cu.write_text(translation_unit(source, specs))
        cmd = cubin_command(nvcc, cu, cu.with_suffix(".cubin"), arch, "-Xptxas", "-v")
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    error = "" if proc.returncode == 0 else output
    return UnitResult(source, arch, len(specs), tuple(parse_ptxas(output)), seconds, error)


def nvrtc_version() -> tuple[int, int] | None:
    """NVRTC's version where it and its binding (cuda-bindings) are installed, else None."""
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # the package or the library is missing
        return None
    return (major, minor) if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


def compile_unit_nvrtc(source: str, arch: str, names: list[str]) -> UnitResult:
    """The instances `names` of `source` compiled by NVRTC in one program, with the runtime's
    options (cuflash/_compile.py through CuPy) and ptxas's report."""
    import time

    from cuda.bindings import nvrtc

    def log_of(program) -> str:  # noqa: ANN001
        _, size = nvrtc.nvrtcGetProgramLogSize(program)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
        return log.decode(errors="replace")

    start = time.perf_counter()
    text = _kernels.compiled_source(source).encode()
    _, program = nvrtc.nvrtcCreateProgram(text, source.encode(), 0, [], [])
    for name in names:
        nvrtc.nvrtcAddNameExpression(program, name.encode())
    options = (*_kernels.runtime_options(arch), "--ptxas-options=-v")
    (err,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
    output = log_of(program)
    built = err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    named = {}
    for name in names if built else ():
        _, lowered = nvrtc.nvrtcGetLoweredName(program, name.encode())
        named[lowered.decode()] = name
    nvrtc.nvrtcDestroyProgram(program)
    # the requested instances (a kernel that is no template is built by every program of its
    # source, and counted in the one that names it)
    kernels = [
        replace(k, name=named[k.mangled_name])
        for k in parse_ptxas(output)
        if k.mangled_name in named
    ]
    seconds = time.perf_counter() - start
    error = "" if built else output or str(err)
    return UnitResult(source, arch, len(names), tuple(kernels), seconds, error, "nvrtc")


def run(
    archs=DEFAULT_ARCHS,
    jobs: int | None = None,
    nvcc: str | None = None,
    features: tuple[int, ...] | None = None,
    compiler: str | None = None,
    sources: tuple[str, ...] | None = None,
) -> list[UnitResult]:
    """Compiles every instance (those of the given feature sets and source files only, where
    given) with NVRTC (compiler "nvrtc", the default where it is installed) or nvcc."""
    nvrtc_found = nvrtc_version() is not None
    compiler = compiler or ("nvrtc" if nvrtc_found else "nvcc")
    if compiler == "nvrtc" and not nvrtc_found:
        raise FileNotFoundError(
            "NVRTC or its binding not found (pip install cuda-bindings and nvidia-cuda-nvrtc)"
        )
    if compiler == "nvcc":
        nvcc = nvcc or find_nvcc()
        if nvcc is None:
            raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    # One unit per (source, architecture), holding the instances that architecture launches
    # (NVRTC: at most NVRTC_UNIT of them, which bounds a program's memory, several GB at 768).
    units: dict[tuple[str, str], list[_kernels.KernelSpec]] = defaultdict(list)
    for arch in archs:
        for spec in _kernels.all_specs(arch):
            if (features is None or spec.features in features) and (
                sources is None or spec.source in sources
            ):
                units[(spec.source, arch)].append(spec)
    size = NVRTC_UNIT if compiler == "nvrtc" else max(map(len, units.values()), default=1)
    work = [
        (src, arch, specs[i : i + size])
        for (src, arch), specs in units.items()
        for i in range(0, len(specs), size)
    ]
    # Largest units first, so that the last one to finish is a short one.
    work.sort(key=lambda w: -len(w[2]))
    jobs = jobs or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # NVRTC and nvcc leave the GIL
        if compiler == "nvrtc":
            futures = [
                pool.submit(compile_unit_nvrtc, src, arch, [s.name_expression for s in specs])
                for src, arch, specs in work
            ]
        else:
            futures = [pool.submit(compile_unit, nvcc, *w) for w in work]
        return [f.result() for f in futures]


Kept = dict[tuple[str, str], int]  # (arch, instance) -> local memory bytes per thread


def read_kept(path: Path = KEPT_FILE) -> Kept:
    """The list of KEPT_FILE: (arch, instance) -> bytes; '#' starts a comment."""
    kept = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            arch, size, name = line.split(None, 2)
            kept[(arch, name)] = int(size)
    return kept


def local_memory(results: list[UnitResult]) -> Kept:
    """The compiled instances whose binary uses local memory (a stack frame or spills)."""
    return {
        (k.arch, k.name or k.mangled_name): k.stack_bytes
        for u in results
        for k in u.kernels
        if not k.clean
    }


def problems(results: list[UnitResult], kept: Kept | None = None) -> list[str]:
    """Every failure in words: build errors, missing instances, wgmma serialised by ptxas (nvcc's
    report), and local memory (spills, stack frames) unless `kept` lists the instance with its
    bytes; with `kept`, also a listed instance that was compiled and uses other bytes or none (the
    list must follow the binaries)."""
    kept = kept or {}
    found = []
    for unit in results:
        where = f"{unit.source} for {unit.arch}"
        if unit.error:
            found.append(f"{where}: build failed:\n{unit.error[-4000:]}")
            continue
        if len(unit.kernels) != unit.expected:
            found.append(f"{where}: {len(unit.kernels)} kernels compiled, {unit.expected} expected")
        for k in unit.kernels:
            if k.wgmma_serialized:
                found.append(
                    f"{where}: {k.name or k.mangled_name}: wgmma serialised, {k.wgmma_serialized}"
                )
            listed = kept.get((k.arch, k.name))
            if not k.clean and listed != k.stack_bytes:
                found.append(
                    f"{where}: {k.name or k.mangled_name}: {k.stack_bytes} bytes stack frame, "
                    f"{k.spill_store_bytes} B spill stores, {k.spill_load_bytes} B spill loads"
                    + (f" ({listed} B listed in {KEPT_FILE.name})" if listed else "")
                )
            elif k.clean and listed is not None:
                found.append(
                    f"{where}: {k.name} uses no local memory now: remove it from {KEPT_FILE.name}"
                )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS))
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument(
        "--features", type=int, nargs="+", default=None, help="only these FEATURES values"
    )
    parser.add_argument(
        "--source", nargs="+", default=None, help="only the instances of these kernels_cu files"
    )
    parser.add_argument(
        "--compiler", choices=("nvrtc", "nvcc"), default=None, help="default: NVRTC if installed"
    )
    args = parser.parse_args(argv)
    results = run(
        args.arch, args.jobs, features=args.features, compiler=args.compiler, sources=args.source
    )
    compiler = results[0].compiler if results else "nvrtc"
    for unit in results:
        regs = [k.registers for k in unit.kernels]
        span = f"{min(regs)}-{max(regs)} registers" if regs else "no kernels"
        print(
            f"{unit.source:28s} {unit.arch:7s} {len(unit.kernels):3d}/{unit.expected:<3d} kernels "
            f"{span:20s} {unit.seconds:6.1f} s"
        )
    # nvcc's binaries are not the runtime's: it is held to no local memory at all
    kept = read_kept() if compiler == "nvrtc" else {}
    found = problems(results, kept)
    for line in found:
        print("FAIL:", line)
    used = local_memory(results)
    verdict = f"clean but the {len(used)} instances of {KEPT_FILE.name}" if used else "clean"
    print(f"compile check ({compiler}):", "FAILED" if found else verdict)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
