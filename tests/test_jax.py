"""cuflash.jax on CPU arrays (the NumPy backend), eagerly: jax.grad through the custom VJP, and
the error of the eager API under jax.jit. Under jit: tests/test_jax_jit.py. GPU runs:
tests/gpu/test_frameworks.py and tests/gpu/test_jax_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash import reference

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
cfj = pytest.importorskip("cuflash.jax")

import cuflash  # noqa: E402


def naive_bshd(q, k, v, causal, scale):
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(0, 2, 1, 3)
    kh = jnp.repeat(k.transpose(0, 2, 1, 3), group, 1)
    vh = jnp.repeat(v.transpose(0, 2, 1, 3), group, 1)
    s = (qh @ kh.transpose(0, 1, 3, 2)) * scale
    s = jnp.where(reference.visible_mask(q.shape[1], k.shape[1], causal), s, -jnp.inf)
    return (jax.nn.softmax(s, -1) @ vh).transpose(0, 2, 1, 3)


@pytest.fixture
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("causal", [False, True])
def test_grad_equals_grad_of_naive_attention(x64, causal):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, 37, 4, 16), dtype=jnp.float64)
    k = jax.random.normal(keys[1], (2, 45, 2, 16), dtype=jnp.float64)
    v = jax.random.normal(keys[2], (2, 45, 2, 16), dtype=jnp.float64)
    w = jax.random.normal(keys[3], (2, 37, 4, 16), dtype=jnp.float64)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * w).sum()

    ours = jax.grad(
        loss(lambda q, k, v: cfj.attention(q, k, v, causal=causal, scale=0.3)), argnums=(0, 1, 2)
    )(q, k, v)
    want = jax.grad(loss(lambda q, k, v: naive_bshd(q, k, v, causal, 0.3)), argnums=(0, 1, 2))(
        q, k, v
    )
    for got, ref in zip(ours, want, strict=True):
        assert isinstance(got, jax.Array)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-10, atol=1e-12)


def test_the_eager_api_names_cuflash_jax_under_jit():
    q = jnp.ones((8, 16), dtype=jnp.float32)
    with pytest.raises(TypeError, match="q is a traced JAX array.*use cuflash.jax.attention"):
        jax.jit(lambda q: cuflash.attention(q, q, q))(q)
