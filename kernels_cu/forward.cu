// forward.cu: the FlashAttention-2 forward pass on the tensor cores (float16 / bfloat16 operands,
// float32 accumulation). Writes O and the logsumexp lse.
//
// One thread block owns BM query rows of one (batch, head); each warp owns MT 16-row m tiles of
// them. The block walks the key/value tiles of BN keys: K_j and V_j are staged in shared memory
// with cp.async (V_j streams in while S = Q K_j^T is computed, K_{j+1} while O += P V_j is), the
// scores and probabilities never leave registers, and the output is normalised once at the end.
#include "common.cuh"
#include "mma.cuh"
#include "tile.cuh"
#include "params.cuh"
#include "features.cuh"
#include "softmax.cuh"
#include "gemm.cuh"
#include "repair.cuh"

namespace cuflash {

// Compile-time shape of one forward configuration (the Python side picks BM, BN, NWARPS).
template <typename Elem_, int HD_, int BM_, int BN_, int NWARPS_, int FEATURES>
struct ForwardTraits {
  typedef Elem_ Elem;
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> ScoreMod;
  static constexpr bool PACKED = Features<FEATURES>::PACKED;
  static constexpr int HD = HD_, BM = BM_, BN = BN_, NWARPS = NWARPS_;
  static constexpr int NTHREADS = NWARPS * 32;
  static constexpr int MT = BM / (16 * NWARPS);  // 16-row m tiles per warp
  static constexpr int PITCH = HD + 8;            // +16 bytes a row: conflict-free ldmatrix
  static constexpr int NT_S = BN / 8;             // n8 tiles of a score tile
  static constexpr int NT_O = HD / 8;             // n8 tiles of the output accumulator
  static constexpr int K_QK = HD / 16;            // k16 steps of Q K^T
  static constexpr int K_PV = BN / 16;            // k16 steps of P V
  static constexpr bool Q_IN_REGS = MT * HD <= 64;
  static_assert(BM % (16 * NWARPS) == 0, "BM must give each warp whole 16-row tiles");
  static_assert(BN % 16 == 0 && HD % 16 == 0, "tiles are built from 16x16 fragments");
};

template <typename Tr>
struct ForwardBlock {
  typedef typename Tr::Elem Elem;
  static constexpr int MT = Tr::MT, NT_S = Tr::NT_S, NT_O = Tr::NT_O, PITCH = Tr::PITCH;

  typedef typename Tr::Mask Mask;
  unsigned short *sQ, *sK, *sV;  // sQ points at this warp's first row
  Rows k_rows, v_rows;
  Mask mask;
  typename Tr::ScoreMod mod;  // softcap, ALiBi (score_mod.cuh), in raw units
  int m0, d, lane, warp_row0;
  bool vec;
  float scale_log2;

  float acc_o[MT][NT_O][4];  // unnormalised O of this warp's rows
  unsigned q_frag[Tr::Q_IN_REGS ? MT : 1][Tr::Q_IN_REGS ? Tr::K_QK : 1][4];
  OnlineSoftmax<MT> softmax;

  // S = Q K_j^T for this warp's rows (raw scores: the scale is applied in the softmax).
  __device__ __forceinline__ void scores_tile(float (&s)[MT][NT_S][4]) const {
    fill(s, 0.f);
    if constexpr (Tr::Q_IN_REGS) {
      gemm_abt<Elem, MT, NT_S, Tr::K_QK, PITCH>(s, q_frag, sK, lane);
    } else {
      gemm_abt<Elem, MT, NT_S, Tr::K_QK, PITCH, PITCH>(s, sQ, sK, lane);
    }
  }

  // S_ij = -inf where query i may not see key j (outside its band, keys past the end).
  __device__ __forceinline__ void apply_mask(float (&s)[MT][NT_S][4], int n0) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = m0 + warp_row0 + mt * 16 + g + ((e >> 1) << 3);
          const int j = n0 + nt * 8 + 2 * t + (e & 1);
          if (!mask.visible(i, j)) s[mt][nt][e] = -inf_f32();
        }
  }

  // One key/value tile: the loop body of the forward pass. K_j is already in flight; j_next is
  // the tile visited next (-1 after the last), `first` marks the first visit.
  template <bool MASKED>
  __device__ __forceinline__ void process_key_tile(int j, int j_next, bool first) {
    cp_async_wait<0>();
    __syncthreads();  // K_j (and Q, on the first tile) have landed; the previous V is no longer read
    load_tile<Tr::BN, Tr::HD, PITCH, Tr::NTHREADS>(sV, v_rows.head, v_rows.stride, j * Tr::BN, mask.nk,
                                                  d, vec);
    cp_async_commit();
    if constexpr (Tr::Q_IN_REGS) {
      if (first) load_a_frags<MT, Tr::K_QK, PITCH>(q_frag, sQ, lane);
    }
    float s[MT][NT_S][4];
    scores_tile(s);
    mod.apply(s, m0 + warp_row0 + (lane >> 2), j * Tr::BN + 2 * (lane & 3));
    if constexpr (MASKED) apply_mask(s, j * Tr::BN);
    softmax.update(s, acc_o, scale_log2);  // s now holds P (unnormalised)
    cp_async_wait<0>();
    __syncthreads();  // V_j has landed; every warp is done with K_j
    if (j_next >= 0) {
      load_tile<Tr::BN, Tr::HD, PITCH, Tr::NTHREADS>(sK, k_rows.head, k_rows.stride, j_next * Tr::BN,
                                                    mask.nk, d, vec);
      cp_async_commit();
    }
    gemm_pb<Elem, MT, NT_O, Tr::K_PV, PITCH>(acc_o, s, sV, lane);  // O += P V_j
  }
};

