// gemm.cuh: the two warp-level tile products every tensor-core kernel is made of.
//
//   gemm_abt: C += A B^T   A = MT 16-row tiles (shared memory or registers), B = rows of a
//                          shared tile stored [n][k]         (S = Q K^T, dP = dO V^T, ...)
//   gemm_pb:  C += P B     P = fp32 accumulators of an earlier product, rounded to Elem in
//                          registers; B = a shared tile stored [k][n]  (O += P V, dQ += dS K, ...)
//
// Shared tiles are row-major with a pitch of (HD + 8) elements, which makes every ldmatrix phase
// touch 8 distinct 16-byte bank groups; the `_in` forms take B in another layout (TileB::at).
#pragma once
#include "common.cuh"
#include "mma.cuh"

namespace cuflash {

// Where element (row, col0 + col1) of a shared tile lives (col0 + col1 within one 16-byte unit's
// reach: col1 < 8 or both multiples of 8): at(row, col) elements from the tile's start, and
// address(tile, row, col0, col1) the pointer. Row-major with a pitch of PITCH elements ...
template <int PITCH>
struct PitchedTile {
  static __device__ __forceinline__ int at(int row, int col) { return row * PITCH + col; }
  // (the sums in the order the products always took: the same PTX for every existing caller,
  // whose mma.sync kernels sit at the register limit)
  template <typename T>
  static __device__ __forceinline__ T* address(T* tile, int row, int col0, int col1) {
    return tile + row * PITCH + col0 + col1;
  }
};

// ... or as the TMA unit writes boxes of ROWS rows x 64 columns under the 128-byte swizzle: one box
// after the other (columns 0-63, 64-127, ...), the 16-byte unit u of row r at unit u ^ (r & 7) of
// its 128-byte row. A pointer to row r0 of a tile (r0 a multiple of 8) is a tile of the same kind.
template <int ROWS>
struct Swizzled128Tile {
  static __device__ __forceinline__ int at(int row, int col) {
    return (col >> 6) * (ROWS * 64) + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
  }
  template <typename T>
  static __device__ __forceinline__ T* address(T* tile, int row, int col0, int col1) {
    return tile + at(row, col0 + col1);
  }
};

template <int A, int B>
__device__ __forceinline__ void fill(float (&c)[A][B][4], float value) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = value;
}

// A fragments of MT 16-row tiles x KSTEPS k16 steps, from a row-major shared tile.
template <int MT, int KSTEPS, int PITCH>
__device__ __forceinline__ void load_a_frags(unsigned (&a)[MT][KSTEPS][4], const unsigned short* sA,
                                             int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
      ldmatrix_x4(a[mt][kk], smem_addr(sA + (mt * 16 + a_frag_row(lane)) * PITCH + kk * 16 +
                                       a_frag_col(lane)));
}

// One k16 step of C += A B^T against NT n8 tiles of B (stored [n][k], layout TileB).
template <typename Elem, int MT, int NT, typename TileB>
__device__ __forceinline__ void gemm_abt_step_in(float (&c)[MT][NT][4], const unsigned (&a)[MT][4],
                                                 const unsigned short* sB, int kk, int lane) {
  static_assert(NT % 2 == 0, "B tiles are loaded in pairs");
#pragma unroll
  for (int nn = 0; nn < NT / 2; ++nn) {
    unsigned b[4];
    ldmatrix_x4(b, smem_addr(TileB::address(sB, nn * 16 + bt_frag_row(lane), kk * 16, bt_frag_col(lane))));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma_16816<Elem>(c[mt][2 * nn], a[mt], b[0], b[1]);
      mma_16816<Elem>(c[mt][2 * nn + 1], a[mt], b[2], b[3]);
    }
  }
}

// The same with B of pitch PB.
template <typename Elem, int MT, int NT, int PB>
__device__ __forceinline__ void gemm_abt_step(float (&c)[MT][NT][4], const unsigned (&a)[MT][4],
                                              const unsigned short* sB, int kk, int lane) {
  gemm_abt_step_in<Elem, MT, NT, PitchedTile<PB>>(c, a, sB, kk, lane);
}

