// backward_sm90.cu: the dK/dV and dQ kernels on Hopper's warpgroup tensor cores (sm_90a, wgmma).
// Same contracts, arguments and arithmetic as backward_dkdv.cu and backward_dq.cu; the tiles live
// in shared memory in the 128-byte swizzled layout of wgmma.cuh, and each warpgroup owns 64 rows.
//
// dK/dV, per query tile i (a warpgroup owns 64 keys of the block):
//   S^T = K Q_i^T, dP^T = V dO_i^T              (A and B from shared memory, K-major)
//   P^T = exp(scale S^T - lse), dS^T = P^T (dP^T - D)   (registers, fragment layout of mma.sync)
//   dV += P^T dO_i, dK += dS^T Q_i               (A from registers, B read MN-major)
// dQ, per key tile j (a warpgroup owns 64 query rows):
//   S = Q K_j^T, dP = dO V_j^T, dS = P (dP - D), dQ += dS K_j
// The streamed tiles (Q_i and dO_i, or K_j and V_j) go through two cp.async stages: tile i + 1 loads
// while tile i is computed, with one block-wide barrier per tile. No atomics: deterministic.
#include "common.cuh"
#include "mma.cuh"
#include "tile.cuh"
#include "mask.cuh"
#include "gemm.cuh"
#include "wgmma.cuh"
#include "repair.cuh"
#include "backward_sm90.cuh"

namespace cuflash {

// ---------------------------------------------------------------------------------------------
// dQ

template <typename Elem, int HD, int BM, int BN>
__global__ void __launch_bounds__(BM * 2, 1) attention_backward_dq_wgmma(
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ delta, unsigned short* __restrict__ dq,
    i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb, i64 k_sh, i64 k_ss, i64 v_sb, i64 v_sh, i64 v_ss,
    i64 do_sb, i64 do_sh, i64 do_ss, i64 lse_sb, i64 lse_sh, i64 lse_ss, i64 dq_sb, i64 dq_sh,
    i64 dq_ss, int hq, int group, int nq, int nk, int d, float scale, int causal, int vec,
    int num_m_blocks) {
  constexpr int NTHREADS = BM * 2, NT_D = HD / 8;
  constexpr int ROWS_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2, PITCH = HD + 8;
  static_assert(HD % 64 == 0 && BM % 64 == 0 && BN % 16 == 0, "wgmma tile shapes");
  static_assert(BM * PITCH * 2 <= 2 * ROWS_BYTES + 4 * KV_BYTES, "staging tile fits");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sQ = smem;
  unsigned char* sdO = sQ + ROWS_BYTES;
  unsigned char* sK = sdO + ROWS_BYTES;  // two stages; V's two stages follow
  unsigned char* sV = sK + 2 * KV_BYTES;

  const BlockCoords bc = decode_block(hq, num_m_blocks);
  const int kv_head = bc.head / group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int m0 = bc.block * BM, warp_row0 = warp * 16;
  const bool is_causal = causal != 0, use_vec = vec != 0;

  Sm90DqRows<Elem, HD, BM, BN> rows;
  rows.sQ = sQ;
  rows.sdO = sdO;
  rows.wg = warp >> 2;
  rows.lane = lane;
  rows.scale_log2 = scale * 1.4426950408889634f;
  const float* lse_head = lse + bc.batch * lse_sb + bc.head * lse_sh;
  const float* delta_head = delta + (static_cast<i64>(bc.batch) * hq + bc.head) * nq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = m0 + warp_row0 + (lane >> 2) + 8 * r;
    rows.lse2[r] = lse2_of_row(row < nq ? lse_head[row * lse_ss] : 0.f, row < nq);
    rows.dlt[r] = row < nq ? delta_head[row] : 0.f;
    rows.last_key[r] = last_visible_key(row, nq, nk, is_causal);
  }
  rows.clear();

  const unsigned short* k_head = head_ptr(k, make_strides(k_sb, k_sh, k_ss), bc.batch, kv_head);
  const unsigned short* v_head = head_ptr(v, make_strides(v_sb, v_sh, v_ss), bc.batch, kv_head);
  const KeyTiles tiles = key_tiles_for_queries(m0, BM, BN, nq, nk, is_causal);
  const unsigned short* q_head = head_ptr(q, make_strides(q_sb, q_sh, q_ss), bc.batch, bc.head);
  const unsigned short* do_head = head_ptr(dout, make_strides(do_sb, do_sh, do_ss), bc.batch, bc.head);
  load_tile_swizzled<BM, HD, NTHREADS>(sQ, q_head, q_ss, m0, nq, d, use_vec);
  load_tile_swizzled<BM, HD, NTHREADS>(sdO, do_head, do_ss, m0, nq, d, use_vec);
  if (tiles.count > 0) {
    const int first = key_tile_at(0, tiles) * BN;
    load_tile_swizzled<BN, HD, NTHREADS>(sK, k_head, k_ss, first, nk, d, use_vec);
    load_tile_swizzled<BN, HD, NTHREADS>(sV, v_head, v_ss, first, nk, d, use_vec);
  }
  cp_async_commit();

