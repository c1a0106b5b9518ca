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
#include "params.cuh"
#include "features.cuh"
#include "gemm.cuh"
#include "wgmma.cuh"
#include "repair.cuh"
#include "backward_sm90.cuh"

namespace cuflash {

// ---------------------------------------------------------------------------------------------
// dQ

template <typename Elem, int HD, int BM, int BN, int FEATURES>
__global__ void __launch_bounds__(BM * 2, 1)
    attention_backward_dq_wgmma(const __grid_constant__ Params p) {
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> Mod;
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

  const BlockCoords bc = decode_block(p.heads_q, p.num_blocks);
  const int kv_head = bc.head / p.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int m0 = bc.block * BM, warp_row0 = warp * 16;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  const Seq<PACKED> seq = Seq<PACKED>::of(p, bc.batch);
  const int nq = seq.nq(p), nk = seq.nk(p), d = p.head_dim;
  if (PACKED && bc.block * BM >= nq) return;  // past this sequence's rows
  const bool use_vec = p.vec != 0;

  Sm90DqRows<Elem, HD, BM, BN, Mask, Mod> rows;
  rows.sQ = sQ;
  rows.sdO = sdO;
  rows.wg = warp >> 2;
  rows.lane = lane;
  rows.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  {
    const HeadRows<const float> lse = seq.template q_rows<const float>(p.lse, bc.head);
    const HeadRows<const float> delta = seq.template q_rows<const float>(p.delta, bc.head);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = m0 + warp_row0 + (lane >> 2) + 8 * r;
      rows.lse2[r] = lse2_of_row(row < nq ? *lse.row(row) : 0.f, row < nq);
      rows.dlt[r] = row < nq ? *delta.row(row) : 0.f;
    }
  }
  rows.row0 = m0 + warp_row0 + (lane >> 2);
  rows.mod = Mod::of(p, bc.batch, bc.head, static_cast<float>(p.scale), seq.ext);
  rows.clear();

  const Rows k_rows = seq.template k_rows<const unsigned short>(p.k, kv_head);
  const Rows v_rows = seq.template k_rows<const unsigned short>(p.v, kv_head);
  const TileRange tiles = Mask::of(p, seq.ext).key_tiles(m0, BM, BN);
  load_tile_swizzled<BM, HD, NTHREADS>(sQ, seq.template q_head<const unsigned short>(p.q, bc.head),
                                       p.q.seq, m0, nq, d, use_vec);
  load_tile_swizzled<BM, HD, NTHREADS>(sdO, seq.template q_head<const unsigned short>(p.dout, bc.head),
                                       p.dout.seq, m0, nq, d, use_vec);
  if (tiles.count() > 0) {
    const int first = tiles.at(0) * BN;
    load_tile_swizzled<BN, HD, NTHREADS>(sK, k_rows.head, k_rows.stride, first, nk, d, use_vec);
    load_tile_swizzled<BN, HD, NTHREADS>(sV, v_rows.head, v_rows.stride, first, nk, d, use_vec);
  }
  cp_async_commit();

  // Masked tiles first (mask.cuh, TileRange::at), then the unmasked ones. Rows that the masked
  // tiles made non-finite are flagged and recomputed at the end (repair.cuh).
  const int masked_tiles = tiles.masked(), count = tiles.count();
  unsigned repair = 0;
  for (int it = 0; it < count; ++it) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // this tile has landed; every warpgroup is done with the last one
    const int j = tiles.at(it), j_next = tiles.at(it + 1);
    if (j_next >= 0) {
      const int next = ((it + 1) & 1) * KV_BYTES;
      load_tile_swizzled<BN, HD, NTHREADS>(sK + next, k_rows.head, k_rows.stride, j_next * BN, nk,
                                           d, use_vec);
      load_tile_swizzled<BN, HD, NTHREADS>(sV + next, v_rows.head, v_rows.stride, j_next * BN, nk,
                                           d, use_vec);
      cp_async_commit();
    }
    rows.step(it < masked_tiles, j * BN, sK + (it & 1) * KV_BYTES, sV + (it & 1) * KV_BYTES,
              Mask::of(p, seq.ext));
    if (it == masked_tiles - 1)
      repair = nonfinite_rows(reinterpret_cast<float (&)[1][NT_D][4]>(rows.acc_dq));
  }

  // Epilogue: dQ = scale * acc, staged through shared memory (row pitch HD + 8).
  const float scale = static_cast<float>(p.scale);
  cp_async_wait<0>();
  __syncthreads();
  unsigned short* s_out = reinterpret_cast<unsigned short*>(smem);
  float (&acc)[1][NT_D][4] = reinterpret_cast<float (&)[1][NT_D][4]>(rows.acc_dq);
  stage_accumulators<Elem, 1, NT_D, PITCH>(s_out + warp_row0 * PITCH, acc, scale, lane);
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
    __syncwarp();
    recompute_dq_rows<Elem, HD, 1>(s_out + warp_row0 * PITCH, PITCH, HD, repair, scale,
                                   rows.scale_log2,
                                   seq.template q_rows<const unsigned short>(p.q, bc.head),
                                   seq.template q_rows<const unsigned short>(p.dout, bc.head),
                                   k_rows, v_rows, seq.template q_rows<const float>(p.lse, bc.head),
                                   seq.template q_rows<const float>(p.delta, bc.head),
                                   m0 + warp_row0, Mask::of(p, seq.ext), rows.mod, d, lane);
  }
  __syncthreads();
  unsigned short* dq_head = seq.template q_head<unsigned short>(p.dq, bc.head);
  store_tile<BM, HD, PITCH, NTHREADS>(dq_head, s_out, p.dq.seq, m0, nq, d, use_vec);
}

