// mask.cuh: which keys a query row may see, and which tiles need the mask at all.
//
// Causal masking is aligned to the bottom-right corner (FlashAttention >= 2.1): query i sees key j
// when j <= i + nk - nq. Keys j >= nk are padding and are never seen. Tiles that lie entirely in
// the visible region are processed by the unmasked loop body; only the tiles that straddle the
// diagonal or the end of the keys run the masked body; tiles entirely invisible are skipped.
#pragma once
#include "common.cuh"

namespace cuflash {

__device__ __forceinline__ bool key_visible(int i, int j, int nq, int nk, bool causal) {
  return j < nk && (!causal || j <= i + (nk - nq));
}

// The last key query i sees (key_visible(i, j) == j <= last_visible_key(i)); negative if none.
__device__ __forceinline__ int last_visible_key(int i, int nq, int nk, bool causal) {
  return causal ? min(nk - 1, i + (nk - nq)) : nk - 1;
}

// Key tiles for the query rows [m0, m0 + bm): tiles [0, full) need no mask, tiles [full, count)
// need it, tiles >= count are invisible to every (real) row of the block.
struct KeyTiles {
  int full, count;
};

__device__ __forceinline__ KeyTiles key_tiles_for_queries(int m0, int bm, int bn, int nq, int nk,
                                                          bool causal) {
  const int last_row = min(m0 + bm, nq) - 1;
  // Exclusive end of the keys seen by the last real row, and of the keys seen by every row.
  const int seen_by_last = causal ? min(nk, last_row + (nk - nq) + 1) : nk;
  const int seen_by_all = causal ? min(nk, m0 + (nk - nq) + 1) : nk;
  KeyTiles t;
  t.count = seen_by_last > 0 ? ceil_div(seen_by_last, bn) : 0;
  t.full = min(t.count, seen_by_all > 0 ? seen_by_all / bn : 0);
  return t;
}

// The kernels visit the masked key tiles [full, count) first, so that the accumulators, checked
// right after them, hold their contribution alone (repair.cuh), then the unmasked tiles [0, full)
// in ascending order. (Visiting every tile from the last down, as v5 did, cost the causal Hopper
// forward about 10% at N = 4096: bench/NOTES.md, v6.)
// Visit `it` of [0, count) -> key tile index, or -1 past the end.
__device__ __forceinline__ int key_tile_at(int it, const KeyTiles& t) {
  const int masked = t.count - t.full;
  if (it >= t.count) return -1;
  return it < masked ? t.full + it : it - masked;
}

// Query tiles for the keys [n0, n0 + bn): tiles [first, unmasked_from) need the causal mask,
// tiles [unmasked_from, count) do not. Padded query rows (>= nq) are neutralised through their
// lse (+inf, so P = 0) and their zero dO, not through the mask.
struct QueryTiles {
  int first, unmasked_from, count;
};

__device__ __forceinline__ QueryTiles query_tiles_for_keys(int n0, int bn, int bm, int nq, int nk,
                                                           bool causal) {
  QueryTiles t;
  t.count = ceil_div(nq, bm);
  if (!causal) {
    t.first = 0;
    t.unmasked_from = 0;
    return t;
  }
  // First query that sees key n0, and first query that sees the block's last key n0 + bn - 1.
  const int first_seeing = max(0, n0 - (nk - nq));
  const int first_seeing_all = max(0, n0 + bn - 1 - (nk - nq));
  t.first = min(t.count, first_seeing / bm);
  t.unmasked_from = min(t.count, max(t.first, ceil_div(first_seeing_all, bm)));
  return t;
}

// The dK/dV kernels' work list: (query head of the group, query tile), with the masked tiles of
// every head first (see key_tile_at). Steps [0, masked_steps) are masked.
struct QueryStep {
  int head, tile;
};

__device__ __forceinline__ int masked_query_steps(const QueryTiles& t, int group) {
  return group * (t.unmasked_from - t.first);
}

__device__ __forceinline__ QueryStep query_step_at(int step, const QueryTiles& t, int group) {
  const int masked = t.unmasked_from - t.first, unmasked = t.count - t.unmasked_from;
  QueryStep s;
  if (step < group * masked) {
    s.head = step / masked;
    s.tile = t.first + (step - s.head * masked);
  } else {
    const int u = step - group * masked;
    s.head = u / unmasked;
    s.tile = t.unmasked_from + (u - s.head * unmasked);
  }
  return s;
}

}  // namespace cuflash
