"""Decoding over a KV cache: cuflash.attention_with_kvcache against the memory bandwidth and SDPA.

Decoding is bound by memory bandwidth: each call reads the whole cache in use once. So each point
reports the achieved bytes/s (cache bytes read plus the output written) as a fraction of the
device's copy bandwidth measured in the same run (a device-to-device copy of 1 GiB: read plus
write bytes over its time), and the time ratio against PyTorch SDPA (flash and cuDNN backends,
enable_gqa=True) on the same keys in SDPA's own (B, H, N, d) layout with Nq = 1.

Every call is captured in a CUDA graph and timed by replaying it (median of rounds, CUDA events):
decoding loops run so, and it takes the host's launch overhead out for every library alike.

Grid (issue 18): bf16, d = 128, Hq = 32, Hkv = 8, Nq = 1; B in {1, 8, 64}; cache lengths in
{1k, 8k, 32k, 128k}; contiguous caches and paged ones (pages of 64 and 256 rows, permuted).
Then chunked prefill: Nq = 512 queries on a 32k cache, against cuflash.attention_forward on the
same keys (the dense forward kernel's TFLOP/s).

    python bench/bench_kvcache.py [--quick] [--out DIR] [--baseline-kernels DIR] [--stages N]
                                  [--serial]

A/B of the decoding kernel in the same run: --baseline-kernels DIR times the contiguous points
again with the kernel sources of DIR (another checkout's kernels_cu/, with the same Params and
template arguments) and reports base time / this time; --stages N times them with N key/value
stages in place of the table's choice (_kernels.decode_stages), and --serial with the combine
launched the ordinary way instead of programmatically (sm_90), each reported the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuflash  # noqa: E402

HQ, HKV, D = 32, 8, 128
DEV = "cuda"
VARIANTS: dict[str, dict] = {}  # name -> variant()'s arguments


@contextlib.contextmanager
def variant(kernels: str | None = None, stages: int | None = None, serial: bool = False):
    """The decoding kernel built from other sources, or with other stages, or (serial) the
    combine launched the ordinary way, not programmatically, inside the block: the compiled
    modules, plans and sources are dropped on the way in and out."""
    from cuflash import _compile, _kernels, _kvcache_cuda, _launch, _plans

    def reset() -> None:
        _compile._loaded.clear()
        _plans.clear()
        _kernels.expanded_source.cache_clear()
        _kernels.compiled_source.cache_clear()
        _kernels.kvcache_instance.cache_clear()

    saved = (_kernels.kernel_dir, _kernels.decode_stages, _launch.launch)
    saved_maps = _kvcache_cuda.decode_box_maps
    source = (Path(kernels) / "kvcache.cu").read_text() if kernels is not None else ""
    if kernels is not None and "attention_decode_boxes" not in source:
        _kvcache_cuda.decode_box_maps = lambda call: None  # sources from before the boxes (v24)
    if serial:
        launch = _launch.launch
        _launch.launch = lambda *args, programmatic=False: launch(*args[:5])
    if kernels is not None:
        _kernels.kernel_dir = lambda: Path(kernels)
    if stages is not None:
        _kernels.decode_stages = lambda head_dim: stages
    reset()
    try:
        yield
    finally:
        _kernels.kernel_dir, _kernels.decode_stages, _launch.launch = saved
        _kvcache_cuda.decode_box_maps = saved_maps
        reset()


def graph_time(fn, reps: int = 20, rounds: int = 5) -> float:
    """Seconds per call of fn, captured once in a CUDA graph and replayed (median of rounds)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps * 1e-3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read plus write), launched eagerly: captured
    in a graph the copy becomes a memcpy node that ran at 2430 GB/s here against 2983 eagerly."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(5):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 5 * 1e-3)
    return 2 * src.numel() / statistics.median(times)


