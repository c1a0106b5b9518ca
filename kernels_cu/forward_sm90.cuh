// forward_sm90.cuh: the loop body of the Hopper forward kernels (wgmma, sm_90a), shared by the
// cp.async kernel (forward_sm90.cu) and the warp-specialised TMA kernel (forward_sm90_tma.cu).
//
// A warpgroup owns 64 query rows of a block of BM. Per key tile it issues S = Q K_j^T (A and B
// from shared memory), applies the online softmax in registers, and issues O += P V_j with P as a
// register A operand and V_j read transposed (MN-major) from shared memory: no shared-memory round
// trip for P, no transposed copy. The tiles are in the 128-byte swizzled layout of wgmma.cuh.
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "features.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

namespace cuflash {

// The element formats of the Hopper forward. 16-bit (f16, bf16): k16 products, O in the input's
// format, V_j read MN-major (transposed by the wgmma). 8-bit (e4m3, the FP8 forward): k32 products
// (the same 32 bytes a step), O in bf16, and V_j read K-major, as 8-bit wgmma reads only: the host
// hands the kernel V^T, each head's (d x keys) with the keys of every 16 permuted so that P's
// accumulator registers are its A fragments as they are (to_a_fragments).
template <typename Elem>
struct ForwardFormat {
  typedef Elem Out;
  static constexpr int BYTES = 2, K_STEP = 16;
  static constexpr bool V_TRANSPOSED = false;
};
template <>
struct ForwardFormat<e4m3> {
  typedef bf16 Out;
  static constexpr int BYTES = 1, K_STEP = 32;
  static constexpr bool V_TRANSPOSED = true;
};

template <typename Elem, int HD, int BM, int BN, int FEATURES>
struct Sm90ForwardTraits {
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> ScoreMod;
  typedef ForwardFormat<Elem> Format;
  typedef typename Format::Out Out;
  static constexpr int BYTES = Format::BYTES;
  static constexpr int WARPGROUPS = BM / 64;
  static constexpr int NTHREADS = WARPGROUPS * 128;
  static constexpr int NT_S = BN / 8, NT_O = HD / 8;
  // Under a softcap alone, the row max of an unmasked tile from its raw scores
  // (OnlineSoftmax::probabilities_capped): d = 64 only, where it measured faster. This and
  // CAP_AS_UNIT serve float16 since v34: bfloat16's unmasked tiles pin (PIN_AT_CAP below).
  static constexpr bool EARLY_CAP_MAX = ScoreMod::CAP_ONLY && HD <= 64;
  // Under a softcap alone, the unmasked tiles keep tanh(s u / c) and the softmax takes c / u as
  // their unit (OnlineSoftmax::probabilities_in_unit): the cap's multiply folds into the
  // exponent's FMA. d = 256 ran 1.03-1.04x (docs/perf/NOTES.md, v33); d = 128, whose softcap
  // chain the exp units bind, 1.01x, and its 160-key tiles spilled 28 B.
  static constexpr bool CAP_AS_UNIT = ScoreMod::CAP_ONLY && HD > 128;
  // How far (log2 units) the TMA forward's running row max may trail the true one, so that most
  // tiles skip the accumulator's rescale (softmax.cuh; FlashAttention-4's conditional rescaling):
  // P then reach 2^8. Taken where the rescale (d / 2 multiplies a thread and tile) outweighs the
  // vote and branch that skip it: the 16-bit forward at d = 256 (128 multiplies beside 40 scores)
  // ran 1.00-1.07x, at d = 128 (64 beside 80) 1.01-1.04x, at d = 64 (32) 0.94-0.98x; not with
  // ALiBi, whose bias rises towards the diagonal by slope x BN a tile, past the slack on most tiles
  // (d = 128: 0.985-0.99x). Nor in the FP8 forward: its P in e4m3 (3 mantissa bits) lose the exact
  // 1 of a row's largest P, and O's error reached 3x a naive FP8 computation's (NOTES.md, v32).
  static constexpr int RESCALE_SLACK =
      HD > 64 && BYTES == 2 && !Features<FEATURES>::ALIBI ? 8 : 0;
  // Under a softcap alone in bfloat16 the softcap's c is the scores' ceiling: once a row's max
  // comes near it the row is pinned, and a warp whose rows all are computes P with no max, no
  // reduction and no rescale (softmax.cuh, CEILING; probabilities_pinned below). float16's P
  // cannot span the range that takes (nor e4m3's).
  static constexpr bool PIN_AT_CAP = ScoreMod::CAP_ONLY && ElemTraits<Elem>::f32_exponents();
  // ... and every how many n-tiles of a pinned tile take their exp2 on the FMA pipe (0: none;
  // mma.cuh, exp2_on_fma). A pinned tile's softcap is two MUFU operations a score (tanh, exp2),
  // which at d = 128 take as long as the products at peak: every 3rd ran 1.04-1.05x, every 2nd
  // and 4th 1.01-1.05x; at d = 64 (issue-heavier) 0.92-0.95x and at d = 256 (half the MUFU work a
  // FLOP) 0.86-0.92x (H100, bf16; docs/perf/NOTES.md, v34).
  static constexpr int PINNED_EXP2_ON_FMA = HD == 128 ? 3 : 0;
  // k steps of the two products (32 bytes of every row each)
  static constexpr int K_QK = HD * BYTES / 32, K_PV = BN / Format::K_STEP;
  static constexpr int Q_BYTES = BM * HD * BYTES, KV_BYTES = BN * HD * BYTES;  // one tile, swizzled
  // Q and K tiles are column blocks of 128-byte swizzled rows, or one block of 64-byte rows (the
  // 64-byte swizzle) where a row has only 64 bytes (e4m3 at d = 64)
  static constexpr int ROW_BYTES = HD * BYTES < 128 ? HD * BYTES : 128;
  static constexpr int PITCH = HD + 8;  // the cp.async kernel's staging tile (gemm.cuh layout)
  static_assert((ROW_BYTES == 128 || ROW_BYTES == 64) && HD * BYTES % ROW_BYTES == 0,
                "swizzled tiles are built from 128-byte (or one 64-byte) column blocks");
  static_assert(!Format::V_TRANSPOSED || BN % 128 == 0, "V^T tiles are built from 128-key blocks");
  static_assert(BM % 64 == 0 && BN % 16 == 0 && BN <= 256 && HD <= 256, "wgmma shapes");
};

template <typename Tr, typename Elem, int HD, int BM, int BN>
struct Sm90ForwardBlock {
  typedef typename Tr::Mask Mask;
  const unsigned char *sQ, *sK, *sV;  // sQ: the whole Q tile; sK, sV: stage 0 (stage s at + s KV_BYTES)
  int m0, lane, warp_row0, wg;
  float scale_log2;
  typename Tr::ScoreMod mod;  // softcap, ALiBi (score_mod.cuh), in raw units
  float acc_o[1][Tr::NT_O][4];
  OnlineSoftmax<1, Tr::PIN_AT_CAP> softmax;

