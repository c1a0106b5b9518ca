"""The masks issue's speed rows: sliding windows, softcap and ALiBi against dense attention, and
against PyTorch FlexAttention (compiled, the same mask_mod / score_mod) and JAX's cuDNN attention
with a local window, where they run. bf16 throughout.

TFLOP/s count the visible (query, key) pairs only: forward 4 * B * H * pairs * d, backward 2.5
times that (docs/DESIGN.md). Every timing runs back to back for at least 200 ms (the GPU's clock
falls within that under these kernels' power: the window forward at 16k ran at 1.98 GHz over 20
ms and 1.5-1.8 GHz over 1.5 s; docs/perf/NOTES.md, v31), JAX's too. --baseline DIR adds another
checkout's cuflash (its forward and backward, and the ratios). Writes score_mods.json and
score_mods_table.txt under --out.

    python bench/bench_score_mods.py [--out DIR] [--quick] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import load_baseline, time_ms  # noqa: E402

import cuflash  # noqa: E402


def visible_pairs(n: int, window: tuple[int, int] | None, causal: bool) -> int:
    """Pairs (i, j) with j in [i - left, i + right] ∩ [0, n) (square, bottom-right = top-left)."""
    left, right = window if window is not None else (n, n)
    right = 0 if causal else right
    total = 0
    for i in range(n):
        total += min(n - 1, i + right) - max(0, i - left) + 1
    return total


def inputs(b: int, n: int, h: int, d: int, gen: torch.Generator):
    q, k, v, do = (
        torch.randn(b, n, h, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(4)
    )
    return q, k, v, do


def cuflash_times(q, k, v, do, options, module=cuflash) -> tuple[float, float]:
    o, lse = module.attention_forward(q, k, v, **options)
    fwd = time_ms(lambda: module.attention_forward(q, k, v, **options), 3, 10, 200)
    bwd = time_ms(lambda: module.attention_backward(do, q, k, v, o, lse, **options), 3, 10, 200)
    return fwd, bwd


def flex_times(q, k, v, do, window, causal, softcap, slopes) -> tuple[float, float]:
    """FlexAttention, compiled, with the same mask and score modifiers ((B, H, N, d) layout)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    n = qt.shape[2]
    left = window[0] if window else n
    right = 0 if causal else (window[1] if window else n)

    def mask_mod(b, h, qi, kj):
        return (kj >= qi - left) & (kj <= qi + right)

    def score_mod(score, b, h, qi, kj):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (qi - kj).abs()
        return score

    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cuda")
    flex = torch.compile(flex_attention)
    mod = score_mod if (softcap is not None or slopes is not None) else None

    def fwd():
        return flex(qt, kt, vt, score_mod=mod, block_mask=block_mask)

    qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))

    def fwd_bwd():
        out = flex(qg, kg, vg, score_mod=mod, block_mask=block_mask)
        out.backward(dot)

    t_fwd = time_ms(fwd, 3, 10, 200)
    t_both = time_ms(fwd_bwd, 3, 10, 200)
    return t_fwd, t_both - t_fwd


def jax_cudnn_forward(q, k, v, window) -> float:
    """jax.nn.dot_product_attention with implementation="cudnn" and a causal local window."""
    import time

    import jax

    qj, kj, vj = (jax.dlpack.from_dlpack(x) for x in (q, k, v))
    f = jax.jit(
        lambda a, b, c: jax.nn.dot_product_attention(
            a, b, c, is_causal=True, local_window_size=window, implementation="cudnn"
        )
    )
    f(qj, kj, vj).block_until_ready()
    reps, elapsed = 10, 0.0
    while elapsed < 0.2:  # as long as time_ms's timings: the clock settles alike
        reps *= 2
        start = time.perf_counter()
        for _ in range(reps):
            out = f(qj, kj, vj)
        out.block_until_ready()
        elapsed = time.perf_counter() - start
    return elapsed / reps * 1e3


