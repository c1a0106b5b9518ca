"""Where a decoding call's time goes: each block's start, loop and end on the GPU's clock.

A copy of kernels_cu with kvcache.cu patched (in a temporary directory, through
bench_kvcache.variant) records %globaltimer in every block of attention_decode (at its start,
as its query rows have landed before its key-tile loop, as its first tile has landed, after the
loop, at its end, and its multiprocessor) and of
attention_decode_combine (after its wait for the decoding kernel, at its end), into __device__
arrays that the script reads back after one eager call (the first ones compile and warm up).
Printed per call: the spread of the blocks' starts, the time until the first and the last block
ends, how long the loops and the merges take, and the combine's span; all in microseconds from
the first block's start. bf16, d = 128, Hq = 32, Hkv = 8, Nq = 1, contiguous caches.

    python bench/trace_decode.py [--points B:KEYS[:SPLITS] ...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_kvcache import DEV, HKV, HQ, D, variant  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _compile  # noqa: E402

MAX_BLOCKS = 1 << 15
TRACE = f"""
__device__ unsigned long long decode_trace[{MAX_BLOCKS} * 7];
__device__ unsigned long long combine_trace[{MAX_BLOCKS} * 2];
__device__ __forceinline__ unsigned long long trace_now() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}
__device__ __forceinline__ unsigned trace_smid() {{
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}}
"""

# (anchor in kvcache.cu, text inserted after it)
PATCHES = [
    ('#include "tma.cuh"\n', TRACE),  # global scope: the names stay unmangled
    (
        "  if constexpr (BULK) launch_dependents();\n",
        "  const unsigned long long trace_t0 = trace_now();\n  unsigned long long trace_f = 0;\n",
    ),
    (
        "  softmax.init(p.p_shift);\n",  # after the wait for Q
        "  const unsigned long long trace_t1 = trace_now();\n",
    ),
    (
        "      mbar_wait(&s_full[stage], (it / STAGES) & 1);\n",
        "      if (trace_f == 0) trace_f = trace_now();\n",
    ),
    (
        "  __syncthreads();  // every warp is done with the tiles: "
        "the stages hold the merge from here\n",
        "  const unsigned long long trace_t2 = trace_now();\n",
    ),
    (
        "      else head_ptr<float>(p.lse, b, rows.head(r))[row * p.lse.seq] = lse[h];\n"
        "    }\n  }\n",
        "  __syncthreads();\n  if (threadIdx.x == 0 && blockIdx.x < "
        f"{MAX_BLOCKS}) {{\n"
        "    unsigned long long* t = decode_trace + 7 * blockIdx.x;\n"
        "    t[0] = trace_t0; t[1] = trace_t1; t[2] = trace_t2;\n"
        "    t[3] = trace_now(); t[4] = trace_smid(); t[5] = trace_t1; t[6] = trace_f;\n"
        "  }\n",
    ),
    (
        "  wait_for_prerequisite_grid();  "
        "// launched programmatically after the decoding kernel\n#endif\n",
        "  const unsigned long long trace_c0 = trace_now();\n",
    ),
    (
        "  if (threadIdx.x == 0) "
        "head_ptr<float>(p.lse, b, head)[static_cast<i64>(i) * p.lse.seq] = lse;\n",
        f"  if (threadIdx.x == 0 && blockIdx.x < {MAX_BLOCKS}) {{\n"
        "    combine_trace[2 * blockIdx.x] = trace_c0;\n"
        "    combine_trace[2 * blockIdx.x + 1] = trace_now();\n"
        "  }\n",
    ),
]


def patched_kernels(root: Path) -> Path:
    src = Path(cuflash.__file__).resolve().parent.parent / "kernels_cu"
    dst = root / "kernels_cu"
    shutil.copytree(src, dst)
    text = (dst / "kvcache.cu").read_text()
    for anchor, insert in PATCHES:
        assert text.count(anchor) == 1, f"anchor not found once: {anchor!r}"
        text = text.replace(anchor, anchor + insert)
    (dst / "kvcache.cu").write_text(text)
    return dst


def trace_array(kernel_hint: str, name: str, count: int):  # noqa: ANN201
    """The __device__ array `name` of the loaded module whose instance contains kernel_hint, as
    a CuPy array (None where no such module is loaded)."""
    import cupy

    for (expr, _), loaded in _compile._loaded.items():
        if kernel_hint in expr:
            address = loaded.function.module.get_global_var(name)  # a device address
            memory = cupy.cuda.UnownedMemory(int(address), 8 * count, loaded.function.module)
            return cupy.ndarray((count,), cupy.uint64, cupy.cuda.MemoryPointer(memory, 0))
    return None


def quantiles(xs: list[float]) -> str:
    xs = sorted(xs)
    pick = [xs[0], xs[len(xs) // 10], xs[len(xs) // 2], xs[9 * len(xs) // 10], xs[-1]]
    return "/".join(f"{x:.1f}" for x in pick)


def trace_point(batch: int, keys: int, splits: int | None) -> None:
    q = torch.randn(batch, 1, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(batch, keys, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((batch,), keys, device=DEV, dtype=torch.int32)
    for _ in range(3):  # compiles, warms up
        cuflash.attention_with_kvcache(q, k, v, lens, num_splits=splits)
    torch.cuda.synchronize()
    decode = trace_array("attention_decode_boxes<", "decode_trace", 7 * MAX_BLOCKS)
    if decode is None:  # the caches have no tensor maps: row copies
        decode = trace_array("attention_decode<", "decode_trace", 7 * MAX_BLOCKS)
    combine = trace_array("attention_decode_combine<", "combine_trace", 2 * MAX_BLOCKS)
    if decode is None:
        print("  no decoding module found")
        return
    for array in (decode, combine):
        if array is not None:
            array.fill(0)  # slots of an earlier, larger grid
    torch.cuda.synchronize()
    cuflash.attention_with_kvcache(q, k, v, lens, num_splits=splits)
    torch.cuda.synchronize()
    raw = [int(x) for x in decode.get()]
    combine = None if combine is None else [int(x) for x in combine.get()]
    rows = [raw[7 * i : 7 * i + 7] for i in range(MAX_BLOCKS) if raw[7 * i] != 0]
    blocks = len(rows)
    t_first = min(r[0] for r in rows)
    us = lambda t: (t - t_first) / 1e3  # noqa: E731
    starts = [us(r[0]) for r in rows]
    ends = [us(r[3]) for r in rows]
    loops = [(r[2] - r[1]) / 1e3 for r in rows]
    prologue = [(r[1] - r[0]) / 1e3 for r in rows]
    merges = [(r[3] - r[2]) / 1e3 for r in rows]
    per_sm: dict[int, int] = {}
    for r in rows:
        per_sm[r[4]] = per_sm.get(r[4], 0) + 1
    moved = 2 * k.numel() * 2
    span = max(ends)
    print(
        f"B={batch} keys={keys} splits={splits or 'auto'}: {blocks} blocks on {len(per_sm)} SMs "
        f"(blocks per SM {min(per_sm.values())}-{max(per_sm.values())}); decode span {span:.1f} us "
        f"= {moved / span / 1e3:.0f} GB/s over the span"
    )
    print(f"  starts (min/p10/med/p90/max) {quantiles(starts)}")
    print(f"  ends                         {quantiles(ends)}")
    print(f"  prologue (start to loop)     {quantiles(prologue)}")
    print(f"  first Q landed               {quantiles([us(r[5]) for r in rows])}")
    print(f"  first tile landed            {quantiles([us(r[6]) for r in rows if r[6]])}")
    print(f"  loop                         {quantiles(loops)}")
    print(f"  merge and store              {quantiles(merges)}")
    # loop times by KV head (the grid's fastest index) and by the blocks on the SM
    by_head: dict[int, list[float]] = {}
    for index, r in zip((i for i in range(MAX_BLOCKS) if raw[7 * i] != 0), rows, strict=True):
        by_head.setdefault(index % HKV, []).append((r[2] - r[1]) / 1e3)
    print(
        "  loop by KV head (median)     "
        + " ".join(f"{h}:{statistics.median(v):.1f}" for h, v in sorted(by_head.items()))
    )
    by_load: dict[int, list[float]] = {}
    for r in rows:
        by_load.setdefault(per_sm[r[4]], []).append((r[2] - r[1]) / 1e3)
    print(
        "  loop by blocks on its SM     "
        + " ".join(f"{n}:{quantiles(v)}" for n, v in sorted(by_load.items()))
    )
    # the blocks still running as the call ends: how long the last 10% / 25% of blocks took
    ends_sorted = sorted(ends)
    active_75 = ends_sorted[3 * blocks // 4]
    print(
        f"  time with fewer than 75% of blocks left: {span - active_75:.1f} us; "
        f"with fewer than half: {span - ends_sorted[blocks // 2]:.1f} us"
    )
    if combine is not None:
        crow = [(combine[2 * i], combine[2 * i + 1]) for i in range(MAX_BLOCKS) if combine[2 * i]]
        recent = [c for c in crow if c[0] >= t_first]
        if recent:
            c_start = [us(c[0]) for c in recent]
            c_end = [us(c[1]) for c in recent]
            print(
                f"  combine ({len(recent)} blocks): passes its wait {quantiles(c_start)}, "
                f"ends {quantiles(c_end)}"
            )
    del q, k, v
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", default=["8:8192:4", "64:1024:1", "1:65536:32"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with variant(kernels=str(patched_kernels(Path(tmp)))):
            for point in args.points:
                parts = [int(x) for x in point.split(":")]
                trace_point(parts[0], parts[1], parts[2] if len(parts) > 2 else None)


if __name__ == "__main__":
    main()
