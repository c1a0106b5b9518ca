// backward_dq.cu: dQ = scale * dS K on the tensor cores, one block of query rows per thread block.
//
// Per key tile j (same visible range as the forward pass):
//   S = Q K_j^T,  P = exp(scale S - lse)   (recomputed from the saved lse, never stored)
//   dP = dO V_j^T,  dS = P * (dP - D)
//   dQ += dS K_j
// Each warp owns MT 16-row m tiles; S, P, dP and dS stay in registers. No atomics: dQ is written
// once, so the result is bitwise deterministic.
#include "common.cuh"
#include "mma.cuh"
#include "tile.cuh"
#include "params.cuh"
#include "features.cuh"
#include "gemm.cuh"
#include "repair.cuh"

namespace cuflash {

template <typename Elem_, int HD_, int BM_, int BN_, int NWARPS_, int FEATURES>
struct DqTraits {
  typedef Elem_ Elem;
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> ScoreMod;
  typedef cuflash::Extents<Features<FEATURES>::PACKED> Extents;
  static constexpr bool PACKED = Features<FEATURES>::PACKED;
  static constexpr int HD = HD_, BM = BM_, BN = BN_, NWARPS = NWARPS_;
  static constexpr int NTHREADS = NWARPS * 32;
  static constexpr int MT = BM / (16 * NWARPS);
  static constexpr int PITCH = HD + 8;
  static constexpr int NT_S = BN / 8;   // n8 tiles of S and dP
  static constexpr int NT_D = HD / 8;   // n8 tiles of dQ
  static constexpr int K_HD = HD / 16;  // k16 steps over the head dim
  static constexpr int K_BN = BN / 16;  // k16 steps over the keys
  static constexpr bool QDO_IN_REGS = MT * HD <= 64;
  static_assert(BM % (16 * NWARPS) == 0, "BM must give each warp whole 16-row tiles");
  static_assert(BN % 16 == 0 && HD % 16 == 0, "tiles are built from 16x16 fragments");
};

template <typename Tr>
struct DqBlock {
  typedef typename Tr::Elem Elem;
  static constexpr int MT = Tr::MT, NT_S = Tr::NT_S, PITCH = Tr::PITCH, FR = Tr::QDO_IN_REGS ? 1 : 0;

  const unsigned short *sQ, *sdO;  // this warp's first row of the Q and dO tiles
  unsigned short *sK, *sV;
  const unsigned short *k_head, *v_head;  // the rest of what a tile needs is read from Params
  int m0, lane, warp_row0;
  float scale_log2;
  typename Tr::ScoreMod mod;  // softcap, ALiBi (score_mod.cuh), in raw units

  float lse2[MT][2];   // lse * log2(e) of rows g, g + 8 (+inf for a row that sees no key)
  float delta[MT][2];  // D of the same rows
  float acc_dq[MT][Tr::NT_D][4];
  unsigned q_frag[FR ? MT : 1][FR ? Tr::K_HD : 1][4];
  unsigned do_frag[FR ? MT : 1][FR ? Tr::K_HD : 1][4];

  // P = exp(scale S - lse), 0 where the key is invisible, times ds'/ds of the softcap (1 without):
  // this kernel uses P only in dS = P (dP - D), so the tanh's derivative joins it here.
  template <bool MASKED>
  __device__ __forceinline__ void probabilities(float (&s)[MT][NT_S][4], int n0, const Params& p,
                                                const typename Tr::Extents& ext) const {
    const typename Tr::Mask mask = Tr::Mask::of(p, ext);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = m0 + warp_row0 + mt * 16 + g + ((e >> 1) << 3);
          const int j = n0 + nt * 8 + 2 * t + (e & 1);
          float dcap;
          const float sm = mod(s[mt][nt][e], mod.row_pos(i),
                               float(n0 + 2 * t + (e & 1)) + float(nt * 8), dcap);
          float pr = fast_exp2(fmaf(sm, scale_log2, -lse2[mt][e >> 1]));
          if constexpr (MASKED) {
            if (!mask.visible(i, j)) pr = 0.f;
          }
          s[mt][nt][e] = pr * dcap;
        }
  }

