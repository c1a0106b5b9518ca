// backward_sm90.cuh: the per-tile steps of the Hopper backward kernels (wgmma, sm_90a), shared by
// the cp.async kernels (backward_sm90.cu) and the warp-specialised TMA kernels
// (backward_sm90_tma.cu). Tiles are in the 128-byte swizzled layout of wgmma.cuh; each warpgroup
// owns 64 rows, and its accumulators have the mma.sync fragment layout per warp (lane = 4 g + t
// holds rows g and g + 8).
//
// dQ, per key tile j (a warpgroup owns 64 query rows):
//   S = Q K_j^T, dP = dO V_j^T, dS = P (dP - D), dQ += dS K_j
// dK/dV, per query tile i (a warpgroup owns 64 keys):
//   S^T = K Q_i^T, dP^T = V dO_i^T              (A and B from shared memory, K-major)
//   P^T = exp(scale S^T - lse), dS^T = P^T (dP^T - D)   (registers)
//   dV += P^T dO_i, dK += dS^T Q_i               (A from registers, B read MN-major)
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "mask.cuh"
#include "wgmma.cuh"

namespace cuflash {

// Issues C (+)= A B^T over the head dim for one warpgroup: A = 64 rows of a swizzled tile of
// A_ROWS rows starting at row a_row0, B = a whole swizzled tile of N rows. No commit, no wait.
template <typename Elem, int HD, int A_ROWS, int N>
__device__ __forceinline__ void wgmma_abt_head_dim(float (&c)[N / 8][4], const unsigned char* a_tile,
                                                   int a_row0, const unsigned char* b_tile) {
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const int block = kk >> 2, within = (kk & 3) * 32;
    wgmma_ss<Elem, N>(c, smem_desc(a_tile + block * (A_ROWS * 128) + a_row0 * 128 + within, 16, 1024),
                      smem_desc(b_tile + block * (N * 128) + within, 16, 1024), kk > 0);
  }
}

// Issues C += P B for one warpgroup: P = K_ROWS / 16 A fragments (registers), B = a swizzled tile
// of K_ROWS rows read MN-major (its head dim is C's N). No commit, no wait.
template <typename Elem, int HD, int K_ROWS>
__device__ __forceinline__ void wgmma_pb(float (&c)[HD / 8][4], const unsigned (&p)[K_ROWS / 16][4],
                                         const unsigned char* b_tile) {
#pragma unroll
  for (int kk = 0; kk < K_ROWS / 16; ++kk)
    wgmma_rs<Elem, HD>(c, p[kk], smem_desc(b_tile + kk * 2048, K_ROWS * 128, 1024), 1);
}

// Keeps A fragments alive (unmodified) until the wgmma that reads them has been waited for.
template <int K>
__device__ __forceinline__ void keep_fragments(unsigned (&p)[K][4]) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(p[kk][e])::"memory");
}

// A dK/dV consumer's operands of a query tile of BM rows as A fragments: P^T (dV += P^T dO_i) and
// dS^T (dK += dS^T Q_i).
template <int BM>
struct DkdvFrags {
  unsigned pt[BM / 16][4], dst[BM / 16][4];
  // Keeps them alive to here: after the wait for the products that read them.
  __device__ __forceinline__ void keep() {
    keep_fragments(pt);
    keep_fragments(dst);
  }
};

// dV += P^T dO_i, dK += dS^T Q_i over COLS columns (from the tiles' column block given), one group
// and no wait: f stays unmodified until the group is complete.
template <typename Elem, int COLS, int BM>
__device__ __forceinline__ void issue_dkdv(float (&acc_dv)[COLS / 8][4], float (&acc_dk)[COLS / 8][4],
                                           DkdvFrags<BM>& f, const unsigned char* q_cols,
                                           const unsigned char* do_cols) {
  wgmma_fence();
  wgmma_pb<Elem, COLS, BM>(acc_dv, f.pt, do_cols);
  wgmma_pb<Elem, COLS, BM>(acc_dk, f.dst, q_cols);
  wgmma_commit();
}

