"""The framework integrations on the GPU: torch autograd, torch.compile, CUDA graphs, streams and
devices; jax.grad (jit, vmap and the rest: tests/gpu/test_jax_gpu.py); CuPy streams and devices;
the SDPA drop-in in a training loop."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash import reference, testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
import cuflash.torch as cft  # noqa: E402


def rand(*shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


def naive_bhsd64(q, k, v, causal, scale):
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    mask = torch.from_numpy(reference.visible_mask(q.shape[2], k.shape[2], causal)).cuda()
    p = torch.softmax(s.masked_fill(~mask, -float("inf")), -1).nan_to_num(0.0)  # rows seeing no key
    return p @ v


# ---------------------------------------------------------------------------------------------
# PyTorch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_autograd_gradients(dtype):
    q = rand(2, 8, 300, 64, dtype=dtype, seed=1).requires_grad_()
    k = rand(2, 2, 400, 64, dtype=dtype, seed=2).requires_grad_()
    v = rand(2, 2, 400, 64, dtype=dtype, seed=3).requires_grad_()
    do = rand(2, 8, 300, 64, dtype=dtype, seed=4)
    o = cft.attention(q, k, v, causal=True, layout="bhsd")
    o.backward(do)
    # autograd runs exactly the plain API's kernels
    o2, lse = cuflash.attention_forward(
        q.detach(), k.detach(), v.detach(), causal=True, layout="bhsd"
    )
    grads = cuflash.attention_backward(
        do, q.detach(), k.detach(), v.detach(), o2, lse, causal=True, layout="bhsd"
    )
    assert torch.equal(o, o2)
    for got, want in zip((q.grad, k.grad, v.grad), grads, strict=True):
        assert torch.equal(got, want)
    # and they are gradients of attention: compare with float64 autograd of naive attention
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    naive_bhsd64(q64, k64, v64, True, 0.125).backward(do.double())
    kw = dict(causal=True, scale=0.125, xp=cupy)
    qc, kc, vc, doc = (cupy.from_dlpack(x.detach().double()) for x in (q, k, v, do))
    oc, lsec = cupy.from_dlpack(o.detach().double()), cupy.from_dlpack(lse.double())
    low = testing.naive_backward(doc, qc, kc, vc, oc, lsec, dtype=str(dtype)[6:], **kw)
    for name, got, ref, naive in zip(
        "q k v".split(), (q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad), low, strict=True
    ):
        check = testing.compare(
            "d" + name,
            cupy.from_dlpack(got.double()),
            cupy.from_dlpack(ref),
            naive,
            str(dtype)[6:],
            cupy,
        )
        assert check.passed, check.message


def test_torch_compile_fullgraph_equals_eager():
    torch._dynamo.reset()

    def block(x, wq, wk, wv):
        q = (x @ wq).unflatten(-1, (8, 64))
        k = (x @ wk).unflatten(-1, (2, 64))
        v = (x @ wv).unflatten(-1, (2, 64))
        return (cft.attention(q, k, v, causal=True).flatten(-2) * 0.5).float()

    x = rand(2, 256, 512, seed=5)
    ws = [(rand(512, n, seed=6 + i) * 0.05).requires_grad_() for i, n in enumerate((512, 128, 128))]
    eager = block(x, *ws)
    compiled = torch.compile(block, fullgraph=True)(x, *ws)
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    g_eager = torch.autograd.grad(eager.sum(), ws)
    g_comp = torch.autograd.grad(compiled.sum(), ws)
    for a, b in zip(g_comp, g_eager, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_cuda_graph_capture_and_replay():
    q, k, v, do = (rand(2, 4, 333, 128, seed=s) for s in (7, 8, 9, 10))
    static = [x.clone() for x in (q, k, v, do)]

    def step(q, k, v, do):
        o, lse = cuflash.attention_forward(q, k, v, causal=True, layout="bhsd")
        return (o, *cuflash.attention_backward(do, q, k, v, o, lse, causal=True, layout="bhsd"))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels and builds the plans
        step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*static)
    for s, x in zip(static, (rand(2, 4, 333, 128, seed=s) for s in (11, 12, 13, 14)), strict=True):
        s.copy_(x)
    graph.replay()
    want = step(*static)
    torch.cuda.synchronize()
    for got, w in zip(outs, want, strict=True):
        assert torch.equal(got, w)


def test_torch_side_stream_ordering():
    q = rand(4, 8, 1024, 64, seed=15)
    want = cft.attention(q, q, q, causal=True, layout="bhsd")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = q * 1.0  # produced on the side stream, consumed there by the kernel
        got = cft.attention(x, x, x, causal=True, layout="bhsd") + 0
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)


def test_torch_non_default_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU on this machine: no non-default device to test")
    q = rand(1, 2, 100, 64).to("cuda:1")
    o = cuflash.attention(q, q, q, layout="bhsd")
    assert o.device == q.device
    torch.testing.assert_close(
        o.to("cuda:0"),
        cuflash.attention(q.to("cuda:0"), q.to("cuda:0"), q.to("cuda:0"), layout="bhsd"),
    )


def test_sdpa_drop_in_trains_like_sdpa():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from train_transformer_block import train

    sdpa = train(torch.nn.functional.scaled_dot_product_attention, steps=15)
    ours = train(cft.scaled_dot_product_attention, steps=15)
    assert ours[-1] < ours[0] * 0.9, ours  # it learns
    gaps = [abs(a - b) / a for a, b in zip(sdpa, ours, strict=True)]
    assert max(gaps) < 2e-2, (sdpa, ours)


# ---------------------------------------------------------------------------------------------
# JAX


def test_jax_grad_on_the_gpu():
    jax = pytest.importorskip("jax")
    import cuflash.jax as cfj

    jnp = jax.numpy
    q = jax.dlpack.from_dlpack(rand(2, 200, 4, 64, dtype=torch.float32, seed=16))
    k = jax.dlpack.from_dlpack(rand(2, 150, 2, 64, dtype=torch.float32, seed=17))
    v = jax.dlpack.from_dlpack(rand(2, 150, 2, 64, dtype=torch.float32, seed=18))
    w = jax.dlpack.from_dlpack(rand(2, 200, 4, 64, dtype=torch.float32, seed=19))
    assert q.devices().pop().platform == "gpu"
    grads = jax.grad(
        lambda q, k, v: (cfj.attention(q, k, v, causal=True) * w).sum(), argnums=(0, 1, 2)
    )(q, k, v)
    o, lse = cuflash.attention_forward(q, k, v, causal=True)
    want = cuflash.attention_backward(w, q, k, v, o, lse, causal=True)
    for g, x in zip(grads, want, strict=True):
        assert isinstance(g, jax.Array) and g.devices().pop().platform == "gpu"
        np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
    # float32 runs the exact path: the gradients are float64-accurate
    qt, kt, vt = (torch.from_dlpack(x).double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    naive_bhsd64(qt, kt, vt, True, 0.125).backward(torch.from_dlpack(w).double().transpose(1, 2))
    for g, ref in zip(grads, (qt.grad, kt.grad, vt.grad), strict=True):
        ref = ref.transpose(1, 2).cpu().numpy()
        assert np.linalg.norm(np.asarray(g) - ref) / np.linalg.norm(ref) < 1e-6
    jitted = jax.jit(
        jax.grad(lambda q, k, v: (cfj.attention(q, k, v, causal=True) * w).sum(), argnums=(0, 1))
    )(q, k, v)
    for g, x in zip(jitted, grads, strict=False):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
    assert jnp.isfinite(grads[0]).all()


# ---------------------------------------------------------------------------------------------
# CuPy


def test_cupy_runs_on_the_current_stream():
    q = cupy.asarray(np.random.default_rng(20).standard_normal((2, 512, 4, 64)), cupy.float16)
    want = cuflash.attention(q, q, q, causal=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = q * 1  # enqueued on `stream`; the kernel must run after it, on the same stream
        got = cuflash.attention(x, x, x, causal=True) + 0
    stream.synchronize()
    assert bool((got == want).all())


def test_cupy_device_index():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU on this machine: no second cupy.cuda.Device to test")
    with cupy.cuda.Device(1):
        q = cupy.asarray(np.random.default_rng(21).standard_normal((1, 64, 2, 32)), cupy.float16)
        o = cuflash.attention(q, q, q)
        assert o.device.id == 1
