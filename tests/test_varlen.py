"""Packed variable-length sequences on the CPU backend: each sequence's outputs and gradients are,
bit for bit, what the dense API gives for that sequence alone (the same NumPy computation per
sequence), across drawn sequence counts and lengths (0 and 1 included, Nq != Nk), dtypes, head
dims, grouped heads, masks and score modifiers; and the errors. GPU runs:
tests/gpu/test_varlen_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash

DTYPES = ["float32", "float64", "float16"]


def packed(rng, lengths, heads, d, dtype):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return rng.standard_normal((int(cu[-1]), heads, d)).astype(dtype), cu


@st.composite
def varlen_calls(draw):
    b = draw(st.integers(1, 16))
    lengths = st.one_of(st.integers(0, 2), st.integers(0, 40))
    lens_q = draw(st.lists(lengths, min_size=b, max_size=b))
    lens_k = draw(st.lists(lengths, min_size=b, max_size=b))
    hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 3, 8, 16, 33]))
    options = {
        "causal": draw(st.booleans()),
        "window": draw(st.one_of(st.none(), st.tuples(st.integers(-1, 20), st.integers(-1, 20)))),
        "softcap": draw(st.one_of(st.none(), st.floats(0.5, 50.0))),
        "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
    }
    alibi = draw(st.sampled_from([None, "heads", "batch"]))
    return lens_q, lens_k, hkv, group, d, options, alibi, draw(st.sampled_from(DTYPES))


@settings(max_examples=40)
@given(call=varlen_calls())
def test_each_sequence_equals_the_dense_api_alone(call):
    lens_q, lens_k, hkv, group, d, options, alibi, dtype = call
    rng = np.random.default_rng(0)
    hq = hkv * group
    q, cq = packed(rng, lens_q, hq, d, dtype)
    k, ck = packed(rng, lens_k, hkv, d, dtype)
    v = rng.standard_normal(k.shape).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    b = len(lens_q)
    slopes = {
        None: None,
        "heads": np.linspace(0.1, 1, hq, dtype=np.float32),
        "batch": rng.uniform(0.1, 1, (b, hq)).astype(np.float32),
    }[alibi]
    o, lse = cuflash.attention_varlen_forward(q, k, v, cq, ck, alibi_slopes=slopes, **options)
    assert o.shape == q.shape and lse.shape == (hq, q.shape[0])
    grads = cuflash.attention_varlen_backward(
        do, q, k, v, o, lse, cq, ck, alibi_slopes=slopes, **options
    )
    for i in range(b):
        sq, sk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        one = dict(options)
        if slopes is not None:
            one["alibi_slopes"] = slopes if slopes.ndim == 1 else slopes[i : i + 1]
        o_i, lse_i = cuflash.attention_forward(q[None, sq], k[None, sk], v[None, sk], **one)
        np.testing.assert_array_equal(o[sq], o_i[0])
        np.testing.assert_array_equal(lse[:, sq], lse_i[0])
        want = cuflash.attention_backward(
            do[None, sq], q[None, sq], k[None, sk], v[None, sk], o_i, lse_i, **one
        )
        np.testing.assert_array_equal(grads[0][sq], want[0][0])
        np.testing.assert_array_equal(grads[1][sk], want[1][0])
        np.testing.assert_array_equal(grads[2][sk], want[2][0])


def test_attention_varlen_and_max_seqlen():
    rng = np.random.default_rng(1)
    q, cq = packed(rng, [3, 5], 2, 8, np.float32)
    k, ck = packed(rng, [4, 6], 2, 8, np.float32)
    o = cuflash.attention_varlen(q, k, k, cq, ck, max_seqlen_q=5, max_seqlen_k=6)
    np.testing.assert_array_equal(o, cuflash.attention_varlen_forward(q, k, k, cq, ck)[0])
    # a larger bound is fine; a smaller one than the longest sequence is an error on the CPU
    cuflash.attention_varlen(q, k, k, cq, ck, max_seqlen_q=50, max_seqlen_k=60)
    with pytest.raises(ValueError, match="max_seqlen_q must be at least the longest"):
        cuflash.attention_varlen(q, k, k, cq, ck, max_seqlen_q=4, max_seqlen_k=6)


def test_errors_name_the_argument():
    rng = np.random.default_rng(2)
    q, cq = packed(rng, [3, 5], 2, 8, np.float32)
    k, ck = packed(rng, [4, 6], 2, 8, np.float32)
    cases = [
        (TypeError, "cu_seqlens_q must have dtype int32", dict(cu_seqlens_q=cq.astype(np.int64))),
        (ValueError, "cu_seqlens_k must have the length", dict(cu_seqlens_k=ck[:2])),
        (ValueError, "cu_seqlens_q must start at 0", dict(cu_seqlens_q=cq + 1)),
        (ValueError, "cu_seqlens_k must be non-decreasing", dict(cu_seqlens_k=ck[[0, 2, 1]])),
        (
            ValueError,
            r"cu_seqlens_q must end at the number of rows of q \(8\)",
            dict(cu_seqlens_q=np.array([0, 3, 7], np.int32)),
        ),
        (ValueError, "q must be a 3-D packed array", dict(q=q[None])),
        (ValueError, "k and v must have the same shape", dict(v=k[:, :1])),
        (TypeError, "max_seqlen_q must be an int", dict(max_seqlen_q=2.5)),
        (ValueError, "max_seqlen_k must be in", dict(max_seqlen_k=-1)),
        (TypeError, "check_seqlens must be a bool", dict(check_seqlens="yes")),
        (ValueError, "alibi_slopes must have shape", dict(alibi_slopes=np.ones(3, np.float32))),
        (ValueError, "cu_seqlens_q must be a 1-D array", dict(cu_seqlens_q=cq[None])),
    ]
    for exc, message, change in cases:
        args = dict(q=q, k=k, v=k, cu_seqlens_q=cq, cu_seqlens_k=ck)
        kwargs = {n: change.pop(n) for n in list(change) if n not in args}
        args.update(change)
        with pytest.raises(exc, match=message):
            cuflash.attention_varlen_forward(*args.values(), **kwargs)
    o, lse = cuflash.attention_varlen_forward(q, k, k, cq, ck)
    with pytest.raises(ValueError, match=r"lse must have shape \(Hq, Tq\)"):
        cuflash.attention_varlen_backward(o, q, k, k, o, lse.T, cq, ck)
    with pytest.raises(ValueError, match="do must have the shape of q"):
        cuflash.attention_varlen_backward(o[:2], q, k, k, o, lse, cq, ck)


def test_zero_sequences_and_empty_keys():
    q = np.ones((0, 2, 8), np.float32)
    cq = np.zeros(1, np.int32)
    o, lse = cuflash.attention_varlen_forward(q, q, q, cq, cq)
    assert o.shape == (0, 2, 8) and lse.shape == (2, 0)
    rng = np.random.default_rng(3)
    q, cq = packed(rng, [3, 2], 2, 8, np.float32)
    k = np.ones((0, 2, 8), np.float32)
    ck = np.zeros(3, np.int32)
    o, lse = cuflash.attention_varlen_forward(q, k, k, cq, ck)
    np.testing.assert_array_equal(o, 0)
    assert np.all(np.isneginf(lse))


def _example(rng):
    q, cq = packed(rng, [3, 0, 5], 4, 16, np.float32)
    k, ck = packed(rng, [4, 2, 6], 2, 16, np.float32)
    return q, k, rng.standard_normal(k.shape).astype(np.float32), cq, ck


def test_jax_varlen_under_jit_and_grad_equals_the_plain_api():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import cuflash.jax as cfj

    q, k, v, cq, ck = (jnp.asarray(x) for x in _example(np.random.default_rng(4)))
    opts = dict(causal=True, softcap=3.0)

    def loss(q, k, v):
        o = cfj.attention_varlen(q, k, v, cq, ck, max_seqlen_q=5, max_seqlen_k=6, **opts)
        return (o * o).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    o, lse = cuflash.attention_varlen_forward(q, k, v, cq, ck, **opts)
    want = cuflash.attention_varlen_backward(2 * o, q, k, v, o, lse, cq, ck, **opts)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    with pytest.raises(TypeError, match="needs max_seqlen_q and max_seqlen_k"):
        cfj.attention_varlen(q, k, v, cq, ck, max_seqlen_q=None, max_seqlen_k=6)


def test_torch_varlen_autograd_and_compile():
    torch = pytest.importorskip("torch")
    import cuflash.torch as cft

    q, k, v, cq, ck = (torch.from_numpy(x) for x in _example(np.random.default_rng(5)))
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    o = cft.attention_varlen(q, k, v, cq, ck, causal=True)
    o.square().sum().backward()
    o_ref, lse = cuflash.attention_varlen_forward(
        q.detach(), k.detach(), v.detach(), cq, ck, causal=True
    )
    want = cuflash.attention_varlen_backward(
        2 * o_ref, q.detach(), k.detach(), v.detach(), o_ref, lse, cq, ck, causal=True
    )
    for x, ref in zip((q, k, v), want, strict=True):
        assert torch.equal(x.grad, ref)
    compiled = torch.compile(
        lambda q: cft.attention_varlen(
            q, k, v, cq, ck, max_seqlen_q=5, max_seqlen_k=6, causal=True
        ),
        fullgraph=True,
    )
    assert torch.equal(compiled(q), o)
