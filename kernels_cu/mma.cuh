// mma.cuh: wrappers for the sm_80+ instructions the tensor-core kernels are built from:
// cp.async (global -> shared copies), ldmatrix (shared -> register fragments) and
// mma.sync m16n8k16 (16x8x16 matrix product, fp16/bf16 operands, fp32 accumulators).
//
// Fragment layout of mma.m16n8k16 (lane = 4 * g + t):
//   A (16x16, row-major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16x8, "col"):      b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C (16x8, fp32):       c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
#pragma once
#include "common.cuh"

namespace cuflash {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; with `valid` false the 16 bytes are zero-filled and
// nothing is read (src must still be a mapped address, callers pass the tensor's base).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N committed groups of this thread are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices from shared memory; lane l supplies the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// As ldmatrix_x4, each 8x8 matrix transposed on the way.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += A * B for one m16n8k16 tile.
template <typename Elem>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1);

template <>
__device__ __forceinline__ void mma_16816<f16>(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                               unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<bf16>(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                                unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Lane offsets (row, col) into a 16x16 block for the ldmatrix_x4 address patterns used below.
// A operand, row-major tile [m][k]: matrices (m0-7,k0-7), (m8-15,k0-7), (m0-7,k8-15), (m8-15,k8-15).
__device__ __forceinline__ int a_frag_row(int lane) { return lane & 15; }
__device__ __forceinline__ int a_frag_col(int lane) { return (lane >> 4) << 3; }
// B operand of two n8 tiles stored as [n][k] (e.g. K for Q K^T): matrices
// (n0-7,k0-7), (n0-7,k8-15), (n8-15,k0-7), (n8-15,k8-15) -> b0,b1 of tile 0, b0,b1 of tile 1.
__device__ __forceinline__ int bt_frag_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int bt_frag_col(int lane) { return ((lane >> 3) & 1) << 3; }
// B operand of two n8 tiles stored as [k][n] (e.g. V for P V), read with ldmatrix .trans:
// matrices (k0-7,n0-7), (k8-15,n0-7), (k0-7,n8-15), (k8-15,n8-15).
__device__ __forceinline__ int b_frag_row(int lane) { return (lane & 7) + (((lane >> 3) & 1) << 3); }
__device__ __forceinline__ int b_frag_col(int lane) { return (lane >> 4) << 3; }

// Converts two n8 accumulator tiles (16 x 16 of fp32, C layout) into one A fragment (16 x 16 of
// Elem): the register reuse that lets P and dS stay in registers between two matrix products.
template <typename Elem>
__device__ __forceinline__ void accum_to_a_frag(unsigned (&a)[4], const float (&c0)[4],
                                                const float (&c1)[4]) {
  a[0] = ElemTraits<Elem>::pack2(c0[0], c0[1]);
  a[1] = ElemTraits<Elem>::pack2(c0[2], c0[3]);
  a[2] = ElemTraits<Elem>::pack2(c1[0], c1[1]);
  a[3] = ElemTraits<Elem>::pack2(c1[2], c1[3]);
}

// Butterfly reductions over the 4 lanes of a quad (the lanes that share an accumulator row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x for a normal x > 0 without the IEEE division's slow path (a call): rcp.approx (within an
// ulp) and one Newton step, r + r (1 - x r).
__device__ __forceinline__ float reciprocal_no_call(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return fmaf(fmaf(-x, r, 1.f), r, r);
}

// log2(x) by the MUFU (lg2.approx: absolute error about 2^-22 near 1)
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe, for a share of the exponentials where the MUFU unit binds
// (FlashAttention-4's trick): x rounded to the nearest integer j by adding 1.5 * 2^23 (the sum's
// low bits then hold j), 2^(x - j) by a cubic on [-1/2, 1/2] (relative error 8.3e-5; fitted for
// this, relative-error minimax by Lawson's iteration), times 2^j built in the exponent bits.
// max.NaN: x >= -126 keeps 2^j normal (x below gives 2^-126 where ex2 gives a denormal or 0, so
// callers take it for finite exponents above -126 or where such P do not count) and NaN stays NaN
// (the scale's bits then read 0.5). Nine instructions, six on the FMA pipe, for one MUFU.
__device__ __forceinline__ float exp2_on_fma(float x) {
  float c;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(c) : "f"(x), "f"(-126.f));
  const float t = c + 12582912.f;  // bits 0x4B400000 + j
  const float f = c - (t - 12582912.f);
  const float p = fmaf(fmaf(fmaf(0.055212993f, f, 0.24271414f), f, 0.69326216f), f, 0.99991959f);
  return p * __int_as_float((__float_as_int(t) << 23) + 0x3F800000);
}

// Writes an accumulator row pair (rows g and g + 8 of a warp's 16, times `factor`) as Elem to
// global memory (the C fragment layout above, one 16-row tile) in four-byte pieces: each lane
// writes its pairs, a quad 16 bytes of a row (half an L2 sector). Rows outside [0, nrows) and
// columns >= d (a multiple of 8) are skipped.
template <typename Elem, int NT>
__device__ __forceinline__ void store_accumulator_rows_narrow(unsigned short* head, i64 stride,
                                                              int row0, int nrows, int d,
                                                              const float (&acc)[NT][4],
                                                              float factor, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row < 0 || row >= nrows) continue;
    unsigned short* dst = head + row * stride;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = nt * 8 + 2 * t;
      if (col < d)
        *reinterpret_cast<unsigned*>(dst + col) =
            ElemTraits<Elem>::pack2(acc[nt][2 * r] * factor, acc[nt][2 * r + 1] * factor);
    }
  }
}