  // Key tile j (already in flight); j_next is the tile visited next (-1 after the last).
  template <bool MASKED>
  __device__ __forceinline__ void process_key_tile(int j, int j_next, bool first, const Params& p,
                                                   const typename Tr::Extents& ext) {
    cp_async_wait<0>();
    __syncthreads();  // K_j and V_j have landed
    if constexpr (FR) {
      if (first) {
        load_a_frags<MT, Tr::K_HD, PITCH>(q_frag, sQ, lane);
        load_a_frags<MT, Tr::K_HD, PITCH>(do_frag, sdO, lane);
      }
    }
    float s[MT][NT_S][4], dp[MT][NT_S][4];
    fill(s, 0.f);
    fill(dp, 0.f);
    if constexpr (FR) {
      gemm_abt<Elem, MT, NT_S, Tr::K_HD, PITCH>(s, q_frag, sK, lane);    // S = Q K_j^T
      gemm_abt<Elem, MT, NT_S, Tr::K_HD, PITCH>(dp, do_frag, sV, lane);  // dP = dO V_j^T
    } else {
      gemm_abt<Elem, MT, NT_S, Tr::K_HD, PITCH, PITCH>(s, sQ, sK, lane);
      gemm_abt<Elem, MT, NT_S, Tr::K_HD, PITCH, PITCH>(dp, sdO, sV, lane);
    }
    probabilities<MASKED>(s, j * Tr::BN, p, ext);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)  // dS = P * (dP - D), in place of dP
#pragma unroll
      for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[mt][nt][e] = s[mt][nt][e] * (dp[mt][nt][e] - delta[mt][e >> 1]);
    gemm_pb<Elem, MT, Tr::NT_D, Tr::K_BN, PITCH>(acc_dq, dp, sK, lane);  // dQ += dS K_j
    if (j_next >= 0) {
      __syncthreads();  // every warp is done with K_j and V_j
      const int n1 = j_next * Tr::BN;
      load_tile<Tr::BN, Tr::HD, PITCH, Tr::NTHREADS>(sK, k_head, p.k.seq, n1, ext.nk(p), p.head_dim,
                                                    p.vec != 0);
      load_tile<Tr::BN, Tr::HD, PITCH, Tr::NTHREADS>(sV, v_head, p.v.seq, n1, ext.nk(p), p.head_dim,
                                                    p.vec != 0);
      cp_async_commit();
    }
  }
};