template <typename Elem, int HD, int BM, int BN, int NWARPS, int FEATURES>
__global__ void __launch_bounds__(NWARPS * 32, Features<FEATURES>::MMA_MIN_BLOCKS)
    attention_forward_mma(const __grid_constant__ Params p) {
  typedef ForwardTraits<Elem, HD, BM, BN, NWARPS, FEATURES> Tr;
  constexpr int MT = Tr::MT, PITCH = Tr::PITCH;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned short* sQ = reinterpret_cast<unsigned short*>(smem_raw);

  const BlockCoords bc = decode_block(p.heads_q, p.num_blocks);
  const int kv_head = bc.head / p.group;
  const int lane = threadIdx.x & 31;
  const Seq<Tr::PACKED> seq = Seq<Tr::PACKED>::of(p, bc.batch);
  const int nq = seq.nq(p), nk = seq.nk(p), d = p.head_dim;
  if (Tr::PACKED && bc.block * BM >= nq) return;  // past this sequence's rows

  ForwardBlock<Tr> blk;
  blk.warp_row0 = (threadIdx.x >> 5) * MT * 16;
  blk.sQ = sQ + blk.warp_row0 * PITCH;
  blk.sK = sQ + BM * PITCH;
  blk.sV = blk.sK + BN * PITCH;
  blk.k_rows = seq.template k_rows<const unsigned short>(p.k, kv_head);
  blk.v_rows = seq.template k_rows<const unsigned short>(p.v, kv_head);
  blk.mask = Tr::Mask::of(p, seq.ext);
  blk.m0 = bc.block * BM;
  blk.d = d;
  blk.lane = lane;
  blk.vec = p.vec != 0;
  blk.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  blk.mod = Tr::ScoreMod::of(p, bc.batch, bc.head, static_cast<float>(p.scale), seq.ext);
  fill(blk.acc_o, 0.f);
  // p_shift: P is scaled by 2^-p_shift so that the unnormalised accumulator cannot overflow
  // (softmax.cuh); the host passes ceil(log2 Nk) for bfloat16 and 0 for float16. A kernel
  // argument, it is read from the constant bank and costs no register.
  blk.softmax.init(p.p_shift);

  // Q tile and the first K tile; everything after this runs tile by tile.
  const TileRange tiles = blk.mask.key_tiles(blk.m0, BM, BN);
  load_tile<BM, HD, PITCH, Tr::NTHREADS>(sQ, seq.template q_head<const unsigned short>(p.q, bc.head),
                                         p.q.seq, blk.m0, nq, d, blk.vec);
  if (tiles.count() > 0)
    load_tile<BN, HD, PITCH, Tr::NTHREADS>(blk.sK, blk.k_rows.head, blk.k_rows.stride,
                                           tiles.at(0) * BN, nk, d, blk.vec);
  cp_async_commit();

  // The few tiles that straddle the mask's bounds or the end of the keys first, then the unmasked
  // ones. Rows that the masked tiles made non-finite are flagged and recomputed at the end
  // (repair.cuh): a NaN or Inf in v must not reach the rows that do not see it.
  const int masked = tiles.masked(), count = tiles.count();
  int it = 0;
  for (; it < masked; ++it)
    blk.template process_key_tile<true>(tiles.at(it), tiles.at(it + 1), it == 0);
  float* lse_row_g = seq.template q_head<float>(p.lse, bc.head) +
                     (blk.m0 + blk.warp_row0 + (lane >> 2)) * p.lse.seq;
  const bool real_row_g = blk.m0 + blk.warp_row0 + (lane >> 2) < nq;
  if (masked > 0) park_flags(lse_flag_slot(lse_row_g, real_row_g, lane), nonfinite_rows(blk.acc_o));
  for (; it < count; ++it)
    blk.template process_key_tile<false>(tiles.at(it), tiles.at(it + 1), it == 0);

  // Epilogue: normalise once, stage O through shared memory, store with wide writes.
  float lse_rows[MT][2];
  blk.softmax.finalize(blk.acc_o, blk.scale_log2, lse_rows);
  cp_async_wait<0>();
  __syncthreads();  // no copy into sQ is in flight and no warp still reads it
  stage_accumulators<Elem, MT, Tr::NT_O, PITCH>(blk.sQ, blk.acc_o, 1.f, lane);
  const unsigned repair = masked > 0 ? unpark_flags(lse_flag_slot(lse_row_g, real_row_g, lane)) : 0u;
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
    __syncwarp();
    recompute_forward_rows<Elem, HD, MT>(blk.sQ, PITCH, HD, repair, lse_rows, blk.scale_log2,
                                         seq.template q_rows<const unsigned short>(p.q, bc.head),
                                         blk.k_rows, blk.v_rows, blk.m0 + blk.warp_row0, blk.mask,
                                         blk.mod, d, lane);
  }
  __syncthreads();
  unsigned short* o_head = seq.template q_head<unsigned short>(p.o, bc.head);
  store_tile<BM, HD, PITCH, Tr::NTHREADS>(o_head, sQ, p.o.seq, blk.m0, nq, d, blk.vec);
  if ((lane & 3) == 0) {
    float* lse_head = seq.template q_head<float>(p.lse, bc.head);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = blk.m0 + blk.warp_row0 + mt * 16 + (lane >> 2) + 8 * r;
        if (row < nq) lse_head[row * p.lse.seq] = lse_rows[mt][r];
      }
  }
}

}  // namespace cuflash
