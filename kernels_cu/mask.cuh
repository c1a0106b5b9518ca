// mask.cuh: who sees whom. The one visibility rule of every kernel family, the NaN repair and the
// tile schedule; cuflash/_mask.py mirrors it for the host's scheduling and the blockwise reference.
//
// Query i sees key j iff 0 <= j < nk and diag(i) - left <= j <= diag(i) + right, where
// diag(i) = i + nk - nq: a band around the bottom-right diagonal (FlashAttention >= 2.1). Dense
// attention has both sides unbounded, causal attention right = 0, a sliding window both bounded.
// The host stores an unbounded side as nq + nk, past which no row reaches, so there is no special
// case in the arithmetic (it needs nq + 2 nk < 2^31, which validation guarantees).
//
// The right bound is a run-time value in every instance: dense and causal attention share one, and
// their bound costs only on the tiles that straddle it. The left bound is compiled in (LOCAL,
// features.cuh), so that the instances without it carry no code for it.
//
// Tiles: a query tile visits a range of key tiles [begin, end), of which [full_begin, full_end) lie
// wholly inside every row's band and need no mask; a key tile visits a range of query tiles, with
// the same shape. The kernels visit the masked tiles first (repair.cuh reads the accumulators right
// after them), then the unmasked ones in ascending order. (Visiting every tile from the last down,
// as v5 did, cost the causal Hopper forward about 10% at N = 4096: docs/perf/NOTES.md, v6.)
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace cuflash {

struct TileRange {
  int begin, full_begin, full_end, end;

  __host__ __device__ __forceinline__ int count() const { return end - begin; }
  __host__ __device__ __forceinline__ int masked() const { return count() - (full_end - full_begin); }
  // Visit `it` of [0, count) -> tile index, -1 past the end: the masked tiles after the full ones,
  // then the tiles from begin up (those before the full ones, then the full ones). It runs once per
  // tile in the kernels' main loops: one select (a version with a branch per range cost the TMA
  // forward 8% at d = 64: docs/perf/NOTES.md, v10).
  __host__ __device__ __forceinline__ int at(int it) const {
    if (it >= count()) return -1;
    const int after = end - full_end;
    return it < after ? full_end + it : begin + (it - after);
  }
};

// A closed interval [first, last] of rows; empty when last < first.
struct Bounds {
  int first, last;
};

template <bool LOCAL>
struct Mask {
  int nq, nk, left, right;

  static __device__ __forceinline__ Mask of(const Params& p) {
    return Mask{p.seq_q, p.seq_k, p.window_left, p.window_right};
  }
  // The mask of one sequence (params.cuh, Extents): a packed sequence's own rows and keys.
  template <bool PACKED>
  static __device__ __forceinline__ Mask of(const Params& p, const Extents<PACKED>& e) {
    return Mask{e.nq(p), e.nk(p), p.window_left, p.window_right};
  }

  __host__ __device__ __forceinline__ int diag(int i) const { return i + nk - nq; }
  // The keys query i sees.
  __host__ __device__ __forceinline__ Bounds keys_of(int i) const {
    return Bounds{LOCAL ? max(0, diag(i) - left) : 0, min(nk - 1, diag(i) + right)};
  }
  // The queries that see key j (none for a padding key j >= nk).
  __host__ __device__ __forceinline__ Bounds queries_of(int j) const {
    if (j >= nk) return Bounds{nq, nq - 1};
    return Bounds{max(0, j - right - (nk - nq)), LOCAL ? min(nq - 1, j + left - (nk - nq)) : nq - 1};
  }
  // Key j against the bounds of a query row (keys_of), and query i against those of a key
  // (queries_of): the comparisons that only LOCAL instances need are compiled out elsewhere.
  static __host__ __device__ __forceinline__ bool key_hidden(int j, const Bounds& row) {
    return j > row.last || (LOCAL && j < row.first);
  }
  static __host__ __device__ __forceinline__ bool query_hidden(int i, const Bounds& key) {
    return i < key.first || (LOCAL && i > key.last);
  }
  __host__ __device__ __forceinline__ bool visible(int i, int j) const { return !key_hidden(j, keys_of(i)); }

  // Key tiles of bn keys for the query rows [m0, m0 + bm) (rows outside [0, nq) are padding and
  // see nothing that matters).
  __host__ __device__ __forceinline__ TileRange key_tiles(int m0, int bm, int bn) const {
    const int r0 = max(m0, 0), r1 = min(m0 + bm, nq) - 1;
    const Bounds some = Bounds{keys_of(r0).first, keys_of(r1).last};  // keys some row sees
    if (r1 < r0 || some.last < some.first) return TileRange{0, 0, 0, 0};
    const Bounds every = Bounds{keys_of(r1).first, keys_of(r0).last};  // keys every row sees
    return tiles_between(some, every, bn, false);
  }

  // Query tiles of bm rows for the keys [n0, n0 + bn). Padding query rows (>= nq) that read as
  // zeros (ZERO_PADDING) need no mask: their lse (+inf) and dO (0) neutralise them; nor do padding
  // keys (>= nk), whose rows of dK and dV are never stored. The packed TMA dK/dV kernel reads the
  // next sequence's rows there, whose NaN or Inf a P of 0 would spread (0 x NaN): with
  // ZERO_PADDING false the tile that holds them is a masked one, which the repair checks.
  template <bool ZERO_PADDING = true>
  __host__ __device__ __forceinline__ TileRange query_tiles(int n0, int bn, int bm) const {
    const int k1 = min(n0 + bn, nk) - 1;
    const Bounds some = Bounds{queries_of(n0).first, queries_of(k1).last};
    if (k1 < n0 || some.last < some.first) return TileRange{0, 0, 0, 0};
    const Bounds every = Bounds{queries_of(k1).first, queries_of(n0).last};
    return tiles_between(some, every, bm, ZERO_PADDING && every.last >= nq - 1);
  }

 private:
  // The tiles of `size` rows that hold rows of `some`, and among them those wholly inside `every`
  // (`to_end`: every row from every.first on, padding included, needs no mask).
  static __host__ __device__ __forceinline__ TileRange tiles_between(const Bounds& some, const Bounds& every,
                                                             int size, bool to_end) {
    TileRange t;
    t.begin = some.first / size;
    t.end = some.last / size + 1;
    const int full_begin = ceil_div(every.first, size);
    const int full_end = to_end ? t.end : (every.last >= 0 ? (every.last + 1) / size : 0);
    t.full_begin = min(max(full_begin, t.begin), t.end);
    t.full_end = min(max(full_end, t.full_begin), t.end);
    return t;
  }
};

// The dK/dV kernels' work list: (query head of the group, query tile), with the masked tiles of
// every head first (TileRange::at). Steps [0, masked_steps) are masked.
struct QueryStep {
  int head, tile;
};

__host__ __device__ __forceinline__ int masked_query_steps(const TileRange& t, int group) {
  return group * t.masked();
}

// Each branch indexes its own range directly: through TileRange::at the TMA dK/dV kernel at d = 128
// took 13% longer (ncu, H100: 2.23 against 1.97 ms; docs/perf/NOTES.md, v10).
__host__ __device__ __forceinline__ QueryStep query_step_at(int step, const TileRange& t, int group) {
  const int masked = t.masked(), unmasked = t.count() - masked;
  QueryStep s;
  if (step < group * masked) {
    s.head = step / masked;
    const int i = step - s.head * masked, after = t.end - t.full_end;
    s.tile = i < after ? t.full_end + i : t.begin + (i - after);  // at(i)
  } else {
    const int u = step - group * masked;
    s.head = u / unmasked;
    s.tile = t.full_begin + (u - s.head * unmasked);  // at(masked + i)
  }
  return s;
}

}  // namespace cuflash
