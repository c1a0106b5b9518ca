// tma.cuh: Hopper's tensor memory accelerator (TMA), the mbarriers that pipelines between a
// producer and its consumers are built of, and warpgroup register reallocation (sm_90 / sm_90a).
//
// A pipeline stage is a shared-memory buffer with two mbarriers: "full" (the producer arms it with
// the byte count it expects; the TMA unit completes it when the bytes have landed) and "empty"
// (every consumer warp arrives once it has read the buffer). A barrier's phase flips each time it
// completes, and a waiter names the parity of the phase it waits for. The producer waits on
// "empty" with the opposite parity, so its first pass over a fresh barrier does not block.
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace cuflash {

// The driver's CUtensorMap: 128 opaque bytes made on the host (cuTensorMapEncodeTiled, see
// cuflash/_tma.py) and passed by value as a __grid_constant__ kernel parameter.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals)
               : "memory");
}

// N pipeline buffers' (full, empty) barrier pairs.
template <int N>
__device__ __forceinline__ void mbar_init_pairs(unsigned long long (&full)[N],
                                                unsigned long long (&empty)[N],
                                                unsigned full_arrivals, unsigned empty_arrivals) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    mbar_init(&full[i], full_arrivals);
    mbar_init(&empty[i], empty_arrivals);
  }
}

// Makes initialised barriers visible to the TMA unit and to the other threads (with a barrier).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival that also announces `bytes` more of asynchronous copies to wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Blocks until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Copies the box at coordinates (c0, c1, c2, c3) (innermost first) of a 4-D tensor map into
// shared memory at `dst` (1024-byte aligned for the 128-byte swizzle); completes `bytes` of the
// barrier's expected transaction count. Out-of-range elements are written as zeros.
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, unsigned long long* bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(smem_addr(bar))
      : "memory");
}

// Programmatic dependent launch (cuflash/_launch.py): lets the next kernel on the stream, launched
// programmatically, start its blocks once every block of this one has called this (or exited) ...
__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
// ... where it waits, before reading what this one writes, for this one to complete (a no-op in
// a kernel launched the ordinary way).
__device__ __forceinline__ void wait_for_prerequisite_grid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Copies `bytes` (a multiple of 16) from global memory at `src` to shared memory at `dst` (both
// 16-byte aligned) on the TMA unit, completing `bytes` of the barrier's expected transaction count:
// the bulk copy without a tensor map, for rows whose addresses come from a table (paged caches).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Copies the box at `src` (shared memory, 1024-byte aligned, in the map's swizzled layout) to the
// coordinates (c0, c1, c2, c3) of a 4-D tensor map in global memory. Unlike tma_load_4d, callers
// keep the box inside the tensor: on the H100 a store of a box that starts before row 0 faults,
// and partial boxes past the last row faulted inside the forward (docs/perf/NOTES.md, v9). The
// copy joins the issuing thread's current bulk group (bulk_commit, bulk_wait_read).
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, const void* src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<unsigned long long>(map)),
      "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Closes the issuing thread's bulk group of stores.
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Waits until the issuing thread's bulk groups, all but the newest N, have read their shared
// memory (the buffer may be written again) ...
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// ... or have completed, writes included.
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Makes this thread's shared-memory writes visible to the TMA unit (the async proxy); a barrier
// after it makes them visible to the thread that issues the copy.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Barrier `id` over the 128 threads of one warpgroup that also returns whether `pred` holds for
// any of them (bar.red.or). Id 0 is __syncthreads'; callers use 8 and up.
__device__ __forceinline__ bool warpgroup_any(int id, bool pred) {
  unsigned any;
  asm volatile(
      "{\n.reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.or.pred q, %2, 128, p;\n"
      "selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<unsigned>(pred)), "r"(id)
      : "memory");
  return any != 0;
}

// Barrier `id` over the 128 threads of one warpgroup.
__device__ __forceinline__ void warpgroup_sync(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}

// Named barrier `id` shared by `threads` threads (a multiple of 32) of which some wait here ...
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// ... and the others only arrive, without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Four 8 x 8 matrices of 16-bit elements from registers to shared memory (stmatrix): register i
// of lane l holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix i (the accumulator
// fragment's layout), and lane l gives the address of row l % 8 of matrix l / 8 (16 bytes).
__device__ __forceinline__ void stmatrix_x4(void* row_address, unsigned r0, unsigned r1, unsigned r2,
                                            unsigned r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
          smem_addr(row_address)),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map))
               : "memory");
}

// Warpgroup register reallocation (sm_90a): every warp of the warpgroup executes it, and the
// kernel has a per-thread register cap at entry (__launch_bounds__(threads, 1)).
template <int REGS>
__device__ __forceinline__ void warpgroup_release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void warpgroup_claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// Register budgets of a producer warpgroup and CONSUMERS consumer warpgroups (setmaxnreg). With
// one consumer every thread has up to 255 registers from the start, and nothing is moved.
template <int CONSUMERS>
struct WarpSpecialisedRegisters {
  static constexpr int PRODUCER = CONSUMERS == 2 ? 24 : 32;
  static constexpr int CONSUMER = CONSUMERS == 2 ? 240 : 160;
  static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "one to three consumer warpgroups");
  static_assert(CONSUMERS == 1 || PRODUCER * 128 + CONSUMER * 128 * CONSUMERS <= 65536,
                "register file");
  static __device__ __forceinline__ void producer() {
    if constexpr (CONSUMERS > 1) warpgroup_release_registers<PRODUCER>();
  }
  static __device__ __forceinline__ void consumer() {
    if constexpr (CONSUMERS > 1) warpgroup_claim_registers<CONSUMER>();
  }
};

// Buffers of the per-item tiles: two (the next item's load overlaps this one) where shared memory
// allows, one at HD = 256.
template <int HD>
struct ItemBuffers {
  static constexpr int COUNT = HD > 128 ? 1 : 2;
};

// The next of N buffers used in turn (round = uses so far, counted by the caller), once the
// producer may fill it (its last use released: waits on its "empty" barrier) ...
template <int N>
__device__ __forceinline__ int acquire_to_fill(unsigned long long (&empty)[N], int& round) {
  const int b = round % N;
  mbar_wait(&empty[b], ((round / N) & 1) ^ 1);
  ++round;
  return b;
}
// ... or once a consumer may read it (it has landed: waits on its "full" barrier).
template <int N>
__device__ __forceinline__ int acquire_to_read(unsigned long long (&full)[N], int& round) {
  const int b = round % N;
  mbar_wait(&full[b], (round / N) & 1);
  ++round;
  return b;
}

}  // namespace cuflash
