// backward_sm90_tma.cuh: what the warp-specialised Hopper backward kernels share
// (backward_sm90_tma.cu, backward_sm90_fused.cu): tile loads through the tensor maps of q, k, v and
// dO, and the producer's staging of lse2 and D.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "tma.cuh"
#include "backward_sm90.cuh"

namespace cuflash {

constexpr int TMA_BOX_ROWS = 64;  // rows of one TMA box (the host's tensor maps, cuflash/_tma.py)

// Copies rows [row0, row0 + ROWS) (all HD columns) of one head of a tensor map into a swizzled
// tile, completing on `bar`: ROWS / 64 x HD / 64 boxes.
template <int ROWS, int HD>
__device__ __forceinline__ void tma_load_tile(unsigned char* tile, const TensorMap* map,
                                              unsigned long long* bar, int row0, int head,
                                              int batch) {
#pragma unroll
  for (int c = 0; c < HD / 64; ++c)
#pragma unroll
    for (int rb = 0; rb < ROWS / TMA_BOX_ROWS; ++rb)
      tma_load_4d(tile + c * (ROWS * 128) + rb * (TMA_BOX_ROWS * 128), map, bar, 64 * c,
                  row0 + rb * TMA_BOX_ROWS, head, batch);
}

// The tensor maps of q, k, v and dO, read in boxes of 64 rows (cuflash/_tma.py).
struct BackwardMaps {
  TensorMap q, k, v, dout;
};

// Producer warp: stages lse2 and D of query rows [m0, m0 + ROWS) of head `head` of sequence `seq`,
// one row per lane.
template <int ROWS, bool PACKED>
__device__ __forceinline__ void stage_lse_and_delta(float* s_lse2, float* s_delta, const Params& p,
                                                    const Seq<PACKED>& seq, int head, int m0,
                                                    int lane) {
  const HeadRows<const float> lse = seq.template q_rows<const float>(p.lse, head);
  const HeadRows<const float> delta = seq.template q_rows<const float>(p.delta, head);
  const int nq = seq.nq(p);
#pragma unroll
  for (int r = lane; r < ROWS; r += 32) {
    const int row = m0 + r;
    s_lse2[r] = lse2_of_row(row < nq ? *lse.row(row) : 0.f, row < nq);
    s_delta[r] = row < nq ? *delta.row(row) : 0.f;
  }
}

// dK and dV of 64 keys shared by two warpgroups (HD = 256: each holds the dV and dK columns of its
// half of the head dim), the scores split between them rather than computed twice: warpgroup 0
// computes S^T = K Q_i^T, warpgroup 1 dP^T = V dO_i^T, each a 64 x BM product over the head dim
// (the same instruction on other tiles: a wgmma on one path only would serialise every wgmma).
// Then, through shared memory (exchange):
//   - warpgroup 0: P^T = exp2(S^T scale_log2 - lse2) (masked, modified) as A fragments (its dV)
//     and G = P^T ds'/ds (float32, fragment order; with a softcap also P^T into a swizzled tile,
//     stmatrix), in P_CHUNKS chunks of query columns: every thread arrives on the chunk's mbarrier
//     p_in[c] once it has stored the chunk;
//   - warpgroup 1: chunk by chunk, waits on p_in[c], then dS^T = G (dP^T - D) as A fragments (its
//     dK) and into a swizzled tile; P^T's fragments: G rounded (without a softcap G is P^T), else
//     from warpgroup 0's tile (ldmatrix); arrives on ds_in after the last chunk;
//   - warpgroup 0 waits on ds_in and loads dS^T's fragments from the tile.
//   The chunks let warpgroup 1's dS^T of one chunk run beside warpgroup 0's P^T of the next: the
//   exchange is a serial hand-off with no product in flight (docs/perf/NOTES.md, v43).
// Then each: dV += P^T dO_i, dK += dS^T Q_i on its columns (issue_grads). Half the score products
// of computing them in both warpgroups, and half their shared-memory reads. Single buffers:
// warpgroup 0 writes the next tile's G (and P^T) only after ds_in, which warpgroup 1 reaches after
// its reads; warpgroup 1 writes the next dS^T only after the next p_in, which warpgroup 0 reaches
// after its reads (the fused kernel gives it two dS^T tiles in turn: its dQ reads them after the
// step). mbarriers, every thread arriving: named barriers' arrive / sync, in the same order, made
// racecheck report hazards on every exchange.
// The exchange's mbarriers' bytes (cuflash/_kernels.py counts the same).
constexpr int EXCHANGE_BARRIER_BYTES = 32;
template <typename Elem, int HD, int BM, int BN, typename Mask, typename Mod>
struct Sm90DkdvKeysExchanged {
  static constexpr int COLS = HD / 2;  // the head-dim columns of dK and dV this warpgroup holds
  static_assert(BN == 64 && BM == 64 && HD == 256, "two warpgroups share 64 keys at d = 256");
  static constexpr int NT_Q = BM / 8, NT_D = COLS / 8;
  static constexpr bool PT_TILE = Mod::HAS_SOFTCAP;  // P^T through a tile (G is not P^T)
  static constexpr int TILE_BYTES = BN * BM * 2;     // P^T, dS^T (16-bit)
  static constexpr int G_BYTES = BN * BM * 4;
  static constexpr int P_CHUNKS = 2, NT_CHUNK = NT_Q / P_CHUNKS, KK_CHUNK = NT_CHUNK / 2;
  static_assert(NT_Q % (2 * P_CHUNKS) == 0, "whole k16 steps a chunk");
  // The exchange area: G, the mbarriers p_in[P_CHUNKS] and ds_in (EXCHANGE_BARRIER_BYTES), then
  // (with a softcap) P^T's tile; dS^T's tile after them where the kernel has none of its own
  // (DS_TILE_BYTES).
  static_assert(8 * (P_CHUNKS + 1) <= EXCHANGE_BARRIER_BYTES, "the exchange's barriers");
  static constexpr int EXCHANGE_BYTES =
      G_BYTES + EXCHANGE_BARRIER_BYTES + (PT_TILE ? TILE_BYTES : 0);
  static constexpr int DS_TILE_BYTES = TILE_BYTES;
  const unsigned char *sK, *sV;
  unsigned char* sX;  // the exchange area
  int tiles;          // query tiles so far (the mbarriers' phases), set by the kernel
  int wg, lane;
  float scale_log2;
  int key0;  // this lane's key g in the sequence (its keys are g and g + 8)
  Mod mod;   // score modifiers of the current query head (score_mod.cuh), raw units
  float acc_dk[NT_D][4], acc_dv[NT_D][4];

