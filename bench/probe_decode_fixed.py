"""A decoding call's fixed cost and its streaming rate, apart: time against cache length.

Within one series the grid is fixed (the batch and the number of splits do not change) and only
the keys each block reads grow, so the time fits t = fixed + bytes / rate: `fixed` holds what a
call pays whatever the cache length (launches, each block's first tiles and its merge, the
combine, the graph's gaps), `rate` the steady stream. The same fit for SDPA (cuDNN, flash;
enable_gqa, the same keys in its (B, Hkv, N, d) layout) says which of the two parts separates
cuflash from the peers on the 256 MiB points of issue 18, where it reaches 0.84-0.87 of the copy
bandwidth. bf16, d = 128, Hq = 32, Hkv = 8, Nq = 1, contiguous caches, CUDA-graph replays.

    python bench/probe_decode_fixed.py [--series B:SPLITS:KEYS,KEYS,... ...]
                                       [--baseline-kernels DIR] [--no-peers]

--baseline-kernels DIR adds a column "base": the decoding kernel built from another checkout's
kernels_cu (bench_kvcache.variant), timed in the same rounds (those from before v20, not
persistent, with a block per item).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_kvcache import DEV, HKV, HQ, D, copy_bandwidth, graph_time, sdpa_time, variant  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _plans  # noqa: E402

DEFAULT_SERIES = ["8:4:2048,4096,8192,16384", "64:1:512,1024,2048,4096", "1:32:32768,65536,131072"]


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = a + bytes / rate: (a seconds, rate bytes/s)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, 1.0 / slope


def point(batch: int, splits: int, keys: int, names: list[str], baseline: str | None) -> dict:
    """Seconds per call of each method in `names` at one cache length, and the bytes moved."""
    from torch.nn.attention import SDPBackend

    q = torch.randn(batch, 1, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(batch, keys, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((batch,), keys, device=DEV, dtype=torch.int32)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def ours() -> float:
        return graph_time(
            lambda: cuflash.attention_with_kvcache(q, k, v, lens, num_splits=splits),
            reps=20,
            rounds=7,
        )

    timed = {"cuflash": ours()}
    if baseline:
        with variant(kernels=baseline):
            timed["base"] = ours()
        timed["cuflash"] = min(timed["cuflash"], ours())  # timed on either side of the baseline
    if "cudnn" in names:
        timed["cudnn"] = sdpa_time(qt, kt, vt, SDPBackend.CUDNN_ATTENTION, rounds=7)
    if "flash" in names:
        timed["flash"] = sdpa_time(qt, kt, vt, SDPBackend.FLASH_ATTENTION, rounds=7)
    timed["bytes"] = 2 * k.numel() * 2 + 2 * q.numel() * 2
    _plans.clear()
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", nargs="+", default=DEFAULT_SERIES)
    parser.add_argument("--baseline-kernels", default=None, help="another checkout's kernels_cu")
    parser.add_argument("--no-peers", action="store_true", help="cuflash (and base) only")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    names = ["cuflash"] + (["base"] if args.baseline_kernels else [])
    names += [] if args.no_peers else ["cudnn", "flash"]
    for series in args.series:
        batch, splits, keys_list = series.split(":")
        batch, splits = int(batch), int(splits)
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for keys in (int(x) for x in keys_list.split(",")):
            timed = point(batch, splits, keys, names, args.baseline_kernels)
            torch.cuda.empty_cache()
            moved = timed["bytes"]
            cells = []
            for name in names:
                t = timed[name]
                if t is None:  # a peer that does not run here (sdpa_time said why)
                    cells.append(f"{name} -")
                    continue
                rows[name].append((moved, t))
                cells.append(f"{name} {t * 1e6:7.1f} us {moved / t / bandwidth:.3f}")
            where = f"B={batch} splits={splits} keys={keys} ({moved / 2**20:.0f} MiB)"
            print(f"{where}: " + " | ".join(cells), flush=True)
        fits = []
        for name, points in rows.items():
            if len(points) < 2:
                continue
            fixed, rate = fit(points)
            fits.append(f"{name} fixed {fixed * 1e6:5.1f} us, rate {rate / bandwidth:.3f}")
        print(f"  fit B={batch} splits={splits}: " + " | ".join(fits), flush=True)


if __name__ == "__main__":
    main()
