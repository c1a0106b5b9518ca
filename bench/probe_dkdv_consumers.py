"""Probe: does the packed TMA dK/dV kernel lose to the dense one on equal lengths only with two
consumer warpgroups? (docs/perf/NOTES.md, v19: the packed kernel's waits for its own wgmma groups
are longer; one guess is that its two consumers' products coincide more often.)

    python bench/probe_dkdv_consumers.py [--rounds 5]

bf16, d = 128, 16 sequences of 4096 rows, causal and not: the backward (preprocess, dK/dV, dQ)
packed and dense on the same tokens, with the table's dK/dV tiles (64, 128, 2) (two consumer
warpgroups of 64 keys) and with (64, 64, 2) (one). The dQ kernel and the preprocess are the same
in every column, so the packed / dense ratio of one tile choice shows what its dK/dV loses.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import testing  # noqa: E402
from cuflash._dispatch import KernelChoice  # noqa: E402


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def packed_plan(choice, do, q, k, v, o, lse, cu, longest, causal):
    *_, plan = testing.attention_varlen_backward_with(
        choice,
        do,
        q,
        k,
        v,
        o,
        lse,
        cu,
        cu,
        causal=causal,
        max_seqlen_q=longest,
        max_seqlen_k=longest,
    )
    pointers = [x.data_ptr() for x in (do, q, k, v, o, lse, cu, cu)]
    return lambda: plan(*pointers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    b, n, h, d = 16, 4096, 16, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn((b * n, h, d), generator=gen, device="cuda").to(torch.bfloat16)
        for _ in range(4)
    )
    cu = torch.arange(0, b * n + 1, n, device="cuda", dtype=torch.int32)
    dense = [x.view(b, n, h, d) for x in (q, k, v, do)]
    for causal in (False, True):
        flops = 2.5 * 4 * d * h * b * (n * (n + 1) // 2 if causal else n * n)
        o, lse = testing.attention_varlen_forward_with(
            KernelChoice(), q, k, v, cu, cu, causal=causal, max_seqlen_q=n, max_seqlen_k=n
        )[:2]
        od, lsed = testing.attention_forward_with(KernelChoice(), *dense[:3], causal=causal)[:2]
        methods = {}
        for tiles in ((64, 128, 2), (64, 64, 2)):
            choice = KernelChoice(tiles=((("dkdv", "tma"), tiles),))
            methods[f"packed {tiles}"] = packed_plan(choice, do, q, k, v, o, lse, cu, n, causal)
            *_, plan = testing.attention_backward_with(
                choice, dense[3], *dense[:3], od, lsed, causal=causal
            )
            pointers = [x.data_ptr() for x in (dense[3], *dense[:3], od, lsed)]
            methods[f"dense {tiles}"] = lambda plan=plan, pointers=pointers: plan(*pointers)
        times = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():
                times[name].append(timed(fn))
        tflops = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
        line = "  ".join(f"{name} {value:6.1f}" for name, value in tflops.items())
        ratios = "  ".join(
            f"{tiles}: packed / dense {tflops[f'packed {tiles}'] / tflops[f'dense {tiles}']:.3f}"
            for tiles in ((64, 128, 2), (64, 64, 2))
        )
        print(f"causal={causal!s:5s} backward TFLOP/s  {line}\n    {ratios}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
