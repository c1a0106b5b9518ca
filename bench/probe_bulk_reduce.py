"""Probe: how fast the TMA unit adds float32 tiles from shared memory into global memory
(cp.reduce.async.bulk .add.f32, the fused backward's dQ sums) against plain bulk copies.

    python bench/probe_bulk_reduce.py [--bytes 65536 32768] [--tiles-per-block 4]

One block per multiprocessor; thread 0 issues `iters` bulk operations of `bytes` from one shared
tile to global tiles in turn (block b's i-th goes to tile (b + i G) mod T, T = G x tiles-per-block:
a working set that stays in L2 at the default), waiting after each until its source is read, as
the fused backward's writer does (in flight: 1), or keeping up to 4 in flight. Prints GB/s of
source bytes for each (mode, bytes, in flight), the best of 3 timed launches.
"""

from __future__ import annotations

import argparse

import cupy as cp

SOURCE = r"""
extern "C" __global__ void bulk_probe(float* dst, long long tiles, int iters, int bytes, int mode,
                                      int in_flight) {
  extern __shared__ __align__(1024) unsigned char smem[];
  float* src = reinterpret_cast<float*>(smem);
  for (int i = threadIdx.x; i < bytes / 4; i += blockDim.x) src[i] = 1.0f;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  if (threadIdx.x != 0) return;
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(src));
  for (int it = 0; it < iters; ++it) {
    const long long tile = (blockIdx.x + static_cast<long long>(it) * gridDim.x) % tiles;
    float* d = dst + tile * (bytes / 4);
    if (mode == 0)
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                   ::"l"(d), "r"(s), "r"(bytes) : "memory");
    else
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                   ::"l"(d), "r"(s), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    if (in_flight == 1) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group.read 3;\n" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, nargs="+", default=[65536, 32768, 16384])
    parser.add_argument("--tiles-per-block", type=int, default=4)
    parser.add_argument("--iters", type=int, default=400)
    args = parser.parse_args()
    device = cp.cuda.Device()
    sms = device.attributes["MultiProcessorCount"]
    module = cp.RawModule(code=SOURCE, options=("-arch=sm_90a", "-std=c++17"))
    kernel = module.get_function("bulk_probe")
    kernel.max_dynamic_shared_size_bytes = max(args.bytes)
    tiles = sms * args.tiles_per_block
    dst = cp.zeros(tiles * max(args.bytes) // 4, dtype=cp.float32)
    print(f"{sms} blocks, working set {tiles} tiles")
    for mode, name in ((0, "reduce.add.f32"), (1, "copy")):
        for nbytes in args.bytes:
            for in_flight in (1, 4):
                launch = (
                    dst,
                    cp.int64(tiles),
                    cp.int32(args.iters),
                    cp.int32(nbytes),
                    cp.int32(mode),
                    cp.int32(in_flight),
                )
                kernel((sms,), (128,), launch, shared_mem=nbytes)
                best = float("inf")
                for _ in range(3):
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    start.record()
                    kernel((sms,), (128,), launch, shared_mem=nbytes)
                    end.record()
                    end.synchronize()
                    best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
                total = sms * args.iters * nbytes
                print(
                    f"{name:15s} {nbytes:6d} B, in flight {in_flight}: {total / best / 1e9:8.1f} "
                    f"GB/s ({best * 1e6 / args.iters:.2f} us per op a block)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
