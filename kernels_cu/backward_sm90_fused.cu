// backward_sm90_fused.cu: the fused Hopper backward (sm_90a) of unpacked attention (dense, causal,
// sliding windows; softcap, ALiBi): one kernel computes dK, dV and dQ's partial sums from
// the same S and dP (5 matrix products per tile pair, where the dK/dV and dQ kernels of
// backward_sm90_tma.cu do 7), and a second one turns the float32 sums into dQ. Deterministic: the
// partial sums of a query tile are added in a fixed order (below), never by unordered atomics.
//
// attention_backward_fused_tma: as attention_backward_dkdv_tma (a persistent block per SM walks the
// (batch, KV head, key block) items; warpgroup 0 produces, consumer warpgroups of 64 keys run the
// steps of Sm90DkdvKeys over the query tiles of every query head of the group), and per query tile:
//   - both consumers store dS^T of their keys into one shared tile (stmatrix, 128-byte swizzle;
//     two tiles used in turn, so that one barrier a tile orders the consumers);
//   - each computes dQ_part = dS K (wgmma, A = dS^T read MN-major, B = K read MN-major) for half
//     of the tile (with 128-row query tiles at d = 64: its 64 queries; with 64-row ones at d = 128:
//     half of the head dim; with 64-row ones at d = 64: every column over its own keys, the second
//     consumer staging the sum of both parts) and stores it, in fragment order, into a staging
//     tile;
//   - warp 1 of the producer warpgroup (the writer) adds the staging tile to the query tile's
//     float32 sums in global memory with one TMA bulk reduction (a bulk copy for the first one),
//     in its turn: the tile's counter says how many items have added theirs. The writer waits for
//     the turn before the staged tile (without a bound at 64-row tiles, warp 2 waits for it a
//     few tiles ahead: POLL_AHEAD), hands the staging tile back once the reduction has read it,
//     and releases the counter once the reduction is written. At d = 256, and at d = 128 under a
//     causal mask alone, two writers (warps 1 and 3) each add one half of the columns in its own
//     turns, counted in its own 16-bit half of the counter (HALF_WRITERS).
// The turns, deterministic whatever the timing: each query tile's additions come in an order fixed
// by the shapes alone, and an item waits only for additions that come before its own.
//   - Unbounded masks ("rotated", FusedDqOrder): every key block adds to every query tile. The
//     items of one (batch, KV head) that run at one time (a wave of the persistent walk: item i
//     runs as step i / G of block i % G) visit the query steps rotated, item r of the wave's m
//     starting at step r T / m (T: a query head's tiles), so that at each step they work on
//     different tiles, and each tile's turns follow the order of the visits; items of later waves
//     come after those of earlier ones. A turn waits only for additions made at earlier steps of
//     the same wave or in earlier waves, so every wait ends. It needs an item per start: at most
//     group x T key blocks per head (cuflash/_dispatch.py).
//   - A right bound (causal, windows; "bounded", FusedBoundedOrder): key block j adds to the query
//     tiles of its rows (mask.cuh, query_tiles), which it visits in ascending order, head by head
//     (a left bound alone stays with the split kernels: every list would start at tile 0). Within
//     a round of the walk (paired: heavy items with light, common.cuh, WorkWalk) a tile's
//     additions come step by step, after those of earlier rounds, and within a step in the order
//     the items reach the tile (from the last key block down, or, with grouped heads under a
//     causal mask or a wide window, up at the second step): a single order of the items, so the
//     waits cannot form a cycle, and one that follows their arrival, so they seldom wait. At
//     d = 64 (128-row tiles) under a causal mask without modifiers, FusedArrivalOrder instead:
//     the second step's lists from the end, turns by expected arrival, counted by warp 2.
// Masked tiles: pairs a query may not see get P = 0 and dS = 0, and so do the padding keys of a
// partial last key block, whose dS would reach dQ (unbounded masks have no masked tiles: there
// those keys' rows of dS^T are overwritten with zeros instead). Bounded masks repair the rows a
// masked tile made non-finite (repair.cuh) from the rows that are non-finite at the end: dK and
// dV after the block's last item (repair_fused_dkdv), dQ in attention_backward_dq_from_accum. The
// tiles are visited in ascending order here, not masked first, so the check waits for the end; a
// row that is non-finite for a visible reason is recomputed to the same value.
//
// attention_backward_dq_from_accum: dQ = scale * sums, a block per (batch, query head, query tile).
#include "common.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "features.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "backward_sm90.cuh"
#include "backward_sm90_tma.cuh"
#include "repair.cuh"

namespace cuflash {

// The turn of an item at each query step: items base .. base + n - 1 share a (batch, KV head).
// The m items of a wave start `span` / m query steps apart, span being one query head's tiles
// (or all steps, where there are more items than tiles): every query tile then gets its additions
// a few steps apart, while its sums are still in L2 (spread over the whole group's steps, grouped
// heads ran 0.77-0.92x as fast, docs/perf/NOTES.md, v21).
struct FusedDqOrder {
  int first;   // items of the head in earlier waves
  int r, m;    // this item's position among the head's items in its wave, and their count
  int span;    // query steps the wave's first steps spread over
  int steps;   // query steps per item (group x query tiles)
  int offset;  // this item's first query step