  // Masked tiles first (mask.cuh, key_tile_at), then the unmasked ones. Rows that the masked
  // tiles made non-finite are flagged and recomputed at the end (repair.cuh).
  const int masked_tiles = tiles.count - tiles.full;
  unsigned repair = 0;
  for (int it = 0; it < tiles.count; ++it) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // this tile has landed; every warpgroup is done with the last one
    const int j = key_tile_at(it, tiles), j_next = key_tile_at(it + 1, tiles);
    if (j_next >= 0) {
      const int next = ((it + 1) & 1) * KV_BYTES;
      load_tile_swizzled<BN, HD, NTHREADS>(sK + next, k_head, k_ss, j_next * BN, nk, d, use_vec);
      load_tile_swizzled<BN, HD, NTHREADS>(sV + next, v_head, v_ss, j_next * BN, nk, d, use_vec);
      cp_async_commit();
    }
    rows.step(it < masked_tiles, j * BN, sK + (it & 1) * KV_BYTES, sV + (it & 1) * KV_BYTES);
    if (it == masked_tiles - 1)
      repair = nonfinite_rows(reinterpret_cast<float (&)[1][NT_D][4]>(rows.acc_dq));
  }

  // Epilogue: dQ = scale * acc, staged through shared memory (row pitch HD + 8).
  cp_async_wait<0>();
  __syncthreads();
  unsigned short* s_out = reinterpret_cast<unsigned short*>(smem);
  float (&acc)[1][NT_D][4] = reinterpret_cast<float (&)[1][NT_D][4]>(rows.acc_dq);
  stage_accumulators<Elem, 1, NT_D, PITCH>(s_out + warp_row0 * PITCH, acc, scale, lane);
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
    __syncwarp();
    recompute_dq_rows<Elem, HD, 1>(s_out + warp_row0 * PITCH, PITCH, HD, repair, scale, rows.scale_log2,
                                   HeadRows{q_head, q_ss}, HeadRows{do_head, do_ss},
                                   HeadRows{k_head, k_ss}, HeadRows{v_head, v_ss}, lse_head, lse_ss,
                                   delta_head, m0 + warp_row0, min(tiles.count * BN, nk), nq, nk, d,
                                   is_causal, lane);
  }
  __syncthreads();
  unsigned short* dq_head = head_ptr(dq, make_strides(dq_sb, dq_sh, dq_ss), bc.batch, bc.head);
  store_tile<BM, HD, PITCH, NTHREADS>(dq_head, s_out, dq_ss, m0, nq, d, use_vec);
}

// ---------------------------------------------------------------------------------------------
// dK and dV