// dK and dV zeroed, at the start of a block's keys.
template <int NT_D>
__device__ __forceinline__ void clear_dkdv(float (&acc_dk)[NT_D][4], float (&acc_dv)[NT_D][4]) {
#pragma unroll
  for (int i = 0; i < NT_D; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;
}

// Every group complete: dV and dK settled, their operands kept alive to here.
template <int NT_D, int BM>
__device__ __forceinline__ void dkdv_complete(float (&acc_dv)[NT_D][4], float (&acc_dk)[NT_D][4],
                                              DkdvFrags<BM>& f) {
  wgmma_wait<0>();
  fence_accumulators(acc_dv);
  fence_accumulators(acc_dk);
  f.keep();
}

// lse in log2 units for P = exp2(s scale_log2 - lse2): +inf (P = 0) for a row that sees no key
// (lse = -inf) and for padding rows (pass `real` false).
__device__ __forceinline__ float lse2_of_row(float lse, bool real) {
  return !real || lse == -inf_f32() ? inf_f32() : lse * 1.4426950408889634f;
}

// dQ of one warpgroup's 64 query rows (rows wg * 64 .. of the block's BM-row Q and dO tiles).
// A key tile is three phases, as in Sm90DkdvKeys: issue_scores (S and dP, one wgmma group),
// gradients (dS, rounded to A fragments), issue_dq (dQ += dS K_j, one group); step() runs them
// in order and waits for each group. (Keeping one tile's dQ group in flight under the next
// tile's gradients was measured slower: docs/perf/NOTES.md, v7.)
template <typename Elem, int HD, int BM, int BN, typename Mask, typename Mod>
struct Sm90DqRows {
  static constexpr int NT_S = BN / 8, NT_D = HD / 8;
  typedef unsigned Frags[BN / 16][4];  // dS as A fragments
  const unsigned char *sQ, *sdO;
  int wg, lane;
  float scale_log2;
  float lse2[2], dlt[2];  // this lane's rows g and g + 8: lse in log2 units (lse2_of_row) and D
  int row0;               // this lane's row g in the sequence (its rows are g and g + 8)
  Mod mod;                // score modifiers (score_mod.cuh), in raw units
  float acc_dq[NT_D][4];
  float s[NT_S][4], dp[NT_S][4];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < NT_D; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dq[i][e] = 0.f;
  }

  // S = Q K_j^T, dP = dO V_j^T (keys in k_tile, v_tile).
  __device__ __forceinline__ void issue_scores(const unsigned char* k_tile,
                                               const unsigned char* v_tile) {
    wgmma_fence();
    wgmma_abt_head_dim<Elem, HD, BM, BN>(s, sQ, wg * 64, k_tile);
    wgmma_abt_head_dim<Elem, HD, BM, BN>(dp, sdO, wg * 64, v_tile);
    wgmma_commit();
  }

  // dS = P (dP - D), P = exp2(S scale_log2 - lse2), for keys n0 .. n0 + BN - 1; `masked`: the
  // tile straddles a bound of the mask or the end of the keys. The scores group must be complete.
  // The rows' key bounds are found here, on masked tiles only: held through the loop they took
  // the registers that the windowed (LOCAL) instances then spilled.
  __device__ __forceinline__ void gradients(bool masked, int n0, Frags& ds, const Mask& mask) {
    fence_accumulators(s);
    fence_accumulators(dp);
    const int col0 = n0 + 2 * (lane & 3);
    Bounds keys[2];
    if (masked) keys[0] = mask.keys_of(row0), keys[1] = mask.keys_of(row0 + 8);
    const float row_pos[2] = {mod.row_pos(row0), mod.row_pos(row0 + 8)};
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float dcap;  // ds'/ds of the softcap
        const float sm =
            mod(s[nt][e], row_pos[e >> 1], float(col0 + (e & 1)) + float(nt * 8), dcap);
        float p = fast_exp2(fmaf(sm, scale_log2, -lse2[e >> 1]));
        if (masked && Mask::key_hidden(col0 + nt * 8 + (e & 1), keys[e >> 1])) p = 0.f;
        dp[nt][e] = p * (dp[nt][e] - dlt[e >> 1]) * dcap;  // dS
      }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) accum_to_a_frag<Elem>(ds[kk], dp[2 * kk], dp[2 * kk + 1]);
  }

  // dQ += dS K_j: ds must stay unmodified until this group is complete.
  __device__ __forceinline__ void issue_dq(Frags& ds, const unsigned char* k_tile) {
    wgmma_fence();
    wgmma_pb<Elem, HD, BN>(acc_dq, ds, k_tile);
    wgmma_commit();
  }

  // One key tile, every group waited for.
  __device__ __forceinline__ void step(bool masked, int n0, const unsigned char* k_tile,
                                       const unsigned char* v_tile, const Mask& mask) {
    Frags ds;
    issue_scores(k_tile, v_tile);
    wgmma_wait<0>();
    gradients(masked, n0, ds, mask);
    issue_dq(ds, k_tile);
    wgmma_wait<0>();
    fence_accumulators(acc_dq);
    keep_fragments(ds);
  }
};

// dK and dV of one warpgroup's 64 keys (rows wg * 64 .. of the block's BN-row K and V tiles), all
// HD columns. (At HD = 256, where dK and dV of 64 keys take 2 x 128 registers a thread, two
// warpgroups share 64 keys instead: Sm90DkdvKeysExchanged, backward_sm90_tma.cuh.)
// ROWS_AFTER_WAIT: the query rows' terms (S^T's columns) are formed after the scores' wait
// (probabilities; the fused kernel's 128-row tiles with ALiBi).
template <typename Elem, int HD, int BM, int BN, typename Mask, typename Mod,
          bool ROWS_AFTER_WAIT = false>