  static __device__ __forceinline__ FusedDqOrder of(i64 item, int n, int tiles, int steps) {
    const i64 grid = gridDim.x, base = item - item % n, wave = item / grid;
    const i64 lo = max(base, wave * grid), hi = min(base + n, (wave + 1) * grid);
    FusedDqOrder o;
    o.first = static_cast<int>(lo - base);
    o.r = static_cast<int>(item - lo);
    o.m = static_cast<int>(hi - lo);
    o.steps = steps;
    o.span = o.m <= tiles ? tiles : steps;
    o.offset = static_cast<int>(static_cast<i64>(o.r) * o.span / o.m);
    return o;
  }
  __device__ __forceinline__ int step_at(int s) const {  // the query step of local step s
    const int q = offset + s;
    return q >= steps ? q - steps : q;
  }
  // Additions to query step q before this item's: the wave's items visit q in the order rq,
  // rq - 1, .., 0, m - 1, .., rq + 1, where rq is the last whose offset is <= q.
  __device__ __forceinline__ int turn(int q) const {
    const int rq = min(m - 1, static_cast<int>((static_cast<i64>(q + 1) * m + span - 1) / span) - 1);
    const int d = rq - r;
    return first + (d < 0 ? d + m : d);
  }
};

// The turns under a right bound. Items base .. base + n - 1 share a (batch, KV head); position
// pos = item - base holds key block n - 1 - pos / 2 (pos even) or pos / 2 (pos odd:
// decode_paired_work). A round of the walk is G items (paired: 2 G, its even items at the round's
// first step, its odd ones at the second). A query tile's additions: those of earlier rounds, then
// this round's at its first step, then those at its second, each from the last key block down,
// except at the second step with grouped heads and no left bound nearer than half the keys
// (`rising`): from the first key block up. Why (the order in which items reach a tile; a timing
// model of the walk is in tests/test_dispatch.py): the items of a round's first step start
// together, and block j reaches query tile t of the group's head h after about h L_j + t - 2 j
// steps (L_j: its tiles), the last block first. At the second step, block k's item starts when
// its SM's first item ends, which under a causal mask has 2 g (k + 1) steps (g: the group), so it
// reaches that tile after about 2 g + h T + t + 2 k (g - 1 - h): the first block first, or all at
// once for the last head. Turns from the last block down made the items wait there (the model:
// 1.1-1.35x the time of the walk without turns at g = 4, 1.00-1.01x rising). With one head per
// group every order is the same to within 1%; a narrow window's lists are about equally long,
// so its second step arrives as its first, the last block first (rising cost up to 1.15x there).
struct FusedBoundedOrder {
  int n, lo, hi;     // the head's positions [lo, hi) in this item's round
  int parity;        // paired: the parity of this item's position; else -1
  int first_parity;  // paired: the parity of the positions at the round's first step
  bool rising;       // this item's additions at its step go from the first key block up
  static __device__ __forceinline__ FusedBoundedOrder of(i64 item, int n, bool paired,
                                                         bool second_rising) {
    const i64 round_items = paired ? 2 * static_cast<i64>(gridDim.x) : gridDim.x;
    const i64 base = item - item % n, round0 = item / round_items * round_items;
    FusedBoundedOrder o;
    o.n = n;
    o.lo = static_cast<int>(max(round0 - base, i64(0)));
    o.hi = static_cast<int>(min(round0 + round_items - base, static_cast<i64>(n)));
    o.parity = paired ? static_cast<int>((item - base) & 1) : -1;
    o.first_parity = static_cast<int>(base & 1);  // global item parity 0 is the first step
    o.rising = second_rising && paired && o.parity != o.first_parity;
    return o;
  }
  static __device__ __forceinline__ int overlap(int a0, int a1, int b0, int b1) {
    return max(0, min(a1, b1) - max(a0, b0));
  }
  // Positions in [a, b) of parity `par` (-1: either) whose key block lies in [jlo, jhi].
  __device__ __forceinline__ int blocks_in(int a, int b, int par, int jlo, int jhi) const {
    int count = 0;
    if (par != 1) count += overlap((a + 1) >> 1, (b + 1) >> 1, n - 1 - jhi, n - jlo);
    if (par != 0) count += overlap(a >> 1, b >> 1, jlo, jhi + 1);
    return count;
  }
  // Additions before this item's (key block `block`) to a query tile that key blocks [jlo, jhi]
  // reach.
  __device__ __forceinline__ int turn(int block, int jlo, int jhi) const {
    int t = blocks_in(0, lo, -1, jlo, jhi);
    if (parity >= 0 && parity != first_parity) t += blocks_in(lo, hi, first_parity, jlo, jhi);
    if (rising) return t + blocks_in(lo, hi, parity, jlo, min(jhi, block - 1));
    return t + blocks_in(lo, hi, parity, max(jlo, block + 1), jhi);
  }
};

// The turns under a causal mask at d = 64 (128-row query tiles, no score modifier; "arrival"
// order). The walk as FusedBoundedOrder's, but the items of a round's second step visit their
// lists from the end, and a query tile's additions come, after those of earlier rounds, in the
// order in which this round's items are expected to reach the tile: an item's visit s at its
// start + s (in query steps), the start being 0 at the round's first step and the SM's first
// item's steps + 1 at the second, ties broken by position. Each item's visits come at increasing
// times, so this is one order of all visits: no wait can be part of a cycle, whatever the timing.
// Why: with ascending lists every list ends at the last tile and every SM's pair costs about the
// same, so all of a round's second-step items reached each tile at once and their additions queued
// (and at the first step a key block is one 128-row tile behind the next: a step of slack); the
// consumers waited for the staging tile. Measured on the H200 (bf16, causal, 32 heads): 1.08-1.09x
// at 4k-16k. With 64-row tiles (d = 128) the same change ran 0.96x, and there the blocks are two
// steps apart: those instances keep FusedBoundedOrder (docs/perf/NOTES.md, v38).
struct FusedArrivalOrder : FusedBoundedOrder {  // its round's positions, parities (rising off)
  int pos;  // this item's position
  static __device__ __forceinline__ FusedArrivalOrder of(i64 item, int n, bool paired) {
    FusedArrivalOrder o;
    static_cast<FusedBoundedOrder&>(o) = FusedBoundedOrder::of(item, n, paired, false);
    o.pos = static_cast<int>(item % n);
    return o;
  }
  __host__ __device__ __forceinline__ static int block_at(int pos, int n) {
    return (pos & 1) ? pos >> 1 : n - 1 - (pos >> 1);
  }
  // A second-step item (paired walk): visits its list from the end.
  __device__ __forceinline__ bool second(int at) const {
    return parity >= 0 && (at & 1) != first_parity;
  }
  // When the item at position `at` (this round) is expected to visit tile q of head h (of the
  // group; `group` heads a list), in query steps from the round's start.
  template <typename Mask, int BM, int BN>
  __device__ __forceinline__ int arrival(int at, int h, int q, int group, const Mask& mask) const {
    const TileRange t = mask.query_tiles(block_at(at, n) * BN, BN, BM);
    const int len = t.count(), s = h * len + (q - t.begin);
    if (!second(at)) return s;
    // the SM's first item: position at - 1, or the previous head's last one
    const int first = block_at(at > 0 ? at - 1 : n - 1, n);
    const int first_len = mask.query_tiles(first * BN, BN, BM).count();
    return group * first_len + 1 + (group * len - 1 - s);
  }
  // Additions before this item's to query tile q of head h (of the group) that key blocks
  // [jlo, jhi] reach: every lane of a warp calls it, and each gets the count.
  template <typename Mask, int BM, int BN>
  __device__ __forceinline__ int turn(int h, int q, int jlo, int jhi, int group,
                                      const Mask& mask, int lane) const {
    const int mine = arrival<Mask, BM, BN>(pos, h, q, group, mask);
    int before = 0;
#pragma unroll 1
    for (int at = lo + lane; at < hi; at += 32) {
      const int j = block_at(at, n);
      if (at == pos || j < jlo || j > jhi) continue;
      const int when = arrival<Mask, BM, BN>(at, h, q, group, mask);
      before += when < mine || (when == mine && at < pos);
    }
    return blocks_in(0, lo, -1, jlo, jhi) + __reduce_add_sync(0xffffffffu, before);
  }
};

// An item's query steps (query head of the group, query tile of BM rows) and the tiles' turns, for
// key blocks of BN keys. LOCAL: the mask has a left bound too (a window). ARRIVAL: the turns of
// FusedArrivalOrder, counted by the whole of warp 2 (its loop over the round's items spilled in
// the writer's 40 registers) and handed to the writer through FusedTurnSlots (as the rotated
// order's with POLL_AHEAD, once seen on the counter).
template <bool BOUNDED, bool LOCAL, int BM, int BN, bool ARRIVAL>
struct FusedSteps;

template <int BM, int BN>
struct FusedSteps<false, false, BM, BN, false> {  // every query tile of every head, rotated (FusedDqOrder)
  FusedDqOrder order;
  int tiles_q;
  template <typename Mask>
  static __device__ __forceinline__ FusedSteps of(const Params& p, i64 item, int, int tiles_q,
                                                  const Mask&) {
    return FusedSteps{FusedDqOrder::of(item, p.num_blocks, tiles_q, p.group * tiles_q), tiles_q};
  }
  __device__ __forceinline__ int count(int) const { return order.steps; }
  __device__ __forceinline__ QueryStep at(int s) const {
    const int q = order.step_at(s), head = q / tiles_q;
    return QueryStep{head, q - head * tiles_q};
  }
  // No tile straddles a bound. (A partial last key block's padding keys are not masked: their
  // rows of dK and dV are never stored, and their dS^T rows go to shared memory as zeros.)
  __device__ __forceinline__ bool masked(int) const { return false; }
  template <typename Mask>
  __device__ __forceinline__ int turn(int, const QueryStep& at, const Mask&) const {
    return order.turn(at.head * tiles_q + at.tile);
  }
};

template <bool LOCAL, int BM, int BN>
struct FusedSteps<true, LOCAL, BM, BN, false> {  // the tiles of the block's rows, ascending, head by head
  TileRange tiles;
  FusedBoundedOrder order;  // the writer's (dead code elsewhere)
  template <typename Mask>
  static __device__ __forceinline__ FusedSteps of(const Params& p, i64 item, int block, int,
                                                  const Mask& mask) {
    FusedSteps s{mask.query_tiles(block * BN, BN, BM),
                 FusedBoundedOrder::of(item, p.num_blocks, p.paired != 0,
                                       p.group > 1 && mask.left >= mask.nk - mask.left)};
    // the last key block, with padding keys: every tile masked
    if ((block + 1) * BN > mask.nk) s.tiles.full_begin = s.tiles.end;
    return s;
  }
  __device__ __forceinline__ int count(int group) const { return group * tiles.count(); }
  __device__ __forceinline__ QueryStep at(int s) const {
    const int len = tiles.count(), head = s / len;
    return QueryStep{head, tiles.begin + s - head * len};
  }
  // The tile straddles a bound: with no left bound, every tile from full_begin on is whole
  // (mask.cuh, query_tiles: full_end = end), and the second comparison is compiled out.
  __device__ __forceinline__ bool masked(int tile) const {
    return tile < tiles.full_begin || (LOCAL && tile >= tiles.full_end);
  }
  template <typename Mask>
  __device__ __forceinline__ int turn(int block, const QueryStep& at, const Mask& mask) const {
    const TileRange blocks = mask.key_tiles(at.tile * BM, BM, BN);
    return order.turn(block, blocks.begin, blocks.end - 1);
  }
};

template <int BM, int BN>
struct FusedSteps<true, false, BM, BN, true> {  // the tiles of the block's rows, head by head
  TileRange tiles;
  int last;  // the list's last step where the item visits it from the end (the second step), or -1
  FusedArrivalOrder order;  // warp 2's (dead code elsewhere)
  template <typename Mask>
  static __device__ __forceinline__ FusedSteps of(const Params& p, i64 item, int block, int,
                                                  const Mask& mask) {
    FusedSteps s{mask.query_tiles(block * BN, BN, BM), -1,
                 FusedArrivalOrder::of(item, p.num_blocks, p.paired != 0)};
    if (s.order.second(s.order.pos)) s.last = p.group * s.tiles.count() - 1;
    // the last key block, with padding keys: every tile masked
    if ((block + 1) * BN > mask.nk) s.tiles.full_begin = s.tiles.end;
    return s;
  }
  __device__ __forceinline__ int count(int group) const { return group * tiles.count(); }
  __device__ __forceinline__ QueryStep at(int s) const {
    const int len = tiles.count(), v = last < 0 ? s : last - s, head = v / len;
    return QueryStep{head, tiles.begin + v - head * len};
  }
  __device__ __forceinline__ bool masked(int tile) const { return tile < tiles.full_begin; }
  // Every lane of warp 2 calls it.
  template <typename Mask>
  __device__ __forceinline__ int turn(const QueryStep& at, const Mask& mask, int group,
                                      int lane) const {
    const TileRange blocks = mask.key_tiles(at.tile * BM, BM, BN);
    return order.template turn<Mask, BM, BN>(at.head, at.tile, blocks.begin, blocks.end - 1, group,
                                             mask, lane);
  }
};

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// HALF_WRITERS: the half of the columns this writer (warp 1 or 3) adds, read from threadIdx where
// it is used (kept in a register through the writer's loop, it spilled in its 40)
__device__ __forceinline__ int writer_half() { return threadIdx.x >> 6 & 1; }
__device__ __forceinline__ void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// A query tile's counter of additions: the whole word, or with HALVES (HALF_WRITERS) one 16-bit
// field per half of the columns, each counting its own writer's additions.
template <bool HALVES>
__device__ __forceinline__ void wait_for_turn(const int* counter, int half, int turn) {
  if constexpr (HALVES) {
    while (((load_acquire(counter) >> (16 * half)) & 0xffff) != turn) {
    }
  } else {
    while (load_acquire(counter) != turn) {
    }
  }
}
template <bool HALVES>
__device__ __forceinline__ void release_turn(int* counter, int half, int turn) {
  if constexpr (HALVES) red_release_add(counter, 1 << (16 * half));
  else store_release(counter, turn + 1);
}
// The counters' and sums' index of query tile 0 of the first query head of item bc's group: query
// tile t of head h of the group is tile fused_first_tile + h T + t (T: query tiles).
__device__ __forceinline__ i64 fused_first_tile(const Params& p, const BlockCoords& bc,
                                                int tiles_q) {
  return (static_cast<i64>(bc.batch) * p.heads_q + bc.head * p.group) * tiles_q;
}
// Orders this thread's global accesses through the async proxy (TMA) against its ordinary ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// `bytes` from shared to global memory on the TMA unit: copied, or added (float32) to what is there.
__device__ __forceinline__ void bulk_store(float* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_reduce_add(float* dst, const void* src, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}

// Under a bound, after the last item: the dK and dV rows of this warp's keys in every item of the
// block's walk that hold a non-finite value, recomputed (repair.cuh). From the stored rows, so that
// the main loop carries one flag rather than this code's registers (inlined in the loop's
// epilogue, it pushed the consumers into spills); a row that is non-finite for a visible reason is
// recomputed to the same value.
// COLS: the columns from col0 this warp holds (HD = 256: its warpgroup's half of the head dim).
template <typename Elem, int HD, int COLS, int BN, typename Mask, typename Mod>
__device__ __forceinline__ void repair_fused_dkdv(const Params& p, const WorkWalk<false>& walk,
                                                  int key_row0, int col0, int lane) {
  constexpr int CPL = COLS / 32;  // columns per lane
  const float scale = static_cast<float>(p.scale);
#pragma unroll 1
  for (int step = 0; !walk.done(step); ++step) {
    const i64 item = walk.item(step);
    if (item >= walk.num_work) continue;
    const BlockCoords bc = decode_paired_work(item, p.heads_kv, p.num_blocks);
    const Seq<false> seq = Seq<false>::of(p, bc.batch);
    unsigned short* dk_head = seq.template k_head<unsigned short>(p.dk, bc.head);
    unsigned short* dv_head = seq.template k_head<unsigned short>(p.dv, bc.head);
    const int key0 = bc.block * BN + key_row0;
    // row rl's flag at bit (rl / 8) % 2 of lane 4 (rl % 8), as row_flag reads it
    unsigned rows = 0;
#pragma unroll 1
    for (int rl = 0; rl < 16; ++rl) {
      const int j = key0 + rl;
      bool bad = false;
      if (j < p.seq_k) {
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const int col = col0 + lane + 32 * c;
          if (col < p.head_dim) {
            const float a = ElemTraits<Elem>::to_acc(dk_head[j * p.dk.seq + col]);
            const float b = ElemTraits<Elem>::to_acc(dv_head[j * p.dv.seq + col]);
            bad |= !is_finite_f32(a) | !is_finite_f32(b);
          }
        }
      }
      if (__any_sync(0xffffffffu, bad) && lane == 4 * (rl & 7)) rows |= 1u << ((rl >> 3) & 1);
    }
    if (__any_sync(0xffffffffu, rows != 0))
      recompute_dkdv_rows<Elem, HD, COLS, Mod>(
          dk_head + key0 * p.dk.seq, dv_head + key0 * p.dv.seq, p.dk.seq,
          COLS < HD ? min(p.head_dim - col0, COLS) : p.head_dim, rows, scale, scale * 1.4426950408889634f, p, seq, bc.head,
          seq.template k_rows<const unsigned short>(p.k, bc.head),
          seq.template k_rows<const unsigned short>(p.v, bc.head), key0, col0,
          Mask::of(p, seq.ext), lane);
  }
}

// dQ_part (+)= dS K over K16_STEPS steps of 16 keys from k16_first: A = dS^T (a tile of BN key rows
// from ds_rows), B = N columns of K (from k_cols), both read MN-major. No wait.
template <typename Elem, int N, int BN, int K16_STEPS>
__device__ __forceinline__ void issue_dq_part(float (&acc)[N / 8][4], const unsigned char* ds_rows,
                                              const unsigned char* k_cols, int k16_first) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < K16_STEPS; ++kk) {
    const int k16 = k16_first + kk;
    wgmma_ss_tt<Elem, N>(acc, smem_desc(ds_rows + k16 * 2048, BN * 128, 1024),
                         smem_desc(k_cols + k16 * 2048, BN * 128, 1024), kk > 0);
  }
  wgmma_commit();
}

