"""Probe: the backward's time with the table's tiles against alternatives for one kernel family
and path (KernelChoice tiles), on the benchmark's 4k point: the speed side of choosing tiles
whose runtime binaries use no local memory (bench/probe_local_memory.py, docs/perf/NOTES.md v16).

    python bench/probe_backward_tiles.py

bf16, B = 4, N = 4096, H = 16, not causal; median of 15 CUDA-event timings (probe_varlen.timed)
of the whole backward (preprocess, dK/dV, dQ), TFLOP/s as the benchmark counts them (2.5x the
forward's 4 N^2 d).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_varlen import timed  # noqa: E402

import cuflash  # noqa: E402
from cuflash import testing  # noqa: E402
from cuflash._dispatch import DEFAULT, KernelChoice  # noqa: E402

# (label, head dim, options, (family, path), [alternative tiles])
CASES = [
    ("d=32 dense", 32, {}, ("dkdv", "mma"), [(64, 32, 4, 2), (16, 64, 4, 1)]),
    ("d=192 dense", 192, {}, ("dkdv", "mma"), [(32, 32, 4, 2), (64, 16, 4, 4), (32, 16, 4, 4)]),
    ("d=128 alibi", 128, {"alibi": True}, ("dkdv", "tma"), [(64, 64, 2)]),
    ("d=256 softcap", 256, {"softcap": 30.0}, ("dkdv", "mma"), [(16, 32, 4, 2), (32, 16, 4, 4)]),
    ("d=224 softcap", 224, {"softcap": 30.0}, ("dq", "mma"), [(64, 16, 4)]),
]


def main() -> int:
    b, n, h = 4, 4096, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, d, extra, key, alternatives in CASES:
        q, k, v, do = (
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(4)
        )
        slopes = torch.rand(h, device="cuda", generator=gen) * 0.1 if extra.get("alibi") else None
        options = dict(softcap=extra.get("softcap"))
        o, lse = cuflash.attention_forward(q, k, v, alibi_slopes=slopes, **options)
        flops = 2.5 * 4 * b * h * n * n * d
        row = []
        for tiles in [None, *alternatives]:
            choice = DEFAULT if tiles is None else KernelChoice(tiles=((key, tiles),))
            *_, plan = testing.attention_backward_with(
                choice, do, q, k, v, o, lse, alibi_slopes=slopes, **options
            )
            pointers = [x.data_ptr() for x in (do, q, k, v, o, lse)]
            if slopes is not None:
                pointers.append(slopes.data_ptr())
            ms = timed(lambda plan=plan, pointers=pointers: plan(*pointers), reps=15)
            row.append(f"{'table' if tiles is None else str(tiles)} {flops / ms / 1e9:6.1f}")
        print(f"{label:14s} {key}: " + "  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
