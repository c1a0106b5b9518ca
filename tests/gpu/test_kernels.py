"""The CUDA kernels against the float64 reference, under the tolerance policy of docs/DESIGN.md.

Inputs are made with PyTorch (the only library here with bfloat16 on the GPU and arbitrary strided
views); references are computed in float64 on the GPU with CuPy (cuflash.testing). Every output
buffer starts as NaN (tests/gpu/conftest.py), so an unwritten element fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from gpu_records import record
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import score_options

import cuflash
from cuflash import testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests make their inputs with PyTorch")
cupy = pytest.importorskip("cupy")

DTYPES = ("float16", "bfloat16", "float32", "float64")
BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class Case:
    batch: int
    heads_kv: int
    group: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    layout: str  # "bshd", "bhsd" or "2d"
    causal: bool
    scale: float | None
    storage: str  # "contiguous", "views" (strided, aligned) or "unaligned" (odd offsets)
    seed: int
    window: tuple[int | None, int | None] | None = None  # (left, right); None / -1: unbounded
    softcap: float | None = None
    alibi: str | None = None  # slopes per head ("head", shape (Hq,)) or per ("batch", (B, Hq))
    alibi_max: float = 1.0  # the slopes are uniform in [0, alibi_max)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    def shape(self, seq: int, heads: int) -> tuple[int, ...]:
        if self.layout == "2d":
            return (seq, self.head_dim)
        if self.layout == "bshd":
            return (self.batch, seq, heads, self.head_dim)
        return (self.batch, heads, seq, self.head_dim)


@st.composite
def cases(draw, max_n: int = 2048, max_work: int = 1 << 24):
    layout = draw(st.sampled_from(["bshd", "bhsd", "2d"]))
    two_d = layout == "2d"
    batch = 1 if two_d else draw(st.integers(1, 3))
    heads_kv = 1 if two_d else draw(st.integers(1, 3))
    group = 1 if two_d else draw(st.sampled_from([1, 1, 2, 3, 4]))
    seq = st.one_of(st.integers(1, 17), st.integers(1, 300), st.integers(1, max_n))
    seq_q, seq_k = draw(seq), draw(seq)
    # keep the float64 score matrix of the reference affordable
    budget = max(1, max_work // (batch * heads_kv * group * seq_q))
    seq_k = max(1, min(seq_k, budget))
    head_dim = draw(st.one_of(st.sampled_from(BUCKETS), st.integers(1, 256)))
    dtype = draw(st.sampled_from(DTYPES + ("float16", "bfloat16")))
    scale = draw(st.one_of(st.none(), st.floats(0.01, 2.0)))
    storage = draw(st.sampled_from(["contiguous", "views", "unaligned"]))
    return Case(
        batch,
        heads_kv,
        group,
        seq_q,
        seq_k,
        head_dim,
        dtype,
        layout,
        draw(st.booleans()),
        scale,
        storage,
        draw(st.integers(0, 2**31 - 1)),
        **draw(score_options()),
    )


def alibi_slopes(case: Case, gen: torch.Generator):
    """ALiBi slopes of the case (float32 on the GPU, (Hq,) or (B, Hq)), or None. Values up to
    case.alibi_max (1 by default: with the distances of long sequences, some scores fall out of
    range entirely)."""
    if case.alibi is None:
        return None
    shape = (case.heads_q,) if case.alibi == "head" else (case.batch, case.heads_q)
    return torch.rand(shape, generator=gen, device="cuda", dtype=torch.float32) * case.alibi_max


def make(case: Case, shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0):
    """Random normal values in `shape` and the case's dtype, stored as the case asks."""
    dtype = getattr(torch, case.dtype)
    if case.storage == "contiguous":
        base = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale
        return base.to(dtype)
    if case.storage == "views":  # strided in every dim but the last, 16-byte aligned rows
        big = tuple(n + 2 for n in shape[:-1]) + (shape[-1],)
        base = (torch.randn(big, generator=gen, device="cuda", dtype=torch.float32) * scale).to(
            dtype
        )
        return base[tuple(slice(1, 1 + n) for n in shape[:-1])]
    # unaligned: the row pitch is d + 1 and the data starts one element in
    big = shape[:-1] + (shape[-1] + 1,)
    base = (torch.randn(big, generator=gen, device="cuda", dtype=torch.float32) * scale).to(dtype)
    return base[..., 1:]


def to_bhsd64(x: torch.Tensor, layout: str):
    """A CuPy float64 (B, H, N, d) copy of a q/k/v-shaped tensor."""
    x64 = cupy.from_dlpack(x.detach().to(torch.float64).contiguous())
    if layout == "2d":
        return x64[None, None]
    return x64.transpose(0, 2, 1, 3) if layout == "bshd" else x64


def lse_bh64(lse: torch.Tensor, layout: str):
    x = cupy.from_dlpack(lse.detach().to(torch.float64).contiguous())
    return x[None, None] if layout == "2d" else x


