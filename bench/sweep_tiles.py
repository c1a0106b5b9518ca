"""Times tile configurations of the tensor-core kernels, one representative shape each.

    python bench/sweep_tiles.py [--dtype bfloat16] [--seq 4096]

For each candidate (family, head dim, tiles) the instance is compiled, checked against PyTorch
SDPA's output (a broken variant must not win), and timed with CUDA events. The table's current
entry is timed too, so the printout reads as "current vs candidates". Used to pick the tile table
in cuflash/_kernels.py; results are recorded in bench/NOTES.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_attention import time_ms  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _kernels  # noqa: E402

CANDIDATES = {
    "forward": {
        64: [(128, 64, 4), (128, 128, 8), (64, 64, 4), (128, 64, 8), (128, 32, 4)],
        128: [(128, 32, 4), (128, 64, 4), (64, 64, 4), (128, 64, 8), (128, 32, 8), (64, 32, 4)],
        256: [(64, 32, 4), (64, 64, 4), (128, 32, 8), (64, 32, 2), (128, 64, 8)],
    },
    "dq": {
        64: [(64, 64, 4), (128, 64, 8), (64, 128, 4), (64, 32, 4)],
        128: [(64, 64, 4), (64, 32, 4), (128, 64, 8), (128, 32, 8)],
        256: [(64, 16, 4), (64, 32, 4), (128, 32, 8), (32, 32, 2)],
    },
    "dkdv": {
        64: [(64, 64, 4, 1), (32, 64, 4, 1), (64, 128, 8, 1), (128, 64, 4, 1)],
        128: [(32, 64, 4, 1), (64, 64, 4, 1), (32, 128, 8, 1), (64, 128, 8, 1), (16, 64, 4, 1)],
        256: [(32, 32, 4, 2), (32, 64, 8, 2), (16, 32, 4, 2), (64, 32, 4, 2)],
    },
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    dt = getattr(torch, args.dtype)
    rows = []
    for d in (64, 128, 256):
        b, h, n = max(1, 16384 // args.seq), 2048 // d, args.seq
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dt) for _ in range(4))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=args.causal)
        flops = 4.0 * b * h * n * n * d / (2 if args.causal else 1)
        for family, variants in CANDIDATES.items():
            for tiles in variants[d]:
                _kernels.set_tile_override(family, args.dtype, d, tiles)
                try:
                    o, lse = cuflash.attention_forward(q, k, v, causal=args.causal, layout="bhsd")
                    err = (o.float() - ref).abs().max().item()
                    if family == "forward":
                        ms = time_ms(
                            lambda: cuflash.attention_forward(
                                q, k, v, causal=args.causal, layout="bhsd"
                            ),
                            2,
                            5,
                            50,
                        )
                        tf = flops / ms / 1e9
                    else:
                        ms = time_ms(
                            lambda: cuflash.attention_backward(
                                do, q, k, v, o, lse, causal=args.causal, layout="bhsd"
                            ),
                            2,
                            5,
                            50,
                        )
                        tf = 2.5 * flops / ms / 1e9
                    note = "ok" if err < 0.05 and math.isfinite(err) else f"WRONG err={err:.3g}"
                    rows.append(
                        f"{family:8s} d={d:3d} tiles={tiles!s:16s} {ms:8.3f} ms "
                        f"{tf:7.1f} TFLOP/s  {note}"
                    )
                except Exception as exc:
                    rows.append(
                        f"{family:8s} d={d:3d} tiles={tiles!s:16s} failed: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                    )
                finally:
                    _kernels.set_tile_override(family, args.dtype, d, None)
                print(rows[-1], flush=True)
    print(
        "\n".join(
            [
                "",
                f"sweep {args.dtype} N={args.seq} causal={args.causal} "
                "(backward rows time the whole backward; TFLOP/s at 2.5x forward FLOPs)",
                *rows,
            ]
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
