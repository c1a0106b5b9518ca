"""What a Hopper kernel instance issues between its wgmma instructions, with no GPU.

Each wgmma (SASS HGMMA, QGMMA for 8-bit) takes its shared-memory operands by descriptors held
in uniform registers. The instructions between two wgmma of one product are what the issuing warp
must get through before the tensor cores can take the next k step: at d = 256 the forward's
S = Q K^T runs sixteen 40-cycle m64n80k16 steps, and rebuilding both descriptors from pointers
(an add, two masks, a shift, moves into the uniform registers: ~12 instructions a step) had made
that product issue-bound (docs/perf/NOTES.md, v45).

The instance is compiled as cuflash.compile_check compiles it for nvcc (its source with the
headers inlined, sm_90a), and disassembled by nvdisasm (on the PATH, in CUDA_HOME, or from the
nvidia-cuda-nvdisasm wheel the test extra installs). Printed per wgmma shape: how many of its
instructions follow another of the same shape, and the median count of instructions between them
(all, moves to uniform registers R2UR, and descriptor builds: a LOP3 with the 0x3fff0 mask).

    python tools/wgmma_issue.py "attention_forward_tma<cuflash::bf16, 256, 128, 80, 2, 0, 2, 0>"
                                [--source forward_sm90_tma.cu]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cuflash import _kernels, compile_check  # noqa: E402

_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_WGMMA = re.compile(r"^(?:@!?U?P\w+\s+)?([HQ]GMMA\.\S+)")
DESCRIPTOR_MASK = "0x3fff0"  # (address & 0x3FFFF) >> 4 as ptxas writes it: a descriptor built


@dataclass(frozen=True)
class Gap:
    """The instructions between one wgmma and the previous one of the same shape."""

    shape: str  # e.g. HGMMA.64x80x16.F32.BF16
    count: int
    to_uniform: int  # R2UR
    descriptor_builds: int  # LOP3 ... 0x3fff0


def find_nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if Path(home, "bin", "nvdisasm").is_file():
        return str(Path(home, "bin", "nvdisasm"))
    spec = importlib.util.find_spec("nvidia")
    for location in spec.submodule_search_locations if spec else ():
        for candidate in sorted(Path(location).glob("cu*/bin/nvdisasm")):
            return str(candidate)
    return None


def instructions(sass: str) -> list[str]:
    """The instructions of nvdisasm's listing, predicates kept, in address order."""
    return [m.group(1) for m in _LINE.finditer(sass)]


def gaps(listing: list[str]) -> list[Gap]:
    """For each wgmma that follows another of its product (same shape, no other wgmma between
    them, and the earlier one not its group's last: ptxas marks that one `gsb0`), what lies
    between the two. The first step of a product has no gap: its chain starts elsewhere."""
    result, previous = [], None  # previous: (shape, index) of a product's latest step
    for index, text in enumerate(listing):
        m = _WGMMA.match(text)
        if not m:
            continue
        shape = m.group(1)
        if previous is not None and previous[0] == shape:
            between = listing[previous[1] + 1 : index]
            result.append(
                Gap(
                    shape,
                    len(between),
                    sum("R2UR" in x for x in between),
                    sum("LOP3" in x and DESCRIPTOR_MASK in x for x in between),
                )
            )
        previous = None if "gsb0" in text else (shape, index)
    return result


def spec_of(name: str, source: str | None, arch: str = "sm_90a") -> _kernels.KernelSpec:
    wanted = name.replace(" ", "")
    matches = [
        s
        for s in _kernels.all_specs(arch)
        if s.name_expression.replace(" ", "").endswith(wanted)
        and (source is None or s.source == source)
    ]
    if len(matches) != 1:
        raise ValueError(f"name: expected one instance matching {name!r}, got {len(matches)}")
    return matches[0]


def disassemble(spec: _kernels.KernelSpec, arch: str = "sm_90a") -> str:
    nvcc, nvdisasm = compile_check.find_nvcc(), find_nvdisasm()
    if nvcc is None or nvdisasm is None:
        raise RuntimeError("nvcc and nvdisasm needed (nvdisasm: pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory(prefix="cuflash-sass-") as tmp:
        unit = Path(tmp) / "unit.cu"
        unit.write_text(compile_check.translation_unit(spec.source, [spec]))
        cubin = unit.with_suffix(".cubin")
        cmd = compile_check.cubin_command(nvcc, unit, cubin, arch)
        subprocess.run(cmd, check=True, capture_output=True)
        return subprocess.run(
            [nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True
        ).stdout


def summary(found: list[Gap]) -> list[str]:
    lines = []
    for shape in sorted({g.shape for g in found}):
        of = [g for g in found if g.shape == shape]
        count = statistics.median(g.count for g in of)
        to_uniform = statistics.median(g.to_uniform for g in of)
        builds = statistics.median(g.descriptor_builds for g in of)
        lines.append(
            f"{shape:34s} {len(of):3d} steps after another: median {count:4.1f} instructions,"
            f" {to_uniform:3.1f} R2UR, {builds:3.1f} descriptor builds"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the instance's name expression (or its end)")
    parser.add_argument("--source", help="the kernels_cu source, where the name is not unique")
    args = parser.parse_args(argv)
    spec = spec_of(args.name, args.source)
    listing = instructions(disassemble(spec))
    print(f"{spec.name_expression}: {len(listing)} instructions")
    print("\n".join(summary(gaps(listing))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
