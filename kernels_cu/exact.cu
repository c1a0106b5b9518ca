// exact.cu: the exact path for float32 and float64 inputs, on the CUDA cores (no TF32).
//
// All arithmetic is in float64, also for float32 inputs (stored and staged as float32): results
// are the float64 values rounded once, and long sums over keys or queries do not accumulate
// float32 rounding error.
//
// The same algorithm as the tensor-core kernels (online softmax forward; backward as dK/dV over
// query tiles and dQ over key tiles, P recomputed from lse, no atomics), written for clarity:
// TPR consecutive threads share one row of the tile; thread c of a row owns the keys (or queries)
// c, c + TPR, ... of each score tile and the head-dim columns c, c + TPR, ... of its accumulator.
// A row's probabilities are passed between its TPR threads with width-TPR shuffles. Shared tiles
// have an odd pitch (HD + 1) so that the rows of a warp fall in different banks. Every tile is
// masked with the same predicate as the fast kernels: this path is for verification, not speed.
#include "common.cuh"
#include "tile.cuh"
#include "mask.cuh"

namespace cuflash {

template <int TPR, typename T>
__device__ __forceinline__ T group_max(T x) {
#pragma unroll
  for (int off = TPR / 2; off > 0; off >>= 1) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, off, TPR));
  return x;
}

template <int TPR, typename T>
__device__ __forceinline__ T group_sum(T x) {
#pragma unroll
  for (int off = TPR / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off, TPR);
  return x;
}

typedef double Acc;  // the exact path's arithmetic type

// Dot product of two shared rows of the head dimension (padding columns hold zeros).
template <int HD, typename T>
__device__ __forceinline__ Acc row_dot(const T* a, const T* b) {
  Acc s = 0.0;
#pragma unroll 8
  for (int x = 0; x < HD; ++x) s = fma(Acc(a[x]), Acc(b[x]), s);
  return s;
}

// acc[i] += sum_r w_r * tile[r][c + TPR * i] over the rows r the mask lets this row see, where
// w_r and bit r / TPR of `visible` are held by thread r % TPR of this row's group: the "P V"-shaped
// product of the exact path. Invisible pairs are skipped, not multiplied by 0, so a NaN or Inf in a
// tile row reaches only the rows that see it (0 * NaN would be NaN). Both loops are unrolled so
// that w is indexed by constants only (a run-time index would move it to local memory).
template <int ROWS, int HD, int TPR, int PITCH, typename T>
__device__ __forceinline__ void accumulate_rows(Acc (&acc)[HD / TPR], const Acc (&w)[ROWS / TPR],
                                                unsigned visible, const T* tile, int c) {
  static_assert(ROWS / TPR <= 32, "one visibility bit per weight");
#pragma unroll
  for (int owner = 0; owner < TPR; ++owner) {
    const unsigned owner_visible = __shfl_sync(0xffffffffu, visible, owner, TPR);
#pragma unroll
    for (int jj = 0; jj < ROWS / TPR; ++jj) {
      const Acc wr = __shfl_sync(0xffffffffu, w[jj], owner, TPR);
      if (!((owner_visible >> jj) & 1)) continue;
      const T* tile_row = tile + (owner + TPR * jj) * PITCH + c;
#pragma unroll
      for (int i = 0; i < HD / TPR; ++i) acc[i] = fma(wr, Acc(tile_row[TPR * i]), acc[i]);
    }
  }
}