  // S_ij = -inf where query i may not see key j (outside its band, keys past the end): a comparison
  // or two per score against the keys each of this lane's two rows sees.
  __device__ __forceinline__ void apply_mask(float (&s)[1][Tr::NT_S][4], int n0,
                                             const Mask& mask) const {
    const int col0 = n0 + 2 * (lane & 3);
    Bounds keys[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) keys[r] = mask.keys_of(m0 + warp_row0 + (lane >> 2) + 8 * r);
#pragma unroll
    for (int nt = 0; nt < Tr::NT_S; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (Mask::key_hidden(col0 + nt * 8 + (e & 1), keys[e >> 1])) s[0][nt][e] = -inf_f32();
  }

  // The steps of a key tile, for kernels that overlap them (forward_sm90_tma.cu): the products
  // are issued to the tensor cores as one wgmma group each, and the caller waits for them
  // (wgmma_wait) before the next step reads their registers.

  // S = Q K_j^T for this warpgroup's 64 rows, K_j in shared memory at k_tile: k step kk (k16, or
  // k32 for 8-bit elements) reads 32 bytes of every row, in column block kk / 4 (of 128-byte rows;
  // 64-byte rows: one block, 8-row atoms of 512 bytes).
  __device__ __forceinline__ void issue_scores(const unsigned char* k_tile,
                                               float (&s)[1][Tr::NT_S][4]) const {
    constexpr int RB = Tr::ROW_BYTES, STEPS = RB / 32;
    const TileDesc q_desc = TileDesc::of<RB>(sQ + wg * (64 * RB), 16, 8 * RB);
    const TileDesc k_desc = TileDesc::of<RB>(k_tile, 16, 8 * RB);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::K_QK; ++kk) {
      const int block = kk / STEPS, within = (kk % STEPS) * 32;
      wgmma_ss<Elem, BN>(s[0], q_desc.at(block * (BM * RB) + within),
                         k_desc.at(block * (BN * RB) + within), kk > 0);
    }
    wgmma_commit();
  }

