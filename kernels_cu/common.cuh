// common.cuh: element types, conversions and small device utilities shared by every kernel.
//
// The sources are compiled by NVRTC (through CuPy) and by nvcc (the CPU compile check), so they
// include no system or toolkit header: half and bfloat16 values are carried as raw 16-bit words
// and converted with PTX instructions.
#pragma once

namespace cuflash {

typedef long long i64;

// Tag types naming the 16-bit element formats; the data itself is stored as unsigned short.
struct f16 {};
struct bf16 {};
// The 8-bit format of the FP8 forward (float8_e4m3fn: no infinities, one NaN per sign), stored as
// unsigned char. Only the Hopper TMA forward reads it (sm_89+ conversions).
struct e4m3 {};

__device__ __forceinline__ float inf_f32() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ double inf_f64() { return __longlong_as_double(0x7ff0000000000000LL); }

template <typename T> __device__ __forceinline__ T infinity();
template <> __device__ __forceinline__ float infinity<float>() { return inf_f32(); }
template <> __device__ __forceinline__ double infinity<double>() { return inf_f64(); }

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ElemTraits<E>: how an element format is stored in memory, which type accumulates it, and the
// conversions between the two. D (the backward's rowsum(dO * O)) is stored in the accumulator type.
template <typename E> struct ElemTraits;

template <> struct ElemTraits<f16> {
  typedef unsigned short storage;
  typedef float acc;
  // whether it has float32's exponent range (a function: a constant member would be a global)
  static __device__ constexpr bool f32_exponents() { return false; }
  static __device__ __forceinline__ float to_acc(unsigned short x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
  static __device__ __forceinline__ unsigned short from_acc(float f) {
    unsigned short x;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f));
    return x;
  }
  // Two floats rounded to half and packed into one 32-bit register, lo in the low half.
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <> struct ElemTraits<bf16> {
  typedef unsigned short storage;
  typedef float acc;
  static __device__ constexpr bool f32_exponents() { return true; }
  static __device__ __forceinline__ float to_acc(unsigned short x) {
    return __uint_as_float(static_cast<unsigned>(x) << 16);
  }
  static __device__ __forceinline__ unsigned short from_acc(float f) {
    unsigned short x;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x) : "f"(f));
    return x;
  }
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <> struct ElemTraits<e4m3> {
  typedef unsigned char storage;
  typedef float acc;
  static __device__ constexpr bool f32_exponents() { return false; }
  static __device__ __forceinline__ float to_acc(unsigned char x) {
    unsigned pair;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(static_cast<unsigned short>(x)));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(pair & 0xffffu)));
    return f;
  }
  // Four floats rounded to e4m3 (NaN stays NaN, the rest saturates at +-448) and packed into one
  // 32-bit register, b0 in the lowest byte.
  static __device__ __forceinline__ unsigned pack4(float b0, float b1, float b2, float b3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b1), "f"(b0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(b3), "f"(b2));
    return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
  }
};

// The exact path (float32 and float64 inputs) does all its arithmetic in float64.
template <> struct ElemTraits<float> {
  typedef float storage;
  typedef double acc;
  static __device__ __forceinline__ double to_acc(float x) { return x; }
  static __device__ __forceinline__ float from_acc(double x) { return static_cast<float>(x); }
};

template <> struct ElemTraits<double> {
  typedef double storage;
  typedef double acc;
  static __device__ __forceinline__ double to_acc(double x) { return x; }
  static __device__ __forceinline__ double from_acc(double x) { return x; }
};

// The block's work item, decoded from a flat blockIdx.x so that B * H is not limited to 65535.
// Blocks of one (batch, head) are adjacent, so they share K and V in L2; within a head the
// heaviest (last, under causal masking) row block is scheduled first.
struct BlockCoords {
  int batch, head, block;
};

// Work item `bid` of a flat list in that order (a persistent kernel walks the list itself).
__device__ __forceinline__ BlockCoords decode_work(i64 bid, int heads, int num_blocks) {
  BlockCoords c;
  const i64 bh = bid / num_blocks;
  c.block = num_blocks - 1 - static_cast<int>(bid - bh * num_blocks);
  c.batch = static_cast<int>(bh / heads);
  c.head = static_cast<int>(bh - static_cast<i64>(c.batch) * heads);
  return c;
}

__device__ __forceinline__ BlockCoords decode_block(int heads, int num_blocks) {
  return decode_work(blockIdx.x, heads, num_blocks);
}

