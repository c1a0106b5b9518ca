"""Packed variable-length batches (cuflash.attention_varlen_*) on the GPU.

The defining property: each sequence's o, lse and gradients are what the dense API gives for that
sequence alone, within the policy's bound against the float64 reference (cuflash.testing), and
the lse rows are laid out (Hq, Tq), so that lse[:, cu_q[b]:cu_q[b + 1]] is that call's lse[0].
Inputs are made with PyTorch; the references are computed per sequence in float64 with CuPy
(testing.naive_forward / naive_backward at dtype "float64", as test_kernels.py does), beside the
naive same-precision results that set the bound. Every output starts as NaN (conftest.py), so a
row that no kernel writes fails.

Also here: bitwise determinism, malformed offsets on trust (max_seqlen given: the call survives and
later calls are unharmed; compute-sanitizer runs `sanitize_cases.py --cases varlen`), malformed
offsets checked (ValueError naming the argument), strided views (q, k, v head slices of one fused
qkv tensor), empty sequences, and agreement with the dense API and between torch and CuPy inputs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import pytest
from gpu_records import record
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import head_dims, score_options

import cuflash
from cuflash import testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests make their inputs with PyTorch")
cupy = pytest.importorskip("cupy")

DEVICE = "cuda"
DTYPES = ("float16", "bfloat16", "float32", "float64")
STORAGES = ("contiguous", "views", "unaligned", "fused")
# max_seqlen_* handling: both given (trusted), both given above the longest, both omitted (read
# and checked on the host), only max_seqlen_q given (read and checked), both given and checked.
SEQLENS = ("given", "loose", "omitted", "q only", "checked")


@dataclass(frozen=True)
class VarlenCase:
    """One packed call: sequence b has seq_q[b] query rows and seq_k[b] keys."""

    seq_q: tuple[int, ...]
    seq_k: tuple[int, ...]
    heads_kv: int
    group: int
    head_dim: int
    dtype: str
    causal: bool
    scale: float | None = None
    # contiguous; views (rows and heads of a bigger tensor); unaligned (row pitch d + 1, one
    # element in); fused (q, k, v head slices of one (T, Hq + 2 Hkv, d) tensor: seq_q == seq_k)
    storage: str = "contiguous"
    seqlens: str = "given"  # one of SEQLENS
    seed: int = 0
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi: str | None = None  # slopes per head ("head", (Hq,)) or per sequence ("batch", (B, Hq))
    loose: int = 7  # seqlens "loose": max_seqlen_* exceed the longest sequence by this

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    @property
    def batch(self) -> int:
        return len(self.seq_q)

    @property
    def cu_q(self) -> list[int]:
        return offsets_of(self.seq_q)

    @property
    def cu_k(self) -> list[int]:
        return offsets_of(self.seq_k)

    @property
    def total_q(self) -> int:
        return sum(self.seq_q)

    @property
    def total_k(self) -> int:
        return sum(self.seq_k)

    @property
    def scale_value(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)

    def seqlen_kwargs(self) -> dict:
        longest_q, longest_k = max(self.seq_q), max(self.seq_k)
        if self.seqlens == "omitted":
            return {}
        if self.seqlens == "q only":
            return {"max_seqlen_q": longest_q}
        extra = self.loose if self.seqlens == "loose" else 0
        kwargs = {"max_seqlen_q": longest_q + extra, "max_seqlen_k": longest_k + extra}
        if self.seqlens == "checked":
            kwargs["check_seqlens"] = True
        return kwargs

    def options(self, slopes) -> dict:
        """The keyword arguments of attention_varlen_forward / _backward."""
        return dict(
            causal=self.causal,
            window=self.window,
            softcap=self.softcap,
            alibi_slopes=slopes,
            scale=self.scale,
            **self.seqlen_kwargs(),
        )


def offsets_of(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def cu_tensor(offsets) -> torch.Tensor:
    return torch.tensor(list(offsets), dtype=torch.int32, device=DEVICE)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # a fault of the kernels surfaces here


def raises(exc, *words):
    return pytest.raises(exc, match=".*".join(re.escape(w) for w in words))


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    slopes: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor


def make_inputs(case: VarlenCase) -> Inputs:
    """Standard normal q (Tq, Hq, d), k, v (Tk, Hkv, d), dO (Tq, Hq, d) stored as the case asks,
    ALiBi slopes in [0, 1) and the int32 offsets, on the GPU."""
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    d, hq, hkv = case.head_dim, case.heads_q, case.heads_kv

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)

    def stored(rows: int, heads: int) -> torch.Tensor:
        if case.storage == "views":  # strided rows and heads: a slice of a bigger tensor
            return randn(rows + 2, heads + 3, d)[1 : 1 + rows, 2 : 2 + heads]
        if case.storage == "unaligned":  # row pitch d + 1, data one element in
            return randn(rows, heads, d + 1)[..., 1:]
        return randn(rows, heads, d)

    if case.storage == "fused":  # one projection's output, split along the head axis
        if case.seq_q != case.seq_k:
            raise ValueError("fused storage needs seq_q == seq_k")
        qkv = randn(case.total_q, hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    else:
        q, k, v = stored(case.total_q, hq), stored(case.total_k, hkv), stored(case.total_k, hkv)
    do = randn(case.total_q, hq, d)
    slopes = None
    if case.alibi is not None:
        shape = (hq,) if case.alibi == "head" else (case.batch, hq)
        slopes = torch.rand(shape, generator=gen, device=DEVICE, dtype=torch.float32)
    return Inputs(q, k, v, do, slopes, cu_tensor(case.cu_q), cu_tensor(case.cu_k))


def run_varlen(case: VarlenCase, x: Inputs) -> tuple:
    """(o, lse, dq, dk, dv) of the packed call, with their shapes and dtypes checked."""
    options = case.options(x.slopes)
    o, lse = cuflash.attention_varlen_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **options)
    lse_dtype = torch.float64 if case.dtype == "float64" else torch.float32
    assert o.shape == x.q.shape and o.dtype == x.q.dtype and o.device == x.q.device
    assert lse.shape == (case.heads_q, case.total_q) and lse.dtype == lse_dtype
    dq, dk, dv = cuflash.attention_varlen_backward(
        x.do, x.q, x.k, x.v, o, lse, x.cu_q, x.cu_k, **options
    )
    assert dq.shape == x.q.shape and dk.shape == x.k.shape and dv.shape == x.v.shape
    assert dq.dtype == dk.dtype == dv.dtype == x.q.dtype
    return o, lse, dq, dk, dv


# ---------------------------------------------------------------------------------------------
# The check: every sequence against the float64 reference


def bhsd64(x: torch.Tensor):
    """Rows (N, H, d) of a packed tensor as a CuPy float64 (1, H, N, d) array."""
    return cupy.from_dlpack(x.detach().to(torch.float64).permute(1, 0, 2).contiguous())[None]


def lse64(x: torch.Tensor):
    """Columns (H, N) of a packed lse as a CuPy float64 (1, H, N) array."""
    return cupy.from_dlpack(x.detach().to(torch.float64).contiguous())[None]


def sequence_slopes(slopes: torch.Tensor | None, b: int):
    """Sequence b's slopes as the dense API takes them for that sequence alone: (Hq,)."""
    if slopes is None:
        return None
    row = slopes if slopes.ndim == 1 else slopes[b]
    return cupy.from_dlpack(row.contiguous()).astype(cupy.float64)


