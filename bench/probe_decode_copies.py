"""How fast a block can stream a decoding cache through bulk copies, by the size of each copy.

Issue 18 asks decoding to reach 0.9 of the copy bandwidth from 256 MiB on; the decoding kernel
streams at 0.98-1.0 of it (its fixed cost apart) where SDPA cuDNN streams at 1.03-1.05, and v20
found a block bound by its count of row copies (~60 M a second), not by bytes (NOTES v20). This
probe strips the attention away: each block only streams the K and V tiles of its part of a
(B, N, Hkv, d) = (B, N, 8, 128) bf16 cache into shared memory through `cp.async.bulk` with
STAGES stages, one copy per issuing thread, and a thread touches one word of each tile. The
patterns differ only in how a tile is cut into copies:

  head_rows  a block per (sequence, KV head, split), one 256-byte copy per key row and head
             (the decoding kernel's copies: 128 a 64-key tile of K and V)
  key_rows   a block per (sequence, split) over all eight heads, one 2 KiB copy per key row
             (every head of the row at once: 16 copies an 8-key tile)
  chunks     a block per (sequence, split), one copy per tile of K and one of V (the tile's key
             rows are contiguous)
  loads      no bulk copies: every thread streams 16-byte loads (a read-only stream's rate)

`--delays` adds that many clock cycles of waiting per tile in every warp before the stage is
released (head_rows+N), standing in for a decoding block's work on its tile.

Fractions are of the eager 1 GiB device copy (read plus write), as bench_kvcache.py reports.

    python bench/probe_decode_copies.py [--batch 8] [--keys 8192 32768] [--delays 0 2000]
                                          [--heads-first]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import cupy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SOURCE = r"""
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(unsigned long long* bar, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_expect(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned bytes,
                                     unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// This block's KV head `h` and `split` (KV heads adjacent in the grid, or splits); returns its
// sequence.
__device__ __forceinline__ long long place(int heads, int splits, int heads_first, int& h,
                                           int& split) {
  long long bid = blockIdx.x;
  if (heads_first) {
    h = bid % heads; bid /= heads;
    split = bid % splits; bid /= splits;
  } else {
    split = bid % splits; bid /= splits;
    h = bid % heads; bid /= heads;
  }
  return bid;
}

// Waits for a stage, touches a word of it, then stands for a decoding block's work on the tile
// (`delay` clock cycles).
__device__ __forceinline__ unsigned consume(unsigned long long* full, unsigned parity,
                                            const unsigned char* stage, long long delay) {
  bar_wait(full, parity);
  const unsigned word = reinterpret_cast<const unsigned*>(stage)[threadIdx.x % 32];
  if (delay > 0) {
    const long long until = clock64() + delay;
    while (clock64() < until) {
    }
  }
  return word;
}

// The stream of a block: `stages` tiles in flight, each stage refilled (`issue(t, stage)`) once
// every thread is done with its tile.
template <typename Issue>
__device__ __forceinline__ void stream(const Issue& issue, unsigned long long* full,
                                       const unsigned char* buf, int stage_bytes, int stages,
                                       int tiles, long long delay, unsigned* sink) {
  for (int t = 0; t < stages && t < tiles; ++t) issue(t, t);
  unsigned acc = 0;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % stages;
    acc += consume(&full[s], (t / stages) & 1, buf + s * stage_bytes, delay);
    __syncthreads();
    if (t + stages < tiles) issue(t + stages, s);
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

extern "C" {
// Block (b, h, split): rows r of tile t of K at k + b*b_stride + h*h_stride + split*split_stride
// + (t*rows + r)*row_stride, copy_bytes each; V the same at + v_offset.
__global__ void stream_copies(const char* k, long long v_offset, int heads, int splits,
                              long long b_stride, long long h_stride, long long split_stride,
                              long long row_stride, int rows, int copy_bytes, int tiles, int stages,
                              int heads_first, long long delay, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);
  unsigned char* buf = smem + 128;
  const int stage_bytes = 2 * rows * copy_bytes;
  int split, h;
  const long long bid = place(heads, splits, heads_first, h, split);
  const long long b = bid;  // the sequence
  const char* base = k + b * b_stride + h * h_stride + split * split_stride;
  const int tid = threadIdx.x;
  const bool issues = tid < 2 * rows;
  const int r = tid % rows;
  const long long off = tid < rows ? 0 : v_offset;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) bar_init(&full[s], 2 * rows);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int t, int s) {
    if (!issues) return;
    unsigned long long* bar = &full[s];
    bar_expect(bar, copy_bytes);
    const long long row = static_cast<long long>(t) * rows + r;
    bulk(buf + s * stage_bytes + tid * copy_bytes, base + off + row * row_stride, copy_bytes, bar);
  };
  stream(issue, full, buf, stage_bytes, stages, tiles, delay, sink);
}

// The same blocks and tiles (64 key rows of one head) as boxes of tensor maps (d, N, Hkv, B) that
// live in global memory: `boxes` boxes of `box_cols` columns a tile of K and as many of V, all
// issued by thread 0.
__global__ void stream_boxes(const void* kmap, const void* vmap, int heads, int splits, int keys,
                             int boxes, int box_cols, int box_bytes, int tiles, int stages,
                             int heads_first, long long delay, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);
  // the boxes' destinations 1024-byte aligned (the 128-byte swizzle)
  unsigned char* buf = smem + 1024 + ((1024 - (smem_u32(smem) & 1023)) & 1023);
  const int stage_bytes = 2 * boxes * box_bytes;
  int split, h;
  const long long bid = place(heads, splits, heads_first, h, split);
  const int b = static_cast<int>(bid);  // the sequence
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) bar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int t, int s) {
    if (tid != 0) return;
    unsigned long long* bar = &full[s];
    bar_expect(bar, stage_bytes);
    const int row = split * (keys / splits) + t * 64;
    for (int i = 0; i < 2 * boxes; ++i) {
      const void* map = i < boxes ? kmap : vmap;
      const int c = (i % boxes) * box_cols;
      asm volatile(
          "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
          ::"r"(smem_u32(buf + s * stage_bytes + i * box_bytes)),
          "l"(map), "r"(c), "r"(row), "r"(h), "r"(b), "r"(smem_u32(bar)) : "memory");
    }
  };
  stream(issue, full, buf, stage_bytes, stages, tiles, delay, sink);
}

