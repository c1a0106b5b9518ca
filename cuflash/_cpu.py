"""The CPU backend: the blockwise NumPy reference in float64, rounded to the input dtype.

Used for every input that lives on the CPU (NumPy, torch CPU, JAX CPU), so scripts and tests run
on any machine with the same semantics and the same errors as the GPU path. The blockwise form
keeps memory at O(N * block) instead of materialising the N x N score matrix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import reference
from ._interop import ArrayInfo, as_float, cpu_result
from ._validate import Problem

BLOCK = 128


def forward(p: Problem, qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo) -> tuple[Any, Any]:
    if p.batch * p.heads_q * p.seq_q == 0 or p.seq_k == 0:
        o = np.zeros(p.q_shape)
        lse = np.full(p.lse_shape, -np.inf)
    else:
        o, lse = reference.forward_blockwise(
            as_float(qi),
            as_float(ki),
            as_float(vi),
            causal=p.causal,
            scale=p.scale,
            layout=p.layout,
            block_m=BLOCK,
            block_n=BLOCK,
        )
    return cpu_result(qi, o, p.dtype), cpu_result(qi, lse, p.lse_dtype)


def backward(
    p: Problem,
    doi: ArrayInfo,
    qi: ArrayInfo,
    ki: ArrayInfo,
    vi: ArrayInfo,
    oi: ArrayInfo,
    lsei: ArrayInfo,
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
            causal=p.causal,
            scale=p.scale,
            layout=p.layout,
            block_m=BLOCK,
            block_n=BLOCK,
        )
    return (cpu_result(qi, dq, p.dtype), cpu_result(qi, dk, p.dtype), cpu_result(qi, dv, p.dtype))