def check_sequence(case: VarlenCase, x: Inputs, outputs: tuple, b: int) -> tuple[list, list]:
    """(checks, failures) of sequence b. A sequence without queries must leave its keys' dk and
    dv at exactly 0; one without keys must give o = 0, lse = -inf and dq = 0 on its rows."""
    o, lse, dq, dk, dv = outputs
    q0, q1 = case.cu_q[b], case.cu_q[b + 1]
    k0, k1 = case.cu_k[b], case.cu_k[b + 1]
    where = f"sequence {b} (Nq {q1 - q0}, Nk {k1 - k0}, rows {q0}:{q1}, keys {k0}:{k1})"
    if q1 == q0:
        ok = bool(torch.all(dk[k0:k1] == 0)) and bool(torch.all(dv[k0:k1] == 0))
        return [], ([] if ok else [f"{where}: dk, dv of keys that no query sees are not 0"])
    if k1 == k0:
        failures = []
        if not bool(torch.all(o[q0:q1] == 0)):
            failures.append(f"{where}: o of rows without keys is not 0")
        if not bool(torch.all(torch.isneginf(lse[:, q0:q1]))):
            failures.append(f"{where}: lse of rows without keys is not -inf")
        if not bool(torch.all(dq[q0:q1] == 0)):
            failures.append(f"{where}: dq of rows without keys is not 0")
        return [], failures

    qb, dob = bhsd64(x.q[q0:q1]), bhsd64(x.do[q0:q1])
    kb, vb = bhsd64(x.k[k0:k1]), bhsd64(x.v[k0:k1])
    kw = dict(
        causal=case.causal,
        scale=case.scale_value,
        xp=cupy,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=sequence_slopes(x.slopes, b),
    )
    o_ref, lse_ref = testing.naive_forward(qb, kb, vb, dtype="float64", **kw)
    o_low, lse_low = testing.naive_forward(qb, kb, vb, dtype=case.dtype, **kw)
    # The backward is checked on the kernel's own o and lse, as a user runs it.
    ob, lseb = bhsd64(o[q0:q1]), lse64(lse[:, q0:q1])
    grads_ref = testing.naive_backward(dob, qb, kb, vb, ob, lseb, dtype="float64", **kw)
    grads_low = testing.naive_backward(dob, qb, kb, vb, ob, lseb, dtype=case.dtype, **kw)
    checks = [
        testing.compare("o", ob, o_ref, o_low, case.dtype, cupy),
        testing.compare("lse", lseb, lse_ref, lse_low, case.dtype, cupy),
    ]
    rows = (slice(q0, q1), slice(k0, k1), slice(k0, k1))
    for name, got, r, ref, low in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), rows, grads_ref, grads_low, strict=True
    ):
        checks.append(testing.compare(name, bhsd64(got[r]), ref, low, case.dtype, cupy))
    failures = [f"{where}: {c.message}" for c in checks if not c.passed]
    # The exact path: far under 1e-4 relative on o, lse and dv (as test_kernels.check_case; dq
    # and dk are cancelling sums, covered by the same-precision policy above).
    limit = {"float32": 1e-5, "float64": 1e-12}.get(case.dtype)
    if limit is not None:
        failures += [
            f"{where}: exact path above {limit} relative: {c.message}"
            for c in checks
            if c.name in ("o", "lse", "dv") and not c.relative < limit
        ]
    return checks, failures


