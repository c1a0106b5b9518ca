"""cuflash.torch on CPU tensors (the NumPy backend): autograd, the custom operators,
torch.compile without graph breaks, and the SDPA drop-in. GPU runs: tests/gpu/test_frameworks.py."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash import reference

torch = pytest.importorskip("torch")
cft = pytest.importorskip("cuflash.torch")


def naive_bshd(q, k, v, causal, scale):
    """float64 attention written with torch ops, autograd-able (the oracle)."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, 1)
    vh = v.transpose(1, 2).repeat_interleave(group, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    mask = torch.from_numpy(reference.visible_mask(q.shape[1], k.shape[1], causal))
    s = s.masked_fill(~mask, -float("inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see no key: 0
    return (p @ vh).transpose(1, 2)


def inputs(nq=37, nk=45, hq=4, hkv=2, d=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(2, n, h, d, generator=gen, dtype=dtype).requires_grad_()
        for n, h in ((nq, hq), (nk, hkv), (nk, hkv))
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(37, 45), (50, 20)])
def test_gradients_equal_autograd_of_naive_attention(causal, nq, nk):
    q, k, v = inputs(nq, nk)
    out = cft.attention(q, k, v, causal=causal, scale=0.3)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = naive_bshd(q2, k2, v2, causal, 0.3)
    (ref * weights).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_custom_operators_pass_opcheck():
    q, k, v = inputs()
    # options: alibi_slopes, causal, window_left, window_right, softcap, scale, layout
    slopes = torch.rand(q.shape[2], device=q.device)
    for options in (
        (None, True, -1, -1, 0.0, 0.25, "bshd"),
        (slopes, False, 5, 2, 3.0, 0.3, "bshd"),
    ):
        torch.library.opcheck(torch.ops.cuflash.attention_forward.default, (q, k, v, *options))
        o, lse = torch.ops.cuflash.attention_forward(q.detach(), k.detach(), v.detach(), *options)
        do = torch.randn_like(o)
        args = (do, q.detach(), k.detach(), v.detach(), o, lse, *options)
        torch.library.opcheck(torch.ops.cuflash.attention_backward.default, args)


def test_lse_is_not_differentiable():
    q, k, v = inputs()
    o, lse = cft.attention_forward(q, k, v)
    assert o.requires_grad and not lse.requires_grad


def test_compiles_without_graph_breaks():
    q, k, v = inputs()

    def loss(q, k, v):
        return (cft.attention(q, k, v, causal=True) ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    want = loss(q, k, v)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got, (q, k, v))
    want_grads = torch.autograd.grad(want, (q, k, v))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_sdpa_drop_in_matches_sdpa():
    F = torch.nn.functional
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 40, 32, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 40, 32, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 40, 32, generator=gen, requires_grad=True)
    ours = cft.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    three_d = cft.scaled_dot_product_attention(
        q[0], k[0].repeat_interleave(4, 0), v[0].repeat_interleave(4, 0), scale=0.1
    )
    torch.testing.assert_close(
        three_d,
        F.scaled_dot_product_attention(
            q[0], k[0].repeat_interleave(4, 0), v[0].repeat_interleave(4, 0), scale=0.1
        ),
        rtol=1e-5,
        atol=1e-6,
    )


def test_sdpa_drop_in_refuses_what_it_cannot_do():
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 2, 12, 16)
    with pytest.raises(ValueError, match="attn_mask is not supported"):
        cft.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p must be 0.0"):
        cft.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="top-left"):
        cft.scaled_dot_product_attention(q, k, k, is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        cft.scaled_dot_product_attention(q, k[:, :1], k[:, :1])
    # what the drop-in can do: non-causal with Nq != Nk equals SDPA
    got = cft.scaled_dot_product_attention(q, k, k)
    np.testing.assert_allclose(
        got.numpy(),
        torch.nn.functional.scaled_dot_product_attention(q, k, k).numpy(),
        rtol=1e-5,
        atol=1e-6,
    )
