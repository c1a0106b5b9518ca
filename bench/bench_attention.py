"""cuflash against its peers, side by side: same process, same inputs, CUDA events.

    python bench/bench_attention.py [--quick] [--dtype bfloat16 float16] [--head-dim 64 128 256]
        [--seq 512 1024 ...] [--causal both|yes|no] [--peers flash cudnn efficient naive]
        [--baseline DIR] [--no-gqa] [--no-memory] [--no-overhead] [--out DIR]

Peers: PyTorch SDPA's flash (FlashAttention-2), cuDNN and memory-efficient backends, and a naive
CuPy attention (S = Q K^T materialised). --baseline DIR adds the peer "baseline": the cuflash of
another checkout (DIR holds its cuflash/ and kernels_cu/, e.g. `git worktree add DIR <commit>`),
imported beside this one, so that two versions are timed in the same rounds on the same inputs.
The grid follows the FlashAttention papers: B = 16384 / N, Hq = 2048 / d, so every point has 16k
tokens and a model width of 2048; plus grouped heads (Hq = 32, Hkv = 8) at d = 128. FLOPs:
forward 4 B Hq Nq Nk d, halved for causal; backward 2.5x the forward. Each time is the median of
many runs after warm-up, timed with CUDA events on repetitions queued back to back (device time;
--sync-each-rep for the method up to v7). The points of one shape (every method, causal and not)
are timed in interleaved rounds on the same inputs (--rounds), so that their ratios are measured
side by side.

Writes bench_results.json, bench_table.txt and bench_plot.png (TFLOP/s against N) to --out, and
prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuflash  # noqa: E402

METHODS = ("cuflash", "baseline", "flash", "cudnn", "efficient", "naive")
SLOWER = 0.97  # a point where cuflash runs under this fraction of the baseline is listed
_baseline = None  # the cuflash of --baseline, imported as cuflash_baseline


def load_baseline(root: str, name: str = "cuflash_baseline"):
    """The cuflash package of the checkout at `root`, as the module `name`."""
    import importlib.util

    package = Path(root).resolve() / "cuflash"
    spec = importlib.util.spec_from_file_location(
        name, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Point:
    dtype: str
    head_dim: int
    seq: int
    batch: int
    heads_q: int
    heads_kv: int
    causal: bool
    fwd_ms: dict[str, float] = field(default_factory=dict)
    bwd_ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def fwd_flops(self) -> float:
        flops = 4.0 * self.batch * self.heads_q * self.seq * self.seq * self.head_dim
        return flops / 2 if self.causal else flops

    def tflops(self, method: str, which: str) -> float | None:
        ms = (self.fwd_ms if which == "fwd" else self.bwd_ms).get(method)
        if ms is None:
            return None
        flops = self.fwd_flops * (1.0 if which == "fwd" else 2.5)
        return flops / (ms * 1e-3) / 1e12

    @property
    def label(self) -> str:
        gqa = f" gqa {self.heads_q}/{self.heads_kv}" if self.heads_q != self.heads_kv else ""
        return (
            f"{self.dtype:8s} d={self.head_dim:3d} N={self.seq:5d} B={self.batch:2d} "
            f"H={self.heads_q:2d}{gqa}{' causal' if self.causal else ''}"
        )


def event_times(fn, reps: int, sync_each_rep: bool) -> list[float]:
    """Times of `reps` calls of fn, each between two CUDA events on the current stream: queued
    back to back and waited for once (device time), or each waited for (sync_each_rep)."""
    events = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if sync_each_rep:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_ms(
    fn, warmup: int, min_reps: int, min_time_ms: float, sync_each_rep: bool = False
) -> float:
    """Median over repetitions of fn, each between two CUDA events on the current stream.

    By default the repetitions are queued back to back and waited for once: a repetition's start
    event fires when the previous one's work ends, so the host's cost of the next call overlaps
    the device's work and each time is the device time of one call (as Triton's do_bench
    measures). With sync_each_rep every repetition is waited for before the next is launched
    (the method up to v7, docs/perf/NOTES.md v8): each time then also holds the host's launch
    latency of that call while the GPU waits, some 20-30 us, a few percent of a 0.5 ms kernel.
    The number of repetitions reaches min_reps and about min_time_ms (at most 1000)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    if sync_each_rep:
        times: list[float] = []
        while len(times) < min_reps or sum(times) < min_time_ms:
            times += event_times(fn, 1, True)
            if len(times) >= 1000:
                break
        return statistics.median(times)
    estimate = statistics.median(event_times(fn, 3, True))
    reps = min(1000, max(min_reps, math.ceil(min_time_ms / max(estimate, 1e-3))))
    return statistics.median(event_times(fn, reps, False))


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[name]


