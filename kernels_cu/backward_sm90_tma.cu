// backward_sm90_tma.cu: the dQ and dK/dV kernels on Hopper, warp-specialised (sm_90a: TMA loads,
// mbarrier pipelines, wgmma, setmaxnreg). Same contracts as backward_sm90.cu (and the sm_80
// kernels): no atomics, deterministic, any N, d <= HD, causal bottom-right, grouped heads; the
// host runs them where the TMA unit can read q, k, v and dO (16-byte aligned base and strides, d
// a multiple of 8) and the other kernels elsewhere.
//
// Both kernels are persistent and split like forward_sm90_tma.cu: warpgroup 0 is the producer,
// warpgroups 1 .. are consumers running the steps of backward_sm90.cuh on their 64 rows. The
// producer warp's lane 0 issues the TMA copies (boxes of 64 rows x 64 columns); its 32 lanes
// stage lse (in log2 units, lse2_of_row) and D of the rows a tile covers into shared memory, and
// every lane arrives on the tile's "full" barrier after its stores.
//   dQ:    per work item (BM query rows of a head) Q, dO, lse and D once; K_j, V_j stream through
//          STAGES buffers.
//   dK/dV: per work item (BN keys of a key/value head) K and V once; Q_i, dO_i, lse_i and D_i of
//          every query head of the group stream through STAGES buffers, masked tiles first.
// The per-item tiles have two buffers where shared memory allows (ItemBuffers), so that the next
// item's load overlaps the current item. Buffers whose lse2 and D the consumers read with
// ordinary loads are released by every consumer thread (arrival count 128 per warpgroup), the
// others by one lane per warp. At HD = 256 the dQ kernel has one consumer warpgroup (64 query
// rows; dQ alone takes 128 registers a thread) and the dK/dV kernel two that split the head dim
// of 64 keys (Sm90DkdvKeysSplit).
// Results go from registers straight to global memory; rows a masked tile made non-finite are
// recomputed there (repair.cuh).
#include "common.cuh"
#include "mma.cuh"
#include "mask.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "repair.cuh"
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

// Producer warp: stages lse2 and D of query rows [m0, m0 + ROWS) of one head, one row per lane.
template <int ROWS>
__device__ __forceinline__ void stage_lse_and_delta(float* s_lse2, float* s_delta,
                                                    const float* lse_head, i64 lse_ss,
                                                    const float* delta_head, int m0, int nq,
                                                    int lane) {
#pragma unroll
  for (int r = lane; r < ROWS; r += 32) {
    const int row = m0 + r;
    s_lse2[r] = lse2_of_row(row < nq ? lse_head[row * lse_ss] : 0.f, row < nq);
    s_delta[r] = row < nq ? delta_head[row] : 0.f;
  }
}

// ---------------------------------------------------------------------------------------------
// dQ

template <int ITEM_BUFS, int STAGES>
struct TmaDqBarriers {
  unsigned long long q_full[ITEM_BUFS], q_empty[ITEM_BUFS];  // Q, dO, lse2, D of a work item
  unsigned long long kv_full[STAGES], kv_empty[STAGES];
};

