// backward_dkdv.cu: dK and dV on the tensor cores, one block of keys per thread block.
//
// The block holds its K_j and V_j tile and walks every query tile that can see it, for every query
// head of its group (grouped heads are summed here, not with atomics). Per query tile i:
//   S^T = K_j Q_i^T,  P^T = exp(scale S^T - lse)       (keys are rows, queries are columns)
//   dP^T = V_j dO_i^T, dS^T = P^T * (dP^T - D)
//   dV += P^T dO_i,    dK += dS^T Q_i
// Working on the transposes puts the keys on the rows, so each warp keeps P^T and dS^T in
// registers and feeds them straight into the next product. A warp owns 16 keys and HD / DSPLIT
// columns of dK and dV; with DSPLIT = 2 (large head dims) two warps share each 16 keys and both
// compute S^T and dP^T for them, which halves the accumulator registers per warp.
#include "common.cuh"
#include "mma.cuh"
#include "tile.cuh"
#include "params.cuh"
#include "features.cuh"
#include "gemm.cuh"
#include "repair.cuh"

namespace cuflash {

template <typename Elem_, int HD_, int BM_, int BN_, int NWARPS_, int DSPLIT_, int FEATURES>
struct DkdvTraits {
  typedef Elem_ Elem;
  typedef typename Features<FEATURES>::Mask Mask;
  typedef typename Features<FEATURES>::template ScoreMod<> ScoreMod;
  static constexpr int HD = HD_, BM = BM_, BN = BN_, NWARPS = NWARPS_, DSPLIT = DSPLIT_;
  static constexpr int NTHREADS = NWARPS * 32;
  static constexpr int PITCH = HD + 8;
  static constexpr int HD_WARP = HD / DSPLIT;  // dK / dV columns owned by one warp
  static constexpr int NT_Q = BM / 8;          // n8 tiles of S^T along the queries
  static constexpr int NT_DW = HD_WARP / 8;    // n8 tiles of a warp's dK / dV slice
  static constexpr int K_HD = HD / 16;         // k16 steps over the head dim
  static constexpr int K_BM = BM / 16;         // k16 steps over the queries
  static constexpr bool KV_IN_REGS = HD <= 64;
  static_assert(BN == 16 * (NWARPS / DSPLIT), "each warp owns 16 keys");
  static_assert(BM % 16 == 0 && HD_WARP % 16 == 0, "tiles are built from 16x16 fragments");
};

template <typename Tr>
struct DkdvBlock {
  typedef typename Tr::Elem Elem;
  static constexpr int NT_Q = Tr::NT_Q, PITCH = Tr::PITCH, FR = Tr::KV_IN_REGS ? 1 : 0;

  const unsigned short *sK, *sV;  // this warp's 16 rows of the K and V tiles
  unsigned short *sQ, *sdO;
  float *sLse2, *sDelta;
  typename Tr::Mask mask;
  typename Tr::ScoreMod mod;  // softcap, ALiBi of the current query head (score_mod.cuh)
  int n0, d, lane, key_row0, col0;
  bool vec;
  float scale_log2;

  float acc_dk[1][Tr::NT_DW][4];
  float acc_dv[1][Tr::NT_DW][4];
  unsigned k_frag[1][FR ? Tr::K_HD : 1][4];
  unsigned v_frag[1][FR ? Tr::K_HD : 1][4];

  // Stages Q_i, dO_i (cp.async) and lse_i (log2 units, +inf where P must be 0), D_i (plain loads).
  __device__ __forceinline__ void load_query_tile(const Rows& q, const Rows& dout,
                                                  const HeadRows<const float>& lse,
                                                  const HeadRows<const float>& delta, int m0) {
    const int nq = mask.nq;
    load_tile<Tr::BM, Tr::HD, PITCH, Tr::NTHREADS>(sQ, q.head, q.stride, m0, nq, d, vec);
    load_tile<Tr::BM, Tr::HD, PITCH, Tr::NTHREADS>(sdO, dout.head, dout.stride, m0, nq, d, vec);
    cp_async_commit();
    for (int r = threadIdx.x; r < Tr::BM; r += Tr::NTHREADS) {
      const int row = m0 + r;
      float l = inf_f32(), dl = 0.f;
      if (row < nq) {
        l = *lse.row(row);
        l = (l == -inf_f32()) ? inf_f32() : l * 1.4426950408889634f;
        dl = *delta.row(row);
      }
      sLse2[r] = l;
      sDelta[r] = dl;
    }
  }

