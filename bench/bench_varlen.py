"""cuflash's packed variable-length attention against its peers, side by side.

    python bench/bench_varlen.py [--head-dim 64 128] [--causal both|yes|no] [--dtype bfloat16]
        [--tokens 65536] [--seed 1] [--peers checked dense njt_flash ... pad_efficient]
        [--baseline DIR ...] [--rounds 5] [--min-time-ms 300] [--out DIR]

The batch: --tokens (65536) tokens packed without padding, in sequences whose lengths are drawn
with a fixed seed from a long-tailed distribution (lognormal, median 1024, sigma 1, clipped to
64..8192) until they fill the tokens, the last one cut to fit; Nq = Nk per sequence, Hq = Hkv =
2048 / d (16 heads at d = 128, 32 at d = 64), bfloat16, causal and not.
cuflash.attention_varlen_forward and attention_varlen_backward (given o and lse; both max_seqlen
given: no host copy) against the peers:

  baseline       the cuflash of each checkout of --baseline DIR [DIR ...] (e.g. .ab/base, a git
                 worktree of an earlier commit), same calls: an A/B of the packed kernels in the
                 same rounds (methods baseline, baseline#2, ...)
  checked        cuflash's packed forward with max_seqlen omitted: the offsets are copied to the
                 host and checked on every call (the cost of not passing max_seqlen)
  dense          cuflash's dense kernels on B x 4096 with as many tokens (B = tokens / 4096): what
                 the same kernels give on equal-length sequences (compare TFLOP/s, not times)
  njt_flash, njt_cudnn, njt_efficient
                 PyTorch SDPA on the same batch as a jagged nested tensor
                 (torch.nested.nested_tensor_from_jagged, (B, H, j, d)) under each backend
  pad_flash, pad_cudnn, pad_efficient
                 PyTorch SDPA on the batch padded to the longest sequence (B, H, L, d): causal
                 needs no mask (padding comes after each sequence's keys), non-causal takes a
                 boolean key-padding mask (B, 1, 1, L) (the flash backend takes no mask: noted)

FLOPs, as the FlashAttention papers count them but on the real (query, key) pairs only: forward
4 * d * H * sum_b pairs_b with pairs_b = N_b^2, or N_b (N_b + 1) / 2 visible pairs when causal;
backward 2.5x the forward. Every method on the packed batch is credited with the same FLOPs
(padding is work a peer wastes, not work done), so their ratios are ratios of times; the dense
point is credited with its own pairs, counted the same way (bench_attention.py halves N^2 for
causal: 0.02% less at N = 4096). A peer whose output differs from cuflash's on the real rows
shows it in the last column (max |o - o_cuflash|, bf16 rounding is about 1e-2 here).

Timing as bench/bench_attention.py: CUDA events around calls queued back to back (device time),
a warm-up, and every job of a head dim (all methods, causal and not, forward and backward) timed
in --rounds interleaved rounds on the same inputs; each time is the median of all repetitions.
Each job gets at least --min-time-ms of calls in all (and --reps), spread over the rounds. A peer
that is missing or raises is noted and left out; nothing else stops the run. A few minutes on an
H100 (the padded peers dominate).

Writes varlen_results.json and varlen_table.txt to --out ($OUT, else bench_out) and prints the
table last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import (  # noqa: E402  (puts the repo on the path)
    event_times,
    load_baseline,
    sdpa_backend,
)

import cuflash  # noqa: E402

PEERS = (
    "baseline",
    "checked",
    "dense",
    "njt_flash",
    "njt_cudnn",
    "njt_efficient",
    "pad_flash",
    "pad_cudnn",
    "pad_efficient",
)
LABELS = {
    "cuflash": "cuflash varlen",
    "baseline": "cuflash varlen, --baseline checkout",
    "checked": "cuflash varlen, offsets checked",
    "dense": "cuflash dense B x {n}",
    "njt_flash": "SDPA jagged, flash",
    "njt_cudnn": "SDPA jagged, cuDNN",
    "njt_efficient": "SDPA jagged, efficient",
    "pad_flash": "SDPA padded, flash",
    "pad_cudnn": "SDPA padded, cuDNN",
    "pad_efficient": "SDPA padded, efficient",
}


_baseline = functools.cache(load_baseline)  # one import of each checkout per run


def label_of(method: str, args) -> str:
    """The table's name of a method: a baseline names its checkout."""
    if method.startswith("baseline"):
        index = int(method.partition("#")[2] or 1) - 1
        return f"cuflash varlen, {args.baseline[index]}"
    return LABELS[method].format(n=args.dense_seq)