def make_inputs(p: Point, requires_grad: bool):
    dt = getattr(torch, p.dtype)
    shape_q = (p.batch, p.heads_q, p.seq, p.head_dim)
    shape_kv = (p.batch, p.heads_kv, p.seq, p.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=dt, requires_grad=requires_grad)
    k = torch.randn(shape_kv, device="cuda", dtype=dt, requires_grad=requires_grad)
    v = torch.randn(shape_kv, device="cuda", dtype=dt, requires_grad=requires_grad)
    return q, k, v


def naive_cupy(q, k, v, causal: bool, scale: float):
    """Materialised attention in CuPy: S, P in the input dtype, the softmax in float32."""
    import cupy

    qc, kc, vc = (cupy.from_dlpack(x.detach()) for x in (q, k, v))
    group = qc.shape[1] // kc.shape[1]
    if group > 1:
        kc, vc = cupy.repeat(kc, group, axis=1), cupy.repeat(vc, group, axis=1)
    s = (qc @ kc.transpose(0, 1, 3, 2)).astype(cupy.float32) * scale
    if causal:
        n = s.shape[-1]
        s = cupy.where(cupy.tri(n, dtype=bool), s, -cupy.inf)
    s = cupy.exp(s - s.max(axis=-1, keepdims=True))
    p = (s / s.sum(axis=-1, keepdims=True)).astype(qc.dtype)
    return p @ vc


@dataclass
class Job:
    """One timed quantity of a configuration: a method's forward or backward at one causal value.
    Its repetition times accumulate over the rounds of bench_config."""

    point: Point
    method: str
    which: str  # "fwd" or "bwd"
    fn: Callable[[], object]
    # entered around each batch of repetitions (SDPA's backend choice), not around every call
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    reps_per_round: int = 1
    times: list[float] = field(default_factory=list)
    failed: bool = False


def rep_times(job: Job, reps: int, sync_each_rep: bool) -> list[float]:
    """event_times of job.fn inside its context."""
    with job.context():
        return event_times(job.fn, reps, sync_each_rep)


def method_jobs(p: Point, method: str, q, k, v, do, scale: float, args) -> list[Job]:
    """The timed calls of `method` at point p (forward, and backward where it has one), each run
    once here so that a peer that does not support the case fails before the timing starts."""
    gqa = p.heads_q != p.heads_kv
    if method in ("cuflash", "baseline"):
        lib = cuflash if method == "cuflash" else _baseline
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        o, lse = lib.attention_forward(qd, kd, vd, causal=p.causal, layout="bhsd")
        lib.attention_backward(do, qd, kd, vd, o, lse, causal=p.causal, layout="bhsd")
        return [
            Job(
                p,
                method,
                "fwd",
                lambda: lib.attention_forward(qd, kd, vd, causal=p.causal, layout="bhsd"),
            ),
            Job(
                p,
                method,
                "bwd",
                lambda: lib.attention_backward(
                    do, qd, kd, vd, o, lse, causal=p.causal, layout="bhsd"
                ),
            ),
        ]
    if method == "naive":
        if p.dtype == "bfloat16":
            raise Skip("skipped: CuPy has no bfloat16 matrix product")
        if p.batch * p.heads_q * p.seq * p.seq * 6 > args.naive_limit_gb * 2**30:
            raise Skip("skipped: S and P would not fit")
        naive_cupy(q, k, v, p.causal, scale)
        return [Job(p, method, "fwd", lambda: naive_cupy(q, k, v, p.causal, scale))]
    backend = sdpa_backend(method)

    def context():
        return torch.nn.attention.sdpa_kernel(backend)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=p.causal, enable_gqa=gqa)

    with context():
        out = fwd()

    def bwd():
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    jobs = [Job(p, method, "fwd", lambda: fwd().detach(), context)]
    try:
        bwd()
        jobs.append(Job(p, method, "bwd", bwd, context))
    except Exception as exc:  # a backend with a forward but no backward for the case
        p.errors[method] = f"backward: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return jobs


