"""Probe: the softcap forward of this tree against other checkouts (--baseline), beside the dense
forward, in interleaved rounds on the same inputs (docs/perf/NOTES.md, v25: the softcap's cost).

    python bench/probe_softcap.py --baseline DIR ... [--rounds 7] [--out DIR]

bf16, the benchmark's shapes at N = 4096 (B = 4, H = 2048 / d, bshd), not causal, softcap 30.
First, tanh.approx.f32's error against float64 over bands of |y|; then each checkout's error on
small float16 and bfloat16 calls with softcaps of 1, 5, 30 and 50 whose scores spread around the
tanh's knee (S / c ~ N(0, 0.3^2), N(0, 1), N(0, 3^2)), as a fraction of the policy's bound
(cuflash.testing), so that a faster form that loses precision shows it in the same table
(--errors-only stops there). TFLOP/s as bench_attention.py counts them; each entry is the median
over rounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import load_baseline  # noqa: E402
from probe_forward import row  # noqa: E402

import cuflash  # noqa: E402
from cuflash import reference, testing  # noqa: E402


def errors(module, dtype: str, softcap: float, spread: float, d: int = 128) -> str:
    """The policy's verdict (cuflash.testing.compare) on a (2, 3, 300, d) call whose scores
    S / c spread as N(0, spread^2) around the tanh's knee: error / bound for o and lse."""
    rng = np.random.default_rng(1)
    shape = (2, 300, 3, d)
    sigma = (spread * softcap) ** 0.5  # scale * q . k has standard deviation sigma^2
    q, k, v = (rng.standard_normal(shape) * s for s in (sigma, sigma, 1.0))
    tdt = getattr(torch, dtype)
    qt, kt, vt = (torch.tensor(x, dtype=tdt, device="cuda") for x in (q, k, v))
    o, lse = module.attention_forward(qt, kt, vt, softcap=softcap)
    qr, kr, vr = (x.float().cpu().double().numpy() for x in (qt, kt, vt))
    bhsd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (qr, kr, vr)]
    scale = reference.default_scale(d)
    o_ref, lse_ref = testing.naive_forward(
        *bhsd, causal=False, scale=scale, dtype="float64", softcap=softcap
    )
    o_naive, lse_naive = testing.naive_forward(
        *bhsd, causal=False, scale=scale, dtype=dtype, softcap=softcap
    )
    o_got = o.float().cpu().double().numpy().transpose(0, 2, 1, 3)
    lse_got = lse.float().cpu().double().numpy()
    co = testing.compare("o", o_got, o_ref, o_naive, dtype)
    cl = testing.compare("lse", lse_got, lse_ref, lse_naive, dtype)
    return f"o {co.error / co.bound:5.3f} of bound, lse {cl.error / cl.bound:5.3f} of bound"


def tanh_profile() -> list[str]:
    """The kernels' tanh (tanh.approx.f32, cuflash.testing.kernel_tanh): its absolute and relative
    error against float64 over |y| bands."""
    import cupy as cp

    y = cp.linspace(-12, 12, 1 << 24, dtype=cp.float32)
    t = testing.kernel_tanh(y).get().astype(np.float64)
    yh = y.get().astype(np.float64)
    exact = np.tanh(yh)
    lines = []
    for lo, hi in ((0, 0.01), (0.01, 0.5), (0.5, 1), (1, 2), (2, 4), (4, 8), (8, 12)):
        sel = (np.abs(yh) >= lo) & (np.abs(yh) < hi)
        ab = np.abs(t[sel] - exact[sel])
        rel = ab / np.maximum(np.abs(exact[sel]), 1e-300)
        lines.append(
            f"tanh.approx.f32 |y| in [{lo}, {hi}): max abs {ab.max():.2e}, max rel {rel.max():.2e}"
            f" (2^{np.log2(rel.max()):.1f}), max |1 - |t|| ratio "
            f"{(ab / np.maximum(1 - np.abs(exact[sel]), 1e-300)).max():.2e}"
        )
        print(lines[-1], flush=True)
    return lines


def checkouts(roots: list[str]) -> dict:
    """This tree's cuflash, then each checkout's under its directory's name."""
    modules = {"cuflash": cuflash}
    for i, root in enumerate(roots):
        modules[Path(root).name] = load_baseline(root, f"cuflash_baseline_{i}")
    return modules


def write(out: str | None, name: str, lines: list[str]) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--head-dim", nargs="+", type=int, default=[128, 64])
    parser.add_argument("--out", default=None)
    parser.add_argument("--errors-only", action="store_true")
    args = parser.parse_args()
    modules = checkouts(args.baseline)
    lines = [f"{torch.cuda.get_device_name()}, bf16 forward TFLOP/s, N = 4096"]
    lines += tanh_profile()
    for name, module in modules.items():
        for dtype in ("float16", "bfloat16"):
            for cap in (1.0, 5.0, 30.0, 50.0):
                for spread in (0.3, 1.0, 3.0):
                    line = f"error {name:14s} {dtype:9s} softcap {cap:4.0f} spread {spread}: "
                    line += errors(module, dtype, cap, spread)
                    print(line, flush=True)
                    lines.append(line)
    if args.errors_only:
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 4096
    for d in args.head_dim:
        b, h = 16384 // n, 2048 // d
        q, k, v = (
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(3)
        )
        flops = 4 * b * h * n * n * d
        for cap in (None, 30.0):
            options = {} if cap is None else {"softcap": cap}
            methods = {
                name: (lambda m=module, o=options: m.attention_forward(q, k, v, **o))
                for name, module in modules.items()
            }
            label = f"d={d} {'dense' if cap is None else 'softcap 30'}"
            lines.append(row(label, methods, flops, args.rounds))
    write(args.out, "probe_softcap.txt", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