class Skip(Exception):
    """A peer left out on purpose (the reason is noted, not an error)."""


def draw_lengths(
    tokens: int, median: float, sigma: float, lo: int, hi: int, seed: int
) -> list[int]:
    """Lognormal lengths clipped to lo..hi, drawn until they sum to `tokens` (the last cut)."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    total = 0
    while total < tokens:
        n = int(np.clip(round(rng.lognormal(math.log(median), sigma)), lo, hi))
        n = min(n, tokens - total)
        lengths.append(n)
        total += n
    return lengths


def visible_pairs(n: int, causal: bool) -> int:
    """(query, key) pairs of one sequence of n queries and n keys that attention computes."""
    return n * (n + 1) // 2 if causal else n * n


@dataclass
class Job:
    """One timed quantity: a method's forward or backward at one causal value."""

    method: str
    causal: bool
    which: str  # "fwd" or "bwd"
    fn: Callable[[], object]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    min_reps: int = 5
    warmup: int = 3
    reps_per_round: int = 1
    times: list[float] = field(default_factory=list)
    failed: bool = False


@dataclass
class Row:
    """The figures of one method at one (head dim, causal)."""

    head_dim: int
    heads: int
    causal: bool
    method: str
    flops_fwd: float
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    max_abs_diff_o: float | None = None  # against cuflash's o on the real rows
    notes: list[str] = field(default_factory=list)

    def tflops(self, which: str) -> float | None:
        ms = self.fwd_ms if which == "fwd" else self.bwd_ms
        if ms is None:
            return None
        return self.flops_fwd * (1.0 if which == "fwd" else 2.5) / (ms * 1e-3) / 1e12


class Batch:
    """The packed inputs of one head dim, and (made on first use) the peers' views of them."""

    def __init__(self, lengths: list[int], head_dim: int, dtype: torch.dtype, seed: int):
        self.lengths, self.d, self.dtype = lengths, head_dim, dtype
        self.heads = 2048 // head_dim
        self.tokens = sum(lengths)
        self.longest = max(lengths)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        shape = (self.tokens, self.heads, head_dim)
        self.q, self.k, self.v, self.do = (
            torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
            for _ in range(4)
        )
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        self.cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        self._njt = None
        self._padded = None

    def flops(self, causal: bool) -> float:
        return 4.0 * self.d * self.heads * sum(visible_pairs(n, causal) for n in self.lengths)

    def njt(self):
        """(q, k, v leaves (T, H, d) that take the gradients, their (B, H, j, d) jagged views,
        dO's jagged view); all built on the same offsets, so they share one ragged size."""
        if self._njt is None:
            if not hasattr(torch, "nested") or not hasattr(
                torch.nested, "nested_tensor_from_jagged"
            ):
                raise Skip(f"torch {torch.__version__} has no nested_tensor_from_jagged")
            offsets = self.cu.to(torch.int64)
            bounds = dict(min_seqlen=min(self.lengths), max_seqlen=self.longest)

            def jagged(x):
                try:  # the bounds spare SDPA a device-to-host copy per call
                    nt = torch.nested.nested_tensor_from_jagged(x, offsets, **bounds)
                except TypeError:  # older torch: no min_seqlen / max_seqlen
                    nt = torch.nested.nested_tensor_from_jagged(x, offsets)
                return nt.transpose(1, 2)

            leaves = [x.detach().clone().requires_grad_(True) for x in (self.q, self.k, self.v)]
            self._njt = (leaves, [jagged(x) for x in leaves], jagged(self.do))
        return self._njt

    def padded(self):
        """(q, k, v leaves (B, L, H, d) padded with zeros after each sequence, their (B, H, L, d)
        views, dO's view, the (B, L) mask of the real rows)."""
        if self._padded is None:
            lengths = torch.tensor(self.lengths, device="cuda")
            real = torch.arange(self.longest, device="cuda")[None, :] < lengths[:, None]

            def pad(x):
                out = x.new_zeros(len(self.lengths), self.longest, self.heads, self.d)
                out[real] = x
                return out

            leaves = [pad(x).requires_grad_(True) for x in (self.q, self.k, self.v)]
            self._padded = (
                leaves,
                [x.transpose(1, 2) for x in leaves],
                pad(self.do).transpose(1, 2),
                real,
            )
        return self._padded


