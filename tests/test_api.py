"""The public API on CPU arrays: results equal the float64 reference, come back as the caller's
array type, and every kind of bad input raises a clear TypeError / ValueError."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cuflash
from cuflash import reference

RNG = np.random.default_rng()


def randn(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def assert_rounded_from(got, exact):
    """got is `exact` (float64) rounded to got's dtype: within one unit in the last place, plus
    float64 summation-order noise (the backend runs the blockwise form, `exact` the naive one)."""
    ulp = {np.float16: 2.0**-10, np.float32: 2.0**-23, np.float64: 0.0}[got.dtype.type]
    err = np.abs(got.astype(np.float64) - exact)
    tiny = np.finfo(got.dtype).smallest_subnormal  # the spacing of subnormals
    bound = ulp * np.abs(exact) + tiny + 2.0**-44 * np.abs(exact).max()
    assert np.all(err <= bound), np.max(err - bound)


def qkv(b=2, nq=37, nk=45, hq=4, hkv=2, d=24, dtype=np.float32, layout="bshd"):
    if layout == "bshd":
        return (
            randn(b, nq, hq, d, dtype=dtype),
            randn(b, nk, hkv, d, dtype=dtype),
            randn(b, nk, hkv, d, dtype=dtype),
        )
    return (
        randn(b, hq, nq, d, dtype=dtype),
        randn(b, hkv, nk, d, dtype=dtype),
        randn(b, hkv, nk, d, dtype=dtype),
    )


# ---------------------------------------------------------------------------------------------
# Results


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_forward_and_backward_match_reference(layout, causal, dtype):
    q, k, v = qkv(dtype=dtype, layout=layout)
    o, lse = cuflash.attention_forward(q, k, v, causal=causal, layout=layout, scale=0.3)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal, scale=0.3, layout=layout)
    assert isinstance(o, np.ndarray) and o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert lse.shape == (2, 4, 37)
    # The CPU backend is the float64 (blockwise) reference rounded once to the output dtype.
    assert_rounded_from(o, o_ref)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-6 if dtype != np.float64 else 1e-12)

    do = randn(*q.shape, dtype=dtype)
    dq, dk, dv = cuflash.attention_backward(
        do, q, k, v, o, lse, causal=causal, scale=0.3, layout=layout
    )
    ref = reference.backward(do, q, k, v, o, lse, causal=causal, scale=0.3, layout=layout)
    for got, want, like in zip((dq, dk, dv), ref, (q, k, v), strict=False):
        assert got.dtype == dtype and got.shape == like.shape
        tol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[dtype]
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_attention_returns_forward_output():
    q, k, v = qkv()
    np.testing.assert_array_equal(
        cuflash.attention(q, k, v, causal=True), cuflash.attention_forward(q, k, v, causal=True)[0]
    )


def test_two_d_input_is_one_head():
    q, k, v = randn(10, 16), randn(7, 16), randn(7, 16)
    o, lse = cuflash.attention_forward(q, k, v, causal=True)
    assert o.shape == (10, 16) and lse.shape == (10,)
    o4, lse4 = cuflash.attention_forward(
        q[None, :, None], k[None, :, None], v[None, :, None], causal=True
    )
    np.testing.assert_array_equal(o, o4[0, :, 0])
    np.testing.assert_array_equal(lse, lse4[0, 0])
    # causal with Nq > Nk: the first Nq - Nk rows see no key
    assert np.all(o[:3] == 0) and np.all(np.isneginf(lse[:3])) and np.all(np.isfinite(lse[3:]))
    dq, dk, dv = cuflash.attention_backward(randn(10, 16), q, k, v, o, lse, causal=True)
    assert np.all(dq[:3] == 0) and np.all(np.isfinite(dq)) and dk.shape == (7, 16)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = qkv(d=25)
    np.testing.assert_array_equal(cuflash.attention(q, k, v), cuflash.attention(q, k, v, scale=0.2))


def test_strided_views_are_read_in_place():
    base = randn(2, 50, 6, 32)
    q = base[:, ::2, 1:5]  # strided in N and H, last dim contiguous
    k, v = base[:, 3:40, 4:6], base[:, 10:47, 0:2]
    o, _ = cuflash.attention_forward(q, k, v)
    o_ref, _ = reference.forward(
        np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
    )
    assert_rounded_from(o, o_ref)


def test_bfloat16_numpy_round_trip():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in qkv())
    o, lse = cuflash.attention_forward(q, k, v, causal=True)
    assert o.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32
    o_ref, _ = reference.forward(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True
    )
    # rounded once to bfloat16 (8 bits of mantissa): within half an ulp
    np.testing.assert_allclose(o.astype(np.float64), o_ref, rtol=2**-8, atol=1e-30)
    dq, dk, dv = cuflash.attention_backward(q, q, k, v, o, lse, causal=True)
    assert dq.dtype == dk.dtype == dv.dtype == ml_dtypes.bfloat16


def test_zero_size_dimensions():
    q, k, v = qkv(b=0)
    o, lse = cuflash.attention_forward(q, k, v)
    assert o.shape == q.shape and lse.shape == (0, 4, 37)
    q, k, v = qkv(nk=0)
    o, lse = cuflash.attention_forward(q, k, v)
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    dq, dk, dv = cuflash.attention_backward(q, q, k, v, o, lse)
    assert np.all(dq == 0) and dk.shape == k.shape
    q, k, v = qkv(nq=0)
    o, lse = cuflash.attention_forward(q, k, v, causal=True)
    assert o.shape == q.shape and lse.shape == (2, 4, 0)


def test_torch_cpu_tensors_come_back_as_torch():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in qkv(layout="bhsd"))
    q.requires_grad_(True)  # the plain API works on tensors that require grad (no autograd)
    o, lse = cuflash.attention_forward(q, k, v, causal=True, layout="bhsd")
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    o_ref, _ = reference.forward(
        q.detach().numpy(), k.numpy(), v.numpy(), causal=True, layout="bhsd"
    )
    assert_rounded_from(o.numpy(), o_ref)
    qb, kb, vb = (x.detach().to(torch.bfloat16) for x in (q, k, v))
    ob, lseb = cuflash.attention_forward(qb, kb, vb, layout="bhsd")
    assert ob.dtype == torch.bfloat16 and lseb.dtype == torch.float32
    o_ref, _ = reference.forward(*(x.float().numpy() for x in (qb, kb, vb)), layout="bhsd")
    np.testing.assert_allclose(ob.float().numpy(), o_ref, rtol=2**-8, atol=1e-30)


def test_jax_cpu_arrays_come_back_as_jax():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    qn, kn, vn = qkv()
    q, k, v = (jnp.asarray(x) for x in (qn, kn, vn))
    o, lse = cuflash.attention_forward(q, k, v, causal=True)
    assert isinstance(o, jax.Array) and isinstance(lse, jax.Array)
    o_ref, _ = reference.forward(qn, kn, vn, causal=True)
    assert_rounded_from(np.asarray(o), o_ref)
    ob = cuflash.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert ob.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# Errors: each names the argument, what was expected and what came.


def raises(exc, *words):
    return pytest.raises(exc, match=".*".join(re.escape(w) for w in words))


class FakeDLPack:
    """A foreign DLPack producer wrapping a NumPy array, optionally claiming another device."""

    def __init__(self, array, device=None):
        self.array, self.device = array, device

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.device or self.array.__dlpack_device__()


def test_error_not_an_array():
    q, k, v = qkv()
    with raises(TypeError, "q must be an array that supports DLPack", "list"):
        cuflash.attention(q.tolist(), k, v)
    with raises(TypeError, "v must be an array that supports DLPack", "str"):
        cuflash.attention(q, k, "v")


def test_foreign_dlpack_producer_is_accepted():
    q, k, v = qkv()
    o = cuflash.attention(FakeDLPack(q), FakeDLPack(k), FakeDLPack(v))
    np.testing.assert_array_equal(o, cuflash.attention(q, k, v))


def test_error_wrong_number_of_dimensions():
    q, k, v = qkv()
    with raises(ValueError, "q must be a 4-D array (B, N, Hq, d)", "got shape (2, 37, 4)"):
        cuflash.attention(q[..., 0], k, v)
    with raises(ValueError, "k must be 4-D like q", "got shape (45, 24)"):
        cuflash.attention(q, k[0, :, 0], v)


def test_error_shapes_disagree():
    q, k, v = qkv()
    with raises(ValueError, "batch size 2", "(1, 45, 2, 24)"):
        cuflash.attention(q, k[:1], v[:1])
    with raises(ValueError, "head dim 24", "(2, 45, 2, 20)"):
        cuflash.attention(q, k[..., :20], v[..., :20])
    with raises(ValueError, "k and v must have the same shape", "(2, 45, 2, 24)", "(2, 44, 2, 24)"):
        cuflash.attention(q, k, v[:, :44])
    with raises(ValueError, "query heads (4) must be a multiple", "key/value heads (3)"):
        cuflash.attention(q, *qkv(hkv=3)[1:])


def test_error_dtypes():
    q, k, v = qkv()
    with raises(TypeError, "q has dtype int32", "float16, bfloat16, float32 and float64"):
        cuflash.attention(q.astype(np.int32), k, v)
    with raises(TypeError, "q has dtype complex64"):
        cuflash.attention(q.astype(np.complex64), k, v)
    with raises(TypeError, "k must have dtype float32 (like q)", "float64"):
        cuflash.attention(q, k.astype(np.float64), v)


def test_error_devices_and_libraries():
    q, k, v = qkv()
    on_gpu = FakeDLPack(k, device=(2, 0))  # claims to live on cuda:0
    with raises(ValueError, "k is on cuda:0 but q is on cpu", "one device"):
        cuflash.attention(FakeDLPack(q), on_gpu, FakeDLPack(v))
    with raises(TypeError, "k is a dlpack array but q is a numpy array", "one library"):
        cuflash.attention(q, FakeDLPack(k), v)
    with raises(ValueError, "unsupported device (DLPack device type 4)"):
        cuflash.attention(FakeDLPack(q, device=(4, 0)), k, v)


def test_error_head_dim_limits():
    q, k, v = qkv(d=24)
    with raises(ValueError, "at least 1", "(2, 37, 4, 0)"):
        cuflash.attention(q[..., :0], k[..., :0], v[..., :0])
    q, k, v = qkv(d=257)
    with raises(ValueError, "at most 256", "got 257"):
        cuflash.attention(q, k, v)


def test_error_last_dimension_not_contiguous():
    q, k, v = qkv()
    with raises(ValueError, "q must have a contiguous last dimension (stride 1)", "strides"):
        cuflash.attention(np.asfortranarray(q), k, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_error_bad_scale_value(scale):
    with raises(ValueError, "scale must be a finite number > 0", repr(float(scale))):
        cuflash.attention(*qkv(), scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, [0.1], 1j])
def test_error_bad_scale_type(scale):
    with raises(TypeError, "scale must be a real number or None"):
        cuflash.attention(*qkv(), scale=scale)


def test_error_layout_and_causal():
    with raises(ValueError, "layout must be 'bshd' (B, N, H, d) or 'bhsd' (B, H, N, d)", "'bsdh'"):
        cuflash.attention(*qkv(), layout="bsdh")
    with raises(TypeError, "layout must be 'bshd' or 'bhsd'", "int"):
        cuflash.attention(*qkv(), layout=3)
    with raises(TypeError, "causal must be a bool", "'yes'"):
        cuflash.attention(*qkv(), causal="yes")


def test_error_backward_arguments():
    q, k, v = qkv()
    o, lse = cuflash.attention_forward(q, k, v)
    do = randn(*q.shape)
    with raises(ValueError, "do must have the shape of q (2, 37, 4, 24)", "(2, 36, 4, 24)"):
        cuflash.attention_backward(do[:, :36], q, k, v, o, lse)
    with raises(TypeError, "do must have dtype float32 (like q)", "float16"):
        cuflash.attention_backward(do.astype(np.float16), q, k, v, o, lse)
    with raises(ValueError, "o must have the shape of q"):
        cuflash.attention_backward(do, q, k, v, o[:1], lse)
    with raises(TypeError, "o must have dtype float32 (like q)", "float64"):
        cuflash.attention_backward(do, q, k, v, o.astype(np.float64), lse)
    with raises(ValueError, "lse must have shape (B, Hq, Nq) = (2, 4, 37)", "(2, 37, 4)"):
        cuflash.attention_backward(do, q, k, v, o, lse.transpose(0, 2, 1).copy())
    with raises(TypeError, "lse must have dtype float32", "float64"):
        cuflash.attention_backward(do, q, k, v, o, lse.astype(np.float64))
    with raises(TypeError, "lse must be an array that supports DLPack"):
        cuflash.attention_backward(do, q, k, v, o, None)


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_q_or_k_reaches_exactly_the_rows_it_touches(where, causal):
    # The CPU backend keeps the GPU's promise: a NaN in a row of q reaches that output row, one in
    # a row of k the rows that see that key (o and lse NaN there), as the naive float64 reference
    # computes it; every other value is as without the NaN, and the backward follows the reference.
    q, k, v = qkv(dtype=np.float64, nq=37, nk=45)
    do = randn(*q.shape, dtype=np.float64)
    bad = q if where == "q" else k
    bad[0, 20, 1, 3] = np.nan
    o, lse = cuflash.attention_forward(q, k, v, causal=causal)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    np.testing.assert_array_equal(np.isnan(o), np.isnan(o_ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
    assert np.isnan(o).any() and np.isnan(lse).any()
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)  # NaN where NaN, else close
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
    for got, want in zip(
        grads, reference.backward(do, q, k, v, o, lse, causal=causal), strict=True
    ):
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Windows, softcap and ALiBi (the masks issue)

MODS = [
    dict(window=(5, 3)),
    dict(window=(0, None), causal=True),
    dict(window=(-1, 0)),
    dict(softcap=0.7),
    dict(alibi="head"),
    dict(window=(12, 2), softcap=4.0, alibi="batch"),
]


def _with_slopes(mods: dict, b: int = 2, hq: int = 4) -> dict:
    options = dict(mods)
    kind = options.pop("alibi", None)
    if kind is not None:
        shape = (hq,) if kind == "head" else (b, hq)
        options["alibi_slopes"] = RNG.uniform(0.0, 0.5, shape).astype(np.float32)
    return options


@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_score_options_match_reference(mods, dtype):
    q, k, v = qkv(dtype=dtype)
    options = _with_slopes(mods)
    o, lse = cuflash.attention_forward(q, k, v, scale=0.3, **options)
    o_ref, lse_ref = reference.forward(q, k, v, scale=0.3, **options)
    assert_rounded_from(o, o_ref)
    finite = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=1e-6)
    do = randn(*q.shape, dtype=dtype)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, scale=0.3, **options)
    ref = reference.backward(do, q, k, v, o, lse, scale=0.3, **options)
    tol = {np.float32: 1e-6, np.float64: 1e-12}[dtype]
    for got, want in zip(grads, ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_window_bounds_spelled_none_or_minus_one_agree():
    q, k, v = qkv()
    a = cuflash.attention(q, k, v, window=(None, 3))
    np.testing.assert_array_equal(a, cuflash.attention(q, k, v, window=(-1, 3)))
    np.testing.assert_array_equal(a, cuflash.attention(q, k, v, window=[-1, 3]))
    # no window at all, and one wider than both sequences
    np.testing.assert_array_equal(
        cuflash.attention(q, k, v), cuflash.attention(q, k, v, window=(1000, 1000))
    )
    # causal sets the right bound to 0
    np.testing.assert_array_equal(
        cuflash.attention(q, k, v, causal=True, window=(4, 9)),
        cuflash.attention(q, k, v, window=(4, 0)),
    )


def test_rows_outside_the_window_see_nothing():
    q, k, v = randn(30, 8), randn(10, 8), randn(10, 8)
    o, lse = cuflash.attention_forward(q, k, v, window=(0, 0))
    assert np.all(o[:20] == 0) and np.all(np.isneginf(lse[:20]))
    np.testing.assert_array_equal(o[20:], v)  # one key each, weight 1
    dq, dk, dv = cuflash.attention_backward(randn(30, 8), q, k, v, o, lse, window=(0, 0))
    assert np.all(dq[:20] == 0) and all(np.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize(
    "window,exc,words",
    [
        ((1, 2, 3), TypeError, ("window must be None or a pair (left, right)", "tuple")),
        (5, TypeError, ("window must be None or a pair", "int 5")),
        ((1.5, 2), TypeError, ("window['left'] must be an int >= 0, -1 or None", "float 1.5")),
        ((0, True), TypeError, ("window['right'] must be an int", "bool True")),
        ((-2, 0), ValueError, ("window's left bound must be >= 0, or -1 / None", "got -2")),
        ((3, -5), ValueError, ("window's right bound must be >= 0", "got -5")),
    ],
)
def test_error_bad_window(window, exc, words):
    with raises(exc, *words):
        cuflash.attention(*qkv(), window=window)


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("nan"), float("inf")])
def test_error_bad_softcap_value(softcap):
    with raises(ValueError, "softcap must be a finite number > 0", repr(float(softcap))):
        cuflash.attention(*qkv(), softcap=softcap)


@pytest.mark.parametrize("softcap", ["30", True, [30.0]])
def test_error_bad_softcap_type(softcap):
    with raises(TypeError, "softcap must be a real number > 0 or None"):
        cuflash.attention(*qkv(), softcap=softcap)


def test_error_bad_alibi_slopes():
    q, k, v = qkv()  # B = 2, Hq = 4
    good = np.ones(4, np.float32)
    with raises(TypeError, "alibi_slopes must have dtype float32", "float64"):
        cuflash.attention(q, k, v, alibi_slopes=good.astype(np.float64))
    with raises(
        ValueError, "alibi_slopes must have shape (Hq,) = (4,) or (B, Hq) = (2, 4)", "(2,)"
    ):
        cuflash.attention(q, k, v, alibi_slopes=good[:2])
    with raises(ValueError, "(B, Hq) = (2, 4)", "(4, 2)"):
        cuflash.attention(q, k, v, alibi_slopes=np.ones((4, 2), np.float32))
    with raises(TypeError, "alibi_slopes must be an array that supports DLPack"):
        cuflash.attention(q, k, v, alibi_slopes=[1.0, 1.0, 1.0, 1.0])
    with raises(ValueError, "alibi_slopes is on cuda:0 but q is on cpu"):
        cuflash.attention(
            *(FakeDLPack(x) for x in (q, k, v)), alibi_slopes=FakeDLPack(good, device=(2, 0))
        )
    o, lse = cuflash.attention_forward(q, k, v, alibi_slopes=good)
    with raises(ValueError, "alibi_slopes must have shape"):
        cuflash.attention_backward(randn(*q.shape), q, k, v, o, lse, alibi_slopes=good[:3])


def test_strided_slopes_are_read_in_place():
    q, k, v = qkv()
    wide = RNG.uniform(0, 0.5, (2, 8)).astype(np.float32)
    strided = wide[:, ::2]  # (B, Hq) with a head stride of 2
    np.testing.assert_array_equal(
        cuflash.attention(q, k, v, alibi_slopes=strided),
        cuflash.attention(q, k, v, alibi_slopes=np.ascontiguousarray(strided)),
    )
