"""Quick check of the Hopper forward kernel (kernels_cu/forward_sm90.cu) on one GPU call.

1. Correctness of the library's forward (wgmma path) against a float32 torch computation on
   awkward shapes (odd N, d below the bucket, causal, grouped heads, strided views).
2. Forward TFLOP/s of the wgmma kernel, the sm_80 kernel (same process) and SDPA's flash and
   cuDNN backends, bf16, B = 16384 / N, H = 2048 / d.

    python bench/probe_sm90.py [--seq 4096 8192] [--head-dim 64 128]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuflash  # noqa: E402
from cuflash import _kernels, _plans  # noqa: E402

# The library's causal row-block alignment, restored after each comparison of the two.
default_alignment = _kernels.causal_end_aligned()


def reference(q, k, v, causal, scale):
    """float32 attention in (B, N, H, d), bottom-right causal, grouped heads."""
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(hq // hkv, dim=1)
    vf = vf.repeat_interleave(hq // hkv, dim=1)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse


# B, Nq, Nk, Hq, Hkv, d, causal, strided (q a view of every other column block)
CHECK_CASES = [
    (2, 300, 300, 3, 3, 128, False, False),
    (2, 300, 300, 3, 3, 128, True, False),
    (1, 257, 1000, 4, 2, 128, True, False),
    (1, 1000, 257, 4, 2, 128, True, False),
    (3, 129, 77, 2, 1, 100, False, False),
    (2, 513, 513, 2, 2, 64, True, False),
    (2, 64, 700, 2, 2, 50, False, True),
    (1, 1, 1, 1, 1, 128, False, False),
    (1, 4096, 4096, 2, 2, 128, True, False),
]


def check(dtype, cases=CHECK_CASES, only_bad: bool = False) -> bool:
    """The library's forward against the float32 reference on `cases`; prints every case, or
    only the failing ones."""
    torch.manual_seed(0)
    ok = True
    for b, nq, nk, hq, hkv, d, causal, strided in cases:
        q = torch.randn(b, nq, hq, (2 if strided else 1) * d, device="cuda", dtype=dtype)[..., :d]
        k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype)
        scale = 1 / math.sqrt(d)
        o, lse = cuflash.attention_forward(q, k, v, causal=causal, scale=scale)
        ro, rlse = reference(q, k, v, causal, scale)
        err_o = (o.float() - ro).abs().max().item()
        finite = torch.isfinite(rlse)
        err_l = (lse[finite] - rlse[finite]).abs().max().item() if finite.any() else 0.0
        # one rounding of o to the element type is the expected error scale
        limit = 4 * torch.finfo(dtype).eps * max(ro.abs().max().item(), 0.3)
        good = err_o <= limit and err_l <= 1e-3 and not torch.isnan(o).any()
        ok &= good
        if not (good and only_bad):
            print(
                f"{'ok ' if good else 'BAD'} {str(dtype)[6:]:8s} b{b} nq{nq} nk{nk} h{hq}/{hkv} "
                f"d{d} causal={causal} strided={strided}: max|o err| {err_o:.2e} "
                f"(limit {limit:.1e}), max|lse err| {err_l:.2e}"
            )
    return ok


def tma_patch_status() -> str:
    """Whether the plans' tensor maps have their address patched in place (cuflash/_tma.py)."""
    found = [
        m._split is not None for plan in _plans._plans.values() for m in getattr(plan, "maps", ())
    ]
    return f"{sum(found)} of {len(found)} maps"


