"""cuflash.jax inside JAX transformations, on the CPU (the NumPy backend runs in XLA's CPU
callback): jit, grad, vmap, checkpoint, shard_map, and the errors. The GPU side:
tests/gpu/test_jax_gpu.py.

Under jit on the CPU the callback runs the same NumPy backend as an eager call, so jitted results
must equal eager ones bit for bit; eager results are held to the float64 reference elsewhere
(tests/test_api.py), and one test here checks the jitted path against the reference directly.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
cfj = pytest.importorskip("cuflash.jax")

from host_devices import run_on_host_devices  # noqa: E402
from strategies import attention_problems, make_inputs  # noqa: E402

import cuflash  # noqa: E402
from cuflash import reference, testing  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def assert_bitwise(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))


@st.composite
def options(draw, heads_q, batch):
    window = draw(
        st.one_of(
            st.none(),
            st.tuples(
                st.one_of(st.none(), st.integers(-1, 40)), st.one_of(st.none(), st.integers(-1, 40))
            ),
        )
    )
    softcap = draw(st.one_of(st.none(), st.floats(0.5, 50.0)))
    alibi = draw(st.sampled_from(["none", "heads", "batch_heads"]))
    slopes = None
    if alibi == "heads":
        slopes = np.linspace(0.05, 0.5, heads_q, dtype=np.float32)
    elif alibi == "batch_heads":
        slopes = np.linspace(0.05, 0.5, batch * heads_q, dtype=np.float32).reshape(batch, heads_q)
    return {"window": window, "softcap": softcap, "alibi_slopes": slopes}


@settings(max_examples=25)
@given(problem=attention_problems(max_n=48, max_d=40, max_elements=60_000), data=st.data())
def test_jit_forward_and_grad_equal_eager_bitwise(problem, data):
    dtype = data.draw(st.sampled_from(sorted(DTYPES)))
    extra = data.draw(options(problem.Hq, problem.B))
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(x, DTYPES[dtype]) for x in make_inputs(problem, rng, np.float32))
    kwargs = dict(problem.kwargs, **extra)
    slopes = extra["alibi_slopes"]
    if slopes is not None:
        kwargs["alibi_slopes"] = jnp.asarray(slopes)

    o, lse = jax.jit(lambda q, k, v: cfj.attention_forward(q, k, v, **kwargs))(q, k, v)
    o_eager, lse_eager = cuflash.attention_forward(q, k, v, **kwargs)
    assert_bitwise(o, o_eager)
    assert_bitwise(lse, lse_eager)

    def loss(q, k, v):
        return (cfj.attention(q, k, v, **kwargs).astype(jnp.float32) * do.astype(jnp.float32)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = cuflash.attention_backward(do, q, k, v, o_eager, lse_eager, **kwargs)
    for got, ref in zip(grads, want, strict=True):
        assert_bitwise(got, ref)


def test_jit_matches_the_float64_reference():
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal(s) for s in [(2, 4, 50, 24), (2, 2, 70, 24)] * 2)
    v, do = do, v  # (q, k, v, do) shaped (q, k, k, q)
    opts = dict(causal=True, window=(20, None), softcap=3.0, scale=0.3)  # the naive one's layout
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, do)]
    o, lse = jax.jit(lambda q, k, v: cfj.attention_forward(q, k, v, layout="bhsd", **opts))(
        *f32[:3]
    )
    dq, dk, dv = jax.jit(
        lambda *a: cfj.attention_backward(a[0], *a[1:4], o, lse, layout="bhsd", **opts)
    )(f32[3], *f32[:3])
    inputs64 = [np.asarray(x, np.float64) for x in f32]
    o_ref, lse_ref = reference.forward(*inputs64[:3], layout="bhsd", **opts)
    grads_ref = reference.backward(
        inputs64[3], *inputs64[:3], o_ref, lse_ref, layout="bhsd", **opts
    )
    o_naive, lse_naive = testing.naive_forward(*inputs64[:3], dtype="float32", **opts)
    naive_grads = testing.naive_backward(
        inputs64[3], *inputs64[:3], o_naive, lse_naive, dtype="float32", **opts
    )
    checks = [
        testing.compare("o", o, o_ref, o_naive, "float32"),
        testing.compare("lse", lse, lse_ref, lse_naive, "float32"),
    ]
    for name, got, ref, naive in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), grads_ref, naive_grads, strict=True
    ):
        checks.append(testing.compare(name, got, ref, naive, "float32"))
    for check in checks:
        assert check.passed, check.message


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "2d"])
def test_vmap_folds_into_the_batch(layout):
    rng = np.random.default_rng(2)
    if layout == "2d":
        qs, ks = rng.standard_normal((3, 20, 8)), rng.standard_normal((3, 25, 8))
        kw = {}
    else:
        shape_q = (2, 20, 4, 8) if layout == "bshd" else (2, 4, 20, 8)
        shape_k = (2, 25, 2, 8) if layout == "bshd" else (2, 2, 25, 8)
        qs, ks = rng.standard_normal((3, *shape_q)), rng.standard_normal((3, *shape_k))
        kw = {"layout": layout}
    qs, ks = jnp.asarray(qs, jnp.float32), jnp.asarray(ks, jnp.float32)
    vs = ks * 0.5 + 1

    def f(q, k, v):
        return cfj.attention_forward(q, k, v, causal=True, **kw)

    o, lse = jax.jit(jax.vmap(f))(qs, ks, vs)
    for i in range(3):
        o_i, lse_i = cuflash.attention_forward(qs[i], ks[i], vs[i], causal=True, **kw)
        np.testing.assert_allclose(o[i], o_i, rtol=2e-7, atol=2e-7)
        np.testing.assert_allclose(lse[i], lse_i, rtol=2e-7, atol=2e-7)
    # only q mapped, and the mapped axis not first
    o2 = jax.vmap(lambda q: cfj.attention(q, ks[0], vs[0], causal=True, **kw), in_axes=1)(
        jnp.moveaxis(qs, 0, 1)
    )
    for i in range(3):
        want = cuflash.attention(qs[i], ks[0], vs[0], causal=True, **kw)
        np.testing.assert_allclose(o2[i], want, rtol=2e-7, atol=2e-7)
    # gradients under vmap, and vmap of vmap
    grads = jax.vmap(jax.grad(lambda q, k: f(q, k, k)[0].sum(), argnums=(0, 1)))(qs, ks)
    for i in range(3):
        o_i, lse_i = cuflash.attention_forward(qs[i], ks[i], ks[i], causal=True, **kw)
        want = cuflash.attention_backward(
            jnp.ones_like(o_i), qs[i], ks[i], ks[i], o_i, lse_i, causal=True, **kw
        )
        np.testing.assert_allclose(grads[0][i], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grads[1][i], want[1] + want[2], rtol=1e-5, atol=1e-6)
    nested = jax.vmap(jax.vmap(lambda q: cfj.attention(q, ks[0], vs[0], **kw)))(
        jnp.stack([qs, qs * 2])
    )
    np.testing.assert_allclose(
        nested[1, 2], cuflash.attention(qs[2] * 2, ks[0], vs[0], **kw), rtol=2e-7, atol=2e-7
    )


@pytest.mark.parametrize("slopes_shape", ["heads", "batch_heads"])
@pytest.mark.parametrize("mapped", [False, True])
def test_vmap_with_alibi_slopes(slopes_shape, mapped):
    rng = np.random.default_rng(3)
    qs = jnp.asarray(rng.standard_normal((3, 2, 12, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 15, 2, 8)), jnp.float32)
    shape = (4,) if slopes_shape == "heads" else (2, 4)
    slopes = jnp.asarray(rng.uniform(0.1, 1.0, ((3,) if mapped else ()) + shape), jnp.float32)
    in_axes = (0, 0 if mapped else None)
    got = jax.vmap(lambda q, s: cfj.attention(q, k, k, alibi_slopes=s), in_axes=in_axes)(qs, slopes)
    for i in range(3):
        s = slopes[i] if mapped else slopes
        want = cuflash.attention(qs[i], k, k, alibi_slopes=s)
        np.testing.assert_allclose(got[i], want, rtol=2e-7, atol=2e-7)


def test_checkpoint_gives_the_same_gradients():
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 30, 2, 16)), jnp.float32) for _ in range(3))

    def block(q, k, v):  # attention only: XLA's own arithmetic would fuse differently in jit
        return cfj.attention(cfj.attention(q, k, v, causal=True), k, v)

    plain = jax.grad(lambda q: block(q, k, v).sum())(q)
    remat = jax.jit(jax.grad(lambda q: jax.checkpoint(block)(q, k, v).sum()))(q)
    assert_bitwise(remat, plain)


def test_jit_inside_scan_and_fori_loop():
    rng = np.random.default_rng(5)
    q, k = (jnp.asarray(rng.standard_normal((1, 16, 1, 8)), jnp.float32) for _ in range(2))

    def step(q, _):
        return cfj.attention(q, k, k) + q, None

    scanned, _ = jax.jit(lambda q: jax.lax.scan(step, q, None, length=5))(q)
    eager = q
    for _ in range(5):
        eager = cuflash.attention(eager, k, k) + eager
    np.testing.assert_array_equal(scanned, eager)
    looped = jax.jit(lambda q: jax.lax.fori_loop(0, 5, lambda i, q: step(q, None)[0], q))(q)
    np.testing.assert_array_equal(looped, eager)


def test_empty_problems_under_jit():
    q = jnp.ones((2, 5, 2, 8), jnp.float32)
    k = jnp.ones((2, 0, 2, 8), jnp.float32)
    o, lse = jax.jit(lambda q, k: cfj.attention_forward(q, k, k))(q, k)
    np.testing.assert_array_equal(o, 0)
    assert np.all(np.isneginf(lse)) and lse.shape == (2, 2, 5)
    dq = jax.jit(jax.grad(lambda q: cfj.attention(q, k, k).sum()))(q)
    np.testing.assert_array_equal(dq, 0)


def test_float64_under_jit():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        rng = np.random.default_rng(6)
        q, k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 5))) for _ in range(3))
        o, lse = jax.jit(lambda q, k, v: cfj.attention_forward(q, k, v, causal=True))(q, k, v)
        assert o.dtype == jnp.float64 and lse.dtype == jnp.float64
        o_ref, lse_ref = reference.forward(*map(np.asarray, (q, k, v)), causal=True)
        np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-13)
        grads = jax.jit(jax.grad(lambda q: cfj.attention(q, k, v, causal=True).sum()))(q)
        want = reference.backward(
            np.ones(q.shape), *map(np.asarray, (q, k, v)), o_ref, lse_ref, causal=True
        )
        np.testing.assert_allclose(grads, want[0], rtol=1e-10, atol=1e-12)
    finally:
        jax.config.update("jax_enable_x64", previous)


def test_errors_under_jit_name_the_argument():
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    k = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="head dim 16 like q"):
        jax.jit(lambda q, k: cfj.attention(q, k[..., :8], k[..., :8]))(q, k)
    with pytest.raises(TypeError, match="k must have dtype float32"):
        jax.jit(lambda q, k: cfj.attention(q, k.astype(jnp.float16), k))(q, k)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        jax.jit(lambda q: cfj.attention(q, k, k, softcap=-1.0))(q)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        jax.jit(lambda q: cfj.attention(q, k, k, alibi_slopes=jnp.ones((3,), jnp.float32)))(q)
    with pytest.raises(TypeError, match="must be a JAX array"):
        cfj.attention([[1.0]], k, k)


def test_unsupported_transformations_name_the_alternative():
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="Use reverse mode instead: jax.vjp, jax.grad"):
        jax.jvp(lambda q: cfj.attention(q, q, q), (q,), (q,))
    with pytest.raises(TypeError, match="differentiable through o only"):
        jax.grad(lambda q: cfj.attention_forward(q, q, q)[1].sum())(q)
    with pytest.raises(TypeError, match="attention_backward is not differentiable"):
        lse = jnp.zeros((1, 2, 8), jnp.float32)
        jax.grad(lambda q: cfj.attention_backward(q, q, q, q, q, lse)[0].sum())(q)
    # attention_forward is differentiable through o, and agrees with attention
    g1 = jax.grad(
        lambda q: (
            jax.lax.stop_gradient(cfj.attention_forward(q, q, q)[1]).sum()
            + cfj.attention_forward(q, q, q)[0].sum()
        )
    )(q)
    g2 = jax.grad(lambda q: cfj.attention(q, q, q).sum())(q)
    assert_bitwise(g1, g2)


SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    import cuflash, cuflash.jax as cfj
    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("batch", "heads"))
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((4, 24, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((4, 30, 2, 16)), jnp.float32)
    spec = P("batch", None, "heads", None)

    def local(q, k):
        return cfj.attention(q, k, k, causal=True)

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    o = sharded(q, k)
    want = cuflash.attention(q, k, k, causal=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(want))
    grad = jax.jit(jax.grad(lambda q, k: sharded(q, k).sum(), argnums=(0, 1)))(q, k)
    o_e, lse_e = cuflash.attention_forward(q, k, k, causal=True)
    dq, dk, dv = cuflash.attention_backward(jnp.ones_like(o_e), q, k, k, o_e, lse_e, causal=True)
    np.testing.assert_array_equal(np.asarray(grad[0]), np.asarray(dq))
    np.testing.assert_allclose(np.asarray(grad[1]), np.asarray(dk + dv), rtol=1e-6, atol=1e-6)
    print("shard_map ok")
    """
)


def test_shard_map_over_batch_and_heads():
    """Four CPU devices (a fresh process: the device count is fixed when JAX starts)."""
    if not hasattr(jax, "shard_map"):
        pytest.skip("jax.shard_map is not in this JAX")
    assert "shard_map ok" in run_on_host_devices(SHARD_MAP_SCRIPT, timeout=300)