  template <bool MASKED>
  __device__ __forceinline__ void process_query_tile(int m0) {
    const int g = lane >> 2, t = lane & 3;
    float st[1][NT_Q][4], dpt[1][NT_Q][4];
    fill(st, 0.f);
    fill(dpt, 0.f);
    if constexpr (FR) {
      gemm_abt<Elem, 1, NT_Q, Tr::K_HD, PITCH>(st, k_frag, sQ, lane);    // S^T = K Q_i^T
      gemm_abt<Elem, 1, NT_Q, Tr::K_HD, PITCH>(dpt, v_frag, sdO, lane);  // dP^T = V dO_i^T
    } else {
      gemm_abt<Elem, 1, NT_Q, Tr::K_HD, PITCH, PITCH>(st, sK, sQ, lane);
      gemm_abt<Elem, 1, NT_Q, Tr::K_HD, PITCH, PITCH>(dpt, sV, sdO, lane);
    }
#pragma unroll
    for (int nt = 0; nt < NT_Q; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1);  // query column within the tile
        const int key = n0 + key_row0 + g + ((e >> 1) << 3);
        float dcap;  // ds'/ds of the softcap
        const float s = mod(st[0][nt][e], mod.row_pos(m0 + 2 * t + (e & 1)) + float(nt * 8),
                            float(key), dcap);
        float p = fast_exp2(fmaf(s, scale_log2, -sLse2[qc]));
        if constexpr (MASKED) {
          if (!mask.visible(m0 + qc, key)) p = 0.f;
        }
        st[0][nt][e] = p;                                         // P^T
        dpt[0][nt][e] = p * (dpt[0][nt][e] - sDelta[qc]) * dcap;  // dS^T
      }
    gemm_pb<Elem, 1, Tr::NT_DW, Tr::K_BM, PITCH>(acc_dv, st, sdO + col0, lane);  // dV += P^T dO_i
    gemm_pb<Elem, 1, Tr::NT_DW, Tr::K_BM, PITCH>(acc_dk, dpt, sQ + col0, lane);  // dK += dS^T Q_i
  }
};