def check_backward(dtype, only_d: int | None = None, only_bad: bool = False) -> bool:
    """Gradients of the library against float32 autograd of the reference, awkward shapes (those
    of head-dim bucket only_d when given); prints every case, or only the failing ones."""
    torch.manual_seed(1)
    ok = True
    cases = [
        # B, Nq, Nk, Hq, Hkv, d, causal
        (2, 300, 300, 3, 3, 128, False),
        (2, 300, 300, 3, 3, 128, True),
        (1, 257, 1000, 4, 2, 128, True),
        (1, 1000, 257, 4, 2, 64, True),
        (3, 129, 77, 2, 1, 100, False),
        (2, 513, 513, 2, 2, 64, True),
        (1, 1, 1, 1, 1, 64, False),
        (2, 700, 900, 4, 1, 48, False),
        (1, 1500, 1500, 2, 2, 64, True),
        (1, 2048, 2048, 2, 2, 128, True),
        (2, 300, 300, 3, 3, 256, True),
        (1, 257, 1000, 4, 2, 256, True),
        (1, 1000, 257, 2, 1, 232, True),
        (3, 129, 77, 2, 1, 256, False),
    ]
    for b, nq, nk, hq, hkv, d, causal in cases:
        if only_d is not None and _kernels.head_dim_bucket(d) != only_d:
            continue
        q = torch.randn(b, nq, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype)
        do = torch.randn(b, nq, hq, d, device="cuda", dtype=dtype)
        scale = 1 / math.sqrt(d)
        o, lse = cuflash.attention_forward(q, k, v, causal=causal, scale=scale)
        dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
        qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
        ro, _ = reference(qf, kf, vf, causal, scale)
        ro.backward(do.float())
        line = []
        good = True
        for name, got, ref in (("dq", dq, qf.grad), ("dk", dk, kf.grad), ("dv", dv, vf.grad)):
            err = (got.float() - ref).abs().max().item()
            limit = 8 * torch.finfo(dtype).eps * max(ref.abs().max().item(), 0.3)
            good &= err <= limit and not torch.isnan(got).any().item()
            line.append(f"{name} {err:.1e}/{limit:.1e}")
        ok &= good
        if good and only_bad:
            continue
        print(
            f"{'ok ' if good else 'BAD'} bwd {str(dtype)[6:]:8s}"
            f" b{b} nq{nq} nk{nk} h{hq}/{hkv} d{d} "
            f"causal={causal}: " + ", ".join(line)
        )
    return ok


def grid_inputs(n: int, d: int, count: int) -> tuple:
    """(B, H, tensors) of one point of the FlashAttention papers' grid: B = 16384 / N,
    H = 2048 / d, `count` random bf16 tensors (B, N, H, d)."""
    b, h = 16384 // n, 2048 // d
    return (
        b,
        h,
        tuple(torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(count)),
    )


def time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bench(seqs, dims) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(
        f"{'d':>4} {'N':>6} {'causal':>6} | {'wgmma':>7} {'sm80':>7} {'flash':>7} {'cudnn':>7}"
        " | wgmma/flash"
    )
    for d in dims:
        for n in seqs:
            for causal in (False, True):
                b, h, (q, k, v) = grid_inputs(n, d, 3)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                res = {}
                for name, enabled in (("wgmma", True), ("sm80", False)):
                    _kernels.set_wgmma(enabled)
                    res[name] = time_ms(lambda: cuflash.attention_forward(q, k, v, causal=causal))
                _kernels.set_wgmma(True)
                for name, backend in (
                    ("flash", SDPBackend.FLASH_ATTENTION),
                    ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ):
                    try:
                        with sdpa_kernel(backend):
                            res[name] = time_ms(
                                lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                            )
                    except RuntimeError:
                        res[name] = float("nan")
                tf = {kk: flops / (ms * 1e-3) / 1e12 for kk, ms in res.items()}
                print(
                    f"{d:4d} {n:6d} {str(causal):>6} | {tf['wgmma']:7.1f} {tf['sm80']:7.1f} "
                    f"{tf['flash']:7.1f} {tf['cudnn']:7.1f} | {tf['wgmma'] / tf['flash']:.2f}",
                    flush=True,
                )


def check_head_dim(d: int, dtype=torch.bfloat16) -> bool:
    """Forward of one head dim on the shapes that exercise a tile configuration: causal (masked
    tiles first), Nk not a multiple of any tile, Nq != Nk, d below the bucket, strided views."""
    cases = [
        (2, 300, 300, 3, 3, d, True, False),
        (2, 513, 513, 2, 2, d, False, False),
        (1, 257, 1000, 4, 2, d, True, False),
        (1, 1000, 257, 4, 2, d, True, False),
        (2, 64, 700, 2, 2, d - 14, False, True),
        (1, 2048, 2048, 2, 1, d, True, False),
    ]
    return check(dtype, cases, only_bad=True)


