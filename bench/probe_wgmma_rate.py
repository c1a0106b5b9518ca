"""Probe: how fast one consumer warpgroup's products run on the tensor cores alone, beside the
other's, and behind the other's (docs/perf/NOTES.md, v47), for the forward's shapes.

    python bench/probe_wgmma_rate.py [--reps 64] [--out DIR]

One block per SM, two warpgroups, tiles of zeros in shared memory. A program is a list of
products, each a chain of k steps into one accumulator, issued back to back, committed, and
waited for (wgmma_wait<0>) before the next repetition:
  S      S = Q K^T: HD * bytes / 32 steps of m64 n=BN, both operands from shared memory
  PV     O += P V: BN / k steps of m64 n=HD, P from registers
  S+PV   both, as the pipelined forward issues them in a turn
  S,S    two independent S chains (two accumulators)
  PVss   O += P V with P from shared memory too (e4m3: both K-major, wgmma_ss), as a loop that
         stages P would issue it
  none   no product (a sleep of about 1 us a repetition): the softmax mode's rate alone
Modes: `one` (warpgroup 0 alone), `both` (the two start each repetition together, a named
barrier), `behind` (warpgroup 1 issues its program, then warpgroup 0 issues its own: the turns of
forward_sm90_tma.cu), `softmax` (warpgroup 1 runs a softmax's instructions meanwhile, FFMA, ex2,
FADD and FMNMX on 32 registers a thread, until warpgroup 0 is done: whether its products slow
down beside the other's softmax; the `ex2/clk` column is the softmax's rate, ex2 a cycle an SM),
`exps` (the same without the max's chain, 64 exponentials a thread and iteration: the exp
phase's own rate).
Per repetition and warpgroup 0: the cycles from the first wgmma_fence to the last commit
(issue), and to the end of the wait (done); at peak a product of F FLOP takes F / 4096 cycles of
an SM (16-bit) or F / 8192 (e4m3), the `peak` column.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import _kernels  # noqa: E402

SOURCE = r"""
#include "common.cuh"
#include "tma.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
using namespace cuflash;

template <typename Elem> struct Shape;
template <> struct Shape<bf16> { static constexpr int BYTES = 2, K = 16; };
template <> struct Shape<e4m3> { static constexpr int BYTES = 1, K = 32; };

