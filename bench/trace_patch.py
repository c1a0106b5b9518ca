"""What the kernel traces share (bench/trace_forward.py, bench/trace_fused.py): the device code of
a clock64 trace (a __device__ array with a slot of `slots` stamps per block, role and index, the
first `blocks` blocks and 4 roles), a copy of kernels_cu with one source patched at anchors, one
call's stamps read back, and a quantile."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from cuflash import _kernels


def prelude(array: str, blocks: int, indices: int, slots: int, skip: str = "") -> str:
    """The trace's device code: `array`, trace_global() (%globaltimer), trace_slot(role, index)
    (nullptr outside the traced blocks and indices, or where the C++ line `skip` returns it), and
    the macros TRACE_AT (clock64), TRACE_GLOBAL and TRACE_VALUE(role, index, e[, v])."""
    return f"""
__device__ unsigned long long {array}[{blocks} * 4 * {indices} * {slots}];
__device__ __forceinline__ unsigned long long trace_global() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}
__device__ __forceinline__ unsigned long long* trace_slot(int role, int index) {{
  if (blockIdx.x >= {blocks} || index >= {indices}) return nullptr;
{skip}  return {array} + ((blockIdx.x * 4 + role) * {indices} + index) * {slots};
}}
#define TRACE_AT(role, index, e) \\
  do {{ unsigned long long* t_ = trace_slot(role, index); if (t_) t_[e] = clock64(); }} while (0)
#define TRACE_GLOBAL(role, index, e) \\
  do {{ unsigned long long* t_ = trace_slot(role, index); \\
        if (t_) t_[e] = trace_global(); }} while (0)
#define TRACE_VALUE(role, index, e, v) \\
  do {{ unsigned long long* t_ = trace_slot(role, index); if (t_) t_[e] = (v); }} while (0)
"""


def patched_kernels(
    root: Path,
    source: str,
    patches: list[tuple[str, str, str]],
    replacements: list[tuple[str, str]] = (),
) -> Path:
    """kernels_cu copied under `root` with `source` patched: each (anchor, before, after) of
    `patches` gets text before and after it, each (anchor, text) of `replacements` is replaced;
    every anchor must occur once."""
    dst = root / "kernels_cu"
    shutil.copytree(_kernels.kernel_dir(), dst)
    text = (dst / source).read_text()
    for anchor, before, after in patches:
        assert text.count(anchor) == 1, f"anchor not found once: {anchor!r}"
        text = text.replace(anchor, before + anchor + after)
    for anchor, new in replacements:
        assert text.count(anchor) == 1, f"anchor not found once: {anchor!r}"
        text = text.replace(anchor, new)
    (dst / source).write_text(text)
    return dst


def traced_call(
    call: Callable[[], object],
    source: str,
    patches: list[tuple[str, str, str]],
    kernel_hint: str,
    array: str,
    count: int,
    replacements: list[tuple[str, str]] = (),
) -> list[int] | None:
    """The `count` stamps of `array` after one call of `call` on kernels_cu with `source` patched
    (three calls before it compile and warm up); None where no module whose instance holds
    kernel_hint was loaded."""
    import torch
    from bench_kvcache import variant
    from trace_decode import trace_array

    with tempfile.TemporaryDirectory() as tmp:
        kernels = patched_kernels(Path(tmp), source, patches, replacements)
        with variant(kernels=str(kernels)):
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            trace = trace_array(kernel_hint, array, count)
            if trace is None:
                return None
            trace.fill(0)
            torch.cuda.synchronize()
            call()
            torch.cuda.synchronize()
            return [int(x) for x in trace.get()]


def quantile(xs: list[float], f: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(f * len(xs)))]