// C += A B^T with A read from shared memory (row pitch PA) one k step at a time.
template <typename Elem, int MT, int NT, int KSTEPS, int PA, int PB>
__device__ __forceinline__ void gemm_abt(float (&c)[MT][NT][4], const unsigned short* sA,
                                         const unsigned short* sB, int lane) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    unsigned a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      ldmatrix_x4(a[mt], smem_addr(sA + (mt * 16 + a_frag_row(lane)) * PA + kk * 16 +
                                   a_frag_col(lane)));
    gemm_abt_step<Elem, MT, NT, PB>(c, a, sB, kk, lane);
  }
}

// C += A B^T with A already held in registers (B in layout TileB) ...
template <typename Elem, int MT, int NT, int KSTEPS, typename TileB>
__device__ __forceinline__ void gemm_abt_in(float (&c)[MT][NT][4],
                                            const unsigned (&a_frags)[MT][KSTEPS][4],
                                            const unsigned short* sB, int lane) {
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    unsigned a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) a[mt][e] = a_frags[mt][kk][e];
    gemm_abt_step_in<Elem, MT, NT, TileB>(c, a, sB, kk, lane);
  }
}

// ... or of pitch PB.
template <typename Elem, int MT, int NT, int KSTEPS, int PB>
__device__ __forceinline__ void gemm_abt(float (&c)[MT][NT][4], const unsigned (&a_frags)[MT][KSTEPS][4],
                                         const unsigned short* sB, int lane) {
  gemm_abt_in<Elem, MT, NT, KSTEPS, PitchedTile<PB>>(c, a_frags, sB, lane);
}

// C += P B: P is a (MT*16) x (KSTEPS*16) fp32 accumulator tile, rounded to Elem one k step at a
// time; B is KSTEPS*16 rows x NT*8 columns of a shared tile stored [k][n] (layout TileB) ...
template <typename Elem, int MT, int NT, int KSTEPS, typename TileB>
__device__ __forceinline__ void gemm_pb_in(float (&c)[MT][NT][4], const float (&p)[MT][2 * KSTEPS][4],
                                           const unsigned short* sB, int lane) {
  static_assert(NT % 2 == 0, "B tiles are loaded in pairs");
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    unsigned a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) accum_to_a_frag<Elem>(a[mt], p[mt][2 * kk], p[mt][2 * kk + 1]);
#pragma unroll
    for (int nn = 0; nn < NT / 2; ++nn) {
      unsigned b[4];
      ldmatrix_x4_trans(b, smem_addr(TileB::address(sB, kk * 16 + b_frag_row(lane), nn * 16, b_frag_col(lane))));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<Elem>(c[mt][2 * nn], a[mt], b[0], b[1]);
        mma_16816<Elem>(c[mt][2 * nn + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// ... or of pitch PB.
template <typename Elem, int MT, int NT, int KSTEPS, int PB>
__device__ __forceinline__ void gemm_pb(float (&c)[MT][NT][4], const float (&p)[MT][2 * KSTEPS][4],
                                        const unsigned short* sB, int lane) {
  gemm_pb_in<Elem, MT, NT, KSTEPS, PitchedTile<PB>>(c, p, sB, lane);
}

// Writes an fp32 accumulator tile (MT 16-row tiles x NT n8 tiles, times `factor`) as Elem into a
// row-major shared tile (pitch PITCH), the staging step before a wide store to global memory.
template <typename Elem, int MT, int NT, int PITCH>
__device__ __forceinline__ void stage_accumulators(unsigned short* s, const float (&c)[MT][NT][4],
                                                   float factor, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      unsigned short* p = s + (mt * 16 + g) * PITCH + nt * 8 + 2 * t;
      *reinterpret_cast<unsigned*>(p) = ElemTraits<Elem>::pack2(c[mt][nt][0] * factor, c[mt][nt][1] * factor);
      *reinterpret_cast<unsigned*>(p + 8 * PITCH) =
          ElemTraits<Elem>::pack2(c[mt][nt][2] * factor, c[mt][nt][3] * factor);
    }
}

}  // namespace cuflash