// The persistent kernels' work list. Under causal masking row block b of a head costs about
// b + 1 key tiles, so a plain stride over decode_work's order can hand one SM the heavy blocks
// every time (when the grid is a multiple of the blocks per head). Here the blocks of a head
// come in pairs, heaviest with lightest (M-1, 0, M-2, 1, ...), and with `paired` (the host's
// choice where row blocks cost more along the sequence: causal) each block takes two consecutive
// items per round, so that every SM's pairs cost about the same; without, equal items are taken
// with a stride of the grid. Heads stay adjacent, so the blocks
// running at one time share K and V in L2.
__host__ __device__ __forceinline__ BlockCoords decode_paired_work(i64 item, int heads,
                                                                 int num_blocks) {
  BlockCoords c;
  const i64 bh = item / num_blocks;
  const int pos = static_cast<int>(item - bh * num_blocks);
  c.block = (pos & 1) ? pos >> 1 : num_blocks - 1 - (pos >> 1);
  c.batch = static_cast<int>(bh / heads);
  c.head = static_cast<int>(bh - static_cast<i64>(c.batch) * heads);
  return c;
}

// Item `item` of the order where every head's last row block comes first, in head order, and the
// other blocks follow in decode_paired_work's (the TMA forward with split_last, whose last blocks
// cost a fraction of the others: taken first, the walk's rounds spread them over every block;
// decode_paired_work's order would hand them all to the same few blocks).
__host__ __device__ __forceinline__ BlockCoords decode_last_first_work(i64 item, int heads,
                                                                     int batch, int num_blocks) {
  const i64 total = static_cast<i64>(batch) * heads;
  if (item >= total) return decode_paired_work(item - total, heads, num_blocks - 1);
  BlockCoords c;
  c.block = num_blocks - 1;
  c.batch = static_cast<int>(item / heads);
  c.head = static_cast<int>(item - static_cast<i64>(c.batch) * heads);
  return c;
}

// Item `item` of the block-major order over chunks of `chunk` (batch, head) pairs, the host's
// choice for dense calls where a window makes the row blocks' costs uneven (Params::walk_heads,
// cuflash/_dispatch.py, walk_heads): every head of a chunk's last row block, then every head's
// next-to-last one, and so on; the chunks one after the other (the last may hold fewer heads).
// Under a left bound a row block costs less only near the sequence's start, so this order takes
// the cheap blocks last, and a round of the walk (in a snake) hands every block items of like
// cost: the strided walk over decode_paired_work's order gave some blocks 1.2x the mean (a
// causal window of 4096 keys at 16k, 16 heads: 15.5 items per SM; docs/perf/NOTES.md, v31).
__host__ __device__ __forceinline__ BlockCoords decode_chunked_work(i64 item, int heads, int batch,
                                                                  int num_blocks, int chunk) {
  const i64 per_chunk = static_cast<i64>(chunk) * num_blocks;
  const i64 first = item / per_chunk * chunk;  // the chunk's first (batch, head)
  const i64 within = item - first * num_blocks;
  const i64 total = static_cast<i64>(batch) * heads;
  const int size = static_cast<int>(total - first < chunk ? total - first : chunk);
  const int step = static_cast<int>(within / size);
  const i64 bh = first + (within - static_cast<i64>(step) * size);
  BlockCoords c;
  c.block = num_blocks - 1 - step;
  c.batch = static_cast<int>(bh / heads);
  c.head = static_cast<int>(bh - static_cast<i64>(c.batch) * heads);
  return c;
}

// The first item of this block's step `step` (0, 1, 2, ...) and whether the walk is over. Paired:
// items 2 i, 2 i + 1 of each round of 2 G (G = gridDim.x); else item i of each round of G. A step
// may give an item >= num_work (skip it); the walk ends at the first round past the list.
// In a snake (packed lists, whose items get cheaper along the list: work_list.cuh; the chunked
// order above): odd rounds go the other way (block b takes position G - 1 - b), so that no block
// takes the heaviest item of every round; simulated on long-tailed batches, the busiest block's
// work fell from 1.02-1.05x the mean to 1.005-1.02x (docs/perf/NOTES.md, v19).
template <bool SNAKE = false>
struct WorkWalk {
  i64 num_work;
  bool paired;
  bool snake = SNAKE;
  __device__ __forceinline__ i64 item(int step) const {
    const i64 grid = gridDim.x;
    if (!snake)
      return paired ? 2 * grid * (step >> 1) + 2 * blockIdx.x + (step & 1) : grid * step + blockIdx.x;
    const i64 round = paired ? step >> 1 : step;
    const i64 slot = (round & 1) ? grid - 1 - blockIdx.x : blockIdx.x;
    return paired ? 2 * (grid * round + slot) + (step & 1) : grid * round + slot;
  }
  __device__ __forceinline__ bool done(int step) const {  // the first round past the list
    const i64 grid = gridDim.x;
    return (paired ? 2 * grid * (step >> 1) : grid * step) >= num_work;
  }
};

}  // namespace cuflash
