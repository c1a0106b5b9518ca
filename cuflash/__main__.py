"""python -m cuflash: attention on random inputs, checked against the float64 reference.

Runs on the GPU when CuPy and a CUDA device are present, otherwise on the CPU backend, and prints
which backend ran, the shapes, and the forward and backward errors against the reference under
the project's tolerance policy. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cuflash
from cuflash import testing


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _head_dim(text: str) -> int:
    value = _positive(text)
    if value > 256:
        raise argparse.ArgumentTypeError(f"head dims run from 1 to 256, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=_positive, default=2)
    parser.add_argument("--heads", type=_positive, default=8, help="query heads")
    parser.add_argument(
        "--kv-heads", type=_positive, default=2, help="key/value heads (grouped; divides --heads)"
    )
    parser.add_argument("--seq", type=_positive, default=777)
    parser.add_argument("--head-dim", type=_head_dim, default=64)
    parser.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32", "float64"),
        help="default: float16 on the GPU, float32 on the CPU",
    )
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cpu", action="store_true", help="use the CPU backend even with a GPU")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")

    reason = "--cpu given" if args.cpu else testing.gpu_unavailable_reason()
    on_gpu = reason is None
    dtype = args.dtype or ("float16" if on_gpu else "float32")
    if dtype == "bfloat16" and on_gpu:
        print("bfloat16 demo inputs need PyTorch or JAX; using float16 on CuPy", file=sys.stderr)
        dtype = "float16"
    if dtype == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            parser.error(
                "--dtype bfloat16 on the CPU backend needs NumPy's bfloat16 from the "
                "ml_dtypes package: pip install ml_dtypes"
            )
    rng = np.random.default_rng()
    b, h, hkv, n, d = args.batch, args.heads, args.kv_heads, args.seq, args.head_dim
    host = [
        rng.standard_normal(s).astype(dtype)
        if dtype != "bfloat16"
        else rng.standard_normal(s).astype(np.float32)
        for s in ((b, n, h, d), (b, n, hkv, d), (b, n, hkv, d), (b, n, h, d))
    ]
    if dtype == "bfloat16":
        import ml_dtypes

        host = [x.astype(ml_dtypes.bfloat16) for x in host]
    if on_gpu:
        import cupy

        q, k, v, do = (cupy.asarray(x) for x in host)
        backend = f"GPU ({cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CuPy)"
    else:
        q, k, v, do = host
        backend = f"CPU (NumPy backend; {reason})"

    start = time.perf_counter()
    o, lse = cuflash.attention_forward(q, k, v, causal=args.causal)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=args.causal)
    if on_gpu:
        cupy.cuda.Device().synchronize()
    seconds = time.perf_counter() - start

    def host64(x):
        x = cupy.asnumpy(x) if on_gpu else np.asarray(x)
        return x.astype(np.float64)

    def bhsd(x):
        return host64(x).transpose(0, 2, 1, 3)

    qb, kb, vb, dob = (bhsd(x) for x in (q, k, v, do))
    scale = 1.0 / np.sqrt(d)
    kw = dict(causal=args.causal, scale=scale)
    o_ref, lse_ref = testing.naive_forward(qb, kb, vb, dtype="float64", **kw)
    o_low, lse_low = testing.naive_forward(qb, kb, vb, dtype=dtype, **kw)
    ob, lseb = bhsd(o), host64(lse)
    grads_ref = testing.naive_backward(dob, qb, kb, vb, ob, lseb, dtype="float64", **kw)
    grads_low = testing.naive_backward(dob, qb, kb, vb, ob, lseb, dtype=dtype, **kw)
    checks = [
        testing.compare("o", ob, o_ref, o_low, dtype),
        testing.compare("lse", lseb, lse_ref, lse_low, dtype),
    ]
    checks += [
        testing.compare(name, bhsd(got), ref, low, dtype)
        for name, got, ref, low in zip(
            ("dq", "dk", "dv"), (dq, dk, dv), grads_ref, grads_low, strict=True
        )
    ]

    print(f"cuflash {cuflash.__version__} demo: backend {backend}")
    note = " (the first call compiles the kernels)" if on_gpu else ""
    print(
        f"  q {tuple(q.shape)}, k/v {tuple(k.shape)} (layout bshd), dtype {dtype}, "
        f"causal={args.causal}; forward+backward in {seconds * 1e3:.1f} ms{note}"
    )
    print("  errors against the float64 reference (pass: <= 2 x naive same-precision + noise):")
    for c in checks:
        print(f"    {'ok  ' if c.passed else 'FAIL'} {c.message}")
    ok = all(c.passed for c in checks)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