template <typename T, int HD, int BM, int BN, int TPR>
__global__ void __launch_bounds__(BM * TPR, 1) attention_forward_exact(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
    T* __restrict__ lse, i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb, i64 k_sh, i64 k_ss, i64 v_sb,
    i64 v_sh, i64 v_ss, i64 o_sb, i64 o_sh, i64 o_ss, int hq, int group, int nq, int nk, int d,
    double scale, int causal, int vec, int num_m_blocks) {
  constexpr int PITCH = HD + 1, NTHREADS = BM * TPR, DPT = HD / TPR, KPT = BN / TPR;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * PITCH;
  T* sV = sK + BN * PITCH;

  const BlockCoords bc = decode_block(hq, num_m_blocks);
  const int kv_head = bc.head / group;
  const int r = threadIdx.x / TPR, c = threadIdx.x % TPR;
  const int m0 = bc.block * BM, row = m0 + r;
  const T* k_head = head_ptr(k, make_strides(k_sb, k_sh, k_ss), bc.batch, kv_head);
  const T* v_head = head_ptr(v, make_strides(v_sb, v_sh, v_ss), bc.batch, kv_head);
  load_tile<BM, HD, PITCH, NTHREADS>(sQ, head_ptr(q, make_strides(q_sb, q_sh, q_ss), bc.batch, bc.head),
                                     q_ss, m0, nq, d, false);

  const KeyTiles tiles = key_tiles_for_queries(m0, BM, BN, nq, nk, causal != 0);
  Acc m = -inf_f64(), l = 0.0, acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.0;

  for (int j = 0; j < tiles.count; ++j) {
    const int n0 = j * BN;
    __syncthreads();  // the previous K, V tiles are consumed
    load_tile<BN, HD, PITCH, NTHREADS>(sK, k_head, k_ss, n0, nk, d, false);
    load_tile<BN, HD, PITCH, NTHREADS>(sV, v_head, v_ss, n0, nk, d, false);
    __syncthreads();
    Acc s[KPT];
    Acc mx = -inf_f64();
    unsigned visible = 0;
#pragma unroll
    for (int jj = 0; jj < KPT; ++jj) {  // S = scale Q K^T, -inf where invisible
      const int key = c + TPR * jj;
      const bool vis = key_visible(row, n0 + key, nq, nk, causal != 0);
      visible |= unsigned(vis) << jj;
      s[jj] = vis ? scale * row_dot<HD>(sQ + r * PITCH, sK + key * PITCH) : -inf_f64();
      mx = fmax(mx, s[jj]);
    }
    const Acc m_new = fmax(m, group_max<TPR>(mx));
    const Acc m_use = (m_new == -inf_f64()) ? 0.0 : m_new;  // no -inf - -inf
    const Acc alpha = exp(m - m_use);
    Acc sum = 0.0;
#pragma unroll
    for (int jj = 0; jj < KPT; ++jj) {
      s[jj] = exp(s[jj] - m_use);
      sum += s[jj];
    }
    l = l * alpha + sum;
    m = m_new;
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] *= alpha;
    accumulate_rows<BN, HD, TPR, PITCH>(acc, s, visible, sV, c);  // O += P V
  }

  l = group_sum<TPR>(l);
  const bool empty = (l == 0.0);
  const Acc inv = empty ? 0.0 : 1.0 / l;
  if (row < nq) {
    T* o_row = head_ptr(o, make_strides(o_sb, o_sh, o_ss), bc.batch, bc.head) + row * o_ss;
#pragma unroll
    for (int i = 0; i < DPT; ++i)
      if (c + TPR * i < d) o_row[c + TPR * i] = T(acc[i] * inv);
    if (c == 0)
      lse[(static_cast<i64>(bc.batch) * hq + bc.head) * nq + row] =
          T(empty ? -inf_f64() : m + log(l));
  }
}

