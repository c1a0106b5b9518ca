"""Determinism under other timing: the forward and the fused backward of causal windows at
d = 128 and 64 (v37's walk-test shapes), repeated, every other repeat beside a second stream's
matrix products, with each walk_heads choice in turn; every result is compared bitwise with the
first (docs/perf/NOTES.md, v39).

    python bench/probe_walk_stress.py [REPEATS]
"""

from __future__ import annotations

import sys
import time

import torch

from cuflash import testing
from cuflash._dispatch import KernelChoice

SHAPES = ((1, 16, 2100, 128, (700, 0)), (1, 40, 700, 128, (130, 0)), (1, 16, 2100, 64, (700, 0)))
NAMES = ("o", "lse", "dq", "dk", "dv")


def main() -> int:
    t0 = time.time()
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    noise = torch.cuda.Stream()
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for batch, heads, seq, d, window in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(29)
        shape = (batch, seq, heads, d)
        q, k, v, do = (torch.randn(*shape, device="cuda", generator=gen).bfloat16() for _ in "qkvd")

        def run(choice: KernelChoice) -> tuple:
            o, lse, _ = testing.attention_forward_with(choice, q, k, v, causal=True, window=window)
            *grads, plan = testing.attention_backward_with(
                choice, do, q, k, v, o, lse, causal=True, window=window
            )
            return (o, lse, *grads), plan.dkdv.aligned.launch.spec.path

        first, path = run(KernelChoice())
        differing: dict[str, list] = {}
        for i in range(repeats):
            if i % 2:
                with torch.cuda.stream(noise):
                    for _ in range(3):
                        big @ big
            out, _ = run(KernelChoice(walk_heads=(0, 1, 3, 16)[i % 4]))
            for name, a, b in zip(NAMES, out, first, strict=True):
                if not torch.equal(a, b):
                    differing.setdefault(name, []).append((i, int((a != b).sum())))
        torch.cuda.synchronize()
        nan = [bool(torch.isnan(x).any()) for x in first]
        print(
            f"{batch}x{heads}x{seq} d={d} window={window} backward {path}: {repeats} repeats, "
            f"differing {differing or 'none'}, NaN in first {nan}, {time.time() - t0:.0f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