// ---------------------------------------------------------------------------------------------
// dK and dV

template <typename Elem, int HD, int BM, int BN, int FEATURES>
__global__ void __launch_bounds__(BN * 2, 1)
    attention_backward_dkdv_wgmma(const __grid_constant__ Params p) {
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> Mod;
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

  const BlockCoords bc = decode_block(p.heads_kv, p.num_blocks);  // bc.head is the key/value head
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = bc.block * BN, key_row0 = warp * 16;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  const Seq<PACKED> seq = Seq<PACKED>::of(p, bc.batch);
  const int nq = seq.nq(p), nk = seq.nk(p), d = p.head_dim, group = p.group;
  if (PACKED && bc.block * BN >= nk) return;  // past this sequence's keys
  const bool use_vec = p.vec != 0;

  Sm90DkdvKeys<Elem, HD, BM, BN, Mask, Mod> keys;
  keys.sK = sK;
  keys.sV = sV;
  keys.wg = warp >> 2;
  keys.lane = lane;
  keys.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
#pragma unroll
  keys.key0 = n0 + key_row0 + (lane >> 2);
  keys.clear();

  load_tile_swizzled<BN, HD, NTHREADS>(sK, seq.template k_head<const unsigned short>(p.k, bc.head),
                                       p.k.seq, n0, nk, d, use_vec);
  load_tile_swizzled<BN, HD, NTHREADS>(sV, seq.template k_head<const unsigned short>(p.v, bc.head),
                                       p.v.seq, n0, nk, d, use_vec);

  // The work list: every (query head of the group, query tile that sees these keys).
  const TileRange tiles = Mask::of(p, seq.ext).query_tiles(n0, BN, BM);
  const int num_steps = group * tiles.count(), masked_steps = masked_query_steps(tiles, group);
  // Stages Q_i, dO_i (cp.async) and lse_i (log2 units, +inf where P must be 0), D_i (plain loads).
  // Masked tiles of every head come first (mask.cuh, query_step_at).
  auto load_step = [&](int step, int stage) {
    const QueryStep at = query_step_at(step, tiles, group);
    const int head = bc.head * group + at.head;
    const int m0 = at.tile * BM;
    const Rows q_rows = seq.template q_rows<const unsigned short>(p.q, head);
    const Rows do_rows = seq.template q_rows<const unsigned short>(p.dout, head);
    load_tile_swizzled<BM, HD, NTHREADS>(sQ + stage * ROWS_BYTES, q_rows.head, q_rows.stride, m0,
                                         nq, d, use_vec);
    load_tile_swizzled<BM, HD, NTHREADS>(sdO + stage * ROWS_BYTES, do_rows.head, do_rows.stride,
                                         m0, nq, d, use_vec);
    cp_async_commit();
    const HeadRows<const float> lse = seq.template q_rows<const float>(p.lse, head);
    const HeadRows<const float> delta = seq.template q_rows<const float>(p.delta, head);
    for (int r = threadIdx.x; r < BM; r += NTHREADS) {
      const int row = m0 + r;
      sLse2[stage * BM + r] = lse2_of_row(row < nq ? *lse.row(row) : 0.f, row < nq);
      sDelta[stage * BM + r] = row < nq ? *delta.row(row) : 0.f;
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
    const QueryStep at = query_step_at(step, tiles, group);
    const int m0 = at.tile * BM;
    if constexpr (Mod::ANY)
      keys.mod = Mod::of(p, bc.batch, bc.head * group + at.head, static_cast<float>(p.scale), seq.ext);
    keys.step(step < masked_steps, m0, sQ + stage * ROWS_BYTES, sdO + stage * ROWS_BYTES,
              sLse2 + stage * BM, sDelta + stage * BM, Mask::of(p, seq.ext));
    if (step == masked_steps - 1) repair = nonfinite_rows(keys.acc_dk, keys.acc_dv);
  }

  // Epilogue: dK = scale * acc_dk and dV, staged through shared memory (row pitch HD + 8).
  const float scale = static_cast<float>(p.scale);
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
    recompute_dkdv_rows<Elem, HD, HD, Mod>(s_dk + key_row0 * PITCH, s_dv + key_row0 * PITCH, PITCH, HD,
                                      repair, scale, keys.scale_log2, p, seq, bc.head,
                                      seq.template k_rows<const unsigned short>(p.k, bc.head),
                                      seq.template k_rows<const unsigned short>(p.v, bc.head),
                                      n0 + key_row0, 0, Mask::of(p, seq.ext), lane);
  }
  __syncthreads();
  store_tile<BN, HD, PITCH, NTHREADS>(seq.template k_head<unsigned short>(p.dk, bc.head), s_dk,
                                      p.dk.seq, n0, nk, d, use_vec);
  store_tile<BN, HD, PITCH, NTHREADS>(seq.template k_head<unsigned short>(p.dv, bc.head), s_dv,
                                      p.dv.seq, n0, nk, d, use_vec);
}

}  // namespace cuflash
