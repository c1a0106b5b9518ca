"""Compile kernel instances ahead of time into CuPy's disk cache, in parallel processes.

    python -m cuflash.precompile [--dtype bfloat16 ...] [--head-dim 64 128 ...] [--features 8 9 ...]
                                 [--family decode forward ...] [--jobs N]

Compiles every instance the dispatch can launch on GPU 0 (cuflash/_kernels.py, all_specs) for
the dtypes, head dims, feature sets (sums of _kernels.FEATURE_* bits) and kernel families asked
for, so that a first call only loads a binary. The parent prints each instance's compile time,
then the instances whose binary uses local memory (register spills or a stack) and exits with 3
if there are any: these are the binaries that run (NVRTC, one instance per module), as the
driver reports them. The CPU compile check (cuflash.compile_check) builds the same binaries with
NVRTC and the runtime's options and holds them to cuflash/local_memory.txt; with NVRTC 13.0 the
two agreed on every sm_90a instance (docs/perf/NOTES.md, v17).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from . import _kernels

_LOCAL_SIZE_BYTES = 3  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
_NUM_REGS = 4  # CU_FUNC_ATTRIBUTE_NUM_REGS


def compile_and_measure(spec: _kernels.KernelSpec) -> tuple[str, float, int, int]:
    """Compiles (or loads) `spec` on GPU 0 as the library's calls do: (instance, seconds, local
    memory bytes per thread, registers per thread) of its runtime binary."""
    import cupy

    from . import _compile

    start = time.perf_counter()
    loaded = _compile.load(spec, 0)
    seconds = time.perf_counter() - start
    local = cupy.cuda.driver.funcGetAttribute(_LOCAL_SIZE_BYTES, loaded.ptr)
    registers = cupy.cuda.driver.funcGetAttribute(_NUM_REGS, loaded.ptr)
    return spec.name_expression, seconds, local, registers


def selected(
    arch: str,
    dtypes: list[str],
    head_dims: list[int],
    features: list[int] | None = None,
    families: list[str] | None = None,
) -> list[_kernels.KernelSpec]:
    buckets = {_kernels.head_dim_bucket(d) for d in head_dims}

    def wanted(s: _kernels.KernelSpec) -> bool:
        if s.dtype not in dtypes or (families is not None and s.family not in families):
            return False
        if s.head_dim == 0:  # no head dim or features: the preprocess, the KV cache's copies
            return True
        return s.head_dim in buckets and (features is None or s.features in features)

    work = [s for s in _kernels.all_specs(arch) if wanted(s)]
    # the slowest (large head dims, tensor-core kernels) first
    return sorted(work, key=lambda s: (-s.head_dim, s.dtype not in _kernels.TENSOR_CORE_DTYPES))


def _head_dim(text: str) -> int:
    d = int(text)
    if not 1 <= d <= _kernels.MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(f"head dims run from 1 to {_kernels.MAX_HEAD_DIM}")
    return d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtype", nargs="+", choices=_kernels.DTYPES, default=list(_kernels.DTYPES)
    )
    parser.add_argument(
        "--head-dim", nargs="+", type=_head_dim, default=list(_kernels.HEAD_DIM_BUCKETS)
    )
    parser.add_argument(
        "--features", nargs="+", type=int, choices=_kernels.FEATURE_SETS, default=None
    )
    families = sorted({s.family for s in _kernels.all_specs("sm_90a")})
    parser.add_argument("--family", nargs="+", choices=families, default=None)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    from . import _compile

    work = selected(_compile.device_arch(0), args.dtype, args.head_dim, args.features, args.family)
    start = time.perf_counter()
    # spawned workers: this process has initialised CUDA (device_arch), which forked ones inherit
    # in a state they cannot use
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=context) as pool:
        times = list(pool.map(compile_and_measure, work))
    lines, status = report(times, time.perf_counter() - start, args.jobs)
    print("\n".join(lines))
    return status


def report(
    times: list[tuple[str, float, int, int]], seconds: float, jobs: int
) -> tuple[list[str], int]:
    """The lines to print for (instance, seconds, local bytes, registers) results, slowest
    first, then the instances that use local memory; exit status 3 if there are any."""
    lines = [
        f"{t:6.2f} s  {registers:3d} registers  {name}"
        for name, t, _, registers in sorted(times, key=lambda r: -r[1])
    ]
    spilled = [(name, local) for name, _, local, _ in times if local]
    lines += [f"local memory {local} B per thread: {name}" for name, local in spilled]
    slowest = max((r[1] for r in times), default=0.0)
    lines.append(
        f"precompiled {len(times)} instances in {seconds:.1f} s with {jobs} processes "
        f"(slowest {slowest:.2f} s); {len(spilled)} use local memory"
    )
    return lines, 3 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
