// backward_sm90_fused.cu: the fused Hopper backward (sm_90a) of dense attention without bounds: one
// kernel computes dK, dV and dQ's partial sums from the same S and dP (5 matrix products per tile
// pair, where the dK/dV and dQ kernels of backward_sm90_tma.cu do 7), and a second one turns the
// float32 sums into dQ. Deterministic: the partial sums of a query tile are added in a fixed order
// (below), never by unordered atomics.
//
// attention_backward_fused_tma: as attention_backward_dkdv_tma (a persistent block per SM walks the
// (batch, KV head, key block) items; warpgroup 0 produces, consumer warpgroups of 64 keys run the
// steps of Sm90DkdvKeys over the query tiles of every query head of the group), and per query tile:
//   - both consumers store dS^T of their keys into one shared tile (stmatrix, 128-byte swizzle;
//     two tiles used in turn, so that one barrier a tile orders the consumers);
//   - each computes dQ_part = dS K for half of the head dim (wgmma, A = dS^T read MN-major,
//     B = K read MN-major) and stores it, in fragment order, into a staging tile;
//   - warp 1 of the producer warpgroup (the writer) adds the staging tile to the query tile's
//     float32 sums in global memory with one TMA bulk reduction (a bulk copy for the first one),
//     in its turn: the tile's counter says how many items have added theirs.
// The turns: the items of one (batch, KV head) that run at one time (a wave of the persistent
// walk: item i runs as step i / G of block i % G) visit the query steps rotated, item r of the
// wave's m starting at step r T / m (T: a query head's tiles), so that at each step they work on
// different tiles, and each tile's turns follow the order of the visits (FusedDqOrder); items of
// later waves come after those of earlier ones. A turn waits only for additions made at earlier
// steps of the same wave or in earlier waves, so every wait ends. The host launches this kernel
// only for unbounded masks (every key block adds to every query tile: no masked tiles, so no
// repair either), whole key blocks (keys past the end of a partial block are not masked here, and
// their dS would reach dQ) and at most group x T key blocks per head (cuflash/_dispatch.py). Bounded masks
// (causal, windows) keep the dK/dV and dQ kernels: their tile order and repair did not fit the
// registers here (docs/perf/NOTES.md, v21).
//
// attention_backward_dq_from_accum: dQ = scale * sums, a block per (batch, query head, query tile).
#include "common.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "features.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "backward_sm90.cuh"
#include "backward_sm90_tma.cuh"

namespace cuflash {

// The turn of an item at each query step: items base .. base + n - 1 share a (batch, KV head).
// The m items of a wave start `span` / m query steps apart, span being one query head's tiles
// (or all steps, where there are more items than tiles): every query tile then gets its additions
// a few steps apart, while its sums are still in L2 (spread over the whole group's steps, grouped
// heads ran 0.77-0.92x as fast, docs/perf/NOTES.md, v21).
struct FusedDqOrder {
  int first;   // items of the head in earlier waves
  int r, m;    // this item's position among the head's items in its wave, and their count
  int span;    // query steps the wave's first steps spread over
  int steps;   // query steps per item (group x query tiles)
  int offset;  // this item's first query step