// The turns, from warp 2 to the writer, a few steps ahead (ARRIVAL; POLL_AHEAD: each already seen
// on its counter); in shared memory after FusedBarriers (cuflash/_kernels.py counts them for every
// fused instance).
constexpr int FUSED_TURN_SLOTS = 4;
struct FusedTurnSlots {
  unsigned long long full[FUSED_TURN_SLOTS], empty[FUSED_TURN_SLOTS];
  int turns[FUSED_TURN_SLOTS];
};

// DQ_FULLS: the barriers that say a staged dQ tile is in: one (the staging tile), or one per stage
// (d = 256: dQ staged in the stage's Q and dO buffers).
template <int STAGES, int DQ_FULLS = 1>
struct FusedBarriers {
  unsigned long long kv_full, kv_empty;  // K and V of a work item
  unsigned long long q_full[STAGES], q_empty[STAGES];
  unsigned long long dq_full[DQ_FULLS], dq_empty;  // the staged tiles of dQ partial sums
  unsigned long long dq_first;           // d = 64: the first consumer's part is in its tile
  // bounded masks: some dK or dV row of consumer warp w was non-finite (repair_fused_dkdv); in
  // shared memory rather than a register live through the main loop, where ALiBi's spilled
  int repair[8];
};

// BOUNDED: the mask has a right bound (causal, windows); the host picks the instance.
template <typename Elem, int HD, int BM, int BN, int STAGES, bool BOUNDED, int FEATURES>
__global__ void __launch_bounds__((HD > 128 ? 2 : BN / 64) * 128 + 128, 1)
    attention_backward_fused_tma(const __grid_constant__ BackwardMaps maps,
                                 const __grid_constant__ Params p) {
  typedef Features<FEATURES> F;
  typedef typename F::Mask Mask;
  typedef typename F::template ScoreMod<> Mod;
  // the arrival order where it was measured faster (FusedArrivalOrder): query tiles as tall as
  // the key blocks are wide (d = 64's 128 rows; d = 256's 64, where the timing model of
  // tests/test_dispatch.py gives it 1.00x the walk without turns, the other order 1.02-1.03x)
  constexpr bool ARRIVAL = BOUNDED && BM == BN && !F::LOCAL && !Mod::ANY;
  // POLL_AHEAD: warp 2 waits for each tile's turn on its counter a few tiles ahead of the writer
  // (rotated order, 64-row tiles: d = 128 and 256). There the writer's chain of a tile (the
  // counter's ~0.5 us round trip, the bulk reduction's read, the release) as a single thread was
  // about as long as a step (~2.3 us at 1.8 GHz) and set the pace at full clocks; the turns are
  // seldom waited for, so the poll comes off that chain (+8-15% at d = 128). Under a bound the
  // turns are waited for, and the writer's own poll hands the turn over ~0.25 us sooner than
  // warp 2's through the slots (d = 128 causal 0.98x, d = 64 0.95x with it); 128-row steps leave
  // the writer slack (docs/perf/NOTES.md v42).
  constexpr bool POLL_AHEAD = !BOUNDED && BM == 64;
  // HALF_WRITERS: two writers (warps 1 and 3), one per half of the tile's columns (the
  // consumers' halves: at d = 256 staged in the stage's Q and dO buffers, at d = 128 the staging
  // tile's two halves), each with its own turns, counted in its own 16-bit half of the tile's
  // counter (waited for ahead by lane h of warp 2 with POLL_AHEAD, handed over in its own
  // FusedTurnSlots; under a bound each writer polls its own half). At d = 256 without a bound 64
  // key blocks' items visit a head's 64 query tiles a step apart, so every tile takes an addition
  // each step, and one writer's chain per addition (turn seen, read of both halves, release,
  // hand-off: ~5,900 cycles) was the step (docs/perf/NOTES.md v43); the halves' chains run side
  // by side. Under a bound the turns are waited for, and the chain is the same (d = 256 and 128
  // under a causal mask alone: 1.06x at d = 256, v44). The bounded instances with a window or a
  // score modifier keep one writer (at d = 256, whose writer then computes its turns, two spilled
  // 4 B in the producer's 40 registers); so does d = 128 without a bound, where the poll ahead
  // gave the chain slack (v42).
  constexpr bool PLAIN_BOUND = BOUNDED && !F::LOCAL && !Mod::ANY;
  constexpr bool HALF_WRITERS = (HD > 128 && !BOUNDED) || (HD >= 128 && PLAIN_BOUND);
  // FusedTurnSlots: one set per writer where warp 2 hands the turns over
  constexpr int TURN_SETS = HALF_WRITERS && (ARRIVAL || POLL_AHEAD) ? 2 : 1;
  typedef FusedSteps<BOUNDED, F::LOCAL, BM, BN, ARRIVAL> Steps;
  static_assert(!F::PACKED, "no packing");
  static_assert(BOUNDED || !F::LOCAL, "a window takes the bounded order");
  // SHARED_KEYS (HD = 256, where dK and dV of 64 keys take 2 x 128 registers a thread): the two
  // consumers share the block's 64 keys, each holding dK and dV of its half of the head dim; one
  // computes S^T, the other dP^T, and they exchange P^T and dS^T (Sm90DkdvKeysExchanged, as the
  // split dK/dV kernel); else each holds 64 keys of BN = 128 and every column.
  constexpr bool SHARED_KEYS = HD > 128;
  static_assert(SHARED_KEYS ? BN == 64 && BM == 64 : BN == 128, "consumers of 64 keys");
  constexpr int CONSUMERS = SHARED_KEYS ? 2 : BN / 64;
  // dQ_part = dS K, split between the consumers one of three ways:
  //  - SPLIT_ROWS (BM = 128, HD = 64): each computes its 64 of the tile's queries, every column,
  //    over all BN keys (A = its column block of dS^T);
  //  - by columns (BM = 64, HD = 128 or 256): each computes its half of the columns (64-column
  //    blocks of K) over all BN keys;
  //  - SPLIT_KEYS (BM = 64, HD = 64): a consumer's share of the columns (32) is not a swizzle atom
  //    of K read MN-major, so each computes all HD columns over its own 64 keys, and the second
  //    stages the sum of both parts.
  constexpr bool SPLIT_ROWS = BM == 64 * CONSUMERS;
  constexpr bool SPLIT_KEYS = !SPLIT_ROWS && HD < 64 * CONSUMERS;
  static_assert(SPLIT_ROWS ? HD == 64 : BM == 64 && (HD == 64 || HD == 128 || HD == 256),
                "64-row query tiles at d = 64, 128 and 256, 128-row ones at d = 64");
  // DQ_IN_STAGE (HD = 256): no room for a staging tile of BM x HD float32 (64 KB) beside two
  // stages; each consumer stages its half of dQ_part in the step's Q (first consumer) or dO
  // (second) buffer, once both consumers' products that read them are complete, and the writer
  // releases the stage (q_empty) once its reductions have read them.
  constexpr bool DQ_IN_STAGE = SHARED_KEYS;
  constexpr int DQ_FULLS = DQ_IN_STAGE ? STAGES : 1;
  constexpr int DQ_COLS = SPLIT_ROWS || SPLIT_KEYS ? HD : HD / CONSUMERS, NT_DQ = DQ_COLS / 8;
  static_assert(!HALF_WRITERS || !(SPLIT_ROWS || SPLIT_KEYS), "a writer per consumer's columns");
  constexpr int KEYS_BYTES = BN * HD * 2, ROWS_BYTES = BM * HD * 2;
  constexpr int DS_BYTES = BN * BM * 2, DQ_BYTES = BM * HD * 4;
  constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  static_assert(4 * CONSUMERS <= 8, "a repair flag per consumer warp");
  // Registers: the producer warpgroup's two working warps need more than the 24 of
  // WarpSpecialisedRegisters (it spilled 152 B there); the consumers fit in 232. SHARED_KEYS with
  // the arrival order: warp 2's turns spilled 16 B in 40, and those consumers (no modifier) fit
  // in 224 (the modifiers' spilled 8-92 B there); d = 128's half writers, each computing its
  // turns, spilled 4 B in 40, and those consumers fit in 224.
  constexpr bool WIDE_PRODUCER = SHARED_KEYS ? ARRIVAL : HALF_WRITERS;
  constexpr int PRODUCER_REGISTERS = WIDE_PRODUCER ? 56 : 40;
  constexpr int CONSUMER_REGISTERS = WIDE_PRODUCER ? 224 : 232;
  // setmaxnreg moves only the registers the block was launched with (65536 / threads, rounded
  // down to 8 a thread): a consumers' increase beyond what the producers gave back waits forever
  constexpr int LAUNCH_REGISTERS = 65536 / (128 + CONSUMER_THREADS) / 8 * 8;
  static_assert(PRODUCER_REGISTERS * 128 + CONSUMER_REGISTERS * CONSUMER_THREADS <=
                    LAUNCH_REGISTERS * (128 + CONSUMER_THREADS),
                "registers");
  // 128-row tiles with ALiBi: the rows' terms after the scores' wait (Sm90DkdvKeys::probabilities;
  // the other instances were measured without it)
  // (SHARED_KEYS: Sm90DkdvKeysExchanged, its dS^T tiles the kernel's own)
  typedef DkdvKeysOf<SHARED_KEYS, Elem, HD, BM, BN, Mask, Mod, SPLIT_ROWS && Mod::HAS_ALIBI> KeysOf;
  typedef typename KeysOf::Type Keys;
  static_assert(!SHARED_KEYS || !Mod::HAS_SOFTCAP, "no room for P^T's exchange tile");
  constexpr int EXCHANGE_BYTES = KeysOf::EXCHANGE_BYTES;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sK = smem;                       // one tile
  unsigned char* sV = sK + KEYS_BYTES;            // one tile
  unsigned char* sQ = sV + KEYS_BYTES;            // STAGES tiles
  unsigned char* sdO = sQ + STAGES * ROWS_BYTES;  // STAGES tiles
  unsigned char* sdS = sdO + STAGES * ROWS_BYTES; // dS^T, two tiles: BN key rows of BM queries
  unsigned char* sX = sdS + 2 * DS_BYTES;  // SHARED_KEYS: the consumers' exchange area
  // staging tile, fragment order (none with DQ_IN_STAGE)
  float* sdQ = reinterpret_cast<float*>(sX + EXCHANGE_BYTES);
  float* sdQ_first = sdQ + (DQ_IN_STAGE ? 0 : BM * HD);  // SPLIT_KEYS: the first consumer's part
  float* s_lse2 = sdQ_first + (SPLIT_KEYS ? BM * HD : 0);  // STAGES x BM
  float* s_delta = s_lse2 + STAGES * BM;                   // STAGES x BM
  typedef FusedBarriers<STAGES, DQ_FULLS> Barriers;
  Barriers& bar = *reinterpret_cast<Barriers*>(s_delta + STAGES * BM);
  FusedTurnSlots* turn_sets = reinterpret_cast<FusedTurnSlots*>(&bar + 1);  // TURN_SETS
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // the host pairs heavy items with light ones under a right bound (p.paired)
  const WorkWalk<false> walk{p.num_work, BOUNDED && p.paired != 0};
  const int tiles_q = ceil_div(p.seq_q, BM);

  if (threadIdx.x == 0) {
    mbar_init(&bar.kv_full, 1);
    mbar_init(&bar.kv_empty, 4 * CONSUMERS);
    // q_full: the copies' bytes and each producer lane's lse2, D; q_empty: every consumer thread
    // (and, DQ_IN_STAGE, the writer)
    mbar_init_pairs(bar.q_full, bar.q_empty, 1 + 32,
                    CONSUMER_THREADS + (DQ_IN_STAGE ? (HALF_WRITERS ? 2 : 1) : 0));
    for (int i = 0; i < DQ_FULLS; ++i)
      mbar_init(&bar.dq_full[i], SPLIT_KEYS ? 4 : 4 * CONSUMERS);  // lane 0 of every staging warp
    mbar_init(&bar.dq_empty, HALF_WRITERS && !DQ_IN_STAGE ? 2 : 1);  // the writer(s)
    mbar_init(&bar.dq_first, 128);           // every thread of the first consumer
    if constexpr (SHARED_KEYS) Keys::init(sX);
    for (int w = 0; w < 8; ++w) bar.repair[w] = 0;
    // lane 0 of warp 2, the writer
    if (ARRIVAL || POLL_AHEAD) mbar_init_pairs(turn_sets[0].full, turn_sets[0].empty, 1, 1);
    if (TURN_SETS > 1) mbar_init_pairs(turn_sets[1].full, turn_sets[1].empty, 1, 1);
    fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {  // producer warpgroup: warp 0 loads, warp 1 writes dQ, the others leave
    warpgroup_release_registers<PRODUCER_REGISTERS>();
    if (warp == 0) {
      int pipe = 0;  // query steps so far; the items so far are `step` (as the consumers')
      for (int step = 0; !walk.done(step); ++step) {
        const i64 item = walk.item(step);
        if (item >= walk.num_work) continue;
        const WorkItem<false> work = work_item<false>(p, item, p.heads_kv);
        const BlockCoords bc = work.c;
        const Steps steps = Steps::of(p, item, bc.block, tiles_q, Mask::of(p, work.seq.ext));
        mbar_wait(&bar.kv_empty, (step & 1) ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(&bar.kv_full, 2 * KEYS_BYTES);
          tma_load_tile<BN, HD>(sK, &maps.k, &bar.kv_full, bc.block * BN, bc.head, bc.batch);
          tma_load_tile<BN, HD>(sV, &maps.v, &bar.kv_full, bc.block * BN, bc.head, bc.batch);
        }
        const int count = steps.count(p.group);
        for (int s = 0; s < count; ++s, ++pipe) {
          const int stage = pipe % STAGES;
          const QueryStep at = steps.at(s);
          const int head = bc.head * p.group + at.head, m0 = at.tile * BM;
          mbar_wait(&bar.q_empty[stage], ((pipe / STAGES) & 1) ^ 1);
          if (lane == 0) {
            mbar_arrive_expect_tx(&bar.q_full[stage], 2 * ROWS_BYTES);
            tma_load_tile<BM, HD>(sQ + stage * ROWS_BYTES, &maps.q, &bar.q_full[stage], m0, head,
                                  bc.batch);
            tma_load_tile<BM, HD>(sdO + stage * ROWS_BYTES, &maps.dout, &bar.q_full[stage], m0,
                                  head, bc.batch);
          }
          stage_lse_and_delta<BM>(s_lse2 + stage * BM, s_delta + stage * BM, p, work.seq, head, m0,
                                  lane);
          mbar_arrive(&bar.q_full[stage]);
        }
      }
    } else if ((warp == 1 || (HALF_WRITERS && warp == 3)) && lane == 0) {  // the writer(s)
      int staged = 0;
      for (int step = 0; !walk.done(step); ++step) {
        const i64 item = walk.item(step);
        if (item >= walk.num_work) continue;
        const BlockCoords bc = decode_paired_work(item, p.heads_kv, p.num_blocks);
        const Mask mask = Mask::of(p, Seq<false>::of(p, bc.batch).ext);
        const Steps steps = Steps::of(p, item, bc.block, tiles_q, mask);
        const i64 first_tile = fused_first_tile(p, bc, tiles_q);
        const int count = steps.count(p.group);
        for (int s = 0; s < count; ++s, ++staged) {
          const QueryStep at = steps.at(s);
          const i64 tile = first_tile + at.head * tiles_q + at.tile;
          // The turn: from warp 2 (POLL_AHEAD: already seen on the counter; warp 2's acquire, then
          // the slot's mbarrier, order this thread's reduction after the earlier additions), or
          // computed here
          int turn;
          if constexpr (ARRIVAL || POLL_AHEAD) {
            FusedTurnSlots& slots = turn_sets[TURN_SETS > 1 ? writer_half() : 0];
            const int slot = staged % FUSED_TURN_SLOTS;
            mbar_wait(&slots.full[slot], (staged / FUSED_TURN_SLOTS) & 1);
            turn = *static_cast<volatile int*>(&slots.turns[slot]);
            mbar_arrive(&slots.empty[slot]);
          } else {
            turn = steps.turn(bc.block, at, mask);
          }
          if constexpr (!POLL_AHEAD)  // the turn first, while the consumers compute the step
            wait_for_turn<HALF_WRITERS>(p.dq_semaphores + tile, writer_half(), turn);
          const int stage = staged % STAGES;
          if constexpr (DQ_IN_STAGE) mbar_wait(&bar.dq_full[stage], (staged / STAGES) & 1);
          else mbar_wait(&bar.dq_full[0], staged & 1);
          fence_proxy_async_global();  // the earlier turns' additions before this one
          float* sums = p.dq_accum + tile * (BM * HD);
          if constexpr (HALF_WRITERS) {  // this writer's half: in the stage's Q or dO buffer
            const int half = writer_half();  // (d = 256), or of the staging tile (d = 128)
            float* dst = sums + half * (BM * HD / 2);
            const unsigned char* src =
                DQ_IN_STAGE ? sQ + (half * STAGES + stage) * ROWS_BYTES  // sdO: half 1
                            : reinterpret_cast<const unsigned char*>(sdQ) + half * (DQ_BYTES / 2);
            if (turn == 0) bulk_store(dst, src, DQ_BYTES / 2);
            else bulk_reduce_add(dst, src, DQ_BYTES / 2);
          } else if constexpr (DQ_IN_STAGE) {  // the consumers' halves: in the stage's Q and dO
            float* second = sums + BM * HD / 2;
            if (turn == 0) {
              bulk_store(sums, sQ + stage * ROWS_BYTES, DQ_BYTES / 2);
              bulk_store(second, sdO + stage * ROWS_BYTES, DQ_BYTES / 2);
            } else {
              bulk_reduce_add(sums, sQ + stage * ROWS_BYTES, DQ_BYTES / 2);
              bulk_reduce_add(second, sdO + stage * ROWS_BYTES, DQ_BYTES / 2);
            }
          } else {
            if (turn == 0) bulk_store(sums, sdQ, DQ_BYTES);
            else bulk_reduce_add(sums, sdQ, DQ_BYTES);
          }
          bulk_commit();
          bulk_wait_read<0>();  // the staged tile is read: the consumers (or the producer) may fill it
          if constexpr (DQ_IN_STAGE) mbar_arrive(&bar.q_empty[stage]);
          else mbar_arrive(&bar.dq_empty);
          bulk_wait<0>();  // written
          fence_proxy_async_global();
          release_turn<HALF_WRITERS>(p.dq_semaphores + tile, writer_half(), turn);
        }
      }
    } else if (warp == 2 && (ARRIVAL || POLL_AHEAD)) {
      // The turns, ahead of the writer, handed over in FusedTurnSlots: under the arrival order
      // counted by the whole warp; with POLL_AHEAD waited for on their counters here. No wait
      // cycle: the turns are posted in the writer's order, and the writer releases each tile's
      // counter without waiting for warp 2.
      int staged = 0;
      for (int step = 0; !walk.done(step); ++step) {
        const i64 item = walk.item(step);
        if (item >= walk.num_work) continue;
        const BlockCoords bc = decode_paired_work(item, p.heads_kv, p.num_blocks);
        const Mask mask = Mask::of(p, Seq<false>::of(p, bc.batch).ext);
        const Steps steps = Steps::of(p, item, bc.block, tiles_q, mask);
        const i64 first_tile = fused_first_tile(p, bc, tiles_q);
        const int count = steps.count(p.group);
        for (int s = 0; s < count; ++s, ++staged) {
          const QueryStep at = steps.at(s);
          int turn;
          if constexpr (ARRIVAL) turn = steps.turn(at, mask, p.group, lane);
          else turn = steps.turn(bc.block, at, mask);
          if (TURN_SETS > 1 ? lane < TURN_SETS : lane == 0) {  // HALF_WRITERS: lane h, half h's
            if constexpr (POLL_AHEAD) {
              const int* counter = p.dq_semaphores + first_tile + at.head * tiles_q + at.tile;
              wait_for_turn<HALF_WRITERS>(counter, lane, turn);
            }
            FusedTurnSlots& slots = turn_sets[TURN_SETS > 1 ? lane : 0];
            const int slot = staged % FUSED_TURN_SLOTS;
            mbar_wait(&slots.empty[slot], ((staged / FUSED_TURN_SLOTS) & 1) ^ 1);
            *static_cast<volatile int*>(&slots.turns[slot]) = turn;
            mbar_arrive(&slots.full[slot]);
          }
          __syncwarp();
        }
      }
    }
    return;
  }

  warpgroup_claim_registers<CONSUMER_REGISTERS>();
  const int wg = (warp - 4) >> 2, tid = threadIdx.x - 128 - wg * 128;  // within the warpgroup
  const int key_row0 = Keys::key_row0(warp - 4);  // this warp's keys within the block
  const int d = p.head_dim;
  Keys keys;
  keys.wg = wg;
  keys.lane = lane;
  keys.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  keys.sK = sK;
  keys.sV = sV;
  if constexpr (SHARED_KEYS) keys.sX = sX;
  // pipe: the query steps so far (the stages' and the staging tile's phases); the items so far are
  // `step` (items past the list come only at the walk's end)
  int pipe = 0;
  for (int step = 0; !walk.done(step); ++step) {
    const i64 item = walk.item(step);
    if (item >= walk.num_work) continue;
    const WorkItem<false> work = work_item<false>(p, item, p.heads_kv);
    const int n0 = work.c.block * BN;
    // masked tiles: those that straddle a bound, and under a bound every tile of a partial last
    // key block, whose padding keys' dS would reach dQ (without one, see the dS^T stores below)
    const Steps steps = Steps::of(p, item, work.c.block, tiles_q, Mask::of(p, work.seq.ext));
    keys.key0 = n0 + key_row0 + (lane >> 2);
    keys.clear();
    mbar_wait(&bar.kv_full, step & 1);
    const int count = steps.count(p.group);
    for (int s = 0; s < count; ++s, ++pipe) {
      const int stage = pipe % STAGES;
      const QueryStep at = steps.at(s);
      mbar_wait(&bar.q_full[stage], (pipe / STAGES) & 1);
      if constexpr (Mod::ANY) {
        keys.mod = Mod::of(p, work.c.batch, work.c.head * p.group + at.head,
                           static_cast<float>(p.scale), work.seq.ext);
      }
      const unsigned char* q_tile = sQ + stage * ROWS_BYTES;
      const unsigned char* do_tile = sdO + stage * ROWS_BYTES;
      typename Keys::Frags f;
      unsigned char* ds_tile;  // this step's dS^T tile (two in turn)
      if constexpr (SHARED_KEYS) {
        // S^T in the first consumer, dP^T in the second, P^T and dS^T exchanged
        // (Sm90DkdvKeysExchanged); the second stores all of dS^T (the tiles in turn, as below:
        // it writes one after the exchange of the next step but one, which the first consumer
        // reaches after its products of this one).
        float x[Keys::NT_Q][4];
        ds_tile = sdS + (pipe & 1) * DS_BYTES;
        keys.tiles = pipe;
        keys.issue_scores(x, q_tile, do_tile);
        wgmma_wait<0>();
        fence_accumulators(x);
        // Without a bound, the padding keys of a partial last block: their dS^T rows zeroed (as
        // below)
        const int pad0 = !BOUNDED && n0 + BN > p.seq_k ? max(0, p.seq_k - n0 - key_row0) : 16;
        if (steps.masked(at.tile))
          keys.template exchange<true>(true, at.tile * BM, x, s_lse2 + stage * BM,
                                       s_delta + stage * BM, Mask::of(p, work.seq.ext), f,
                                       ds_tile, pad0);
        else
          keys.template exchange<true>(false, at.tile * BM, x, s_lse2 + stage * BM,
                                       s_delta + stage * BM, Mask::of(p, work.seq.ext), f,
                                       ds_tile, pad0);
      } else {
        keys.issue_scores(q_tile, do_tile);
        wgmma_wait<0>();
        // two copies: the unmasked tiles' (nearly all) without the mask's code
        if (steps.masked(at.tile))
          keys.probabilities(true, at.tile * BM, s_lse2 + stage * BM, s_delta + stage * BM, f,
                             Mask::of(p, work.seq.ext));
        else
          keys.probabilities(false, at.tile * BM, s_lse2 + stage * BM, s_delta + stage * BM, f,
                             Mask::of(p, work.seq.ext));
        // dS^T of this warp's 16 keys into rows 64 wg + 16 w .. of one of two tiles, in turn: the
        // last products that read this one (two tiles back) were waited for before the other
        // consumer passed the barrier below on the previous tile.
        ds_tile = sdS + (pipe & 1) * DS_BYTES;
        {
          // 16-byte chunk c of a row (queries 8 c ..) lies in column block c / 8 of BN rows
          const int mi = lane >> 3, row = key_row0 + (mi & 1) * 8 + (lane & 7);
#pragma unroll
          for (int kk = 0; kk < BM / 16; ++kk) {
            const int chunk = 2 * kk + (mi >> 1);
            unsigned char* block = ds_tile + (chunk >> 3) * (BN * 128);
            stmatrix_x4(block + row * 128 + (((chunk & 7) ^ (row & 7)) << 4), f.dst[kk][0],
                        f.dst[kk][1], f.dst[kk][2], f.dst[kk][3]);
          }
        }
        // Without a bound, the padding keys of a partial last block are not masked: their dS^T
        // rows are overwritten with zeros, so that no P overflowed to inf meets K's zero rows in
        // dQ (inf x 0). Out of the main path: the other items' stores stay as they are.
        if (!BOUNDED && n0 + BN > p.seq_k) {
          __syncwarp();  // the warp's stmatrix before the zeros
          const int pad0 = max(0, p.seq_k - n0 - key_row0);  // this warp's first padding row
          constexpr int CHUNKS = BM / 8;                      // 16-byte chunks of a row
#pragma unroll
          for (int i = lane; i < 16 * CHUNKS; i += 32) {
            const int r = i / CHUNKS, c = i % CHUNKS;  // a whole row: the swizzle does not matter
            if (r >= pad0)
              *reinterpret_cast<uint4*>(ds_tile + (c >> 3) * (BN * 128) + (key_row0 + r) * 128 +
                                        (c & 7) * 16) = make_uint4(0, 0, 0, 0);
          }
        }
        fence_proxy_async();
        named_barrier_sync(1, CONSUMER_THREADS);  // both consumers' keys are in
      }
      // dQ_part = dS K: A = dS^T, B = K, both read MN-major (issue_dq_part). SPLIT_ROWS: queries
      // 64 wg .. (column block wg of dS^T), all columns, all keys; SPLIT_KEYS: all columns, keys
      // 64 wg ..; else head-dim columns DQ_COLS wg .. (column blocks of K), all keys.
      const unsigned char* ds_rows = ds_tile + (SPLIT_ROWS ? wg * (BN * 128) : 0);
      if constexpr (DQ_IN_STAGE) {
        // In two 64-column halves (column blocks 2 wg and 2 wg + 1 of K): the first issued with
        // dV and dK, the second once those are complete, so that P^T's and dS^T's fragments are
        // dead before its accumulator lives (a 128-column accumulator beside them made ptxas
        // serialise every wgmma: C7512). Then consumer wg's half at nt * 128 + tid of the step's
        // Q (wg 0) or dO (wg 1) buffer, once both consumers' products that read those (the other's
        // dV and dK read its columns of them) are complete; the writer releases the stage.
        constexpr int NT_HALF = NT_DQ / 2;
        float acc_a[NT_HALF][4], acc_b[NT_HALF][4];
        keys.issue_grads(f, q_tile, do_tile);  // dV += P^T dO_i, dK += dS^T Q_i
        issue_dq_part<Elem, 64, BN, BN / 16>(acc_a, ds_rows, sK + (2 * wg) * (BN * 128), 0);
        wgmma_wait<0>();
        fence_accumulators(keys.acc_dv);
        fence_accumulators(keys.acc_dk);
        fence_accumulators(acc_a);
        f.keep();
        issue_dq_part<Elem, 64, BN, BN / 16>(acc_b, ds_rows, sK + (2 * wg + 1) * (BN * 128), 0);
        mbar_arrive(&bar.q_empty[stage]);  // every thread: its loads of lse2 and D are done
        named_barrier_sync(2, CONSUMER_THREADS);
        float4* half = reinterpret_cast<float4*>(wg == 0 ? sQ + stage * ROWS_BYTES
                                                         : sdO + stage * ROWS_BYTES);
#pragma unroll
        for (int nt = 0; nt < NT_HALF; ++nt)
          half[nt * 128 + tid] = make_float4(acc_a[nt][0], acc_a[nt][1], acc_a[nt][2], acc_a[nt][3]);
        wgmma_wait<0>();
        fence_accumulators(acc_b);
#pragma unroll
        for (int nt = 0; nt < NT_HALF; ++nt)
          half[(NT_HALF + nt) * 128 + tid] =
              make_float4(acc_b[nt][0], acc_b[nt][1], acc_b[nt][2], acc_b[nt][3]);
        fence_proxy_async_shared();
        __syncwarp();
        if (lane == 0) mbar_arrive(&bar.dq_full[stage]);
      } else {
        // dQ_part first, then dV and dK: the staging below runs under those two products.
        float acc_dq[NT_DQ][4];
        issue_dq_part<Elem, DQ_COLS, BN, SPLIT_KEYS ? 4 : BN / 16>(
            acc_dq, ds_rows, sK + (SPLIT_ROWS || SPLIT_KEYS ? 0 : wg * (BN * 128)),
            SPLIT_KEYS ? 4 * wg : 0);
        keys.issue_grads(f, q_tile, do_tile);  // dV += P^T dO_i, dK += dS^T Q_i
        wgmma_wait<1>();                       // dQ_part's group
        fence_accumulators(acc_dq);
        // The staging tile, once the writer has read the previous one: float4 (wg, nt) of thread
        // tid at index (wg * NT_DQ + nt) * 128 + tid (conflict-free; attention_backward_dq_from_accum
        // reads this order; SPLIT_ROWS: wg is the consumer's half of the rows, else its columns).
        // SPLIT_KEYS: the first consumer stores its part at nt * 128 + tid of its
        // own tile (the second read the last one before the barrier above), and the second stages
        // the sum (the same fragment layout: thread tid's elements), so that each tile has one writer.
        // Every thread arrives and waits on an mbarrier (rather than a named barrier's arrive, or one
        // lane's arrive after __syncwarp): the pattern racecheck follows.
        const float4* first = reinterpret_cast<const float4*>(sdQ_first);
        if (SPLIT_KEYS && wg == 0) {
#pragma unroll
          for (int nt = 0; nt < NT_DQ; ++nt)
            reinterpret_cast<float4*>(sdQ_first)[nt * 128 + tid] =
                make_float4(acc_dq[nt][0], acc_dq[nt][1], acc_dq[nt][2], acc_dq[nt][3]);
          mbar_arrive(&bar.dq_first);
        } else {
          mbar_wait(&bar.dq_empty, (pipe & 1) ^ 1);
          if (SPLIT_KEYS) mbar_wait(&bar.dq_first, pipe & 1);
#pragma unroll
          for (int nt = 0; nt < NT_DQ; ++nt) {
            float4 v = make_float4(acc_dq[nt][0], acc_dq[nt][1], acc_dq[nt][2], acc_dq[nt][3]);
            if (SPLIT_KEYS) {
              const float4 a = first[nt * 128 + tid];
              v = make_float4(a.x + v.x, a.y + v.y, a.z + v.z, a.w + v.w);
            }
            reinterpret_cast<float4*>(sdQ)[((SPLIT_KEYS ? 0 : wg) * NT_DQ + nt) * 128 + tid] = v;
          }
          fence_proxy_async_shared();
          __syncwarp();
          if (lane == 0) mbar_arrive(&bar.dq_full[0]);
        }
        dkdv_complete(keys.acc_dv, keys.acc_dk, f);
        mbar_arrive(&bar.q_empty[stage]);  // every thread: its loads of lse2 and D are done
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&bar.kv_empty);

    // Epilogue: dK = scale * acc_dk and dV (this warpgroup's columns), from registers; under a
    // bound, rows that are non-finite now (a masked tile may have made them so: 0 x NaN) are
    // flagged for the repair.
    const float scale = static_cast<float>(p.scale);
    const BlockCoords bc = decode_paired_work(item, p.heads_kv, p.num_blocks);
    const Seq<false> seq = Seq<false>::of(p, bc.batch);
    const int col0 = keys.col0(), cols = d - col0;  // cols <= 0: nothing of d in this half
    unsigned short* dk_head = seq.template k_head<unsigned short>(p.dk, bc.head) + col0;
    unsigned short* dv_head = seq.template k_head<unsigned short>(p.dv, bc.head) + col0;
    const int key0 = n0 + key_row0;
    if constexpr (BOUNDED)
      if (__any_sync(0xffffffffu, nonfinite_rows(keys.acc_dk, keys.acc_dv) != 0) && lane == 0)
        bar.repair[warp - 4] = 1;
    store_accumulator_rows<Elem, Keys::NT_D>(dk_head, p.dk.seq, key0, p.seq_k, cols, keys.acc_dk,
                                             scale, lane);
    store_accumulator_rows<Elem, Keys::NT_D>(dv_head, p.dv.seq, key0, p.seq_k, cols, keys.acc_dv,
                                             1.f, lane);
  }
  __syncwarp();
  if (BOUNDED && bar.repair[warp - 4]) {  // rare: a NaN or Inf (this warp's keys and columns)
    repair_fused_dkdv<Elem, HD, Keys::COLS, BN, Mask, Mod>(p, walk, key_row0, keys.col0(), lane);
  }
}

// dQ = scale * sums: a block of 2 BM threads (a warp per 16 rows) per (batch, query head, query
// tile of BM rows; key blocks of BN keys). Thread tid + 128 h reads the float4s that consumer
// thread tid of each warpgroup staged for rows 64 h .. of the tile (with 64-row tiles, h = 0 and
// the warpgroups staged column blocks): together the 16-row accumulator of its warp's rows in the
// mma layout (mma.cuh), stored as the dQ kernels store theirs. A tile that no key block reaches
// (rows that see no key) has no sums: dQ = 0 there. Where the tile meets a masked key block,
// rows that are non-finite are recomputed (repair.cuh).
template <typename Elem, int HD, int BM, int BN, int FEATURES>
__global__ void __launch_bounds__(2 * BM)
    attention_backward_dq_from_accum(const __grid_constant__ Params p) {
  typedef Features<FEATURES> F;
  typedef typename F::Mask Mask;
  typedef typename F::template ScoreMod<> Mod;
  // staged float4 (h, nt) of thread tid, at (h * NT_D + nt) * 128 + tid, is column tile nt of its
  // rows
  constexpr int NT_D = HD / 8;
  const int tiles_q = ceil_div(p.seq_q, BM), lane = threadIdx.x & 31;
  const i64 index = blockIdx.x;
  const int tile = static_cast<int>(index % tiles_q);
  const i64 bh = index / tiles_q;
  const int batch = static_cast<int>(bh / p.heads_q), head = static_cast<int>(bh % p.heads_q);
  const Seq<false> seq = Seq<false>::of(p, batch);
  const Mask mask = Mask::of(p, seq.ext);
  const TileRange blocks = mask.key_tiles(tile * BM, BM, BN);
  const float4* sums = reinterpret_cast<const float4*>(p.dq_accum + index * (BM * HD)) +
                       (threadIdx.x >> 7) * (NT_D * 128) + (threadIdx.x & 127);
  float acc[1][NT_D][4];
#pragma unroll
  for (int nt = 0; nt < NT_D; ++nt) {
    const float4 v = blocks.count() > 0 ? sums[nt * 128] : make_float4(0.f, 0.f, 0.f, 0.f);
    acc[0][nt][0] = v.x, acc[0][nt][1] = v.y, acc[0][nt][2] = v.z, acc[0][nt][3] = v.w;
  }
  const float scale = static_cast<float>(p.scale);
  const int row0 = tile * BM + (threadIdx.x >> 5) * 16;
  unsigned short* dq_head = seq.template q_head<unsigned short>(p.dq, head);
  store_accumulator_rows<Elem, NT_D>(dq_head, p.dq.seq, row0, p.seq_q, p.head_dim, acc[0], scale,
                                     lane);
  if (blocks.masked() == 0) return;  // no masked tile: every non-finite value is the inputs'
  const unsigned repair = nonfinite_rows(acc);
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf
    __syncwarp();
    const int kv_head = head / p.group;
    recompute_dq_rows<Elem, HD, 1>(
        dq_head + row0 * p.dq.seq, p.dq.seq, p.head_dim, repair, scale,
        scale * 1.4426950408889634f, seq.template q_rows<const unsigned short>(p.q, head),
        seq.template q_rows<const unsigned short>(p.dout, head),
        seq.template k_rows<const unsigned short>(p.k, kv_head),
        seq.template k_rows<const unsigned short>(p.v, kv_head),
        seq.template q_rows<const float>(p.lse, head), seq.template q_rows<const float>(p.delta, head),
        row0, mask, Mod::of(p, batch, head, scale, seq.ext), p.head_dim, lane);
  }
}

}  // namespace cuflash
