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
  // Per-sequence extents, for the features built on this core; null selects none.
  const int* cu_seqlens_q;  // packed sequences: row offsets of each sequence (batch + 1)
  const int* cu_seqlens_k;
  const int* seqused_k;     // keys in use per sequence (a KV cache)
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
  int row_shift;      // TMA forward: rows of the first block that lie before row 0 (causal)
  int paired;         // persistent kernels: blocks take pairs of work items (common.cuh, WorkWalk)
  int lanes_per_row;  // preprocess: lanes that reduce one row
  i64 num_work;       // persistent kernels: work items (row blocks of every head)
  i64 rows;           // preprocess: batch * heads_q * seq_q
};

// Row 0 of head `head` of sequence `batch` of a tensor, as T: 64-bit offsets throughout.
template <typename T>
__device__ __forceinline__ T* head_ptr(const TensorRef& t, int batch, int head) {
  return static_cast<T*>(t.ptr) + static_cast<i64>(batch) * t.batch + static_cast<i64>(head) * t.head;
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

}  // namespace cuflash
