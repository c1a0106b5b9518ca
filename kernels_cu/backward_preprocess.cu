// backward_preprocess.cu: D_i = rowsum(dO_i * O_i), the first step of the backward pass.
//
// One warp per row: the lanes stride over the head dimension and reduce with shuffles. D is
// accumulated in the accumulator type (float32 for 16-bit inputs, float64 for the exact path's
// float32 and float64) and written contiguously as (B, Hq, Nq).
#include "common.cuh"

namespace cuflash {

constexpr int PREPROCESS_ROWS_PER_BLOCK = 8;

template <typename Elem>
__global__ void __launch_bounds__(PREPROCESS_ROWS_PER_BLOCK * 32)
    attention_backward_preprocess(const typename ElemTraits<Elem>::storage* __restrict__ o,
                                  const typename ElemTraits<Elem>::storage* __restrict__ dout,
                                  typename ElemTraits<Elem>::acc* __restrict__ delta, i64 o_sb,
                                  i64 o_sh, i64 o_ss, i64 do_sb, i64 do_sh, i64 do_ss, int hq,
                                  int nq, int d, i64 rows) {
  typedef typename ElemTraits<Elem>::acc Acc;
  const int lane = threadIdx.x & 31;
  const i64 row = static_cast<i64>(blockIdx.x) * PREPROCESS_ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (row >= rows) return;
  const i64 bh = row / nq;
  const int i = static_cast<int>(row - bh * nq);
  const int b = static_cast<int>(bh / hq);
  const int h = static_cast<int>(bh - static_cast<i64>(b) * hq);
  const auto* o_row = o + b * o_sb + h * o_sh + i * o_ss;
  const auto* do_row = dout + b * do_sb + h * do_sh + i * do_ss;
  Acc sum = Acc(0);
  for (int c = lane; c < d; c += 32) {
    sum += ElemTraits<Elem>::to_acc(o_row[c]) * ElemTraits<Elem>::to_acc(do_row[c]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) delta[row] = sum;
}

}  // namespace cuflash
