// backward_sm90_tma.cu: the dQ and dK/dV kernels on Hopper, warp-specialised (sm_90a: TMA loads,
// mbarrier pipelines, wgmma, setmaxnreg). Same contracts as backward_sm90.cu (and the sm_80
// kernels): no atomics, deterministic, any N, d <= HD, the mask of mask.cuh, grouped heads; the
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
//
// Packed sequences (PACKED), as in forward_sm90_tma.cu: the maps cover the packed tensors, an
// item's rows are its sequence's (Seq, params.cuh), and the work list, which build_work_list
// writes before the launch, holds only the blocks each sequence has (work_item, work_list.cuh;
// a causal list's filler block lies past its sequence's rows and is skipped). Boxes that reach
// past the sequence read the next one's rows: its keys are masked (the tile at the end of the
// keys is a masked one), its query rows have lse +inf (P = 0) and are never written, and the
// dK/dV kernel's query tile at the end of the rows is a masked one too
// (Mask::query_tiles<false>), so that a NaN or Inf there, which P = 0 spreads into dK and dV,
// sets off the repair of the keys it reached.
#include "common.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "features.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "repair.cuh"
#include "backward_sm90.cuh"
#include "backward_sm90_tma.cuh"

namespace cuflash {

// ---------------------------------------------------------------------------------------------
// dQ

template <int ITEM_BUFS, int STAGES>
struct TmaDqBarriers {
  unsigned long long q_full[ITEM_BUFS], q_empty[ITEM_BUFS];  // Q, dO, lse2, D of a work item
  unsigned long long kv_full[STAGES], kv_empty[STAGES];
};

template <typename Elem, int HD, int BM, int BN, int STAGES, int FEATURES>
__global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)
    attention_backward_dq_tma(const __grid_constant__ BackwardMaps maps,
                              const __grid_constant__ Params p) {
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> Mod;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
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
  // Windowed instances walk decode_chunked_work's order where the host asks (Params::walk_heads)
  constexpr bool CHUNKABLE = Features<FEATURES>::LOCAL && !PACKED;
  const WorkWalk<PACKED> walk{work_count<PACKED>(p), p.paired != 0,
                            PACKED || (CHUNKABLE && p.walk_heads > 0)};  // common.cuh

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
      if (item >= walk.num_work) continue;
      const WorkItem<PACKED> work = work_item<PACKED, CHUNKABLE>(p, item, p.heads_q);
      const BlockCoords bc = work.c;
      const Seq<PACKED> seq = work.seq;
      const int kv_head = bc.head / p.group, m0 = bc.block * BM;
      if (PACKED && m0 >= seq.nq(p)) continue;  // past this sequence's rows
      const TileRange tiles = Mask::of(p, seq.ext).key_tiles(m0, BM, BN);
      const int buf = acquire_to_fill(bar.q_empty, round);
      if (lane == 0) {
        mbar_arrive_expect_tx(&bar.q_full[buf], 2 * ROWS_BYTES);
        tma_load_tile<BM, HD>(sQ + buf * ROWS_BYTES, &maps.q, &bar.q_full[buf], seq.q_coord(m0),
                              bc.head, seq.map_batch());
        tma_load_tile<BM, HD>(sdO + buf * ROWS_BYTES, &maps.dout, &bar.q_full[buf],
                              seq.q_coord(m0), bc.head, seq.map_batch());
      }
      stage_lse_and_delta<BM>(s_lse2 + buf * BM, s_delta + buf * BM, p, seq, bc.head, m0, lane);
      mbar_arrive(&bar.q_full[buf]);
      for (int it = 0; it < tiles.count(); ++it, ++pipe) {
        const int stage = pipe % STAGES;
        mbar_wait(&bar.kv_empty[stage], ((pipe / STAGES) & 1) ^ 1);
        if (lane == 0) {
          const int n0 = tiles.at(it) * BN;
          mbar_arrive_expect_tx(&bar.kv_full[stage], 2 * KV_BYTES);
          tma_load_tile<BN, HD>(sK + stage * KV_BYTES, &maps.k, &bar.kv_full[stage],
                                seq.k_coord(n0), kv_head, seq.map_batch());
          tma_load_tile<BN, HD>(sV + stage * KV_BYTES, &maps.v, &bar.kv_full[stage],
                                seq.k_coord(n0), kv_head, seq.map_batch());
        }
      }
    }
    return;
  }

  Regs::consumer();
  const int warp_row0 = (warp - 4) * 16;  // this warp's rows within the block
  const int d = p.head_dim;
  Sm90DqRows<Elem, HD, BM, BN, Mask, Mod> rows;
  rows.wg = (warp - 4) >> 2;
  rows.lane = lane;
  rows.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  int pipe = 0, round = 0;
  for (int step = 0; !walk.done(step); ++step) {
    const i64 item = walk.item(step);
    if (item >= walk.num_work) continue;
    // The item's coordinates are decoded again where used, and the sequence's offsets looked up
    // again for the epilogue (as in the dK/dV kernel); its extents (registers: packed) go through
    // the loop in the mask.
    const WorkItem<PACKED> work = work_item<PACKED, CHUNKABLE>(p, item, p.heads_q);
    const BlockCoords item_bc = work.c;
    const Extents<PACKED> ext = work.seq.ext;
    const int m0 = item_bc.block * BM;
    if (PACKED && m0 >= ext.nq(p)) continue;  // past this sequence's rows, skipped by the producer too
    const TileRange tiles = Mask::of(p, ext).key_tiles(m0, BM, BN);
    // Masked tiles first (mask.cuh, TileRange::at); rows that they made non-finite are flagged
    // and recomputed at the end (repair.cuh).
    const int masked_tiles = tiles.masked(), count = tiles.count();
    unsigned repair = 0;
    const int buf = acquire_to_read(bar.q_full, round);
    rows.sQ = sQ + buf * ROWS_BYTES;
    rows.sdO = sdO + buf * ROWS_BYTES;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + (lane >> 2) + 8 * r;
      rows.lse2[r] = s_lse2[buf * BM + row];
      rows.dlt[r] = s_delta[buf * BM + row];
    }
    rows.row0 = m0 + warp_row0 + (lane >> 2);
    if constexpr (Mod::ANY)
      rows.mod = Mod::of(p, item_bc.batch, item_bc.head, static_cast<float>(p.scale), ext);
    rows.clear();
    for (int it = 0; it < count; ++it, ++pipe) {
      const int stage = pipe % STAGES;
      mbar_wait(&bar.kv_full[stage], (pipe / STAGES) & 1);
      rows.step(it < masked_tiles, tiles.at(it) * BN, sK + stage * KV_BYTES,
                sV + stage * KV_BYTES, Mask::of(p, ext));
      __syncwarp();
      if (lane == 0) mbar_arrive(&bar.kv_empty[stage]);
      if (it == masked_tiles - 1)
        repair = nonfinite_rows(reinterpret_cast<float (&)[1][NT_D][4]>(rows.acc_dq));
    }
    mbar_arrive(&bar.q_empty[buf]);  // every thread: its loads of lse2 and D are done

    // Epilogue: dQ = scale * acc, from registers.
    const float scale = static_cast<float>(p.scale);
    const WorkItem<PACKED> again = work_item<PACKED, CHUNKABLE>(p, item, p.heads_q);
    const BlockCoords bc = again.c;
    const Seq<PACKED> seq = again.seq;
    unsigned short* dq_head = seq.template q_head<unsigned short>(p.dq, bc.head);
    const int row0 = m0 + warp_row0;
    store_accumulator_rows<Elem, NT_D>(dq_head, p.dq.seq, row0, seq.nq(p), d, rows.acc_dq, scale,
                                       lane);
    if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
      __syncwarp();
      const int kv_head = bc.head / p.group;
      recompute_dq_rows<Elem, HD, 1>(
          dq_head + row0 * p.dq.seq, p.dq.seq, d, repair, scale, rows.scale_log2,
          seq.template q_rows<const unsigned short>(p.q, bc.head),
          seq.template q_rows<const unsigned short>(p.dout, bc.head),
          seq.template k_rows<const unsigned short>(p.k, kv_head),
          seq.template k_rows<const unsigned short>(p.v, kv_head),
          seq.template q_rows<const float>(p.lse, bc.head),
          seq.template q_rows<const float>(p.delta, bc.head), row0, Mask::of(p, seq.ext), rows.mod,
          d, lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// dK and dV

struct PackedItem {
  int nq, nk, batch, head;
};

template <int ITEM_BUFS, int STAGES>
struct TmaDkdvBarriers {
  unsigned long long kv_full[ITEM_BUFS], kv_empty[ITEM_BUFS];  // K and V of a work item
  unsigned long long q_full[STAGES], q_empty[STAGES];
  // Packed: the item's sequence (its query rows and keys) and key/value head, written by the
  // producer before kv_full's arrival. The consumers read them here on each query tile and for the
  // epilogue: held in registers through the loop, or decoded again from the item (64-bit
  // divisions) beside the accumulators, they made the packed instances spill 8-64 B.
  PackedItem item[ITEM_BUFS];
};

template <typename Elem, int HD, int BM, int BN, int STAGES, int FEATURES>
__global__ void __launch_bounds__((HD > 128 ? 2 : BN / 64) * 128 + 128, 1)
    attention_backward_dkdv_tma(const __grid_constant__ BackwardMaps maps,
                                const __grid_constant__ Params p) {
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> Mod;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  // BN keys per block (64 per consumer warpgroup; at HD = 256, 64 shared by two warpgroups that
  // split the head dim), query tiles of BM rows.
  constexpr bool SPLIT = HD > 128;
  constexpr int CONSUMERS = SPLIT ? 2 : BN / 64, BUFS = ItemBuffers<HD>::COUNT;
  constexpr int KEYS_BYTES = BN * HD * 2, ROWS_BYTES = BM * HD * 2;
  typedef WarpSpecialisedRegisters<CONSUMERS> Regs;
  typedef DkdvKeysOf<SPLIT, Elem, HD, BM, BN, Mask, Mod> KeysOf;
  typedef typename KeysOf::Type Keys;
  constexpr int NT_D = Keys::NT_D;
  static_assert(HD % 64 == 0 && BN % 64 == 0 && BM % TMA_BOX_ROWS == 0, "tile shapes");
  static_assert(!SPLIT || BN == 64, "the split head dim serves 64 keys");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sK = smem;                         // BUFS tiles
  unsigned char* sV = sK + BUFS * KEYS_BYTES;       // BUFS tiles
  unsigned char* sQ = sV + BUFS * KEYS_BYTES;       // STAGES tiles
  unsigned char* sdO = sQ + STAGES * ROWS_BYTES;    // STAGES tiles
  // SPLIT: the consumers' exchange area, then dS^T's tile
  unsigned char* sX = sdO + STAGES * ROWS_BYTES;
  float* s_lse2 = reinterpret_cast<float*>(sX + KeysOf::EXCHANGE_BYTES + KeysOf::DS_TILE_BYTES);
  float* s_delta = s_lse2 + STAGES * BM;                                // STAGES x BM
  TmaDkdvBarriers<BUFS, STAGES>& bar =
      *reinterpret_cast<TmaDkdvBarriers<BUFS, STAGES>*>(s_delta + STAGES * BM);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const WorkWalk<PACKED> walk{work_count<PACKED>(p), p.paired != 0};

  if (threadIdx.x == 0) {
    mbar_init_pairs(bar.kv_full, bar.kv_empty, 1, 4 * CONSUMERS);
    // q_full: the copies' bytes and each producer lane's lse2, D; q_empty: every consumer thread
    mbar_init_pairs(bar.q_full, bar.q_empty, 1 + 32, 128 * CONSUMERS);
    if constexpr (SPLIT) Keys::init(sX);
    fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {  // producer warpgroup: warp 0 works, the others leave
    Regs::producer();
    if (warp != 0) return;
    int pipe = 0, round = 0;
    for (int step = 0; !walk.done(step); ++step) {
      const i64 item = walk.item(step);
      if (item >= walk.num_work) continue;
      // head: the key/value head
      const WorkItem<PACKED> work = work_item<PACKED>(p, item, p.heads_kv);
      const BlockCoords bc = work.c;
      const Seq<PACKED> seq = work.seq;
      const int n0 = bc.block * BN;
      if (PACKED && n0 >= seq.nk(p)) continue;  // past this sequence's keys
      const TileRange tiles = Mask::of(p, seq.ext).template query_tiles<!PACKED>(n0, BN, BM);
      const int num_steps = p.group * tiles.count();
      const int buf = acquire_to_fill(bar.kv_empty, round);
      if (lane == 0) {
        if constexpr (PACKED) bar.item[buf] = PackedItem{seq.nq(p), seq.nk(p), bc.batch, bc.head};
        mbar_arrive_expect_tx(&bar.kv_full[buf], 2 * KEYS_BYTES);
        tma_load_tile<BN, HD>(sK + buf * KEYS_BYTES, &maps.k, &bar.kv_full[buf], seq.k_coord(n0),
                              bc.head, seq.map_batch());
        tma_load_tile<BN, HD>(sV + buf * KEYS_BYTES, &maps.v, &bar.kv_full[buf], seq.k_coord(n0),
                              bc.head, seq.map_batch());
      }
      for (int s = 0; s < num_steps; ++s, ++pipe) {
        const int stage = pipe % STAGES;
        const QueryStep at = query_step_at(s, tiles, p.group);
        const int head = bc.head * p.group + at.head, m0 = at.tile * BM;
        mbar_wait(&bar.q_empty[stage], ((pipe / STAGES) & 1) ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(&bar.q_full[stage], 2 * ROWS_BYTES);
          tma_load_tile<BM, HD>(sQ + stage * ROWS_BYTES, &maps.q, &bar.q_full[stage],
                                seq.q_coord(m0), head, seq.map_batch());
          tma_load_tile<BM, HD>(sdO + stage * ROWS_BYTES, &maps.dout, &bar.q_full[stage],
                                seq.q_coord(m0), head, seq.map_batch());
        }
        stage_lse_and_delta<BM>(s_lse2 + stage * BM, s_delta + stage * BM, p, seq, head, m0, lane);
        mbar_arrive(&bar.q_full[stage]);
      }
    }
    return;
  }

  Regs::consumer();
  const int key_row0 = Keys::key_row0(warp - 4);  // this warp's keys within the block
  const int d = p.head_dim;
  Keys keys;
  keys.wg = (warp - 4) >> 2;
  keys.lane = lane;
  keys.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  if constexpr (SPLIT) keys.sX = sX;
  int pipe = 0, round = 0;
  for (int step = 0; !walk.done(step); ++step) {
    const i64 item = walk.item(step);
    if (item >= walk.num_work) continue;
    // The item's coordinates are decoded again where used (held through the loop they cost
    // registers that the ALiBi instances then spilled; packed: read from shared memory,
    // TmaDkdvBarriers::item), and the sequence's offsets looked up again for the epilogue.
    const WorkItem<PACKED> work = work_item<PACKED>(p, item, p.heads_kv);
    const BlockCoords item_bc = work.c;
    const Extents<PACKED> ext = work.seq.ext;
    const int n0 = item_bc.block * BN;
    if (PACKED && n0 >= ext.nk(p)) continue;  // past this sequence's keys, skipped by the producer too
    const TileRange tiles = Mask::of(p, ext).template query_tiles<!PACKED>(n0, BN, BM);
    const int num_steps = p.group * tiles.count();
    // Masked tiles of every head first (mask.cuh, query_step_at); rows that they made non-finite
    // are flagged and recomputed at the end (repair.cuh).
    const int masked_steps = masked_query_steps(tiles, p.group);
    unsigned repair = 0;
    keys.key0 = n0 + key_row0 + (lane >> 2);
    keys.clear();
    const int buf = acquire_to_read(bar.kv_full, round);
    keys.sK = sK + buf * KEYS_BYTES;
    keys.sV = sV + buf * KEYS_BYTES;
    auto extents = [&]() {
      if constexpr (PACKED) return Extents<PACKED>{bar.item[buf].nq, bar.item[buf].nk};
      else return ext;
    };
    auto coords = [&]() {  // (batch, key/value head) of the item
      if constexpr (PACKED) return BlockCoords{bar.item[buf].batch, bar.item[buf].head, 0};
      else return decode_paired_work(item, p.heads_kv, p.num_blocks);
    };
    for (int s = 0; s < num_steps; ++s, ++pipe) {
      const int stage = pipe % STAGES;
      mbar_wait(&bar.q_full[stage], (pipe / STAGES) & 1);
      const QueryStep at = query_step_at(s, tiles, p.group);
      if constexpr (Mod::ANY) {
        const BlockCoords bc = coords();
        keys.mod = Mod::of(p, bc.batch, bc.head * p.group + at.head, static_cast<float>(p.scale),
                           extents());
      }
      if constexpr (SPLIT) keys.tiles = pipe;  // a counter kept by the struct spilled
      keys.step(s < masked_steps, at.tile * BM,
                sQ + stage * ROWS_BYTES, sdO + stage * ROWS_BYTES, s_lse2 + stage * BM,
                s_delta + stage * BM, Mask::of(p, extents()));
      mbar_arrive(&bar.q_empty[stage]);  // every thread: its loads of lse2 and D are done
      if (s == masked_steps - 1) repair = nonfinite_rows(keys.acc_dk, keys.acc_dv);
    }
    const BlockCoords bc = coords();
    __syncwarp();
    if (lane == 0) mbar_arrive(&bar.kv_empty[buf]);

    // Epilogue: dK = scale * acc_dk and dV (this warpgroup's columns), from registers.
    const float scale = static_cast<float>(p.scale);
    const Seq<PACKED> seq = Seq<PACKED>::of(p, bc.batch);
    const int col0 = keys.col0(), cols = d - col0;  // cols <= 0: nothing of d in this half
    unsigned short* dk_head = seq.template k_head<unsigned short>(p.dk, bc.head) + col0;
    unsigned short* dv_head = seq.template k_head<unsigned short>(p.dv, bc.head) + col0;
    const int key0 = n0 + key_row0, nk = seq.nk(p);
    store_accumulator_rows<Elem, NT_D>(dk_head, p.dk.seq, key0, nk, cols, keys.acc_dk, scale, lane);
    store_accumulator_rows<Elem, NT_D>(dv_head, p.dv.seq, key0, nk, cols, keys.acc_dv, 1.f, lane);
    if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
      __syncwarp();
      // dk and dv are allocated alike: one row stride for both
      recompute_dkdv_rows<Elem, HD, Keys::COLS, Mod>(
          dk_head - col0 + key0 * p.dk.seq, dv_head - col0 + key0 * p.dv.seq, p.dk.seq,
          min(cols, Keys::COLS), repair, scale, keys.scale_log2, p, seq, bc.head,
          seq.template k_rows<const unsigned short>(p.k, bc.head),
          seq.template k_rows<const unsigned short>(p.v, bc.head), key0, col0, Mask::of(p, seq.ext),
          lane);
    }
  }
}

}  // namespace cuflash