template <typename T, int HD, int BM, int BN, int TPR>
__global__ void __launch_bounds__(BN * TPR, 1) attention_backward_dkdv_exact(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const T* __restrict__ lse, const Acc* __restrict__ delta,
    T* __restrict__ dk, T* __restrict__ dv, i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb, i64 k_sh,
    i64 k_ss, i64 v_sb, i64 v_sh, i64 v_ss, i64 do_sb, i64 do_sh, i64 do_ss, i64 lse_sb,
    i64 lse_sh, i64 lse_ss, i64 dk_sb, i64 dk_sh, i64 dk_ss, i64 dv_sb, i64 dv_sh, i64 dv_ss,
    int hq, int group, int nq, int nk, int d, double scale, int causal, int vec, int num_n_blocks) {
  constexpr int PITCH = HD + 1, NTHREADS = BN * TPR, DPT = HD / TPR, QPT = BM / TPR;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* sLse = reinterpret_cast<Acc*>(smem_raw);  // first: 8-byte aligned
  Acc* sDelta = sLse + BM;
  T* sK = reinterpret_cast<T*>(sDelta + BM);
  T* sV = sK + BN * PITCH;
  T* sQ = sV + BN * PITCH;
  T* sdO = sQ + BM * PITCH;

  const int hkv = hq / group;
  const BlockCoords bc = decode_block(hkv, num_n_blocks);
  const int r = threadIdx.x / TPR, c = threadIdx.x % TPR;
  const int n0 = bc.block * BN, key = n0 + r;
  load_tile<BN, HD, PITCH, NTHREADS>(sK, head_ptr(k, make_strides(k_sb, k_sh, k_ss), bc.batch, bc.head),
                                     k_ss, n0, nk, d, false);
  load_tile<BN, HD, PITCH, NTHREADS>(sV, head_ptr(v, make_strides(v_sb, v_sh, v_ss), bc.batch, bc.head),
                                     v_ss, n0, nk, d, false);

  Acc acc_dk[DPT], acc_dv[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc_dk[i] = acc_dv[i] = 0.0;

  const QueryTiles tiles = query_tiles_for_keys(n0, BN, BM, nq, nk, causal != 0);
  const int tiles_per_head = tiles.count - tiles.first;
  for (int step = 0; step < group * tiles_per_head; ++step) {
    const int head = bc.head * group + step / tiles_per_head;
    const int m0 = (tiles.first + step % tiles_per_head) * BM;
    __syncthreads();  // the previous query tile is consumed
    load_tile<BM, HD, PITCH, NTHREADS>(sQ, head_ptr(q, make_strides(q_sb, q_sh, q_ss), bc.batch, head),
                                       q_ss, m0, nq, d, false);
    load_tile<BM, HD, PITCH, NTHREADS>(sdO, head_ptr(dout, make_strides(do_sb, do_sh, do_ss), bc.batch, head),
                                       do_ss, m0, nq, d, false);
    const T* lse_head = head_ptr(lse, make_strides(lse_sb, lse_sh, lse_ss), bc.batch, head);
    const Acc* delta_head = delta + (static_cast<i64>(bc.batch) * hq + head) * nq;
    for (int x = threadIdx.x; x < BM; x += NTHREADS) {
      Acc lx = inf_f64(), dx = 0.0;  // padded rows and rows that see no key: P = 0
      if (m0 + x < nq) {
        lx = lse_head[(m0 + x) * lse_ss];
        if (lx == -inf_f64()) lx = inf_f64();
        dx = delta_head[m0 + x];
      }
      sLse[x] = lx;
      sDelta[x] = dx;
    }
    __syncthreads();
    Acc p[QPT], ds[QPT];
    unsigned visible = 0;  // padded query rows count as invisible
#pragma unroll
    for (int jj = 0; jj < QPT; ++jj) {  // P^T and dS^T for this key and queries c + TPR jj
      const int qi = c + TPR * jj;
      const bool vis = m0 + qi < nq && key_visible(m0 + qi, key, nq, nk, causal != 0);
      visible |= unsigned(vis) << jj;
      const Acc pij = vis ? exp(scale * row_dot<HD>(sK + r * PITCH, sQ + qi * PITCH) - sLse[qi]) : 0.0;
      const Acc dpij = row_dot<HD>(sV + r * PITCH, sdO + qi * PITCH);
      p[jj] = pij;
      ds[jj] = pij * (dpij - sDelta[qi]);
    }
    accumulate_rows<BM, HD, TPR, PITCH>(acc_dv, p, visible, sdO, c);  // dV += P^T dO
    accumulate_rows<BM, HD, TPR, PITCH>(acc_dk, ds, visible, sQ, c);  // dK += dS^T Q
  }

  if (key < nk) {
    T* dk_row = head_ptr(dk, make_strides(dk_sb, dk_sh, dk_ss), bc.batch, bc.head) + key * dk_ss;
    T* dv_row = head_ptr(dv, make_strides(dv_sb, dv_sh, dv_ss), bc.batch, bc.head) + key * dv_ss;
#pragma unroll
    for (int i = 0; i < DPT; ++i)
      if (c + TPR * i < d) {
        dk_row[c + TPR * i] = T(acc_dk[i] * scale);
        dv_row[c + TPR * i] = T(acc_dv[i]);
      }
  }
}

template <typename T, int HD, int BM, int BN, int TPR>
__global__ void __launch_bounds__(BM * TPR, 1) attention_backward_dq_exact(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const T* __restrict__ lse, const Acc* __restrict__ delta,
    T* __restrict__ dq, i64 q_sb, i64 q_sh, i64 q_ss, i64 k_sb, i64 k_sh, i64 k_ss, i64 v_sb,
    i64 v_sh, i64 v_ss, i64 do_sb, i64 do_sh, i64 do_ss, i64 lse_sb, i64 lse_sh, i64 lse_ss,
    i64 dq_sb, i64 dq_sh, i64 dq_ss, int hq, int group, int nq, int nk, int d, double scale,
    int causal,
    int vec, int num_m_blocks) {
  constexpr int PITCH = HD + 1, NTHREADS = BM * TPR, DPT = HD / TPR, KPT = BN / TPR;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + BM * PITCH;
  T* sK = sdO + BM * PITCH;
  T* sV = sK + BN * PITCH;

  const BlockCoords bc = decode_block(hq, num_m_blocks);
  const int kv_head = bc.head / group;
  const int r = threadIdx.x / TPR, c = threadIdx.x % TPR;
  const int m0 = bc.block * BM, row = m0 + r;
  const T* k_head = head_ptr(k, make_strides(k_sb, k_sh, k_ss), bc.batch, kv_head);
  const T* v_head = head_ptr(v, make_strides(v_sb, v_sh, v_ss), bc.batch, kv_head);
  load_tile<BM, HD, PITCH, NTHREADS>(sQ, head_ptr(q, make_strides(q_sb, q_sh, q_ss), bc.batch, bc.head),
                                     q_ss, m0, nq, d, false);
  load_tile<BM, HD, PITCH, NTHREADS>(sdO, head_ptr(dout, make_strides(do_sb, do_sh, do_ss), bc.batch, bc.head),
                                     do_ss, m0, nq, d, false);
  Acc lse_row = inf_f64(), delta_row = 0.0;
  if (row < nq) {
    lse_row = head_ptr(lse, make_strides(lse_sb, lse_sh, lse_ss), bc.batch, bc.head)[row * lse_ss];
    if (lse_row == -inf_f64()) lse_row = inf_f64();  // a row that sees no key: P = 0
    delta_row = delta[(static_cast<i64>(bc.batch) * hq + bc.head) * nq + row];
  }

  Acc acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.0;
  const KeyTiles tiles = key_tiles_for_queries(m0, BM, BN, nq, nk, causal != 0);
  for (int j = 0; j < tiles.count; ++j) {
    const int n0 = j * BN;
    __syncthreads();
    load_tile<BN, HD, PITCH, NTHREADS>(sK, k_head, k_ss, n0, nk, d, false);
    load_tile<BN, HD, PITCH, NTHREADS>(sV, v_head, v_ss, n0, nk, d, false);
    __syncthreads();
    Acc ds[KPT];
    unsigned visible = 0;
#pragma unroll
    for (int jj = 0; jj < KPT; ++jj) {  // dS = P * (dP - D) for this query and keys c + TPR jj
      const int key = c + TPR * jj;
      const bool vis = key_visible(row, n0 + key, nq, nk, causal != 0);
      visible |= unsigned(vis) << jj;
      const Acc p = vis ? exp(scale * row_dot<HD>(sQ + r * PITCH, sK + key * PITCH) - lse_row) : 0.0;
      ds[jj] = p * (row_dot<HD>(sdO + r * PITCH, sV + key * PITCH) - delta_row);
    }
    accumulate_rows<BN, HD, TPR, PITCH>(acc, ds, visible, sK, c);  // dQ += dS K
  }
  if (row < nq) {
    T* dq_row = head_ptr(dq, make_strides(dq_sb, dq_sh, dq_ss), bc.batch, bc.head) + row * dq_ss;
#pragma unroll
    for (int i = 0; i < DPT; ++i)
      if (c + TPR * i < d) dq_row[c + TPR * i] = T(acc[i] * scale);
  }
}

}  // namespace cuflash