template <typename Elem, int HD, int BM, int BN, int STAGES>
__global__ void __launch_bounds__((BM / 64 + 1) * 128, 1) attention_backward_dq_tma(
    const __grid_constant__ TensorMap tm_q, const __grid_constant__ TensorMap tm_k,
    const __grid_constant__ TensorMap tm_v, const __grid_constant__ TensorMap tm_do,
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ delta, unsigned short* __restrict__ dq,
    i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb, i64 k_sh, i64 k_ss, i64 v_sb, i64 v_sh, i64 v_ss,
    i64 do_sb, i64 do_sh, i64 do_ss, i64 lse_sb, i64 lse_sh, i64 lse_ss, i64 dq_sb, i64 dq_sh,
    i64 dq_ss, int hq, int group, int nq, int nk, int d, float scale, int causal, int vec,
    int num_m_blocks, int num_work) {
  constexpr int CONSUMERS = BM / 64, NT_D = HD / 8, BUFS = ItemBuffers<HD>::COUNT;
  constexpr int ROWS_BYTES = BM * HD * 2, KV_BYTES = BN * HD * 2;
  typedef WarpSpecialisedRegisters<CONSUMERS> Regs;
  static_assert(HD % 64 == 0 && BM % 64 == 0 && BN % TMA_BOX_ROWS == 0, "tile shapes");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sQ = smem;                         // BUFS tiles
  unsigned char* sdO = sQ + BUFS * ROWS_BYTES;      // BUFS tiles
  unsigned char* sK = sdO + BUFS * ROWS_BYTES;      // STAGES tiles
  unsigned char* sV = sK + STAGES * KV_BYTES;       // STAGES tiles
  float* s_lse2 = reinterpret_cast<float*>(sV + STAGES * KV_BYTES);  // BUFS x BM
  float* s_delta = s_lse2 + BUFS * BM;                                // BUFS x BM
  TmaDqBarriers<BUFS, STAGES>& bar =
      *reinterpret_cast<TmaDqBarriers<BUFS, STAGES>*>(s_delta + BUFS * BM);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool is_causal = causal != 0;
  const WorkWalk walk{num_work, is_causal};  // causal work is paired (common.cuh)

  if (threadIdx.x == 0) {
    // q_full: the copies' bytes and each producer lane's lse2, D; q_empty: every consumer thread
    mbar_init_pairs(bar.q_full, bar.q_empty, 1 + 32, 128 * CONSUMERS);
    mbar_init_pairs(bar.kv_full, bar.kv_empty, 1, 4 * CONSUMERS);
    fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {  // producer warpgroup: warp 0 works, the others leave
    Regs::producer();
    if (warp != 0) return;
    int pipe = 0, round = 0;
    for (int step = 0; !walk.done(step); ++step) {
      const i64 item = walk.item(step);
      if (item >= num_work) continue;
      const BlockCoords bc = decode_paired_work(item, hq, num_m_blocks);
      const int kv_head = bc.head / group, m0 = bc.block * BM;
      const KeyTiles tiles = key_tiles_for_queries(m0, BM, BN, nq, nk, is_causal);
      const int buf = acquire_to_fill(bar.q_empty, round);
      if (lane == 0) {
        mbar_arrive_expect_tx(&bar.q_full[buf], 2 * ROWS_BYTES);
        tma_load_tile<BM, HD>(sQ + buf * ROWS_BYTES, &tm_q, &bar.q_full[buf], m0, bc.head, bc.batch);
        tma_load_tile<BM, HD>(sdO + buf * ROWS_BYTES, &tm_do, &bar.q_full[buf], m0, bc.head,
                              bc.batch);
      }
      stage_lse_and_delta<BM>(s_lse2 + buf * BM, s_delta + buf * BM,
                              lse + bc.batch * lse_sb + bc.head * lse_sh, lse_ss,
                              delta + (static_cast<i64>(bc.batch) * hq + bc.head) * nq, m0, nq,
                              lane);
      mbar_arrive(&bar.q_full[buf]);
      for (int it = 0; it < tiles.count; ++it, ++pipe) {
        const int stage = pipe % STAGES;
        mbar_wait(&bar.kv_empty[stage], ((pipe / STAGES) & 1) ^ 1);
        if (lane == 0) {
          const int n0 = key_tile_at(it, tiles) * BN;
          mbar_arrive_expect_tx(&bar.kv_full[stage], 2 * KV_BYTES);
          tma_load_tile<BN, HD>(sK + stage * KV_BYTES, &tm_k, &bar.kv_full[stage], n0, kv_head,
                                bc.batch);
          tma_load_tile<BN, HD>(sV + stage * KV_BYTES, &tm_v, &bar.kv_full[stage], n0, kv_head,
                                bc.batch);
        }
      }
    }
    return;
  }

  Regs::consumer();
  const int warp_row0 = (warp - 4) * 16;  // this warp's rows within the block
  Sm90DqRows<Elem, HD, BM, BN> rows;
  rows.wg = (warp - 4) >> 2;
  rows.lane = lane;
  rows.scale_log2 = scale * 1.4426950408889634f;
  int pipe = 0, round = 0;
  for (int step = 0; !walk.done(step); ++step) {
    const i64 item = walk.item(step);
    if (item >= num_work) continue;
    const int m0 = decode_paired_work(item, hq, num_m_blocks).block * BM;
    const KeyTiles tiles = key_tiles_for_queries(m0, BM, BN, nq, nk, is_causal);
    // Masked tiles first (mask.cuh, key_tile_at); rows that they made non-finite are flagged and
    // recomputed at the end (repair.cuh).
    const int masked_tiles = tiles.count - tiles.full;
    unsigned repair = 0;
    const int buf = acquire_to_read(bar.q_full, round);
    rows.sQ = sQ + buf * ROWS_BYTES;
    rows.sdO = sdO + buf * ROWS_BYTES;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + (lane >> 2) + 8 * r;
      rows.lse2[r] = s_lse2[buf * BM + row];
      rows.dlt[r] = s_delta[buf * BM + row];
      rows.last_key[r] = last_visible_key(m0 + row, nq, nk, is_causal);
    }
    rows.clear();
    for (int it = 0; it < tiles.count; ++it, ++pipe) {
      const int stage = pipe % STAGES;
      mbar_wait(&bar.kv_full[stage], (pipe / STAGES) & 1);
      rows.step(it < masked_tiles, key_tile_at(it, tiles) * BN, sK + stage * KV_BYTES,
                sV + stage * KV_BYTES);
      __syncwarp();
      if (lane == 0) mbar_arrive(&bar.kv_empty[stage]);
      if (it == masked_tiles - 1)
        repair = nonfinite_rows(reinterpret_cast<float (&)[1][NT_D][4]>(rows.acc_dq));
    }
    mbar_arrive(&bar.q_empty[buf]);  // every thread: its loads of lse2 and D are done

    // Epilogue: dQ = scale * acc, from registers.
    const BlockCoords bc = decode_paired_work(item, hq, num_m_blocks);
    unsigned short* dq_head = head_ptr(dq, make_strides(dq_sb, dq_sh, dq_ss), bc.batch, bc.head);
    const int row0 = m0 + warp_row0;
    store_accumulator_rows<Elem, NT_D>(dq_head, dq_ss, row0, nq, d, rows.acc_dq, scale, lane);
    if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
      __syncwarp();
      const int kv_head = bc.head / group;
      recompute_dq_rows<Elem, HD, 1>(
          dq_head + row0 * dq_ss, dq_ss, d, repair, scale, rows.scale_log2,
          HeadRows{head_ptr(q, make_strides(q_sb, q_sh, q_ss), bc.batch, bc.head), q_ss},
          HeadRows{head_ptr(dout, make_strides(do_sb, do_sh, do_ss), bc.batch, bc.head), do_ss},
          HeadRows{head_ptr(k, make_strides(k_sb, k_sh, k_ss), bc.batch, kv_head), k_ss},
          HeadRows{head_ptr(v, make_strides(v_sb, v_sh, v_ss), bc.batch, kv_head), v_ss},
          lse + bc.batch * lse_sb + bc.head * lse_sh, lse_ss,
          delta + (static_cast<i64>(bc.batch) * hq + bc.head) * nq, row0,
          min(tiles.count * BN, nk), nq, nk, d, is_causal, lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dK and dV

template <int ITEM_BUFS, int STAGES>
struct TmaDkdvBarriers {
  unsigned long long kv_full[ITEM_BUFS], kv_empty[ITEM_BUFS];  // K and V of a work item
  unsigned long long q_full[STAGES], q_empty[STAGES];
};

template <typename Elem, int HD, int BM, int BN, int STAGES>
__global__ void __launch_bounds__((HD > 128 ? 2 : BN / 64) * 128 + 128, 1) attention_backward_dkdv_tma(
    const __grid_constant__ TensorMap tm_q, const __grid_constant__ TensorMap tm_k,
    const __grid_constant__ TensorMap tm_v, const __grid_constant__ TensorMap tm_do,
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v, const unsigned short* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ delta, unsigned short* __restrict__ dk,
    unsigned short* __restrict__ dv, i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb, i64 k_sh, i64 k_ss,
    i64 v_sb, i64 v_sh, i64 v_ss, i64 do_sb, i64 do_sh, i64 do_ss, i64 lse_sb, i64 lse_sh,
    i64 lse_ss, i64 dk_sb, i64 dk_sh, i64 dk_ss, i64 dv_sb, i64 dv_sh, i64 dv_ss, int hq,
    int group, int nq, int nk, int d, float scale, int causal, int vec, int num_n_blocks,
    int num_work) {
  // BN keys per block (64 per consumer warpgroup; at HD = 256, 64 shared by two warpgroups that
  // split the head dim), query tiles of BM rows.
  constexpr bool SPLIT = HD > 128;
  constexpr int CONSUMERS = SPLIT ? 2 : BN / 64, BUFS = ItemBuffers<HD>::COUNT;
  constexpr int KEYS_BYTES = BN * HD * 2, ROWS_BYTES = BM * HD * 2;
  typedef WarpSpecialisedRegisters<CONSUMERS> Regs;
  typedef Sm90DkdvKeys<Elem, HD, BM, BN, SPLIT ? HD / 2 : HD> Keys;
  constexpr int NT_D = Keys::NT_D;
  static_assert(HD % 64 == 0 && BN % 64 == 0 && BM % TMA_BOX_ROWS == 0, "tile shapes");
  static_assert(!SPLIT || BN == 64, "the split head dim serves 64 keys");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sK = smem;                         // BUFS tiles
  unsigned char* sV = sK + BUFS * KEYS_BYTES;       // BUFS tiles
  unsigned char* sQ = sV + BUFS * KEYS_BYTES;       // STAGES tiles
  unsigned char* sdO = sQ + STAGES * ROWS_BYTES;    // STAGES tiles
  float* s_lse2 = reinterpret_cast<float*>(sdO + STAGES * ROWS_BYTES);  // STAGES x BM
  float* s_delta = s_lse2 + STAGES * BM;                                // STAGES x BM
  TmaDkdvBarriers<BUFS, STAGES>& bar =
      *reinterpret_cast<TmaDkdvBarriers<BUFS, STAGES>*>(s_delta + STAGES * BM);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool is_causal = causal != 0;
  const int hkv = hq / group;
  const WorkWalk walk{num_work, is_causal};

  if (threadIdx.x == 0) {
    mbar_init_pairs(bar.kv_full, bar.kv_empty, 1, 4 * CONSUMERS);
    // q_full: the copies' bytes and each producer lane's lse2, D; q_empty: every consumer thread
    mbar_init_pairs(bar.q_full, bar.q_empty, 1 + 32, 128 * CONSUMERS);
    fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {  // producer warpgroup: warp 0 works, the others leave
    Regs::producer();
    if (warp != 0) return;
    int pipe = 0, round = 0;
    for (int step = 0; !walk.done(step); ++step) {
      const i64 item = walk.item(step);
      if (item >= num_work) continue;
      const BlockCoords bc = decode_paired_work(item, hkv, num_n_blocks);  // head: key/value head
      const int n0 = bc.block * BN;
      const QueryTiles tiles = query_tiles_for_keys(n0, BN, BM, nq, nk, is_causal);
      const int num_steps = group * (tiles.count - tiles.first);
      const int buf = acquire_to_fill(bar.kv_empty, round);
      if (lane == 0) {
        mbar_arrive_expect_tx(&bar.kv_full[buf], 2 * KEYS_BYTES);
        tma_load_tile<BN, HD>(sK + buf * KEYS_BYTES, &tm_k, &bar.kv_full[buf], n0, bc.head,
                              bc.batch);
        tma_load_tile<BN, HD>(sV + buf * KEYS_BYTES, &tm_v, &bar.kv_full[buf], n0, bc.head,
                              bc.batch);
      }
      for (int s = 0; s < num_steps; ++s, ++pipe) {
        const int stage = pipe % STAGES;
        const QueryStep at = query_step_at(s, tiles, group);
        const int head = bc.head * group + at.head, m0 = at.tile * BM;
        mbar_wait(&bar.q_empty[stage], ((pipe / STAGES) & 1) ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(&bar.q_full[stage], 2 * ROWS_BYTES);
          tma_load_tile<BM, HD>(sQ + stage * ROWS_BYTES, &tm_q, &bar.q_full[stage], m0, head,
                                bc.batch);
          tma_load_tile<BM, HD>(sdO + stage * ROWS_BYTES, &tm_do, &bar.q_full[stage], m0, head,
                                bc.batch);
        }
        stage_lse_and_delta<BM>(s_lse2 + stage * BM, s_delta + stage * BM,
                                lse + bc.batch * lse_sb + head * lse_sh, lse_ss,
                                delta + (static_cast<i64>(bc.batch) * hq + head) * nq, m0, nq,
                                lane);
        mbar_arrive(&bar.q_full[stage]);
      }
    }
    return;
  }

  Regs::consumer();
  const int key_row0 = Keys::key_row0(warp - 4);  // this warp's keys within the block
  Keys keys;
  keys.wg = (warp - 4) >> 2;
  keys.lane = lane;
  keys.scale_log2 = scale * 1.4426950408889634f;
  int pipe = 0, round = 0;
  for (int step = 0; !walk.done(step); ++step) {
    const i64 item = walk.item(step);
    if (item >= num_work) continue;
    const int n0 = decode_paired_work(item, hkv, num_n_blocks).block * BN;
    const QueryTiles tiles = query_tiles_for_keys(n0, BN, BM, nq, nk, is_causal);
    const int num_steps = group * (tiles.count - tiles.first);
    // Masked tiles of every head first (mask.cuh, query_step_at); rows that they made non-finite
    // are flagged and recomputed at the end (repair.cuh).
    const int masked_steps = masked_query_steps(tiles, group);
    unsigned repair = 0;
#pragma unroll
    for (int r = 0; r < 2; ++r)
      keys.first_query[r] =
          keys.first_query_of(n0 + key_row0 + (lane >> 2) + 8 * r, nq, nk, is_causal);
    keys.clear();
    const int buf = acquire_to_read(bar.kv_full, round);
    keys.sK = sK + buf * KEYS_BYTES;
    keys.sV = sV + buf * KEYS_BYTES;
    for (int s = 0; s < num_steps; ++s, ++pipe) {
      const int stage = pipe % STAGES;
      mbar_wait(&bar.q_full[stage], (pipe / STAGES) & 1);
      keys.step(s < masked_steps, query_step_at(s, tiles, group).tile * BM,
                sQ + stage * ROWS_BYTES, sdO + stage * ROWS_BYTES, s_lse2 + stage * BM,
                s_delta + stage * BM);
      mbar_arrive(&bar.q_empty[stage]);  // every thread: its loads of lse2 and D are done
      if (s == masked_steps - 1) repair = nonfinite_rows(keys.acc_dk, keys.acc_dv);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&bar.kv_empty[buf]);

    // Epilogue: dK = scale * acc_dk and dV (this warpgroup's columns), from registers.
    const BlockCoords bc = decode_paired_work(item, hkv, num_n_blocks);
    const int col0 = keys.col0(), cols = d - col0;  // cols <= 0: nothing of d in this half
    unsigned short* dk_head =
        head_ptr(dk, make_strides(dk_sb, dk_sh, dk_ss), bc.batch, bc.head) + col0;
    unsigned short* dv_head =
        head_ptr(dv, make_strides(dv_sb, dv_sh, dv_ss), bc.batch, bc.head) + col0;
    const int key0 = n0 + key_row0;
    store_accumulator_rows<Elem, NT_D>(dk_head, dk_ss, key0, nk, cols, keys.acc_dk, scale, lane);
    store_accumulator_rows<Elem, NT_D>(dv_head, dv_ss, key0, nk, cols, keys.acc_dv, 1.f, lane);
    if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
      __syncwarp();
      const Strides q_str = make_strides(q_sb, q_sh, q_ss), do_str = make_strides(do_sb, do_sh, do_ss);
      const QuerySide qs{q, dout, lse, delta, q_str, do_str, make_strides(lse_sb, lse_sh, lse_ss),
                         bc.batch, hq};
      // dk and dv are allocated alike: one row stride for both
      recompute_dkdv_rows<Elem, HD, Keys::COLS>(
          dk_head - col0 + key0 * dk_ss, dv_head - col0 + key0 * dv_ss, dk_ss,
          min(cols, Keys::COLS), repair, scale, keys.scale_log2, qs, bc.head * group, group,
          HeadRows{head_ptr(k, make_strides(k_sb, k_sh, k_ss), bc.batch, bc.head), k_ss},
          HeadRows{head_ptr(v, make_strides(v_sb, v_sh, v_ss), bc.batch, bc.head), v_ss}, key0,
          col0, tiles.first * BM, nq, nk, d, is_causal, lane);
    }
  }
}

}  // namespace cuflash
