"""Merging partial attention results over disjoint key sets with their logsumexps.

If part s attended the same queries to key set K_s, giving o_s and lse_s, attention over the union
of the K_s is  o = sum_s exp(lse_s - lse) o_s  with  lse = log sum_s exp(lse_s).  The sums run in
float32 (float64 for float64 parts) after subtracting the largest lse_s of each row; a row whose
lse_s are all -inf saw no key anywhere and gets o = 0, lse = -inf.

The arithmetic runs in the parts' own array library (NumPy, CuPy, PyTorch or JAX, on their
device, traced JAX values included), so the result is the same kind of array and the call adds
no copies between libraries. Used by cuflash.combine and by ring attention (cuflash/_ring.py,
cuflash/_jax_ring.py).
"""

from __future__ import annotations

from typing import Any

O_DTYPES = ("float16", "bfloat16", "float32", "float64")
LSE_DTYPES = ("float32", "float64")


def _library(x: Any) -> str:
    module = type(x).__module__.split(".")[0]
    if module in ("numpy", "cupy", "torch"):
        return module
    if module in ("jax", "jaxlib"):
        return "jax"
    raise TypeError(
        f"o_partials and lse_partials must be NumPy, CuPy, PyTorch or JAX arrays; got "
        f"{type(x).__module__}.{type(x).__qualname__}"
    )


class _Ops:
    """The few array operations the merge needs, in one library's spelling."""

    def __init__(self, library: str) -> None:
        self.library = library
        if library == "torch":
            import torch

            self.xp = torch
        elif library == "jax":
            import jax.numpy as jnp

            self.xp = jnp
        elif library == "cupy":
            import cupy

            self.xp = cupy
        else:
            import numpy

            self.xp = numpy

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype).removeprefix("torch.")

    def cast(self, x: Any, name: str) -> Any:
        if self.library == "torch":
            return x.to(getattr(self.xp, name))
        if self.library == "numpy" and name == "bfloat16":
            import ml_dtypes

            return x.astype(ml_dtypes.bfloat16)
        return x.astype(name)

    def amax0(self, x: Any) -> Any:
        return self.xp.amax(x, 0) if self.library == "torch" else self.xp.max(x, axis=0)

    def sum0(self, x: Any) -> Any:
        return self.xp.sum(x, 0) if self.library == "torch" else self.xp.sum(x, axis=0)

    def rows_last(self, x: Any) -> Any:
        """(..., H, N) -> (..., N, H): lse rows in the order of a bshd o."""
        return self.xp.swapaxes(x, -1, -2) if self.library != "torch" else x.transpose(-1, -2)


def merge(o_partials: Any, lse_partials: Any, bshd: bool, name_o: str = "o_partials") -> tuple:
    """(o, lse) from o_partials (S, ..., N, [H,] d) and lse_partials (S, ..., N) (bshd: o's rows
    before its heads, lse (S, B, H, N)). o in the parts' dtype; lse float32 (float64 for
    float64 parts)."""
    ops = _Ops(_library(o_partials))
    xp = ops.xp
    o_dtype = ops.dtype_name(o_partials)
    wide = "float64" if o_dtype == "float64" else "float32"
    lse = ops.cast(lse_partials, wide)
    top = ops.amax0(lse)
    top = xp.where(xp.isneginf(top), xp.zeros_like(top), top)
    weights = xp.exp(lse - top[None])  # -inf parts weigh 0
    total = ops.sum0(weights)
    if bshd:
        weights, norm = ops.rows_last(weights), ops.rows_last(total)
    else:
        norm = total
    o = ops.sum0(ops.cast(o_partials, wide) * weights[..., None])
    seen = norm[..., None] > 0
    o = xp.where(
        seen, o / xp.where(seen, norm[..., None], xp.ones_like(norm[..., None])), xp.zeros_like(o)
    )
    positive = total > 0
    lse_out = xp.where(
        positive,
        top + xp.log(xp.where(positive, total, xp.ones_like(total))),
        xp.full_like(total, -float("inf")),
    )
    return ops.cast(o, o_dtype), lse_out


def check(o_partials: Any, lse_partials: Any, layout: Any) -> bool:
    """Validates a combine call; returns whether o's rows come before its heads (bshd)."""
    library = _library(o_partials)
    if _library(lse_partials) != library:
        raise TypeError(
            f"o_partials and lse_partials must come from one array library; got {library} and "
            f"{_library(lse_partials)}"
        )
    if not isinstance(layout, str) or layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd'; got {layout!r}")
    ops = _Ops(library)
    o_dtype, lse_dtype = ops.dtype_name(o_partials), ops.dtype_name(lse_partials)
    if o_dtype not in O_DTYPES:
        raise TypeError(f"o_partials must be float16, bfloat16, float32 or float64; got {o_dtype}")
    if lse_dtype not in LSE_DTYPES:
        raise TypeError(f"lse_partials must be float32 or float64; got {lse_dtype}")
    o_shape, lse_shape = tuple(o_partials.shape), tuple(lse_partials.shape)
    if len(o_shape) == 3:  # (S, N, d) with lse (S, N)
        want = o_shape[:2]
    elif len(o_shape) == 5:  # (S, B, N, H, d) or (S, B, H, N, d) with lse (S, B, H, N)
        s, b = o_shape[:2]
        n, h = (o_shape[2], o_shape[3]) if layout == "bshd" else (o_shape[3], o_shape[2])
        want = (s, b, h, n)
    else:
        raise ValueError(
            f"o_partials must be (S, N, d), or (S, B, N, H, d) / (S, B, H, N, d) by layout: the "
            f"parts stacked on a new first axis; got shape {o_shape}"
        )
    if o_shape[0] < 1:
        raise ValueError("o_partials must hold at least one part (S >= 1); got S = 0")
    if lse_shape != want:
        raise ValueError(
            f"lse_partials must have shape {want} for o_partials of shape {o_shape} "
            f"({layout}); got {lse_shape}"
        )
    devices = [_device(x, library) for x in (o_partials, lse_partials)]
    if devices[0] != devices[1]:
        raise ValueError(
            f"o_partials and lse_partials must be on one device; got {devices[0]} and {devices[1]}"
        )
    return len(o_shape) == 5 and layout == "bshd"


def _device(x: Any, library: str) -> Any:
    if library == "torch":
        return str(x.device)
    if library == "cupy":
        return f"cuda:{x.device.id}"
    if library == "jax":
        try:
            return tuple(sorted(str(d) for d in x.devices()))
        except Exception:  # a traced value: its placement is XLA's
            return None
    return "cpu"
