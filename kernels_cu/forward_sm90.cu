// forward_sm90.cu: the FlashAttention-2 forward pass on Hopper's warpgroup tensor cores (sm_90a:
// wgmma.mma_async, float16 / bfloat16 operands, float32 accumulation). Same contract as
// forward.cu: writes O and lse, any Nq, Nk, d <= HD, causal bottom-right, grouped heads, strides.
//
// One thread block owns BM = 64 * WARPGROUPS query rows of one (batch, head); each warpgroup owns
// 64 of them (the loop body is forward_sm90.cuh). Q stays in shared memory (wgmma reads its A
// operand from there); K_j and V_j stream through two shared-memory stages with cp.async issued by
// every thread, so tile j + 1 loads while tile j is computed, with one block-wide barrier per
// tile. It reads any strides and head dim; where the TMA unit can read the inputs (16-byte
// aligned rows), forward_sm90_tma.cu runs instead.
#include "common.cuh"
#include "mma.cuh"
#include "tile.cuh"
#include "mask.cuh"
#include "gemm.cuh"
#include "wgmma.cuh"
#include "repair.cuh"
#include "forward_sm90.cuh"

namespace cuflash {

template <typename Elem, int HD, int BM, int BN>
__global__ void __launch_bounds__(BM * 2, 1)
    attention_forward_wgmma(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                            const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
                            float* __restrict__ lse, i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb,
                            i64 k_sh, i64 k_ss, i64 v_sb, i64 v_sh, i64 v_ss, i64 o_sb, i64 o_sh,
                            i64 o_ss, int hq, int group, int nq, int nk, int d, float scale,
                            int causal, int vec, int num_m_blocks, float p_shift) {
  typedef Sm90ForwardTraits<Elem, HD, BM, BN> Tr;
  static_assert(BM * Tr::PITCH * 2 <= Tr::Q_BYTES + 4 * Tr::KV_BYTES, "staging tile fits the buffers");
  extern __shared__ unsigned char smem_raw[];
  // Swizzled tiles must start on 1024-byte boundaries; the host adds 1 KB of slack for this.
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

  const BlockCoords bc = decode_block(hq, num_m_blocks);
  const int kv_head = bc.head / group;
  const int warp = threadIdx.x >> 5;

  Sm90ForwardBlock<Tr, Elem, HD, BM, BN> blk;
  blk.sQ = smem;
  blk.sK = smem + Tr::Q_BYTES;
  blk.sV = blk.sK + 2 * Tr::KV_BYTES;
  blk.m0 = bc.block * BM;
  blk.nq = nq;
  blk.nk = nk;
  blk.lane = threadIdx.x & 31;
  blk.warp_row0 = warp * 16;
  blk.wg = warp >> 2;
  blk.causal = causal != 0;
  blk.scale_log2 = scale * 1.4426950408889634f;
  fill(blk.acc_o, 0.f);
  blk.softmax.init(p_shift);  // see forward.cu

  const bool use_vec = vec != 0;
  const unsigned short* k_head = head_ptr(k, make_strides(k_sb, k_sh, k_ss), bc.batch, kv_head);
  const unsigned short* v_head = head_ptr(v, make_strides(v_sb, v_sh, v_ss), bc.batch, kv_head);
  const KeyTiles tiles = key_tiles_for_queries(blk.m0, BM, BN, nq, nk, blk.causal);
  const unsigned short* q_head = head_ptr(q, make_strides(q_sb, q_sh, q_ss), bc.batch, bc.head);
  load_tile_swizzled<BM, HD, Tr::NTHREADS>(smem, q_head, q_ss, blk.m0, nq, d, use_vec);
  if (tiles.count > 0) {
    const int first = key_tile_at(0, tiles) * BN;
    load_tile_swizzled<BN, HD, Tr::NTHREADS>(smem + Tr::Q_BYTES, k_head, k_ss, first, nk, d, use_vec);
    load_tile_swizzled<BN, HD, Tr::NTHREADS>(smem + Tr::Q_BYTES + 2 * Tr::KV_BYTES, v_head, v_ss,
                                             first, nk, d, use_vec);
  }
  cp_async_commit();

  // The tiles that straddle the diagonal or the end of the keys first (mask.cuh, key_tile_at).
  // Rows that they made non-finite are flagged and recomputed at the end (repair.cuh).
  const int masked = tiles.count - tiles.full;
  // The flag slot is built at each use from these two: a FlagSlot held through the loop spills.
  float* lse_row_g = lse + (static_cast<i64>(bc.batch) * hq + bc.head) * nq + blk.m0 +
                     blk.warp_row0 + (blk.lane >> 2);
  const bool real_row_g = blk.m0 + blk.warp_row0 + (blk.lane >> 2) < nq;
  for (int it = 0; it < tiles.count; ++it) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // this tile has landed everywhere; every warpgroup is done with the last one
    const int next = key_tile_at(it + 1, tiles);
    if (next >= 0) {
      unsigned char* k_next = smem + Tr::Q_BYTES + ((it + 1) & 1) * Tr::KV_BYTES;
      load_tile_swizzled<BN, HD, Tr::NTHREADS>(k_next, k_head, k_ss, next * BN, nk, d, use_vec);
      load_tile_swizzled<BN, HD, Tr::NTHREADS>(k_next + 2 * Tr::KV_BYTES, v_head, v_ss, next * BN,
                                               nk, d, use_vec);
      cp_async_commit();
    }
    if (it < masked) {
      blk.template process_key_tile<true>(key_tile_at(it, tiles), it & 1);
      if (it == masked - 1) park_flags(lse_flag_slot(lse_row_g, real_row_g, blk.lane), nonfinite_rows(blk.acc_o));
    } else {
      blk.template process_key_tile<false>(key_tile_at(it, tiles), it & 1);
    }
  }

  // Epilogue: normalise once, stage O through shared memory (row pitch HD + 8), wide stores.
  float lse_rows[1][2];
  blk.softmax.finalize(blk.acc_o, blk.scale_log2, lse_rows);
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup is done reading the pipeline buffers
  unsigned short* s_out = reinterpret_cast<unsigned short*>(smem);
  stage_accumulators<Elem, 1, Tr::NT_O, Tr::PITCH>(s_out + blk.warp_row0 * Tr::PITCH, blk.acc_o,
                                                     1.f, blk.lane);
  const unsigned repair = masked > 0 ? unpark_flags(lse_flag_slot(lse_row_g, real_row_g, blk.lane)) : 0u;
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
    __syncwarp();
    recompute_forward_rows<Elem, HD, 1>(s_out + blk.warp_row0 * Tr::PITCH, Tr::PITCH, HD, repair,
                                        lse_rows, blk.scale_log2, HeadRows{q_head, q_ss},
                                        HeadRows{k_head, k_ss}, HeadRows{v_head, v_ss},
                                        blk.m0 + blk.warp_row0, min(tiles.count * BN, nk), nq, nk,
                                        d, blk.causal, blk.lane);
  }
  __syncthreads();
  unsigned short* o_head = head_ptr(o, make_strides(o_sb, o_sh, o_ss), bc.batch, bc.head);
  store_tile<BM, HD, Tr::PITCH, Tr::NTHREADS>(o_head, s_out, o_ss, blk.m0, nq, d, use_vec);
  if ((blk.lane & 3) == 0) {
    float* lse_head = lse + (static_cast<i64>(bc.batch) * hq + bc.head) * nq;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = blk.m0 + blk.warp_row0 + (blk.lane >> 2) + 8 * r;
      if (row < nq) lse_head[row] = lse_rows[0][r];
    }
  }
}

}  // namespace cuflash