def check_case(case: Case, test_name: str = "property", choice=None):
    """Forward and backward of the case against the float64 reference; with `choice` (a
    cuflash._dispatch.KernelChoice) through plans built with it, which are returned."""
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    q = make(case, case.shape(case.seq_q, case.heads_q), gen)
    k = make(case, case.shape(case.seq_k, case.heads_kv), gen)
    v = make(case, case.shape(case.seq_k, case.heads_kv), gen)
    do = make(case, case.shape(case.seq_q, case.heads_q), gen)
    slopes = alibi_slopes(case, gen)
    layout = "bshd" if case.layout == "2d" else case.layout
    scale = case.scale if case.scale is not None else 1.0 / np.sqrt(case.head_dim)
    mods = dict(window=case.window, softcap=case.softcap)
    options = dict(causal=case.causal, scale=case.scale, layout=layout, alibi_slopes=slopes, **mods)

    plans = (None, None)
    if choice is None:
        o, lse = cuflash.attention_forward(q, k, v, **options)
    else:
        o, lse, fwd = testing.attention_forward_with(choice, q, k, v, **options)
    assert o.dtype == q.dtype and o.shape == q.shape and o.device == q.device
    assert lse.dtype == (torch.float64 if case.dtype == "float64" else torch.float32)
    if choice is None:
        dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, **options)
    else:
        dq, dk, dv, bwd = testing.attention_backward_with(choice, do, q, k, v, o, lse, **options)
        plans = (fwd, bwd)

    qb, kb, vb, dob = (to_bhsd64(x, case.layout) for x in (q, k, v, do))
    slopes_bh = None if slopes is None else cupy.from_dlpack(slopes).astype(cupy.float64)
    kw = dict(causal=case.causal, scale=scale, xp=cupy, alibi_slopes=slopes_bh, **mods)
    o_ref, lse_ref = testing.naive_forward(qb, kb, vb, dtype="float64", **kw)
    o_low, lse_low = testing.naive_forward(qb, kb, vb, dtype=case.dtype, **kw)
    # The backward is checked on the kernel's own o and lse, as a user runs it.
    ob, lseb = to_bhsd64(o, case.layout), lse_bh64(lse, case.layout)
    grads_ref = testing.naive_backward(dob, qb, kb, vb, ob, lseb, dtype="float64", **kw)
    grads_low = testing.naive_backward(dob, qb, kb, vb, ob, lseb, dtype=case.dtype, **kw)

    checks = [
        testing.compare("o", ob, o_ref, o_low, case.dtype, cupy),
        testing.compare("lse", lseb, lse_ref, lse_low, case.dtype, cupy),
    ]
    for name, got, ref, low in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), grads_ref, grads_low, strict=True
    ):
        checks.append(
            testing.compare(name, to_bhsd64(got, case.layout), ref, low, case.dtype, cupy)
        )
    record(test_name, case.dtype, checks)
    failed = [c.message for c in checks if not c.passed]
    assert not failed, f"{case}:\n" + "\n".join(failed)
    # The exact path: far under 1e-4 relative on the well-conditioned outputs (o, lse and dv are
    # convex combinations or sums of positive weights). dq and dk are sums that cancel (sum_j dS_ij
    # = 0; with one key they are exactly 0), so their error relative to their own size can grow
    # without bound at machine precision; the same-precision policy above covers them.
    limit = {"float32": 1e-5, "float64": 1e-12}.get(case.dtype)
    if limit is not None:
        checked = [c for c in checks if c.name in ("o", "lse", "dv")]
        assert all(c.relative < limit for c in checked), [c.message for c in checked]
    return plans


@given(case=cases())
def test_forward_and_backward_match_reference(case):
    note(repr(case))
    check_case(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 8, 33, 64, 80, 128, 200, 256])
