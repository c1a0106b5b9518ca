"""cuflash.jax on the GPU under jit, grad, vmap and loops: the kernels run on XLA's stream into
XLA's buffers. The eager API on the same JAX arrays runs the same kernel instances through CuPy
(checked against the float64 reference by the rest of the GPU suite), so jitted results must
equal eager ones bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
jax = pytest.importorskip("jax")
if not any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("GPU test: JAX has no CUDA backend here", allow_module_level=True)
import jax.numpy as jnp  # noqa: E402
from strategies import attention_problems, make_inputs  # noqa: E402

import cuflash.jax as cfj  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def assert_bitwise(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    view = np.uint16 if got.dtype.itemsize == 2 else np.uint32
    np.testing.assert_array_equal(got.view(view), want.view(view))


def inputs(problem, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(x, DTYPES[dtype]) for x in make_inputs(problem, rng, np.float32)]


@st.composite
def score_mods(draw, heads_q, batch):
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, 300), st.integers(-1, 300))))
    softcap = draw(st.one_of(st.none(), st.floats(0.5, 50.0)))
    slopes = draw(st.sampled_from([None, (heads_q,), (batch, heads_q)]))
    if slopes is not None:
        slopes = jnp.asarray(np.random.default_rng(1).uniform(0.01, 1.0, slopes), jnp.float32)
    return {"window": window, "softcap": softcap, "alibi_slopes": slopes}


@settings(max_examples=60)
@given(problem=attention_problems(max_n=400, max_elements=20_000_000), data=st.data())
def test_jit_forward_and_gradients_equal_eager_bitwise(problem, data):
    dtype = data.draw(st.sampled_from(sorted(DTYPES)))
    kwargs = dict(problem.kwargs, **data.draw(score_mods(problem.Hq, problem.B)))
    q, k, v, do = inputs(problem, dtype)
    o, lse = jax.jit(lambda q, k, v: cfj.attention_forward(q, k, v, **kwargs))(q, k, v)
    o_eager, lse_eager = cuflash.attention_forward(q, k, v, **kwargs)
    assert o.devices().pop().platform == "gpu"
    assert_bitwise(o, o_eager)
    assert_bitwise(lse, lse_eager)
    _, pullback = jax.vjp(jax.jit(lambda q, k, v: cfj.attention(q, k, v, **kwargs)), q, k, v)
    grads = jax.jit(pullback)(do)
    want = cuflash.attention_backward(do, q, k, v, o_eager, lse_eager, **kwargs)
    for got, ref in zip(grads, want, strict=True):
        assert_bitwise(got, ref)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_vmap_is_one_call_with_a_larger_batch(layout):
    rng = np.random.default_rng(3)
    shape_q = (2, 300, 8, 64) if layout == "bshd" else (2, 8, 300, 64)
    shape_k = (2, 250, 2, 64) if layout == "bshd" else (2, 2, 250, 64)
    qs = jnp.asarray(rng.standard_normal((3, *shape_q)), jnp.bfloat16)
    ks = jnp.asarray(rng.standard_normal((3, *shape_k)), jnp.bfloat16)
    f = lambda q, k: cfj.attention_forward(q, k, k, causal=True, layout=layout)  # noqa: E731
    o, lse = jax.jit(jax.vmap(f))(qs, ks)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    o_flat, lse_flat = cuflash.attention_forward(
        flat(qs), flat(ks), flat(ks), causal=True, layout=layout
    )
    assert_bitwise(o, o_flat.reshape(o.shape))
    assert_bitwise(lse, lse_flat.reshape(lse.shape))
    grads = jax.jit(jax.vmap(jax.grad(lambda q, k: f(q, k)[0].astype(jnp.float32).sum())))(qs, ks)
    want = cuflash.attention_backward(
        jnp.ones_like(o_flat),
        flat(qs),
        flat(ks),
        flat(ks),
        o_flat,
        lse_flat,
        causal=True,
        layout=layout,
    )
    assert_bitwise(grads, want[0].reshape(grads.shape))


def test_a_jitted_loop_orders_the_launches_on_xlas_stream():
    """Each step reads the previous step's output: any launch on the wrong stream, or before its
    inputs are written, changes the result."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 1024, 4, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 1024, 4, 128)), jnp.bfloat16)

    def step(i, q):
        return (cfj.attention(q, k, k, causal=True) * 4).astype(q.dtype) + q

    looped = jax.jit(lambda q: jax.lax.fori_loop(0, 30, step, q))(q)
    eager = q
    for _ in range(30):
        o = cuflash.attention(eager, k, k, causal=True)
        eager = jax.jit(lambda o, q: (o * 4).astype(q.dtype) + q)(o, eager)
    assert_bitwise(looped, eager)