def tflops(b: int, h: int, pairs: int, d: int, ms: float, backward: bool = False) -> float:
    return 4 * b * h * pairs * d * (2.5 if backward else 1.0) / (ms * 1e-3) / 1e12


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--quick", action="store_true", help="skip N = 32k")
    parser.add_argument("--peers", nargs="*", default=["flex", "jax"])
    parser.add_argument("--baseline", default=None, help="another checkout's cuflash too")
    args = parser.parse_args(argv)
    base = load_baseline(args.baseline, "cuflash_baseline") if args.baseline else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def run(name, b, n, h, d, causal=False, window=None, softcap=None, alibi=False, peers=()):
        q, k, v, do = inputs(b, n, h, d, gen)
        slopes = torch.rand(h, generator=gen, device="cuda") * 0.1 if alibi else None
        options = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
        pairs = visible_pairs(n, window, causal)
        fwd, bwd = cuflash_times(q, k, v, do, options)
        row = {
            "name": name,
            "shape": [b, n, h, d],
            "cuflash_fwd": tflops(b, h, pairs, d, fwd),
            "cuflash_bwd": tflops(b, h, pairs, d, bwd, True),
        }
        if base is not None:
            b_fwd, b_bwd = cuflash_times(q, k, v, do, options, base)
            row["base_fwd"] = tflops(b, h, pairs, d, b_fwd)
            row["base_bwd"] = tflops(b, h, pairs, d, b_bwd, True)
        if "flex" in peers:
            try:
                f_fwd, f_bwd = flex_times(q, k, v, do, window, causal, softcap, slopes)
                row["flex_fwd"] = tflops(b, h, pairs, d, f_fwd)
                row["flex_bwd"] = tflops(b, h, pairs, d, f_bwd, True)
            except Exception as exc:  # a peer that does not run here is reported, not fatal
                row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if "jax" in peers and window is not None and causal and not softcap and not alibi:
            try:
                row["jax_cudnn_fwd"] = tflops(b, h, pairs, d, jax_cudnn_forward(q, k, v, window))
            except Exception as exc:
                row["jax_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()

    peers = tuple(args.peers)
    run("dense causal 4k d128", 4, 4096, 16, 128, causal=True)
    for n in (16384,) + (() if args.quick else (32768,)):
        run(f"window (4095,0) {n // 1024}k d128", 1, n, 16, 128, True, (4095, 0), peers=peers)
    run("dense 4k d128", 4, 4096, 16, 128)
    run("softcap 30 4k d128", 4, 4096, 16, 128, softcap=30.0, peers=peers)
    run("alibi 4k d128", 4, 4096, 16, 128, alibi=True, peers=peers)
    run("dense 4k d64", 4, 4096, 16, 64)
    run("softcap 30 4k d64", 4, 4096, 16, 64, softcap=30.0)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "score_mods.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"{'TFLOP/s (visible pairs), bf16':34s} {'fwd':>7s} {'bwd':>7s} {'flex f':>7s} "
        f"{'flex b':>7s} {'jax f':>7s} {'x flex f':>8s} {'x flex b':>8s} {'x jax f':>8s}"
        + (f" {'base f':>7s} {'base b':>7s} {'x base f':>8s} {'x base b':>8s}" if base else "")
    ]
    for r in rows:

        def get(key):
            return r.get(key, float("nan"))

        fwd, bwd = get("cuflash_fwd"), get("cuflash_bwd")
        line = (
            f"{r['name']:34s} {fwd:7.1f} {bwd:7.1f} "
            f"{get('flex_fwd'):7.1f} {get('flex_bwd'):7.1f} {get('jax_cudnn_fwd'):7.1f} "
            f"{fwd / get('flex_fwd'):8.2f} {bwd / get('flex_bwd'):8.2f} "
            f"{fwd / get('jax_cudnn_fwd'):8.2f}"
        )
        if base:
            line += (
                f" {get('base_fwd'):7.1f} {get('base_bwd'):7.1f}"
                f" {fwd / get('base_fwd'):8.2f} {bwd / get('base_bwd'):8.2f}"
            )
        lines.append(line)
    table = "\n".join(lines)
    (out / "score_mods_table.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
