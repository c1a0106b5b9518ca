"""Small cases that run every kernel family for every dtype, for compute-sanitizer.

    compute-sanitizer --tool memcheck python tests/gpu/sanitize_cases.py [--all-buckets]

Each case runs the forward pass and the backward pass (preprocess, dK/dV, dQ) on odd sizes,
grouped heads and causal masking, through both the 16-byte path (aligned) and the element-wise
path (unaligned views), with a sliding window and with every score modifier (the feature
instances), plus, for fp16 and bf16, a causal forward whose first (end-aligned) row block starts
before row 0 and meets a NaN key (the repair path), and at d <= 64 calls of 1000 rows (three
consumer warpgroups: a last row block split by keys and merged, causal and windowed blocks).
--all-buckets covers every
head-dim instance; --forward-tiles and --register-store choose other TMA forwards, --walk-heads
another order of the persistent forward's and dQ's work items in the windowed calls, --backward
fused or split the Hopper backward where the call allows it (an explicit KernelChoice,
cuflash/_dispatch.py). --cases varlen runs packed variable-length calls instead
(cuflash.attention_varlen_*: every dtype, the head dims above, causal, windows, softcap, ALiBi,
aligned and unaligned, offsets well-formed and, trusted with max_seqlen given, malformed);
--cases kvcache runs attention_with_kvcache (every dtype: the decoding kernels for fp16 / bf16 with
one split and several, the packed path for the exact dtypes and for chunked prefill; contiguous
and paged caches, appended rows, masks and modifiers, unaligned views; lengths beyond the
capacity and page indices outside the cache, on trust); --cases fp8 runs attention_forward_fp8
(sm_90: head dims 16, 128, 144 and 256, causal, windows, grouped heads, descale factors or none,
a partial last key tile and V^T's padding, a NaN value); --cases softcap runs only the 16-bit
softcap-alone calls of the dense kind (bfloat16's rows pinned at the cap: a short call for the
tools that take long); --cases all runs every kind.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

import cuflash
from cuflash import testing
from cuflash._dispatch import KernelChoice

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def inputs(
    gen, dtype, d: int, aligned: bool, rows_q: tuple, rows_k: tuple, kv_heads: int = 2
) -> list:
    """q, k, v, dO of shapes (*rows_q, 4, d) and (*rows_k, kv_heads, d); unaligned: row pitch
    d + 1, the data one element in (the kernels for any strides)."""

    def make(rows: tuple, h: int) -> torch.Tensor:
        width = d if aligned else d + 1
        x = torch.randn(*rows, h, width, generator=gen, device="cuda").to(dtype)
        return x if aligned else x[..., 1:]

    return [make(rows_q, 4), make(rows_k, kv_heads), make(rows_k, kv_heads), make(rows_q, 4)]


def mod_options(causal: bool, mods: str, gen, slopes_shape: tuple) -> dict:
    """The call's options for mods (see run)."""
    options = {"causal": causal}
    if mods and mods not in ("alibi_dense", "softcap"):
        options["window"] = (9, 4)
    if mods in ("all", "softcap"):
        options["softcap"] = 5.0
    if mods in ("alibi", "alibi_dense", "all"):
        options["alibi_slopes"] = torch.rand(slopes_shape, generator=gen, device="cuda")
    return options


def run(
    choice: KernelChoice,
    dtype: torch.dtype,
    d: int,
    causal: bool,
    aligned: bool,
    nq: int = 67,
    nk: int = 45,
    mods: str = "",
    kv_heads: int = 2,
) -> None:
    """mods: "" (none), "window" (a sliding window: the LOCAL instances), "alibi" (window and
    ALiBi: the Hopper backward kernels take it), "alibi_dense" (ALiBi alone, no window: the
    fused backward at d = 128), "softcap" (the softcap alone: the bfloat16 TMA forward's rows
    pinned at the cap) or "all" (window, softcap and ALiBi)."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v, do = inputs(gen, dtype, d, aligned, (2, nq), (2, nk), kv_heads)
    options = mod_options(causal, mods, gen, (2, 4))
    if "window" not in options:  # the chunked walk is the windowed instances' (walk_heads)
        choice = replace(choice, walk_heads=None)
    o, lse, _ = testing.attention_forward_with(choice, q, k, v, **options)
    dq, dk, dv, _ = testing.attention_backward_with(choice, do, q, k, v, o, lse, **options)
    torch.cuda.synchronize()
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        if not torch.isfinite(x).all():
            raise SystemExit(f"non-finite {name} for {dtype} d={d} causal={causal}")


def run_softcap_alone(choice: KernelChoice, dtype: torch.dtype, d: int) -> int:
    """The softcap alone over several key tiles (bfloat16's rows pinned at the cap), causal and
    not; returns the number of runs."""
    for causal in (False, True):
        run(choice, dtype, d, causal, aligned=True, nq=300, nk=700, mods="softcap")
    return 2


def run_nan_key_before_row_0(choice: KernelChoice, dtype: torch.dtype, d: int) -> None:
    """Causal forward on Nq < Nk (end-aligned row blocks) with a NaN key that the first block's
    rows before 0 see: the repair path gets those rows flagged and must not read or write them."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (
        torch.randn(1, n, 2, d, generator=gen, device="cuda").to(dtype) for n in (100, 300, 300)
    )
    k[0, 150, 1, 0] = float("nan")
    testing.attention_forward_with(replace(choice, walk_heads=None), q, k, v, causal=True)
    torch.cuda.synchronize()


