"""Probe: the forward alone, this tree's kernels (the table's tiles and explicit alternatives)
against other checkouts' (--baseline) and SDPA's flash and cuDNN backends, in interleaved rounds
on the same inputs: the quick A/B of a forward-kernel change (docs/perf/NOTES.md, v18). Each
baseline is a column named after its directory.

    python bench/probe_forward.py [--baseline DIR ...] [--rounds 5] [--out DIR]

bf16, the benchmark's shapes (B = 16384 / N, H = 2048 / d, bshd), causal and not; softcap 30 and
ALiBi rows at N = 4k (the masks issue's cost targets, against dense in the same rounds). TFLOP/s
as bench_attention.py counts them (4 B H N^2 d, halved for causal); each entry is the median over
rounds of each round's median of back-to-back calls (bench_attention.time_ms).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import load_baseline, sdpa_backend, time_ms  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _kernels, testing  # noqa: E402
from cuflash._dispatch import KernelChoice  # noqa: E402

# (head dim, sequence lengths, alternatives to the library's TMA forward: (label, tiles or None
# for the table's, schedule or None for the table's))
SERIAL, OVERLAP, TURNS = _kernels.FORWARD_SCHEDULES[:3]
LOOPS = [("serial", None, SERIAL), ("overlap", None, OVERLAP), ("turns", None, TURNS)]
SHAPES = [
    (
        64,
        (1024, 4096, 16384),
        [(f"128x128 {s}", (128, 128, 2), s) for s in (SERIAL, OVERLAP, TURNS)]
        + [("192x128 serial", (192, 128, 2), SERIAL)],
    ),
    (128, (1024, 4096, 16384), LOOPS),
    (256, (1024, 4096, 16384), LOOPS),
]
# (head dim, modifier, alternatives)
MODS = [(64, {"softcap": 30.0}, []), (128, {"softcap": 30.0}, LOOPS), (128, {"alibi": True}, [])]


def row(label: str, methods: dict, flops: float, rounds: int) -> str:
    """The table's line: TFLOP/s of each method, timed in `rounds` interleaved rounds, each in its
    own random order (seeded), so that no method always runs first or after the same one.
    (Rotating one order kept its cyclic neighbours: the first column always ran right after the
    last, SDPA cuDNN, and read 0-7% low: the "API under explicit" gap of docs/perf/NOTES.md v18,
    explained in v20.)"""
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    order = random.Random(label)
    for _ in range(rounds):
        for name in order.sample(names, len(names)):
            times[name].append(time_ms(methods[name], warmup=2, min_reps=5, min_time_ms=20.0))
    result = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
    line = f"{label:28s} " + "  ".join(f"{n} {r:6.1f}" for n, r in result.items())
    print(line, flush=True)
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--baseline", nargs="*", default=[], help="checkouts whose cuflash is timed beside this one"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--head-dim", nargs="+", type=int, help="only these head dims' rows")
    parser.add_argument(
        "--no-alternatives",
        action="store_true",
        help="time the library, the baselines and SDPA only (no explicit tiles or loops)",
    )
    parser.add_argument(
        "--seq", nargs="+", type=int, help="only these sequence lengths (default 1k, 4k, 16k)"
    )
    parser.add_argument("--out", default=None, help="a directory for probe_forward.txt")
    args = parser.parse_args()
    bases = {
        Path(root).name: load_baseline(root, f"cuflash_baseline_{i}")
        for i, root in enumerate(args.baseline)
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = []

    def methods_of(q, k, v, causal, alternatives, options, slopes):
        # bshd arrays: (B, N, H, d)
        methods = {
            "cuflash": lambda: cuflash.attention_forward(
                q, k, v, causal=causal, **options, alibi_slopes=slopes
            )
        }
        for label, base in bases.items():
            methods[label] = lambda base=base: base.attention_forward(
                q, k, v, causal=causal, alibi_slopes=slopes, **options
            )
        for label, tiles, schedule in [] if args.no_alternatives else alternatives:
            choice = KernelChoice(
                tiles=((("forward", "tma"), tiles),) if tiles else (), schedule=schedule
            )
            *_, plan = testing.attention_forward_with(
                choice, q, k, v, causal=causal, alibi_slopes=slopes, **options
            )
            pointers = [x.data_ptr() for x in (q, k, v)]
            if slopes is not None:
                pointers.append(slopes.data_ptr())
            methods[label] = lambda plan=plan, pointers=pointers: plan(*pointers)
        if not options and slopes is None:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            for peer in ("flash", "cudnn"):

                def sdpa(peer=peer):
                    with torch.nn.attention.sdpa_kernel(sdpa_backend(peer)):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                sdpa()  # a peer that does not run fails here, before the timing
                methods[peer] = sdpa
        return methods

    def inputs(d, n):
        b, h = 16384 // n, 2048 // d
        return [
            torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(3)
        ]

    wanted = set(args.head_dim or (d for d, *_ in SHAPES))
    for d, seqs, alternatives in SHAPES:
        if d not in wanted:
            continue
        for n in args.seq or seqs:
            q, k, v = inputs(d, n)
            for causal in (False, True):
                flops = 4 * q.shape[0] * q.shape[2] * n * n * d / (2 if causal else 1)
                label = f"d={d} N={n} {'causal' if causal else 'full'}"
                methods = methods_of(q, k, v, causal, alternatives, {}, None)
                lines.append(row(label, methods, flops, args.rounds))
    for d, mod, alternatives in MODS:
        if d not in wanted:
            continue
        q, k, v = inputs(d, 4096)
        slopes = None
        if mod.get("alibi"):
            slopes = torch.rand(q.shape[2], device="cuda", generator=gen) * 0.1
        options = {key: val for key, val in mod.items() if key != "alibi"}
        flops = 4 * q.shape[0] * q.shape[2] * 4096 * 4096 * d
        label = f"d={d} N=4096 {'alibi' if slopes is not None else 'softcap 30'}"
        methods = methods_of(q, k, v, False, alternatives, options, slopes)
        lines.append(row(label, methods, flops, args.rounds))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "probe_forward.txt").write_text(
            f"{torch.cuda.get_device_name()}, bf16 forward TFLOP/s\n" + "\n".join(lines) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