  // The scores of key tile j (s: its product waited for), modified and masked (MASKED: the tile
  // straddles a bound of the mask or the end of the keys). The kernels build `mask` from their
  // Params where they call this (Mask::of): a copy held through their loops would cost registers.
  template <bool MASKED>
  __device__ __forceinline__ void final_scores(int j, float (&s)[1][Tr::NT_S][4],
                                               const Mask& mask) const {
    fence_accumulators(s[0]);
    mod.apply(s, m0 + warp_row0 + (lane >> 2), j * BN + 2 * (lane & 3));
    if constexpr (MASKED) apply_mask(s, j * BN, mask);
  }

  // Where ALiBi's distance |diag(i) - j| keeps one sign over key tile j for every row of the
  // block: +1 where the tile lies wholly at or left of every row's diagonal, -1 right of it, 0
  // where the tile straddles a diagonal (the kernel gives those tiles the general form, with the
  // masked ones). Under a causal mask every unmasked tile is on the left.
  __device__ __forceinline__ int alibi_side(int j) const {
    const int first = m0 + mod.diag_offset, last = m0 + BM - 1 + mod.diag_offset;
    return j * BN + BN - 1 <= first ? 1 : (j * BN >= last ? -1 : 0);
  }

  // ... turned into unnormalised probabilities by the online softmax; alphas: the factor acc_o
  // must be rescaled by before this tile's P V is added (softmax.cuh; exactly 1 on rows whose max
  // stays within Tr::RESCALE_SLACK). Returns whether any row of the warp needs that rescale.
  // `alibi_sign`: alibi_side(j) of an unmasked tile under ALiBi (its caller chose the path by it).
  template <bool MASKED>
  __device__ __forceinline__ bool scores_to_probabilities(int j, float (&s)[1][Tr::NT_S][4],
                                                          const Mask& mask, float (&alphas)[1][2],
                                                          int alibi_sign = 0) {
    constexpr int SLACK = Tr::RESCALE_SLACK;
    if constexpr (!MASKED && Tr::EARLY_CAP_MAX) {
      fence_accumulators(s[0]);
      softmax.template probabilities_capped<Tr::NT_S, SLACK>(s, scale_log2, mod.cap_in,
                                                             mod.cap_out, alphas);
    } else if constexpr (!MASKED && Tr::CAP_AS_UNIT) {
      fence_accumulators(s[0]);
      mod.tanh_only(s);
      softmax.template probabilities_in_unit<Tr::NT_S, SLACK>(s, scale_log2, mod.cap_out, alphas);
    } else if constexpr (!MASKED && Tr::ScoreMod::HAS_ALIBI) {
      // Unmasked tiles under ALiBi lie on one side of every row's diagonal (the kernel sends the
      // ones that straddle it the masked way): one FMA a score (ScoreMod::apply_one_sided).
      fence_accumulators(s[0]);
      float row_term[1][2];
      mod.apply_one_sided(s, m0 + warp_row0 + (lane >> 2), j * BN + 2 * (lane & 3), alibi_sign,
                          row_term);
      softmax.template probabilities<Tr::NT_S, SLACK>(s, scale_log2, row_term, alphas);
    } else {
      final_scores<MASKED>(j, s, mask);
      softmax.template probabilities<Tr::NT_S, SLACK>(s, scale_log2, alphas);
    }
    return SLACK == 0 || softmax.any_rescale(alphas);
  }

  // The same for an unmasked tile where every row of the warp is pinned at the softcap
  // (Tr::PIN_AT_CAP, softmax.warp_pinned()): P = exp2(c tanh(s u / c) - c - shift) in log2 units,
  // the cap's multiply folded into the exponent's FMA. acc_o keeps its scale (no rescale).
  __device__ __forceinline__ void pinned_probabilities(float (&s)[1][Tr::NT_S][4]) {
    static_assert(Tr::PIN_AT_CAP, "rows pinned at the softcap");
    fence_accumulators(s[0]);
    const float cap_log2 = mod.cap_out * scale_log2;
    softmax.template probabilities_pinned<Tr::NT_S, Tr::PINNED_EXP2_ON_FMA>(
        s, [&](float x, float bias) { return capped_exponent(x, mod.cap_in, cap_log2, bias); });
  }