# Packed calls: B = 5 sequences, Nq != Nk, one without queries, one without keys, one of one row.
VARLEN_Q = (37, 0, 1, 70, 5)
VARLEN_K = (45, 9, 0, 64, 33)
# Offsets that break the contract, given with max_seqlen (trusted, never read on the host): the
# values are unspecified, but nothing outside q, k, v and the outputs may be read or written.
VARLEN_MALFORMED = ("decreasing", "past the end", "negative", "short of the end", "too long")


def varlen_offsets(lengths: tuple[int, ...], kind: str) -> torch.Tensor:
    total = sum(lengths)
    offsets = {
        "decreasing": [0, 60, 20, 90, 50, total],
        "past the end": [0, 10, total + 7, total + 100, 2**31 - 1, total + 1],
        "negative": [0, -5, 20, -(2**31), total, total],
        "short of the end": [0, 10, 20, 30, 30, total // 2],
    }.get(kind)
    if offsets is None:  # well-formed ("too long": sequences longer than max_seqlen says)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device="cuda")


def run_varlen(
    dtype: torch.dtype,
    d: int,
    causal: bool,
    aligned: bool = True,
    mods: str = "",
    offsets: str = "well-formed",
    trusted: bool = True,
) -> None:
    """A packed forward and backward; mods as run() ("alibi": slopes (Hq,), "all": (B, Hq));
    offsets "well-formed" or one of VARLEN_MALFORMED; trusted: max_seqlen given (no host copy)."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    tq, tk = sum(VARLEN_Q), sum(VARLEN_K)
    q, k, v, do = inputs(gen, dtype, d, aligned, (tq,), (tk,))
    slopes_shape = (len(VARLEN_Q), 4) if mods == "all" else (4,)
    options = mod_options(causal, mods, gen, slopes_shape)
    if trusted:
        too_long = offsets == "too long"
        options["max_seqlen_q"] = 16 if too_long else max(VARLEN_Q)
        options["max_seqlen_k"] = 16 if too_long else max(VARLEN_K)
    cu_q, cu_k = varlen_offsets(VARLEN_Q, offsets), varlen_offsets(VARLEN_K, offsets)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cu_q, cu_k, **options)
    dq, dk, dv = cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, **options)
    torch.cuda.synchronize()
    if offsets != "well-formed":
        return
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        if not torch.isfinite(x).all():
            raise SystemExit(f"non-finite {name} for packed {dtype} d={d} causal={causal}")


# KV cache: 3 sequences with these rows in use, 2 appended, capacity 96 (pages of 16, 7 or 64 rows).
KV_LENGTHS = (0, 41, 94)
KV_MALFORMED = ("lengths", "pages")


def run_kvcache(
    dtype: torch.dtype,
    d: int,
    page: int | None,
    nq: int = 1,
    splits: int | None = None,
    aligned: bool = True,
    mods: str = "",
    malformed: str = "",
) -> None:
    """One call: contiguous caches (page None) or paged ones; malformed "lengths" (beyond the
    capacity, negative) or "pages" (indices -1 and past the cache) on trust."""
    gen = torch.Generator(device="cuda").manual_seed(d)
    batch, new, capacity = len(KV_LENGTHS), 2, 96
    if page is None:
        rows = (batch, capacity)
    else:
        rows = (batch * -(-capacity // page) + 2, page)
    q, k_cache, v_cache, _ = inputs(gen, dtype, d, aligned, (batch, nq), rows)
    _, k_new, v_new, _ = inputs(gen, dtype, d, aligned, (batch, nq), (batch, new))
    lengths = [n - new if n >= new else n for n in KV_LENGTHS]
    if malformed == "lengths":
        lengths = [capacity + 5, -7, 2**31 - 2]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    table = None
    if page is not None:
        pages = -(-capacity // page)
        table = torch.randperm(rows[0], generator=gen, device="cuda")[: batch * pages]
        table = table.view(batch, pages).to(torch.int32)
        if malformed == "pages":
            table[0, 0], table[1, -1], table[2, 1] = -1, rows[0] + 5, 2**31 - 1
    options = mod_options(nq > 1, mods, gen, (batch, 4))
    o, lse = cuflash.attention_with_kvcache(
        q, k_cache, v_cache, seqlens, k_new=k_new, v_new=v_new, block_table=table,
        num_splits=splits, **options,
    )  # fmt: skip
    torch.cuda.synchronize()
    if not malformed and not torch.isfinite(o).all():
        raise SystemExit(f"non-finite o for the KV cache, {dtype} d={d} page={page} nq={nq}")


def run_fp8(
    d: int,
    causal: bool,
    nq: int,
    nk: int,
    window=None,
    kv_heads: int = 2,
    descales: bool = True,
    nan_value: bool = False,
) -> None:
    """One attention_forward_fp8 call (4 query heads), checked against the CPU backend."""
    gen = torch.Generator(device="cuda").manual_seed(d + nq + nk)
    q, k, v = (
        (torch.randn(2, n, h, d, generator=gen, device="cuda") * 2).to(torch.float8_e4m3fn)
        for n, h in ((nq, 4), (nk, kv_heads), (nk, kv_heads))
    )
    if nan_value:
        v.view(torch.uint8)[0, nk // 2, 0, 0] = 0x7F
    factors = {}
    if descales:
        names = ("q_descale", "k_descale", "v_descale")
        factors = {n: torch.rand(2, kv_heads, generator=gen, device="cuda") + 0.5 for n in names}
    o, lse = cuflash.attention_forward_fp8(q, k, v, causal=causal, window=window, **factors)
    cpu = {n: f.cpu() for n, f in factors.items()}
    o_ref, lse_ref = cuflash.attention_forward_fp8(
        q.cpu(), k.cpu(), v.cpu(), causal=causal, window=window, **cpu
    )
    finite = torch.isfinite(lse_ref)
    assert torch.equal(finite, torch.isfinite(lse.cpu())), "fp8: rows that see no key differ"
    # a sanity bound, not the accuracy policy (tests/gpu/test_fp8_gpu.py): FP8 wgmma accumulates
    # with about 14 significant bits (DeepSeek-V3's report; docs/perf/NOTES.md v27), 2.9e-3 at
    # d = 16 against a CPU lse of about 15
    err = (lse.cpu() - lse_ref)[finite].abs().max().item() if finite.any() else 0.0
    bound = 2**-10 * (1 + lse_ref[finite].abs().max().item()) if finite.any() else 0.0
    assert err <= bound, f"fp8 d={d}: lse off by {err} (bound {bound})"
    scale = o_ref.float().abs().nan_to_num(0).max().item() + 1e-6
    close = (o.cpu().float() - o_ref.float()).abs() <= 0.1 * scale
    assert bool((close | o_ref.float().isnan()).all()), f"fp8 d={d}: O far from the reference"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--all-buckets", action="store_true")
    parser.add_argument("--head-dim", nargs="+", type=int, help="these head dims only")
    parser.add_argument(
        "--forward-tiles",
        nargs="+",
        default=(),
        metavar="BM,BN,STAGES",
        help="the TMA forward's tiles (every head dim given)",
    )
    parser.add_argument(
        "--register-store", action="store_true", help="the TMA forward writes O from registers"
    )
    parser.add_argument(
        "--walk-heads",
        type=int,
        default=None,
        help="the TMA forward's and dQ's order of items (in the windowed calls)",
    )
    parser.add_argument(
        "--backward",
        choices=["fused", "split"],
        default=None,
        help="the Hopper backward to run where the call allows it (default: the library's)",
    )
    parser.add_argument(
        "--cases",
        choices=["dense", "varlen", "kvcache", "fp8", "softcap", "all"],
        default="dense",
        help="dense calls (the default), packed variable-length calls, KV-cache calls, FP8 calls, "
        "the 16-bit softcap-alone calls of dense, or all",
    )
    args = parser.parse_args()
    tiles = tuple(int(x) for x in args.forward_tiles[0].split(",")) if args.forward_tiles else None
    choice = KernelChoice(
        tiles=((("forward", "tma"), tiles),) if tiles else (),
        o_store="registers" if args.register_store else "tma",
        walk_heads=args.walk_heads,
        backward=args.backward,
    )
    head_dims = (24, 64, 72, 128, 136, 192, 200, 256) if args.all_buckets else (40, 200)
    head_dims = tuple(args.head_dim or head_dims)
    count = 0
    for dtype in (torch.float16, torch.bfloat16) if args.cases == "softcap" else ():
        for d in head_dims:
            count += run_softcap_alone(choice, dtype, d)
    for dtype in DTYPES if args.cases in ("dense", "all") else ():
        for d in head_dims:
            for causal in (False, True):
                run(choice, dtype, d, causal, aligned=True)
                count += 1
            run(choice, dtype, d, True, aligned=False, nq=33, nk=70)
            for mods in ("window", "alibi", "all"):  # the feature instances (features.cuh)
                run(choice, dtype, d, True, aligned=True, nq=150, nk=170, mods=mods)
            count += 4
            if dtype in (torch.float16, torch.bfloat16):
                run_nan_key_before_row_0(choice, dtype, d)
                # the fused backward (d = 64, 128): several key blocks and query tiles, a partial
                # last key block, causal with rows that see no key, a window; grouped heads
                # (4 / 2, 4 / 1) and not
                run(choice, dtype, d, False, aligned=True, nq=300, nk=384, mods="alibi_dense")
                count += run_softcap_alone(choice, dtype, d)
                causal = (
                    (300, 200, "alibi_dense", 4),
                    (200, 450, "", 4),
                    (300, 330, "window", 4),
                    (520, 520, "", 2),
                    (300, 330, "window", 1),
                )
                for nq, nk, mods, kv in causal:
                    run(choice, dtype, d, True, aligned=True, nq=nq, nk=nk, mods=mods, kv_heads=kv)
                count += 1 + len(causal)
                # two work items per persistent block (176 for 132 SMs, or 88 causal pairs; the
                # cases above give a block one item): buffers and stages reused across items;
                # causal with more queries than keys puts an item that sees no key first
                for causal in (False, True):
                    run(choice, dtype, d, causal, aligned=True, nq=2800, nk=600)
                count += 2
                if d <= 64:
                    # three consumers (192-row tiles from 1k rows): the last row block's 40 rows
                    # split by keys among them and merged (SPLIT_LAST), causal and windowed blocks
                    run(choice, dtype, d, False, aligned=True, nq=1000, nk=300)
                    for mods in ("", "window"):
                        run(choice, dtype, d, True, aligned=True, nq=1000, nk=1000, mods=mods)
                    count += 3
    for dtype in DTYPES if args.cases in ("varlen", "all") else ():
        for d in head_dims:
            for causal in (False, True):
                run_varlen(dtype, d, causal)
            for mods in ("window", "alibi", "all"):
                run_varlen(dtype, d, True, mods=mods)
            run_varlen(dtype, d, True, aligned=False, mods="all")
            run_varlen(dtype, d, False, trusted=False)  # offsets read and checked on the host
            for kind in VARLEN_MALFORMED:
                run_varlen(dtype, d, True, mods="all", offsets=kind)
            count += 7 + len(VARLEN_MALFORMED)
    for dtype in DTYPES if args.cases in ("kvcache", "all") else ():
        for d in head_dims:
            for page in (None, 16, 7, 64):  # contiguous and 64: boxes at d = 40 and 128 (sm_90)
                for splits in (None, 1, 5):
                    run_kvcache(dtype, d, page, splits=splits)
                run_kvcache(dtype, d, page, nq=3, mods="all")
                run_kvcache(
                    dtype, d, page, nq=40, aligned=False, mods="alibi"
                )  # 40 x 4 rows: packed
                for kind in KV_MALFORMED if page is not None else KV_MALFORMED[:1]:
                    run_kvcache(dtype, d, page, malformed=kind)
                count += 6 + (len(KV_MALFORMED) if page is not None else 1)
    fp8 = args.cases in ("fp8", "all") and torch.cuda.get_device_capability() == (9, 0)
    for d in (16, 128, 144, 256) if fp8 else ():
        for causal in (False, True):
            run_fp8(d, causal, 130, 250)
        run_fp8(d, True, 300, 77, kv_heads=1, descales=False)  # rows that see no key
        run_fp8(d, False, 64, 300, window=(20, 5), kv_heads=4)
        run_fp8(d, True, 256, 256, nan_value=True)
        count += 5
    print(f"sanitize cases: {count} forward+backward runs completed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