  static __device__ __forceinline__ FusedDqOrder of(i64 item, int n, int tiles, int steps) {
    const i64 grid = gridDim.x, base = item - item % n, wave = item / grid;
    const i64 lo = max(base, wave * grid), hi = min(base + n, (wave + 1) * grid);
    FusedDqOrder o;
    o.first = static_cast<int>(lo - base);
    o.r = static_cast<int>(item - lo);
    o.m = static_cast<int>(hi - lo);
    o.steps = steps;
    o.span = o.m <= tiles ? tiles : steps;
    o.offset = static_cast<int>(static_cast<i64>(o.r) * o.span / o.m);
    return o;
  }
  __device__ __forceinline__ int step_at(int s) const {  // the query step of local step s
    const int q = offset + s;
    return q >= steps ? q - steps : q;
  }
  // Additions to query step q before this item's: the wave's items visit q in the order rq,
  // rq - 1, .., 0, m - 1, .., rq + 1, where rq is the last whose offset is <= q.
  __device__ __forceinline__ int turn(int q) const {
    const int rq = min(m - 1, static_cast<int>((static_cast<i64>(q + 1) * m + span - 1) / span) - 1);
    const int d = rq - r;
    return first + (d < 0 ? d + m : d);
  }
};

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Orders this thread's global accesses through the async proxy (TMA) against its ordinary ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// `bytes` from shared to global memory on the TMA unit: copied, or added (float32) to what is there.
__device__ __forceinline__ void bulk_store(float* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_reduce_add(float* dst, const void* src, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}

template <int STAGES>
struct FusedBarriers {
  unsigned long long kv_full, kv_empty;  // K and V of a work item
  unsigned long long q_full[STAGES], q_empty[STAGES];
  unsigned long long dq_full, dq_empty;  // the staging tile of dQ partial sums
};

template <typename Elem, int HD, int BM, int BN, int STAGES, int FEATURES>
__global__ void __launch_bounds__(BN / 64 * 128 + 128, 1)
    attention_backward_fused_tma(const __grid_constant__ BackwardMaps maps,
                                 const __grid_constant__ Params p) {
  typedef Features<FEATURES> F;
  typedef typename F::Mask Mask;
  typedef typename F::template ScoreMod<> Mod;
  static_assert(!F::SOFTCAP && !F::PACKED && !F::LOCAL, "dense, unbounded masks only");
  static_assert(HD == 128 && BM == FUSED_BM && BN == 128, "two consumers of 64 keys, 64-row tiles");
  constexpr int CONSUMERS = BN / 64, NT_DQ = HD / CONSUMERS / 8;
  constexpr int KEYS_BYTES = BN * HD * 2, ROWS_BYTES = BM * HD * 2;
  constexpr int DS_BYTES = BN * BM * 2, DQ_BYTES = BM * HD * 4;
  constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  // Registers: the producer warpgroup's two working warps need more than the 24 of
  // WarpSpecialisedRegisters (it spilled 152 B there); the consumers fit in 232.
  constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
  static_assert(PRODUCER_REGISTERS * 128 + CONSUMER_REGISTERS * CONSUMER_THREADS <= 65536,
                "register file");
  typedef Sm90DkdvKeys<Elem, HD, BM, BN, Mask, Mod> Keys;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sK = smem;                       // one tile
  unsigned char* sV = sK + KEYS_BYTES;            // one tile
  unsigned char* sQ = sV + KEYS_BYTES;            // STAGES tiles
  unsigned char* sdO = sQ + STAGES * ROWS_BYTES;  // STAGES tiles
  unsigned char* sdS = sdO + STAGES * ROWS_BYTES; // dS^T, two tiles: BN key rows of BM queries
  float* sdQ = reinterpret_cast<float*>(sdS + 2 * DS_BYTES);  // staging tile, fragment order
  float* s_lse2 = sdQ + BM * HD;                           // STAGES x BM
  float* s_delta = s_lse2 + STAGES * BM;                   // STAGES x BM
  FusedBarriers<STAGES>& bar = *reinterpret_cast<FusedBarriers<STAGES>*>(s_delta + STAGES * BM);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const WorkWalk<false> walk{p.num_work, false};
  const int tiles_q = ceil_div(p.seq_q, BM), steps = p.group * tiles_q;

  if (threadIdx.x == 0) {
    mbar_init(&bar.kv_full, 1);
    mbar_init(&bar.kv_empty, 4 * CONSUMERS);
    // q_full: the copies' bytes and each producer lane's lse2, D; q_empty: every consumer thread
    mbar_init_pairs(bar.q_full, bar.q_empty, 1 + 32, CONSUMER_THREADS);
    mbar_init(&bar.dq_full, 4 * CONSUMERS);  // lane 0 of every consumer warp
    mbar_init(&bar.dq_empty, 1);             // the writer
    fence_barrier_init();
  }
  __syncthreads();

  if (warp < 4) {  // producer warpgroup: warp 0 loads, warp 1 writes dQ, the others leave
    warpgroup_release_registers<PRODUCER_REGISTERS>();
    if (warp == 0) {
      int pipe = 0, round = 0;
      for (int step = 0; !walk.done(step); ++step) {
        const i64 item = walk.item(step);
        if (item >= walk.num_work) continue;
        const WorkItem<false> work = work_item<false>(p, item, p.heads_kv);
        const BlockCoords bc = work.c;
        const FusedDqOrder order = FusedDqOrder::of(item, p.num_blocks, tiles_q, steps);
        mbar_wait(&bar.kv_empty, (round & 1) ^ 1);
        ++round;
        if (lane == 0) {
          mbar_arrive_expect_tx(&bar.kv_full, 2 * KEYS_BYTES);
          tma_load_tile<BN, HD>(sK, &maps.k, &bar.kv_full, bc.block * BN, bc.head, bc.batch);
          tma_load_tile<BN, HD>(sV, &maps.v, &bar.kv_full, bc.block * BN, bc.head, bc.batch);
        }
        for (int s = 0; s < steps; ++s, ++pipe) {
          const int stage = pipe % STAGES, q = order.step_at(s);
          const int head = bc.head * p.group + q / tiles_q, m0 = (q % tiles_q) * BM;
          mbar_wait(&bar.q_empty[stage], ((pipe / STAGES) & 1) ^ 1);
          if (lane == 0) {
            mbar_arrive_expect_tx(&bar.q_full[stage], 2 * ROWS_BYTES);
            tma_load_tile<BM, HD>(sQ + stage * ROWS_BYTES, &maps.q, &bar.q_full[stage], m0, head,
                                  bc.batch);
            tma_load_tile<BM, HD>(sdO + stage * ROWS_BYTES, &maps.dout, &bar.q_full[stage], m0,
                                  head, bc.batch);
          }
          stage_lse_and_delta<BM>(s_lse2 + stage * BM, s_delta + stage * BM, p, work.seq, head, m0,
                                  lane);
          mbar_arrive(&bar.q_full[stage]);
        }
      }
    } else if (warp == 1 && lane == 0) {  // the writer
      int staged = 0;
      for (int step = 0; !walk.done(step); ++step) {
        const i64 item = walk.item(step);
        if (item >= walk.num_work) continue;
        const BlockCoords bc = decode_paired_work(item, p.heads_kv, p.num_blocks);
        const FusedDqOrder order = FusedDqOrder::of(item, p.num_blocks, tiles_q, steps);
        // query step q of the item is tile first_tile + q of the counters and sums
        const i64 first_tile = (static_cast<i64>(bc.batch) * p.heads_q + bc.head * p.group) * tiles_q;
        for (int s = 0; s < steps; ++s, ++staged) {
          const int q = order.step_at(s);
          mbar_wait(&bar.dq_full, staged & 1);
          const int turn = order.turn(q);
          int* counter = p.dq_semaphores + first_tile + q;
          while (load_acquire(counter) != turn) {
          }
          fence_proxy_async_global();  // the earlier turns' additions before this one
          float* sums = p.dq_accum + (first_tile + q) * (FUSED_BM * HD);
          if (turn == 0) bulk_store(sums, sdQ, DQ_BYTES);
          else bulk_reduce_add(sums, sdQ, DQ_BYTES);
          bulk_commit();
          bulk_wait<0>();  // read and written
          mbar_arrive(&bar.dq_empty);
          fence_proxy_async_global();
          store_release(counter, turn + 1);
        }
      }
    }
    return;
  }

  warpgroup_claim_registers<CONSUMER_REGISTERS>();
  const int wg = (warp - 4) >> 2, tid = threadIdx.x - 128 - wg * 128;  // within the warpgroup
  const int key_row0 = Keys::key_row0(warp - 4);  // this warp's keys within the block
  const int d = p.head_dim;
  Keys keys;
  keys.wg = wg;
  keys.lane = lane;
  keys.scale_log2 = static_cast<float>(p.scale) * 1.4426950408889634f;
  keys.sK = sK;
  keys.sV = sV;
  int pipe = 0, round = 0, staged = 0;
  for (int step = 0; !walk.done(step); ++step) {
    const i64 item = walk.item(step);
    if (item >= walk.num_work) continue;
    const WorkItem<false> work = work_item<false>(p, item, p.heads_kv);
    const int n0 = work.c.block * BN;
    const FusedDqOrder order = FusedDqOrder::of(item, p.num_blocks, tiles_q, steps);
    keys.key0 = n0 + key_row0 + (lane >> 2);
    keys.clear();
    mbar_wait(&bar.kv_full, round & 1);
    ++round;
    for (int s = 0; s < steps; ++s, ++pipe, ++staged) {
      const int stage = pipe % STAGES, q = order.step_at(s);
      const int m0 = (q % tiles_q) * BM;
      mbar_wait(&bar.q_full[stage], (pipe / STAGES) & 1);
      if constexpr (Mod::ANY) {
        const BlockCoords bc = decode_paired_work(item, p.heads_kv, p.num_blocks);
        keys.mod = Mod::of(p, bc.batch, bc.head * p.group + q / tiles_q, static_cast<float>(p.scale),
                           work.seq.ext);
      }
      const unsigned char* q_tile = sQ + stage * ROWS_BYTES;
      const unsigned char* do_tile = sdO + stage * ROWS_BYTES;
      typename Keys::Frags f;
      keys.issue_scores(q_tile, do_tile);
      wgmma_wait<0>();
      keys.probabilities(false, m0, s_lse2 + stage * BM, s_delta + stage * BM, f,
                         Mask::of(p, work.seq.ext));
      // dS^T of this warp's 16 keys into rows 64 wg + 16 w .. of one of two tiles, in turn: the
      // last products that read this one (two tiles back) were waited for before the other
      // consumer passed the barrier below on the previous tile.
      unsigned char* ds_tile = sdS + (staged & 1) * DS_BYTES;
      {
        const int mi = lane >> 3, row = key_row0 + (mi & 1) * 8 + (lane & 7);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
          const int chunk = 2 * kk + (mi >> 1);
          stmatrix_x4(ds_tile + row * 128 + ((chunk ^ (row & 7)) << 4), f.dst[kk][0], f.dst[kk][1],
                      f.dst[kk][2], f.dst[kk][3]);
        }
      }
      fence_proxy_async();
      named_barrier_sync(1, CONSUMER_THREADS);  // both consumers' keys are in
      keys.issue_grads(f, q_tile, do_tile);  // dV += P^T dO_i, dK += dS^T Q_i
      // dQ_part = dS K for head-dim columns 64 wg ..: A = dS^T, B = K, both read MN-major.
      float acc_dq[NT_DQ][4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_ss_tt<Elem, HD / CONSUMERS>(acc_dq, smem_desc(ds_tile + kk * 2048, BN * 128, 1024),
                                          smem_desc(sK + wg * (BN * 128) + kk * 2048, BN * 128, 1024),
                                          kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulators(keys.acc_dv);
      fence_accumulators(keys.acc_dk);
      fence_accumulators(acc_dq);
      keys.keep(f);
      mbar_arrive(&bar.q_empty[stage]);  // every thread: its loads of lse2 and D are done
      // The staging tile, once the writer has read the previous one: float4 (wg, nt) of thread
      // tid at index (wg * NT_DQ + nt) * 128 + tid (conflict-free; attention_backward_dq_from_accum
      // reads this order).
      mbar_wait(&bar.dq_empty, (staged & 1) ^ 1);
#pragma unroll
      for (int nt = 0; nt < NT_DQ; ++nt)
        reinterpret_cast<float4*>(sdQ)[(wg * NT_DQ + nt) * 128 + tid] =
            make_float4(acc_dq[nt][0], acc_dq[nt][1], acc_dq[nt][2], acc_dq[nt][3]);
      fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) mbar_arrive(&bar.dq_full);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&bar.kv_empty);

    // Epilogue: dK = scale * acc_dk and dV, from registers.
    const float scale = static_cast<float>(p.scale);
    const BlockCoords bc = decode_paired_work(item, p.heads_kv, p.num_blocks);
    const Seq<false> seq = Seq<false>::of(p, bc.batch);
    unsigned short* dk_head = seq.template k_head<unsigned short>(p.dk, bc.head);
    unsigned short* dv_head = seq.template k_head<unsigned short>(p.dv, bc.head);
    const int key0 = n0 + key_row0;
    store_accumulator_rows<Elem, Keys::NT_D>(dk_head, p.dk.seq, key0, p.seq_k, d, keys.acc_dk, scale,
                                             lane);
    store_accumulator_rows<Elem, Keys::NT_D>(dv_head, p.dv.seq, key0, p.seq_k, d, keys.acc_dv, 1.f,
                                             lane);
  }
}

// dQ = scale * sums: a block of 128 threads per (batch, query head, query tile). Thread tid reads
// the float4s that consumer thread tid of each warpgroup staged: together the 16-row accumulator
// of its warp's rows in the mma layout (mma.cuh), stored as the dQ kernels store theirs.
template <typename Elem, int HD>
__global__ void __launch_bounds__(128) attention_backward_dq_from_accum(const __grid_constant__ Params p) {
  // staged float4 (wg, nt) of thread tid, at (wg * NT_D / 2 + nt) * 128 + tid, is column tile
  // wg * NT_D / 2 + nt of its rows
  constexpr int NT_D = HD / 8;
  const int tiles_q = ceil_div(p.seq_q, FUSED_BM);
  const i64 index = blockIdx.x;
  const int tile = static_cast<int>(index % tiles_q);
  const i64 bh = index / tiles_q;
  const int batch = static_cast<int>(bh / p.heads_q), head = static_cast<int>(bh % p.heads_q);
  const float4* sums = reinterpret_cast<const float4*>(p.dq_accum + index * (FUSED_BM * HD));
  float acc[NT_D][4];
#pragma unroll
  for (int nt = 0; nt < NT_D; ++nt) {
    const float4 v = sums[nt * 128 + threadIdx.x];
    acc[nt][0] = v.x, acc[nt][1] = v.y, acc[nt][2] = v.z, acc[nt][3] = v.w;
  }
  store_accumulator_rows<Elem, NT_D>(head_ptr<unsigned short>(p.dq, batch, head), p.dq.seq,
                                     tile * FUSED_BM + (threadIdx.x >> 5) * 16, p.seq_q,
                                     p.head_dim, acc, static_cast<float>(p.scale), threadIdx.x & 31);
}

}  // namespace cuflash
