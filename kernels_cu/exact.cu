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
#include "params.cuh"
#include "features.cuh"

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

template <typename T, int HD, int BM, int BN, int TPR, int FEATURES>
__global__ void __launch_bounds__(BM * TPR, 1)
    attention_forward_exact(const __grid_constant__ Params p) {
  constexpr int PITCH = HD + 1, NTHREADS = BM * TPR, DPT = HD / TPR, KPT = BN / TPR;
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<Acc, true> Mod;  // scores in final units
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * PITCH;
  T* sV = sK + BN * PITCH;

  const BlockCoords bc = decode_block(p.heads_q, p.num_blocks);
  const int kv_head = bc.head / p.group;
  const int r = threadIdx.x / TPR, c = threadIdx.x % TPR;
  const int m0 = bc.block * BM, row = m0 + r;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  const Seq<PACKED> seq = Seq<PACKED>::of(p, bc.batch);
  const int nq = seq.nq(p), nk = seq.nk(p), d = p.head_dim;
  if (PACKED && m0 >= nq) return;  // past this sequence's rows
  const Acc scale = p.scale;
  const Mask mask = Mask::of(p, seq.ext);
  const HeadRows<const T> k = seq.template k_rows<const T>(p.k, kv_head);
  const HeadRows<const T> v = seq.template k_rows<const T>(p.v, kv_head);
  const HeadRows<const T> q = seq.template q_rows<const T>(p.q, bc.head);
  load_tile<BM, HD, PITCH, NTHREADS>(sQ, q.head, q.stride, m0, nq, d, false);

  const TileRange tiles = mask.key_tiles(m0, BM, BN);
  const Bounds keys = mask.keys_of(row);
  const Mod mod = Mod::of(p, bc.batch, bc.head, 1.0, seq.ext);
  const Acc row_pos = mod.row_pos(row);
  Acc m = -inf_f64(), l = 0.0, acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.0;

  for (int j = tiles.begin; j < tiles.end; ++j) {
    const int n0 = j * BN;
    __syncthreads();  // the previous K, V tiles are consumed
    load_tile<BN, HD, PITCH, NTHREADS>(sK, k.head, k.stride, n0, nk, d, false);
    load_tile<BN, HD, PITCH, NTHREADS>(sV, v.head, v.stride, n0, nk, d, false);
    __syncthreads();
    Acc s[KPT];
    Acc mx = -inf_f64();
    unsigned visible = 0;
#pragma unroll
    for (int jj = 0; jj < KPT; ++jj) {  // S = scale Q K^T, modified; -inf where invisible
      const int key = c + TPR * jj;
      const bool vis = !mask.key_hidden(n0 + key, keys);
      visible |= unsigned(vis) << jj;
      s[jj] = vis ? mod(scale * row_dot<HD>(sQ + r * PITCH, sK + key * PITCH), row_pos, Acc(n0 + key))
                  : -inf_f64();
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
    T* o_row = seq.template q_rows<T>(p.o, bc.head).row(row);
#pragma unroll
    for (int i = 0; i < DPT; ++i)
      if (c + TPR * i < d) o_row[c + TPR * i] = T(acc[i] * inv);
    if (c == 0) *seq.template q_rows<T>(p.lse, bc.head).row(row) = T(empty ? -inf_f64() : m + log(l));
  }
}

template <typename T, int HD, int BM, int BN, int TPR, int FEATURES>
__global__ void __launch_bounds__(BN * TPR, 1)
    attention_backward_dkdv_exact(const __grid_constant__ Params p) {
  constexpr int PITCH = HD + 1, NTHREADS = BN * TPR, DPT = HD / TPR, QPT = BM / TPR;
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<Acc, true> Mod;  // scores in final units
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* sLse = reinterpret_cast<Acc*>(smem_raw);  // first: 8-byte aligned
  Acc* sDelta = sLse + BM;
  T* sK = reinterpret_cast<T*>(sDelta + BM);
  T* sV = sK + BN * PITCH;
  T* sQ = sV + BN * PITCH;
  T* sdO = sQ + BM * PITCH;

  const BlockCoords bc = decode_block(p.heads_kv, p.num_blocks);
  const int r = threadIdx.x / TPR, c = threadIdx.x % TPR;
  const int n0 = bc.block * BN, key = n0 + r;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  const Seq<PACKED> seq = Seq<PACKED>::of(p, bc.batch);
  const int nq = seq.nq(p), nk = seq.nk(p), d = p.head_dim, group = p.group;
  if (PACKED && n0 >= nk) return;  // past this sequence's keys
  const Acc scale = p.scale;
  const Mask mask = Mask::of(p, seq.ext);
  const HeadRows<const T> k = seq.template k_rows<const T>(p.k, bc.head);
  const HeadRows<const T> v = seq.template k_rows<const T>(p.v, bc.head);
  load_tile<BN, HD, PITCH, NTHREADS>(sK, k.head, k.stride, n0, nk, d, false);
  load_tile<BN, HD, PITCH, NTHREADS>(sV, v.head, v.stride, n0, nk, d, false);

  Acc acc_dk[DPT], acc_dv[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc_dk[i] = acc_dv[i] = 0.0;

  const TileRange tiles = mask.query_tiles(n0, BN, BM);
  const Bounds queries = mask.queries_of(key);
  const int tiles_per_head = tiles.count();
  for (int step = 0; step < group * tiles_per_head; ++step) {
    const int head = bc.head * group + step / tiles_per_head;
    const int m0 = (tiles.begin + step % tiles_per_head) * BM;
    __syncthreads();  // the previous query tile is consumed
    const HeadRows<const T> q = seq.template q_rows<const T>(p.q, head);
    const HeadRows<const T> dout = seq.template q_rows<const T>(p.dout, head);
    load_tile<BM, HD, PITCH, NTHREADS>(sQ, q.head, q.stride, m0, nq, d, false);
    load_tile<BM, HD, PITCH, NTHREADS>(sdO, dout.head, dout.stride, m0, nq, d, false);
    const HeadRows<const T> lse = seq.template q_rows<const T>(p.lse, head);
    const HeadRows<const Acc> delta = seq.template q_rows<const Acc>(p.delta, head);
    const Mod mod = Mod::of(p, bc.batch, head, 1.0, seq.ext);
    for (int x = threadIdx.x; x < BM; x += NTHREADS) {
      Acc lx = inf_f64(), dx = 0.0;  // padded rows and rows that see no key: P = 0
      if (m0 + x < nq) {
        lx = *lse.row(m0 + x);
        if (lx == -inf_f64()) lx = inf_f64();
        dx = *delta.row(m0 + x);
      }
      sLse[x] = lx;
      sDelta[x] = dx;
    }
    __syncthreads();
    Acc pt[QPT], ds[QPT];
    unsigned visible = 0;  // padded query rows count as invisible
#pragma unroll
    for (int jj = 0; jj < QPT; ++jj) {  // P^T and dS^T for this key and queries c + TPR jj
      const int qi = c + TPR * jj;
      const bool vis = m0 + qi < nq && !mask.query_hidden(m0 + qi, queries);
      visible |= unsigned(vis) << jj;
      Acc dcap = 1.0;  // ds'/ds of the softcap
      const Acc pij =
          vis ? exp(mod(scale * row_dot<HD>(sK + r * PITCH, sQ + qi * PITCH), mod.row_pos(m0 + qi),
                        Acc(key), dcap) - sLse[qi])
              : 0.0;
      const Acc dpij = row_dot<HD>(sV + r * PITCH, sdO + qi * PITCH);
      pt[jj] = pij;
      ds[jj] = pij * (dpij - sDelta[qi]) * dcap;
    }
    accumulate_rows<BM, HD, TPR, PITCH>(acc_dv, pt, visible, sdO, c);  // dV += P^T dO
    accumulate_rows<BM, HD, TPR, PITCH>(acc_dk, ds, visible, sQ, c);   // dK += dS^T Q
  }

  if (key < nk) {
    T* dk_row = seq.template k_rows<T>(p.dk, bc.head).row(key);
    T* dv_row = seq.template k_rows<T>(p.dv, bc.head).row(key);
#pragma unroll
    for (int i = 0; i < DPT; ++i)
      if (c + TPR * i < d) {
        dk_row[c + TPR * i] = T(acc_dk[i] * scale);
        dv_row[c + TPR * i] = T(acc_dv[i]);
      }
  }
}

template <typename T, int HD, int BM, int BN, int TPR, int FEATURES>
__global__ void __launch_bounds__(BM * TPR, 1)
    attention_backward_dq_exact(const __grid_constant__ Params p) {
  constexpr int PITCH = HD + 1, NTHREADS = BM * TPR, DPT = HD / TPR, KPT = BN / TPR;
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<Acc, true> Mod;  // scores in final units
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + BM * PITCH;
  T* sK = sdO + BM * PITCH;
  T* sV = sK + BN * PITCH;

  const BlockCoords bc = decode_block(p.heads_q, p.num_blocks);
  const int kv_head = bc.head / p.group;
  const int r = threadIdx.x / TPR, c = threadIdx.x % TPR;
  const int m0 = bc.block * BM, row = m0 + r;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  const Seq<PACKED> seq = Seq<PACKED>::of(p, bc.batch);
  const int nq = seq.nq(p), nk = seq.nk(p), d = p.head_dim;
  if (PACKED && m0 >= nq) return;  // past this sequence's rows
  const Acc scale = p.scale;
  const Mask mask = Mask::of(p, seq.ext);
  const HeadRows<const T> k = seq.template k_rows<const T>(p.k, kv_head);
  const HeadRows<const T> v = seq.template k_rows<const T>(p.v, kv_head);
  const HeadRows<const T> q = seq.template q_rows<const T>(p.q, bc.head);
  const HeadRows<const T> dout = seq.template q_rows<const T>(p.dout, bc.head);
  load_tile<BM, HD, PITCH, NTHREADS>(sQ, q.head, q.stride, m0, nq, d, false);
  load_tile<BM, HD, PITCH, NTHREADS>(sdO, dout.head, dout.stride, m0, nq, d, false);
  Acc lse_row = inf_f64(), delta_row = 0.0;
  if (row < nq) {
    lse_row = *seq.template q_rows<const T>(p.lse, bc.head).row(row);
    if (lse_row == -inf_f64()) lse_row = inf_f64();  // a row that sees no key: P = 0
    delta_row = *seq.template q_rows<const Acc>(p.delta, bc.head).row(row);
  }

  Acc acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.0;
  const TileRange tiles = mask.key_tiles(m0, BM, BN);
  const Bounds keys = mask.keys_of(row);
  const Mod mod = Mod::of(p, bc.batch, bc.head, 1.0, seq.ext);
  const Acc row_pos = mod.row_pos(row);
  for (int j = tiles.begin; j < tiles.end; ++j) {
    const int n0 = j * BN;
    __syncthreads();
    load_tile<BN, HD, PITCH, NTHREADS>(sK, k.head, k.stride, n0, nk, d, false);
    load_tile<BN, HD, PITCH, NTHREADS>(sV, v.head, v.stride, n0, nk, d, false);
    __syncthreads();
    Acc ds[KPT];
    unsigned visible = 0;
#pragma unroll
    for (int jj = 0; jj < KPT; ++jj) {  // dS = P * (dP - D) for this query and keys c + TPR jj
      const int key = c + TPR * jj;
      const bool vis = !mask.key_hidden(n0 + key, keys);
      visible |= unsigned(vis) << jj;
      Acc dcap = 1.0;  // ds'/ds of the softcap
      const Acc pij =
          vis ? exp(mod(scale * row_dot<HD>(sQ + r * PITCH, sK + key * PITCH), row_pos,
                        Acc(n0 + key), dcap) - lse_row)
              : 0.0;
      ds[jj] = pij * (row_dot<HD>(sdO + r * PITCH, sV + key * PITCH) - delta_row) * dcap;
    }
    accumulate_rows<BN, HD, TPR, PITCH>(acc, ds, visible, sK, c);  // dQ += dS K
  }
  if (row < nq) {
    T* dq_row = seq.template q_rows<T>(p.dq, bc.head).row(row);
#pragma unroll
    for (int i = 0; i < DPT; ++i)
      if (c + TPR * i < d) dq_row[c + TPR * i] = T(acc[i] * scale);
  }
}

}  // namespace cuflash