def sweep(configs: dict[int, list[tuple[int, ...]]], seqs, family: str = "forward_sm90") -> None:
    """Forward TFLOP/s of each tile tuple of a Hopper forward kernel (`family`: forward_sm90, the
    cp.async kernel, or forward_tma), bf16, B = 16384 / N, H = 2048 / d, with SDPA's flash
    backend on the same shapes first (and, for the TMA kernel, the cp.async kernel's table
    tiles)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(
        "sweep: d tiles | "
        + " ".join(f"N={n} {'causal' if c else 'full'}" for n in seqs for c in (0, 1))
    )

    def row_for(d, fn_of):
        row = []
        for n in seqs:
            for causal in (False, True):
                b, h, (q, k, v) = grid_inputs(n, d, 3)
                ms = time_ms(fn_of(q, k, v, causal))
                row.append(4 * b * h * n * n * d * (0.5 if causal else 1.0) / ms / 1e9)
        return " ".join(f"{t:6.1f}" for t in row)

    def flash(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        return run

    def ours(q, k, v, causal):
        return lambda: cuflash.attention_forward(q, k, v, causal=causal)

    _kernels.set_tma(family == "forward_tma")
    for d, tiles in configs.items():
        print(f"sweep: {d} sdpa-flash | {row_for(d, flash)}", flush=True)
        if family == "forward_tma":
            _kernels.set_tma(False)
            print(f"sweep: {d} cp.async table | {row_for(d, ours)}", flush=True)
            _kernels.set_tma(True)
        for t in tiles:
            _kernels.set_tile_override(family, "bfloat16", d, t)
            try:
                ok = check_head_dim(d)
                print(f"sweep: {d} {t} {'ok' if ok else 'WRONG'} | {row_for(d, ours)}", flush=True)
            except Exception as exc:  # a configuration that does not build or launch
                print(f"sweep: {d} {t} failed: {exc}"[:300], flush=True)
            _kernels.set_tile_override(family, "bfloat16", d, None)
    _kernels.set_tma(True)


def bench_backward(seqs, dims) -> None:
    """Backward TFLOP/s (2.5x the forward count) of the library (wgmma, sm80) and SDPA flash."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print(
        f"{'d':>4} {'N':>6} {'causal':>6} | {'wgmma':>7} {'sm80':>7} {'flash':>7} | bwd wgmma/flash"
    )
    for d in dims:
        for n in seqs:
            for causal in (False, True):
                b, h, (q, k, v, do) = grid_inputs(n, d, 4)
                flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                res = {}
                for name, enabled in (("wgmma", True), ("sm80", False)):
                    _kernels.set_wgmma(enabled)
                    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
                    res[name] = time_ms(
                        lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
                    )
                _kernels.set_wgmma(True)
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    dot = do.transpose(1, 2)
                    res["flash"] = time_ms(
                        lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
                    )
                tf = {kk: flops / (ms * 1e-3) / 1e12 for kk, ms in res.items()}
                print(
                    f"{d:4d} {n:6d} {str(causal):>6} | {tf['wgmma']:7.1f} {tf['sm80']:7.1f} "
                    f"{tf['flash']:7.1f} | {tf['wgmma'] / tf['flash']:.2f}",
                    flush=True,
                )


