"""Probe: the persistent kernels' order of work items under windows (cuflash/_dispatch.py,
walk_heads; docs/perf/NOTES.md, v31): the TMA forward with decode_paired_work's order (chunk
0) against the block-major order over chunks of C heads, and the library's choice, in
interleaved rounds on the same inputs, beside the simulated walk's balance (the mean block's
work over the busiest block's).

    python bench/probe_walk.py [--rounds 5] [--chunks 0 1 4 16] [--out DIR]

bf16, bshd; TFLOP/s on the visible pairs (4 B H pairs d).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_score_mods import visible_pairs  # noqa: E402
from probe_forward import row  # noqa: E402

from cuflash import _dispatch, testing  # noqa: E402
from cuflash._dispatch import KernelChoice  # noqa: E402

# (label, d, B, H, N, window): the masks issue's row first (a causal window of 4096 keys at 16k).
# Windows only: the other instances have no chunked order (walk_heads).
CASES = [
    ("win 4095 causal", 128, 1, 16, 16384, (4095, 0)),
    ("win 4095 causal", 128, 1, 16, 32768, (4095, 0)),
    ("win 2047,2047", 128, 1, 16, 16384, (2047, 2047)),
    ("win 1023 causal", 128, 4, 16, 4096, (1023, 0)),
    ("win 1023 causal", 64, 1, 32, 16384, (1023, 0)),
    ("win 4095 causal", 256, 1, 8, 16384, (4095, 0)),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", nargs="+", type=int, default=[0, 1, 4, 16])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"{torch.cuda.get_device_name()}, bf16 TFLOP/s on visible pairs"]
    for label, d, b, h, n, window in CASES:
        q, k, v = (
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(3)
        )
        causal = window[1] == 0
        options = {"causal": causal, "window": window}
        pairs = visible_pairs(n, window, causal)
        flops = 4 * b * h * pairs * d
        methods, balance = {}, []
        for chunk in [None, *args.chunks]:
            choice = KernelChoice(walk_heads=chunk)
            *_, plan = testing.attention_forward_with(choice, q, k, v, **options)
            launch = plan.runs.aligned.launch
            name = "library" if chunk is None else f"C={chunk}"
            if chunk is None:
                name += f"(C={launch.walk_heads})"
            pointers = [x.data_ptr() for x in (q, k, v)]
            methods[name] = lambda plan=plan, pointers=pointers: plan(*pointers)
            if chunk is not None:
                costs = _dispatch._row_block_costs(
                    _problem(q, k, v, options), launch.spec, launch.num_blocks, launch.row_shift
                )
                heads, grid = b * h, launch.grid
                span = _dispatch.walk_makespan(costs, heads, launch.paired, chunk, grid)
                balance.append(f"C={chunk} {sum(costs) * heads / grid / span:.3f}")
        title = f"d={d} B={b} H={h} N={n} {label}"
        lines.append(f"{title}: simulated balance " + ", ".join(balance))
        print(lines[-1], flush=True)
        lines.append(row(title, methods, flops, args.rounds))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe_walk.txt").write_text("\n".join(lines) + "\n")
    return 0


def _problem(q, k, v, options):
    from cuflash import _validate

    return _validate.check_forward(q, k, v, None, **options)[0]


if __name__ == "__main__":
    sys.exit(main())
