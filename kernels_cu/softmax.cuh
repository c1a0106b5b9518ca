// softmax.cuh: the online softmax of the forward pass, on mma.m16n8k16 accumulator fragments.
//
// Each lane holds two rows of every 16-row m tile (rows g and g + 8, see mma.cuh). Scores stay in
// raw units (s = q . k); the softmax scale is folded with log2(e) into one FMA per element:
//   p = exp2(s * scale_log2 - m * scale_log2),  m = running row max of s.
// The running sum is kept per lane (each lane sums its own columns) and reduced across the quad
// once, at the end; rescaling by alpha keeps the partial sums consistent.
//
// `shift` (log2 units) scales every P by 2^-shift inside the same FMA. It cancels in O = acc / l
// and is added back to lse; with shift = ceil(log2(Nk)) the unnormalised accumulator
// sum_j P_j V_j stays below max|V| and cannot overflow float32 even when V is near the top of the
// bfloat16 range (whose exponent range is float32's, so the scaled P lose no precision).
//
// A slack (SLACK > 0, log2 units; FlashAttention-4's conditional rescaling) lets the running max
// trail the row's true max: it moves only where a tile's max exceeds it by more than SLACK, so
// that after a row's first tiles alpha is 1 and the accumulator's rescale (a multiply per
// accumulator register and tile: d / 2 of them a thread at d = 128, beside BN / 2 scores) is
// skipped (the caller's vote, `any_rescale`). P = exp2(s - m) then reaches up to 2^SLACK; the
// caller adds SLACK to the shift where it scales P down (bfloat16), so that P stays under
// 2^-shift as above. m, l and lse stay consistent: lse = m + log(l) whichever m.
//
// A ceiling (CEILING; the softcap's c: no final score exceeds it) lets a row's max stop moving for
// good: once a row's max comes within `reach` (log2 units) of the ceiling, the row is pinned, its
// max set to ceiling - SLACK and kept there (no later tile can pass it by more than SLACK); with
// shift = p_shift + SLACK (the host's shift and the slack), P's exponent bias is then the ceiling
// plus p_shift. A warp whose rows are all pinned needs no max at all: P = exp2(s - ceiling -
// p_shift) (probabilities_pinned), no reduction, no rescale. P stays under 2^-p_shift (the
// overflow bound above); its row's largest P is at least 2^-(reach + p_shift), so with reach =
// 96 - 2 p_shift the P that ftz flushes (each < 2^-126, at most 2^p_shift of them) weigh under
// 2^-30 of the row's sum, and P rounded to bfloat16 (float32's exponents) stay normal.
// float16 P cannot span that range: the callers take a ceiling for bfloat16 only.
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "score_mod.cuh"

namespace cuflash {

// CEILING: a pinned row's max and its exponent bias, and the max from which a row is pinned (an
// empty base without, so that those instances keep their layout)
template <bool CEILING>
struct SoftmaxPins {};
template <>
struct SoftmaxPins<true> {
  float pin_max, pin_bias, pin_from;
};

template <int MT, bool CEILING = false>
struct OnlineSoftmax : SoftmaxPins<CEILING> {
  float row_max[MT][2];  // running max of the raw scores of rows g and g + 8 of each m tile
  float row_sum[MT][2];  // this lane's share of sum_j exp2((s_j - row_max) * scale_log2 - shift)
  float shift;

  __device__ __forceinline__ void init(float shift_log2) {
    shift = shift_log2;
    if constexpr (CEILING) {  // no pin until set_ceiling
      this->pin_max = this->pin_bias = this->pin_from = inf_f32();
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_max[mt][r] = -inf_f32();
        row_sum[mt][r] = 0.f;
      }
    }
  }

