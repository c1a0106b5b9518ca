// params.cuh: the one argument of every kernel, passed by value.
//
// The host fills its mirror (cuflash/_params.py, Params) in one place per plan. Every compiled
// source ends with static_asserts that the host writes from that mirror (its size and each field's
// offset), so a layout that drifts between the two fails to compile; tests/test_params.py runs the
// same check with nvcc on machines without a GPU.
#pragma once
#include "common.cuh"

namespace cuflash {

// One (batch, head, sequence[, dim]) tensor: its address and element strides; the dim stride is 1.
struct TensorRef {
  void* ptr;
  i64 batch, head, seq;
};

struct Params {
  // Forward: reads q, k, v; writes o and lse. Backward: the preprocess reads o and dout and writes
  // delta (D = rowsum(dO * O)); dK/dV and dQ read q, k, v, dout, lse and delta and write dk, dv, dq.
  TensorRef q, k, v, o, dout, dq, dk, dv;
  TensorRef lse, delta;  // one value per (batch, head, row): the seq stride steps the rows
  TensorRef alibi;       // ALiBi: float32 slopes, one per (batch, query head); seq stride unused
  // KV cache (kvcache.cu): k and v are the caches, (batch or page, row or slot, head); k_new and
  // v_new the rows appended to them; o_accum and lse_accum the split-KV partial results (float32),
  // split s of sequence b at batch index s * batch + b.
  TensorRef k_new, v_new, o_accum, lse_accum;
  // Per-sequence extents, for the features built on this core; null selects none.
  const int* cu_seqlens_q;  // packed sequences: row offsets of each sequence (batch + 1)
  const int* cu_seqlens_k;
  const int* seqused_k;     // KV cache: rows in use per sequence before the append, or null
  const int* block_table;   // paged KV cache: (batch, max pages) page indices; null: contiguous
  // Packed calls on the persistent (TMA) kernels: the work list that build_work_list
  // (work_list.cu) writes before each launch, from entry list_base (two int4 each): a header
  // {items, ...}, then an entry per item (work_item).
  int4* work_list;
  // The fused backward (backward_sm90_fused.cu): float32 dQ partial sums, a dq_tile_rows x HD tile
  // per (batch, query head, query tile) in the consumers' fragment order, and one counter per such
  // tile that orders the additions (the preprocess zeroes them); null elsewhere.
  float* dq_accum;
  int* dq_semaphores;
  double scale;             // S = scale * q . k
  double softcap;           // softcap c: S = c tanh(S / c) (the SOFTCAP feature, score_mod.cuh)
  int batch, heads_q, heads_kv, group;  // group = heads_q / heads_kv
  int seq_q, seq_k, head_dim;
  // The mask (mask.cuh): query i sees key j iff i + seq_k - seq_q - window_left <= j <=
  // i + seq_k - seq_q + window_right; an unbounded side holds seq_q + seq_k.
  int window_left, window_right;
  float p_shift;      // forward: P is scaled by 2^-p_shift (softmax.cuh)
  int vec;            // 16-byte copies: pointers, strides and d allow them (tile.cuh)
  int num_blocks;     // row blocks per head: query rows (keys for dK/dV) over the block's rows
  int row_shift;      // TMA forward: rows of the first block that lie before row 0 (causal; packed:
                      // each sequence's own, forward_sm90_tma.cu)
  int paired;         // persistent kernels: blocks take pairs of work items (common.cuh, WorkWalk)
  int walk_heads;     // dense persistent forward and dQ: 0, or decode_chunked_work's chunk
  int split_last;     // TMA forward, three consumers, serial loop: every head's last row block
                      // (its rows fit one warpgroup) split by keys, walked first
                      // (forward_sm90_tma.cu)
  int lanes_per_row;  // preprocess: lanes that reduce one row
  int dq_tile_rows;   // preprocess, where dq_semaphores is set: the fused backward's tile rows
  int total_q, total_k;  // packed sequences (PACKED): the rows of the packed tensors
  // KV cache: rows per page (paged), pages in the cache, rows in use of every sequence when
  // seqused_k is null, rows appended (k_new), splits of the keys and keys per split (a multiple
  // of the key tile). seq_k is the capacity: the most rows one sequence's cache can hold.
  int page_size, num_pages, cache_len, seq_new, num_splits, keys_per_split;
  // build_work_list (work_list.cuh, WorkListShape): the list's rows per block and the rows of the
  // tiles an item streams (its cost), its heads, and LIST_KEYS / LIST_END_ALIGNED.
  int list_rows, list_cost_rows, list_heads, list_flags;
  i64 num_work;       // persistent kernels: work items (row blocks of every head)
  i64 rows;           // preprocess: batch * heads_q * seq_q
  i64 block_table_stride;  // paged KV cache: elements between two sequences' rows of the table
  i64 list_base;      // packed persistent kernels: the first entry (the header) of their work list
  // The FP8 forward (e4m3 q, k, v; forward_sm90_tma.cu): float32 descale factors, one per (batch,
  // key/value head) with those strides: S = scale (q . k) dq dk, O = dv P V / l. Null stands for 1.
  TensorRef descale_q, descale_k, descale_v;
};

// Row 0 of head `head` of sequence `batch` of a tensor, as T: 64-bit offsets throughout.
template <typename T>
__device__ __forceinline__ T* head_ptr(const TensorRef& t, int batch, int head) {
  return static_cast<T*>(t.ptr) + static_cast<i64>(batch) * t.batch + static_cast<i64>(head) * t.head;
}

// Entry (batch, head) of a descale tensor of the FP8 forward, 1 where the call gave none.
__device__ __forceinline__ float descale_of(const TensorRef& t, int batch, int head) {
  return t.ptr ? *head_ptr<const float>(t, batch, head) : 1.f;
}

// One head's rows of a tensor: row i starts at head + i * stride.
template <typename T>
struct HeadRows {
  T* head;
  i64 stride;
  __device__ __forceinline__ T* row(int i) const { return head + static_cast<i64>(i) * stride; }
};

// A head's rows of a tensor of 16-bit elements (q, k, v, dO of the tensor-core kernels).
typedef HeadRows<const unsigned short> Rows;

template <typename T>
__device__ __forceinline__ HeadRows<T> head_rows(const TensorRef& t, int batch, int head) {
  return HeadRows<T>{head_ptr<T>(t, batch, head), t.seq};
}

// The extents of one sequence: its query rows and keys. Dense calls (PACKED false) read them from
// the kernel's parameters where used (the constant bank: no registers); packed calls hold their
// sequence's in two registers.
template <bool PACKED>
struct Extents {
  int packed_nq, packed_nk;
  __device__ __forceinline__ int nq(const Params& p) const { return PACKED ? packed_nq : p.seq_q; }
  __device__ __forceinline__ int nk(const Params& p) const { return PACKED ? packed_nk : p.seq_k; }
};

// The rows of sequence `batch` of a call. Dense calls: sequence `batch` of the tensors' batch
// dimension. Packed calls (the PACKED feature): rows cu_seqlens_q[batch] .. cu_seqlens_q[batch + 1]
// of the packed query tensors (q, o, dout, dq, lse, delta) and cu_seqlens_k[batch] .. of the packed
// key tensors (k, v, dk, dv), whose batch stride is unused. The offsets are clamped to the tensors'
// rows (total_q, total_k) and a sequence to seq_q / seq_k rows (the longest the grid covers), so
// that malformed offsets never reach outside the tensors.
template <bool PACKED>
struct Seq {
  int batch;
  Extents<PACKED> ext;
  i64 q0, k0;  // packed: the sequence's first row in the packed tensors

