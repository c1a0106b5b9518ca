// score_mod.cuh: the score modifiers, softcap and ALiBi, applied between S = scale * q . k and the
// mask (the order of docs/DESIGN.md): S' = c tanh(S / c) (softcap c > 0), then
// S' -= slope * |i + nk - nq - j| (ALiBi: a slope per (batch, query head), FlashAttention's sign
// and bottom-right alignment). lse and P are over the final S'.
//
// The kernels hold scores in some unit u (the tensor-core kernels raw dot products, u = scale,
// because the softmax folds the scale into its exp2; the exact kernels u = 1): a ScoreMod built
// for unit u maps a score s = S / u to s' = S' / u, so the code after it does not change.
// The backward needs ds'/ds through the tanh, 1 - tanh^2 (ALiBi adds a constant): dcap.
//
// Compile-time features (features.cuh): an instance without either carries no code for them.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "mma.cuh"

namespace cuflash {

// tanh(x) as one MUFU operation (tanh.approx.f32). PTX promises a relative error of 2^-11; the
// sm_90 unit measures 1.1e-5 (2^-16.5) at most and 2.3e-6 absolute once saturated (|x| >= 2;
// docs/perf/NOTES.md v25), so a capped score carries at most c * 8e-6, far under a half-precision
// score's own rounding. tests/gpu/test_score_mods.py holds the device it runs on to 2^-15. The
// exact form 1 - 2 / (exp(2x) + 1) took two MUFU operations (ex2, rcp); with one the softcap
// forward's cost at d = 128 fell from 35% to 18.5% on the H100 (v25). Gives +-1 at +-inf and NaN
// for NaN.
__device__ __forceinline__ float tanh_fast(float x) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x));
  return t;
}

// The softcap's score as an exponent of the softmax, less a bias: c tanh(s u / c) in log2 units
// minus `bias`, the cap's multiply folded into one FMA (cap_in = u / c; cap_log2: c / u times the
// softmax's scale_log2). The unmasked tiles of the softcap alone take it (OnlineSoftmax's capped
// and pinned tiles).
__device__ __forceinline__ float capped_exponent(float s, float cap_in, float cap_log2, float bias) {
  return fmaf(cap_log2, tanh_fast(s * cap_in), -bias);
}

template <bool SOFTCAP, bool ALIBI, typename T = float, bool PRECISE = false>
struct ScoreMod {
  static constexpr bool ANY = SOFTCAP || ALIBI;
  static constexpr bool CAP_ONLY = SOFTCAP && !ALIBI;  // the final score rises with the raw one
  static constexpr bool HAS_ALIBI = ALIBI;
  static constexpr bool HAS_SOFTCAP = SOFTCAP;
  T cap_in, cap_out;  // softcap: u / c and c / u
  T slope;            // ALiBi: this (batch, head)'s slope / u
  int diag_offset;    // nk - nq: query i sits at key position i + nk - nq

  // The modifiers of query head `head` of sequence `batch`, for scores in unit `unit`.
  static __device__ __forceinline__ ScoreMod of(const Params& p, int batch, int head, T unit) {
    return of(p, batch, head, unit, Extents<false>{});
  }
  // The same for one sequence (params.cuh, Extents): a packed sequence's own diagonal.
  template <bool PACKED>
  static __device__ __forceinline__ ScoreMod of(const Params& p, int batch, int head, T unit,
                                                const Extents<PACKED>& e) {
    ScoreMod m;
    m.cap_in = m.cap_out = m.slope = T(0);
    if constexpr (SOFTCAP) {
      m.cap_in = unit / T(p.softcap);
      m.cap_out = T(p.softcap) / unit;
    }
    if constexpr (ALIBI) m.slope = T(*head_ptr<const float>(p.alibi, batch, head)) / unit;
    m.diag_offset = e.nk(p) - e.nq(p);
    return m;
  }

  // Query i's position on the key axis, the row term of ALiBi's distance (hoisted out of the
  // loops over a row's keys).
  __device__ __forceinline__ T row_pos(int i) const { return T(i + diag_offset); }

  static __device__ __forceinline__ T tanh_of(T x) {
    if constexpr (!PRECISE) return tanh_fast(x);
    else if constexpr (sizeof(T) == 4) return tanhf(x);
    else return tanh(x);
  }

  // s' of score s of the query at `row` (row_pos) against key `col` (as T), and ds'/ds in `dcap`
  // (1 without softcap).
  __device__ __forceinline__ T operator()(T s, T row, T col, T& dcap) const {
    dcap = T(1);
    if constexpr (SOFTCAP) {
      const T t = tanh_of(s * cap_in);
      s = cap_out * t;
      dcap = T(1) - t * t;
    }
    if constexpr (ALIBI) s -= slope * fabs(row - col);
    return s;
  }

  // The same where ds'/ds is not needed (the forward): the compiler drops its arithmetic.
  __device__ __forceinline__ T operator()(T s, T row, T col) const {
    T unused;
    return (*this)(s, row, col, unused);
  }

  // Over mma / wgmma accumulator fragments s[MT][NT][4] of query rows and key columns: element
  // (mt, nt, e) of this lane is query row0 + 16 mt + 8 (e >> 1) and key col0 + 8 nt + (e & 1)
  // (row0, col0: the lane's first).
  template <int MT, int NT>
  __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int row0, int col0) const {
    if constexpr (ANY) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float rpos = row_pos(row0 + 16 * mt + 8 * (e >> 1));
          const float cbase = float(col0 + (e & 1));
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            s[mt][nt][e] = (*this)(s[mt][nt][e], rpos, cbase + float(8 * nt));
        }
    }
  }

  // The softcap's tanh alone: s <- tanh(s u / c), the final score over cap_out (the caller's
  // softmax takes cap_out as the scores' unit: OnlineSoftmax::probabilities_in_unit).
  template <int MT, int NT>
  __device__ __forceinline__ void tanh_only(float (&s)[MT][NT][4]) const {
    static_assert(CAP_ONLY, "the softcap alone");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = tanh_of(s[mt][nt][e] * float(cap_in));
  }

  // ALiBi over a key tile that lies wholly on one side of every row's diagonal (`sign`: +1 where
  // every key is at or left of it, -1 right): there |row - col| = sign (row - col), so with
  // col = col0 + c (c = 8 nt + (e & 1), a constant of the unrolled loop)
  //   s' = s + sign slope c + sign slope (col0 - row),
  // one FMA a score with an immediate, and a term per row (`row_term`; col0 holds the lane's
  // first column, so the term is the lane's own) that the caller adds to the row's max and
  // exponent bias (OnlineSoftmax::probabilities's row terms): the softmax is invariant to it but
  // for lse. The general form above takes a subtraction a score, the
  // column's position and |.| (2.2 instructions a score beside the dense softmax's ~10 at d = 128).
  template <int MT, int NT>
  __device__ __forceinline__ void apply_one_sided(float (&s)[MT][NT][4], int row0, int col0,
                                                  int sign, float (&row_term)[MT][2]) const {
    static_assert(ALIBI, "the one-sided form is ALiBi's");
    const float signed_slope = sign > 0 ? float(slope) : -float(slope);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        row_term[mt][r] = signed_slope * (float(col0) - float(row_pos(row0 + 16 * mt + 8 * r)));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][nt][e];
          if constexpr (SOFTCAP) x = float(cap_out) * tanh_of(x * float(cap_in));
          s[mt][nt][e] = fmaf(signed_slope, float(8 * nt + (e & 1)), x);
        }
  }
};

}  // namespace cuflash
