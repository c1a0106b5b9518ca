// tile.cuh: moving (rows x head-dim) tiles between global and shared memory.
//
// A tile covers rows [row0, row0 + ROWS) of one head's (N x d) matrix, whose rows are `stride`
// elements apart and whose last dimension is contiguous. In shared memory it is ROWS rows of
// PITCH elements. Rows >= nrows and columns >= d are zero-filled on load and skipped on store,
// so any N and any d <= HD work; zeros (not garbage) matter: a padded V row times P = 0 must give 0.
//
// Two paths: `vec` (the host checked that every pointer is 16-byte aligned and every stride and d
// are multiples of 16 bytes' worth of elements) copies 16-byte chunks with cp.async; otherwise
// elements are copied one by one with ordinary loads and stores.
#pragma once
#include "common.cuh"
#include "mma.cuh"

namespace cuflash {

template <int ROWS, int HD, int PITCH, int NTHREADS, typename S>
__device__ __forceinline__ void load_tile(S* smem, const S* g, i64 stride, int row0, int nrows,
                                          int d, bool vec) {
  constexpr int CHUNK = 16 / sizeof(S);
  constexpr bool CAN_VEC = (PITCH * sizeof(S)) % 16 == 0 && HD % CHUNK == 0;
  if constexpr (CAN_VEC) {
    if (vec) {
      constexpr int CHUNKS_PER_ROW = HD / CHUNK;
#pragma unroll
      for (int idx = threadIdx.x; idx < ROWS * CHUNKS_PER_ROW; idx += NTHREADS) {
        const int r = idx / CHUNKS_PER_ROW;
        const int c = (idx % CHUNKS_PER_ROW) * CHUNK;
        const bool valid = row0 + r < nrows && c < d;
        const S* src = valid ? g + static_cast<i64>(row0 + r) * stride + c : g;
        cp_async_16(smem_addr(smem + r * PITCH + c), src, valid);
      }
      return;
    }
  }
#pragma unroll 1
  for (int idx = threadIdx.x; idx < ROWS * HD; idx += NTHREADS) {
    const int r = idx / HD;
    const int c = idx % HD;
    S x = S(0);
    if (row0 + r < nrows && c < d) x = g[static_cast<i64>(row0 + r) * stride + c];
    smem[r * PITCH + c] = x;
  }
}

template <int ROWS, int HD, int PITCH, int NTHREADS, typename S>
__device__ __forceinline__ void store_tile(S* g, const S* smem, i64 stride, int row0, int nrows,
                                           int d, bool vec) {
  constexpr int CHUNK = 16 / sizeof(S);
  constexpr bool CAN_VEC = (PITCH * sizeof(S)) % 16 == 0 && HD % CHUNK == 0;
  if constexpr (CAN_VEC) {
    if (vec) {
      constexpr int CHUNKS_PER_ROW = HD / CHUNK;
#pragma unroll
      for (int idx = threadIdx.x; idx < ROWS * CHUNKS_PER_ROW; idx += NTHREADS) {
        const int r = idx / CHUNKS_PER_ROW;
        const int c = (idx % CHUNKS_PER_ROW) * CHUNK;
        if (row0 + r < nrows && c < d) {
          *reinterpret_cast<uint4*>(g + static_cast<i64>(row0 + r) * stride + c) =
              *reinterpret_cast<const uint4*>(smem + r * PITCH + c);
        }
      }
      return;
    }
  }
#pragma unroll 1
  for (int idx = threadIdx.x; idx < ROWS * HD; idx += NTHREADS) {
    const int r = idx / HD;
    const int c = idx % HD;
    if (row0 + r < nrows && c < d) g[static_cast<i64>(row0 + r) * stride + c] = smem[r * PITCH + c];
  }
}

}  // namespace cuflash