def test_every_head_dim_bucket(dtype, head_dim):
    for causal in (False, True):
        check_case(
            Case(
                2, 2, 2, 77, 131, head_dim, dtype, "bshd", causal, None, "contiguous", seed=head_dim
            ),
            "buckets",
        )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fully_masked_rows_give_zero_and_minus_inf(dtype):
    # causal with Nq > Nk: the first Nq - Nk query rows see no key
    case = Case(1, 2, 2, 200, 70, 64, dtype, "bhsd", True, None, "contiguous", seed=3)
    check_case(case, "masked rows")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = make(case, case.shape(200, 4), gen)
    k, v = make(case, case.shape(70, 2), gen), make(case, case.shape(70, 2), gen)
    o, lse = cuflash.attention_forward(q, k, v, causal=True, layout="bhsd")
    assert torch.all(o[:, :, :130] == 0) and torch.all(torch.isneginf(lse[:, :, :130]))
    assert torch.all(torch.isfinite(lse[:, :, 130:]))
    dq, dk, dv = cuflash.attention_backward(
        torch.randn_like(q), q, k, v, o, lse, causal=True, layout="bhsd"
    )
    assert torch.all(dq[:, :, :130] == 0)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.parametrize(
    "dtype,head_dim",
    [(dt, 96) for dt in DTYPES] + [("bfloat16", 64), ("float16", 128), ("bfloat16", 256)],
)
def test_backward_is_bitwise_deterministic(dtype, head_dim):
    # d = 96: the mma.sync and exact kernels; 64, 128, 256: the TMA kernels on Hopper
    case = Case(2, 2, 4, 300, 500, head_dim, dtype, "bshd", True, None, "contiguous", seed=5)
    gen = torch.Generator(device="cuda").manual_seed(case.seed)
    q = make(case, case.shape(300, 8), gen)
    k, v = make(case, case.shape(500, 2), gen), make(case, case.shape(500, 2), gen)
    do = make(case, case.shape(300, 8), gen)
    o, lse = cuflash.attention_forward(q, k, v, causal=True)
    first = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    for _ in range(3):
        again = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_torch_cupy_and_jax_inputs_give_the_same_numbers(dtype):
    gen = torch.Generator(device="cuda").manual_seed(11)
    tdt = getattr(torch, dtype)
    q = torch.randn(2, 100, 4, 64, generator=gen, device="cuda").to(tdt)
    k = torch.randn(2, 120, 2, 64, generator=gen, device="cuda").to(tdt)
    v = torch.randn(2, 120, 2, 64, generator=gen, device="cuda").to(tdt)
    o_t, lse_t = cuflash.attention_forward(q, k, v, causal=True)
    qc, kc, vc = (cupy.from_dlpack(x) for x in (q, k, v))
    o_c, lse_c = cuflash.attention_forward(qc, kc, vc, causal=True)
    assert isinstance(o_c, cupy.ndarray) and isinstance(lse_c, cupy.ndarray)
    assert torch.equal(o_t, torch.from_dlpack(o_c)) and torch.equal(lse_t, torch.from_dlpack(lse_c))
    jax = pytest.importorskip("jax")
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    qj, kj, vj = (jax.dlpack.from_dlpack(x) for x in (q, k, v))
    o_j, lse_j = cuflash.attention_forward(qj, kj, vj, causal=True)
    assert isinstance(o_j, jax.Array) and str(o_j.dtype) == dtype
    assert torch.equal(o_t, torch.from_dlpack(o_j)) and torch.equal(lse_t, torch.from_dlpack(lse_j))


def test_bfloat16_passes_through_torch_and_jax():
    jax = pytest.importorskip("jax")
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (
        torch.randn(1, 64, 2, 128, generator=gen, device="cuda").bfloat16() for _ in range(3)
    )
    o_t, _ = cuflash.attention_forward(q, k, v)
    assert o_t.dtype == torch.bfloat16
    qj, kj, vj = (jax.dlpack.from_dlpack(x) for x in (q, k, v))
    o_j, lse_j = cuflash.attention_forward(qj, kj, vj)
    assert str(o_j.dtype) == "bfloat16" and str(lse_j.dtype) == "float32"
    assert torch.equal(o_t, torch.from_dlpack(o_j))
    # the JAX result is a real JAX array: JAX can compute with it
    assert bool(jax.numpy.isfinite(o_j.astype("float32")).all())


def test_torch_inputs_run_on_the_current_stream():
    side = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(13)
    with torch.cuda.stream(side):
        q = torch.randn(4, 512, 8, 64, generator=gen, device="cuda").half()
        k, v = q * 0.5, q.flip(1).contiguous()
        o, lse = cuflash.attention_forward(q, k, v, causal=True)
        o2 = (o.float() * 2).half()  # ordered after the kernel on the same stream
    side.synchronize()
    o_ref, _ = cuflash.attention_forward(q, k, v, causal=True)
    assert torch.equal(o, o_ref) and torch.equal(o2, (o_ref.float() * 2).half())


def test_second_call_compiles_nothing():
    from cuflash import _compile

    q = torch.randn(1, 33, 1, 40, device="cuda").half()
    cuflash.attention_backward(q, q, q, q, *cuflash.attention_forward(q, q, q))
    before = _compile.compile_count
    o, lse = cuflash.attention_forward(q, q, q)
    cuflash.attention_backward(q, q, q, q, o, lse)
    assert _compile.compile_count == before


def test_zero_size_and_empty_keys_on_gpu():
    q = torch.randn(0, 10, 2, 32, device="cuda").half()
    o, lse = cuflash.attention_forward(q, q, q)
    assert o.shape == q.shape and lse.shape == (0, 2, 10)
    q = torch.randn(2, 10, 2, 32, device="cuda").half()
    k = torch.randn(2, 0, 2, 32, device="cuda").half()
    o, lse = cuflash.attention_forward(q, k, k)
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    dq, dk, dv = cuflash.attention_backward(q, q, k, k, o, lse)
    assert torch.all(dq == 0) and dk.shape == k.shape
