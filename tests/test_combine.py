"""cuflash.combine: partial results over disjoint key sets merge into attention over their union
(NumPy float64 to rounding, float32 within the policy against the float64 reference), in every
layout and array library (PyTorch, JAX under jit, NumPy bfloat16); rows that see no key give 0
and -inf; one part comes back unchanged; the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import testing


def _split_keys(nk: int, parts: int, rng) -> list[slice]:
    cuts = np.sort(rng.choice(np.arange(1, nk), size=parts - 1, replace=False)) if parts > 1 else []
    edges = [0, *map(int, cuts), nk]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _parts(q, k, v, slices, layout, **options):
    axis = 1 if layout == "bshd" else 2
    outs = []
    for s in slices:
        index = [slice(None)] * 4
        index[axis] = s
        outs.append(
            cuflash.attention_forward(q, k[tuple(index)], v[tuple(index)], layout=layout, **options)
        )
    return np.stack([o for o, _ in outs]), np.stack([lse for _, lse in outs])


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    nq=st.integers(1, 40),
    nk=st.integers(2, 60),
    parts=st.integers(1, 5),
    heads=st.sampled_from([(1, 1), (4, 2), (3, 3)]),
    d=st.sampled_from([1, 8, 33]),
    layout=st.sampled_from(["bshd", "bhsd"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_parts_merge_into_attention_over_the_union(b, nq, nk, parts, heads, d, layout, seed):
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    parts = min(parts, nk)

    def make(n, h):
        shape = (b, n, h, d) if layout == "bshd" else (b, h, n, d)
        return rng.standard_normal(shape)

    q, k, v = make(nq, hq), make(nk, hkv), make(nk, hkv)
    slices = _split_keys(nk, parts, rng)
    o_parts, lse_parts = _parts(q, k, v, slices, layout)
    o, lse = cuflash.combine(o_parts, lse_parts, layout=layout)
    o_want, lse_want = cuflash.attention_forward(q, k, v, layout=layout)
    np.testing.assert_allclose(o, o_want, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(lse, lse_want, rtol=1e-12, atol=1e-12)
    # float32 parts: the merge within the policy against the float64 reference
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    o_parts, lse_parts = _parts(q32, k32, v32, slices, layout)
    o, lse = cuflash.combine(o_parts, lse_parts, layout=layout)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    to_bhsd = (lambda x: x.transpose(0, 2, 1, 3)) if layout == "bshd" else (lambda x: x)
    kw = dict(causal=False, scale=1 / math.sqrt(d))
    args = [to_bhsd(x.astype(np.float64)) for x in (q32, k32, v32)]
    o_ref, lse_ref = testing.naive_forward(*args, dtype="float64", **kw)
    o_low, lse_low = testing.naive_forward(*args, dtype="float32", **kw)
    for name, got, ref, low in (("o", to_bhsd(o), o_ref, o_low), ("lse", lse, lse_ref, lse_low)):
        check = testing.compare(name, got, ref, low, "float32")
        assert check.passed, check.message


def test_rows_without_keys_and_single_parts():
    rng = np.random.default_rng(0)
    o = rng.standard_normal((3, 2, 5, 4, 8)).astype(np.float32)  # (S, B, N, H, d)
    lse = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
    lse[:, 1, 2, 3] = -np.inf  # batch 1, head 2, row 3 sees no key in any part
    o[:, 1, 3, 2] = 0
    lse[1, 0, 0, 0] = -np.inf  # one part without keys for a row: it weighs nothing
    merged, merged_lse = cuflash.combine(o, lse)
    assert np.all(merged[1, 3, 2] == 0) and np.isneginf(merged_lse[1, 2, 3])
    without = cuflash.combine(o[[0, 2]], lse[[0, 2]])
    np.testing.assert_allclose(merged[0, 0, 0], without[0][0, 0, 0], rtol=1e-6)
    one_o, one_lse = cuflash.combine(o[:1], lse[:1])
    np.testing.assert_array_equal(one_o, o[0])
    np.testing.assert_array_equal(one_lse, lse[0])
    # 2-D problems: (S, N, d) with (S, N)
    o2, lse2 = cuflash.combine(o[:, 0, :, 0], lse[:, 0, 0])
    assert o2.shape == (5, 8) and lse2.shape == (5,)


def test_libraries():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    o = rng.standard_normal((2, 1, 3, 6, 8)).astype(np.float32)  # bhsd
    lse = rng.standard_normal((2, 1, 3, 6)).astype(np.float32)
    want_o, want_lse = cuflash.combine(o, lse, layout="bhsd")
    got = cuflash.combine(torch.from_numpy(o), torch.from_numpy(lse), layout="bhsd")
    assert all(isinstance(x, torch.Tensor) for x in got)
    np.testing.assert_allclose(got[0].numpy(), want_o, rtol=1e-6, atol=1e-7)
    got = jax.jit(lambda o, lse: cuflash.combine(o, lse, layout="bhsd"))(
        jnp.asarray(o), jnp.asarray(lse)
    )
    np.testing.assert_allclose(np.asarray(got[0]), want_o, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got[1]), want_lse, rtol=1e-6, atol=1e-7)
    bf16 = cuflash.combine(torch.from_numpy(o).bfloat16(), torch.from_numpy(lse), layout="bhsd")
    assert bf16[0].dtype == torch.bfloat16 and bf16[1].dtype == torch.float32
    ml_dtypes = pytest.importorskip("ml_dtypes")
    o_np, _ = cuflash.combine(o.astype(ml_dtypes.bfloat16), lse, layout="bhsd")
    assert o_np.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(o_np.astype(np.float32), bf16[0].float().numpy())


def test_errors():
    o = np.zeros((2, 1, 3, 4, 8), np.float32)
    lse = np.zeros((2, 1, 4, 3), np.float32)
    cuflash.combine(o, lse)  # bshd: (S, B, N=3, H=4, d) with (S, B, H, N)
    with pytest.raises(ValueError, match=r"lse_partials must have shape \(2, 1, 3, 4\)"):
        cuflash.combine(o, lse, layout="bhsd")
    with pytest.raises(ValueError, match="layout must be"):
        cuflash.combine(o, lse, layout="sbhd")
    with pytest.raises(ValueError, match="stacked on a new first axis"):
        cuflash.combine(o[0], lse[0])
    with pytest.raises(ValueError, match="at least one part"):
        cuflash.combine(o[:0], lse[:0])
    with pytest.raises(TypeError, match="lse_partials must be float32 or float64"):
        cuflash.combine(o, lse.astype(np.float16))
    with pytest.raises(TypeError, match="o_partials must be float16"):
        cuflash.combine(o.astype(np.int32), lse)
    with pytest.raises(TypeError, match="NumPy, CuPy, PyTorch or JAX arrays"):
        cuflash.combine(o.tolist(), lse)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="one array library"):
        cuflash.combine(torch.from_numpy(o), lse)