def check_varlen(case: VarlenCase, test_name: str = "varlen property") -> tuple:
    """Forward and backward of the packed call, every sequence against the float64 reference.
    Returns the inputs and the outputs (o, lse, dq, dk, dv)."""
    x = make_inputs(case)
    outputs = run_varlen(case, x)
    checks, failures = [], []
    for b in range(case.batch):
        c, f = check_sequence(case, x, outputs, b)
        checks += c
        failures += f
    if checks:
        record(test_name, case.dtype, checks)
    assert not failures, f"{case}:\n" + "\n".join(failures)
    return x, outputs


# ---------------------------------------------------------------------------------------------
# (a) The property test

# Lengths 0..600, biased to 0, 1, tiny lengths and the tiles' edges.
EDGES = (15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 511, 513)
LENGTHS = st.one_of(
    st.sampled_from((0, 1)), st.integers(0, 8), st.sampled_from(EDGES), st.integers(0, 600)
)


def fit_work(seq_q, seq_k, per_pair: int, budget: int, tied: bool):
    """Halve the sequence with the most pairs (its longer side; both when `tied`, which keeps
    seq_q == seq_k) until sum(Nq * Nk) * per_pair <= budget: shrinking, never filtering."""
    seq_q, seq_k = list(seq_q), list(seq_k)
    while sum(a * b for a, b in zip(seq_q, seq_k, strict=True)) * per_pair > budget:
        b = max(range(len(seq_q)), key=lambda i: seq_q[i] * seq_k[i])
        if tied or seq_q[b] >= seq_k[b]:
            seq_q[b] = max(1, seq_q[b] // 2)
        if tied or seq_k[b] > seq_q[b]:
            seq_k[b] = max(1, seq_k[b] // 2)
    return tuple(seq_q), tuple(seq_k)


@st.composite
def varlen_cases(draw, max_sequences: int = 16, max_work: int = 20_000_000) -> VarlenCase:
    """1..max_sequences sequences of 0..600 query rows and 0..600 keys (drawn independently, or
    the same lengths for both), any dtype, head dim 1..256, grouped heads, causal, a window, a
    softcap, ALiBi per head or per sequence, a scale, a storage and a max_seqlen handling; the
    work sum(Nq * Nk) * Hq * d stays <= max_work."""
    n = draw(st.integers(1, max_sequences))
    seq_q = tuple(draw(st.lists(LENGTHS, min_size=n, max_size=n)))
    storage = draw(st.sampled_from(STORAGES))
    same = storage == "fused" or draw(st.integers(0, 2)) == 0
    seq_k = seq_q if same else tuple(draw(st.lists(LENGTHS, min_size=n, max_size=n)))
    heads_kv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    head_dim = draw(head_dims(256))
    seq_q, seq_k = fit_work(seq_q, seq_k, heads_kv * group * head_dim, max_work, same)
    options = draw(score_options(1000))
    return VarlenCase(
        seq_q,
        seq_k,
        heads_kv,
        group,
        head_dim,
        draw(st.sampled_from(DTYPES + ("float16", "bfloat16"))),
        draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        storage=storage,
        seqlens=draw(st.sampled_from(SEQLENS)),
        seed=draw(st.integers(0, 2**31 - 1)),
        loose=draw(st.integers(1, 300)),
        **options,
    )


@given(case=varlen_cases())
def test_each_sequence_matches_the_reference(case):
    note(repr(case))
    check_varlen(case)


# A mixed packing: sequences without queries, without keys, of one row, Nq < Nk and Nq > Nk.
MIXED_Q = (77, 0, 1, 200, 33, 5)
MIXED_K = (131, 5, 0, 200, 64, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 8, 33, 64, 80, 128, 200, 256])
def test_every_head_dim_bucket(dtype, head_dim):
    for causal in (False, True):
        case = VarlenCase(MIXED_Q, MIXED_K, 2, 2, head_dim, dtype, causal, seed=head_dim)
        check_varlen(case, "varlen buckets")


FEATURES = {
    "window": dict(window=(40, 7)),
    "softcap": dict(softcap=2.0),
    "alibi per sequence": dict(alibi="batch"),
    "all": dict(window=(100, -1), softcap=30.0, alibi="head"),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("storage", ["contiguous", "unaligned"])
def test_each_feature(feature, dtype, head_dim, storage):
    # contiguous and unaligned: the 16-byte and the element-wise loads (on Hopper, the wgmma
    # cp.async kernels and the mma.sync ones at 64 and 128)
    for causal in (False, True):
        case = VarlenCase(MIXED_Q, MIXED_K, 2, 2, head_dim, dtype, causal, storage=storage, seed=3)
        check_varlen(replace(case, **FEATURES[feature]), "varlen features")


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 128), ("float16", 64), ("float32", 40)])
def test_many_short_sequences_and_a_long_one(dtype, head_dim):
    # hundreds of sequences of 0..20 rows around one of 2000: many tiny row blocks per launch
    gen = torch.Generator().manual_seed(head_dim)
    short = [int(n) for n in torch.randint(0, 21, (300,), generator=gen)]
    seq_q = tuple(short[:150] + [2000] + short[150:])
    short_k = [int(n) for n in torch.randint(0, 21, (300,), generator=gen)]
    seq_k = tuple(short_k[:150] + [1800] + short_k[150:])
    for causal, window in ((True, None), (False, (64, 64))):
        case = VarlenCase(seq_q, seq_k, 2, 2, head_dim, dtype, causal, window=window, seed=1)
        check_varlen(case, "varlen many")