  // P rounded to the element type, as the A fragments of O += P V. 16-bit: n-tiles 2kk, 2kk + 1
  // are k16 step kk's fragment. 8-bit: a k32 fragment holds row g's keys 4t .. 4t + 3 in register
  // 0 and 16 + 4t .. in register 2 (row g + 8: 1 and 3), where this lane's accumulator has keys
  // 2t, 2t + 1 of every n-tile: register 0 takes those of n-tiles 4kk and 4kk + 1, so position
  // 4t + i of every 16 keys holds key 2t + (i & 1) + 8 (i >> 1), the order of the host's V^T.
  static __device__ __forceinline__ void to_a_fragments(float (&s)[1][Tr::NT_S][4],
                                                        unsigned (&p)[Tr::K_PV][4]) {
#pragma unroll
    for (int kk = 0; kk < Tr::K_PV; ++kk) {
      if constexpr (Tr::BYTES == 2) {
        accum_to_a_frag<Elem>(p[kk], s[0][2 * kk], s[0][2 * kk + 1]);
      } else {
        const float(&a)[4] = s[0][4 * kk];
        const float(&b)[4] = s[0][4 * kk + 1];
        const float(&c)[4] = s[0][4 * kk + 2];
        const float(&d)[4] = s[0][4 * kk + 3];
        p[kk][0] = ElemTraits<Elem>::pack4(a[0], a[1], b[0], b[1]);
        p[kk][1] = ElemTraits<Elem>::pack4(a[2], a[3], b[2], b[3]);
        p[kk][2] = ElemTraits<Elem>::pack4(c[0], c[1], d[0], d[1]);
        p[kk][3] = ElemTraits<Elem>::pack4(c[2], c[3], d[2], d[3]);
      }
    }
  }

  // O += P V_j, V_j in shared memory at v_tile. 16-bit: k16 step kk covers keys 16kk .. 16kk + 15,
  // rows of V_j 2048 bytes apart. 8-bit: V_j^T (HD rows, BN / 128 column blocks of 128 keys), k32
  // step kk reads 32 bytes of every row, in column block kk / 4 ...
  __device__ __forceinline__ void issue_pv(const unsigned char* v_tile, unsigned (&p)[Tr::K_PV][4]) {
    const TileDesc v_desc = Tr::Format::V_TRANSPOSED ? TileDesc::of(v_tile, 16, 1024)
                                                     : TileDesc::of(v_tile, BN * 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::K_PV; ++kk) {
      if constexpr (Tr::Format::V_TRANSPOSED) {
        wgmma_rs<Elem, HD>(acc_o[0], p[kk], v_desc.at((kk >> 2) * (HD * 128) + (kk & 3) * 32), 1);
      } else {
        wgmma_rs<Elem, HD>(acc_o[0], p[kk], v_desc.at(kk * 2048), 1);
      }
    }
    wgmma_commit();
  }
  // ... and, once it has been waited for, acc_o may be read again and p written.
  __device__ __forceinline__ void pv_done(unsigned (&p)[Tr::K_PV][4]) {
    fence_accumulators(acc_o[0]);
    // The A registers are read by the tensor cores until the wait: keep them alive until here.
    fence_fragments(p);
  }
  // p's values computed by this point (and kept until it)
  static __device__ __forceinline__ void fence_fragments(unsigned (&p)[Tr::K_PV][4]) {
#pragma unroll
    for (int kk = 0; kk < Tr::K_PV; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(p[kk][e])::"memory");
  }

  // The same steps one after the other (forward_sm90.cu).
  // P for key tile j (in shared memory at k_tile), as A fragments; acc_o rescaled.
  template <bool MASKED>
  __device__ __forceinline__ void probabilities(int j, const unsigned char* k_tile,
                                                unsigned (&p)[Tr::K_PV][4], const Mask& mask) {
    float s[1][Tr::NT_S][4];
    issue_scores(k_tile, s);
    wgmma_wait<0>();
    final_scores<MASKED>(j, s, mask);
    softmax.update(s, acc_o, scale_log2);  // s now holds P (unnormalised); acc_o rescaled
    to_a_fragments(s, p);
  }

  // O += P V_j.
  __device__ __forceinline__ void accumulate_pv(const unsigned char* v_tile,
                                                unsigned (&p)[Tr::K_PV][4]) {
    issue_pv(v_tile, p);
    wgmma_wait<0>();
    pv_done(p);
  }

  // Key tile j, which sits in pipeline stage `stage` (K and V stages KV_BYTES apart).
  template <bool MASKED>
  __device__ __forceinline__ void process_key_tile(int j, int stage, const Mask& mask) {
    unsigned p[Tr::K_PV][4];
    probabilities<MASKED>(j, sK + stage * Tr::KV_BYTES, p, mask);
    accumulate_pv(sV + stage * Tr::KV_BYTES, p);
  }
};

}  // namespace cuflash
