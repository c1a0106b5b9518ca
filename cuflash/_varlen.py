"""Packed variable-length sequences: their offsets on the host, and the CPU backend.

A packed call holds B sequences in q (Tq, Hq, d) and k, v (Tk, Hkv, d): sequence b's queries are
rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1], its keys rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1].
The offsets are read to the host only when the call asks for it (check_seqlens), when a longest
length is not given, or on the CPU; CUDA calls with both max_seqlen given read nothing and trust
them (the kernels clamp every offset to the tensors' rows: kernels_cu/params.cuh, Seq).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import _cpu, reference
from ._interop import ArrayInfo, as_float, cpu_result, numpy_view
from ._problem import Problem


@dataclass(frozen=True)
class Offsets:
    """The sequences' first rows (B + 1 each, checked) and their longest lengths."""

    q: np.ndarray
    k: np.ndarray

    @property
    def longest_q(self) -> int:
        return int(np.diff(self.q).max(initial=0))

    @property
    def longest_k(self) -> int:
        return int(np.diff(self.k).max(initial=0))


def _host_copy(info: ArrayInfo) -> np.ndarray:
    if info.device[0] == "cpu":
        return np.array(numpy_view(info), dtype=np.int64)
    import cupy

    with cupy.cuda.Device(info.device[1]):
        # the caller's stream orders this copy after the offsets' producer
        from ._interop import cupy_stream, launch_stream

        stream = cupy_stream(launch_stream(info.library, info.device[1]), info.device[1])
        mem = cupy.cuda.UnownedMemory(info.ptr, info.shape[0] * 4, info.obj)
        device = cupy.ndarray(info.shape, cupy.int32, cupy.cuda.MemoryPointer(mem, 0))
        with stream:
            host = cupy.asnumpy(device, stream=stream)
        stream.synchronize()
    return host.astype(np.int64)


def read_offsets(cqi: ArrayInfo, cki: ArrayInfo, total_q: int, total_k: int) -> Offsets:
    """Both offset arrays on the host, checked: start at 0, never decrease, end at T."""
    arrays = []
    for info, total, rows in ((cqi, total_q, "q"), (cki, total_k, "k")):
        cu = _host_copy(info)
        if cu[0] != 0:
            raise ValueError(f"{info.name} must start at 0; got {cu[0]}")
        steps = np.diff(cu)
        if np.any(steps < 0):
            b = int(np.argmax(steps < 0))
            raise ValueError(
                f"{info.name} must be non-decreasing; got {cu[b]} then {cu[b + 1]} at index {b}"
            )
        if cu[-1] != total:
            raise ValueError(
                f"{info.name} must end at the number of rows of {rows} ({total}); got {cu[-1]}"
            )
        arrays.append(cu)
    return Offsets(*arrays)


def _sequence(p: Problem, nq: int, nk: int) -> Problem:
    """The dense problem of one sequence: (1, nq, Hq, d) against (1, nk, Hkv, d)."""
    return replace(p, batch=1, seq_q=nq, seq_k=nk, packed=False, total_q=0, total_k=0)


def _slopes(alibi: ArrayInfo | None, b: int) -> Any:
    if alibi is None:
        return None
    slopes = np.asarray(as_float(alibi), dtype=np.float64)
    return slopes if slopes.ndim == 1 else slopes[b : b + 1]


def cpu_forward(
    p: Problem, qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo, alibi: Any, offsets: Offsets
) -> tuple[Any, Any]:
    """Each sequence as the dense CPU backend computes it alone (the same blocks, so the same
    bits), written into the packed outputs."""
    q, k, v = as_float(qi), as_float(ki), as_float(vi)
    o = np.zeros(p.q_shape)
    lse = np.full(p.lse_shape, -np.inf)
    for b in range(p.batch):
        q0, q1, k0, k1 = offsets.q[b], offsets.q[b + 1], offsets.k[b], offsets.k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        sub = _sequence(p, int(q1 - q0), int(k1 - k0))
        o_b, lse_b = reference.forward_blockwise(
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            window=p.window,
            scale=p.scale,
            layout="bshd",
            softcap=p.softcap,
            alibi_slopes=_slopes(alibi, b),
            **_cpu._blocks(sub),
        )
        o[q0:q1], lse[:, q0:q1] = o_b[0], lse_b[0]
    return cpu_result(qi, o, p.dtype), cpu_result(qi, lse, p.lse_dtype)


def cpu_backward(
    p: Problem,
    doi: ArrayInfo,
    qi: ArrayInfo,
    ki: ArrayInfo,
    vi: ArrayInfo,
    oi: ArrayInfo,
    lsei: ArrayInfo,
    alibi: Any,
    offsets: Offsets,
) -> tuple[Any, Any, Any]:
    do, q, k, v, o = (as_float(i) for i in (doi, qi, ki, vi, oi))
    lse = np.asarray(as_float(lsei), dtype=np.float64)
    dq, dk, dv = np.zeros(p.q_shape), np.zeros(p.kv_shape), np.zeros(p.kv_shape)
    for b in range(p.batch):
        q0, q1, k0, k1 = offsets.q[b], offsets.q[b + 1], offsets.k[b], offsets.k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        sub = _sequence(p, int(q1 - q0), int(k1 - k0))
        dq_b, dk_b, dv_b = reference.backward_blockwise(
            do[None, q0:q1],
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            o[None, q0:q1],
            lse[None, :, q0:q1],
            window=p.window,
            scale=p.scale,
            layout="bshd",
            softcap=p.softcap,
            alibi_slopes=_slopes(alibi, b),
            **_cpu._blocks(sub),
        )
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = dq_b[0], dk_b[0], dv_b[0]
    return tuple(cpu_result(qi, x, p.dtype) for x in (dq, dk, dv))
