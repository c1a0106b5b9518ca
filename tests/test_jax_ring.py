"""cuflash.jax.ring_attention inside shard_map on 2 and 3 CPU devices (a fresh process: the
device count is fixed when JAX starts): each device's output and the gradients are, gathered,
single-process attention on the whole sequence, within the policy against the float64 reference
(float32), causal and not, grouped heads, both layouts, odd chunk lengths; repeated runs give
the same bits; zigzag_order / zigzag_restore and the errors."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from host_devices import run_on_host_devices

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cuflash.jax as cfj  # noqa: E402

RING_SCRIPT = textwrap.dedent(
    """
    import math
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import cuflash.jax as cfj
    from cuflash import testing
    assert len(jax.devices()) == 4, jax.devices()

    def to_bhsd(x, layout):
        x = np.asarray(x, np.float64)
        return x.transpose(0, 2, 1, 3) if layout == "bshd" else x

    def from_bhsd(x, layout):
        return x.transpose(0, 2, 1, 3) if layout == "bshd" else x

    for world in (2, 3):
        mesh = Mesh(np.array(jax.devices()[:world]), ("seq",))
        shapes = (("bshd", (2, 3, 4, 2, 8)), ("bhsd", (1, 5, 3, 1, 16)))
        for layout, (b, chunk, hq, hkv, d) in shapes:
            seq = 1 if layout == "bshd" else 2
            n = 2 * world * chunk
            rng = np.random.default_rng(world)
            def make(h):
                x = rng.standard_normal((b, n, h, d))
                return x if layout == "bshd" else x.transpose(0, 2, 1, 3)
            q, k, v, do = (jnp.asarray(make(h), jnp.float32) for h in (hq, hkv, hkv, hq))
            spec = P(*[None] * seq, "seq")
            for causal in (False, True):
                def local(q, k, v, do):
                    def loss(q, k, v):
                        o = cfj.ring_attention(
                            q, k, v, axis_name="seq", causal=causal, layout=layout
                        )
                        return (o * do).sum(), o
                    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
                    (_, o), grads = grad(q, k, v)
                    return (o, *grads)
                specs = (spec,) * 4
                run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs))
                zz = lambda x: cfj.zigzag_order(x, world, seq)
                inputs = [zz(x) for x in (q, k, v, do)]
                got = [cfj.zigzag_restore(x, world, seq) for x in run(*inputs)]
                again = [cfj.zigzag_restore(x, world, seq) for x in run(*inputs)]
                for g, a in zip(got, again):
                    assert np.array_equal(np.asarray(g), np.asarray(a)), "not repeatable"
                q64, k64, v64, do64 = (to_bhsd(x, layout) for x in (q, k, v, do))
                kw = dict(causal=causal, scale=1 / math.sqrt(d))
                o_ref, lse_ref = testing.naive_forward(q64, k64, v64, dtype="float64", **kw)
                o_low, _ = testing.naive_forward(q64, k64, v64, dtype="float32", **kw)
                args = (do64, q64, k64, v64, o_ref, lse_ref)
                g_ref = testing.naive_backward(*args, dtype="float64", **kw)
                g_low = testing.naive_backward(*args, dtype="float32", **kw)
                names = ("o", "dq", "dk", "dv")
                for name, x, ref, low in zip(names, got, (o_ref, *g_ref), (o_low, *g_low)):
                    check = testing.compare(name, to_bhsd(x, layout), ref, low, "float32")
                    assert check.passed, (world, layout, causal, check.message)
    print("ring ok")
    """
)


def test_ring_attention_in_shard_map_equals_attention_on_the_whole_sequence():
    if not hasattr(jax, "shard_map"):
        pytest.skip("jax.shard_map is not in this JAX")
    assert "ring ok" in run_on_host_devices(RING_SCRIPT)


def test_zigzag_order_and_restore():
    x = jnp.arange(2 * 12 * 3).reshape(2, 12, 3)
    ordered = cfj.zigzag_order(x, 3)  # chunks of 2: 0 5 1 4 2 3
    want = np.concatenate([np.asarray(x)[:, 2 * c : 2 * c + 2] for c in (0, 5, 1, 4, 2, 3)], 1)
    np.testing.assert_array_equal(np.asarray(ordered), want)
    np.testing.assert_array_equal(np.asarray(cfj.zigzag_restore(ordered, 3)), np.asarray(x))
    with pytest.raises(ValueError, match="2 x world_size = 10 equal chunks"):
        cfj.zigzag_order(x, 5)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        cfj.zigzag_order(x, 0)


def test_ring_attention_errors():
    x = jnp.zeros((1, 12, 2, 4))
    with pytest.raises(ValueError, match="layout must be"):
        cfj.ring_attention(x, x, x, axis_name="seq", layout="sbhd")
    with pytest.raises(ValueError, match="two equal chunks"):
        cfj.ring_attention(x[:, :11], x[:, :11], x[:, :11], axis_name="seq")
    with pytest.raises(ValueError, match="4 dimensions"):
        cfj.ring_attention(x[0], x, x, axis_name="seq")
    with pytest.raises(TypeError, match="causal must be a bool"):
        cfj.ring_attention(x, x, x, axis_name="seq", causal=1)
