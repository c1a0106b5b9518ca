"""Probe: how precisely the H100's FP8 tensor cores accumulate, through cuBLAS's FP8 GEMM
(torch._scaled_mm) and through the FP8 forward's lse (docs/perf/NOTES.md, v27).

    python bench/probe_fp8_accumulation.py

e4m3 inputs N(0, 4); their products are exact in float32, so an exact float32 accumulation
would match the float64 product to about 2^-24 of the partial sums. Prints the largest error of
A B^T (K = 16 .. 4096) relative to the largest |partial sum|, and the FP8 forward's largest lse
error against the float64 reference (d = 16 .. 256) relative to max |S|.
"""

from __future__ import annotations

import numpy as np
import torch

import cuflash
from cuflash import reference


def gemm_rows() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k in (16, 32, 128, 1024, 4096):
        a = (torch.randn(256, k, generator=gen, device="cuda") * 2).to(torch.float8_e4m3fn)
        b = (torch.randn(256, k, generator=gen, device="cuda") * 2).to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        got = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        exact = a.double() @ b.double().t()
        partial = (a.double().abs() @ b.double().abs().t()).max().item()
        err = (got.double() - exact).abs().max().item()
        share = np.log2(err / partial)
        print(f"cuBLAS FP8 GEMM K={k}: max error {err:.3g} = 2^{share:.1f} of max partial sum")


def lse_rows() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    for d in (16, 64, 128, 256):
        q, k, v = (
            (torch.randn(1, 512, 2, d, generator=gen, device="cuda") * 2).to(torch.float8_e4m3fn)
            for _ in range(3)
        )
        _, lse = cuflash.attention_forward_fp8(q, k, v)
        qb, kb, vb = (x.double().cpu().numpy() for x in (q, k, v))
        _, ref = reference.forward(qb, kb, vb)
        s_max = np.abs(np.einsum("bqhd,bkhd->bhqk", qb, kb)).max() / np.sqrt(d)
        err = np.abs(lse.double().cpu().numpy() - ref).max()
        share = np.log2(err / s_max)
        print(f"FP8 forward d={d}: lse max error {err:.3g} = 2^{share:.1f} of max |S| {s_max:.3g}")


if __name__ == "__main__":
    gemm_rows()
    lse_rows()
