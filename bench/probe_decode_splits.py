"""Decoding time against the number of splits (num_splits forced), beside the library's choice.

Where the bandwidth fraction of a decoding point is low, this shows whether another split of the
keys would do better (the choice is made from the shapes alone: cuflash/_kvcache_cuda.py,
split_keys). bf16, d = 128, Hq = 32, Hkv = 8, Nq = 1, contiguous caches, CUDA-graph replays.

    python bench/probe_decode_splits.py [--points B:KEYS ...] [--splits N ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_kvcache import DEV, HKV, HQ, D, copy_bandwidth, graph_time  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _compile, _plans  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", default=["1:8192", "8:8192", "64:1024", "1:131072"])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 33, 64, 128])
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    for point in args.points:
        batch, keys = (int(x) for x in point.split(":"))
        q = torch.randn(batch, 1, HQ, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(batch, keys, HKV, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((batch,), keys, device=DEV, dtype=torch.int32)
        moved = 2 * k.numel() * 2 + 2 * q.numel() * 2
        cuflash.attention_with_kvcache(q, k, v, lens)
        chosen = next(p for p in _plans._plans.values() if hasattr(p, "splits")).splits
        _plans.clear()
        cells = []
        for splits in [None, *args.splits]:
            t = graph_time(
                lambda s=splits: cuflash.attention_with_kvcache(q, k, v, lens, num_splits=s)
            )
            name = f"choice {chosen}" if splits is None else str(splits)
            cells.append(f"{name}: {t * 1e6:.1f} us {moved / t / bandwidth:.2f}")
        print(
            f"B={batch} keys={keys} ({_compile.sm_count(0)} SMs): " + " | ".join(cells), flush=True
        )
        torch.cuda.empty_cache()
        _plans.clear()


if __name__ == "__main__":
    main()
