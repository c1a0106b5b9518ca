// forward_sm90.cu: the FlashAttention-2 forward pass on Hopper's warpgroup tensor cores (sm_90a:
// wgmma.mma_async, float16 / bfloat16 operands, float32 accumulation). Same contract as
// forward.cu: writes O and lse, any Nq, Nk, d <= HD, the mask of mask.cuh, grouped heads, strides.
//
// One thread block owns BM = 64 * WARPGROUPS query rows of one (batch, head); each warpgroup owns
// 64 of them (the loop body is forward_sm90.cuh). Q stays in shared memory (wgmma reads its A
// operand from there); K_j and V_j stream through two shared-memory stages with cp.async issued by
// every thread, so tile j + 1 loads while tile j is computed, with one block-wide barrier per
// tile. It reads any strides and head dim; where the TMA unit can read the inputs (16-byte
// aligned rows), forward_sm90_tma.cu runs instead.
#include "common.cuh"
#include "mma.cuh"
#include "tile.cuh"
#include "params.cuh"
#include "features.cuh"
#include "gemm.cuh"
#include "wgmma.cuh"
#include "repair.cuh"
#include "forward_sm90.cuh"

namespace cuflash {

template <typename Elem, int HD, int BM, int BN, int FEATURES>
__global__ void __launch_bounds__(BM * 2, 1)
    attention_forward_wgmma(const __grid_constant__ Params p) {
  typedef Sm90ForwardTraits<Elem, HD, BM, BN, FEATURES> Tr;
  static_assert(BM * Tr::PITCH * 2 <= Tr::Q_BYTES + 4 * Tr::KV_BYTES, "staging tile fits the buffers");
  extern __shared__ unsigned char smem_raw[];
  // Swizzled tiles must start on 1024-byte boundaries; the host adds 1 KB of slack for this.
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

  const BlockCoords bc = decode_block(p.heads_q, p.num_blocks);
  const int kv_head = bc.head / p.group;
  const int warp = threadIdx.x >> 5;
  constexpr bool PACKED = Features<FEATURES>::PACKED;
  const Seq<PACKED> seq = Seq<PACKED>::of(p, bc.batch);  // dense: p.seq_q, p.seq_k where used
  if (PACKED && bc.block * BM >= seq.nq(p)) return;       // past this sequence's rows

  Sm90ForwardBlock<Tr, Elem, HD, BM, BN> blk;
  blk.sQ = smem;
  blk.sK = smem + Tr::Q_BYTES;
  blk.sV = blk.sK + 2 * Tr::KV_BYTES;
  blk.m0 = bc.block * BM;
  blk.lane = threadIdx.x & 31;
  blk.warp_row0 = warp * 16;
  blk.wg = warp >> 2;
  blk.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  blk.mod = Tr::ScoreMod::of(p, bc.batch, bc.head, static_cast<float>(p.scale), seq.ext);
  fill(blk.acc_o, 0.f);
  blk.softmax.init(p.p_shift);  // see forward.cu

  // The parameters are read where they are used: copies held through the loop cost registers.
  const unsigned short* k_head = seq.template k_head<const unsigned short>(p.k, kv_head);
  const unsigned short* v_head = seq.template k_head<const unsigned short>(p.v, kv_head);
  const TileRange tiles = Tr::Mask::of(p, seq.ext).key_tiles(blk.m0, BM, BN);
  load_tile_swizzled<BM, HD, Tr::NTHREADS>(smem, seq.template q_head<const unsigned short>(p.q, bc.head),
                                           p.q.seq, blk.m0, seq.nq(p), p.head_dim, p.vec != 0);
  if (tiles.count() > 0) {
    const int first = tiles.at(0) * BN;
    load_tile_swizzled<BN, HD, Tr::NTHREADS>(smem + Tr::Q_BYTES, k_head, p.k.seq, first, seq.nk(p),
                                             p.head_dim, p.vec != 0);
    load_tile_swizzled<BN, HD, Tr::NTHREADS>(smem + Tr::Q_BYTES + 2 * Tr::KV_BYTES, v_head, p.v.seq,
                                             first, seq.nk(p), p.head_dim, p.vec != 0);
  }
  cp_async_commit();

  // The tiles that straddle a bound of the mask or the end of the keys first (mask.cuh,
  // TileRange::at). Rows that they made non-finite are flagged and recomputed at the end
  // (repair.cuh).
  const int masked = tiles.masked(), count = tiles.count();
  // The flag slot is built at each use from these two: a FlagSlot held through the loop spills.
  float* lse_row_g = seq.template q_head<float>(p.lse, bc.head) +
                     (blk.m0 + blk.warp_row0 + (blk.lane >> 2)) * p.lse.seq;
  const bool real_row_g = blk.m0 + blk.warp_row0 + (blk.lane >> 2) < seq.nq(p);
  for (int it = 0; it < count; ++it) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // this tile has landed everywhere; every warpgroup is done with the last one
    const int next = tiles.at(it + 1);
    if (next >= 0) {
      unsigned char* k_next = smem + Tr::Q_BYTES + ((it + 1) & 1) * Tr::KV_BYTES;
      load_tile_swizzled<BN, HD, Tr::NTHREADS>(k_next, k_head, p.k.seq, next * BN, seq.nk(p),
                                               p.head_dim, p.vec != 0);
      load_tile_swizzled<BN, HD, Tr::NTHREADS>(k_next + 2 * Tr::KV_BYTES, v_head, p.v.seq,
                                               next * BN, seq.nk(p), p.head_dim, p.vec != 0);
      cp_async_commit();
    }
    if (it < masked) {
      blk.template process_key_tile<true>(tiles.at(it), it & 1, Tr::Mask::of(p, seq.ext));
      if (it == masked - 1) park_flags(lse_flag_slot(lse_row_g, real_row_g, blk.lane), nonfinite_rows(blk.acc_o));
    } else {
      blk.template process_key_tile<false>(tiles.at(it), it & 1, Tr::Mask::of(p, seq.ext));
    }
  }