  // CEILING: the scores' ceiling (raw units), `reach` (log2 units; see the top) and the caller's
  // SLACK. Call after init.
  __device__ __forceinline__ void set_ceiling(float ceiling, float reach_log2, float scale_log2,
                                              int slack) {
    static_assert(CEILING, "an instance with a ceiling");
    this->pin_max = ceiling - static_cast<float>(slack) / scale_log2;
    this->pin_bias = this->pin_max * scale_log2 + shift;
    this->pin_from = ceiling - reach_log2 / scale_log2;
  }

  // Whether every row of the warp is pinned (CEILING): its tiles may take probabilities_pinned.
  __device__ __forceinline__ bool warp_pinned() const {
    if constexpr (CEILING) {
      bool pinned = true;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        pinned = pinned && row_max[mt][0] == this->pin_max && row_max[mt][1] == this->pin_max;
      return __all_sync(0xffffffffu, pinned);
    } else {
      return false;
    }
  }

  // S <- P = exp2(exponent(s, pin_bias)) and l += rowsum(P) for a tile whose rows are all pinned:
  // their max stays, no rescale (alpha = 1). FMA_EVERY > 0: every FMA_EVERY-th n-tile's exp2 on
  // the FMA pipe (exp2_on_fma; its exponents here are at least -2 ceiling - shift, and P under
  // 2^-126 weigh nothing beside the row's largest, see the top).
  template <int NT_S, int FMA_EVERY = 0, typename Exponent>
  __device__ __forceinline__ void probabilities_pinned(float (&s)[MT][NT_S][4], Exponent exponent) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            const float x = exponent(s[mt][nt][e], this->pin_bias);
            const float p =
                FMA_EVERY > 0 && nt % FMA_EVERY == FMA_EVERY - 1 ? exp2_on_fma(x) : fast_exp2(x);
            s[mt][nt][e] = p;
            sum += p;
          }
        }
        row_sum[mt][r] += sum;
      }
    }
  }

  // m_new = max(m, rowmax(S)); acc *= exp(m - m_new); S <- P = exp(S - m_new); l = alpha l + rowsum(P).
  // SKIP_UNIT: the warp skips the rescale of acc where no lane's row max moved (alpha = 1 for
  // every row: most tiles of a long row), at the cost of a vote (the decoding kernel, whose
  // per-tile work is small beside the rescale of its 16-row accumulator).
  template <int NT_S, int NT_O, bool SKIP_UNIT = false>
  __device__ __forceinline__ void update(float (&s)[MT][NT_S][4], float (&acc)[MT][NT_O][4],
                                         float scale_log2) {
    if constexpr (SKIP_UNIT) {
      float alphas[MT][2];
      probabilities(s, scale_log2, alphas);
      bool unit = true;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) unit = unit && alphas[mt][0] == 1.f && alphas[mt][1] == 1.f;
      if (__all_sync(0xffffffffu, unit)) return;
      rescale(acc, alphas);
    } else {
      update_rows(s, scale_log2, [&](int mt, int r, float alpha) { rescale_row(acc, mt, r, alpha); });
    }
  }

  // update without the rescale, for kernels that rescale acc later (while a product that does not
  // read acc is in flight): alphas[mt][r] is the factor acc's row must be rescaled by before
  // this tile's P V is added to it (exactly 1 where the row's max stayed; SLACK: see the top).
  template <int NT_S, int SLACK = 0>
  __device__ __forceinline__ void probabilities(float (&s)[MT][NT_S][4], float scale_log2,
                                                float (&alphas)[MT][2]) {
    update_rows<NT_S, SLACK>(s, scale_log2,
                             [&](int mt, int r, float alpha) { alphas[mt][r] = alpha; });
  }

  // The same for scores that are unit * s (unit > 0: the softcap's c / u, ScoreMod::tanh_only):
  // the row max is the unit times the largest s (a rounding that keeps the order), and the unit
  // folds into the exponent's FMA, one multiply a score less.
  template <int NT_S, int SLACK = 0>
  __device__ __forceinline__ void probabilities_in_unit(float (&s)[MT][NT_S][4], float scale_log2,
                                                        float unit, float (&alphas)[MT][2]) {
    const float unit_log2 = unit * scale_log2;
    update_rows<NT_S, SLACK>(
        s, scale_log2, [&](int mt, int r, float alpha) { alphas[mt][r] = alpha; },
        [&](int mt, int r) { return unit * tile_row_max(s, mt, r); },
        [&](int, int, float x, float bias) { return fmaf(x, unit_log2, -bias); });
  }

  // The same for scores that are s + row_term[mt][r] (a term per row and lane that the caller
  // kept out of the scores: ScoreMod::apply_one_sided's ALiBi): it goes into the row's max (and
  // so into lse) and, scaled, into the exponent's bias, one addition a row rather than one a
  // score. The lanes of a quad hold different columns of the row, so their terms differ: each
  // adds its own to its own max before the quad's reduction.
  template <int NT_S, int SLACK = 0>
  __device__ __forceinline__ void probabilities(float (&s)[MT][NT_S][4], float scale_log2,
                                                const float (&row_term)[MT][2],
                                                float (&alphas)[MT][2]) {
    update_rows<NT_S, SLACK>(
        s, scale_log2, [&](int mt, int r, float alpha) { alphas[mt][r] = alpha; },
        [&](int mt, int r) { return quad_max(lane_row_max(s, mt, r) + row_term[mt][r]); },
        [&](int mt, int r, float x, float bias) {
          return fmaf(x, scale_log2, row_term[mt][r] * scale_log2 - bias);
        });
  }

  // Whether any lane of the warp has a row whose accumulator must be rescaled (alpha != 1): the
  // warp skips the rescale otherwise.
  static __device__ __forceinline__ bool any_rescale(const float (&alphas)[MT][2]) {
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) moved = moved || alphas[mt][0] != 1.f || alphas[mt][1] != 1.f;
    return __any_sync(0xffffffffu, moved);
  }

  // acc *= alpha, row by row.
  template <int NT_O>
  static __device__ __forceinline__ void rescale(float (&acc)[MT][NT_O][4],
                                                 const float (&alphas)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) rescale_row(acc, mt, r, alphas[mt][r]);
  }

  // The rows of update: S <- P, m and l updated, and each row's alpha = exp(m - m_new) handed to
  // on_alpha(mt, r, alpha) as soon as it is known. A row that has seen no key yet keeps m = -inf;
  // exponents then use 0 in place of m_new so that no -inf - -inf = NaN appears (its P and alpha
  // are 0).
  // The scores' form enters through two hooks: tile_max(mt, r), the row's largest final score in
  // this tile (default: the largest s), and exponent(mt, r, x, bias), log2 of P for score x
  // (default: x scale_log2 - bias).
  template <int NT_S, int SLACK = 0, typename OnAlpha>
  __device__ __forceinline__ void update_rows(float (&s)[MT][NT_S][4], float scale_log2,
                                              OnAlpha on_alpha) {
    update_rows<NT_S, SLACK>(
        s, scale_log2, on_alpha, [&](int mt, int r) { return tile_row_max(s, mt, r); },
        [&](int, int, float x, float bias) { return fmaf(x, scale_log2, -bias); });
  }
  template <int NT_S, int SLACK, typename OnAlpha, typename TileMax, typename Exponent>
  __device__ __forceinline__ void update_rows(float (&s)[MT][NT_S][4], float scale_log2,
                                              OnAlpha on_alpha, TileMax tile_max,
                                              Exponent exponent) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = pin(next_max<SLACK>(row_max[mt][r], tile_max(mt, r), scale_log2));
        const float m_scaled = scaled_max(m_new, scale_log2);
        on_alpha(mt, r,
                 move_row<(SLACK > 0)>(s, mt, r, m_new, m_scaled, scale_log2,
                                       [&](float x, float bias) { return exponent(mt, r, x, bias); }));
      }
    }
  }

  // probabilities for the scores of a tile that no mask bound crosses, under a softcap alone:
  // s holds raw scores (unit u), P is over c tanh(s u / c) (score_mod.cuh: cap_in = u / c,
  // cap_out = c / u, row_max in capped units as in probabilities). tanh is increasing, so a row's
  // largest capped score is the cap of its largest raw one: the max no longer waits for the
  // tanh, and the cap's multiply folds into the softmax's FMA. A tile with hidden scores (-inf)
  // takes the general path: here tanh(-inf) = -1 would make them visible. (+2-4% for the d = 64
  // softcap forward on the H100 and H200; docs/perf/NOTES.md, v25, v26 and v29.)
  template <int NT_S, int SLACK = 0>
  __device__ __forceinline__ void probabilities_capped(float (&s)[MT][NT_S][4], float scale_log2,
                                                       float cap_in, float cap_out,
                                                       float (&alphas)[MT][2]) {
    const float cap_log2 = cap_out * scale_log2;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float raw_max = tile_row_max(s, mt, r);
        const float m_new = pin(next_max<SLACK>(
            row_max[mt][r], cap_out * tanh_fast(raw_max * cap_in), scale_log2));
        const float m_scaled = m_new * scale_log2;  // finite: tanh(-inf) = -1
        alphas[mt][r] = move_row<(SLACK > 0)>(
            s, mt, r, m_new, m_scaled, scale_log2,
            [&](float x, float bias) { return capped_exponent(x, cap_in, cap_log2, bias); });
      }
    }
  }

  // A row max m as the exponents' offset, m scale_log2, or 0 for a row that has seen no key (m =
  // -inf: its P and alpha are then 0, where -inf - -inf would give NaN). The online update and the
  // merges of several softmaxes' rows (forward_sm90_tma.cu, kvcache.cu) share it.
  static __device__ __forceinline__ float scaled_max(float m, float scale_log2) {
    return m == -inf_f32() ? 0.f : m * scale_log2;
  }

  // A row's running max after a tile whose largest score is m_tile: max(m_old, m_tile), or with
  // SLACK > 0 m_old unless m_tile exceeds it by more than SLACK in log2 units (the top). A row that
  // has seen no key (m_old = -inf) takes any finite m_tile; NaN differences keep m_old, as
  // fmaxf would.
  template <int SLACK>
  static __device__ __forceinline__ float next_max(float m_old, float m_tile, float scale_log2) {
    if constexpr (SLACK > 0) {
      if (!((m_tile - m_old) * scale_log2 > static_cast<float>(SLACK))) return m_old;
    }
    return fmaxf(m_old, m_tile);
  }

  // A row's next max m, or pin_max where m reaches pin_from (CEILING; see the top).
  __device__ __forceinline__ float pin(float m) const {
    if constexpr (CEILING) return m >= this->pin_from ? this->pin_max : m;
    else return m;
  }

  // The largest score of row r of m-tile mt in this tile (over the lane quad that holds it).
  template <int NT_S>
  static __device__ __forceinline__ float tile_row_max(const float (&s)[MT][NT_S][4], int mt, int r) {
    return quad_max(lane_row_max(s, mt, r));
  }
  // ... of this lane's columns only.
  template <int NT_S>
  static __device__ __forceinline__ float lane_row_max(const float (&s)[MT][NT_S][4], int mt, int r) {
    float mx = -inf_f32();
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
    return mx;
  }

  // Row r of m-tile mt moves to the max m_new (m_scaled: its exponent, m_new * scale_log2 or 0):
  // its scores become P = exp2(exponent(s, bias)), bias = m_scaled + shift, its sum l = alpha l +
  // rowsum(P); returns alpha = exp2(m scale_log2 - m_scaled).
  template <bool UNIT_IF_KEPT, int NT_S, typename Exponent>
  __device__ __forceinline__ float move_row(float (&s)[MT][NT_S][4], int mt, int r, float m_new,
                                            float m_scaled, float scale_log2, Exponent exponent) {
    // UNIT_IF_KEPT: alpha is exactly 1 where the max stays (the callers' vote skips the rescale
    // there; the product's rounding could leave exp2 of a residual)
    float alpha = fast_exp2(row_max[mt][r] * scale_log2 - m_scaled);
    if constexpr (UNIT_IF_KEPT) alpha = m_new == row_max[mt][r] ? 1.f : alpha;
    // a pinned row's bias as probabilities_pinned takes it (the same rounding)
    float bias = m_scaled + shift;
    if constexpr (CEILING) bias = m_new == this->pin_max ? this->pin_bias : bias;
    row_max[mt][r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
#pragma unroll
      for (int e = 2 * r; e < 2 * r + 2; ++e) {
        const float p = fast_exp2(exponent(s[mt][nt][e], bias));
        s[mt][nt][e] = p;
        sum += p;
      }
    }
    row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
    return alpha;
  }

  // acc row r of m-tile mt *= alpha
  template <int NT_O>
  static __device__ __forceinline__ void rescale_row(float (&acc)[MT][NT_O][4], int mt, int r,
                                                     float alpha) {
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) {
      acc[mt][nt][2 * r] *= alpha;
      acc[mt][nt][2 * r + 1] *= alpha;
    }
  }

  // Row r of m-tile mt's o_factor / l and lse = m * scale + ln(l) (a row that saw no key, l = 0:
  // 0 and -inf), from the running max and sum alone. (o_factor: the FP8 forward's descale factor
  // of v.) FAST: o_factor times 1 / l from rcp.approx and a Newton step (reciprocal_no_call) and
  // log2(l) from lg2.approx, in place of the IEEE division (a slow path behind a branch) and
  // log2f's polynomial: short enough to hide under the TMA forward's last P V (forward_sm90_tma.cu,
  // FAST_FINISH).
  template <bool FAST = false>
  __device__ __forceinline__ void finish_row(int mt, int r, float scale_log2, float o_factor,
                                             float& inv, float& lse) const {
    const float ln2 = 0.6931471805599453f;
    const float l = quad_sum(row_sum[mt][r]);
    const bool empty = (l == 0.f);
    // (each branch spells out its expressions: one form shared by both moved an instruction of
    // the exact branch's log2f, whose instances are measured as they are)
    if constexpr (FAST) {
      inv = empty ? 0.f : o_factor * reciprocal_no_call(l);
      lse = empty ? -inf_f32() : (row_max[mt][r] * scale_log2 + fast_log2(l) + shift) * ln2;
    } else {
      inv = empty ? 0.f : o_factor / l;
      lse = empty ? -inf_f32() : (row_max[mt][r] * scale_log2 + log2f(l) + shift) * ln2;
    }
  }

  // Every row's (finish_row), so that the Hopper forward's pipelined loops compute them while
  // their last P V is in flight and scale the accumulator by them afterwards (rescale).
  template <bool FAST = false>
  __device__ __forceinline__ void finish_rows(float scale_log2, float (&inv)[MT][2],
                                              float (&lse)[MT][2], float o_factor = 1.f) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        finish_row<FAST>(mt, r, scale_log2, o_factor, inv[mt][r], lse[mt][r]);
  }

  // O = o_factor acc / l and lse, row by row.
  template <bool FAST = false, int NT_O>
  __device__ __forceinline__ void finalize(float (&acc)[MT][NT_O][4], float scale_log2,
                                           float (&lse)[MT][2], float o_factor = 1.f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float inv;
        finish_row<FAST>(mt, r, scale_log2, o_factor, inv, lse[mt][r]);
        rescale_row(acc, mt, r, inv);
      }
    }
  }
};

}  // namespace cuflash
