"""Probe: the TMA forward's tiles and loops, dense and under a softcap, on this tree and other
checkouts (--baseline), in interleaved rounds on the same inputs (docs/perf/NOTES.md, v26: three
consumer warpgroups against the softcap's MUFU latency; longer key tiles at d = 128).

    python bench/probe_forward_tiles.py --head-dim 128 --config table 128x160x2:turns:reg \
        [--seq 4096 16384] [--causal] [--baseline DIR ...] [--rounds 5] [--out DIR]
    python bench/probe_forward_tiles.py ... --compile-only --shard I --shards N

Each config is BMxBNxSTAGES:SCHEDULE, with ":reg" for O written from registers instead of
through a staging tile and TMA stores, or "table" for the library's own choice. bf16, N = 4096
(--seq), B = 16384 / N, H = 2048 / d, bshd; dense and softcap 30, not causal; dense causal too
with --causal; --extra window alibi: a causal window of 1024 keys, ALiBi (causal too with
--causal); --windows L ...: causal windows (L, 0) and two-sided ones (L / 2, L / 2)
(--windows-only: no other rows). TFLOP/s as bench_attention.py counts them, on the visible
pairs (the median over rounds). A config that
a checkout cannot build or launch is reported and skipped. --compile-only builds the plans of
every N-th (tree, config) pair into CuPy's disk cache and exits: run the shards in parallel
processes before the timed run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import load_baseline  # noqa: E402
from bench_score_mods import visible_pairs  # noqa: E402
from probe_forward import row  # noqa: E402

import cuflash  # noqa: E402


def parse(config: str) -> tuple:
    """'BMxBNxSTAGES:SCHEDULE[:reg]' -> ((BM, BN, STAGES), SCHEDULE, O's store)."""
    tiles, schedule, *store = config.split(":")
    o_store = "registers" if store == ["reg"] else "tma"
    return tuple(int(x) for x in tiles.split("x")), schedule or None, o_store


def plan_of(module, config: str, q, k, v, options: dict):
    """A callable that runs `module`'s forward with `config`'s tiles and loop."""
    if config == "table":
        return lambda: module.attention_forward(q, k, v, **options)
    tiles, schedule, o_store = parse(config)
    choice = importlib.import_module(module.__name__ + "._dispatch").KernelChoice(
        tiles=((("forward", "tma"), tiles),), schedule=schedule, o_store=o_store
    )
    testing = importlib.import_module(module.__name__ + ".testing")
    *_, plan = testing.attention_forward_with(choice, q, k, v, **options)
    slopes = options.get("alibi_slopes")
    pointers = [x.data_ptr() for x in (q, k, v)] + ([] if slopes is None else [slopes.data_ptr()])
    return lambda: plan(*pointers)


def variants(
    n: int, heads: int, extra: list[str], causal: bool, gen, windows=(), windows_only=False
) -> list[tuple]:
    """(label, options, visible query-key pairs per head) of the timed rows at length n."""
    rows = [("dense", {}, n * n), ("softcap 30", {"softcap": 30.0}, n * n)]
    if causal:
        rows.append(("dense causal", {"causal": True}, n * n // 2))  # as the benchmark counts
    if windows_only:
        rows = []
    if "window" in extra:  # a causal window of 1024 keys: row i sees min(i, 1023) + 1 keys
        windows = (1023, *windows)
    for left in dict.fromkeys(windows):  # causal windows, then two-sided ones of the same width
        pairs = visible_pairs(n, (left, 0), True)
        rows.append((f"window {left} causal", {"causal": True, "window": (left, 0)}, pairs))
        pairs = visible_pairs(n, (left // 2, left // 2), False)
        rows.append((f"window {left // 2},{left // 2}", {"window": (left // 2, left // 2)}, pairs))
    if "alibi" in extra:
        slopes = torch.rand(heads, device="cuda", generator=gen) * 0.1
        rows.append(("alibi", {"alibi_slopes": slopes}, n * n))
        if causal:
            rows.append(("alibi causal", {"alibi_slopes": slopes, "causal": True}, n * n // 2))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", nargs="*", default=[])
    parser.add_argument("--head-dim", nargs="+", type=int, default=[128])
    parser.add_argument("--config", nargs="+", default=["table"])
    parser.add_argument("--seq", nargs="+", type=int, default=[4096])
    parser.add_argument("--causal", action="store_true", help="causal rows too")
    parser.add_argument(
        "--extra", nargs="*", default=[], choices=["window", "alibi"], help="rows with these too"
    )
    parser.add_argument(
        "--windows", nargs="*", type=int, default=[], help="window rows: (L, 0) causal, (L/2, L/2)"
    )
    parser.add_argument("--windows-only", action="store_true", help="no dense or softcap rows")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args()
    modules = {"cuflash": cuflash}
    for i, root in enumerate(args.baseline):
        name = f"cuflash_baseline_{i}"
        modules[Path(root).name] = load_baseline(root, name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"{torch.cuda.get_device_name()}, bf16 forward TFLOP/s"]
    job = 0
    for n, d in ((n, d) for n in args.seq for d in args.head_dim):
        b, h = 16384 // n, 2048 // d
        q, k, v = (
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(3)
        )
        for row_label, options, pairs in variants(
            n, h, args.extra, args.causal, gen, args.windows, args.windows_only
        ):
            flops = 4 * b * h * pairs * d
            methods = {}
            for name, module in modules.items():
                for config in args.config:
                    job += 1
                    if args.compile_only and job % args.shards != args.shard:
                        continue
                    label = f"{name} {config}"
                    try:
                        methods[label] = plan_of(module, config, q, k, v, options)
                        methods[label]()
                        torch.cuda.synchronize()
                    except Exception as e:  # a tile the kernel or the machine does not take
                        methods.pop(label, None)
                        msg = f"N={n} d={d} {row_label} {label}: skipped "
                        msg = (msg + f"({type(e).__name__}: {e})").splitlines()[0][:300]
                        print(msg, flush=True)
                        if not args.compile_only:
                            traceback.print_exc(limit=1)
                        lines.append(msg)
            if args.compile_only or not methods:
                continue
            label = f"N={n} d={d} {row_label}"
            lines.append(row(label, methods, flops, args.rounds))
    if args.out and not args.compile_only:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe_forward_tiles.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