def method_jobs(method: str, causal: bool, batch: Batch, args, outputs: dict) -> list[Job]:
    """The timed calls of `method`, each run once here so that a peer that cannot run the case
    fails before the timing starts. outputs[method] gets its o on the real rows (T, H, d)."""
    b = batch

    def job(which: str, fn: Callable[[], object], context=contextlib.nullcontext, padded=False):
        reps, warmup = (args.padded_reps, 1) if padded else (args.reps, args.warmup)
        return Job(method, causal, which, fn, context, reps, warmup)

    longest = dict(max_seqlen_q=b.longest, max_seqlen_k=b.longest)
    if method in ("cuflash", "checked") or method.startswith("baseline"):
        lib = cuflash
        if method.startswith("baseline"):
            if not args.baseline:
                raise Skip("no --baseline checkout given")
            index = int(method.partition("#")[2] or 1) - 1
            lib = _baseline(args.baseline[index], f"cuflash_baseline_{index}")
        kw = dict(causal=causal, **(longest if method != "checked" else {}))
        o, lse = lib.attention_varlen_forward(b.q, b.k, b.v, b.cu, b.cu, **kw)
        outputs[method] = o
        jobs = [job("fwd", lambda: lib.attention_varlen_forward(b.q, b.k, b.v, b.cu, b.cu, **kw))]
        if method != "checked":
            lib.attention_varlen_backward(b.do, b.q, b.k, b.v, o, lse, b.cu, b.cu, **kw)
            jobs.append(
                job(
                    "bwd",
                    lambda: lib.attention_varlen_backward(
                        b.do, b.q, b.k, b.v, o, lse, b.cu, b.cu, **kw
                    ),
                )
            )
        return jobs
    if method == "dense":
        n = args.dense_seq
        rows = max(1, b.tokens // n)
        gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
        q, k, v, do = (
            torch.randn((rows, n, b.heads, b.d), generator=gen, device="cuda").to(b.dtype)
            for _ in range(4)
        )
        o, lse = cuflash.attention_forward(q, k, v, causal=causal)
        cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
        return [
            job("fwd", lambda: cuflash.attention_forward(q, k, v, causal=causal)),
            job("bwd", lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)),
        ]

    kind, backend_name = method.split("_")
    backend = sdpa_backend(backend_name)

    def context():
        return torch.nn.attention.sdpa_kernel(backend)

    if kind == "njt":
        leaves, (q, k, v), do = b.njt()
        mask = None
    else:
        leaves, (q, k, v), do, real = b.padded()
        mask = None if causal else real[:, None, None, :]  # True: the key takes part

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    with context():
        out = fwd()
    rows = out.transpose(1, 2)
    outputs[method] = rows.values() if kind == "njt" else rows[real]

    def bwd():
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    padded = kind == "pad"
    jobs = [job("fwd", lambda: fwd().detach(), context, padded)]
    try:
        with context():
            bwd()
        jobs.append(job("bwd", bwd, context, padded))
    except Exception as exc:  # a backend with a forward but no backward for the case
        raise PartialSkip(jobs, f"backward: {type(exc).__name__}: {first_line(exc)}") from exc
    return jobs


class PartialSkip(Exception):
    """A peer whose forward runs but whose backward raised: its forward jobs, and why."""

    def __init__(self, jobs: list[Job], why: str):
        super().__init__(why)
        self.jobs = jobs


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else ""