// Within each quad of lanes (t = lane & 3): word i of lane t goes to lane i as its word t (a 4 x 4
// transpose in two exchanges, xor 1 and xor 2, and selects: no local memory).
__device__ __forceinline__ void transpose_quad_words(unsigned (&w)[4], int t) {
  const bool b0 = t & 1, b1 = t & 2;
  // Keep the words bound for lanes with this lane's bit 0, swap the others with lane t ^ 1 ...
  const unsigned k0 = b0 ? w[1] : w[0], k2 = b0 ? w[3] : w[2];
  const unsigned r0 = __shfl_xor_sync(0xffffffffu, b0 ? w[0] : w[1], 1);
  const unsigned r2 = __shfl_xor_sync(0xffffffffu, b0 ? w[2] : w[3], 1);
  // ... then those bound for the other bit 1 with lane t ^ 2.
  const unsigned s0 = __shfl_xor_sync(0xffffffffu, b1 ? k0 : k2, 2);
  const unsigned s1 = __shfl_xor_sync(0xffffffffu, b1 ? r0 : r2, 2);
  const unsigned own = b1 ? k2 : k0, own1 = b1 ? r2 : r0;
  // own, own1, s0, s1 came from lanes t, t ^ 1, t ^ 2, t ^ 3: word s is lane s's.
  const unsigned p0 = b0 ? own1 : own, p1 = b0 ? own : own1;
  const unsigned p2 = b0 ? s1 : s0, p3 = b0 ? s0 : s1;
  w[0] = b1 ? p2 : p0;
  w[1] = b1 ? p3 : p1;
  w[2] = b1 ? p0 : p2;
  w[3] = b1 ? p1 : p3;
}

// The same in 16-byte pieces: each quad of lanes trades its packed pairs of four n-tiles so that
// lane t holds the 8 columns of n-tile 4j + t, and a row's 64 bytes go out as whole 32-byte
// sectors. Rows must be 16-byte aligned (head and stride).
template <typename Elem, int NT>
__device__ __forceinline__ void store_accumulator_rows_wide(unsigned short* head, i64 stride,
                                                            int row0, int nrows, int d,
                                                            const float (&acc)[NT][4],
                                                            float factor, int lane) {
  static_assert(NT % 4 == 0, "groups of four n-tiles");
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    const bool inside = row >= 0 && row < nrows;
    unsigned short* dst = head + static_cast<i64>(inside ? row : 0) * stride;
#pragma unroll
    for (int j = 0; j < NT / 4; ++j) {
      unsigned w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        w[i] = ElemTraits<Elem>::pack2(acc[4 * j + i][2 * r] * factor,
                                       acc[4 * j + i][2 * r + 1] * factor);
      transpose_quad_words(w, t);  // every lane takes part, inside its rows or not
      const int col = (4 * j + t) * 8;
      if (inside && col < d)
        *reinterpret_cast<uint4*>(dst + col) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// Writes an accumulator row pair (rows g and g + 8 of a warp's 16, times `factor`) as Elem to
// global memory: O in the Hopper forward, dQ, dK and dV in the Hopper backward. In 16-byte pieces
// where NT is a multiple of 4, else in four-byte pieces. Four-byte stores fill half an L2 sector
// each, and every block writes its rows at about the same time: at d = 256 that took 8,000-12,000
// cycles of a forward item, 15-20% of its time at 1k (docs/perf/NOTES.md, v28). The callers' rows
// are 16-byte aligned: their kernels run only as the launch for aligned pointers and strides
// (cuflash/_dispatch.py, Pair). A choice made here at run time would cost the backward's dK/dV
// kernels, at their register limit, up to 160 bytes of spills (both forms are kept live). Rows
// outside [0, nrows) and columns >= d (a multiple of 8) are skipped.
template <typename Elem, int NT>
__device__ __forceinline__ void store_accumulator_rows(unsigned short* head, i64 stride, int row0,
                                                       int nrows, int d, const float (&acc)[NT][4],
                                                       float factor, int lane) {
  if constexpr (NT % 4 == 0)
    store_accumulator_rows_wide<Elem, NT>(head, stride, row0, nrows, d, acc, factor, lane);
  else
    store_accumulator_rows_narrow<Elem, NT>(head, stride, row0, nrows, d, acc, factor, lane);
}

}  // namespace cuflash
