"""A few eager attention calls of one shape, for profilers (ncu, nsys): no timing of its own.

    ncu --kernel-name regex:attention_forward --launch-skip 2 --launch-count 1 \
        python bench/profile_attention.py --seq 4096 --head-dim 128 [--softcap 30] [--alibi]

bf16, B = 4, Hq = Hkv = 16 (the benchmark's 4k point); --causal, --window LEFT for the masks;
--backward adds the backward to each call; --fp8 runs attention_forward_fp8 on the same values
rounded to float8_e4m3fn (descale factors 1; forward only); --packed runs the same B sequences
as one packed batch (attention_varlen_*); --long-tailed runs bench_varlen.py's packed batch
instead (65536 tokens of lengths 64..8192, Hq = Hkv = 2048 / d). CUFLASH_TREE=DIR imports DIR's
cuflash instead of this tree's. --sdpa cudnn|flash runs torch's SDPA on that backend instead
(dense or causal only), so that a profiler can set a peer's kernel beside ours (ncu -k
regex:'sdpa|fprop|flash').
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

# CUFLASH_TREE: another checkout's cuflash (an .ab/ variant tree; bench/ncu_forward.sh)
sys.path.insert(0, os.environ.get("CUFLASH_TREE", str(Path(__file__).resolve().parent.parent)))
import cuflash  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--softcap", type=float, default=None)
    parser.add_argument("--alibi", action="store_true")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--long-tailed", action="store_true")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--sdpa", choices=("cudnn", "flash"), default=None)
    args = parser.parse_args()
    b, n = args.batch, args.seq
    shape = (b, n, args.heads, args.head_dim)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    slopes = None
    if args.alibi:
        slopes = torch.rand(args.heads, device="cuda", dtype=torch.float32)
    window = None if args.window is None else (args.window, 0)
    options = dict(causal=args.causal, window=window, softcap=args.softcap, alibi_slopes=slopes)
    if args.long_tailed:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_varlen import draw_lengths

        lengths = draw_lengths(65536, 1024, 1.0, 64, 8192, 1)
        shape = (sum(lengths), 2048 // args.head_dim, args.head_dim)
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu.cuda()
        options.update(max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        args.packed = True
    elif args.packed:
        q, k, v, do = (x.view(b * n, *shape[2:]) for x in (q, k, v, do))
        cu = torch.arange(0, b * n + 1, n, device="cuda", dtype=torch.int32)
        options.update(max_seqlen_q=n, max_seqlen_k=n)
    if args.sdpa is not None:
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_attention import sdpa_backend

        if args.packed or args.window is not None or args.softcap or args.alibi:
            parser.error("--sdpa takes dense or causal calls only")
        qt, kt, vt = (
            x.transpose(1, 2).contiguous().requires_grad_(args.backward) for x in (q, k, v)
        )

        def forward():
            with sdpa_kernel(sdpa_backend(args.sdpa)):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal), None

        def backward(o, lse):
            o.backward(do.transpose(1, 2))

    elif args.fp8:
        if args.packed or args.backward or args.softcap or args.alibi:
            parser.error("--fp8 takes dense, causal or windowed forward calls only")
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))

        def forward():
            return cuflash.attention_forward_fp8(q8, k8, v8, causal=args.causal, window=window)

    elif args.packed:

        def forward():
            return cuflash.attention_varlen_forward(q, k, v, cu, cu, **options)

        def backward(o, lse):
            return cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, **options)
    else:

        def forward():
            return cuflash.attention_forward(q, k, v, **options)

        def backward(o, lse):
            return cuflash.attention_backward(do, q, k, v, o, lse, **options)

    for _ in range(args.calls):
        o, lse = forward()
        if args.backward:
            backward(o, lse)
    torch.cuda.synchronize()
    print(f"{args.calls} calls of {shape}, packed {args.packed}, {options}")


if __name__ == "__main__":
    main()
