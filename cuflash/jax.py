"""JAX integration: attention with a custom VJP, for jax.grad on concrete arrays.

    import cuflash.jax as cfj
    loss = lambda q, k, v: cfj.attention(q, k, v, causal=True).sum()
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

Shapes as :func:`cuflash.attention` (``layout="bshd"``: q ``(B, Nq, Hq, d)``, k/v
``(B, Nk, Hkv, d)``; or 2-D ``(N, d)``). Buffers move between JAX and the kernels through DLPack
without copies; the forward saves q, k, v, o and lse and the backward runs the three backward
kernels.

**Eager only.** The kernels are launched from Python (through CuPy), which XLA cannot call from
inside a compiled program. Under ``jax.jit`` (or ``vmap``, ``scan``, ``pmap``, anything that
traces) the inputs are tracers, and ``attention`` raises a TypeError that says so, never a silent
host round trip. Call it outside ``jit`` — ``jax.grad`` of an eager function works — and jit the
rest of the model around it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from . import _validate, api

_JIT_MESSAGE = (
    "cuflash.jax.attention got a traced array ({what}): it runs eagerly on concrete arrays and "
    "cannot run inside jax.jit, vmap, scan or other transformations that trace, because its "
    "kernels are launched from Python. Call it outside jit (jax.grad of an eager function "
    "works) and jit the surrounding computation separately."
)


def _check_concrete(*arrays: Any) -> None:
    for x in arrays:
        if isinstance(x, jax.core.Tracer):
            raise TypeError(_JIT_MESSAGE.format(what=type(x).__name__))


# The options are static (hashable) arguments; the ALiBi slopes are an array without a gradient.
@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attention(q, k, v, alibi_slopes, causal, window, softcap, scale, layout):
    _check_concrete(q, k, v)
    options = _validate.option_kwargs(causal, window, softcap, scale, layout)
    return api.attention(q, k, v, alibi_slopes=alibi_slopes, **options)


def _attention_fwd(q, k, v, alibi_slopes, causal, window, softcap, scale, layout):
    _check_concrete(q, k, v)
    options = _validate.option_kwargs(causal, window, softcap, scale, layout)
    o, lse = api.attention_forward(q, k, v, alibi_slopes=alibi_slopes, **options)
    return o, (q, k, v, alibi_slopes, o, lse)


def _attention_bwd(causal, window, softcap, scale, layout, residuals, do):
    q, k, v, alibi_slopes, o, lse = residuals
    _check_concrete(do)
    options = _validate.option_kwargs(causal, window, softcap, scale, layout)
    dq, dk, dv = api.attention_backward(do, q, k, v, o, lse, alibi_slopes=alibi_slopes, **options)
    return dq, dk, dv, None  # the slopes get no gradient


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
) -> jax.Array:
    """Exact attention with a custom VJP (see the module docstring). Differentiable in q, k, v
    with ``jax.grad``/``jax.vjp`` on concrete arrays; raises TypeError under ``jax.jit``.
    ``window``, ``softcap`` and ``alibi_slopes`` as in :func:`cuflash.attention` (the slopes get
    no gradient)."""
    window = tuple(window) if isinstance(window, list) else window  # a static argument: hashable
    return _attention(q, k, v, alibi_slopes, causal, window, softcap, scale, layout)