  static __device__ __forceinline__ Seq of(const Params& p, int batch) {
    Seq s;
    s.batch = batch;
    s.ext.packed_nq = s.ext.packed_nk = 0;
    s.q0 = s.k0 = 0;
    if constexpr (PACKED) {
      s.q0 = span(p.cu_seqlens_q, batch, p.total_q, p.seq_q, s.ext.packed_nq);
      s.k0 = span(p.cu_seqlens_k, batch, p.total_k, p.seq_k, s.ext.packed_nk);
    }
    return s;
  }
  // First row of sequence b of offsets `cu`, and its rows in n (both clamped as above).
  static __host__ __device__ __forceinline__ int span(const int* cu, int b, int total, int longest,
                                                      int& n) {
    const int first = min(max(cu[b], 0), total);
    const int last = min(max(cu[b + 1], first), total);
    n = min(last - first, longest);
    return first;
  }
  __device__ __forceinline__ int nq(const Params& p) const { return ext.nq(p); }
  __device__ __forceinline__ int nk(const Params& p) const { return ext.nk(p); }
  // Row 0 of head `head` of this sequence in a tensor with query rows / with key rows.
  template <typename T>
  __device__ __forceinline__ T* q_head(const TensorRef& t, int head) const {
    if constexpr (PACKED) return head_ptr<T>(t, 0, head) + q0 * t.seq;
    else return head_ptr<T>(t, batch, head);
  }
  template <typename T>
  __device__ __forceinline__ T* k_head(const TensorRef& t, int head) const {
    if constexpr (PACKED) return head_ptr<T>(t, 0, head) + k0 * t.seq;
    else return head_ptr<T>(t, batch, head);
  }
  template <typename T>
  __device__ __forceinline__ HeadRows<T> q_rows(const TensorRef& t, int head) const {
    return HeadRows<T>{q_head<T>(t, head), t.seq};
  }
  template <typename T>
  __device__ __forceinline__ HeadRows<T> k_rows(const TensorRef& t, int head) const {
    return HeadRows<T>{k_head<T>(t, head), t.seq};
  }
  // TMA coordinates (tma.cuh) of this sequence's query row m / key row n and of its batch, in a
  // map over the whole tensor (packed: (d, total rows, heads, 1); rows past the sequence are the
  // next sequence's, which the mask hides, and rows past the tensor read as zeros).
  __device__ __forceinline__ int q_coord(int m) const { return static_cast<int>(q0) + m; }
  __device__ __forceinline__ int k_coord(int n) const { return static_cast<int>(k0) + n; }
  __device__ __forceinline__ int map_batch() const { return PACKED ? 0 : batch; }
};

// Work item -> (row block, head, sequence) of the persistent kernels (the TMA forward, dQ and
// dK/dV; `heads`: the heads of the list, query heads or key/value heads), with the sequence's
// rows (Seq). Dense calls: decode_paired_work's list
// of whole heads (consecutive items share a head's keys in L2), or decode_chunked_work's order
// where the host chose it. Packed calls: entry `item` of the
// list that build_work_list wrote for this launch (work_list.cuh): only the blocks that hold rows
// of their sequence, each head's blocks together, the sequences with the most key tiles first
// (paired: heavy with light). An entry is two int4, (sequence, head, block, 0) and the sequence's
// (first query row, query rows, first key, keys) as Seq::of clamps them, so that an item costs
// one round trip to memory (two dependent ones when the rows came from cu_seqlens).
template <bool PACKED>
struct WorkItem {
  BlockCoords c;
  Seq<PACKED> seq;
};

__host__ __device__ __forceinline__ const int4* work_entry(const Params& p, i64 item) {
  return p.work_list + 2 * (p.list_base + 1 + item);  // the header is entry 0
}

// CHUNKABLE: the kernel walks decode_chunked_work's order where the host sets p.walk_heads (the
// TMA forward's and dQ kernel's windowed instances; the others keep v30's code, whose d = 128
// forward read 2% slower with the decode compiled in: docs/perf/NOTES.md, v31). LAST_FIRST:
// decode_last_first_work's where the host sets p.split_last (the TMA forward's SPLIT_LAST
// instances).
template <bool PACKED, bool CHUNKABLE = false, bool LAST_FIRST = false>
__device__ __forceinline__ WorkItem<PACKED> work_item(const Params& p, i64 item, int heads) {
  WorkItem<PACKED> w;
  if constexpr (!PACKED) {
    if (CHUNKABLE && p.walk_heads > 0)
      w.c = decode_chunked_work(item, heads, p.batch, p.num_blocks, p.walk_heads);
    else if (LAST_FIRST && p.split_last)
      w.c = decode_last_first_work(item, heads, p.batch, p.num_blocks);
    else
      w.c = decode_paired_work(item, heads, p.num_blocks);
    w.seq = Seq<false>::of(p, w.c.batch);
  } else {
    // field by field: a caller's unused fields are then never loaded (whole int4 loads cost
    // the packed dK/dV's epilogue the registers it spilled 12 bytes for)
    const int4* entry = work_entry(p, item);
    w.c = BlockCoords{entry[0].x, entry[0].y, entry[0].z};
    w.seq.batch = entry[0].x;
    w.seq.q0 = entry[1].x;
    w.seq.ext.packed_nq = entry[1].y;
    w.seq.k0 = entry[1].z;
    w.seq.ext.packed_nk = entry[1].w;
  }
  return w;
}

// The items of a persistent kernel's list: the launch's count (dense), or the count that
// build_work_list wrote in the packed list's header.
template <bool PACKED>
__device__ __forceinline__ i64 work_count(const Params& p) {
  if constexpr (PACKED) return p.work_list[2 * p.list_base].x;
  else return p.num_work;
}

}  // namespace cuflash
