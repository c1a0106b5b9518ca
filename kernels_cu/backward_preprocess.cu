// backward_preprocess.cu: D_i = rowsum(dO_i * O_i), the first step of the backward pass.
//
// A row is reduced by `lanes_per_row` lanes of a warp (a power of two, 1 .. 32), so a warp covers
// 32 / lanes_per_row rows; the lanes stride over the head dimension and reduce with shuffles. With
// `vec` (16-bit elements, 16-byte aligned rows: the host checks) each lane reads 16-byte chunks of
// 8 elements, so that a short row (d = 64: 8 lanes) still moves enough bytes per load to keep the
// memory busy; otherwise element by element (lanes_per_row = 32). D is accumulated in the
// accumulator type (float32 for 16-bit inputs, float64 for the exact path's float32 and float64)
// and written contiguously as (B, Hq, Nq). Before the fused backward it also zeroes that kernel's
// counters.
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

constexpr int PREPROCESS_WARPS = 8;

template <typename Elem>
__global__ void __launch_bounds__(PREPROCESS_WARPS * 32)
    attention_backward_preprocess(const __grid_constant__ Params p) {
  typedef typename ElemTraits<Elem>::acc Acc;
  typedef typename ElemTraits<Elem>::storage Storage;
  const int lanes_per_row = p.lanes_per_row, d = p.head_dim;
  const int lane = threadIdx.x & 31, sub = lane & (lanes_per_row - 1);
  const i64 warp = static_cast<i64>(blockIdx.x) * PREPROCESS_WARPS + (threadIdx.x >> 5);
  const i64 row = warp * (32 / lanes_per_row) + lane / lanes_per_row;
  Acc sum = Acc(0);
  int b = 0, h = 0, i = 0;
  if (row < p.rows) {
    const i64 bh = row / p.seq_q;
    i = static_cast<int>(row - bh * p.seq_q);
    b = static_cast<int>(bh / p.heads_q);
    h = static_cast<int>(bh - static_cast<i64>(b) * p.heads_q);
    const Storage* o_row = head_rows<const Storage>(p.o, b, h).row(i);
    const Storage* do_row = head_rows<const Storage>(p.dout, b, h).row(i);
    bool done = false;
    if constexpr (sizeof(Storage) == 2) {
      if (p.vec) {
        for (int c = sub * 8; c < d; c += lanes_per_row * 8) {
          const uint4 ov = *reinterpret_cast<const uint4*>(o_row + c);
          const uint4 dv = *reinterpret_cast<const uint4*>(do_row + c);
          const unsigned ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            sum += ElemTraits<Elem>::to_acc(static_cast<unsigned short>(ow[w] & 0xffffu)) *
                   ElemTraits<Elem>::to_acc(static_cast<unsigned short>(dw[w] & 0xffffu));
            sum += ElemTraits<Elem>::to_acc(static_cast<unsigned short>(ow[w] >> 16)) *
                   ElemTraits<Elem>::to_acc(static_cast<unsigned short>(dw[w] >> 16));
          }
        }
        done = true;
      }
    }
    if (!done)
      for (int c = sub; c < d; c += lanes_per_row)
        sum += ElemTraits<Elem>::to_acc(o_row[c]) * ElemTraits<Elem>::to_acc(do_row[c]);
  }
  for (int off = lanes_per_row >> 1; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (sub == 0 && row < p.rows) {
    *head_rows<Acc>(p.delta, b, h).row(i) = sum;
    // The fused backward's counters (backward_sm90_fused.cu): one per query tile, zeroed by the
    // tile's first row.
    if (p.dq_semaphores != nullptr && i % p.dq_tile_rows == 0)
      p.dq_semaphores[(static_cast<i64>(b) * p.heads_q + h) * ceil_div(p.seq_q, p.dq_tile_rows) +
                      i / p.dq_tile_rows] = 0;
  }
}

}  // namespace cuflash