class Skip(Exception):
    """A peer that is left out of a point on purpose (the reason is recorded, not an error)."""


def bench_config(points: list[Point], methods: list[str], args) -> None:
    """Time every method on `points`, which share dtype, shape and inputs and differ in `causal`.

    The calls are timed in `args.rounds` rounds; each round times every (method, causal, fwd/bwd)
    once, in alternating order, and each time is the median of all repetitions of all rounds.
    Compared quantities (cuflash against a peer, causal against non-causal) are thus measured
    side by side within a few seconds, so a slow drift of the GPU's clock between points (it
    runs at its power limit) does not enter their ratios (docs/perf/NOTES.md, v9)."""
    p0 = points[0]
    scale = 1.0 / math.sqrt(p0.head_dim)
    q, k, v = make_inputs(p0, requires_grad=True)
    do = torch.randn_like(q)
    jobs: list[Job] = []
    for p in points:
        for method in methods:
            try:
                jobs += method_jobs(p, method, q, k, v, do, scale, args)
            except Skip as why:
                p.errors[method] = str(why)
            except Exception as exc:  # a peer that does not support the case
                p.errors[method] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"

    def attempt(job: Job, action: Callable[[], None]) -> None:
        if job.failed:
            return
        try:
            action()
        except Exception as exc:  # e.g. out of memory beside the other jobs' buffers
            job.failed = True
            job.point.errors[job.method] = f"{job.which}: {type(exc).__name__}: {str(exc)[:120]}"

    def prepare(job: Job) -> None:  # warm-up, then repetitions per round from a first estimate
        with job.context():
            for _ in range(args.warmup):
                job.fn()
        estimate = statistics.median(rep_times(job, 3, True))
        total = min(1000, max(args.reps, math.ceil(args.min_time_ms / max(estimate, 1e-3))))
        job.reps_per_round = max(1, math.ceil(total / rounds))

    rounds = max(1, args.rounds)
    for job in jobs:
        attempt(job, lambda job=job: prepare(job))
    for r in range(rounds):
        for job in jobs if r % 2 == 0 else reversed(jobs):
            attempt(
                job,
                lambda job=job: job.times.extend(
                    rep_times(job, job.reps_per_round, args.sync_each_rep)
                ),
            )
    for job in jobs:
        if job.times and not job.failed:
            ms = job.point.fwd_ms if job.which == "fwd" else job.point.bwd_ms
            ms[job.method] = statistics.median(job.times)
    del jobs
    torch.cuda.empty_cache()


def host_overhead(calls: int = 1000) -> dict[str, float]:
    """Mean wall time per call of 1000 back-to-back tiny forward calls (B=1, H=1, N=64, d=64)."""
    q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    result = {}

    def run(fn):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    result["cuflash"] = run(lambda: cuflash.attention_forward(q, k, v, layout="bhsd"))
    if _baseline is not None:
        result["baseline"] = run(lambda: _baseline.attention_forward(q, k, v, layout="bhsd"))
    from torch.nn.attention import SDPBackend

    with torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        result["sdpa_flash"] = run(lambda: F.scaled_dot_product_attention(q, k, v))
    return result


