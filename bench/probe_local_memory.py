"""Probe: registers and local memory of kernel instances as the runtime builds them (NVRTC through
CuPy, one instance per module), for the library's tiles and for alternatives, to choose tiles
whose runtime binaries use no local memory (docs/perf/NOTES.md, v16).

    python bench/probe_local_memory.py [--jobs 16]

Each row: family, path, dtype, head dim, features, tiles; then registers and local bytes per
thread. The candidates are the instances that used local memory on the H100 in v16 and, for
each, the table's tiles and tile shapes the kernels accept.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import _kernels  # noqa: E402
from cuflash.precompile import compile_and_measure  # noqa: E402

# (family, path, head dim, feature sets) -> candidate tiles (the table's first)
CANDIDATES = {
    ("dkdv", "mma", 32, (0, 7)): [(64, 64, 4, 1), (32, 64, 4, 1), (16, 64, 4, 1), (64, 32, 4, 2)],
    ("dkdv", "mma", 128, (7,)): [(32, 64, 4, 1), (16, 64, 4, 1), (32, 32, 4, 2)],
    ("dkdv", "mma", 160, (12, 13, 15)): [(64, 32, 4, 2), (32, 32, 4, 2), (64, 16, 4, 4)],
    ("dkdv", "mma", 192, (0, 1, 4, 5, 8, 9, 12, 13)): [
        (64, 32, 4, 2),
        (32, 32, 4, 2),
        (64, 16, 4, 4),
        (32, 16, 4, 4),
    ],
    ("dkdv", "mma", 256, (3, 6, 11, 15)): [(32, 32, 4, 2), (16, 32, 4, 2), (32, 16, 4, 4)],
    ("dq", "mma", 224, (3, 7, 11, 15)): [(64, 32, 4), (64, 16, 4)],
    ("dkdv", "wgmma", 128, (5, 13)): [(64, 128), (32, 128), (64, 64)],
    ("dkdv", "tma", 128, (4,)): [(64, 128, 2), (128, 128, 2), (64, 64, 2)],
}


def _one(args) -> tuple:
    family, path, dtype, hd, features, tiles = args
    try:
        spec = _kernels.instance(family, path, dtype, hd, tiles, features)
        _, _, local, regs = compile_and_measure(spec)
        return args, regs, local, ""
    except Exception as exc:  # a shape the kernel rejects, or one over the shared memory
        return args, 0, 0, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=16)
    args = parser.parse_args()
    work = [
        (family, path, "bfloat16", hd, f, tiles)
        for (family, path, hd, feature_sets), candidates in CANDIDATES.items()
        for f in feature_sets
        for tiles in candidates
    ]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        results = list(pool.map(_one, work))
    for (family, path, dtype, hd, f, tiles), regs, local, error in results:
        verdict = error or f"{regs:3d} registers, local {local} B"
        print(f"{family:4s} {path:5s} {dtype} d={hd:3d} features {f:2d} {tiles!s:18s} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
