// work_list.cu: build_work_list writes the work list of one packed launch of a persistent kernel
// (work_list.cuh says why, params.cuh what an entry holds), on the launch's stream just before it.
//
// One block of 1024 threads: (1) each sequence's items per head are summed per cost bucket;
// (2) a scan gives each bucket its first item, the costliest bucket first; (3) each sequence
// claims its run of items within its bucket and a warp writes its entries, head by head. The
// order of sequences within a bucket follows the shared-memory atomics and may differ between
// calls; each item's results do not depend on where it runs, so the outputs' bits do not either.
// The entries stop at the list's capacity (num_work, the host's bound for well-formed offsets):
// malformed offsets (overlapping sequences) can claim more, which are dropped, never written
// past the buffer (their rows are left unwritten: the checked mode reports such offsets).
#include "common.cuh"
#include "params.cuh"
#include "work_list.cuh"

namespace cuflash {

constexpr int LIST_THREADS = 1024;

__global__ void __launch_bounds__(LIST_THREADS)
    build_work_list(const __grid_constant__ Params p) {
  static_assert(LIST_COST_BUCKETS == LIST_THREADS, "a thread per bucket in the scan");
  __shared__ unsigned long long bucket_items[LIST_COST_BUCKETS];  // then each bucket's next item
  __shared__ unsigned long long warp_sums[LIST_THREADS / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int4* list = p.work_list + 2 * p.list_base;  // entries of two int4 (params.cuh, work_item)
  const i64 capacity = p.num_work, heads = p.list_heads;

  bucket_items[tid] = 0;
  __syncthreads();
  for (int b = tid; b < p.batch; b += LIST_THREADS) {
    const SequenceItems s = SequenceItems::of(p, b);
    atomicAdd(&bucket_items[s.bucket], static_cast<unsigned long long>(s.items));
  }
  __syncthreads();

  // Exclusive scan over the buckets from the costliest: thread t holds bucket B - 1 - t.
  const int bucket = LIST_COST_BUCKETS - 1 - tid;
  const unsigned long long mine = bucket_items[bucket];
  unsigned long long sum = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long up = __shfl_up_sync(0xffffffffu, sum, d);
    if (lane >= d) sum += up;
  }
  if (lane == 31) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = warp_sums[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned long long up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    warp_sums[lane] = w;  // inclusive, over warps
  }
  __syncthreads();
  const unsigned long long before = sum - mine + (warp > 0 ? warp_sums[warp - 1] : 0);
  const unsigned long long total = warp_sums[LIST_THREADS / 32 - 1];
  bucket_items[bucket] = before;
  if (tid == 0) {
    const unsigned long long entries = total * static_cast<unsigned long long>(heads);
    list[0] = make_int4(static_cast<int>(min(entries, static_cast<unsigned long long>(capacity))),
                        0, 0, 0);
    list[1] = make_int4(0, 0, 0, 0);
  }
  __syncthreads();

  // Each lane claims a sequence's run; then the warp writes the 32 sequences' entries in turn
  // (item e of a sequence's run: head e / items, its item e % items), each with the sequence's
  // rows as Seq::of clamps them.
  for (int base = warp * 32; base < p.batch; base += LIST_THREADS) {
    const int b = base + lane;
    SequenceItems s{0, 0, 0, 0, 0, 0};
    unsigned long long first = 0;
    if (b < p.batch) {
      s = SequenceItems::of(p, b);
      first = atomicAdd(&bucket_items[s.bucket], static_cast<unsigned long long>(s.items));
    }
    for (int j = 0; j < 32 && base + j < p.batch; ++j) {
      SequenceItems sj;
      sj.items = __shfl_sync(0xffffffffu, s.items, j);
      const unsigned long long first_j = __shfl_sync(0xffffffffu, first, j);
      const int4 rows_j = make_int4(
          __shfl_sync(0xffffffffu, s.q0, j), __shfl_sync(0xffffffffu, s.nq, j),
          __shfl_sync(0xffffffffu, s.k0, j), __shfl_sync(0xffffffffu, s.nk, j));
      const i64 run = heads * sj.items, start = static_cast<i64>(first_j) * heads;
      for (i64 e = lane; e < run && start + e < capacity; e += 32) {
        const int head = static_cast<int>(e / sj.items);
        const int i = static_cast<int>(e - static_cast<i64>(head) * sj.items);
        int4* entry = list + 2 * (1 + start + e);
        entry[0] = make_int4(base + j, head, sj.block(p, i), 0);
        entry[1] = rows_j;
      }
    }
  }
}

}  // namespace cuflash
