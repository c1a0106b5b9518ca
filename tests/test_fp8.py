"""The FP8 forward without a GPU: the e4m3 rounding and the naive FP8 model of the tests, the
CPU backend of attention_forward_fp8 against the float64 reference, its argument errors, and the
dispatch's FP8 launches (instances, tiles, maps). GPU: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _dispatch, _interop, _kernels, reference, testing
from cuflash._problem import Problem

torch = pytest.importorskip("torch", reason="FP8 arrays are made with PyTorch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this PyTorch has no float8_e4m3fn", allow_module_level=True)


def test_e4m3_values_and_rounding_agree_with_torch() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float().numpy()
    table = _interop.E4M3_VALUES
    assert np.array_equal(np.isnan(values), np.isnan(table))
    assert np.array_equal(values[~np.isnan(values)], table[~np.isnan(table)])
    # every representable value rounds to itself; random values round as torch's cast does
    finite = table[np.isfinite(table)].astype(np.float64)
    assert np.array_equal(testing.round_e4m3(finite), finite)
    x = np.random.default_rng(0).standard_normal(20000) * np.exp2(np.linspace(-12, 8, 20000))
    x = x[np.abs(x) <= 448]
    expected = torch.from_numpy(x).to(torch.float8_e4m3fn).double().numpy()
    assert np.array_equal(testing.round_e4m3(x), expected)
    assert testing.round_e4m3(np.array([1000.0, -1e9]))[0] == 448  # satfinite
    assert np.isnan(testing.round_e4m3(np.array([np.nan]))).all()


def _inputs(shape_q, shape_kv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape_q, generator=gen) * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(shape_kv, generator=gen) * 2).to(torch.float8_e4m3fn)
    v = (torch.randn(shape_kv, generator=gen) * 4).to(torch.float8_e4m3fn)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_cpu_backend_is_the_forward_of_the_dequantised_inputs(causal: bool, layout: str) -> None:
    b, hq, hkv, nq, nk, d = 2, 4, 2, 37, 53, 32
    if layout == "bshd":
        q, k, v = _inputs((b, nq, hq, d), (b, nk, hkv, d))
    else:
        q, k, v = _inputs((b, hq, nq, d), (b, hkv, nk, d))
    factors = [torch.rand(b, hkv) + 0.5 for _ in range(3)]
    o, lse = cuflash.attention_forward_fp8(
        q, k, v, q_descale=factors[0], k_descale=factors[1], v_descale=factors[2],
        causal=causal, layout=layout,
    )  # fmt: skip
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and lse.dtype == torch.float32
    axis = 2 if layout == "bshd" else 1

    def dequantised(x, f, group):
        f = np.repeat(f.double().numpy(), group, axis=1)
        f = f[:, None, :, None] if layout == "bshd" else f[:, :, None, None]
        return x.double().numpy() * f

    qd = dequantised(q, factors[0], hq // hkv)
    kd, vd = dequantised(k, factors[1], 1), dequantised(v, factors[2], 1)
    ref_o, ref_lse = reference.forward(qd, kd, vd, causal=causal, layout=layout)
    assert q.shape[axis] == hq
    atol = 2**-8 * np.abs(ref_o).max()
    np.testing.assert_allclose(o.double().numpy(), ref_o, rtol=2**-8, atol=atol)
    np.testing.assert_allclose(lse.double().numpy(), ref_lse, rtol=1e-6, atol=1e-6)


def test_naive_fp8_model_errs_as_its_roundings_predict() -> None:
    """The naive FP8 computation (the GPU tests' yardstick) differs from the reference of the
    dequantised inputs by P's rounding to e4m3: about 2^-4 relative per probability, so a few
    percent of O's scale in the RMS, and far less in lse (unrounded)."""
    arrays = _inputs((1, 256, 2, 64), (1, 256, 2, 64))
    q, k, v = (x.double().numpy().transpose(0, 2, 1, 3) for x in arrays)
    ones = np.ones((1, 2))
    scale = 1 / 8
    naive_o, naive_lse = testing.naive_forward_fp8(q, k, v, (ones,) * 3, causal=True, scale=scale)
    ref_o, ref_lse = reference.forward(q, k, v, causal=True, scale=scale, layout="bhsd")
    rms = np.linalg.norm(naive_o - ref_o) / np.linalg.norm(ref_o)
    assert 1e-3 < rms < 0.05
    assert np.abs(naive_lse - ref_lse).max() < 1e-4


def test_fp8_argument_errors_on_cpu_arrays() -> None:
    q, k, v = _inputs((1, 16, 2, 32), (1, 16, 2, 32))
    with pytest.raises(TypeError, match="q must have dtype float8_e4m3fn"):
        cuflash.attention_forward_fp8(q.float(), k, v)
    with pytest.raises(TypeError, match="k must have dtype float8_e4m3fn"):
        cuflash.attention_forward_fp8(q, k.float(), v)
    with pytest.raises(TypeError, match="v_descale must have dtype float32"):
        cuflash.attention_forward_fp8(q, k, v, v_descale=torch.ones(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"q_descale must have shape \(B, Hkv\) = \(1, 2\)"):
        cuflash.attention_forward_fp8(q, k, v, q_descale=torch.ones(2))
    with pytest.raises(ValueError, match="multiple of 16"):
        q24, k24, v24 = _inputs((1, 16, 2, 24), (1, 16, 2, 24))
        cuflash.attention_forward_fp8(q24, k24, v24)
    with pytest.raises(ValueError, match="4-D"):
        cuflash.attention_forward_fp8(q[0, :, 0], k[0, :, 0], v[0, :, 0])
    with pytest.raises(ValueError, match="strides"):
        wide = torch.zeros(1, 16, 2, 40, dtype=torch.float8_e4m3fn)[..., :32]
        cuflash.attention_forward_fp8(wide, k, v)
    with pytest.raises(ValueError, match="softcap|window"):
        cuflash.attention_forward_fp8(q, k, v, window=(-3, 0))
    with pytest.raises(TypeError, match="causal"):
        cuflash.attention_forward_fp8(q, k, v, causal="yes")


def test_fp8_instances_and_launches() -> None:
    fp8 = _kernels.FP8_DTYPE
    specs = [s for s in _kernels.all_specs("sm_90a") if s.dtype == fp8]
    assert {s.family for s in specs} == {"forward", "transpose_v"}
    assert not [s for s in _kernels.all_specs("sm_80") if s.dtype == fp8]
    for spec in specs:
        assert spec.smem_bytes <= _kernels.SM90_MAX_SMEM
    assert _kernels.fp8_bucket(16) == 64 and _kernels.fp8_bucket(80) == 128
    assert _kernels.fp8_bucket(144) == 256
    assert (
        _kernels.map_row_bytes(fp8, 48, "q") == 64 and _kernels.map_row_bytes(fp8, 48, "vt") == 128
    )
    assert _kernels.map_row_bytes(fp8, 128, "k") == 128
    assert _kernels.map_row_bytes("bfloat16", 64, "q") == 128
    with pytest.raises(ValueError, match="at most 256"):
        _kernels.fp8_bucket(272)
    with pytest.raises(ValueError, match="features"):
        _kernels.instance("forward", "tma", fp8, 128, None, _kernels.FEATURE_SOFTCAP)
    with pytest.raises(ValueError, match="multiples of 128"):
        _kernels.instance("forward", "tma", fp8, 128, (128, 64, 2))
    with pytest.raises(ValueError, match="shared memory"):
        _kernels.instance("forward", "tma", fp8, 256, (128, 256, 2))
    p = Problem(2, 4, 2, 1000, 777, 128, fp8, "bshd", False, (None, 0), 0.1, ("cuda", 0), "torch")
    assert p.out_dtype == "bfloat16" and p.keys_padded == 784
    assert p.map_shape("vt") == (784, 128, 2, 2)
    strides = {
        "q": (1000 * 4 * 128, 128, 4 * 128),
        "k": (777 * 2 * 128, 128, 2 * 128),
        "v": (777 * 2 * 128, 128, 2 * 128),
        "o": (1000 * 4 * 128, 128, 4 * 128),
        "vt": (2 * 128 * 784, 128 * 784, 784),
    }
    launches = _dispatch.forward_fp8(p, strides, "sm_90a", 132)
    assert launches.forward.maps == (("q", 128), ("k", 256), ("vt", 128), ("o", 64))
    assert launches.forward.paired and launches.forward.num_work == 8 * 4 * 2
    assert launches.transpose.grid == 7 * 2 * 2  # 128-key blocks of 784 keys, per (b, kv head)
    with pytest.raises(ValueError, match="sm_90"):
        _dispatch.forward_fp8(p, strides, "sm_89", 132)


def test_fp8_empty_calls() -> None:
    """No keys: o = 0, lse = -inf; no query rows: empty outputs (the CPU backend; the GPU plan
    fills the same values without a launch)."""
    q, k, v = _inputs((1, 5, 2, 32), (1, 0, 2, 32))
    o, lse = cuflash.attention_forward_fp8(q, k, v)
    assert o.shape == q.shape and o.dtype == torch.bfloat16 and not o.float().abs().max()
    assert torch.isneginf(lse).all() and lse.shape == (1, 2, 5)
    q, k, v = _inputs((1, 0, 2, 32), (1, 7, 2, 32))
    o, lse = cuflash.attention_forward_fp8(q, k, v, causal=True)
    assert o.shape == (1, 0, 2, 32) and lse.shape == (1, 2, 0)
