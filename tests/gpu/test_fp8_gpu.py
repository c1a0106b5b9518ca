"""The FP8 forward (cuflash.attention_forward_fp8: e4m3 q, k, v, float32 descale factors, O in
bfloat16) against the float64 reference of the dequantised inputs, with the usual policy: the
kernel's error at most twice that of the naive FP8 computation (testing.naive_forward_fp8: the
same roundings, P to e4m3 and O to bfloat16) plus rounding noise. Skipped off sm_90."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from cuflash import _compile, reference, testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests make their inputs with PyTorch")
if _compile.device_arch(torch.cuda.current_device()) != "sm_90a":
    pytest.skip("the FP8 forward runs on Hopper (sm_90) only", allow_module_level=True)
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this PyTorch has no float8_e4m3fn", allow_module_level=True)


@dataclass(frozen=True)
class Fp8Case:
    batch: int = 2
    heads_q: int = 4
    heads_kv: int = 4
    seq_q: int = 300
    seq_k: int = 300
    head_dim: int = 128
    causal: bool = False
    window: tuple | None = None
    layout: str = "bshd"
    descales: bool = True
    seed: int = 0


CASES = [
    Fp8Case(),
    Fp8Case(causal=True, seq_q=1000, seq_k=1000),
    Fp8Case(head_dim=256, seq_q=520, seq_k=777),
    Fp8Case(head_dim=256, causal=True, seq_q=384, seq_k=1000),
    Fp8Case(head_dim=64, heads_q=8, heads_kv=2, seq_q=129, seq_k=1000, causal=True),
    Fp8Case(head_dim=96, seq_q=1, seq_k=77, descales=False),
    Fp8Case(head_dim=160, layout="bhsd", seq_q=700, seq_k=130),
    Fp8Case(window=(100, 20), seq_q=900, seq_k=900),
    Fp8Case(window=(0, 0), head_dim=256, seq_q=200, seq_k=260, heads_q=6, heads_kv=3),
    Fp8Case(seq_q=4100, seq_k=4100, causal=True, batch=1, heads_q=2, heads_kv=1),
]


def _shape(case: Fp8Case, seq: int, heads: int) -> tuple:
    if case.layout == "bshd":
        return (case.batch, seq, heads, case.head_dim)
    return (case.batch, heads, seq, case.head_dim)


def _bhsd(x, layout: str) -> np.ndarray:
    a = x.float().double().cpu().numpy()
    return a.transpose(0, 2, 1, 3) if layout == "bshd" else a


def inputs(case: Fp8Case, scale_q: float = 2.0):
    gen = torch.Generator(device="cuda").manual_seed(case.seed)

    def e4m3(shape, spread):
        x = torch.randn(shape, generator=gen, device="cuda") * spread
        return x.to(torch.float8_e4m3fn)

    q = e4m3(_shape(case, case.seq_q, case.heads_q), scale_q)
    k = e4m3(_shape(case, case.seq_k, case.heads_kv), 2.0)
    v = e4m3(_shape(case, case.seq_k, case.heads_kv), 4.0)
    factors = None
    if case.descales:
        factors = tuple(
            torch.rand((case.batch, case.heads_kv), generator=gen, device="cuda") + 0.25
            for _ in range(3)
        )
    return q, k, v, factors


def check(case: Fp8Case, q, k, v, factors, o, lse) -> None:
    import cuflash  # noqa: F401

    qb, kb, vb = (_bhsd(x, case.layout) for x in (q, k, v))
    group = case.heads_q // case.heads_kv
    ones = np.ones((case.batch, case.heads_kv))
    dq, dk, dv = (ones,) * 3 if factors is None else (f.cpu().numpy() for f in factors)
    scale = 1.0 / np.sqrt(case.head_dim)
    # the reference: the dequantised inputs in float64
    ref_o, ref_lse = reference.forward(
        qb * np.repeat(dq, group, axis=1)[:, :, None, None],
        kb * dk[:, :, None, None],
        vb * dv[:, :, None, None],
        causal=case.causal,
        window=case.window,
        scale=scale,
        layout="bhsd",
    )
    naive_o, naive_lse = testing.naive_forward_fp8(
        qb, kb, vb, (dq, dk, dv), causal=case.causal, scale=scale, window=case.window
    )
    got_o = _bhsd(o, case.layout)
    got_lse = lse.double().cpu().numpy()
    for name, got, ref, naive in (
        ("o", got_o, ref_o, naive_o),
        ("lse", got_lse, ref_lse, naive_lse),
    ):
        result = testing.compare(name, got, ref, naive, "bfloat16")
        assert result.passed, f"{case}: {result.message}"


def forward(case: Fp8Case, q, k, v, factors):
    """cuflash.attention_forward_fp8 with the case's options and descale factors (None: none)."""
    import cuflash

    names = ("q_descale", "k_descale", "v_descale")
    kwargs = {} if factors is None else dict(zip(names, factors, strict=True))
    return cuflash.attention_forward_fp8(
        q, k, v, causal=case.causal, window=case.window, layout=case.layout, **kwargs
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_forward_matches_the_reference(case: Fp8Case) -> None:
    q, k, v, factors = inputs(case)
    o, lse = forward(case, q, k, v, factors)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    assert lse.dtype == torch.float32
    check(case, q, k, v, factors, o, lse)
    # a second call takes the cached plan and gives the same bits
    o2, lse2 = forward(case, q, k, v, factors)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_fp8_forward_takes_jax_arrays() -> None:
    """JAX float8_e4m3fn arrays go in through DLPack and O (bfloat16) and lse come back as JAX
    arrays, with the bits of the same call on PyTorch tensors."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    case = Fp8Case(seq_q=200, seq_k=300, heads_q=4, heads_kv=2, causal=True)
    q, k, v, factors = inputs(case)
    o, lse = forward(case, q, k, v, factors)
    # e4m3 values are exact in float32: the JAX arrays hold the same bits
    qj, kj, vj = (jnp.asarray(x.float().cpu().numpy()).astype(jnp.float8_e4m3fn) for x in (q, k, v))
    fj = tuple(jnp.asarray(f.cpu().numpy()) for f in factors)
    oj, lsej = forward(case, qj, kj, vj, fj)
    assert isinstance(oj, jax.Array) and isinstance(lsej, jax.Array)
    assert oj.dtype == jnp.bfloat16 and oj.shape == q.shape and lsej.dtype == jnp.float32
    assert np.array_equal(np.asarray(oj.astype(jnp.float32)), o.float().cpu().numpy())
    assert np.array_equal(np.asarray(lsej), lse.cpu().numpy())


@st.composite
def fp8_cases(draw) -> Fp8Case:
    """Any shape the FP8 forward takes: grouped heads, d a multiple of 16 up to 256, lengths up to
    700 (partial tiles, rows that see no key under causal masks), windows, both layouts."""
    heads_kv = draw(st.integers(1, 3))
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, 300), st.integers(-1, 300))))
    return Fp8Case(
        batch=draw(st.integers(1, 2)),
        heads_q=heads_kv * draw(st.integers(1, 3)),
        heads_kv=heads_kv,
        seq_q=draw(st.integers(1, 700)),
        seq_k=draw(st.integers(1, 700)),
        head_dim=16 * draw(st.integers(1, 16)),
        causal=draw(st.booleans()),
        window=window,
        layout=draw(st.sampled_from(("bshd", "bhsd"))),
        descales=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@given(case=fp8_cases())
def test_fp8_forward_property(case: Fp8Case) -> None:
    note(str(case))
    q, k, v, factors = inputs(case)
    o, lse = forward(case, q, k, v, factors)
    check(case, q, k, v, factors, o, lse)


def test_fp8_nan_in_a_hidden_value_stays_local() -> None:
    """A NaN in v at a key that causal rows before it do not see: those rows stay finite and
    correct, the others are NaN. The rows of the key's own (masked) tile meet the NaN with P = 0
    and are recomputed by the repair (repair.cuh, reading e4m3 rows: unrounded P, so not bitwise
    the tensor cores' result); rows of earlier blocks never meet it and are bitwise unchanged."""
    case = Fp8Case(causal=True, seq_q=512, seq_k=512, batch=1, heads_q=2, heads_kv=2)
    q, k, clean, factors = inputs(case)
    v = clean.clone()
    v.view(torch.uint8)[0, 300, 1, 5] = 0x7F  # e4m3fn NaN at key 300, head 1
    o, lse = forward(case, q, k, v, factors)
    o_clean, lse_clean = forward(case, q, k, clean, factors)
    of = o.float().cpu().numpy()
    assert np.isfinite(of[0, :300]).all()  # rows 0..299 do not see key 300
    assert np.isnan(of[0, 300:, 1, 5]).all()
    assert np.isfinite(of[0, :, 0]).all()
    assert torch.equal(lse, lse_clean)
    assert torch.equal(o[0, :256], o_clean[0, :256])  # the row blocks before key 300's tile
    mixed = o_clean.clone()
    mixed[0, :300] = o[0, :300]
    check(case, q, k, clean, factors, mixed, lse)


def test_fp8_bad_arguments() -> None:
    import cuflash

    case = Fp8Case(seq_q=64, seq_k=64)
    q, k, v, factors = inputs(case)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        cuflash.attention_forward_fp8(q.to(torch.bfloat16), k, v)
    with pytest.raises(TypeError, match="k must have dtype"):
        cuflash.attention_forward_fp8(q, k.to(torch.bfloat16), v)
    with pytest.raises(TypeError, match="q_descale must have dtype float32"):
        cuflash.attention_forward_fp8(q, k, v, q_descale=factors[0].double())
    with pytest.raises(ValueError, match=r"k_descale must have shape \(B, Hkv\)"):
        cuflash.attention_forward_fp8(q, k, v, k_descale=factors[1][:, :1])
    with pytest.raises(ValueError, match="multiple of 16"):
        cuflash.attention_forward_fp8(q[..., :40], k[..., :40], v[..., :40])
    with pytest.raises(ValueError, match="16-byte aligned"):
        flat = torch.empty(q.numel() + 16, dtype=torch.uint8, device="cuda")
        shifted = flat[1 : 1 + q.numel()].view(torch.float8_e4m3fn).view(q.shape)
        cuflash.attention_forward_fp8(shifted, k, v)
