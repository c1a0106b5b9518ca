"""Probe: the packed TMA forward against the dense one on the same tokens, by length
distribution and tiles, to find where packed calls lose time (docs/perf/NOTES.md, v13).

    python bench/probe_varlen.py [--head-dim 64 128] [--backward]

Rows: the long-tailed batch of bench_varlen.py (65536 tokens), equal lengths (8 x 8192,
16 x 4096, 64 x 1024) packed and dense, each causal and not, with the library's tiles and with
explicit (BM, BN, stages) tiles. Forward TFLOP/s on the real pairs, median of CUDA-event timings.
--backward: the backward instead (the library's kernels; 2.5x the forward's FLOPs), packed and,
for equal lengths, dense on the same tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_varlen import draw_lengths, visible_pairs  # noqa: E402

import cuflash  # noqa: E402
from cuflash import testing  # noqa: E402
from cuflash._dispatch import DEFAULT, KernelChoice  # noqa: E402


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def backward_row(q, k, v, cu, lengths, causal, flops) -> list[str]:
    """Backward TFLOP/s of the packed call and, for equal lengths, of the dense call."""
    n_max = max(lengths)
    opts = dict(causal=causal, max_seqlen_q=n_max, max_seqlen_k=n_max)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu, cu, **opts)
    do = torch.randn_like(o)
    ms = timed(lambda: cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, **opts))
    row = [f"packed {flops / ms / 1e9:6.1f}"]
    if len(set(lengths)) == 1:
        b, shape = len(lengths), (len(lengths), n_max, *q.shape[1:])
        qd, kd, vd, dod = (x.view(shape) for x in (q, k, v, do))
        od, lsed = cuflash.attention_forward(qd, kd, vd, causal=causal)
        ms = timed(lambda: cuflash.attention_backward(dod, qd, kd, vd, od, lsed, causal=causal))
        row.append(f"dense {flops / ms / 1e9:6.1f} (B = {b})")
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    batches = {
        "long-tailed": draw_lengths(65536, 1024, 1.0, 64, 8192, 1),
        "8 x 8192": [8192] * 8,
        "16 x 4096": [4096] * 16,
        "64 x 1024": [1024] * 64,
    }
    for d in args.head_dim:
        heads = 2048 // d
        tile_sets = [("table", DEFAULT)]
        for tiles in ((128, 128, 2), (192, 128, 2)) if d == 64 else ((128, 128, 2),):
            tile_sets.append((str(tiles), KernelChoice(tiles=((("forward", "tma"), tiles),))))
        for name, lengths in batches.items():
            total = sum(lengths)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            cu = cu.cuda()
            q, k, v = (
                torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)
            )
            for causal in (False, True):
                flops = 4 * d * heads * sum(visible_pairs(n, causal) for n in lengths)
                if args.backward:
                    row = backward_row(q, k, v, cu, lengths, causal, 2.5 * flops)
                    print(f"d={d:3d} {name:12s} causal={causal!s:5s} backward " + "  ".join(row))
                    continue
                row = []
                for label, choice in tile_sets:
                    opts = dict(causal=causal, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
                    *_, plan = testing.attention_varlen_forward_with(
                        choice, q, k, v, cu, cu, **opts
                    )
                    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), cu.data_ptr())
                    ms = timed(lambda plan=plan, pointers=pointers: plan(*pointers, pointers[-1]))
                    row.append(f"{label} {flops / ms / 1e9:6.1f}")
                if len(set(lengths)) == 1:
                    b, n = len(lengths), lengths[0]
                    qd, kd, vd = (x.view(b, n, heads, d) for x in (q, k, v))
                    ms = timed(
                        lambda qd=qd, kd=kd, vd=vd: cuflash.attention_forward(
                            qd, kd, vd, causal=causal
                        )
                    )
                    row.append(f"dense {flops / ms / 1e9:6.1f}")
                print(f"d={d:3d} {name:12s} causal={causal!s:5s} " + "  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