__global__ void stream_loads(const uint4* src, long long n, unsigned* sink) {
  unsigned acc = 0;
  const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
  long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * step < n; i += 4 * step) {
    uint4 a = __ldg(src + i), b = __ldg(src + i + step);
    uint4 c = __ldg(src + i + 2 * step), d = __ldg(src + i + 3 * step);
    acc += a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += step) acc += __ldg(src + i).x;
  if (acc == 0x12345678u) sink[0] = acc;
}
}
"""

HKV, D, ELEM = 8, 128, 2
ROW = HKV * D * ELEM  # bytes of one key row of a (B, N, Hkv, d) cache


def timed(launch, reps: int = 20, rounds: int = 5) -> float:
    for _ in range(3):
        launch()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(rounds):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(reps):
            launch()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / reps * 1e-3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = cupy.empty(2**30, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    return 2 * src.nbytes / timed(lambda: dst.__setitem__(slice(None), src), reps=5)


def unswizzled_map(tma, address: int, keys: int, batch: int, columns: int) -> bytes:
    """A map of one cache (d, N, Hkv, B) read in boxes of (columns, 64) without a swizzle."""
    import ctypes

    dims = (ctypes.c_uint64 * 4)(D, keys, HKV, batch)
    strides = (ctypes.c_uint64 * 3)(HKV * D * ELEM, D * ELEM, keys * ROW)
    box = (ctypes.c_uint32 * 4)(columns, 64, 1, 1)
    ones = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    out = (ctypes.c_uint8 * (tma.MAP_BYTES + 64))()
    base = (ctypes.addressof(out) + 63) & ~63  # the driver wants 64-byte alignment
    err = tma._encoder()(
        base,
        tma._DATA_TYPE_UINT16,
        4,
        address,
        dims,
        strides,
        box,
        ones,
        tma._INTERLEAVE_NONE,
        0,
        tma._L2_PROMOTION_256B,
        tma._OOB_FILL_ZEROS,
    )
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled: {err}")
    return ctypes.string_at(base, tma.MAP_BYTES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--keys", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--delays", type=int, nargs="+", default=[0], help="cycles a tile")
    parser.add_argument("--heads-first", action="store_true", help="KV heads adjacent in the grid")
    args = parser.parse_args()

    module = cupy.RawModule(code=SOURCE, options=("--std=c++17", "-arch=sm_90a"))
    stream_copies = module.get_function("stream_copies")
    stream_loads = module.get_function("stream_loads")
    sink = cupy.zeros(1, dtype=cupy.uint32)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, {sms} SMs")

    # (name, heads as blocks, splits, rows a tile, copy bytes, row stride, keys a tile, stages,
    #  cycles of work a tile)
    patterns = []
    for stages in (3, 4):
        for delay in args.delays:
            patterns.append((f"head_rows+{delay}", HKV, 4, 64, D * ELEM, ROW, 64, stages, delay))
        patterns.append(("key_rows", 1, 32, 8, ROW, ROW, 8, stages, 0))
        patterns.append(("key_rows16", 1, 32, 16, ROW, ROW, 16, stages, 0))
        patterns.append(("chunks", 1, 32, 1, 8 * ROW, 8 * ROW, 8, stages, 0))
        patterns.append(("chunks16", 1, 32, 1, 16 * ROW, 16 * ROW, 16, stages, 0))
    print(
        f"{'pattern':<12} {'stages':>6} {'blocks':>6} {'smem':>7} "
        + " ".join(f"{k:>16}" for k in args.keys)
    )
    caches = {keys: cupy.empty(2 * args.batch * keys * ROW, dtype=cupy.uint8) for keys in args.keys}
    for name, heads, splits, rows, copy_bytes, row_stride, tile_keys, stages, delay in patterns:
        smem = 128 + stages * 2 * rows * copy_bytes
        if smem > 227 * 1024:
            continue
        stream_copies.max_dynamic_shared_size_bytes = smem
        cells = []
        for keys in args.keys:
            cache = caches[keys]
            v_offset = args.batch * keys * ROW
            tiles = keys // splits // tile_keys
            blocks = args.batch * heads * splits
            launch_args = (
                cache,
                cupy.int64(v_offset),
                cupy.int32(heads),
                cupy.int32(splits),
                cupy.int64(keys * ROW),
                cupy.int64(D * ELEM if heads > 1 else 0),
                cupy.int64(keys // splits * ROW),
                cupy.int64(row_stride),
                cupy.int32(rows),
                cupy.int32(copy_bytes),
                cupy.int32(tiles),
                cupy.int32(stages),
                cupy.int32(args.heads_first),
                cupy.int64(delay),
                sink,
            )
            seconds = timed(lambda: stream_copies((blocks,), (128,), launch_args, shared_mem=smem))
            cells.append(f"{seconds * 1e6:7.1f} us {cache.nbytes / seconds / bandwidth:5.3f}")
        print(
            f"{name:<12} {stages:>6} {blocks:>6} {smem:>7} " + " ".join(f"{c:>16}" for c in cells)
        )
    # Boxes: 128-byte swizzled boxes of 64 columns (two a tile of K at d = 128), and the padded
    # rows of 136 columns without a swizzle that v20's experiment copied (one a tile).
    from cuflash import _tma

    stream_boxes = module.get_function("stream_boxes")
    for label, boxes, box_cols, swizzle in (
        ("boxes128B", 2, 64, True),
        ("boxes136", 1, 136, False),
    ):
        box_bytes = 64 * box_cols * ELEM
        for stages in (3,):
            for delay in args.delays:
                smem = 2048 + stages * 2 * boxes * box_bytes
                stream_boxes.max_dynamic_shared_size_bytes = smem
                cells = []
                for keys in args.keys:
                    cache = caches[keys]
                    half = args.batch * keys * ROW
                    maps = []
                    for offset in (0, half):
                        address = cache.data.ptr + offset
                        if swizzle:
                            dims = (D, keys, HKV, args.batch)
                            strides = (HKV * D * ELEM, D * ELEM, keys * ROW)
                            blob = _tma.TileMap(dims, strides, 64, address).template
                        else:  # the v20 experiment's map
                            blob = unswizzled_map(_tma, address, keys, args.batch, box_cols)
                        maps.append(cupy.asarray(bytearray(blob), dtype=cupy.uint8))
                    blocks = args.batch * HKV * 4
                    launch_args = (
                        maps[0],
                        maps[1],
                        cupy.int32(HKV),
                        cupy.int32(4),
                        cupy.int32(keys),
                        cupy.int32(boxes),
                        cupy.int32(box_cols),
                        cupy.int32(box_bytes),
                        cupy.int32(keys // 4 // 64),
                        cupy.int32(stages),
                        cupy.int32(args.heads_first),
                        cupy.int64(delay),
                        sink,
                    )
                    seconds = timed(
                        lambda: stream_boxes((blocks,), (128,), launch_args, shared_mem=smem)
                    )
                    cells.append(
                        f"{seconds * 1e6:7.1f} us {cache.nbytes / seconds / bandwidth:5.3f}"
                    )
                name = f"{label}+{delay}"
                print(
                    f"{name:<12} {stages:>6} {blocks:>6} {smem:>7} "
                    + " ".join(f"{c:>16}" for c in cells)
                )
    cells = []
    for keys in args.keys:
        cache = caches[keys]
        n = cache.nbytes // 16
        seconds = timed(lambda: stream_loads((sms * 8,), (256,), (cache, cupy.int64(n), sink)))
        cells.append(f"{seconds * 1e6:7.1f} us {cache.nbytes / seconds / bandwidth:5.3f}")
    print(f"{'loads':<12} {'-':>6} {sms * 8:>6} {'-':>7} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
