// backward_sm90_tma.cuh: what the warp-specialised Hopper backward kernels share
// (backward_sm90_tma.cu, backward_sm90_fused.cu): tile loads through the tensor maps of q, k, v and
// dO, and the producer's staging of lse2 and D.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "tma.cuh"
#include "backward_sm90.cuh"

namespace cuflash {

constexpr int TMA_BOX_ROWS = 64;  // rows of one TMA box (the host's tensor maps, cuflash/_tma.py)

// Copies rows [row0, row0 + ROWS) (all HD columns) of one head of a tensor map into a swizzled
// tile, completing on `bar`: ROWS / 64 x HD / 64 boxes.
template <int ROWS, int HD>
__device__ __forceinline__ void tma_load_tile(unsigned char* tile, const TensorMap* map,
                                              unsigned long long* bar, int row0, int head,
                                              int batch) {
#pragma unroll
  for (int c = 0; c < HD / 64; ++c)
#pragma unroll
    for (int rb = 0; rb < ROWS / TMA_BOX_ROWS; ++rb)
      tma_load_4d(tile + c * (ROWS * 128) + rb * (TMA_BOX_ROWS * 128), map, bar, 64 * c,
                  row0 + rb * TMA_BOX_ROWS, head, batch);
}

// The tensor maps of q, k, v and dO, read in boxes of 64 rows (cuflash/_tma.py).
struct BackwardMaps {
  TensorMap q, k, v, dout;
};

// Producer warp: stages lse2 and D of query rows [m0, m0 + ROWS) of head `head` of sequence `seq`,
// one row per lane.
template <int ROWS, bool PACKED>
__device__ __forceinline__ void stage_lse_and_delta(float* s_lse2, float* s_delta, const Params& p,
                                                    const Seq<PACKED>& seq, int head, int m0,
                                                    int lane) {
  const HeadRows<const float> lse = seq.template q_rows<const float>(p.lse, head);
  const HeadRows<const float> delta = seq.template q_rows<const float>(p.delta, head);
  const int nq = seq.nq(p);
#pragma unroll
  for (int r = lane; r < ROWS; r += 32) {
    const int row = m0 + r;
    s_lse2[r] = lse2_of_row(row < nq ? *lse.row(row) : 0.f, row < nq);
    s_delta[r] = row < nq ? *delta.row(row) : 0.f;
  }
}

}  // namespace cuflash
