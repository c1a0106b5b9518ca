"""Compile kernel instances ahead of time into CuPy's disk cache, in parallel processes.

    python -m cuflash.precompile [--dtype bfloat16 ...] [--head-dim 64 128 ...] [--jobs N]

A first call of a configuration then only loads a binary. Each worker process compiles a share of
the instances for GPU 0's architecture; the parent prints each instance's compile time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from . import _kernels


def _compile_one(args: tuple[str, str, int]) -> tuple[str, float]:
    family, dtype, head_dim = args
    from . import _cuda

    if family.endswith("_tma"):  # the TMA instances that serve aligned calls on Hopper
        seq = 1 << 30 if family.startswith("long_") else 0  # long sequences' tiles
        base = family.removeprefix("long_")[: -len("_tma")]
        spec = _kernels.tma_spec(base, dtype, head_dim, _cuda.device_arch(0), seq)
        if spec is None:
            return f"(no {family} instance for {dtype} d={head_dim})", 0.0
    else:
        spec = _cuda.spec_for(family, dtype, head_dim, 0)
    start = time.perf_counter()
    _cuda.load(spec, 0)
    return spec.name_expression, time.perf_counter() - start


# The table's families, and the TMA instances (the long-sequence tiles of the forward too).
_FAMILIES = ("forward", "forward_tma", "long_forward_tma", "dkdv", "dkdv_tma", "dq", "dq_tma")


def selected(dtypes: list[str], head_dims: list[int]) -> list[tuple[str, str, int]]:
    work = [("preprocess", dt, 0) for dt in dtypes]
    work += [(fam, dt, hd) for fam in _FAMILIES for dt in dtypes for hd in head_dims]
    # the slowest (large head dims, tensor-core kernels) first
    return sorted(work, key=lambda w: (-w[2], w[1] not in _kernels.TENSOR_CORE_DTYPES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=list(_kernels.DTYPES))
    parser.add_argument("--head-dim", nargs="+", type=int, default=list(_kernels.HEAD_DIM_BUCKETS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    work = selected(args.dtype, args.head_dim)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        times = [t for t in pool.map(_compile_one, work) if not t[0].startswith("(no ")]
    for name, seconds in sorted(times, key=lambda t: -t[1]):
        print(f"{seconds:6.2f} s  {name}")
    print(
        f"precompiled {len(times)} instances in {time.perf_counter() - start:.1f} s "
        f"with {args.jobs} processes (slowest {max(t for _, t in times):.2f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
