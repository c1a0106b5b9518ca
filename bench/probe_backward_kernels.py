"""Probe: where a backward call's time goes, kernel by kernel (torch.profiler's CUDA times).

    python bench/probe_backward_kernels.py [--head-dim 256] [--seq 4096 16384] [--causal]
        [--backward fused|split] [--calls 5]

bf16, B x N = 16k tokens (B = 16384 / N, at least 1), H = 8 (Hq = Hkv), as the benchmark's grid.
For each N: the mean time of each kernel over `--calls` backward calls (after warm-up), its
share of the call, and the TFLOP/s of the whole call (2.5 x the forward's 4 B H N^2 d, halved
when causal). CUFLASH_TREE=DIR imports DIR's cuflash instead of this tree's.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.environ.get("CUFLASH_TREE", str(Path(__file__).resolve().parent.parent)))
from cuflash import testing  # noqa: E402
from cuflash._dispatch import KernelChoice  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", choices=("fused", "split"), default=None)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    choice = KernelChoice(backward=args.backward)
    d, h = args.head_dim, args.heads
    for n in args.seq:
        b = max(1, 16384 // n)
        q, k, v, do = (
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        o, lse = testing.attention_forward_with(KernelChoice(), q, k, v, causal=args.causal)[:2]

        def call():
            return testing.attention_backward_with(choice, do, q, k, v, o, lse, causal=args.causal)

        plan = call()[3]
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
        times: dict[str, float] = collections.defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                name = event.name.split("<")[0].split("(")[0]
                times[name] += event.device_time / args.calls  # microseconds
        total = sum(times.values())
        flops = 2.5 * 4 * b * h * n * n * d * (0.5 if args.causal else 1.0)
        path = plan.dkdv.aligned.launch.spec.path
        print(
            f"d={d} N={n} B={b} H={h} causal={args.causal} dkdv path {path}: "
            f"{total:.1f} us a call, {flops / total / 1e6:.1f} TFLOP/s (kernel time)"
        )
        for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"    {name:48s} {us:9.1f} us  {100 * us / total:5.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