template <typename Elem, int HD, int BM, int BN, int NWARPS, int FEATURES>
__global__ void __launch_bounds__(NWARPS * 32, Features<FEATURES>::MMA_MIN_BLOCKS)
    attention_backward_dq_mma(const __grid_constant__ Params p) {
  typedef DqTraits<Elem, HD, BM, BN, NWARPS, FEATURES> Tr;
  constexpr int MT = Tr::MT, PITCH = Tr::PITCH;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned short* sQ = reinterpret_cast<unsigned short*>(smem_raw);
  unsigned short* sdO = sQ + BM * PITCH;

  const BlockCoords bc = decode_block(p.heads_q, p.num_blocks);
  const int kv_head = bc.head / p.group;
  const int lane = threadIdx.x & 31;
  const Seq<Tr::PACKED> seq = Seq<Tr::PACKED>::of(p, bc.batch);
  const int nq = seq.nq(p), nk = seq.nk(p), d = p.head_dim;
  if (Tr::PACKED && bc.block * BM >= nq) return;  // past this sequence's rows

  DqBlock<Tr> blk;
  blk.warp_row0 = (threadIdx.x >> 5) * MT * 16;
  blk.sQ = sQ + blk.warp_row0 * PITCH;
  blk.sdO = sdO + blk.warp_row0 * PITCH;
  blk.sK = sdO + BM * PITCH;
  blk.sV = blk.sK + BN * PITCH;
  blk.k_head = seq.template k_head<const unsigned short>(p.k, kv_head);
  blk.v_head = seq.template k_head<const unsigned short>(p.v, kv_head);
  blk.m0 = bc.block * BM;
  blk.lane = lane;
  blk.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  blk.mod = Tr::ScoreMod::of(p, bc.batch, bc.head, static_cast<float>(p.scale), seq.ext);
  fill(blk.acc_dq, 0.f);

  // This lane's rows: lse in log2 units (a row that sees no key has lse = -inf: use +inf so that
  // P = 0 instead of exp(inf)), and D. Padded rows get P = 0 and D = 0.
  {
    const HeadRows<const float> lse = seq.template q_rows<const float>(p.lse, bc.head);
    const HeadRows<const float> delta = seq.template q_rows<const float>(p.delta, bc.head);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = blk.m0 + blk.warp_row0 + mt * 16 + (lane >> 2) + 8 * r;
      float l = inf_f32(), dl = 0.f;
      if (row < nq) {
        l = *lse.row(row);
        l = (l == -inf_f32()) ? inf_f32() : l * 1.4426950408889634f;
        dl = *delta.row(row);
      }
      blk.lse2[mt][r] = l;
      blk.delta[mt][r] = dl;
    }
  }

  const TileRange tiles = Tr::Mask::of(p, seq.ext).key_tiles(blk.m0, BM, BN);
  const bool vec = p.vec != 0;
  load_tile<BM, HD, PITCH, Tr::NTHREADS>(sQ, seq.template q_head<const unsigned short>(p.q, bc.head),
                                         p.q.seq, blk.m0, nq, d, vec);
  load_tile<BM, HD, PITCH, Tr::NTHREADS>(sdO,
                                         seq.template q_head<const unsigned short>(p.dout, bc.head),
                                         p.dout.seq, blk.m0, nq, d, vec);
  if (tiles.count() > 0) {
    const int first = tiles.at(0) * BN;
    load_tile<BN, HD, PITCH, Tr::NTHREADS>(blk.sK, blk.k_head, p.k.seq, first, nk, d, vec);
    load_tile<BN, HD, PITCH, Tr::NTHREADS>(blk.sV, blk.v_head, p.v.seq, first, nk, d, vec);
  }
  cp_async_commit();

  // Masked tiles first (mask.cuh, TileRange::at), then the unmasked ones. Rows that the masked
  // tiles made non-finite are flagged and recomputed at the end (repair.cuh).
  const int masked = tiles.masked(), count = tiles.count();
  int it = 0;
  for (; it < masked; ++it)
    blk.template process_key_tile<true>(tiles.at(it), tiles.at(it + 1), it == 0, p, seq.ext);
  // The flags wait in the padding columns of this lane's row g of the Q tile (repair.cuh).
  const FlagSlot flags = padding_flag_slot(sQ + (blk.warp_row0 + (lane >> 2)) * PITCH, HD, lane);
  if (masked > 0) park_flags(flags, nonfinite_rows(blk.acc_dq));
  for (; it < count; ++it)
    blk.template process_key_tile<false>(tiles.at(it), tiles.at(it + 1), it == 0, p, seq.ext);
  const unsigned repair = masked > 0 ? unpark_flags(flags) : 0u;

  // Epilogue: dQ = scale * acc, staged through this warp's rows of the Q tile.
  const float scale = static_cast<float>(p.scale);
  cp_async_wait<0>();
  __syncthreads();
  unsigned short* stage = sQ + blk.warp_row0 * PITCH;
  stage_accumulators<Elem, MT, Tr::NT_D, PITCH>(stage, blk.acc_dq, scale, lane);
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
    __syncwarp();
    recompute_dq_rows<Elem, HD, MT>(
        stage, PITCH, HD, repair, scale, blk.scale_log2,
        seq.template q_rows<const unsigned short>(p.q, bc.head),
        seq.template q_rows<const unsigned short>(p.dout, bc.head), Rows{blk.k_head, p.k.seq},
        Rows{blk.v_head, p.v.seq}, seq.template q_rows<const float>(p.lse, bc.head),
        seq.template q_rows<const float>(p.delta, bc.head), blk.m0 + blk.warp_row0,
        Tr::Mask::of(p, seq.ext), blk.mod, d, lane);
  }
  __syncthreads();
  unsigned short* dq_head = seq.template q_head<unsigned short>(p.dq, bc.head);
  store_tile<BM, HD, PITCH, Tr::NTHREADS>(dq_head, sQ, p.dq.seq, blk.m0, nq, d, vec);
}

}  // namespace cuflash