  __device__ __forceinline__ int col0() const { return wg * COLS; }
  static __device__ __forceinline__ int key_row0(int warp_index) { return (warp_index & 3) * 16; }
  static __device__ __forceinline__ unsigned long long* barriers(unsigned char* exchange) {
    return reinterpret_cast<unsigned long long*>(exchange + G_BYTES);  // p_in[P_CHUNKS], ds_in
  }
  static __device__ __forceinline__ void init(unsigned char* exchange) {  // one thread
    for (int b = 0; b <= P_CHUNKS; ++b) mbar_init(barriers(exchange) + b, 128);
  }

  __device__ __forceinline__ void clear() { clear_dkdv(acc_dk, acc_dv); }

  typedef DkdvFrags<BM> Frags;

  // The address this lane gives stmatrix and ldmatrix for k16 step kk of a swizzled tile of BN
  // key rows (lane l: row l % 8 of 8 x 8 matrix l / 8; the matrices (keys +0, +8) x (queries
  // 16 kk, 16 kk + 8), an A fragment's four registers, as the fused kernel stores dS^T).
  __device__ __forceinline__ unsigned char* frag_rows(unsigned char* tile, int kk) const {
    const int mi = lane >> 3, row = key_row0(threadIdx.x >> 5) + (mi & 1) * 8 + (lane & 7);
    const int chunk = 2 * kk + (mi >> 1);
    return tile + (chunk >> 3) * (BN * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
  }

  // S^T (warpgroup 0) or dP^T (warpgroup 1) into x. No wait.
  __device__ __forceinline__ void issue_scores(float (&x)[NT_Q][4], const unsigned char* q_tile,
                                               const unsigned char* do_tile) {
    wgmma_fence();
    wgmma_abt_head_dim<Elem, HD, BN, BM>(x, wg == 0 ? sK : sV, 0, wg == 0 ? q_tile : do_tile);
    wgmma_commit();
  }

  // The exchange of query rows m0 .. (x complete): f gets P^T's and dS^T's fragments, ds_tile dS^T.
  // pad0: warpgroup 1 zeroes the dS^T rows of its warp from pad0 on (16: none). ASYNC: a wgmma
  // reads ds_tile later (the proxy fence).
  template <bool ASYNC>
  __device__ __forceinline__ void exchange(bool masked, int m0, float (&x)[NT_Q][4],
                                           const float* lse2, const float* dlt, const Mask& mask,
                                           Frags& f, unsigned char* ds_tile, int pad0) {
    float4* s_g = reinterpret_cast<float4*>(sX) + (threadIdx.x & 127);
    unsigned char* s_pt = sX + G_BYTES + EXCHANGE_BARRIER_BYTES;
    unsigned long long *p_in = barriers(sX), *ds_in = p_in + P_CHUNKS;
    const unsigned phase = tiles & 1;
    const int t = lane & 3;
    if (wg == 0) {
      Bounds queries[2];
      if (masked) queries[0] = mask.queries_of(key0), queries[1] = mask.queries_of(key0 + 8);
      const float key_pos[2] = {float(key0), float(key0 + 8)};
#pragma unroll
      for (int c = 0; c < P_CHUNKS; ++c) {
#pragma unroll
        for (int nt = c * NT_CHUNK; nt < (c + 1) * NT_CHUNK; ++nt) {
          float g[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qc = nt * 8 + 2 * t + (e & 1);  // query column within the tile
            float dcap;                               // ds'/ds of the softcap
            const float s = mod(x[nt][e], mod.row_pos(m0 + 2 * t + (e & 1)) + float(nt * 8),
                                key_pos[e >> 1], dcap);
            float p = fast_exp2(fmaf(s, scale_log2, -lse2[qc]));
            if (masked && Mask::query_hidden(m0 + qc, queries[e >> 1])) p = 0.f;
            x[nt][e] = p;
            g[e] = PT_TILE ? p * dcap : p;
          }
          s_g[nt * 128] = make_float4(g[0], g[1], g[2], g[3]);
        }
        // P^T's tile (a softcap) before the chunk's arrival: warpgroup 1 reads it with the chunk
#pragma unroll
        for (int kk = c * KK_CHUNK; kk < (c + 1) * KK_CHUNK; ++kk) {
          accum_to_a_frag<Elem>(f.pt[kk], x[2 * kk], x[2 * kk + 1]);
          if constexpr (PT_TILE)
            stmatrix_x4(frag_rows(s_pt, kk), f.pt[kk][0], f.pt[kk][1], f.pt[kk][2], f.pt[kk][3]);
        }
        mbar_arrive(p_in + c);
      }
      mbar_wait(ds_in, phase);
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) ldmatrix_x4(f.dst[kk], smem_addr(frag_rows(ds_tile, kk)));
    } else {
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        if (kk % KK_CHUNK == 0) mbar_wait(p_in + kk / KK_CHUNK, phase);
        float g[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int nt = 2 * kk + h;
          const float4 v = s_g[nt * 128];
          const float d0 = dlt[nt * 8 + 2 * t], d1 = dlt[nt * 8 + 2 * t + 1];
          g[h][0] = v.x, g[h][1] = v.y, g[h][2] = v.z, g[h][3] = v.w;
          x[nt][0] = v.x * (x[nt][0] - d0);
          x[nt][1] = v.y * (x[nt][1] - d1);
          x[nt][2] = v.z * (x[nt][2] - d0);
          x[nt][3] = v.w * (x[nt][3] - d1);
        }
        accum_to_a_frag<Elem>(f.dst[kk], x[2 * kk], x[2 * kk + 1]);
        stmatrix_x4(frag_rows(ds_tile, kk), f.dst[kk][0], f.dst[kk][1], f.dst[kk][2],
                    f.dst[kk][3]);
        if constexpr (PT_TILE) ldmatrix_x4(f.pt[kk], smem_addr(frag_rows(s_pt, kk)));
        else accum_to_a_frag<Elem>(f.pt[kk], g[0], g[1]);  // G is P^T
      }
      if (pad0 < 16) {  // rows of padding keys: zeros (whole rows, so no swizzle)
        __syncwarp();   // the warp's stmatrix before the zeros
        const int row0 = key_row0(threadIdx.x >> 5);
        constexpr int CHUNKS = BM / 8;  // 16-byte chunks of a row
#pragma unroll
        for (int i = lane; i < 16 * CHUNKS; i += 32) {
          const int r = i / CHUNKS, c = i % CHUNKS;
          if (r >= pad0)
            *reinterpret_cast<uint4*>(ds_tile + (c >> 3) * (BN * 128) + (row0 + r) * 128 +
                                      (c & 7) * 16) = make_uint4(0, 0, 0, 0);
        }
      }
      if constexpr (ASYNC) fence_proxy_async();
      mbar_arrive(ds_in);
    }
  }

