"""A few eager decoding calls of one shape, for profilers (ncu, nsys): no timing of its own.

    ncu --kernel-name regex:attention_decode --launch-skip 3 --launch-count 1 \
        python bench/profile_decode.py --batch 64 --keys 1024 [--page 64] [--calls 5]

bf16, d = 128, Hq = 32, Hkv = 8, Nq = 1, as bench/bench_kvcache.py's grid.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuflash  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--keys", type=int, default=1024)
    parser.add_argument("--page", type=int, default=None)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    b, n, dtype = args.batch, args.keys, torch.bfloat16
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=dtype)
    lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
    table = None
    if args.page is None:
        k_cache = torch.randn(b, n, HKV, D, device="cuda", dtype=dtype)
    else:
        pages = b * (n // args.page)
        k_cache = torch.randn(pages, args.page, HKV, D, device="cuda", dtype=dtype)
        table = torch.randperm(pages, device="cuda").view(b, -1).to(torch.int32)
    v_cache = torch.randn_like(k_cache)
    for _ in range(args.calls):
        cuflash.attention_with_kvcache(q, k_cache, v_cache, lens, block_table=table)
    torch.cuda.synchronize()
    print(f"{args.calls} calls, B = {b}, {n} keys, page {args.page}")


if __name__ == "__main__":
    main()