template <typename Elem, int HD, int BM, int BN, int NWARPS, int DSPLIT, int FEATURES>
__global__ void __launch_bounds__(NWARPS * 32, Features<FEATURES>::MMA_MIN_BLOCKS)
    attention_backward_dkdv_mma(const __grid_constant__ Params p) {
  typedef DkdvTraits<Elem, HD, BM, BN, NWARPS, DSPLIT, FEATURES> Tr;
  constexpr int PITCH = Tr::PITCH;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned short* sK = reinterpret_cast<unsigned short*>(smem_raw);
  unsigned short* sV = sK + BN * PITCH;

  const BlockCoords bc = decode_block(p.heads_kv, p.num_blocks);  // bc.head is the key/value head
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  const Seq<PACKED> seq = Seq<PACKED>::of(p, bc.batch);
  const int nk = seq.nk(p), d = p.head_dim;
  if (PACKED && bc.block * BN >= nk) return;  // past this sequence's keys

  DkdvBlock<Tr> blk;
  blk.key_row0 = (warp % (NWARPS / DSPLIT)) * 16;
  blk.col0 = (warp / (NWARPS / DSPLIT)) * Tr::HD_WARP;
  blk.sK = sK + blk.key_row0 * PITCH;
  blk.sV = sV + blk.key_row0 * PITCH;
  blk.sQ = sV + BN * PITCH;
  blk.sdO = blk.sQ + BM * PITCH;
  blk.sLse2 = reinterpret_cast<float*>(blk.sdO + BM * PITCH);
  blk.sDelta = blk.sLse2 + BM;
  blk.mask = Tr::Mask::of(p, seq.ext);
  blk.n0 = bc.block * BN;
  blk.d = d;
  blk.lane = lane;
  blk.vec = p.vec != 0;
  blk.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  fill(blk.acc_dk, 0.f);
  fill(blk.acc_dv, 0.f);

  load_tile<BN, HD, PITCH, Tr::NTHREADS>(sK, seq.template k_head<const unsigned short>(p.k, bc.head),
                                         p.k.seq, blk.n0, nk, d, blk.vec);
  load_tile<BN, HD, PITCH, Tr::NTHREADS>(sV, seq.template k_head<const unsigned short>(p.v, bc.head),
                                         p.v.seq, blk.n0, nk, d, blk.vec);

  // The work list: every (query head of the group, query tile that sees these keys).
  // The range is recomputed where a step needs it: held through the loop, it took the registers
  // that the d = 32 instance then spilled (sm_80).
  auto query_tiles = [&] { return blk.mask.query_tiles(blk.n0, BN, BM); };
  const int num_steps = p.group * query_tiles().count();
  const int masked_steps = masked_query_steps(query_tiles(), p.group);
  auto load_step = [&](int step) {
    const QueryStep at = query_step_at(step, query_tiles(), p.group);
    const int head = bc.head * p.group + at.head;
    blk.load_query_tile(seq.template q_rows<const unsigned short>(p.q, head),
                        seq.template q_rows<const unsigned short>(p.dout, head),
                        seq.template q_rows<const float>(p.lse, head),
                        seq.template q_rows<const float>(p.delta, head), at.tile * BM);
  };
  if (num_steps > 0) load_step(0);
  cp_async_commit();

  // Masked tiles first; rows that they made non-finite are flagged and recomputed at the end
  // (repair.cuh).
  unsigned repair = 0;
  for (int step = 0; step < num_steps; ++step) {
    cp_async_wait<0>();
    __syncthreads();  // Q_i, dO_i, lse_i, D_i (and K, V on the first step) are in shared memory
    if constexpr (Tr::KV_IN_REGS) {
      if (step == 0) {
        load_a_frags<1, Tr::K_HD, PITCH>(blk.k_frag, blk.sK, lane);
        load_a_frags<1, Tr::K_HD, PITCH>(blk.v_frag, blk.sV, lane);
      }
    }
    const QueryStep at = query_step_at(step, query_tiles(), p.group);
    if constexpr (Tr::ScoreMod::ANY)
      blk.mod = Tr::ScoreMod::of(p, bc.batch, bc.head * p.group + at.head,
                                 static_cast<float>(p.scale), seq.ext);
    if (step < masked_steps)
      blk.template process_query_tile<true>(at.tile * BM);
    else
      blk.template process_query_tile<false>(at.tile * BM);
    if (step + 1 < num_steps) {
      __syncthreads();  // every warp is done with Q_i, dO_i, lse_i, D_i
      load_step(step + 1);
    }
    if (step == masked_steps - 1) repair = nonfinite_rows(blk.acc_dk[0], blk.acc_dv[0]);
  }

  // Epilogue: dK = scale * acc_dk and dV, staged through the K and V tiles.
  const float scale = static_cast<float>(p.scale);
  cp_async_wait<0>();
  __syncthreads();
  stage_accumulators<Elem, 1, Tr::NT_DW, PITCH>(sK + blk.key_row0 * PITCH + blk.col0, blk.acc_dk,
                                                scale, lane);
  stage_accumulators<Elem, 1, Tr::NT_DW, PITCH>(sV + blk.key_row0 * PITCH + blk.col0, blk.acc_dv,
                                                1.f, lane);
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
    __syncwarp();
    recompute_dkdv_rows<Elem, HD, Tr::HD_WARP, typename Tr::ScoreMod>(sK + blk.key_row0 * PITCH, sV + blk.key_row0 * PITCH,
                                               PITCH, Tr::HD_WARP, repair, scale, blk.scale_log2, p,
                                               seq, bc.head,
                                               seq.template k_rows<const unsigned short>(p.k, bc.head),
                                               seq.template k_rows<const unsigned short>(p.v, bc.head),
                                               blk.n0 + blk.key_row0, blk.col0, blk.mask, lane);
  }
  __syncthreads();
  store_tile<BN, HD, PITCH, Tr::NTHREADS>(seq.template k_head<unsigned short>(p.dk, bc.head), sK,
                                          p.dk.seq, blk.n0, nk, d, blk.vec);
  store_tile<BN, HD, PITCH, Tr::NTHREADS>(seq.template k_head<unsigned short>(p.dv, bc.head), sV,
                                          p.dv.seq, blk.n0, nk, d, blk.vec);
}

}  // namespace cuflash
