"""The CPU backend: the blockwise NumPy reference in float64, rounded to the input dtype.

Used for every input that lives on the CPU (NumPy, torch CPU, JAX CPU), so scripts and tests run
on any machine with the same semantics and the same errors as the GPU path. The blockwise form
bounds memory: each step holds the scores of one block of query rows against all keys, with the
block sized to stay near SCORE_BYTES (never the whole N x N matrix of a long sequence).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import reference
from ._interop import ArrayInfo, as_float, cpu_result
from ._problem import Problem

SCORE_BYTES = 64 * 2**20


def _blocks(p: Problem) -> dict[str, int]:
    """Query rows per step such that one step's float64 scores take about SCORE_BYTES."""
    per_row = max(1, p.batch * p.heads_q * p.seq_k * 8)
    block_m = max(16, min(p.seq_q, SCORE_BYTES // per_row))
    return {"block_m": block_m, "block_n": max(1, p.seq_k)}


def _score_mods(p: Problem, alibi: ArrayInfo | None) -> dict[str, Any]:
    """The reference's softcap and ALiBi arguments of problem `p`."""
    slopes = None if alibi is None else np.asarray(as_float(alibi), dtype=np.float64)
    return {"softcap": p.softcap, "alibi_slopes": slopes}


def forward(
    p: Problem, qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo, alibi: ArrayInfo | None = None
) -> tuple[Any, Any]:
    arrays = (as_float(qi), as_float(ki), as_float(vi))
    return _forward_result(p, qi, arrays, _score_mods(p, alibi))


def _forward_result(p: Problem, qi: ArrayInfo, arrays: tuple, mods: dict) -> tuple[Any, Any]:
    """(o, lse) of q, k, v's values `arrays` in q's library: o in p.out_dtype."""
    if p.batch * p.heads_q * p.seq_q == 0 or p.seq_k == 0:
        o = np.zeros(p.q_shape)
        lse = np.full(p.lse_shape, -np.inf)
    else:
        o, lse = reference.forward_blockwise(
            *arrays, window=p.window, scale=p.scale, layout=p.layout, **mods, **_blocks(p)
        )
    return cpu_result(qi, o, p.out_dtype), cpu_result(qi, lse, p.lse_dtype)


def forward_fp8(
    p: Problem,
    qi: ArrayInfo,
    ki: ArrayInfo,
    vi: ArrayInfo,
    descales: tuple[ArrayInfo | None, ArrayInfo | None, ArrayInfo | None],
) -> tuple[Any, Any]:
    """attention_forward_fp8 on the CPU: the forward of the dequantised inputs (each (batch,
    key/value head) times its descale factor) in float64, O rounded to bfloat16. The GPU kernel
    also rounds P to e4m3 (cuflash.testing.naive_forward_fp8 models that)."""
    arrays = []
    for info, factor in zip((qi, ki, vi), descales, strict=True):
        x = np.asarray(as_float(info), dtype=np.float64)
        if factor is not None and x.size:
            f = np.asarray(as_float(factor), dtype=np.float64)  # (B, Hkv)
            f = np.repeat(f, p.group, axis=1) if info is qi else f  # per query head
            x = x * (f[:, None, :, None] if p.layout == "bshd" else f[:, :, None, None])
        arrays.append(x)
    return _forward_result(p, qi, tuple(arrays), {})


def backward(
    p: Problem,
    doi: ArrayInfo,
    qi: ArrayInfo,
    ki: ArrayInfo,
    vi: ArrayInfo,
    oi: ArrayInfo,
    lsei: ArrayInfo,
    alibi: ArrayInfo | None = None,
) -> tuple[Any, Any, Any]:
    if p.batch * p.heads_q * p.seq_q == 0 or p.seq_k == 0:
        dq, dk, dv = np.zeros(p.q_shape), np.zeros(p.kv_shape), np.zeros(p.kv_shape)
    else:
        dq, dk, dv = reference.backward_blockwise(
            as_float(doi),
            as_float(qi),
            as_float(ki),
            as_float(vi),
            as_float(oi),
            np.asarray(as_float(lsei), dtype=np.float64),
            window=p.window,
            scale=p.scale,
            layout=p.layout,
            **_score_mods(p, alibi),
            **_blocks(p),
        )
    return (cpu_result(qi, dq, p.dtype), cpu_result(qi, dk, p.dtype), cpu_result(qi, dv, p.dtype))