template <typename Elem, int HD, int BM, int BN>
__global__ void __launch_bounds__(BN * 2, 1) attention_backward_dkdv_wgmma(
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ delta, unsigned short* __restrict__ dk,
    unsigned short* __restrict__ dv, i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb, i64 k_sh, i64 k_ss,
    i64 v_sb, i64 v_sh, i64 v_ss, i64 do_sb, i64 do_sh, i64 do_ss, i64 lse_sb, i64 lse_sh,
    i64 lse_ss, i64 dk_sb, i64 dk_sh, i64 dk_ss, i64 dv_sb, i64 dv_sh, i64 dv_ss, int hq,
    int group, int nq, int nk, int d, float scale, int causal, int vec, int num_n_blocks) {
  // BN keys per block (64 per warpgroup), query tiles of BM rows.
  constexpr int NTHREADS = BN * 2, NT_D = HD / 8;
  constexpr int KEYS_BYTES = BN * HD * 2, ROWS_BYTES = BM * HD * 2, PITCH = HD + 8;
  static_assert(HD % 64 == 0 && BN % 64 == 0 && BM % 16 == 0, "wgmma tile shapes");
  static_assert(2 * BN * PITCH * 2 <= 2 * KEYS_BYTES + 4 * ROWS_BYTES, "staging tiles fit");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sK = smem;
  unsigned char* sV = sK + KEYS_BYTES;
  unsigned char* sQ = sV + KEYS_BYTES;     // two stages; dO's two stages follow
  unsigned char* sdO = sQ + 2 * ROWS_BYTES;
  float* sLse2 = reinterpret_cast<float*>(sdO + 2 * ROWS_BYTES);  // two stages of BM
  float* sDelta = sLse2 + 2 * BM;

  const int hkv = hq / group;
  const BlockCoords bc = decode_block(hkv, num_n_blocks);  // bc.head is the key/value head
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = bc.block * BN, key_row0 = warp * 16;
  const bool is_causal = causal != 0, use_vec = vec != 0;

  Sm90DkdvKeys<Elem, HD, BM, BN> keys;
  keys.sK = sK;
  keys.sV = sV;
  keys.wg = warp >> 2;
  keys.lane = lane;
  keys.scale_log2 = scale * 1.4426950408889634f;
#pragma unroll
  for (int r = 0; r < 2; ++r)
    keys.first_query[r] = keys.first_query_of(n0 + key_row0 + (lane >> 2) + 8 * r, nq, nk, is_causal);
  keys.clear();

  const unsigned short* k_head = head_ptr(k, make_strides(k_sb, k_sh, k_ss), bc.batch, bc.head);
  const unsigned short* v_head = head_ptr(v, make_strides(v_sb, v_sh, v_ss), bc.batch, bc.head);
  load_tile_swizzled<BN, HD, NTHREADS>(sK, k_head, k_ss, n0, nk, d, use_vec);
  load_tile_swizzled<BN, HD, NTHREADS>(sV, v_head, v_ss, n0, nk, d, use_vec);

  // The work list: every (query head of the group, query tile that sees these keys).
  const QueryTiles tiles = query_tiles_for_keys(n0, BN, BM, nq, nk, is_causal);
  const int tiles_per_head = tiles.count - tiles.first;
  const int num_steps = group * tiles_per_head, masked_steps = masked_query_steps(tiles, group);
  const Strides q_str = make_strides(q_sb, q_sh, q_ss), do_str = make_strides(do_sb, do_sh, do_ss);
  const Strides lse_str = make_strides(lse_sb, lse_sh, lse_ss);
  // Stages Q_i, dO_i (cp.async) and lse_i (log2 units, +inf where P must be 0), D_i (plain loads).
  // Masked tiles of every head come first (mask.cuh, query_step_at).
  auto load_step = [&](int step, int stage) {
    const QueryStep at = query_step_at(step, tiles, group);
    const int head = bc.head * group + at.head;
    const int m0 = at.tile * BM;
    load_tile_swizzled<BM, HD, NTHREADS>(sQ + stage * ROWS_BYTES, head_ptr(q, q_str, bc.batch, head),
                                         q_ss, m0, nq, d, use_vec);
    load_tile_swizzled<BM, HD, NTHREADS>(sdO + stage * ROWS_BYTES,
                                         head_ptr(dout, do_str, bc.batch, head), do_ss, m0, nq, d,
                                         use_vec);
    cp_async_commit();
    const float* lse_head = head_ptr(lse, lse_str, bc.batch, head);
    const float* delta_head = delta + (static_cast<i64>(bc.batch) * hq + head) * nq;
    for (int r = threadIdx.x; r < BM; r += NTHREADS) {
      const int row = m0 + r;
      sLse2[stage * BM + r] = lse2_of_row(row < nq ? lse_head[row * lse_ss] : 0.f, row < nq);
      sDelta[stage * BM + r] = row < nq ? delta_head[row] : 0.f;
    }
  };
  if (num_steps > 0) load_step(0, 0);
  cp_async_commit();

  // Masked tiles first; rows that they made non-finite are flagged and recomputed at the end
  // (repair.cuh).
  unsigned repair = 0;

  for (int step = 0; step < num_steps; ++step) {
    const int stage = step & 1;
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // step's tiles (and K, V) have landed; every warpgroup is done with step - 1
    if (step + 1 < num_steps) load_step(step + 1, stage ^ 1);
    const int m0 = query_step_at(step, tiles, group).tile * BM;
    keys.step(step < masked_steps, m0, sQ + stage * ROWS_BYTES, sdO + stage * ROWS_BYTES,
              sLse2 + stage * BM, sDelta + stage * BM);
    if (step == masked_steps - 1) repair = nonfinite_rows(keys.acc_dk, keys.acc_dv);
  }

  // Epilogue: dK = scale * acc_dk and dV, staged through shared memory (row pitch HD + 8).
  cp_async_wait<0>();
  __syncthreads();
  unsigned short* s_dk = reinterpret_cast<unsigned short*>(smem);
  unsigned short* s_dv = s_dk + BN * PITCH;
  stage_accumulators<Elem, 1, NT_D, PITCH>(s_dk + key_row0 * PITCH,
                                           reinterpret_cast<float (&)[1][NT_D][4]>(keys.acc_dk), scale, lane);
  stage_accumulators<Elem, 1, NT_D, PITCH>(s_dv + key_row0 * PITCH,
                                           reinterpret_cast<float (&)[1][NT_D][4]>(keys.acc_dv), 1.f, lane);
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
    __syncwarp();
    const QuerySide qs{q, dout, lse, delta, q_str, do_str, lse_str, bc.batch, hq};
    recompute_dkdv_rows<Elem, HD, HD>(s_dk + key_row0 * PITCH, s_dv + key_row0 * PITCH, PITCH, HD, repair,
                                      scale, keys.scale_log2, qs, bc.head * group, group,
                                      HeadRows{k_head, k_ss}, HeadRows{v_head, v_ss}, n0 + key_row0,
                                      0, tiles.first * BM, nq, nk, d, is_causal, lane);
  }
  __syncthreads();
  store_tile<BN, HD, PITCH, NTHREADS>(head_ptr(dk, make_strides(dk_sb, dk_sh, dk_ss), bc.batch, bc.head),
                                      s_dk, dk_ss, n0, nk, d, use_vec);
  store_tile<BN, HD, PITCH, NTHREADS>(head_ptr(dv, make_strides(dv_sb, dv_sh, dv_ss), bc.batch, bc.head),
                                      s_dv, dv_ss, n0, nk, d, use_vec);
}

}  // namespace cuflash
