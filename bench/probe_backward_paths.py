"""Probe: the backward's time and the dK/dV path the library takes, for one tree, with ALiBi and
without (the v30 A/B of ALiBi's backward at d = 256, docs/perf/NOTES.md; run it once per checkout
with PYTHONPATH=<checkout> to compare trees).

    PYTHONPATH=. python bench/probe_backward_paths.py [HEAD_DIM] [LABEL]

bf16, B = 4, N = 4096, H = 16 (Hq = Hkv); rows: dense, ALiBi, causal ALiBi, ALiBi with a window
(1024, 0), causal. Each row: the better of two means of 10 back-to-back calls after 3
warm-up calls (CUDA events), in ms, with the path of the dK/dV launch (_dispatch) in brackets.
"""

from __future__ import annotations

import sys

import torch

import cuflash
from cuflash import testing
from cuflash._dispatch import KernelChoice


def mean_ms(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    label = sys.argv[2] if len(sys.argv) > 2 else ""
    torch.manual_seed(0)
    b, n, h = 4, 4096, 16
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    slopes = torch.rand(h, device="cuda", dtype=torch.float32)
    cases = {
        "dense": {},
        "alibi": {"alibi_slopes": slopes},
        "alibi_causal": {"alibi_slopes": slopes, "causal": True},
        "alibi_window": {"alibi_slopes": slopes, "window": (1024, 0)},
        "causal": {"causal": True},
    }
    out = []
    for name, options in cases.items():
        o, lse = cuflash.attention_forward(q, k, v, **options)
        *_, plan = testing.attention_backward_with(KernelChoice(), do, q, k, v, o, lse, **options)
        path = plan.dkdv.aligned.launch.spec.path
        call = lambda: cuflash.attention_backward(do, q, k, v, o, lse, **options)  # noqa: E731
        ms = min(mean_ms(call) for _ in range(2))
        out.append(f"{name}:bwd={ms:.3f}({path})")
    print(label, d, " ".join(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
