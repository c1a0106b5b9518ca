"""Probe: the throughput and latency of the special-function unit (MUFU) operations that the
softcap's scores use, against an FMA, on this GPU (docs/perf/NOTES.md, v25).

    python bench/probe_mufu.py [--out DIR]

One block per SM runs W warps; each thread applies one operation CHAINS x ITERS times over CHAINS
independent registers (CHAINS = 8: throughput; CHAINS = 1, one warp per scheduler: latency).
The figures are results per clock per SM (two per f16x2 instruction) and cycles per dependent
operation, from clock64 around the loop of each block.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import cupy as cp

# name: (PTX of one step on register %0 (b32), results per instruction)
OPS = {
    "fma.f32": ("fma.rn.f32 %0, %0, 0f3F7FFFFF, 0f33800000;", 1),
    "ex2.ftz.f32": ("ex2.approx.ftz.f32 %0, %0;", 1),
    # void as written: ptxas folds rcp(rcp(x)) = x, so this row reads no MUFU time
    "rcp.ftz.f32": ("rcp.approx.ftz.f32 %0, %0;", 1),
    "tanh.f32": ("tanh.approx.f32 %0, %0;", 1),
    "ex2.f16x2": ("ex2.approx.f16x2 %0, %0;", 2),
    "tanh.f16x2": ("tanh.approx.f16x2 %0, %0;", 2),
    "tanh.bf16x2": ("tanh.approx.bf16x2 %0, %0;", 2),
    "ex2.ftz.bf16x2": ("ex2.approx.ftz.bf16x2 %0, %0;", 2),
}

SOURCE = r"""
extern "C" __global__ void probe(unsigned* out, long long* cycles, int iters) {
  unsigned x[CHAINS];
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) x[c] = 0x3c003c00u ^ (threadIdx.x * 7u + c);
  __syncthreads();
  const long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) asm volatile(STEP : "+r"(x[c]));
  }
  const long long t1 = clock64();
  unsigned acc = 0;
#pragma unroll
  for (int c = 0; c < CHAINS; ++c) acc ^= x[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
"""


def measure(step: str, chains: int, warps: int, sms: int, iters: int = 4096) -> tuple[float, int]:
    """(median over blocks of the cycles one block's loop took, iterations of that loop)."""
    src = SOURCE.replace("CHAINS", str(chains)).replace("STEP", '"' + step + '"')
    kernel = cp.RawModule(code=src, options=("-std=c++17",)).get_function("probe")
    out = cp.zeros(sms * warps * 32, dtype=cp.uint32)
    cycles = cp.zeros(sms, dtype=cp.int64)
    for _ in range(2):
        kernel((sms,), (warps * 32,), (out, cycles, cp.int32(iters)))
    cp.cuda.runtime.deviceSynchronize()
    return float(statistics.median(cycles.get().tolist())), iters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    lines = [f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs"]
    lines.append(f"{'op':16s} {'per clk/SM 4w':>14s} {'8w':>8s} {'16w':>8s} {'latency':>8s}")
    for name, (step, results) in OPS.items():
        rates = []
        for warps in (4, 8, 16):
            cyc, iters = measure(step, 8, warps, sms)
            rates.append(warps * 32 * 8 * iters * results / cyc)
        cyc, iters = measure(step, 1, 4, sms)
        lines.append(
            f"{name:16s} {rates[0]:14.1f} {rates[1]:8.1f} {rates[2]:8.1f} {cyc / iters:8.1f}"
        )
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_mufu.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