def backward_row(d: int, seqs, flash: bool = False) -> str:
    """Backward TFLOP/s (2.5x the forward count) of the library, or of SDPA's flash backend,
    bf16, B = 16384 / N, H = 2048 / d, at each N, not causal and causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    row = []
    for n in seqs:
        for causal in (False, True):
            b, h, (q, k, v, do) = grid_inputs(n, d, 4)
            if flash:
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                dot = do.transpose(1, 2)
                ms = time_ms(lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True))
            else:
                o, lse = cuflash.attention_forward(q, k, v, causal=causal)
                ms = time_ms(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal))
            row.append(10 * b * h * n * n * d * (0.5 if causal else 1.0) / ms / 1e9)
    return " ".join(f"{t:6.1f}" for t in row)


def sweep_backward(
    configs: dict[tuple[str, int], list[tuple[int, ...]]], seqs, suffix: str = "_sm90"
) -> None:
    """Backward TFLOP/s per tile tuple of one Hopper backward kernel (the other at its default):
    suffix "_sm90" for the cp.async kernels' (BM, BN), "_tma" for the TMA kernels'
    (BM, BN, STAGES); the TMA sweep starts with SDPA flash and the cp.async kernels per d."""
    print(
        "sweep-bwd: family d tiles | "
        + " ".join(f"N={n} {'causal' if c else 'full'}" for n in seqs for c in (0, 1))
    )
    if suffix == "_tma":
        for d in sorted({d for _, d in configs}):
            print(f"sweep-bwd: {d} sdpa-flash | {backward_row(d, seqs, flash=True)}", flush=True)
            _kernels.set_tma(False)
            print(f"sweep-bwd: {d} cp.async table | {backward_row(d, seqs)}", flush=True)
            _kernels.set_tma(True)
    for (family, d), tiles in configs.items():
        for t in tiles:
            _kernels.set_tile_override(family + suffix, "bfloat16", d, t)
            try:
                ok = check_backward(torch.bfloat16, only_d=d, only_bad=True)
                row = backward_row(d, seqs)
                print(f"sweep-bwd: {family} {d} {t} {'ok' if ok else 'WRONG'} | {row}", flush=True)
            except Exception as exc:
                print(f"sweep-bwd: {family} {d} {t} failed: {exc}"[:300], flush=True)
            _kernels.set_tile_override(family + suffix, "bfloat16", d, None)


def profile_kernels(seqs, dims) -> None:
    """Mean device time of each kernel of one forward and one backward call (torch.profiler),
    bf16, B = 16384 / N, H = 2048 / d: where the time of a call goes."""
    from torch.profiler import ProfilerActivity, profile

    for d in dims:
        for n in seqs:
            for causal in (False, True):
                b, h, (q, k, v, do) = grid_inputs(n, d, 4)
                o, lse = cuflash.attention_forward(q, k, v, causal=causal)
                cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
                torch.cuda.synchronize()
                reps = 5
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(reps):
                        cuflash.attention_forward(q, k, v, causal=causal)
                        cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
                    torch.cuda.synchronize()
                cells = []
                for evt in prof.key_averages():
                    total = getattr(evt, "device_time_total", None)
                    if total is None:
                        total = getattr(evt, "cuda_time_total", 0)
                    if total > 0 and "attention" in evt.key:
                        name = evt.key.split("<")[0].replace("cuflash::attention_", "")
                        cells.append(f"{name} {total / reps:8.1f}")
                print(f"profile: d={d} N={n} causal={causal} | " + ", ".join(cells), flush=True)


def ab_causal_layout(seqs, dims) -> None:
    """Causal TMA forward TFLOP/s with the row blocks aligned to the start of the sequence and
    to its end (_kernels.set_causal_end_aligned, NOTES v8), measured alternately twice each,
    beside the non-causal figure of the same shape; bf16, B = 16384 / N, H = 2048 / d. At d = 64
    both tile heights run whatever the table picks, to place the causal threshold of the tall
    tiles."""
    configs: list[tuple[int, tuple[int, ...] | None]] = [(d, None) for d in dims]
    if 64 in dims:
        configs += [(64, (128, 128, 2)), (64, (192, 128, 2))]
    print("ab: d tiles N | full | causal start, end, start, end | causal/full start end")
    for d, tiles in configs:
        if tiles:
            _kernels.set_tile_override("forward_tma", "bfloat16", d, tiles)
        for n in seqs:
            b, h, (q, k, v) = grid_inputs(n, d, 3)
            flops = 4 * b * h * n * n * d

            def run(causal):
                return lambda: cuflash.attention_forward(q, k, v, causal=causal)

            full = flops / time_ms(run(False)) / 1e9
            causal = {False: [], True: []}
            for end in (False, True, False, True):
                _kernels.set_causal_end_aligned(end)
                causal[end].append(flops / 2 / time_ms(run(True)) / 1e9)
            _kernels.set_causal_end_aligned(default_alignment)
            start_best, end_best = max(causal[False]), max(causal[True])
            print(
                f"ab: {d} {tiles or 'table'} {n} | {full:6.1f} | "
                f"{causal[False][0]:6.1f} {causal[True][0]:6.1f} {causal[False][1]:6.1f} "
                f"{causal[True][1]:6.1f} | {start_best / full:.3f} {end_best / full:.3f}",
                flush=True,
            )
        if tiles:
            _kernels.set_tile_override("forward_tma", "bfloat16", d, None)


def item_costs(seqs, dims, rounds: int = 5) -> None:
    """Where the causal forward's time goes (NOTES v9). At a fixed Nq (the same work items, BM
    query rows each) the non-causal forward runs with Nk = N, N / 2 + BN / 2 and N / 4 + BN / 2
    keys: per item, 32, 16.5 and 8.5 key tiles at N = 4096, BN = 128, the last two ending in a
    half-masked tile as the causal diagonal does. A least-squares line through the three gives a
    cost per item (intercept) and per key tile (slope); the causal forward, whose items average
    the middle point's tiles, is then compared with that line's prediction. Both ways of writing
    O (TMA stores and from registers, set_tma_store) in the same rounds. bf16, B = 16384 / N,
    H = 2048 / d; the runs are timed in alternating rounds, medians printed."""
    print(
        "items: d N BM BN O-store | ms: full, half keys, quarter keys, causal | per item us, "
        "per tile us | causal predicted ms, measured/predicted | causal/full TFLOP/s ratio"
    )
    default_store = _kernels.tma_store_enabled()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for d in dims:
        for n in seqs:
            b, h, (q, k, v) = grid_inputs(n, d, 3)
            spec = _kernels.tma_spec("forward", "bfloat16", d, "sm_90a", n, True)
            bm, bn = spec.rows_per_block, spec.rows_per_step
            key_counts = (n, n // 2 + bn // 2, n // 4 + bn // 2)
            calls = [
                (lambda nk=nk: cuflash.attention_forward(q, k[:, :nk], v[:, :nk]))
                for nk in key_counts
            ]
            calls.append(lambda: cuflash.attention_forward(q, k, v, causal=True))
            runs = [(store, call) for store in (True, False) for call in calls]
            times: list[list[float]] = [[] for _ in runs]
            for r in range(rounds):
                order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))
                for i in order:
                    _kernels.set_tma_store(runs[i][0])
                    times[i].append(time_ms(runs[i][1]))
            _kernels.set_tma_store(default_store)
            # time = items_per_sm * (c + tiles_per_item * t): c and t from the non-causal runs
            items_per_sm = math.ceil(b * h * math.ceil(n / bm) / sms)
            xs = [math.ceil(nk / bn) for nk in key_counts]
            mx = sum(xs) / 3
            causal_tiles = (n / bn + 1) / 2  # mean key tiles of a causal item, diagonal too
            for v_index, store in enumerate(("tma", "registers")):
                ms = [sorted(t)[len(t) // 2] for t in times[4 * v_index : 4 * v_index + 4]]
                ys = [m * 1e3 / items_per_sm for m in ms[:3]]
                my = sum(ys) / 3
                slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
                    (x - mx) ** 2 for x in xs
                )
                intercept = my - slope * mx
                predicted = items_per_sm * (intercept + causal_tiles * slope) / 1e3
                print(
                    f"items: {d} {n} {bm} {bn} {store} | {ms[0]:.3f} {ms[1]:.3f} {ms[2]:.3f} "
                    f"{ms[3]:.3f} | {intercept:6.2f} {slope:5.2f} | {predicted:.3f} "
                    f"{ms[3] / predicted:.3f} | {ms[0] / (2 * ms[3]):.3f}",
                    flush=True,
                )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--sweep", action="store_true", help="compare (BM, BN) of the wgmma kernel")
    parser.add_argument("--sweep-backward", action="store_true")
    parser.add_argument(
        "--sweep-tma",
        nargs="*",
        type=str,
        default=None,
        metavar="D:BM,BN,S",
        help="compare (BM, BN, STAGES) of the TMA forward (default set if empty)",
    )
    parser.add_argument(
        "--sweep-tma-backward",
        nargs="*",
        type=str,
        default=None,
        metavar="FAMILY:D:BM,BN,S",
        help="compare tiles of the TMA dq / dkdv kernels (default set if empty)",
    )
    parser.add_argument("--profile", action="store_true", help="device time per kernel")
    parser.add_argument(
        "--check-tiles",
        nargs="+",
        metavar="D:BM,BN,S[,TURNS]",
        help="only check the TMA forward with these tiles (bf16 and fp16, causal row blocks "
        "start- and end-aligned) against the reference; exit 1 on a mismatch",
    )
    parser.add_argument(
        "--item-costs",
        action="store_true",
        help="per-item and per-key-tile cost of the forward, and the causal forward against them",
    )
    parser.add_argument(
        "--ab-causal-layout",
        action="store_true",
        help="causal forward with start- against end-aligned row blocks (after a check of both)",
    )
    args = parser.parse_args()
    if args.check_tiles:
        ok = True
        for item in args.check_tiles:
            d, tiles = item.split(":")
            d, tiles = int(d), tuple(int(x) for x in tiles.split(","))
            for dtype in (torch.bfloat16, torch.float16):
                name = str(dtype)[6:]
                _kernels.set_tile_override("forward_tma", name, d, tiles)
                for end in (False, True):
                    _kernels.set_causal_end_aligned(end)
                    good = check_head_dim(d, dtype)
                    verdict = "ok" if good else "WRONG"
                    print(f"check-tiles: {d} {tiles} {name} end-aligned={end}: {verdict}")
                    ok &= good
                _kernels.set_causal_end_aligned(default_alignment)
                _kernels.set_tile_override("forward_tma", name, d, None)
        return 0 if ok else 1
    if args.ab_causal_layout:
        ok = True
        for end in (False, True):
            _kernels.set_causal_end_aligned(end)
            ok &= check(torch.bfloat16, only_bad=True) & check(torch.float16, only_bad=True)
            ok &= check_head_dim(64) & check_head_dim(128) & check_head_dim(256)
        _kernels.set_causal_end_aligned(default_alignment)
        print("ab correctness:", "ok" if ok else "FAILED", flush=True)
        if ok:
            ab_causal_layout(args.seq, args.head_dim)
        return 0 if ok else 1
    if args.item_costs:
        item_costs(args.seq, args.head_dim)
        return 0
    if args.profile:
        profile_kernels(args.seq, args.head_dim)
        return 0
    if args.sweep_tma_backward is not None:
        bwd: dict[tuple[str, int], list[tuple[int, ...]]] = {}
        for item in args.sweep_tma_backward or [
            "dq:64:128,128,2",
            "dq:64:192,64,2",
            "dkdv:64:64,128,2",
            "dq:128:128,64,2",
            "dkdv:128:64,128,2",
            "dq:256:64,64,2",
        ]:
            family, d, tiles = item.split(":")
            bwd.setdefault((family, int(d)), []).append(tuple(int(x) for x in tiles.split(",")))
        ok = check_backward(torch.bfloat16) & check_backward(torch.float16)
        print("tma maps patched in place:", tma_patch_status())
        sweep_backward(bwd, args.seq, suffix="_tma")
        return 0 if ok else 1
    if args.sweep_tma is not None:
        configs: dict[int, list[tuple[int, ...]]] = {}
        for item in args.sweep_tma or [
            "64:128,128,2",
            "64:192,128,2",
            "64:192,160,2",
            "128:128,128,2",
            "128:128,160,2",
            "128:192,96,2",
            "256:128,64,2",
        ]:
            d, tiles = item.split(":")
            configs.setdefault(int(d), []).append(tuple(int(x) for x in tiles.split(",")))
        ok = check(torch.bfloat16) & check(torch.float16)
        print("tma maps patched in place:", tma_patch_status())
        sweep(configs, args.seq, family="forward_tma")
        return 0 if ok else 1
    if args.sweep_backward:
        ok = check_backward(torch.bfloat16)
        sweep_backward(
            {
                ("dq", 64): [(192, 64), (128, 64), (128, 128)],
                ("dq", 128): [(192, 64), (128, 64), (128, 128)],
                ("dkdv", 64): [(64, 192), (64, 128)],
                ("dkdv", 128): [(64, 128)],
            },
            args.seq,
        )
        return 0 if ok else 1
    if args.sweep:
        sweep(
            {
                64: [(192, 64), (192, 128), (128, 64)],
                128: [(192, 128), (128, 128)],
                256: [(128, 64)],
            },
            args.seq,
        )
        return 0
    ok = check(torch.bfloat16) & check(torch.float16)
    ok &= check_backward(torch.bfloat16) & check_backward(torch.float16)
    print("correctness:", "ok" if ok else "FAILED")
    if ok:
        bench(args.seq, args.head_dim)
        bench_backward(args.seq, [d for d in args.head_dim if d <= 128])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