def test_checkpointed_training_gradients_match_the_float64_reference():
    """float32 runs the exact path: jitted, checkpointed gradients are float64-accurate."""
    rng = np.random.default_rng(5)
    q, k, v, w = (rng.standard_normal(s) for s in [(2, 200, 4, 64), (2, 150, 2, 64)] * 2)
    v, w = w, v
    q32, k32, v32, w32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v, w))

    def loss(q, k, v):
        block = jax.checkpoint(lambda q, k, v: cfj.attention(q, k, v, causal=True))
        return (block(q, k, v) * w32).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q32, k32, v32)
    from cuflash import reference

    x64 = [np.asarray(x, np.float64) for x in (q32, k32, v32, w32)]
    o_ref, lse_ref = reference.forward(*x64[:3], causal=True)
    want = reference.backward(x64[3], *x64[:3], o_ref, lse_ref, causal=True)
    for g, ref in zip(grads, want, strict=True):
        assert np.linalg.norm(np.asarray(g, np.float64) - ref) / np.linalg.norm(ref) < 1e-6


GRAPH_SCRIPT = """
import numpy as np, jax, jax.numpy as jnp
import cuflash, cuflash.jax as cfj

runs = []
for cls in (cfj._ForwardCall, cfj._BackwardCall):
    def counted(self, *args, _call=cls.__call__):
        runs.append(type(self).__name__)
        return _call(self, *args)
    cls.__call__ = counted

rng = np.random.default_rng(6)
k = jnp.asarray(rng.standard_normal((2, 700, 2, 128)), jnp.bfloat16)

def step(i, q):
    return (cfj.attention(q, k, k, causal=True) * 2).astype(q.dtype) + q

loop = jax.jit(lambda q: jax.lax.fori_loop(0, 25, step, q))
grad = jax.jit(jax.grad(lambda q: cfj.attention(q, k, k).astype(jnp.float32).sum()))
for seed in range(4):  # new inputs, new buffers: XLA must capture again or replay correctly
    q = jnp.asarray(np.random.default_rng(seed).standard_normal((2, 500, 4, 128)), jnp.bfloat16)
    got, got_grad = loop(q), grad(q)
    want = q
    for _ in range(25):
        want = jax.jit(lambda o, q: (o * 2).astype(q.dtype) + q)(
            cuflash.attention(want, k, k, causal=True), want
        )
    o, lse = cuflash.attention_forward(q, k, k)
    want_grad = cuflash.attention_backward(jnp.ones_like(o), q, k, k, o, lse)[0]
    for a, b in ((got, want), (got_grad, want_grad)):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
# eager cuflash calls above run outside XLA; the jitted ones' callbacks ran only when captured
print("callbacks", len(runs))
"""


def test_command_buffers_record_the_launches_and_replay_them_correctly():
    """With XLA_FLAGS that put custom calls into CUDA graphs (set before the backend starts, so
    in a fresh process, where the very first callback runs under stream capture), the jitted
    loop's 25 calls and the gradient's calls run Python only while XLA captures, and every
    replay on new inputs gives the eager bits."""
    import os
    import subprocess
    import sys

    flags = (
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
        "--xla_gpu_graph_min_graph_size=1"
    )
    env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    root = os.path.dirname(os.path.dirname(os.path.abspath(cuflash.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", GRAPH_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = int(result.stdout.split("callbacks")[-1])
    # without capture: 4 x (25 forward calls + a forward and a backward) = 108 callbacks
    assert runs < 40, result.stdout
