"""Probe: the FP8 forward (cuflash.attention_forward_fp8) against the bf16 forward of this tree and
SDPA's cuDNN bf16 forward, in interleaved rounds on the same values (docs/perf/NOTES.md, v27), and
its error against the float64 reference of the dequantised inputs.

    python bench/probe_fp8_forward.py [--head-dim 128 256] [--seq 4096 16384] [--causal]
        [--config table 128x128x2:serial ...] [--baseline DIR ...] [--rounds 5] [--out DIR]

bshd, B = 16384 / N, H = 2048 / d, inputs N(0, 1) (e4m3 for FP8, descale factors 1). TFLOP/s as
bench_attention.py counts them (4 B H d N^2, half for causal). Rows: "fp8" the whole call (V^T's
pass and the forward), "fp8 kernel" the forward launch alone (its plan's Run), "vt" V^T's pass
alone (in microseconds), "bf16" cuflash.attention_forward, "cudnn" SDPA's cuDNN backend (bhsd
copies), and per --baseline checkout its whole FP8 call (a column named after its directory).
A config is BMxBNxSTAGES:SCHEDULE[:reg] (probe_forward_tiles.py's spelling) or "table".
The error table: B = 1, H = 2, N = 1024, each head dim, causal and not: max |o - ref| / max |ref|,
relative RMS error, and the naive FP8 computation's (testing.naive_forward_fp8) for comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import load_baseline, time_ms  # noqa: E402
from probe_forward import row  # noqa: E402
from probe_forward_tiles import parse  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _cuda, _dispatch, _validate, reference, testing  # noqa: E402


def fp8_plan(q, k, v, causal: bool, config: str) -> _cuda.Fp8ForwardPlan:
    """The FP8 forward's plan for these arrays with `config`'s tiles and loop."""
    problem, qi, ki, vi, infos = _validate.check_fp8_forward(q, k, v, (None,) * 3, causal=causal)
    choice = _dispatch.DEFAULT
    if config != "table":
        tiles, schedule, o_store = parse(config)
        choice = _dispatch.KernelChoice(
            tiles=((("forward", "tma"), tiles),), schedule=schedule, o_store=o_store
        )
    return _cuda.Fp8ForwardPlan(problem, qi, ki, vi, infos, choice)


def speed_rows(args) -> list[str]:
    lines = [f"{torch.cuda.get_device_name()}, forward TFLOP/s (vt: microseconds)"]
    bases = {
        Path(root).name: load_baseline(root, f"cuflash_baseline_{i}")
        for i, root in enumerate(args.baseline)
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d in args.head_dim:
        for n in args.seq:
            b, h = 16384 // n, 2048 // d
            q, k, v = (
                torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(3)
            )
            q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
            qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            for causal in (False, True) if args.causal else (False,):
                flops = 4 * b * h * n * n * d // (2 if causal else 1)
                methods = {}
                vt_ms = {}
                for config in args.config:
                    try:
                        plan = fp8_plan(q8, k8, v8, causal, config)
                    except ValueError as e:  # tiles this head dim cannot take
                        lines.append(f"N={n} d={d} {config}: skipped ({e})")
                        print(lines[-1], flush=True)
                        continue
                    pointers = (q8.data_ptr(), k8.data_ptr(), v8.data_ptr())
                    vt = torch.empty(plan.vt_words * 4, dtype=torch.uint8, device="cuda")
                    o = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
                    lse = torch.empty((b, h, n), dtype=torch.float32, device="cuda")
                    stream = torch.cuda.current_stream().cuda_stream
                    forward_pointers = (*pointers, o.data_ptr(), lse.data_ptr(), 0, 0, 0)
                    forward_pointers += (vt.data_ptr(),)

                    def whole(plan=plan, pointers=pointers):
                        return plan(*pointers, (0, 0, 0))

                    def kernel(plan=plan, fp=forward_pointers, s=stream):
                        plan.forward(s, fp)

                    def transpose(plan=plan, vt=vt, s=stream):
                        plan.transpose(s, (v8.data_ptr(), vt.data_ptr()))

                    whole()
                    torch.cuda.synchronize()
                    methods[f"fp8 {config}"] = whole
                    methods[f"fp8 kernel {config}"] = kernel
                    vt_ms[config] = transpose
                for name, base in bases.items():
                    methods[name] = lambda base=base, c=causal: base.attention_forward_fp8(
                        q8, k8, v8, causal=c
                    )
                methods["bf16"] = lambda c=causal: cuflash.attention_forward(q, k, v, causal=c)
                methods["cudnn"] = lambda c=causal: sdpa_cudnn(qh, kh, vh, c)
                label = f"N={n} d={d}{' causal' if causal else ''}"
                lines.append(row(label, methods, flops, args.rounds))
                for config, fn in vt_ms.items():
                    us = 1000 * time_ms(fn, warmup=2, min_reps=20, min_time_ms=20.0)
                    lines.append(f"{label} vt {config}: {us:.1f} us")
                    print(lines[-1], flush=True)
    return lines


def sdpa_cudnn(q, k, v, causal: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def error_rows(head_dims: list[int]) -> list[str]:
    lines = ["errors against the float64 reference of the dequantised inputs"]
    lines[0] += " (B = 1, H = 2, N = 1024)"
    gen = torch.Generator(device="cuda").manual_seed(1)
    for d in head_dims:
        for causal in (False, True):
            shape = (1, 1024, 2, d)
            q8, k8, v8 = (
                torch.randn(shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)
                for _ in range(3)
            )
            o, lse = cuflash.attention_forward_fp8(q8, k8, v8, causal=causal)
            qb, kb, vb = (x.double().cpu().numpy().transpose(0, 2, 1, 3) for x in (q8, k8, v8))
            scale = 1 / np.sqrt(d)
            ref, _ = reference.forward(qb, kb, vb, causal=causal, scale=scale, layout="bhsd")
            ones = np.ones((1, 2))
            factors = (ones,) * 3
            naive, _ = testing.naive_forward_fp8(qb, kb, vb, factors, causal=causal, scale=scale)
            got = o.double().cpu().numpy().transpose(0, 2, 1, 3)
            peak = np.abs(ref).max()

            def stats(x):
                return np.abs(x - ref).max() / peak, np.linalg.norm(x - ref) / np.linalg.norm(ref)

            (gm, gr), (nm, nr) = stats(got), stats(naive)
            lines.append(
                f"d={d}{' causal' if causal else ''}: max {gm:.3g} rms {gr:.3g} "
                f"(naive fp8: max {nm:.3g} rms {nr:.3g})"
            )
            print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--seq", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--config", nargs="+", default=["table"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--baseline", nargs="*", default=[], help="other checkouts' FP8 forward")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = error_rows(args.head_dim) + speed_rows(args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe_fp8_forward.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