  // Epilogue: normalise once, stage O through shared memory (row pitch HD + 8), wide stores.
  float lse_rows[1][2];
  blk.softmax.finalize(blk.acc_o, blk.scale_log2, lse_rows);
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup is done reading the pipeline buffers
  unsigned short* s_out = reinterpret_cast<unsigned short*>(smem);
  stage_accumulators<Elem, 1, Tr::NT_O, Tr::PITCH>(s_out + blk.warp_row0 * Tr::PITCH, blk.acc_o,
                                                     1.f, blk.lane);
  const unsigned repair = masked > 0 ? unpark_flags(lse_flag_slot(lse_row_g, real_row_g, blk.lane)) : 0u;
  if (__any_sync(0xffffffffu, repair != 0)) {  // rare: a NaN or Inf met a masked tile
    __syncwarp();
    recompute_forward_rows<Elem, HD, 1>(s_out + blk.warp_row0 * Tr::PITCH, Tr::PITCH, HD, repair,
                                        lse_rows, blk.scale_log2,
                                        seq.template q_rows<const unsigned short>(p.q, bc.head),
                                        Rows{k_head, p.k.seq}, Rows{v_head, p.v.seq},
                                        blk.m0 + blk.warp_row0, Tr::Mask::of(p, seq.ext), blk.mod, p.head_dim,
                                        blk.lane);
  }
  __syncthreads();
  unsigned short* o_head = seq.template q_head<unsigned short>(p.o, bc.head);
  store_tile<BM, HD, Tr::PITCH, Tr::NTHREADS>(o_head, s_out, p.o.seq, blk.m0, seq.nq(p), p.head_dim,
                                              p.vec != 0);
  if ((blk.lane & 3) == 0) {
    float* lse_head = seq.template q_head<float>(p.lse, bc.head);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = blk.m0 + blk.warp_row0 + (blk.lane >> 2) + 8 * r;
      if (row < seq.nq(p)) lse_head[row * p.lse.seq] = lse_rows[0][r];
    }
  }
}

}  // namespace cuflash