def time_jobs(jobs: list[Job], args, notes: Callable[[Job, str], None]) -> None:
    """Warm-up and repetitions per round from a first estimate, then args.rounds rounds that
    time every job once each, in alternating order (bench_attention.bench_config)."""
    rounds = max(1, args.rounds)

    def attempt(job: Job, action: Callable[[], None]) -> None:
        if job.failed:
            return
        try:
            action()
        except Exception as exc:  # e.g. out of memory beside the other jobs' buffers
            job.failed = True
            notes(job, f"{job.which}: {type(exc).__name__}: {first_line(exc)}")

    def with_context(job: Job, reps: int, sync_each: bool) -> list[float]:
        with job.context():
            return event_times(job.fn, reps, sync_each)

    def prepare(job: Job) -> None:
        with job.context():
            for _ in range(job.warmup):
                job.fn()
        estimate = statistics.median(with_context(job, 3, True))
        total = min(1000, max(job.min_reps, math.ceil(args.min_time_ms / max(estimate, 1e-3))))
        job.reps_per_round = max(1, math.ceil(total / rounds))

    for job in jobs:
        attempt(job, lambda job=job: prepare(job))
    for r in range(rounds):
        for job in jobs if r % 2 == 0 else reversed(jobs):
            attempt(
                job, lambda job=job: job.times.extend(with_context(job, job.reps_per_round, False))
            )