def test_long_sequences_with_windows():
    # several key tiles per row block on both sides of the band, per sequence
    seq_q, seq_k = (1500, 3, 900), (1300, 1700, 900)
    for window in ((0, 0), (256, 0), (-1, 64), (5000, 5000)):
        for causal in (False, True):
            case = VarlenCase(seq_q, seq_k, 2, 2, 128, "bfloat16", causal, window=window, seed=11)
            check_varlen(case, "varlen windows")


# ---------------------------------------------------------------------------------------------
# The dense API, sequence by sequence


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_sequence_is_what_the_dense_api_gives_for_it(dtype):
    """The dense API on each sequence alone ((1, N, H, d), slopes row b), its results written
    into the packed layout (o rows cu_q[b]:cu_q[b + 1], lse columns of (Hq, Tq)), passes the same
    per-sequence check as the packed call, and agrees with it: the lse to fp32 rounding, every
    output to float32 rounding on the exact path."""
    case = VarlenCase(
        (50, 300, 1, 129),
        (70, 200, 9, 129),
        2,
        3,
        64,
        dtype,
        True,
        window=(90, -1),
        softcap=20.0,
        alibi="batch",
        seed=21,
    )
    x, packed = check_varlen(case, "varlen vs dense")
    dense = tuple(torch.full_like(t, float("nan")) for t in packed)
    for b in range(case.batch):
        q0, q1, k0, k1 = case.cu_q[b], case.cu_q[b + 1], case.cu_k[b], case.cu_k[b + 1]
        options = dict(
            causal=True,
            window=case.window,
            softcap=case.softcap,
            alibi_slopes=x.slopes[b : b + 1],  # (1, Hq): row b is sequence b
            layout="bshd",
        )
        qb, kb, vb, dob = x.q[None, q0:q1], x.k[None, k0:k1], x.v[None, k0:k1], x.do[None, q0:q1]
        o_b, lse_b = cuflash.attention_forward(qb, kb, vb, **options)
        dq_b, dk_b, dv_b = cuflash.attention_backward(dob, qb, kb, vb, o_b, lse_b, **options)
        dense[0][q0:q1], dense[1][:, q0:q1], dense[2][q0:q1] = o_b[0], lse_b[0], dq_b[0]
        dense[3][k0:k1], dense[4][k0:k1] = dk_b[0], dv_b[0]
    failures = []
    for b in range(case.batch):
        checks, f = check_sequence(case, x, dense, b)
        record("dense per sequence", case.dtype, checks)
        failures += f
    assert not failures, "\n".join(failures)
    torch.testing.assert_close(packed[1], dense[1], rtol=1e-5, atol=1e-5)
    if dtype == "float32":
        for got, want in zip(packed, dense, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Locality: a sequence's non-finite inputs stay in that sequence


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("tensor", ["q", "k", "v", "do"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 128), ("float16", 64), ("bfloat16", 40)])
def test_nonfinite_inputs_of_one_sequence_reach_no_other(dtype, head_dim, causal, tensor, value):
    """Sequence 1's rows of one input set to NaN or Inf: the tiles of sequences 0 and 2 reach into
    them (the TMA forward loads whole boxes of the packed tensors; 77 and 50 rows fill no tile),
    yet every other sequence passes the float64 check of clean inputs."""
    case = VarlenCase((77, 50, 130, 33), (77, 50, 130, 33), 2, 2, head_dim, dtype, causal, seed=12)
    x = make_inputs(case)
    rows = slice(case.cu_q[1], case.cu_q[2])
    getattr(x, tensor)[rows] = value
    outputs = run_varlen(case, x)
    failures = []
    for b in (0, 2, 3):
        checks, f = check_sequence(case, x, outputs, b)
        record("varlen locality", case.dtype, checks)
        failures += f
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# (b) Determinism


