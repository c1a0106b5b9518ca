// forward_sm90_tma.cu: the FlashAttention-2 forward pass on Hopper, warp-specialised (sm_90a:
// TMA loads, mbarrier pipelines, wgmma, setmaxnreg). Same contract as forward.cu: writes O and
// lse, any Nq, Nk, d <= HD, the mask of mask.cuh, grouped heads, strides; the host runs it
// where the TMA unit can read q, k and v (16-byte aligned base and strides, d a multiple of 8)
// and forward_sm90.cu elsewhere (cuflash/_dispatch.py).
//
// Persistent: a block per SM walks its share of the work list (query tile, head, batch;
// decode_paired_work's order, in pairs where the host asks: causal work; packed calls: the list
// that build_work_list writes before the launch, work_list.cuh). Warpgroup 0 is the
// producer: it gives back its registers and one thread walks the list, posts each item with its
// Q buffer for the consumers (PostedItem), and issues the TMA copies of Q (two buffers at
// HD <= 128, one at 256) and of K_j, V_j (STAGES buffers each), each completing on its own "full"
// barrier, in the order the consumers use them (K_0, then K_{j+1} before V_j).
// Warpgroups 1 .. BM / 64 are consumers: they take the producer's registers and run the steps of
// forward_sm90.cuh on their 64 query rows, waiting for K_j before S = Q K_j^T and for V_j only
// before O += P V_j, and release K_j (its "empty" barrier) once S_j is computed, V_j once P_j V_j
// is, and the Q buffer after the item's last S. The host picks the loop (SCHEDULE): each tile's
// steps one after the other, or pipelined as in FlashAttention-3 (S_{j+1} and P_j V_j in flight
// on the tensor cores while a consumer computes the softmax of S_{j+1}), optionally with the
// consumers taking turns at issuing their products (TensorCoreTurns), so that their softmaxes do
// not coincide, or with the turns alone (SCHEDULE_SERIAL_TURNS: the FP8 forward). The producer
// loads the next work item's Q and first K/V tiles while the consumers finish the current one
// (with one Q buffer, HD = 256, K_0 before Q: its stage frees up as early). No block-wide barrier
// after the set-up. The copies zero-fill rows past N and columns past d, so the consumers see
// padded tiles as the cp.async kernel builds them.
//
// Output: with O_VIA_TMA (HD <= 128, where shared memory has room for an O tile, and d == HD)
// each consumer warpgroup writes its normalised 64 rows of O into a staging tile (stmatrix, the
// map's swizzled layout) and one of its threads hands the tile to the TMA unit, which writes it
// while the warpgroup goes on to its next item; the staging tile is reused once that store has
// read it. This per-item epilogue cost sets the causal / non-causal ratio at N = 4k
// (docs/perf/NOTES.md, v9). A warpgroup whose rows reach before row 0 or past Nq (TMA stores of
// such boxes fault), or one with a row that needs the NaN/Inf repair, writes O straight from
// registers, as every warpgroup does without O_VIA_TMA.
//
// Row blocks: slot b of a head holds the query rows [b BM - row_shift, (b + 1) BM - row_shift).
// The host passes row_shift = 0 (blocks from row 0, the last one partial) or, under a right
// bound (causal), aligns the blocks to the end of the sequence (row_shift = slots BM - Nq >= 0):
// the partial block is then the first, which sees the fewest keys, instead of the last, which would
// run every key tile for a few real rows. An odd block count gets an empty slot 0 (all its rows
// negative, skipped), so that every pair of decode_paired_work stays within one head. Rows
// before 0 are read as zeros by the TMA unit and never written. Without a right bound, where the
// last block's real rows fit one consumer and the instance has three (SPLIT_LAST: d = 64's
// 192-row tiles at 1k, 4k, 16k rows), the host asks for that block to be split by key tiles among
// the consumers and walked first (Params::split_last, decode_last_first_work): it then costs about
// a third of a block, where padded it cost a whole one (docs/perf/NOTES.md, v48).
//
// Elements (forward_sm90.cuh, ForwardFormat): fp16 / bf16, or e4m3 for the FP8 forward, whose
// tiles have rows of 128 elements (one box per 128 bytes either way), whose V tiles are V^T's
// (the host's pass, fp8_transpose.cu: 8-bit wgmma reads B only K-major), whose scores and O are
// scaled by the descale factors of the item's (batch, key/value head), and whose O is bf16.
//
// Packed sequences (PACKED): the maps cover the packed tensors, and a slot's rows are its
// sequence's (Seq, params.cuh): slots count from the sequence's first row, or end at its last
// where the host pairs the work (causal); the work list holds only the slots with its rows (a
// causal list's filler slot lies before them and is skipped). Tiles that reach past the
// sequence read the next one's rows: its keys are masked (a select), its query rows are never
// written, and a NaN or Inf among its values, which a masked tile's P = 0 would spread, sets off
// the repair of the rows that met it (the end of the keys makes that tile a masked one).
#include "common.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "features.cuh"
#include "gemm.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "repair.cuh"
#include "forward_sm90.cuh"

