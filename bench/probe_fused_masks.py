"""The fused Hopper backward against the split dK/dV + dQ kernels, both chosen explicitly
(KernelChoice(backward=...)), under masks: causal, sliding windows, ALiBi, grouped heads.
bf16, d = 128 (or --head-dim), interleaved rounds in one process; TFLOP/s count the visible
(query, key) pairs (backward: 10 * B * H * pairs * d, docs/DESIGN.md). Writes
probe_fused_masks.txt (probe_fused_masks_d<d>.txt for another head dim) under --out.

    python bench/probe_fused_masks.py [--out DIR] [--rounds N] [--head-dim D]
        [--tiles BM,STAGES ...] [--cases TEXT]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import time_ms  # noqa: E402
from bench_score_mods import visible_pairs  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _kernels, testing  # noqa: E402
from cuflash._dispatch import KernelChoice  # noqa: E402

# (label, batch, seq_q, seq_k, heads_q, heads_kv, causal, window, alibi[, softcap])
CASES = [
    ("dense", 4, 4096, 4096, 16, 16, False, None, False),
    ("dense", 1, 16384, 16384, 16, 16, False, None, False),
    ("causal", 16, 1024, 1024, 16, 16, True, None, False),
    ("causal", 4, 4096, 4096, 16, 16, True, None, False),
    ("causal", 1, 16384, 16384, 16, 16, True, None, False),
    ("alibi", 4, 4096, 4096, 16, 16, False, None, True),
    ("causal alibi", 4, 4096, 4096, 16, 16, True, None, True),
    ("softcap alibi", 4, 4096, 4096, 16, 16, False, None, True, 30.0),
    ("softcap", 4, 4096, 4096, 16, 16, False, None, False, 30.0),
    ("causal softcap", 4, 4096, 4096, 16, 16, True, None, False, 30.0),
    ("causal softcap alibi", 4, 4096, 4096, 16, 16, True, None, True, 30.0),
    ("window (1023, 0) softcap", 4, 4096, 4096, 16, 16, False, (1023, 0), False, 30.0),
    ("window (1023, 0) alibi", 4, 4096, 4096, 16, 16, False, (1023, 0), True),
    ("causal gqa 32/16", 4, 4096, 4096, 32, 16, True, None, False),
    ("causal gqa 32/8", 16, 1024, 1024, 32, 8, True, None, False),
    ("causal gqa 32/8", 4, 4096, 4096, 32, 8, True, None, False),
    ("causal gqa 32/8", 1, 16384, 16384, 32, 8, True, None, False),
    ("causal gqa nk = 2 nq", 4, 2048, 4096, 32, 8, True, None, False),
    ("window gqa (1023, 0)", 4, 4096, 4096, 32, 8, False, (1023, 0), False),
    ("window gqa (3071, 0)", 4, 4096, 4096, 32, 8, False, (3071, 0), False),
    ("window gqa (4095, 0)", 1, 16384, 16384, 32, 8, False, (4095, 0), False),
    ("window (255, 0)", 4, 4096, 4096, 16, 16, False, (255, 0), False),
    ("window (1023, 0)", 4, 4096, 4096, 16, 16, False, (1023, 0), False),
    ("window (4095, 0)", 1, 16384, 16384, 16, 16, False, (4095, 0), False),
    ("window (4095, 0)", 1, 32768, 32768, 16, 16, False, (4095, 0), False),
    ("window (511, 511)", 4, 4096, 4096, 16, 16, False, (511, 511), False),
    ("causal nk = 2 nq", 4, 2048, 4096, 16, 16, True, None, False),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--tiles",
        nargs="*",
        default=[],
        help="fused columns with these query tile rows and Q/dO stages too (BM,STAGES)",
    )
    parser.add_argument("--cases", default="", help="only the cases whose label contains this")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    d = args.head_dim
    fused_tiles = {}
    for text in args.tiles:
        bm, stages = (int(x) for x in text.split(","))
        bn = _kernels.FUSED_BN[_kernels.head_dim_bucket(d)]
        fused_tiles[f"{bm}/s{stages}"] = (bm, bn, stages)
    extra = "".join(f" {name:>7}" for name in fused_tiles)
    lines = [
        f"device: {torch.cuda.get_device_name()}; bf16, d = {d}, median of {args.rounds} rounds",
        f"{'case':<24} {'B':>2} {'N':>6} {'H':>7}  {'fused':>7} {'split':>7}{extra}  x split  path",
    ]
    for label, b, n, nk, hq, hkv, causal, window, alibi, *more in CASES:
        if args.cases not in label:
            continue
        softcap = more[0] if more else None
        q, do = (torch.randn(b, n, hq, d, generator=gen, device="cuda").bfloat16() for _ in "ab")
        k, v = (torch.randn(b, nk, hkv, d, generator=gen, device="cuda").bfloat16() for _ in "ab")
        options = dict(causal=causal, window=window, softcap=softcap)
        if alibi:
            options["alibi_slopes"] = torch.rand(hq, generator=gen, device="cuda")
        o, lse = cuflash.attention_forward(q, k, v, **options)
        runs = {}
        choices = {name: KernelChoice(backward=name) for name in ("fused", "split")}
        for name, tiles in fused_tiles.items():
            choices[name] = KernelChoice(backward="fused", tiles=((("dkdv", "fused"), tiles),))
        for name, choice in choices.items():
            *_, plan = testing.attention_backward_with(choice, do, q, k, v, o, lse, **options)
            runs[name] = (choice, plan.dkdv.aligned.launch.spec.path)
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (choice, _) in runs.items():
                fn = lambda c=choice: testing.attention_backward_with(  # noqa: E731
                    c, do, q, k, v, o, lse, **options
                )
                times[name].append(time_ms(fn, 2, 10, 100))
        if nk == n:
            pairs = visible_pairs(n, window, causal)
        else:  # causal, bottom-right: row i sees keys up to i + nk - n
            pairs = sum(min(nk, i + nk - n + 1) for i in range(n))
        tf = {m: 10 * b * hq * pairs * d / statistics.median(t) / 1e9 for m, t in times.items()}
        lines.append(
            f"{label:<24} {b:>2} {n:>6} {hq:>3}/{hkv:<3}  {tf['fused']:7.1f} {tf['split']:7.1f}"
            + "".join(f" {tf[name]:7.1f}" for name in fused_tiles)
            + f"  {tf['fused'] / tf['split']:6.3f}  {runs['fused'][1]}"
        )
        print(lines[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = "probe_fused_masks.txt" if d == 128 else f"probe_fused_masks_d{d}.txt"
    (Path(args.out) / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
