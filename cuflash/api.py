"""The public API: exact attention forward and backward for any DLPack array.

Shapes (``layout="bshd"``, the FlashAttention / JAX order): q ``(B, Nq, Hq, d)``, k and v
``(B, Nk, Hkv, d)``; ``layout="bhsd"`` (the PyTorch SDPA order): ``(B, H, N, d)``. A 2-D ``(N, d)``
array is one sequence with one head. ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention;
query head h reads key/value head ``h // (Hq // Hkv)``).

Causal masking is aligned to the bottom-right corner: query i sees key j when
``j <= i + Nk - Nq``. A query row that sees no key gives o = 0, lse = -inf and zero gradients.

dtypes: float16 and bfloat16 run on the tensor cores with float32 accumulation; float32 and
float64 run on an exact path. Outputs have the input dtype; lse is float32 (float64 for float64
inputs), shape ``(B, Hq, Nq)`` (``(N,)`` for 2-D input).

CUDA inputs run on their device, on the current stream of the library that owns them; CPU inputs
(NumPy, torch CPU, JAX CPU) run the NumPy backend with the same semantics. Results come back as
arrays of the caller's library.
"""

from __future__ import annotations

import os
from typing import Any

from . import _plans, _validate

Array = Any  # any object with __dlpack__ / __dlpack_device__ (NumPy, CuPy, torch, JAX, ...)


def attention_forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
) -> tuple[Array, Array]:
    """Attention output and logsumexp.

    Args:
        q: queries, ``(B, Nq, Hq, d)`` for ``layout="bshd"``, ``(B, Hq, Nq, d)`` for ``"bhsd"``,
            or ``(Nq, d)``; float16, bfloat16, float32 or float64; last dimension contiguous.
        k, v: keys and values, ``(B, Nk, Hkv, d)`` (or the ``bhsd`` / 2-D equivalents), same
            dtype and device as q; ``Hq % Hkv == 0``.
        causal: bottom-right aligned causal mask (query i sees key j iff ``j <= i + Nk - Nq``).
        scale: softmax scale, a finite number > 0; defaults to ``1 / sqrt(d)``.
        layout: ``"bshd"`` or ``"bhsd"`` (ignored for 2-D input).

    Returns:
        ``(o, lse)``: o shaped and typed like q; lse ``(B, Hq, Nq)`` (``(Nq,)`` for 2-D input)
        holding ``log(sum_j exp(scale * q_i . k_j))`` over the keys row i sees, float32 (float64
        for float64 input), ``-inf`` for a row that sees no key. Arrays of q's library.

    Raises:
        TypeError: an argument is not an array, has an unsupported dtype, or libraries are mixed;
            causal is not a bool, scale not a real number, layout not a string.
        ValueError: shapes disagree, arrays are on different devices, the head dim is 0 or above
            256, the last dimension is not contiguous, scale is not finite and > 0, or layout is
            neither "bshd" nor "bhsd".
    """
    arrays = (q, k, v)
    key = _plans.signature("forward", arrays, causal, scale, layout)
    plan = _plans.get(key)
    if plan is not None:  # this signature was validated before
        return plan.call_arrays(arrays)
    problem, qi, ki, vi = _validate.check_forward(q, k, v, causal, scale, layout)
    if problem.device[0] == "cpu":
        from . import _cpu

        return _cpu.forward(problem, qi, ki, vi)
    from . import _cuda

    plan = _cuda.ForwardPlan(problem, qi, ki, vi, poison=poison_outputs())
    _plans.put(key, plan)
    return plan(qi.ptr, ki.ptr, vi.ptr)


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
) -> Array:
    """``softmax(scale * q k^T) v``: the output of :func:`attention_forward` without the lse."""
    return attention_forward(q, k, v, causal=causal, scale=scale, layout=layout)[0]


def attention_backward(
    do: Array,
    q: Array,
    k: Array,
    v: Array,
    o: Array,
    lse: Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
) -> tuple[Array, Array, Array]:
    """Gradients of ``sum(o * do)`` with respect to q, k and v.

    Args:
        do: gradient of the output, shaped and typed like q.
        q, k, v, causal, scale, layout: as given to :func:`attention_forward`.
        o, lse: what :func:`attention_forward` returned for them.

    Returns:
        ``(dq, dk, dv)`` shaped and typed like q, k and v; with grouped heads dk and dv sum over
        the query heads of each group. Deterministic: the same inputs give the same bits.

    Raises:
        TypeError, ValueError: as :func:`attention_forward`, and for ``do``, ``o`` or ``lse`` of
            the wrong shape, dtype, library or device.
    """
    arrays = (do, q, k, v, o, lse)
    key = _plans.signature("backward", arrays, causal, scale, layout)
    plan = _plans.get(key)
    if plan is not None:
        return plan.call_arrays(arrays)
    problem, doi, qi, ki, vi, oi, lsei = _validate.check_backward(
        do, q, k, v, o, lse, causal, scale, layout
    )
    if problem.device[0] == "cpu":
        from . import _cpu

        return _cpu.backward(problem, doi, qi, ki, vi, oi, lsei)
    from . import _cuda

    plan = _cuda.BackwardPlan(problem, doi, qi, ki, vi, oi, lsei, poison=poison_outputs())
    _plans.put(key, plan)
    return plan(doi.ptr, qi.ptr, ki.ptr, vi.ptr, oi.ptr, lsei.ptr)


def poison_outputs() -> bool:
    """Whether new plans fill their outputs with NaN before the kernels run (the environment
    variable CUFLASH_POISON_OUTPUTS=1; read when a plan is built, never per call): a debugging
    aid that makes every element a kernel fails to write show up. The GPU tests run so."""
    return os.environ.get("CUFLASH_POISON_OUTPUTS") == "1"