namespace cuflash {

// The consumer warpgroups' turns at the tensor cores (FlashAttention-3's ping-pong): a warpgroup
// issues a tile's products only once the previous warpgroup (in a ring) has issued its own, so
// that one warpgroup's softmax runs while the others' products keep the tensor cores busy,
// instead of all warpgroups computing their softmax at the same time. Named barrier
// FIRST + w is warpgroup w's: it syncs there (128 threads) and the previous one arrives (128).
// Every consumer warpgroup of a block takes the same number of turns (the same items and key
// tiles), so the arrivals balance: the first warpgroup gets the first turn by an arrival of its
// own at start(), and takes the last warpgroup's final arrival at finish().
template <int CONSUMERS, bool ON>
struct TensorCoreTurns {
  static constexpr int FIRST = 1;  // named barriers 1 .. CONSUMERS (0: __syncthreads)
  int wg;
  __device__ __forceinline__ void start() const {
    if (ON && wg == 0) named_barrier_arrive(FIRST, 256);
  }
  __device__ __forceinline__ void begin() const {
    if constexpr (ON) named_barrier_sync(FIRST + wg, 256);
  }
  __device__ __forceinline__ void end() const {
    if constexpr (ON) named_barrier_arrive(FIRST + (wg + 1) % CONSUMERS, 256);
  }
  __device__ __forceinline__ void finish() const {
    if (ON && wg == 0) named_barrier_sync(FIRST, 256);
  }
};

// The key-tile loop of the consumers (the host's choice, cuflash/_kernels.py): each tile's steps
// one after the other, pipelined within each warpgroup, pipelined with turns at the tensor cores,
// or one after the other with turns (SCHEDULE_SERIAL_TURNS, FlashAttention-3's ping-pong without
// its pipelining): in its turn a warpgroup issues P_j V_j, waits for it and issues S_{j+1}, then
// waits for S_{j+1} and computes its softmax while the other warpgroups take their turns. S and
// the P fragments are never live at once (the pipelined loops hold both through the softmax), so
// that the FP8 forward's 256-key tiles at d = 128 and its d = 256 tiles fit (docs/perf/NOTES.md,
// v49: 1.04-1.21x the serial loop there).
enum ForwardSchedule {
  SCHEDULE_SERIAL = 0,
  SCHEDULE_OVERLAP = 1,
  SCHEDULE_TURNS = 2,
  SCHEDULE_SERIAL_TURNS = 3
};

template <typename Elem, int HD, int BM, int BN, int STAGES, int O_VIA_TMA, int SCHEDULE,
          int FEATURES>
struct TmaForwardTraits : Sm90ForwardTraits<Elem, HD, BM, BN, FEATURES> {
  static constexpr int CONSUMERS = BM / 64;
  // O through a staging tile and TMA stores (see the top of the file)
  static constexpr bool STAGE_O = O_VIA_TMA != 0;
  static constexpr int O_STAGE_BYTES = STAGE_O ? BM * HD * 2 : 0;
  static constexpr int STAGE_O_BARRIER = 8;  // named barrier 8 + consumer warpgroup
  static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
  typedef WarpSpecialisedRegisters<CONSUMERS> Regs;
  // Q buffers: the next work item's Q loads during this one
  static constexpr int Q_BUFS = ItemBuffers<HD>::COUNT;
  // Pipelined, a thread holds O's accumulator (HD / 2 registers), S (BN / 2) and the P
  // fragments of the product in flight (BN / 4) at once: with three consumers at d = 64 and
  // BN = 128 that spilled 16-160 bytes, and the host asks for SCHEDULE_SERIAL there.
  static constexpr bool OVERLAP = SCHEDULE == SCHEDULE_OVERLAP || SCHEDULE == SCHEDULE_TURNS;
  static constexpr bool TURNS = SCHEDULE == SCHEDULE_TURNS || SCHEDULE == SCHEDULE_SERIAL_TURNS;
  // The rows' 1 / l and log2(l) by the MUFU (softmax.cuh, finish_row<FAST>) and, in the pipelined
  // loops, under the last P V (FINISH_UNDER_PV in the kernel): d = 128's 160-key tiles (16-bit, no
  // softcap), where that ran 1.015-1.025x at 4k and 1.02-1.03x at 16k (H200, bf16, dense, causal);
  // the 128-key tiles at 1k lost 1.4% with it, and the softcap 3% at 4k in v46. Every loop of an
  // instance finishes its rows alike (the schedules give the same bits).
  static constexpr bool FAST_FINISH = HD == 128 && BN > 128 &&
      Sm90ForwardTraits<Elem, HD, BM, BN, FEATURES>::BYTES == 2 && !Features<FEATURES>::SOFTCAP;
  // A tile's softmax finished in its own branch (acc_o's rescale and P's fragments: probabilities
  // in the kernel): the FP8 forward's serial turns, where that took 0.98x the cycles under ncu at
  // d = 128 and 256 (the whole call 0.96-1.07x, geometric mean 1.01, H200). The 16-bit serial
  // loop of three consumers at d = 64 ran 0.89-0.97x with it (docs/perf/NOTES.md, v50).
  static constexpr bool FINISH_IN_BRANCH =
      Sm90ForwardTraits<Elem, HD, BM, BN, FEATURES>::BYTES == 1 &&
      SCHEDULE == SCHEDULE_SERIAL_TURNS;
  typedef TensorCoreTurns<CONSUMERS, TURNS> Turns;
  // The last row block of a head split by keys (Params::split_last; the host's choice where that
  // block's real rows fit one warpgroup): every consumer runs the block's first 64 rows over every
  // CONSUMERS-th key tile, and the first consumer merges the others' partial rows (their max,
  // sum and O, through shared memory: COMBINE_BYTES) before its epilogue. Such a block costs about
  // a third of the others, where the whole block's tiles cost as much as a full one: d = 64's
  // 192-row tiles at 1k rows (5 x 192 + 64) spend a sixth of their items on it. The three-consumer
  // serial loop, 16-bit, dense sequences without a window (the host's walk:
  // decode_last_first_work), and not the softcap with ALiBi (4 B spilled).
  static constexpr bool SPLIT_LAST = CONSUMERS == 3 && SCHEDULE == SCHEDULE_SERIAL &&
      Sm90ForwardTraits<Elem, HD, BM, BN, FEATURES>::BYTES == 2 && !Features<FEATURES>::PACKED &&
      !Features<FEATURES>::LOCAL && !(Features<FEATURES>::SOFTCAP && Features<FEATURES>::ALIBI);
  // per thread of each consumer but the first: its O accumulator, row max and sum, repair bits
  static constexpr int COMBINE_FIELDS = HD / 2 + 5;
  static constexpr int COMBINE_BYTES = SPLIT_LAST ? (CONSUMERS - 1) * 128 * COMBINE_FIELDS * 4 : 0;
  static constexpr int COMBINE_WRITTEN = 12, COMBINE_READ = 13;  // named barriers
  // One TMA box per column block of a Q or K tile (ROW_BYTES = 128 bytes, or 64 for e4m3 at
  // d = 64; BOX_COLS elements wide), and of V's (16-bit) or of V^T's, whose blocks hold 128 keys
  // (8-bit: ForwardFormat); O's stores (16-bit) go in 64-column blocks.
  static constexpr int ROW_BYTES = Sm90ForwardTraits<Elem, HD, BM, BN, FEATURES>::ROW_BYTES;
  static constexpr int BOX_COLS = ROW_BYTES / Sm90ForwardTraits<Elem, HD, BM, BN, FEATURES>::BYTES;
  static constexpr int COL_BLOCKS = HD / BOX_COLS, O_COL_BLOCKS = HD / 64;
  static constexpr bool V_TRANSPOSED = ForwardFormat<Elem>::V_TRANSPOSED;
  static constexpr int V_BLOCKS = V_TRANSPOSED ? BN / 128 : COL_BLOCKS;
  static_assert(!V_TRANSPOSED || !(Features<FEATURES>::SOFTCAP || Features<FEATURES>::ALIBI ||
                                   Features<FEATURES>::PACKED),
                "the FP8 forward: dense, causal or windowed, not packed");
};

// The tensor maps of q, k and v (read in boxes of BM query rows, BN keys) and of o (written in
// boxes of 64 rows, one per consumer warpgroup, where O_VIA_TMA).
struct ForwardMaps {
  TensorMap q, k, v, o;
};

// The first query row of work slot `block` of a sequence (the file's top: "Row blocks", "Packed").
template <int BM, bool PACKED>
__device__ __forceinline__ int slot_row0(const Params& p, const Seq<PACKED>& seq, int block) {
  if constexpr (PACKED) return block * BM - (p.paired ? p.num_blocks * BM - seq.nq(p) : 0);
  else return block * BM - p.row_shift;
}

// A work item as the producer decoded it, posted beside its Q buffer before that buffer's "full"
// arrival: the consumers take it after their wait for Q, so that the walk and the decode (64-bit
// divisions; the packed list's loads) run once a block, on the producer's thread, and not on
// every consumer thread's path between two items. `last`: no item follows (posted without Q).
template <bool PACKED>
struct PostedItem {
  WorkItem<PACKED> work;
  int last;
};
// The host's allowance per Q buffer (cuflash/_kernels.py, POSTED_ITEM_BYTES, which the compiled
// source asserts equal)
constexpr int POSTED_ITEM_BYTES = 64;

// The barriers of the pipeline, in shared memory after the tiles. K_j and V_j share stage
// j % STAGES but are released apart: K_j once S_j has been computed, V_j after P_j V_j. Then the
// work items posted with the Q buffers.
template <int Q_BUFS, int STAGES, bool PACKED>
struct TmaForwardBarriers {
  unsigned long long q_full[Q_BUFS], q_empty[Q_BUFS];
  unsigned long long k_full[STAGES], k_empty[STAGES], v_full[STAGES], v_empty[STAGES];
  PostedItem<PACKED> item[Q_BUFS];
  static_assert(sizeof(PostedItem<PACKED>) <= POSTED_ITEM_BYTES, "the host's allowance");
};

// Stages this warp's 16 rows of the normalised O (acc, the accumulator fragments) as 16-bit
// elements in the staging tile: column block c (64 columns, 128 bytes a row) of the warpgroup's 64
// rows at sO + c BM 128 + wg 64 128, 16-byte chunks swizzled as the TMA unit's 128-byte swizzle
// lays them out (chunk k of row r at k ^ (r % 8)). stmatrix x4 writes n-tiles nt and nt + 1, rows
// 0-7 and 8-15.
template <typename Elem, int HD, int BM>
__device__ __forceinline__ void stage_output_rows(unsigned char* sO, const float (&acc)[HD / 8][4],
                                                  int wg, int warp_row0_in_wg, int lane) {
  unsigned char* base = sO + wg * (64 * 128);
  const int m = lane >> 3;                                    // the matrix this lane addresses
  const int row = warp_row0_in_wg + 8 * (m & 1) + (lane & 7);  // within the warpgroup's 64 rows
#pragma unroll
  for (int nt = 0; nt < HD / 8; nt += 2) {
    const int chunk = nt + (m >> 1);  // 16-byte column chunk of the lane's matrix
    unsigned char* addr =
        base + (chunk >> 3) * (BM * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
    stmatrix_x4(addr, ElemTraits<Elem>::pack2(acc[nt][0], acc[nt][1]),
                ElemTraits<Elem>::pack2(acc[nt][2], acc[nt][3]),
                ElemTraits<Elem>::pack2(acc[nt + 1][0], acc[nt + 1][1]),
                ElemTraits<Elem>::pack2(acc[nt + 1][2], acc[nt + 1][3]));
  }
}

// SPLIT_LAST: the consumers' partial results for the same 64 rows (each over its share of the key
// tiles) merged into the first consumer's. Thread t of every consumer holds the same rows and
// columns: the others write their O accumulator, row max, row sum and repair bits at `area`
// (COMBINE_FIELDS values of 128 threads each, field-major: consecutive threads, consecutive
// words), the first rescales everything to the rows' common max and adds them in consumer order,
// so that the bits do not depend on which consumer finished first. Two named barriers: written
// (the others arrive, the first waits) and read (the other way round), so that the area is free
// again before any consumer can reach its next split block.
template <typename Tr, typename Block>
__device__ __forceinline__ void merge_split_rows(Block& blk, float* area, unsigned& repair) {
  constexpr int F = Tr::COMBINE_FIELDS, NT_O = Tr::NT_O, THREADS = 128 * Tr::CONSUMERS;
  const int t = threadIdx.x & 127;
  if (blk.wg > 0) {
    float* mine = area + (blk.wg - 1) * (F * 128) + t;
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(nt * 4 + e) * 128] = blk.acc_o[0][nt][e];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mine[(NT_O * 4 + r) * 128] = blk.softmax.row_max[0][r];
      mine[(NT_O * 4 + 2 + r) * 128] = blk.softmax.row_sum[0][r];
    }
    mine[(NT_O * 4 + 4) * 128] = __uint_as_float(repair);
    named_barrier_arrive(Tr::COMBINE_WRITTEN, THREADS);
    named_barrier_sync(Tr::COMBINE_READ, THREADS);
    return;
  }
  named_barrier_sync(Tr::COMBINE_WRITTEN, THREADS);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = blk.softmax.row_max[0][r];
#pragma unroll
    for (int w = 1; w < Tr::CONSUMERS; ++w)
      m = fmaxf(m, area[(w - 1) * (F * 128) + (NT_O * 4 + r) * 128 + t]);
    // each consumer's P are exp2(s scale_log2 - its max scaled - shift) (softmax.cuh, move_row):
    // rescaled to the common max
    const float m_scaled = blk.softmax.scaled_max(m, blk.scale_log2);
    const float own = fast_exp2(blk.softmax.row_max[0][r] * blk.scale_log2 - m_scaled);
    float sum = blk.softmax.row_sum[0][r] * own;
    blk.softmax.rescale_row(blk.acc_o, 0, r, own);
#pragma unroll
    for (int w = 1; w < Tr::CONSUMERS; ++w) {
      const float* theirs = area + (w - 1) * (F * 128) + t;
      const float factor =
          fast_exp2(theirs[(NT_O * 4 + r) * 128] * blk.scale_log2 - m_scaled);
      sum = fmaf(theirs[(NT_O * 4 + 2 + r) * 128], factor, sum);
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e)
          blk.acc_o[0][nt][e] = fmaf(theirs[(nt * 4 + e) * 128], factor, blk.acc_o[0][nt][e]);
    }
    blk.softmax.row_max[0][r] = m;
    blk.softmax.row_sum[0][r] = sum;
  }
