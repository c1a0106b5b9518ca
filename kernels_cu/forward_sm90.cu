// forward_sm90.cu: the FlashAttention-2 forward pass on Hopper's warpgroup tensor cores (sm_90a:
// wgmma.mma_async, float16 / bfloat16 operands, float32 accumulation). Same contract as
// forward.cu: writes O and lse, any Nq, Nk, d <= HD, causal bottom-right, grouped heads, strides.
//
// One thread block owns BM = 64 * WARPGROUPS query rows of one (batch, head); each warpgroup owns
// 64 of them. Q stays in shared memory (wgmma reads its A operand from there); K_j and V_j stream
// through two shared-memory stages with cp.async, so tile j + 1 loads while tile j is computed.
// Per key tile a warpgroup issues S = Q K_j^T (A and B from shared memory), applies the online
// softmax in registers, and issues O += P V_j with P as a register A operand and V_j read
// transposed (MN-major) from shared memory: no shared-memory round trip for P, no transposed copy.
#include "common.cuh"
#include "mma.cuh"
#include "tile.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "gemm.cuh"
#include "wgmma.cuh"
#include "repair.cuh"

namespace cuflash {

template <typename Elem, int HD, int BM, int BN>
struct Sm90ForwardTraits {
  static constexpr int WARPGROUPS = BM / 64;
  static constexpr int NTHREADS = WARPGROUPS * 128;
  static constexpr int NT_S = BN / 8, NT_O = HD / 8;
  static constexpr int K_QK = HD / 16, K_PV = BN / 16;
  static constexpr int Q_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2;  // one tile, swizzled
  static constexpr int PITCH = HD + 8;  // the epilogue's staging tile (gemm.cuh layout)
  static_assert(HD % 64 == 0, "swizzled tiles are built from 64-column blocks");
  static_assert(BM % 64 == 0 && BN % 16 == 0 && BN <= 256 && HD <= 256, "wgmma shapes");
  static_assert(BM * PITCH * 2 <= Q_BYTES + 4 * KV_BYTES, "staging tile fits the pipeline buffers");
};

template <typename Tr, typename Elem, int HD, int BM, int BN>
struct Sm90ForwardBlock {
  const unsigned char *sQ, *sK, *sV;  // sQ: the whole Q tile; sK, sV: stage 0 of two
  int m0, nq, nk, lane, warp_row0, wg;
  bool causal;
  float scale_log2;
  float acc_o[1][Tr::NT_O][4];
  OnlineSoftmax<1> softmax;

  // S_ij = -inf where query i may not see key j (causal diagonal, keys past the end).
  __device__ __forceinline__ void apply_mask(float (&s)[1][Tr::NT_S][4], int n0) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < Tr::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m0 + warp_row0 + g + ((e >> 1) << 3);
        const int j = n0 + nt * 8 + 2 * t + (e & 1);
        if (!key_visible(i, j, nq, nk, causal)) s[0][nt][e] = -inf_f32();
      }
  }

  // Key tile j, which sits in pipeline stage `stage`.
  template <bool MASKED>
  __device__ __forceinline__ void process_key_tile(int j, int stage) {
    const unsigned char* k_tile = sK + stage * Tr::KV_BYTES;
    const unsigned char* v_tile = sV + stage * Tr::KV_BYTES;
    // S = Q K_j^T: k16 step kk reads 32 bytes of every row, in column block kk / 4.
    float s[1][Tr::NT_S][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::K_QK; ++kk) {
      const int block = kk >> 2, within = (kk & 3) * 32;
      const unsigned long long dq =
          smem_desc(sQ + block * (BM * 128) + wg * (64 * 128) + within, 16, 1024);
      const unsigned long long dk = smem_desc(k_tile + block * (BN * 128) + within, 16, 1024);
      wgmma_ss<Elem, BN>(s[0], dq, dk, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(s[0]);
    if constexpr (MASKED) apply_mask(s, j * BN);
    softmax.update(s, acc_o, scale_log2);  // s now holds P (unnormalised); acc_o rescaled
    // O += P V_j: k16 step kk covers keys 16kk .. 16kk + 15, rows of V_j 2048 bytes apart.
    unsigned p[Tr::K_PV][4];
#pragma unroll
    for (int kk = 0; kk < Tr::K_PV; ++kk) accum_to_a_frag<Elem>(p[kk], s[0][2 * kk], s[0][2 * kk + 1]);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::K_PV; ++kk)
      wgmma_rs<Elem, HD>(acc_o[0], p[kk], smem_desc(v_tile + kk * 2048, BN * 128, 1024), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(acc_o[0]);
    // The A registers are read by the tensor cores until the wait: keep them alive until here.
#pragma unroll
    for (int kk = 0; kk < Tr::K_PV; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(p[kk][e])::"memory");
  }
};

template <typename Elem, int HD, int BM, int BN>
__global__ void __launch_bounds__(BM * 2, 1)
    attention_forward_wgmma(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                            const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
                            float* __restrict__ lse, i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb,
                            i64 k_sh, i64 k_ss, i64 v_sb, i64 v_sh, i64 v_ss, i64 o_sb, i64 o_sh,
                            i64 o_ss, int hq, int group, int nq, int nk, int d, float scale,
                            int causal, int vec, int num_m_blocks, float p_shift) {
  typedef Sm90ForwardTraits<Elem, HD, BM, BN> Tr;
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
    recompute_forward_rows<Elem, HD, 1>(s_out + blk.warp_row0 * Tr::PITCH, Tr::PITCH, repair,
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