  // dV += P^T dO_i, dK += dS^T Q_i on this warpgroup's columns. No wait; f must stay unmodified
  // until this group is complete.
  __device__ __forceinline__ void issue_grads(Frags& f, const unsigned char* q_tile,
                                              const unsigned char* do_tile) {
    const int cols = (col0() / 64) * (BM * 128);
    issue_dkdv<Elem, COLS, BM>(acc_dv, acc_dk, f, q_tile + cols, do_tile + cols);
  }

  // One query tile, every group waited for (the split kernel: dS^T's tile after the exchange
  // area).
  __device__ __forceinline__ void step(bool masked, int m0, const unsigned char* q_tile,
                                       const unsigned char* do_tile, const float* lse2,
                                       const float* dlt, const Mask& mask) {
    float x[NT_Q][4];  // warpgroup 0: S^T, then P^T; warpgroup 1: dP^T, then dS^T
    Frags f;
    issue_scores(x, q_tile, do_tile);
    wgmma_wait<0>();
    fence_accumulators(x);
    exchange<false>(masked, m0, x, lse2, dlt, mask, f, sX + EXCHANGE_BYTES, 16);
    issue_grads(f, q_tile, do_tile);
    dkdv_complete(acc_dv, acc_dk, f);
  }
};

// The consumers' steps of the dK/dV kernels (split and fused): Sm90DkdvKeys (64 keys a warpgroup,
// every column), or where two warpgroups share 64 keys (HD = 256) Sm90DkdvKeysExchanged.
// EXCHANGE_BYTES: their shared memory beside the kernel's tiles; DS_TILE_BYTES: dS^T's tile, for a
// kernel that has none of its own.
template <bool SHARED, typename Elem, int HD, int BM, int BN, typename Mask, typename Mod,
          bool ROWS_AFTER_WAIT = false>
struct DkdvKeysOf {
  typedef Sm90DkdvKeys<Elem, HD, BM, BN, Mask, Mod, ROWS_AFTER_WAIT> Type;
  static constexpr int EXCHANGE_BYTES = 0, DS_TILE_BYTES = 0;
};
template <typename Elem, int HD, int BM, int BN, typename Mask, typename Mod, bool ROWS_AFTER_WAIT>
struct DkdvKeysOf<true, Elem, HD, BM, BN, Mask, Mod, ROWS_AFTER_WAIT> {
  typedef Sm90DkdvKeysExchanged<Elem, HD, BM, BN, Mask, Mod> Type;
  static constexpr int EXCHANGE_BYTES = Type::EXCHANGE_BYTES, DS_TILE_BYTES = Type::DS_TILE_BYTES;
};

}  // namespace cuflash