#pragma unroll
  for (int w = 1; w < Tr::CONSUMERS; ++w)
    repair |= __float_as_uint(area[(w - 1) * (F * 128) + (NT_O * 4 + 4) * 128 + t]);
  named_barrier_arrive(Tr::COMBINE_READ, THREADS);
}

template <typename Elem, int HD, int BM, int BN, int STAGES, int O_VIA_TMA, int SCHEDULE,
          int FEATURES>
__global__ void __launch_bounds__((BM / 64 + 1) * 128, 1)
    attention_forward_tma(const __grid_constant__ ForwardMaps maps, const __grid_constant__ Params p) {
  typedef TmaForwardTraits<Elem, HD, BM, BN, STAGES, O_VIA_TMA, SCHEDULE, FEATURES> Tr;
  static_assert(!Tr::STAGE_O || HD <= 128, "an O staging tile fits in shared memory at HD <= 128");
  constexpr int Q_BUFS = Tr::Q_BUFS;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  extern __shared__ unsigned char smem_raw[];
  // Swizzled tiles must start on 1024-byte boundaries; the host adds 1 KB of slack for this.
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sQ = smem;                         // Q_BUFS tiles
  unsigned char* sK = sQ + Q_BUFS * Tr::Q_BYTES;    // STAGES tiles
  unsigned char* sV = sK + STAGES * Tr::KV_BYTES;   // STAGES tiles
  unsigned char* sO = sV + STAGES * Tr::KV_BYTES;   // the O staging tile (STAGE_O)
  float* combine = reinterpret_cast<float*>(sO + Tr::O_STAGE_BYTES);  // SPLIT_LAST's partial rows
  TmaForwardBarriers<Q_BUFS, STAGES, PACKED>& bar =
      *reinterpret_cast<TmaForwardBarriers<Q_BUFS, STAGES, PACKED>*>(sO + Tr::O_STAGE_BYTES +
                                                                     Tr::COMBINE_BYTES);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // The parameters are read where they are used (Tr::Mask::of(p) builds the mask there): copies
  // held through the loops cost the consumers registers.

  if (threadIdx.x == 0) {
    // "full": the producer's arrival with its byte count; "empty": one arrival per consumer warp,
    // and for Q per consumer thread (each thread's own arrival orders its reads of the posted
    // item before the producer's next write there; compute-sanitizer's racecheck does not take a
    // warp's __syncwarp and one lane's arrival for it, docs/perf/NOTES.md, v36).
    mbar_init_pairs(bar.q_full, bar.q_empty, 1, 128 * Tr::CONSUMERS);
    mbar_init_pairs(bar.k_full, bar.k_empty, 1, 4 * Tr::CONSUMERS);
    mbar_init_pairs(bar.v_full, bar.v_empty, 1, 4 * Tr::CONSUMERS);
    fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {
    // Producer warpgroup: one thread issues every copy.
    Tr::Regs::producer();
    if (warp != 0 || lane != 0) return;
    prefetch_tensor_map(&maps.q);
    prefetch_tensor_map(&maps.k);
    prefetch_tensor_map(&maps.v);
    if constexpr (Tr::STAGE_O) prefetch_tensor_map(&maps.o);
    // Windowed instances walk decode_chunked_work's order where the host asks (Params::walk_heads)
    constexpr bool CHUNKABLE = Features<FEATURES>::LOCAL && !PACKED;
    const WorkWalk<PACKED> walk{work_count<PACKED>(p), p.paired != 0,
                              PACKED || (CHUNKABLE && p.walk_heads > 0)};  // common.cuh
    int pipe = 0;  // key tiles of earlier items: tile t in stage t % STAGES, its use t / STAGES
    int round = 0;  // work items done
    for (int step = 0; !walk.done(step); ++step) {
      const i64 item = walk.item(step);
      if (item >= walk.num_work) continue;
      const WorkItem<PACKED> work =
          work_item<PACKED, CHUNKABLE, Tr::SPLIT_LAST>(p, item, p.heads_q);
      const BlockCoords bc = work.c;
      const Seq<PACKED> seq = work.seq;
      const int kv_head = bc.head / p.group, m0 = slot_row0<BM>(p, seq, bc.block);
      if (m0 + BM <= 0 || m0 >= seq.nq(p)) continue;  // an empty slot (row_shift above)
      const TileRange tiles = Tr::Mask::of(p, seq.ext).key_tiles(m0, BM, BN);
      // K or V (`sT`, `map`, its barriers) of visit `it` of this item's key tiles into its stage
      // (tile number pipe + it, stage (pipe + it) % STAGES), once the consumers released it.
      // V^T (Tr::V_TRANSPOSED): its map is (keys, d, heads, batch), a box 128 keys by HD rows.
      auto load = [&](int it, unsigned char* sT, const TensorMap* map, unsigned long long* full,
                      unsigned long long* empty) {
        const int tile = pipe + it, stage = tile % STAGES;
        const int n0 = tiles.at(it) * BN;
        mbar_wait(&empty[stage], ((tile / STAGES) & 1) ^ 1);
        mbar_arrive_expect_tx(&full[stage], Tr::KV_BYTES);
        if (Tr::V_TRANSPOSED && map == &maps.v) {
#pragma unroll
          for (int c = 0; c < Tr::V_BLOCKS; ++c)
            tma_load_4d(sT + stage * Tr::KV_BYTES + c * (HD * 128), map, &full[stage],
                        seq.k_coord(n0) + 128 * c, 0, kv_head, seq.map_batch());
          return;
        }
#pragma unroll
        for (int c = 0; c < Tr::COL_BLOCKS; ++c)
          tma_load_4d(sT + stage * Tr::KV_BYTES + c * (BN * Tr::ROW_BYTES), map, &full[stage],
                      Tr::BOX_COLS * c, seq.k_coord(n0), kv_head, seq.map_batch());
      };
      // The loads in the order the consumers use them: pipelined (Tr::OVERLAP), K_0, then
      // K_{it + 1} before V_it (they compute S_{it + 1} = Q K_{it + 1}^T before P_it V_it); the
      // serial loop takes K_it, V_it, K_{it + 1}. (The pipelined order under the serial loop
      // held d = 64 from 4k, its one user, at 0.95-0.98x v17: docs/perf/NOTES.md, v20.) With one
      // Q buffer it frees up only when the consumers have computed the previous item's last S,
      // when K_0's stage has freed up too: load K_0 first, so that it is under way when the item
      // starts.
      const int count = tiles.count();
      const int first_k = Q_BUFS == 1 && count > 0 ? 1 : 0;
      if (first_k) load(0, sK, &maps.k, bar.k_full, bar.k_empty);
      const int qb = acquire_to_fill(bar.q_empty, round);
      bar.item[qb] = PostedItem<PACKED>{work, 0};  // seen by the consumers after the arrival
      mbar_arrive_expect_tx(&bar.q_full[qb], Tr::Q_BYTES);
#pragma unroll
      for (int c = 0; c < Tr::COL_BLOCKS; ++c)
        tma_load_4d(sQ + qb * Tr::Q_BYTES + c * (BM * Tr::ROW_BYTES), &maps.q, &bar.q_full[qb],
                    Tr::BOX_COLS * c, seq.q_coord(m0), bc.head, seq.map_batch());
      if constexpr (Tr::OVERLAP) {
        for (int it = first_k; it <= count; ++it) {
          if (it < count) load(it, sK, &maps.k, bar.k_full, bar.k_empty);
          if (it > 0) load(it - 1, sV, &maps.v, bar.v_full, bar.v_empty);
        }
      } else {
        for (int it = 0; it < count; ++it) {
          if (it >= first_k) load(it, sK, &maps.k, bar.k_full, bar.k_empty);
          load(it, sV, &maps.v, bar.v_full, bar.v_empty);
        }
      }
      pipe += count;
    }
    const int qb = acquire_to_fill(bar.q_empty, round);  // the end of the walk
    bar.item[qb].last = 1;
    mbar_arrive(&bar.q_full[qb]);
    return;
  }

  // Consumer warpgroups.
  Tr::Regs::consumer();
  Sm90ForwardBlock<Tr, Elem, HD, BM, BN> blk;
  blk.sK = sK;
  blk.sV = sV;
  blk.lane = lane;
  blk.warp_row0 = (warp - 4) * 16;  // this warp's rows within the block
  // At d = 256 broadcast from lane 0, so that ptxas sees the warpgroup as warp-uniform (it is)
  // and keeps Q's descriptors in uniform registers: +2-5% there; at d <= 128 the broadcast read
  // -1 to -3% from 4k (docs/perf/NOTES.md v45), so those keep the plain index.
  const int wg = (warp - 4) >> 2;
  blk.wg = HD > 128 ? __shfl_sync(0xffffffffu, wg, 0) : wg;
  const float scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  blk.scale_log2 = scale_log2;
  const typename Tr::Turns turns{blk.wg};
  turns.start();
  // The thread that issues this warpgroup's O stores (STAGE_O)
  const bool o_issuer = Tr::STAGE_O && (threadIdx.x & 127) == 0;
  int pipe = 0, round = 0;
  // UNDER_PV: the pipelined loop of two consumers, two Q buffers and key tiles of up to 128 keys
  // (d = 64 under 1k rows, d = 128 under 4k, and the feature sets that keep those tiles) finishes
  // its rows, writes lse and takes the next item and its Q while its last P V is in flight
  // (below); the others do so after the loop and at the top of the next item. Not with every
  // modifier on packed sequences (d = 128's spilled 24-32 B under NVRTC).
  typedef Features<FEATURES> F;
  constexpr bool UNDER_PV = Tr::OVERLAP && Q_BUFS > 1 && BN <= 128 && Tr::CONSUMERS == 2 &&
                            !(F::PACKED && F::LOCAL && F::SOFTCAP && F::ALIBI);
  // FINISH_UNDER_PV: the rows finished and lse written under the last P V, as UNDER_PV does but
  // without its early Q: UNDER_PV's instances and the pipelined ones with FAST_FINISH.
  constexpr bool FINISH_UNDER_PV = UNDER_PV || (Tr::FAST_FINISH && Tr::OVERLAP);
  int qb = UNDER_PV ? acquire_to_read(bar.q_full, round) : 0;
  for (;;) {
    // The next item and its Q (the producer posted the item with it; empty slots never come)
    if constexpr (!UNDER_PV) qb = acquire_to_read(bar.q_full, round);
    if (bar.item[qb].last) break;
    const WorkItem<PACKED> work = bar.item[qb].work;
    const BlockCoords bc = work.c;
    const Seq<PACKED> seq = work.seq;
    blk.m0 = slot_row0<BM>(p, seq, bc.block);
    blk.sQ = sQ + qb * Tr::Q_BYTES;
    blk.mod = Tr::ScoreMod::of(p, bc.batch, bc.head, static_cast<float>(p.scale), seq.ext);
    // The FP8 forward's factors per (batch, key/value head): q's and k's scale the scores, v's O.
    float o_factor = 1.f;
    if constexpr (Tr::V_TRANSPOSED) {
      const int kv_head = bc.head / p.group;
      blk.scale_log2 = scale_log2 * descale_of(p.descale_q, bc.batch, kv_head) *
                       descale_of(p.descale_k, bc.batch, kv_head);
      o_factor = descale_of(p.descale_v, bc.batch, kv_head);
    }
    fill(blk.acc_o, 0.f);
    // P reaches 2^RESCALE_SLACK under the trailing row max (softmax.cuh): where the host scales P
    // down (bfloat16, p_shift > 0; see forward.cu) the slack goes into the shift too.
    constexpr int SLACK = Tr::RESCALE_SLACK;
    if constexpr (Tr::PIN_AT_CAP) {
      // Rows pinned at the softcap (bfloat16; softmax.cuh, CEILING): a pinned row's P =
      // exp2(s - c - p_shift) stays under 2^-p_shift whatever p_shift is, with the slack in the
      // shift.
      blk.softmax.init(p.p_shift + SLACK);
      blk.softmax.set_ceiling(blk.mod.cap_out, 96.f - 2.f * p.p_shift, blk.scale_log2, SLACK);
    } else if constexpr (SLACK > 0) {
      blk.softmax.init(p.p_shift > 0.f ? p.p_shift + SLACK : 0.f);
    } else {
      blk.softmax.init(p.p_shift);  // see forward.cu
    }
    const TileRange tiles = Tr::Mask::of(p, seq.ext).key_tiles(blk.m0, BM, BN);
    // SPLIT_LAST: every consumer takes the block's first 64 rows (issue_scores and the masks add
    // the warpgroup's 64-row offset to sQ and m0: move them back by it) over its share of the key
    // tiles, tiles.at(it) for it % CONSUMERS == wg.
    const bool split = Tr::SPLIT_LAST && p.split_last && bc.block == p.num_blocks - 1;
    if (split) {
      blk.m0 -= 64 * blk.wg;
      blk.sQ -= blk.wg * (64 * Tr::ROW_BYTES);
    }
    // The tiles that straddle a bound of the mask or the end of the keys first (mask.cuh,
    // TileRange::at). Rows that they made non-finite are flagged and recomputed at the end
    // (repair.cuh).
    const int masked = tiles.masked(), count = tiles.count();
    unsigned repair = 0;
    auto release = [&](unsigned long long* empty) {  // the producer may load into it again
      __syncwarp();
      if (lane == 0) mbar_arrive(empty);
    };
    // Key tile `it` of the item: its stage and the parity of that stage's use.
    auto stage_of = [&](int it) { return (pipe + it) % STAGES; };
    auto phase_of = [&](int it) { return static_cast<unsigned>(((pipe + it) / STAGES) & 1); };
    // S_it's scores (the accumulator of Q K_it^T, then P_it in float32), P as the A fragments of
    // the P V product in flight, the rescale factors of the softmax's last update, and whether
    // acc_o still awaits them (most tiles' rows keep their max: softmax.cuh, SLACK).
    float s[1][Tr::NT_S][4];
    unsigned pf[Tr::K_PV][4];
    float alphas[1][2];
    bool rescale = true;
    // S_it of the tile in `stage`, waited for and turned into probabilities; K_it released. With
    // Tr::FINISH_IN_BRANCH (the serial turns: no P V in flight here) acc_o's rescale and P's
    // fragments follow in each branch, where ptxas spreads their instructions among the exp2s (the
    // MUFU takes one a warp every 8 cycles); after the branches they ran as a tail of their own,
    // and the rescale in the next turn.
    auto probabilities = [&](int it) {
      if (it == count - 1) mbar_arrive(&bar.q_empty[qb]);  // the item's last S: Q is read
      release(&bar.k_empty[stage_of(it)]);
      auto then_finish = [&]() {
        if constexpr (!Tr::FINISH_IN_BRANCH) return;
        if (rescale) blk.softmax.rescale(blk.acc_o, alphas);
        rescale = false;  // acc_o is at this tile's scale
        blk.to_a_fragments(s, pf);
        // both computed in the branch: the compiler would sink them to the join (the rescale
        // even into the next turn, before P V's issue)
        fence_accumulators(blk.acc_o[0]);
        blk.fence_fragments(pf);
      };
      // Under ALiBi the tiles that straddle a row's diagonal go the masked way too: the unmasked
      // one takes ALiBi's one-sided form (Sm90ForwardBlock::alibi_side). Under a pinning softcap
      // (Tr::PIN_AT_CAP) the unmasked tiles of a warp whose rows are not all pinned yet go the
      // masked way (its first tiles, as a rule), the others take no max.
      const int alibi_sign = Tr::ScoreMod::HAS_ALIBI ? blk.alibi_side(tiles.at(it)) : 0;
      if (it < masked || (Tr::ScoreMod::HAS_ALIBI && alibi_sign == 0) ||
          (Tr::PIN_AT_CAP && !blk.softmax.warp_pinned())) {
        rescale = blk.template scores_to_probabilities<true>(tiles.at(it), s,
                                                             Tr::Mask::of(p, seq.ext), alphas);
        then_finish();
      } else if constexpr (Tr::PIN_AT_CAP) {
        blk.pinned_probabilities(s);
        rescale = false;
        then_finish();
      } else {
        rescale = blk.template scores_to_probabilities<false>(
            tiles.at(it), s, Tr::Mask::of(p, seq.ext), alphas, alibi_sign);
        then_finish();
      }
    };
    // ... and P_it's fragments, where no P V is in flight.
    auto softmax_tile = [&](int it) {
      probabilities(it);
      if constexpr (!Tr::FINISH_IN_BRANCH) blk.to_a_fragments(s, pf);
    };
    // P_it V_it waited for: V_it released, and the rows a masked tile made non-finite flagged once
    // the last masked tile is in.
    auto pv_done = [&](int it) {
      blk.pv_done(pf);
      release(&bar.v_empty[stage_of(it)]);
      if (it == masked - 1) repair = nonfinite_rows(blk.acc_o);
    };
    // The key tiles. Pipelined within the warpgroup (Tr::OVERLAP, FlashAttention-3): S_it = Q K_it^T
    // is issued before P_{it-1} V_{it-1}, and the softmax of S_it runs while that product is in
    // flight; acc_o is rescaled for P_{it-1} (by alpha_{it-1}) before its product is issued, and
    // the P fragments are rewritten only once it has been waited for. Otherwise each tile's
    // steps run one after the other.
    auto issue_scores = [&](int it) {
      mbar_wait(&bar.k_full[stage_of(it)], phase_of(it));
      blk.issue_scores(sK + stage_of(it) * Tr::KV_BYTES, s);
    };
    auto issue_pv = [&](int it) {
      // (with FINISH_IN_BRANCH `rescale` is false here; ptxas keeps the test and its block, and
      // without them scheduled the FP8 serial turns worse: 1.09x the cycles, NOTES.md v50)
      if (rescale) blk.softmax.rescale(blk.acc_o, alphas);
      mbar_wait(&bar.v_full[stage_of(it)], phase_of(it));
      blk.issue_pv(sV + stage_of(it) * Tr::KV_BYTES, pf);
    };
    // UNDER_PV: the rows' o_factor / l and lse (the running max and sum are final once the last
    // P is), lse written and the next item's Q taken while the last P V is in flight. At 1k rows
    // an item's fixed costs are ~15% of it, the two warpgroups' epilogues fall together and the
    // tensor cores idle through them (bench/trace_forward.py): 1.02-1.04x at d = 64 and 128, 1k
    // (docs/perf/NOTES.md v46). Elsewhere the exact finish measured 0.97-1.01x (160-key tiles,
    // d = 256, three consumers) and those instances keep the epilogue after the loop (finalize),
    // but for d = 128's 160-key tiles with FAST_FINISH (FINISH_UNDER_PV, v47).
    float inv_rows[1][2], lse_rows[1][2];
    auto finish_rows = [&]() {
      blk.softmax.template finish_rows<Tr::FAST_FINISH>(blk.scale_log2, inv_rows, lse_rows,
                                                        o_factor);
      float* lse_head = seq.template q_head<float>(p.lse, bc.head);
      if ((lane & 3) == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // rows outside [0, Nq) skipped (row_shift above)
          const int row = blk.m0 + blk.warp_row0 + (lane >> 2) + 8 * r;
          if (row >= 0 && row < seq.nq(p)) lse_head[row * p.lse.seq] = lse_rows[0][r];
        }
      }
    };
    int next_qb = -1;  // UNDER_PV: the next item's Q buffer, once taken
    if (count == 0) mbar_arrive(&bar.q_empty[qb]);
    // S_0 in the item's first turn, then its softmax (the loops with turns, or pipelined)
    auto first_scores = [&]() {
      turns.begin();
      issue_scores(0);
      turns.end();
      wgmma_wait<0>();
      softmax_tile(0);
    };
    if constexpr (Tr::OVERLAP) {
      if (count > 0) first_scores();
      for (int it = 1; it < count; ++it) {
        turns.begin();
        issue_scores(it);
        issue_pv(it - 1);
        turns.end();
        wgmma_wait<1>();  // S_it
        probabilities(it);
        wgmma_wait<0>();  // P_{it-1} V_{it-1}
        pv_done(it - 1);
        blk.to_a_fragments(s, pf);
      }
      if (count > 0) {
        issue_pv(count - 1);
        if constexpr (FINISH_UNDER_PV) finish_rows();
        if constexpr (UNDER_PV) next_qb = acquire_to_read(bar.q_full, round);
        wgmma_wait<0>();
        pv_done(count - 1);
      }
    } else if constexpr (Tr::TURNS) {
      // SCHEDULE_SERIAL_TURNS: each turn issues P_{it-1} V_{it-1}, waits for it, and issues S_it
      // (with both in flight, FP8's 256-key tiles left ptxas short of registers: it serialised
      // every wgmma of the kernel)
      if (count > 0) first_scores();
      for (int it = 1; it < count; ++it) {
        turns.begin();
        issue_pv(it - 1);
        wgmma_wait<0>();
        pv_done(it - 1);
        issue_scores(it);
        turns.end();
        wgmma_wait<0>();
        softmax_tile(it);
      }
      if (count > 0) {
        turns.begin();
        issue_pv(count - 1);
        turns.end();
        wgmma_wait<0>();
        pv_done(count - 1);
      }
    } else {
      auto serial_tile = [&](int it) {
        issue_scores(it);
        wgmma_wait<0>();
        softmax_tile(it);
        issue_pv(it);
        wgmma_wait<0>();
      };
      if (split) {
        // Another consumer's tile: waited for (so that this release counts towards its use, not
        // the stage's next) and released at once.
        auto pass_tile = [&](int it) {
          if (it == count - 1) mbar_arrive(&bar.q_empty[qb]);
          mbar_wait(&bar.k_full[stage_of(it)], phase_of(it));
          release(&bar.k_empty[stage_of(it)]);
          mbar_wait(&bar.v_full[stage_of(it)], phase_of(it));
          release(&bar.v_empty[stage_of(it)]);
        };
        for (int it = 0; it < count; ++it) {
          if (it % Tr::CONSUMERS != blk.wg) {
            pass_tile(it);
            continue;
          }
          serial_tile(it);
          blk.pv_done(pf);
          release(&bar.v_empty[stage_of(it)]);
          // this consumer's last masked tile (the first `masked` come first)
          if (it < masked && it + Tr::CONSUMERS >= masked) repair = nonfinite_rows(blk.acc_o);
        }
      } else {
        for (int it = 0; it < count; ++it) {
          serial_tile(it);
          pv_done(it);
        }
      }
    }
    pipe += count;
    if (split) {
      merge_split_rows<Tr>(blk, combine, repair);
      if (blk.wg != 0) continue;  // the first consumer writes the rows
    }

    // Epilogue: normalise, write O (through the staging tile, or this lane's pairs of it straight
    // from registers) and lse (FINISH_UNDER_PV wrote it above).
    if constexpr (FINISH_UNDER_PV) {
      if (count == 0) finish_rows();
      blk.softmax.rescale(blk.acc_o, inv_rows);
    } else {
      blk.softmax.template finalize<Tr::FAST_FINISH>(blk.acc_o, blk.scale_log2, lse_rows,
                                                     o_factor);
    }
    unsigned short* o_head = seq.template q_head<unsigned short>(p.o, bc.head);
    float* lse_head = seq.template q_head<float>(p.lse, bc.head);
    // Rows outside [0, Nq) are skipped: past the last, or before the first (row_shift above).
    const int row0 = blk.m0 + blk.warp_row0;
    bool staged = false;
    if constexpr (Tr::STAGE_O) {
      // The last item's store has read the staging tile (its issuer waited; the barrier tells the
      // others). The warpgroup stages O when its 64 rows all exist: a TMA store of a box that
      // starts before row 0 faults on the H100 (docs/perf/NOTES.md, v9; loads of such boxes are
      // fine), and this epilogue's first version faulted on calls whose partial boxes ran past
      // Nq too. No row may need the repair either, whose stores would race the TMA's. Otherwise
      // the warpgroup writes O from registers.
      if (o_issuer) bulk_wait_read<0>();
      const int box_row0 = blk.m0 + 64 * blk.wg;
      const bool whole_box = box_row0 >= 0 && box_row0 + 64 <= seq.nq(p);
      staged = !warpgroup_any(Tr::STAGE_O_BARRIER + blk.wg, repair != 0 || !whole_box);
      if (staged) {
        stage_output_rows<typename Tr::Out, HD, BM>(sO, blk.acc_o[0], blk.wg,
                                                    blk.warp_row0 - 64 * blk.wg, lane);
        fence_proxy_async_shared();
        warpgroup_sync(Tr::STAGE_O_BARRIER + blk.wg);
        if (o_issuer) {
#pragma unroll
          for (int c = 0; c < Tr::O_COL_BLOCKS; ++c)
            tma_store_4d(&maps.o, sO + c * (BM * 128) + blk.wg * (64 * 128), 64 * c,
                         seq.q_coord(box_row0), bc.head, seq.map_batch());
          bulk_commit();
        }
      }
    }
    // Otherwise from registers, in 16-byte pieces where d's n-tiles come in fours (mma.cuh,
    // store_accumulator_rows; this kernel runs only on aligned launches).
    if (!staged)
      store_accumulator_rows<typename Tr::Out, Tr::NT_O>(o_head, p.o.seq, row0, seq.nq(p),
                                                         p.head_dim, blk.acc_o[0], 1.f, lane);
    if (!FINISH_UNDER_PV && (lane & 3) == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + (lane >> 2) + 8 * r;
        if (row >= 0 && row < seq.nq(p)) lse_head[row * p.lse.seq] = lse_rows[0][r];
      }
    }
    if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
      __syncwarp();
      const int kv_head = bc.head / p.group;
      typedef const typename ElemTraits<Elem>::storage In;
      recompute_forward_rows<Elem, HD, 1, typename Tr::Out>(
          o_head + row0 * p.o.seq, p.o.seq, p.head_dim, repair, lse_rows, blk.scale_log2,
          seq.template q_rows<In>(p.q, bc.head), seq.template k_rows<In>(p.k, kv_head),
          seq.template k_rows<In>(p.v, kv_head), row0, Tr::Mask::of(p, seq.ext), blk.mod,
          p.head_dim, lane, o_factor);
    }
    if constexpr (UNDER_PV) qb = next_qb >= 0 ? next_qb : acquire_to_read(bar.q_full, round);
  }
  turns.finish();
  if (o_issuer) bulk_wait<0>();  // the last stores have completed before the block exits
}

}  // namespace cuflash