struct Sm90DkdvKeys {
  static constexpr int COLS = HD;  // the head-dim columns of dK and dV this warpgroup holds
  static constexpr int NT_Q = BM / 8, NT_D = COLS / 8;
  const unsigned char *sK, *sV;
  int wg, lane;
  float scale_log2;
  int key0;           // this lane's key g in the sequence (its keys are g and g + 8)
  Mod mod;            // score modifiers of the current query head (score_mod.cuh), raw units
  float acc_dk[NT_D][4], acc_dv[NT_D][4];

  __device__ __forceinline__ int col0() const { return 0; }  // this warpgroup's first column
  // This warp's first key within the block (warp_index: among the consumer warps).
  static __device__ __forceinline__ int key_row0(int warp_index) { return warp_index * 16; }

  __device__ __forceinline__ void clear() { clear_dkdv(acc_dk, acc_dv); }

  // The three phases of a query tile, as in Sm90DqRows: issue_scores (S^T, dP^T), probabilities
  // (P^T, dS^T as A fragments), issue_grads (dV += P^T dO_i, dK += dS^T Q_i).
  typedef DkdvFrags<BM> Frags;
  float st[NT_Q][4], dpt[NT_Q][4];

  __device__ __forceinline__ void issue_scores(const unsigned char* q_tile,
                                               const unsigned char* do_tile) {
    const int keys0 = wg * 64;
    wgmma_fence();
    wgmma_abt_head_dim<Elem, HD, BN, BM>(st, sK, keys0, q_tile);    // S^T = K Q_i^T
    wgmma_abt_head_dim<Elem, HD, BN, BM>(dpt, sV, keys0, do_tile);  // dP^T = V dO_i^T
    wgmma_commit();
  }

  // Query rows m0 .. m0 + BM - 1 with their lse2 and D; `masked`: the tile straddles a bound of the
  // mask (the keys' query bounds are found here, as in Sm90DqRows::gradients).
  __device__ __forceinline__ void probabilities(bool masked, int m0, const float* lse2,
                                                const float* dlt, Frags& f, const Mask& mask) {
    const int t = lane & 3;
    fence_accumulators(st);
    fence_accumulators(dpt);
    if constexpr (ROWS_AFTER_WAIT) {
      // m0 made to depend on the scores (min(m0, m0 | x) = m0, unsigned; in asm, which the
      // compiler does not fold), so that the query rows' terms (ALiBi's distances: 64 a thread at
      // BM = 128) are formed after the scores' wait: ptxas computed them ahead of it, beside S^T
      // and dP^T, and spilled them (the fused d = 64 ALiBi instance: 256 B, then 40 B and 1.15x
      // the 64-row tiles' speed; docs/perf/NOTES.md, v30).
      const int bits = m0 | static_cast<int>(__float_as_uint(st[0][0]));
      asm("min.u32 %0, %0, %1;" : "+r"(m0) : "r"(bits));
    }
    Bounds queries[2];
    if (masked) queries[0] = mask.queries_of(key0), queries[1] = mask.queries_of(key0 + 8);
    const float key_pos[2] = {float(key0), float(key0 + 8)};
#pragma unroll
    for (int nt = 0; nt < NT_Q; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1);  // query column within the tile
        float dcap;                               // ds'/ds of the softcap
        const float s =
            mod(st[nt][e], mod.row_pos(m0 + 2 * t + (e & 1)) + float(nt * 8), key_pos[e >> 1], dcap);
        float p = fast_exp2(fmaf(s, scale_log2, -lse2[qc]));
        if (masked && Mask::query_hidden(m0 + qc, queries[e >> 1])) p = 0.f;
        st[nt][e] = p;                                   // P^T
        dpt[nt][e] = p * (dpt[nt][e] - dlt[qc]) * dcap;  // dS^T
      }
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      accum_to_a_frag<Elem>(f.pt[kk], st[2 * kk], st[2 * kk + 1]);
      accum_to_a_frag<Elem>(f.dst[kk], dpt[2 * kk], dpt[2 * kk + 1]);
    }
  }

  // f must stay unmodified until this group is complete.
  __device__ __forceinline__ void issue_grads(Frags& f, const unsigned char* q_tile,
                                              const unsigned char* do_tile) {
    issue_dkdv<Elem, COLS, BM>(acc_dv, acc_dk, f, q_tile, do_tile);
  }

  // One query tile, every group waited for.
  __device__ __forceinline__ void step(bool masked, int m0, const unsigned char* q_tile,
                                       const unsigned char* do_tile, const float* lse2,
                                       const float* dlt, const Mask& mask) {
    Frags f;
    issue_scores(q_tile, do_tile);
    wgmma_wait<0>();
    probabilities(masked, m0, lse2, dlt, f, mask);
    issue_grads(f, q_tile, do_tile);
    dkdv_complete(acc_dv, acc_dk, f);
  }
};

}  // namespace cuflash