// PROG: 0 S, 1 PV, 2 S+PV, 3 S,S, 4 PVss, 5 none. MODE: 0 one, 1 both, 2 behind, 3 softmax,
// 4 exps.
template <typename Elem, int HD, int BN, int PROG, int MODE>
__global__ void __launch_bounds__(256, 1) probe(unsigned long long* out, int reps) {
  constexpr int BYTES = Shape<Elem>::BYTES, K_QK = HD * BYTES / 32, K_PV = BN / Shape<Elem>::K;
  constexpr int Q_BYTES = 64 * HD * BYTES, KV_BYTES = BN * HD * BYTES;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  for (int i = threadIdx.x * 16; i < 2 * Q_BYTES + 2 * KV_BYTES; i += blockDim.x * 16)
    *reinterpret_cast<uint4*>(smem + i) = make_uint4(0, 0, 0, 0);
  volatile int* stop = reinterpret_cast<volatile int*>(smem + 2 * Q_BYTES + 2 * KV_BYTES);
  if (threadIdx.x == 0) *stop = 0;
  fence_proxy_async();
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  if (MODE == 0 && wg == 1) return;
  if (MODE >= 3 && wg == 1) {  // the softmax's instructions until warpgroup 0 is done
    constexpr int EL = MODE == 3 ? 32 : 64;  // exps: 64 scores, no max first
    float x[EL];
#pragma unroll
    for (int i = 0; i < EL; ++i) x[i] = 0.001f * (threadIdx.x + i);
    unsigned long long iters = 0;
    const unsigned long long t0 = clock64();
    while (*stop == 0) {
      float mx = 1.f;
      if constexpr (MODE == 3) {
        mx = x[0];
#pragma unroll
        for (int i = 1; i < EL; ++i) mx = fmaxf(mx, x[i]);
      }
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < EL; ++i) {
        const float p = fast_exp2(fmaf(x[i], 0.5f, -mx));
        sum += p;
        x[i] = p;
      }
      x[0] += sum * 1e-30f;
      ++iters;
    }
    const unsigned long long t1 = clock64();
    if ((threadIdx.x & 127) == 0) {
      unsigned long long* slot = out + (blockIdx.x * 2 + 1) * 4;
      slot[0] = iters;
      slot[1] = t1 - t0;
      slot[3] = x[0] != 0.f;
    }
    return;
  }
  const unsigned char* sQ = smem + wg * Q_BYTES;
  const unsigned char* sK = smem + 2 * Q_BYTES;
  const unsigned char* sV = sK + KV_BYTES;
  float s[BN / 8][4], s2[BN / 8][4], o[HD / 8][4];
  unsigned pf[K_PV][4];
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[i][e] = s2[i][e] = 0.f;
#pragma unroll
  for (int i = 0; i < HD / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
#pragma unroll
  for (int i = 0; i < K_PV; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) pf[i][e] = 0u;
  const TileDesc q_desc = TileDesc::of(sQ, 16, 1024);
  const TileDesc k_desc = TileDesc::of(sK, 16, 1024);
  const TileDesc v_desc =
      BYTES == 1 ? TileDesc::of(sV, 16, 1024) : TileDesc::of(sV, BN * 128, 1024);
  // PVss: P as a K-major tile of 64 rows in the two Q tiles' area (2 x 64 x HD bytes: BN <= 2 HD)
  const TileDesc p_desc = TileDesc::of(smem, 16, 1024);
  auto issue_s = [&](float (&acc)[BN / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < K_QK; ++kk) {
      const int block = kk / 4, within = (kk % 4) * 32;
      wgmma_ss<Elem, BN>(acc, q_desc.at(block * (64 * 128) + within),
                         k_desc.at(block * (BN * 128) + within), 1);
    }
    wgmma_commit();
  };
  auto issue_pv = [&]() {
#pragma unroll
    for (int kk = 0; kk < K_PV; ++kk) {
      if constexpr (BYTES == 1)
        wgmma_rs<Elem, HD>(o, pf[kk], v_desc.at((kk >> 2) * (HD * 128) + (kk & 3) * 32), 1);
      else
        wgmma_rs<Elem, HD>(o, pf[kk], v_desc.at(kk * 2048), 1);
    }
    wgmma_commit();
  };
  auto issue_pv_ss = [&]() {
    if constexpr (BYTES == 1 && PROG == 4) {
#pragma unroll
      for (int kk = 0; kk < K_PV; ++kk)
        wgmma_ss<Elem, HD>(o, p_desc.at((kk >> 2) * (64 * 128) + (kk & 3) * 32),
                           v_desc.at((kk >> 2) * (HD * 128) + (kk & 3) * 32), 1);
      wgmma_commit();
    }
  };
  unsigned long long issue = 0, done = 0, t_first = 0, t_last = 0;
  for (int r = 0; r < reps; ++r) {
    if (MODE == 1) named_barrier_sync(1, 256);
    if (MODE == 2 && wg == 0) named_barrier_sync(1, 256);
    const unsigned long long ta = clock64();
    wgmma_fence();
    if (PROG == 0 || PROG == 2 || PROG == 3) issue_s(s);
    if (PROG == 1 || PROG == 2) issue_pv();
    if (PROG == 3) issue_s(s2);
    if (PROG == 4) issue_pv_ss();
    if (PROG == 5) __nanosleep(1000);
    const unsigned long long tb = clock64();
    if (MODE == 2 && wg == 1) named_barrier_arrive(1, 256);
    wgmma_wait<0>();
    fence_accumulators(s);
    fence_accumulators(s2);
    fence_accumulators(o);
    const unsigned long long tc = clock64();
    if (MODE == 2) named_barrier_sync(2, 256);  // both done before the next repetition
    if (r == 0) t_first = ta;
    t_last = tc;
    if (r >= 2) {
      issue += tb - ta;
      done += tc - ta;
    }
  }
  if (MODE >= 3 && threadIdx.x == 0) *stop = 1;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) acc += s[i][0] + s2[i][1];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) acc += o[i][0];
  if ((threadIdx.x & 127) == 0) {
    unsigned long long* slot = out + (blockIdx.x * 2 + wg) * 4;
    slot[0] = issue;
    slot[1] = done;
    slot[2] = t_last - t_first;
    slot[3] = acc != 0.f;  // zeros in, zeros out: keeps the products live
  }
}
"""

SHAPES = {  # name: (C++ element, HD, BN, FLOP rate per SM per cycle)
    "bf16 d=64 BN=128": ("bf16", 64, 128, 4096),
    "bf16 d=128 BN=128": ("bf16", 128, 128, 4096),
    "bf16 d=128 BN=160": ("bf16", 128, 160, 4096),
    "bf16 d=256 BN=80": ("bf16", 256, 80, 4096),
    "e4m3 d=128 BN=128": ("e4m3", 128, 128, 8192),
    "e4m3 d=128 BN=256": ("e4m3", 128, 256, 8192),
}
PROGS = {"S": 0, "PV": 1, "S+PV": 2, "S,S": 3, "PVss": 4, "none": 5}
MODES = {"one": 0, "both": 1, "behind": 2, "softmax": 3, "exps": 4}


def flops(prog: str, hd: int, bn: int) -> int:
    s, pv = 2 * 64 * bn * hd, 2 * 64 * hd * bn
    return {"S": s, "PV": pv, "S+PV": s + pv, "S,S": 2 * s, "PVss": pv, "none": 0}[prog]


def fits(shape: str, prog: str, mode: str) -> bool:
    """Two S accumulators and O's fit a thread's 255 registers (e4m3 d = 128 BN = 256's spill);
    PVss: e4m3 (8-bit wgmma reads both operands K-major), whose P tile (64 x BN) fits Q's area
    (2 x 64 x HD bytes); none: the softmax mode only."""
    elem, hd, bn, _ = SHAPES[shape]
    if prog == "none":
        return mode in ("softmax", "exps")
    if prog == "PVss":
        return elem == "e4m3" and bn <= 2 * hd
    return prog != "S,S" or bn + hd // 2 <= 220


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=66)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    runs = [(s, p, m) for s in args.shapes for p in PROGS for m in MODES if fits(s, p, m)]
    names = [
        f"probe<cuflash::{SHAPES[s][0]}, {SHAPES[s][1]}, {SHAPES[s][2]}, {PROGS[p]}, {MODES[m]}>"
        for s, p, m in runs
    ]
    arch = "sm_90a"
    module = cp.RawModule(
        code=SOURCE,
        options=(*_kernels.COMPILE_OPTIONS, f"-arch={arch}", f"-I{_kernels.kernel_dir()}"),
        name_expressions=names,
    )
    head = ("shape", "program", "mode", "issue", "done", "period", "peak", "ex2/clk")
    lines = ["{:20s} {:7s} {:7s} {:>7s} {:>7s} {:>7s} {:>6s} {:>7s}".format(*head)]
    for s, p, m in runs:
        elem, hd, bn, rate = SHAPES[s]
        nbytes = 1 if elem == "e4m3" else 2
        smem = 2 * 64 * hd * nbytes + 2 * bn * hd * nbytes + 1024 + 16  # + slack, the flag
        fn = module.get_function(f"probe<cuflash::{elem}, {hd}, {bn}, {PROGS[p]}, {MODES[m]}>")
        fn.max_dynamic_shared_size_bytes = smem
        out = cp.zeros(sms * 2 * 4, dtype=cp.uint64)
        for _ in range(2):  # the second launch's figures
            fn((sms,), (256,), (out, cp.int32(args.reps)), shared_mem=smem)
        cp.cuda.Device().synchronize()
        o = out.get().reshape(sms, 2, 4)
        timed = args.reps - 2
        issue = statistics.median(o[:, 0, 0] / timed)
        done = statistics.median(o[:, 0, 1] / timed)
        period = statistics.median(o[:, 0, 2] / args.reps)
        peak = flops(p, hd, bn) / rate
        # softmax / exps: warpgroup 1's 32 / 64 ex2 a thread an iteration, 128 threads
        per_iter = {"softmax": 32, "exps": 64}.get(m, 0)
        ex2 = statistics.median(o[:, 1, 0] * per_iter * 128 / o[:, 1, 1]) if per_iter else 0
        lines.append(
            f"{s:20s} {p:7s} {m:7s} {issue:7.0f} {done:7.0f} {period:7.0f} {peak:6.0f} {ex2:7.2f}"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "wgmma_rate.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