def bench_head_dim(d: int, lengths: list[int], methods: list[str], args) -> list[Row]:
    dtype = getattr(torch, args.dtype)
    batch = Batch(lengths, d, dtype, args.seed)
    rows: dict[tuple[str, bool], Row] = {}
    for causal in args.causal_values:
        for m in methods:
            flops = batch.flops(causal)
            if m == "dense":
                n = args.dense_seq
                flops = 4.0 * d * batch.heads * max(1, batch.tokens // n) * visible_pairs(n, causal)
            rows[m, causal] = Row(d, batch.heads, causal, m, flops)

    def note(job_or_row, text: str) -> None:
        rows[job_or_row.method, job_or_row.causal].notes.append(text)

    jobs: list[Job] = []
    for causal in args.causal_values:
        outputs: dict[str, torch.Tensor] = {}
        for m in methods:
            row = rows[m, causal]
            try:
                jobs += method_jobs(m, causal, batch, args, outputs)
            except PartialSkip as part:
                jobs += part.jobs
                row.notes.append(str(part))
            except Skip as why:
                row.notes.append(f"skipped: {why}")
            except Exception as exc:  # a peer that does not support the case
                row.notes.append(f"{type(exc).__name__}: {first_line(exc)}")
            ours = outputs.get("cuflash")
            if m in outputs and m != "cuflash" and ours is not None:
                diff = (outputs[m].float() - ours.float()).abs().max()
                row.max_abs_diff_o = float(diff)
            if m != "cuflash":
                outputs.pop(m, None)
        outputs.clear()
    torch.cuda.synchronize()
    time_jobs(jobs, args, note)
    for job in jobs:
        if job.times and not job.failed:
            row = rows[job.method, job.causal]
            ms = statistics.median(job.times)
            if job.which == "fwd":
                row.fwd_ms = ms
            else:
                row.bwd_ms = ms
    del jobs, batch
    torch.cuda.empty_cache()
    return list(rows.values())


def format_table(rows: list[Row], args) -> str:
    lines = []
    head = (
        f"{'':34s} {'fwd TFLOP/s':>11s} {'bwd TFLOP/s':>11s} {'fwd ms':>8s} {'bwd ms':>8s}"
        f"   {'cuflash/x fwd':>13s} {'bwd':>6s}   {'max|o-o_cf|':>11s}"
    )
    for d in args.head_dim:
        for causal in args.causal_values:
            group = [r for r in rows if r.head_dim == d and r.causal == causal]
            if not group:
                continue
            ours = next(r for r in group if r.method == "cuflash")
            title = f"d={d} H={group[0].heads}{' causal' if causal else ''}"
            lines += [f"{title:34s}" + head[34:], "-" * len(head)]
            for r in group:
                label = label_of(r.method, args)
                cells = []
                for which in ("fwd", "bwd"):
                    t = r.tflops(which)
                    cells.append(f"{t:11.1f}" if t else f"{'-':>11s}")
                for ms in (r.fwd_ms, r.bwd_ms):
                    cells.append(f"{ms:8.3f}" if ms else f"{'-':>8s}")
                ratios = []
                for which, width in (("fwd", 13), ("bwd", 6)):
                    mine, theirs = ours.tflops(which), r.tflops(which)
                    ok = r.method != "cuflash" and mine and theirs
                    ratios.append(f"{mine / theirs:{width}.2f}" if ok else f"{'-':>{width}s}")
                diff = "" if r.max_abs_diff_o is None else f"{r.max_abs_diff_o:11.3g}"
                lines.append(
                    f"  {label:32s} {' '.join(cells)}   {ratios[0]} {ratios[1]}   {diff:>11s}"
                )
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--median", type=float, default=1024.0, help="median sequence length")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths")
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dense-seq", type=int, default=4096, help="N of the dense point")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument(
        "--baseline", nargs="+", default=[], help="checkouts whose cuflash are the 'baseline' peers"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--padded-reps", type=int, default=3, help="the padded peers' minimum repetitions"
    )
    # at least this much of each job's calls in all, over the rounds: with 60 ms and 3 rounds (the
    # defaults until v19) the packed / dense ratios moved by up to 0.1 between runs
    parser.add_argument("--min-time-ms", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    args.causal_values = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    methods = ["cuflash"]
    for peer in (p for p in PEERS if p in args.peers):
        if peer == "baseline" and args.baseline:
            methods += ["baseline"] + [f"baseline#{i + 1}" for i in range(1, len(args.baseline))]
        else:
            methods.append(peer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    lengths = draw_lengths(
        args.tokens, args.median, args.sigma, args.min_len, args.max_len, args.seed
    )
    start = time.time()
    rows: list[Row] = []
    for d in args.head_dim:
        rows += bench_head_dim(d, lengths, methods, args)
        print(f"d={d}: {time.time() - start:.0f} s", file=sys.stderr)

    device = torch.cuda.get_device_name()
    padded_pairs = len(lengths) * max(lengths) ** 2
    real_pairs = sum(n * n for n in lengths)
    summary = (
        f"device: {device}; torch {torch.__version__}; {args.dtype}; {sum(lengths)} tokens in "
        f"{len(lengths)} sequences (lengths {min(lengths)}..{max(lengths)}, median "
        f"{int(np.median(lengths))}; lognormal median {args.median:g} sigma {args.sigma:g} "
        f"clipped to {args.min_len}..{args.max_len}, seed {args.seed}); Hq = Hkv = 2048 / d; "
        f"padded to the longest: {padded_pairs / real_pairs:.1f}x the pairs"
    )
    timing = (
        f"TFLOP/s on the real pairs (dense: its own), median per call, calls queued back to back, "
        f"{args.rounds} interleaved rounds; {time.time() - start:.0f} s"
    )
    table = format_table(rows, args)
    notes = [
        f"  d={r.head_dim}{' causal' if r.causal else ''} {label_of(r.method, args)}: {n}"
        for r in rows
        for n in r.notes
    ]
    text = [summary, timing]
    if notes:
        text += ["peers that did not run (or not fully):", *notes]
    text += ["", table]
    results = {
        "device": device,
        "torch": torch.__version__,
        "cuflash": cuflash.__version__,
        "dtype": args.dtype,
        "lengths": lengths,
        "distribution": dict(
            median=args.median, sigma=args.sigma, lo=args.min_len, hi=args.max_len, seed=args.seed
        ),
        "dense_seq": args.dense_seq,
        "rounds": args.rounds,
        "seconds": time.time() - start,
        "rows": [
            {
                **{k: v for k, v in vars(r).items()},
                "fwd_tflops": r.tflops("fwd"),
                "bwd_tflops": r.tflops("bwd"),
            }
            for r in rows
        ],
    }
    (out / "varlen_results.json").write_text(json.dumps(results, indent=1))
    (out / "varlen_table.txt").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