def sdpa_time(q, k, v, backend, rounds: int = 5) -> float | None:
    from torch.nn.attention import sdpa_kernel

    def call():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    try:
        call()
        torch.cuda.synchronize()
        return graph_time(call, rounds=rounds)
    except Exception as exc:  # noqa: BLE001 - a peer that does not run here is reported as such
        print(f"  SDPA {backend}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return None


def decode_point(batch: int, keys: int, page: int | None, bandwidth: float, peers: bool) -> dict:
    dtype = torch.bfloat16
    q = torch.randn(batch, 1, HQ, D, device=DEV, dtype=dtype)
    lens = torch.full((batch,), keys, device=DEV, dtype=torch.int32)
    table = None
    if page is None:
        k_cache = torch.randn(batch, keys, HKV, D, device=DEV, dtype=dtype)
    else:
        pages = batch * (keys // page)
        k_cache = torch.randn(pages, page, HKV, D, device=DEV, dtype=dtype)
        table = torch.randperm(pages, device=DEV).view(batch, -1).to(torch.int32)
    v_cache = torch.randn_like(k_cache)

    def run():
        return cuflash.attention_with_kvcache(q, k_cache, v_cache, lens, block_table=table)

    t = graph_time(run)
    moved = 2 * batch * keys * HKV * D * 2 + 2 * q.numel() * 2  # K and V read, q read, o written
    row = {
        "batch": batch,
        "keys": keys,
        "page": page,
        "cache_mib": 2 * batch * keys * HKV * D * 2 / 2**20,
        "us": t * 1e6,
        "gbps": moved / t / 1e9,
        "of_copy": moved / t / bandwidth,
    }
    if page is None:
        for name, how in VARIANTS.items():
            with variant(**how):
                row[f"x_{name}"] = graph_time(run) / t  # the variant's time / this one's
    if peers and page is None:
        from torch.nn.attention import SDPBackend

        del k_cache, v_cache
        qs = q.transpose(1, 2)  # (B, Hq, 1, d)
        ks = torch.randn(batch, HKV, keys, D, device=DEV, dtype=dtype)
        vs = torch.randn_like(ks)
        # cuflash on SDPA's layout: each head's rows contiguous, as (B, N, Hkv, d) views
        kt, vt = ks.transpose(1, 2), vs.transpose(1, 2)
        t_same = graph_time(lambda: cuflash.attention_with_kvcache(q, kt, vt, lens))
        row["bhsd_of_copy"] = moved / t_same / bandwidth
        for name, backend in (
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ):
            peer = sdpa_time(qs, ks, vs, backend)
            row[f"sdpa_{name}_us"] = None if peer is None else peer * 1e6
            row[f"sdpa_{name}_of_copy"] = None if peer is None else moved / peer / bandwidth
            row[f"x_sdpa_{name}"] = None if peer is None else peer / t_same
    torch.cuda.empty_cache()
    return row


def prefill_point() -> dict:
    """Nq = 512 new queries (causal) on a 32k cache against the dense forward on the same keys."""
    dtype, keys, nq = torch.bfloat16, 32768, 512
    q = torch.randn(1, nq, HQ, D, device=DEV, dtype=dtype)
    k = torch.randn(1, keys, HKV, D, device=DEV, dtype=dtype)
    v = torch.randn_like(k)
    lens = torch.full((1,), keys, device=DEV, dtype=torch.int32)
    t_cache = graph_time(lambda: cuflash.attention_with_kvcache(q, k, v, lens, causal=True))
    t_int = graph_time(lambda: cuflash.attention_with_kvcache(q, k, v, keys, causal=True))
    t_dense = graph_time(lambda: cuflash.attention_forward(q, k, v, causal=True))
    # visible pairs: every row sees all but the last (nq - 1 - i) keys
    pairs = HQ * (nq * keys - nq * (nq - 1) // 2)
    flops = 4 * pairs * D
    return {
        "nq": nq,
        "keys": keys,
        "kvcache_tflops": flops / t_cache / 1e12,  # lengths a tensor: keys gathered
        "kvcache_int_tflops": flops / t_int / 1e12,  # lengths an int: views of the cache
        "forward_tflops": flops / t_dense / 1e12,
        "ratio": t_dense / t_cache,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B in {1, 64}, 8k and 128k only")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--baseline-kernels", default=None, help="another checkout's kernels_cu")
    parser.add_argument("--stages", type=int, default=None, help="decoding stages to compare")
    parser.add_argument(
        "--serial", action="store_true", help="compare with the combine launched the ordinary way"
    )
    args = parser.parse_args()
    if args.serial:
        VARIANTS["serial"] = {"serial": True}
    if args.baseline_kernels:
        VARIANTS["base"] = {"kernels": args.baseline_kernels}
    if args.stages:
        VARIANTS[f"stages{args.stages}"] = {"stages": args.stages}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    batches = (1, 64) if args.quick else (1, 8, 64)
    lengths = (8192, 131072) if args.quick else (1024, 8192, 32768, 131072)
    rows = []
    for batch in batches:
        for keys in lengths:
            for page in (None, 64, 256):
                row = decode_point(batch, keys, page, bandwidth, peers=True)
                rows.append(row)
                print(json.dumps(row), flush=True)
    prefill = prefill_point()
    print(json.dumps(prefill), flush=True)
    (out / "kvcache.json").write_text(
        json.dumps({"copy_gbps": bandwidth / 1e9, "decode": rows, "prefill": prefill}, indent=1)
    )
    lines = [
        f"decode bf16 d={D} Hq={HQ} Hkv={HKV} Nq=1, CUDA graphs; copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s; fraction of it. contig: (B, N, Hkv, d) caches; bhsd: the "
        "same as views of (B, Hkv, N, d), SDPA's layout, on which SDPA runs\n"
        "(x: SDPA time / cuflash's on that layout)",
        f"{'B':>3} {'keys':>7} {'MiB':>7} | {'contig':>6} {'page64':>6} {'page256':>7} "
        f"{'bhsd':>6} | {'SDPA flash':>12} {'SDPA cudnn':>12}"
        + "".join(f" | x {name:>7}" for name in VARIANTS),
    ]
    for batch in batches:
        for keys in lengths:
            cells = {r["page"]: r for r in rows if r["batch"] == batch and r["keys"] == keys}
            c = cells[None]

            def peer(name: str, c=c) -> str:
                if c.get(f"sdpa_{name}_of_copy") is None:
                    return f"{'n/a':>12}"
                return f"{c[f'sdpa_{name}_of_copy']:.2f} ({c[f'x_sdpa_{name}']:.2f}x)".rjust(12)

            lines.append(
                f"{batch:>3} {keys:>7} {c['cache_mib']:>7.0f} | {c['of_copy']:>6.2f} "
                f"{cells[64]['of_copy']:>6.2f} {cells[256]['of_copy']:>7.2f} "
                f"{c['bhsd_of_copy']:>6.2f} | "
                f"{peer('flash')} {peer('cudnn')}"
                + "".join(f" | {c[f'x_{name}']:>9.3f}" for name in VARIANTS)
            )
    gathered, views = prefill["kvcache_tflops"], prefill["kvcache_int_tflops"]
    lines.append(
        f"chunked prefill Nq={prefill['nq']} on {prefill['keys']} keys, causal, TFLOP/s: lengths "
        f"a tensor (keys gathered) {gathered:.0f} ({prefill['ratio']:.2f}x the forward), an int "
        f"(views) {views:.0f}, forward on the same keys {prefill['forward_tflops']:.0f}"
    )
    if VARIANTS:
        lines.append(
            "x NAME: the time of variant NAME over this one's, contiguous caches: "
            + ", ".join(f"{name} = {how}" for name, how in VARIANTS.items())
        )
    table = "\n".join(lines)
    (out / "kvcache_table.txt").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
