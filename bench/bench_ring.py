"""Weak scaling of cuflash.torch.ring_attention (context parallelism), one process per GPU.

    torchrun --nproc_per_node P bench/bench_ring.py [--tokens-per-rank 8192 16384 32768]
        [--head-dim 128] [--heads-q 32] [--heads-kv 8] [--no-causal] [--out DIR]
    torchrun --nproc_per_node 2 bench/bench_ring.py --device cpu --tokens-per-rank 64  # smoke test

For each tokens-per-rank value T: the whole sequence has N = P T tokens (B = 1, bf16 on GPUs,
float32 on the CPU), each rank its zigzag shard; forward + backward of ring_attention is timed
(CUDA events, median of --reps after a warm-up, all ranks in step), and so is the same loop with
the communication left out (every step computes against the rank's own shard: the compute
alone), whose difference is the exposed communication. Rank 0 also times single-GPU cuflash on the
dense problem of the whole length N (when it fits: --single-max-tokens) in the same run.

Parallel efficiency (docs/perf/NOTES.md): (the whole problem's FLOPs / P) / (ring time x the
single-GPU TFLOP/s at length N), FLOPs counted as bench_attention.py counts them (forward
4 N^2 d H, halved when causal; backward 2.5x). Writes ring_results.json and ring_table.txt under
--out (default $OUT, else bench_out) on rank 0 and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cuflash  # noqa: E402
import cuflash.torch as cft  # noqa: E402
from cuflash import _ring  # noqa: E402


def flops(n: int, d: int, heads: int, causal: bool) -> tuple[float, float]:
    forward = 4.0 * n * n * d * heads * (0.5 if causal else 1.0)
    return forward, 2.5 * forward


class _ComputeOnly:
    """Replaces the ring's exchange with local copies: every step computes against the rank's
    own shard, with the same calls, so that the time is the compute alone."""

    def __enter__(self):
        self._exchange = _ring._exchange

        def local(send, group, world_size, rank, tag=0):
            return [], [t.clone() for t in send], send

        _ring._exchange = local
        return self

    def __exit__(self, *exc):
        _ring._exchange = self._exchange


def timed(fn, reps: int, device: str) -> float:
    """Median seconds of fn over reps, every rank in step."""
    times = []
    for _ in range(reps):
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-rank", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--single-max-tokens", type=int, default=131072)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args()

    device = args.device
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    causal = not args.no_causal
    d, hq, hkv = args.head_dim, args.heads_q, args.heads_kv
    rows = []
    for per_rank in args.tokens_per_rank:
        n = per_rank * world
        gen = torch.Generator(device=device).manual_seed(0)

        def make(h, n=n, gen=gen):
            return torch.randn(1, n, h, d, generator=gen, device=device, dtype=dtype)

        q, k, v, do = make(hq), make(hkv), make(hkv), make(hq)
        shards = [cft.zigzag_shard(x, world, rank).contiguous() for x in (q, k, v, do)]
        leaves = [x.clone().requires_grad_() for x in shards[:3]]

        def ring_step(leaves=leaves, do_shard=shards[3]):
            for x in leaves:
                x.grad = None
            cft.ring_attention(*leaves, causal=causal).backward(do_shard)

        ring_step()  # warm-up: compiles, allocates
        ring = timed(ring_step, args.reps, device)
        with _ComputeOnly():
            ring_step()
            compute = timed(ring_step, args.reps, device)
        fwd, bwd = flops(n, d, hq, causal)
        single = None
        if rank == 0 and n <= args.single_max_tokens:
            full = [x.clone().requires_grad_() for x in (q, k, v)]

            def single_step(full=full, do=do):
                for x in full:
                    x.grad = None
                cft.attention(*full, causal=causal).backward(do)

            single_step()
            times = []
            for _ in range(args.reps):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                single_step()
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            single = statistics.median(times)
        dist.barrier()
        if rank == 0:
            single_tflops = (fwd + bwd) / single / 1e12 if single else None
            ring_tflops = (fwd + bwd) / world / ring / 1e12
            rows.append(
                dict(
                    tokens_per_rank=per_rank,
                    tokens=n,
                    ring_ms=ring * 1e3,
                    compute_ms=compute * 1e3,
                    exposed_comm_ms=max(0.0, ring - compute) * 1e3,
                    ring_tflops_per_rank=ring_tflops,
                    single_ms=single * 1e3 if single else None,
                    single_tflops=single_tflops,
                    efficiency=ring_tflops / single_tflops if single_tflops else None,
                )
            )
        del q, k, v, do, shards, leaves
    if rank == 0:
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        header = (
            f"ring_attention weak scaling, {world} x {name}; B=1, d={d}, Hq={hq}, Hkv={hkv}, "
            f"{dtype}, {'causal (zigzag)' if causal else 'not causal'}; forward + backward, "
            f"median of {args.reps}; cuflash {cuflash.__version__}"
        )
        lines = [
            header,
            "tokens/rank  tokens  ring ms  compute ms  exposed comm ms  TFLOP/s/rank  "
            "single ms  single TFLOP/s  efficiency",
        ]
        for r in rows:
            single = "-" if r["single_ms"] is None else f"{r['single_ms']:9.2f}"
            single_t = "-" if r["single_tflops"] is None else f"{r['single_tflops']:14.1f}"
            eff = "-" if r["efficiency"] is None else f"{r['efficiency']:10.2f}"
            lines.append(
                f"{r['tokens_per_rank']:11d} {r['tokens']:7d} {r['ring_ms']:8.2f} "
                f"{r['compute_ms']:11.2f} {r['exposed_comm_ms']:16.2f} "
                f"{r['ring_tflops_per_rank']:13.1f} {single:>10} {single_t:>15} {eff:>11}"
            )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ring_results.json").write_text(
            json.dumps(dict(world=world, device=name, rows=rows), indent=1)
        )
        (out / "ring_table.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
