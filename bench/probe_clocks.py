"""Probe: the SM clock and the board's power while one call runs back to back (bf16, d = 128,
B = 4, N = 4096, H = 16 by default): the backward of this tree's cuflash, another checkout's
(--baseline) and SDPA's cuDNN backend, both forwards, and an 8192^3 bf16 matrix product.
nvidia-smi samples clocks.sm and power.draw every 20 ms in the background; each workload runs for
--seconds after a warm-up. Prints, per workload: the time of a call, TFLOP/s (the forward's
4 B H N^2 d; the backward's 2.5 times that) and the mean / min SM clock and power over its samples.

    python bench/probe_clocks.py [--baseline DIR] [--seconds 2] [--causal] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import load_baseline  # noqa: E402

import cuflash  # noqa: E402


def sampled(fn, seconds: float) -> tuple[float, list[tuple[float, float]]]:
    """fn run back to back for `seconds`: (ms a call, [(sm MHz, W)] sampled meanwhile)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(
        [
            "nvidia-smi",
            "--query-gpu=clocks.sm,power.draw",
            "--format=csv,noheader,nounits",
            "-lms",
            "20",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    calls, start = 0, time.perf_counter()
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    out = smi.communicate()[0]
    samples = []
    for line in out.strip().splitlines():
        try:
            mhz, watts = (float(x) for x in line.split(","))
            samples.append((mhz, watts))
        except ValueError:
            pass
    return begin.elapsed_time(end) / calls, samples[2:]  # the first samples precede the load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    base = load_baseline(args.baseline) if args.baseline else None
    d, n, h = args.head_dim, args.seq, 16
    b = max(1, 16384 // n)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = cuflash.attention_forward(q, k, v, causal=args.causal)
    flops = 2.5 * 4 * b * h * n * n * d / (2 if args.causal else 1)
    work = {
        "cuflash backward": lambda: cuflash.attention_backward(
            do, q, k, v, o, lse, causal=args.causal
        ),
    }
    if base is not None:
        work["baseline backward"] = lambda: base.attention_backward(
            do, q, k, v, o, lse, causal=args.causal
        )
    qt, kt, vt, dot = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v, do))

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
    work["cudnn backward"] = lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
    work["cuflash forward"] = lambda: cuflash.attention_forward(q, k, v, causal=args.causal)

    def cudnn_forward():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)

    work["cudnn forward"] = cudnn_forward
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    work["matmul 8192^3"] = lambda: a @ a
    print(
        f"{torch.cuda.get_device_name()}; bf16 d = {d}, B = {b}, N = {n}, H = {h}, "
        f"causal {args.causal}; {args.seconds} s each"
    )
    for name, fn in work.items():
        ms, samples = sampled(fn, args.seconds)
        count = flops / 2.5 if name.endswith("forward") else flops
        tf = (2 * 8192**3 if name.startswith("matmul") else count) / ms / 1e9
        mhz = [s[0] for s in samples] or [float("nan")]
        watts = [s[1] for s in samples] or [float("nan")]
        print(
            f"{name:<24} {ms:8.3f} ms {tf:7.1f} TFLOP/s  SM {sum(mhz) / len(mhz):6.0f} MHz "
            f"(min {min(mhz):.0f})  {sum(watts) / len(watts):5.0f} W (max {max(watts):.0f})  "
            f"{len(samples)} samples",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
