"""Ring attention for JAX: the algorithm of cuflash/_ring.py inside ``shard_map``, with
``jax.lax.ppermute`` moving the key/value shards (and, in the backward, their dK/dV accumulators)
around the mesh axis that splits the sequence.

Each device holds its zigzag shard (chunks r and 2P - 1 - r of 2P): `zigzag_order` permutes a
full sequence so that an even split along that axis hands every device its shard. The pairs of
chunks a device computes at ring step s are known statically but for one: at s = 0 its own
diagonal pairs and the pair (second query chunk, first key chunk); at every later step the pair
(second query chunk, first key chunk), which is always visible under the causal mask, and one of
(first, first) when s <= r and (second, second) otherwise, which depends on the device index r (a
traced value): the inputs of that call are selected with `jnp.where`, and its result goes to the
chunk it belongs to, with lse = -inf (no contribution) for the other. Partial results are merged
with their logsumexps in float32 (float64 for float64 inputs); the backward runs cuflash's backward
on each visible pair with the merged o and lse.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

LAYOUTS = {"bshd": 1, "bhsd": 2}


class AttentionOps(NamedTuple):
    """The attention of each visible pair of shards: cuflash.jax's attention_forward and
    attention_backward, handed in by cuflash.jax (this module imports nothing of it)."""

    forward: Callable
    backward: Callable


def _seq_axis(layout: object) -> int:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout must be 'bshd' (B, N, H, d) or 'bhsd' (B, H, N, d); got {layout!r}"
        )
    return LAYOUTS[layout]


def _world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    return world_size


def zigzag_order(x: jax.Array, world_size: int, axis: int = 1) -> jax.Array:
    """The full sequence reordered so that cutting it into world_size equal parts along `axis`
    gives part r = chunks r and 2 world_size - 1 - r (of 2 world_size equal chunks): shard the
    result evenly along that axis (e.g. PartitionSpec(None, "seq")) for ring_attention."""
    world_size = _world_size(world_size)
    n = x.shape[axis]
    if n % (2 * world_size):
        raise ValueError(
            f"the sequence (axis {axis}, length {n}) must split into 2 x world_size = "
            f"{2 * world_size} equal chunks"
        )
    chunks = jnp.split(x, 2 * world_size, axis)
    order = [c for r in range(world_size) for c in (chunks[r], chunks[2 * world_size - 1 - r])]
    return jnp.concatenate(order, axis)


def zigzag_restore(x: jax.Array, world_size: int, axis: int = 1) -> jax.Array:
    """The inverse of zigzag_order: the sequence back in its order."""
    world_size = _world_size(world_size)
    if x.shape[axis] % (2 * world_size):
        raise ValueError(
            f"the sequence (axis {axis}, length {x.shape[axis]}) must split into 2 x "
            f"world_size = {2 * world_size} equal chunks"
        )
    chunks = jnp.split(x, 2 * world_size, axis)
    first = [chunks[2 * r] for r in range(world_size)]
    second = [chunks[2 * r + 1] for r in reversed(range(world_size))]
    return jnp.concatenate(first + second, axis)


def _axis_size(axis_name) -> int:
    size = getattr(jax.lax, "axis_size", None)
    return int(size(axis_name)) if size is not None else int(jax.lax.psum(1, axis_name))


def _acc_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _merge(parts, seq_axis: int):
    """(o, lse) over the union of the parts' key sets (cuflash.combine's merge)."""
    from . import _combine

    o = jnp.stack([part[0] for part in parts])
    lse = jnp.stack([part[1] for part in parts])
    return _combine.merge(o, lse, bshd=seq_axis == 1)


def _halves(x, axis):
    return jnp.split(x, 2, axis)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _ring(q, k, v, ops, axis_name, causal, scale, layout):
    return _ring_forward(q, k, v, ops, axis_name, causal, scale, layout)[0]


def _ring_forward(q, k, v, ops, axis_name, causal, scale, layout):
    seq = LAYOUTS[layout]
    world = _axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    perm = [(i, (i + 1) % world) for i in range(world)]
    acc = _acc_dtype(q.dtype)

    def fwd(q, k, v, diagonal=False):
        return ops.forward(q, k, v, causal=diagonal, scale=scale, layout=layout)

    qa, qb = _halves(q, seq)
    parts_a, parts_b = [], []
    block = (k, v)
    for step in range(world):
        nxt = None
        if step + 1 < world:
            nxt = tuple(jax.lax.ppermute(x, axis_name, perm) for x in block)
        (kc, ke), (vc, ve) = _halves(block[0], seq), _halves(block[1], seq)
        if not causal:
            o_s, lse_s = fwd(q, *block)
            (oa, ob), (la, lb) = _halves(o_s, seq), _halves(lse_s, -1)
            parts_a.append((oa, la))
            parts_b.append((ob, lb))
        elif step == 0:
            parts_a.append(fwd(qa, kc, vc, True))
            parts_b.append(fwd(qb, kc, vc))
            parts_b.append(fwd(qb, ke, ve, True))
        else:
            first = step <= rank  # the owner's first chunk comes before this device's first
            o_s, lse_s = fwd(
                jnp.where(first, qa, qb), jnp.where(first, kc, ke), jnp.where(first, vc, ve)
            )
            parts_a.append((jnp.where(first, o_s, 0), jnp.where(first, lse_s, -jnp.inf)))
            parts_b.append((jnp.where(first, 0, o_s), jnp.where(first, -jnp.inf, lse_s)))
            parts_b.append(fwd(qb, kc, vc))
        if nxt is not None:
            block = nxt
    (o_a, lse_a), (o_b, lse_b) = _merge(parts_a, seq), _merge(parts_b, seq)
    o = jnp.concatenate([o_a, o_b], seq).astype(q.dtype)
    lse = jnp.concatenate([lse_a, lse_b], -1).astype(
        jnp.float64 if acc == jnp.float64 else jnp.float32
    )
    return o, (q, k, v, o, lse)


def _ring_backward(ops, axis_name, causal, scale, layout, residuals, do):
    q, k, v, o, lse = residuals
    seq = LAYOUTS[layout]
    world = _axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    perm = [(i, (i + 1) % world) for i in range(world)]
    acc = _acc_dtype(q.dtype)

    def bwd(do, q, k, v, o, lse, diagonal=False):
        grads = ops.backward(do, q, k, v, o, lse, causal=diagonal, scale=scale, layout=layout)
        return tuple(g.astype(acc) for g in grads)

    qa, qb = _halves(q, seq)
    oa, ob = _halves(o, seq)
    da, db = _halves(do.astype(q.dtype), seq)
    la, lb = _halves(lse, -1)
    dq_a, dq_b = jnp.zeros(qa.shape, acc), jnp.zeros(qb.shape, acc)
    block = (k, v)
    dk, dv = jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc)
    for step in range(world):
        nxt = None
        if step + 1 < world:
            nxt = tuple(jax.lax.ppermute(x, axis_name, perm) for x in block)
        (kc, ke), (vc, ve) = _halves(block[0], seq), _halves(block[1], seq)
        (dkc, dke), (dvc, dve) = _halves(dk, seq), _halves(dv, seq)
        if not causal:
            dq_s, dk_s, dv_s = bwd(do.astype(q.dtype), q, *block, o, lse)
            dq_sa, dq_sb = _halves(dq_s, seq)
            dq_a, dq_b = dq_a + dq_sa, dq_b + dq_sb
            dk, dv = dk + dk_s, dv + dv_s
        else:
            if step == 0:
                g = bwd(da, qa, kc, vc, oa, la, True)
                dq_a, dkc, dvc = dq_a + g[0], dkc + g[1], dvc + g[2]
                g = bwd(db, qb, ke, ve, ob, lb, True)
                dq_b, dke, dve = dq_b + g[0], dke + g[1], dve + g[2]
            else:
                first = step <= rank

                def pick(a, b, first=first):
                    return jnp.where(first, a, b)

                g = bwd(
                    pick(da, db),
                    pick(qa, qb),
                    pick(kc, ke),
                    pick(vc, ve),
                    pick(oa, ob),
                    pick(la, lb),
                )
                dq_a = dq_a + jnp.where(first, g[0], 0)
                dq_b = dq_b + jnp.where(first, 0, g[0])
                dkc, dke = dkc + jnp.where(first, g[1], 0), dke + jnp.where(first, 0, g[1])
                dvc, dve = dvc + jnp.where(first, g[2], 0), dve + jnp.where(first, 0, g[2])
            g = bwd(db, qb, kc, vc, ob, lb)
            dq_b, dkc, dvc = dq_b + g[0], dkc + g[1], dvc + g[2]
            dk, dv = jnp.concatenate([dkc, dke], seq), jnp.concatenate([dvc, dve], seq)
        # the accumulators follow their shard; after the last step one hop takes them home
        dk, dv = (jax.lax.ppermute(x, axis_name, perm) for x in (dk, dv))
        if nxt is not None:
            block = nxt
    dq = jnp.concatenate([dq_a, dq_b], seq)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_forward, _ring_backward)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ops: AttentionOps,
    *,
    axis_name,
    causal: bool,
    scale: float | None,
    layout: str,
) -> jax.Array:
    """cuflash.jax.ring_attention (its docstring), with `ops` computing each pair of shards."""
    seq = _seq_axis(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have 4 dimensions ({layout}); got {getattr(x, 'shape', x)!r}"
            )
    n = q.shape[seq]
    if n % 2 or k.shape[seq] != n or v.shape[seq] != n:
        raise ValueError(
            f"q, k and v must be zigzag shards of one sequence (two equal chunks each): sequence "
            f"lengths {n}, {k.shape[seq]}, {v.shape[seq]} along axis {seq}"
        )
    return _ring(q, k, v, ops, axis_name, causal, scale, layout)
