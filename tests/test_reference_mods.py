"""The reference's softcap and ALiBi on their own terms: the backward against finite differences
(the tanh's derivative), the naive against the blockwise form, the limits that must give dense
attention back, and the naive same-precision computation of the test policy at float64."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash import reference, testing

RNG = np.random.default_rng(7)


def _inputs(b=1, nq=5, nk=7, hq=2, hkv=1, d=3):
    q = RNG.standard_normal((b, nq, hq, d))
    k = RNG.standard_normal((b, nk, hkv, d))
    v = RNG.standard_normal((b, nk, hkv, d))
    return q, k, v


@pytest.mark.parametrize(
    "options",
    [
        dict(softcap=0.8),
        dict(alibi_slopes=np.array([0.3, 0.9])),
        dict(softcap=2.0, alibi_slopes=np.array([[0.5, 0.1]]), window=(2, 1)),
        dict(softcap=1.5, causal=True),
    ],
)
def test_backward_matches_finite_differences(options):
    q, k, v = _inputs()
    do = RNG.standard_normal(q.shape)
    o, lse = reference.forward(q, k, v, scale=1.3, **options)
    grads = reference.backward(do, q, k, v, o, lse, scale=1.3, **options)

    def loss(qx, kx, vx):
        return float((reference.forward(qx, kx, vx, scale=1.3, **options)[0] * do).sum())

    eps = 1e-6
    for index, (x, g) in enumerate(zip((q, k, v), grads, strict=True)):
        numeric = np.zeros_like(x)
        for pos in np.ndindex(x.shape):
            args = [q, k, v]
            plus, minus = x.copy(), x.copy()
            plus[pos] += eps
            minus[pos] -= eps
            args[index] = plus
            f_plus = loss(*args)
            args[index] = minus
            numeric[pos] = (f_plus - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("block", [(1, 1), (3, 4), (16, 16)])
def test_blockwise_matches_naive(block):
    q, k, v = _inputs(b=2, nq=19, nk=13, hq=4, hkv=2, d=5)
    do = RNG.standard_normal(q.shape)
    options = dict(
        softcap=3.0, alibi_slopes=RNG.uniform(0, 1, (2, 4)), window=(4, 0), scale=0.9
    )  # Nq > Nk with a window: some rows see no key
    o, lse = reference.forward(q, k, v, **options)
    assert np.isneginf(lse).any() and np.isfinite(lse).any()
    ob, lseb = reference.forward_blockwise(q, k, v, block_m=block[0], block_n=block[1], **options)
    np.testing.assert_allclose(ob, o, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lseb), np.isneginf(lse))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(lseb[finite], lse[finite], rtol=1e-12)
    naive = reference.backward(do, q, k, v, o, lse, **options)
    blocks = reference.backward_blockwise(
        do, q, k, v, o, lse, block_m=block[0], block_n=block[1], **options
    )
    for a, b in zip(blocks, naive, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_neutral_modifiers_give_dense_attention_back():
    q, k, v = _inputs(b=2, nq=9, nk=11, hq=2, hkv=2, d=4)
    dense = reference.forward(q, k, v, causal=True)
    zero_slopes = reference.forward(q, k, v, causal=True, alibi_slopes=np.zeros(2))
    np.testing.assert_array_equal(zero_slopes[0], dense[0])
    huge_cap = reference.forward(q, k, v, causal=True, softcap=1e9)
    np.testing.assert_allclose(huge_cap[0], dense[0], rtol=1e-12, atol=1e-14)


def test_softcap_bounds_the_scores_and_alibi_is_a_distance():
    q, k, _ = _inputs(nq=6, nk=8)
    s, _ = reference.scores_and_probabilities(q * 100, k, softcap=2.0)
    assert np.all(np.abs(s) <= 2.0)
    # ALiBi alone: S - S_dense = -slope |i + Nk - Nq - j|
    s_dense, _ = reference.scores_and_probabilities(q, k)
    s_alibi, _ = reference.scores_and_probabilities(q, k, alibi_slopes=np.array([0.5, 2.0]))
    i, j = np.arange(6)[:, None] + 2, np.arange(8)[None, :]
    for h, slope in enumerate((0.5, 2.0)):
        np.testing.assert_allclose(s_alibi[0, h] - s_dense[0, h], -slope * np.abs(i - j))


def test_nan_outside_the_window_stays_outside():
    q, k, v = _inputs(nq=12, nk=12, hq=1, hkv=1, d=3)
    k[0, 3, 0, 1] = np.nan
    o, lse = reference.forward(q, k, v, window=(2, 0), softcap=4.0, alibi_slopes=np.ones(1))
    sees = (np.arange(12) >= 3) & (np.arange(12) <= 5)
    assert np.all(np.isnan(o[0, sees, 0])) and np.all(np.isfinite(o[0, ~sees, 0]))


def test_naive_same_precision_at_float64_is_the_reference():
    q, k, v = _inputs(b=2, nq=10, nk=14, hq=4, hkv=2, d=6)
    do = RNG.standard_normal(q.shape)
    slopes = RNG.uniform(0, 1, (2, 4))
    options = dict(window=(5, 2), softcap=1.7)
    o, lse = reference.forward(q, k, v, scale=0.7, alibi_slopes=slopes, **options)
    grads = reference.backward(do, q, k, v, o, lse, scale=0.7, alibi_slopes=slopes, **options)

    def bhsd(x):
        return x.transpose(0, 2, 1, 3)

    kw = dict(causal=False, scale=0.7, dtype="float64", alibi_slopes=slopes, **options)
    o_n, lse_n = testing.naive_forward(bhsd(q), bhsd(k), bhsd(v), **kw)
    np.testing.assert_allclose(o_n, bhsd(o), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse_n, lse, rtol=1e-12)
    grads_n = testing.naive_backward(bhsd(do), bhsd(q), bhsd(k), bhsd(v), bhsd(o), lse, **kw)
    for a, b in zip(grads_n, grads, strict=True):
        np.testing.assert_allclose(a, bhsd(b), rtol=1e-10, atol=1e-12)