def memory_table(seqs: list[int], dtype: str = "bfloat16", d: int = 128, heads: int = 16):
    """Peak device memory of one forward + backward (B = 1) for cuflash and naive attention."""
    rows = []
    for n in seqs:
        row = {"seq": n}
        for method in ("cuflash", "naive"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                q, k, v = (
                    torch.randn(
                        1,
                        heads,
                        n,
                        d,
                        device="cuda",
                        dtype=getattr(torch, dtype),
                        requires_grad=method == "naive",
                    )
                    for _ in range(3)
                )
                do = torch.randn_like(q)
                if method == "cuflash":
                    o, lse = cuflash.attention_forward(q, k, v, layout="bhsd")
                    grads = cuflash.attention_backward(do, q, k, v, o, lse, layout="bhsd")
                else:
                    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
                    o = torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
                    grads = torch.autograd.grad(o, (q, k, v), do)
                torch.cuda.synchronize()
                row[method] = (torch.cuda.max_memory_allocated() - base) / 2**20
                del grads, o
            except torch.OutOfMemoryError:
                row[method] = None
            finally:
                q = k = v = do = s = None  # noqa: F841
        rows.append(row)
    return rows


def grid(args) -> list[Point]:
    points = []
    for dtype in args.dtype:
        for d in args.head_dim:
            for n in args.seq:
                for causal in args.causal_values:
                    points.append(
                        Point(dtype, d, n, max(1, 16384 // n), 2048 // d, 2048 // d, causal)
                    )
        if not args.no_gqa and 128 in args.head_dim:
            for n in args.seq:
                for causal in args.causal_values:
                    points.append(Point(dtype, 128, n, max(1, 16384 // n), 32, 8, causal))
    return points


def format_table(points: list[Point], methods: list[str]) -> str:
    peers = [m for m in methods if m != "cuflash"]
    lines = []
    for which in ("fwd", "bwd"):
        head = f"{'TFLOP/s ' + which:54s} {'cuflash':>8s} " + " ".join(f"{m:>9s}" for m in peers)
        head += "   " + " ".join(f"{'x ' + m:>9s}" for m in peers)
        lines += [head, "-" * len(head)]
        for p in points:
            ours = p.tflops("cuflash", which)
            cells = [f"{x:9.1f}" if (x := p.tflops(m, which)) else f"{'-':>9s}" for m in peers]
            ratios = [
                f"{ours / x:9.2f}" if ours and (x := p.tflops(m, which)) else f"{'-':>9s}"
                for m in peers
            ]
            lines.append(
                f"{p.label:54s} {ours or 0:8.1f} " + " ".join(cells) + "   " + " ".join(ratios)
            )
        lines.append("")
    if "baseline" in peers:
        lines.append(baseline_summary(points))
    return "\n".join(lines)


def baseline_summary(points: list[Point]) -> str:
    """cuflash against --baseline: the range of the ratios and the points under SLOWER."""
    lines = []
    for which in ("fwd", "bwd"):
        ratios = [
            (ours / theirs, p.label)
            for p in points
            if (ours := p.tflops("cuflash", which)) and (theirs := p.tflops("baseline", which))
        ]
        if not ratios:
            continue
        low = sorted(r for r in ratios if r[0] < SLOWER)
        lines.append(
            f"{which} x baseline: {min(r for r, _ in ratios):.3f}-{max(r for r, _ in ratios):.3f} "
            f"over {len(ratios)} points; under {SLOWER}: {len(low)}"
        )
        lines += [f"  {r:.3f} {label}" for r, label in low]
    return "\n".join(lines)


def plot(points: list[Point], methods: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    configs = sorted({(p.dtype, p.head_dim, p.heads_q != p.heads_kv, p.causal) for p in points})
    fig, axes = plt.subplots(len(configs), 2, figsize=(11, 3.2 * len(configs)), squeeze=False)
    for row, cfg in enumerate(configs):
        pts = sorted(
            (p for p in points if (p.dtype, p.head_dim, p.heads_q != p.heads_kv, p.causal) == cfg),
            key=lambda p: p.seq,
        )
        for col, which in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            for m in methods:
                xs = [p.seq for p in pts if p.tflops(m, which)]
                ys = [p.tflops(m, which) for p in pts if p.tflops(m, which)]
                if xs:
                    ax.plot(xs, ys, marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_title(
                f"{which} {cfg[0]} d={cfg[1]}{' gqa' if cfg[2] else ''}"
                f"{' causal' if cfg[3] else ''}",
                fontsize=9,
            )
            ax.set_xlabel("N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    global _baseline
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small grid in under two minutes (bf16, d 64 and 128, N 1k and 4k, the SDPA flash "
        "and cuDNN peers), where --dtype, --head-dim and --seq do not say otherwise",
    )
    parser.add_argument("--dtype", nargs="+")
    parser.add_argument("--head-dim", nargs="+", type=int)
    parser.add_argument("--seq", nargs="+", type=int)
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--peers", nargs="+", default=["flash", "cudnn", "efficient", "naive"])
    parser.add_argument("--baseline", help="a checkout whose cuflash is timed as a peer")
    parser.add_argument("--no-gqa", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-overhead", action="store_true")
    parser.add_argument(
        "--memory-seq", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768, 65536]
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--min-time-ms", type=float, default=100.0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="interleaved rounds per shape: every method, causal and not, timed once per round",
    )
    parser.add_argument(
        "--sync-each-rep",
        action="store_true",
        help="wait for each timed call before the next (the method up to v7): times include "
        "the host's launch latency",
    )
    parser.add_argument("--naive-limit-gb", type=float, default=16.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = parser.parse_args(argv)
    grid_default = (
        (["bfloat16"], [64, 128], [1024, 4096])
        if args.quick
        else (["bfloat16", "float16"], [64, 128, 256], [512, 1024, 2048, 4096, 8192, 16384])
    )
    args.dtype = args.dtype or grid_default[0]
    args.head_dim = args.head_dim or grid_default[1]
    args.seq = args.seq or grid_default[2]
    if args.quick:
        args.peers = [p for p in args.peers if p in ("flash", "cudnn")]
        args.no_memory = True
        args.min_time_ms, args.reps = 30.0, 5
    if args.baseline:
        _baseline = load_baseline(args.baseline)
        args.peers = ["baseline"] + [p for p in args.peers if p != "baseline"]
    args.causal_values = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    methods = ["cuflash"] + [m for m in args.peers if m in METHODS and m != "cuflash"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    points = grid(args)
    try:
        from tqdm import tqdm
    except ImportError:

        def tqdm(xs, **_):
            return xs

    configs: dict[tuple, list[Point]] = {}
    for p in points:  # the causal and non-causal points of a shape share inputs and rounds
        configs.setdefault((p.dtype, p.head_dim, p.seq, p.heads_q, p.heads_kv), []).append(p)
    start = time.time()
    for group in tqdm(list(configs.values()), desc="benchmark", file=sys.stderr, mininterval=5):
        bench_config(group, methods, args)
    overhead = None if args.no_overhead else host_overhead()
    memory = None if args.no_memory else memory_table(args.memory_seq)

    table = format_table(points, methods)
    device = torch.cuda.get_device_name()
    results = {
        "device": device,
        "torch": torch.__version__,
        "cuflash": cuflash.__version__,
        "baseline": args.baseline,
        "seconds": time.time() - start,
        "timing": "sync-each-rep" if args.sync_each_rep else "back-to-back",
        "rounds": args.rounds,
        "points": [asdict(p) for p in points],
        "host_overhead_us": overhead,
        "memory_mib": memory,
    }
    (out / "bench_results.json").write_text(json.dumps(results, indent=1))
    timing = "each call waited for" if args.sync_each_rep else "calls queued back to back"
    text = [
        f"device: {device}; median time per call, {timing}, in {args.rounds} interleaved rounds",
        table,
    ]
    if overhead:
        text.append(
            "host overhead per call (B=1 H=1 N=64 d=64, mean of 1000): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in overhead.items())
        )
    if memory:
        text.append("peak memory of forward+backward, MiB (B=1 H=16 d=128 bf16):")
        for row in memory:
            text.append(
                f"  N={row['seq']:6d}  cuflash {row['cuflash'] or 'OOM'!s:>10}  "
                f"naive {row['naive'] or 'OOM'!s:>10}"
            )
    errors = [f"  {p.label}: {m}: {e}" for p in points for m, e in p.errors.items()]
    if errors:
        text.append("peers that did not run:\n" + "\n".join(errors[:30]))
    (out / "bench_table.txt").write_text("\n".join(text) + "\n")
    plot(points, methods, out / "bench_plot.png")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
