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

from . import api

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


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, causal, scale, layout):
    _check_concrete(q, k, v)
    return api.attention(q, k, v, causal=causal, scale=scale, layout=layout)


def _attention_fwd(q, k, v, causal, scale, layout):
    _check_concrete(q, k, v)
    o, lse = api.attention_forward(q, k, v, causal=causal, scale=scale, layout=layout)
    return o, (q, k, v, o, lse)


def _attention_bwd(causal, scale, layout, residuals, do):
    q, k, v, o, lse = residuals
    _check_concrete(do)
    return api.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, layout=layout)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
) -> jax.Array:
    """Exact attention with a custom VJP (see the module docstring). Differentiable in q, k, v
    with ``jax.grad``/``jax.vjp`` on concrete arrays; raises TypeError under ``jax.jit``."""
    return _attention(q, k, v, causal, scale, layout)