@pytest.mark.parametrize(
    "dtype,head_dim",
    [(dt, 96) for dt in DTYPES] + [("bfloat16", 64), ("float16", 128), ("bfloat16", 256)],
)
def test_backward_is_bitwise_deterministic(dtype, head_dim):
    case = VarlenCase(
        (300, 0, 77, 513, 1), (500, 40, 77, 129, 0), 2, 4, head_dim, dtype, True, seed=5
    )
    x = make_inputs(case)
    options = case.options(None)
    o, lse = cuflash.attention_varlen_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **options)
    first = cuflash.attention_varlen_backward(
        x.do, x.q, x.k, x.v, o, lse, x.cu_q, x.cu_k, **options
    )
    for _ in range(3):
        o2, lse2 = cuflash.attention_varlen_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **options)
        assert torch.equal(o.view(torch.uint8), o2.view(torch.uint8))
        assert torch.equal(lse.view(torch.uint8), lse2.view(torch.uint8))
        again = cuflash.attention_varlen_backward(
            x.do, x.q, x.k, x.v, o, lse, x.cu_q, x.cu_k, **options
        )
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_cuda_graph_replays_with_new_offsets(head_dim):
    """max_seqlen given, a packed forward and backward captured in a CUDA graph (no host copy,
    the work lists built on the GPU from the offsets) replay with other offsets and inputs in the
    same buffers: each replay gives the bits of eager calls on those offsets."""
    batches = ((300, 0, 1000, 77, 1), (600, 500, 1, 276, 1), (1378, 0, 0, 0, 0))
    total, heads, longest = 1378, 4, 1400
    gen = torch.Generator(device=DEVICE).manual_seed(11)

    def rand(*shape):
        return torch.randn(shape, generator=gen, device=DEVICE).to(torch.bfloat16)

    q, do = rand(total, heads, head_dim), rand(total, heads, head_dim)
    k, v = rand(total, 2, head_dim), rand(total, 2, head_dim)
    cu = torch.zeros(len(batches[0]) + 1, dtype=torch.int32, device=DEVICE)
    options = dict(causal=True, max_seqlen_q=longest, max_seqlen_k=longest)

    def step():
        o, lse = cuflash.attention_varlen_forward(q, k, v, cu, cu, **options)
        return (o, lse, *cuflash.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, **options))

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    cu.copy_(offsets(batches[0]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # plans and kernels ready before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for lengths in batches:
        cu.copy_(offsets(lengths))
        for x in (q, k, v, do):
            x.copy_(torch.randn(x.shape, generator=gen, device=DEVICE).to(torch.bfloat16))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), captured, eager, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (lengths, name)


# ---------------------------------------------------------------------------------------------
# (c), (d) Malformed offsets: on trust (max_seqlen given) and checked

GOOD_Q = (37, 0, 1, 70, 92)  # Tq = 200
GOOD_K = (45, 9, 0, 64, 142)  # Tk = 260
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


def malformed(kind: str, total: int) -> list[int]:
    """B + 1 = 6 offsets of rows 0..total that break the contract in one way."""
    return {
        "decreasing": [0, 60, 20, 90, 50, total],
        "past the end": [0, 10, total + 7, total + 100, INT32_MAX, total + 1],
        "negative": [0, -5, 20, INT32_MIN, total, total],
        "short of the end": [0, 10, 20, 30, 30, total // 2],
        "not starting at 0": [7, 10, 20, 30, 40, total],
    }[kind]


MALFORMED = ("decreasing", "past the end", "negative", "short of the end", "not starting at 0")


def malformed_setup(dtype: str, mods: str):
    case = VarlenCase(GOOD_Q, GOOD_K, 2, 2, 64, dtype, True, seed=9)
    if mods == "all":  # the per-sequence slopes are read by sequence index
        case = replace(case, window=(30, 5), softcap=10.0, alibi="batch")
    x = make_inputs(case)
    options = case.options(x.slopes)  # both max_seqlen given: trusted
    o, lse = cuflash.attention_varlen_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **options)
    grads = cuflash.attention_varlen_backward(
        x.do, x.q, x.k, x.v, o, lse, x.cu_q, x.cu_k, **options
    )
    return case, x, options, (o, lse, *grads)


@pytest.mark.parametrize("mods", ["none", "all"])
@pytest.mark.parametrize("side", ["q", "k", "both"])
@pytest.mark.parametrize("kind", MALFORMED + ("longer than max_seqlen", "max_seqlen 0"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_malformed_offsets_on_trust_are_survived(dtype, kind, side, mods):
    """With both max_seqlen given the offsets are not read on the host: malformed ones give
    unspecified values, but no fault, no write into the inputs, and later calls are unharmed
    (that nothing outside the arrays is read or written: compute-sanitizer, sanitize_cases.py)."""
    case, x, options, good = malformed_setup(dtype, mods)
    before = [t.clone() for t in (x.q, x.k, x.v, x.do, *good[:2])]
    cu = {"q": x.cu_q, "k": x.cu_k}
    bad_options = dict(options)
    for s in ("q", "k") if side == "both" else (side,):
        if kind == "longer than max_seqlen":  # well-formed offsets, too small a longest length
            bad_options[f"max_seqlen_{s}"] = 16
        elif kind == "max_seqlen 0":
            bad_options[f"max_seqlen_{s}"] = 0
        else:
            cu[s] = cu_tensor(malformed(kind, case.total_q if s == "q" else case.total_k))
    o, lse = cuflash.attention_varlen_forward(x.q, x.k, x.v, cu["q"], cu["k"], **bad_options)
    cuflash.attention_varlen_backward(x.do, x.q, x.k, x.v, o, lse, cu["q"], cu["k"], **bad_options)
    # the good forward's o and lse as the backward's input: any values, right shapes
    cuflash.attention_varlen_backward(
        x.do, x.q, x.k, x.v, good[0], good[1], cu["q"], cu["k"], **bad_options
    )
    sync()
    for was, now in zip(before, (x.q, x.k, x.v, x.do, *good[:2]), strict=True):
        assert torch.equal(was, now), "a malformed call wrote into its inputs"
    # later calls: the same bits as before
    o2, lse2 = cuflash.attention_varlen_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **options)
    grads2 = cuflash.attention_varlen_backward(
        x.do, x.q, x.k, x.v, o2, lse2, x.cu_q, x.cu_k, **options
    )
    sync()
    for a, b in zip(good, (o2, lse2, *grads2), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


CHECKED_MODES = {
    "max_seqlen omitted": {},
    "check_seqlens": dict(max_seqlen_q=max(GOOD_Q), max_seqlen_k=max(GOOD_K), check_seqlens=True),
    "max_seqlen_k omitted": dict(max_seqlen_q=max(GOOD_Q)),
}


@pytest.mark.parametrize("mode", sorted(CHECKED_MODES))
@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_offsets_checked_raise(kind, side, mode):
    case, x, _, (o, lse, *_) = malformed_setup("bfloat16", "none")
    cu = {"q": x.cu_q, "k": x.cu_k}
    cu[side] = cu_tensor(malformed(kind, case.total_q if side == "q" else case.total_k))
    options = dict(causal=True, **CHECKED_MODES[mode])
    name = f"cu_seqlens_{side}"
    with raises(ValueError, name):
        cuflash.attention_varlen_forward(x.q, x.k, x.v, cu["q"], cu["k"], **options)
    with raises(ValueError, name):
        cuflash.attention_varlen(x.q, x.k, x.v, cu["q"], cu["k"], **options)
    with raises(ValueError, name):
        cuflash.attention_varlen_backward(x.do, x.q, x.k, x.v, o, lse, cu["q"], cu["k"], **options)


@pytest.mark.parametrize("side", ["q", "k"])
def test_checked_max_seqlen_below_the_longest_raises(side):
    _, x, _, (o, lse, *_) = malformed_setup("float16", "none")
    options = dict(max_seqlen_q=max(GOOD_Q), max_seqlen_k=max(GOOD_K), check_seqlens=True)
    options[f"max_seqlen_{side}"] -= 1
    with raises(ValueError, f"max_seqlen_{side}"):
        cuflash.attention_varlen_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **options)
    with raises(ValueError, f"max_seqlen_{side}"):
        cuflash.attention_varlen_backward(x.do, x.q, x.k, x.v, o, lse, x.cu_q, x.cu_k, **options)


def test_offsets_of_the_wrong_kind_raise():
    # the API's conventions: TypeError for the wrong kind of thing, ValueError for a wrong value,
    # the message naming the argument
    _, x, _, (o, lse, *_) = malformed_setup("bfloat16", "none")
    q, k, v, cu_q, cu_k = x.q, x.k, x.v, x.cu_q, x.cu_k
    with raises(TypeError, "cu_seqlens_q", "int32"):
        cuflash.attention_varlen(q, k, v, cu_q.long(), cu_k)
    with raises(TypeError, "cu_seqlens_k", "int32"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k.float())
    with raises(ValueError, "cu_seqlens_k"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k[:-1])
    with raises(ValueError, "cu_seqlens_q"):
        cuflash.attention_varlen(q, k, v, cu_q[None], cu_k[None])
    with raises(ValueError, "cu_seqlens_q", "cpu"):
        cuflash.attention_varlen(q, k, v, cu_q.cpu(), cu_k)
    with raises(TypeError, "cu_seqlens_q"):
        cuflash.attention_varlen(q, k, v, cupy.from_dlpack(cu_q), cu_k)
    with raises(ValueError, "q", "3-D"):
        cuflash.attention_varlen(q[None], k, v, cu_q, cu_k)
    with raises(ValueError, "max_seqlen_q"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=-1, max_seqlen_k=200)
    with raises(TypeError, "max_seqlen_k"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=92, max_seqlen_k=2.5)
    with raises(TypeError, "check_seqlens"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, check_seqlens="yes")
    slopes = torch.rand(len(GOOD_Q) + 1, 4, device=DEVICE)  # B + 1 rows
    with raises(ValueError, "alibi_slopes"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes)
    with raises(ValueError, "lse"):
        cuflash.attention_varlen_backward(x.do, q, k, v, o, lse[None], cu_q, cu_k)
    with raises(ValueError, "lse"):
        cuflash.attention_varlen_backward(x.do, q, k, v, o, lse.T.contiguous(), cu_q, cu_k)


# ---------------------------------------------------------------------------------------------
# (e) Strided views


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [40, 64, 128])
def test_head_slices_of_one_qkv_tensor(dtype, head_dim):
    # q, k, v are views of one (T, Hq + 2 Hkv, d) projection output, read in place
    seqs = (300, 1, 0, 129, 64)
    case = VarlenCase(seqs, seqs, 2, 2, head_dim, dtype, True, storage="fused", seed=head_dim)
    x, _ = check_varlen(case, "varlen views")
    assert not x.q.is_contiguous() and x.q.stride() == (8 * head_dim, head_dim, 1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_strided_rows_and_heads(dtype):
    for storage in ("views", "unaligned"):
        case = VarlenCase(MIXED_Q, MIXED_K, 3, 2, 72, dtype, False, storage=storage, seed=4)
        check_varlen(case, "varlen views")


# ---------------------------------------------------------------------------------------------
# (f) Empty sequences


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequences(dtype, causal):
    # 0: keys only; 1: queries only; 2: nothing; 5: keys only; 6: one query, no key
    seq_q, seq_k = (0, 5, 0, 7, 3, 0, 1), (4, 0, 0, 9, 3, 2, 0)
    for seqlens in ("given", "omitted"):
        case = VarlenCase(seq_q, seq_k, 2, 2, 64, dtype, causal, seqlens=seqlens, seed=2)
        x, (o, lse, dq, dk, dv) = check_varlen(case, "varlen empty")
        assert o.shape == (16, 4, 64) and lse.shape == (4, 16) and dk.shape == (18, 2, 64)
        # sequences 1 (rows 0:5) and 6 (row 15) see no key: o = 0, lse = -inf, dq = 0
        for q0, q1 in ((0, 5), (15, 16)):
            assert torch.all(o[q0:q1] == 0) and torch.all(torch.isneginf(lse[:, q0:q1]))
            assert torch.all(dq[q0:q1] == 0)
        # sequences 0 (keys 0:4) and 5 (keys 16:18) have no query: dk = dv = 0
        for k0, k1 in ((0, 4), (16, 18)):
            assert torch.all(dk[k0:k1] == 0) and torch.all(dv[k0:k1] == 0)
        assert bool(torch.isfinite(lse[:, 5:15]).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlens", ["given", "omitted"])
def test_calls_with_no_rows_or_no_keys(dtype, seqlens):
    for seq_q, seq_k in (((0, 0, 0), (0, 0, 0)), ((3, 0, 50), (0, 0, 0)), ((0, 0), (7, 90))):
        case = VarlenCase(seq_q, seq_k, 1, 2, 32, dtype, True, seqlens=seqlens, seed=6)
        x = make_inputs(case)
        o, lse, dq, dk, dv = run_varlen(case, x)
        sync()
        assert torch.all(o == 0) and torch.all(torch.isneginf(lse)) and torch.all(dq == 0)
        assert torch.all(dk == 0) and torch.all(dv == 0)


# ---------------------------------------------------------------------------------------------
# Libraries


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_cupy_inputs_give_the_torch_numbers(dtype):
    case = VarlenCase(MIXED_Q, MIXED_K, 2, 2, 64, dtype, True, alibi="batch", seed=8)
    x = make_inputs(case)
    want = run_varlen(case, x)
    options = case.options(x.slopes)
    assert torch.equal(cuflash.attention_varlen(x.q, x.k, x.v, x.cu_q, x.cu_k, **options), want[0])
    c = Inputs(*(None if t is None else cupy.from_dlpack(t) for t in vars(x).values()))
    options = case.options(c.slopes)
    o, lse = cuflash.attention_varlen_forward(c.q, c.k, c.v, c.cu_q, c.cu_k, **options)
    assert isinstance(o, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    grads = cuflash.attention_varlen_backward(
        c.do, c.q, c.k, c.v, o, lse, c.cu_q, c.cu_k, **options
    )
    for got, w in zip((o, lse, *grads), want, strict=True):
        assert torch.equal(torch.from_dlpack(got), w)


# ---------------------------------------------------------------------------------------------
# The framework wrappers on the GPU: the same kernels, so the same bits as the plain API


def test_torch_wrapper_autograd_and_compile_on_the_gpu():
    import cuflash.torch as cft

    case = VarlenCase(MIXED_Q, MIXED_K, 2, 2, 64, "bfloat16", True, softcap=8.0, seed=9)
    x = make_inputs(case)
    options = dict(causal=True, softcap=8.0)
    lengths = dict(max_seqlen_q=max(MIXED_Q), max_seqlen_k=max(MIXED_K))
    o_want, lse = cuflash.attention_varlen_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **options)
    grads_want = cuflash.attention_varlen_backward(
        x.do, x.q, x.k, x.v, o_want, lse, x.cu_q, x.cu_k, **options
    )
    leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]
    o = cft.attention_varlen(*leaves, x.cu_q, x.cu_k, **options)
    o.backward(x.do)
    assert torch.equal(o.detach(), o_want)
    for leaf, want in zip(leaves, grads_want, strict=True):
        assert torch.equal(leaf.grad, want)
    compiled = torch.compile(
        lambda q, k, v: cft.attention_varlen(q, k, v, x.cu_q, x.cu_k, **options, **lengths),
        fullgraph=True,
    )
    assert torch.equal(compiled(x.q, x.k, x.v), o_want)


def test_jax_wrapper_under_jit_on_the_gpu():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no CUDA backend here")
    import jax.dlpack
    import jax.numpy as jnp

    import cuflash.jax as cfj

    case = VarlenCase(MIXED_Q, MIXED_K, 1, 3, 128, "float16", False, window=(40, 7), seed=10)
    x = make_inputs(case)
    q, k, v, do, cq, ck = (
        jax.dlpack.from_dlpack(t.contiguous()) for t in (x.q, x.k, x.v, x.do, x.cu_q, x.cu_k)
    )
    options = dict(window=(40, 7), max_seqlen_q=max(MIXED_Q), max_seqlen_k=max(MIXED_K))

    def loss(q, k, v):
        o = cfj.attention_varlen(q, k, v, cq, ck, **options)
        return (o.astype(jnp.float32) * do.astype(jnp.float32)).sum(), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert o.devices().pop().platform == "gpu"
    o_want, lse = cuflash.attention_varlen_forward(x.q, x.k, x.v, x.cu_q, x.cu_k, **options)
    grads_want = cuflash.attention_varlen_backward(
        x.do, x.q, x.k, x.v, o_want, lse, x.cu_q, x.cu_k, **options
    )
    assert torch.equal(torch.from_dlpack(o), o_want)
    for got, want in zip(grads, grads_want, strict=True):
        assert torch.equal(torch.from_dlpack(got), want)
