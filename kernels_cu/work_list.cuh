// work_list.cuh: the work list of a packed call on the persistent (TMA) kernels, one item per
// block of rows that a sequence has, built on the device from cu_seqlens before the kernel runs
// (work_list.cu) and read by work_item (params.cuh).
//
// Why a list built per call: a list of every (sequence, head, slot) up to the longest sequence's
// blocks is mostly empty on a long-tailed batch (46 sequences of 64..8192 rows: 47,104 slots for
// 8,560 blocks at d = 128), and a fixed stride over items of unequal cost loads the SMs unevenly:
// simulated, the busiest block had 1.04-1.13x the mean work, against 1.01-1.03x for dense 4k
// batches. Here the list holds only real blocks, ordered by their sequence's cost (key tiles for
// the forward and dQ, query tiles for dK/dV) from the most to the least, each head's blocks
// together (they share K and V in L2), and the kernels walk it in a snake (common.cuh,
// WorkWalk): 1.005-1.035x (docs/perf/NOTES.md, v19). Only the per-sequence arithmetic lives
// here, __host__ __device__, so that tests/test_work_list.py runs it on the host.
#pragma once
#include "params.cuh"

namespace cuflash {

// Params::list_flags
constexpr int LIST_KEYS = 1;         // the list's blocks are of keys (dK/dV), else of query rows
constexpr int LIST_END_ALIGNED = 2;  // blocks end at the sequence's last row (the TMA forward
                                     // under causal masking: forward_sm90_tma.cu, slot_row0)
// Sequences are ordered by their cost in tiles, up to this many (longer ones share the last).
constexpr int LIST_COST_BUCKETS = 1024;

// What one sequence contributes to the list of a launch: `items` per head (its blocks; paired,
// an even count, the first of an odd one empty), its cost bucket, and its rows as Seq::of clamps
// them (first query row, query rows, first key, keys), which each of its entries carries.
struct SequenceItems {
  int items, bucket;
  int q0, nq, k0, nk;

  static __host__ __device__ __forceinline__ SequenceItems of(const Params& p, int b) {
    SequenceItems s;
    s.q0 = Seq<true>::span(p.cu_seqlens_q, b, p.total_q, p.seq_q, s.nq);
    s.k0 = Seq<true>::span(p.cu_seqlens_k, b, p.total_k, p.seq_k, s.nk);
    const bool keys = (p.list_flags & LIST_KEYS) != 0;
    const int rows = keys ? s.nk : s.nq, streamed = keys ? s.nq : s.nk;
    s.items = ceil_div(rows, p.list_rows);
    if (p.paired) s.items += s.items & 1;
    s.bucket = min(ceil_div(streamed, p.list_cost_rows), LIST_COST_BUCKETS - 1);
    return s;
  }

  // The block of item i of a head (0 <= i < items). Unpaired: i, from the sequence's first row.
  // Paired: items 2 u, 2 u + 1 are the heavy and light blocks of pair u, within the sequence's own
  // blocks, counted from its first row, or (LIST_END_ALIGNED) from its end at slot num_blocks.
  __host__ __device__ __forceinline__ int block(const Params& p, int i) const {
    if (!p.paired) return i;
    const int u = i >> 1;
    const int first = (p.list_flags & LIST_END_ALIGNED) ? p.num_blocks - items : 0;
    return first + ((i & 1) ? u : items - 1 - u);
  }
};

}  // namespace cuflash
