"""Attention over a key/value cache (cuflash.attention_with_kvcache) on the GPU.

The defining property: after the call, the caches are, bit for bit, the caches before it with
k_new / v_new written at rows cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1 of each sequence
(through the block table when paged), and nothing else changed; and each sequence's o and lse are
attention of its queries over its first cache_seqlens[b] + Nnew keys, within the policy's bound
against the float64 reference (cuflash.testing: testing.naive_forward at "float64" and at the
dtype, computed per sequence with CuPy on the gathered keys). Inputs are made with PyTorch; every
output starts as NaN (conftest.py), so an unwritten element fails.

Also here: the number of splits changes nothing beyond rounding (None, 1, 3, 17, and up to 64 on
a long cache); a decoding step captured in a CUDA graph and replayed after cache_seqlens (and q,
k_new, v_new) changed in place gives, bit for bit, the eager results and appends for the new
lengths; lengths beyond the capacity, negative lengths and pages outside the cache, trusted
(check_inputs=False), neither fault nor write outside the caches (guard pages around them stay
as they were) nor harm the next call, and with check_inputs=True raise ValueError naming the
argument; two identical calls give the same bits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np
import pytest
from gpu_records import record
from hypothesis import given, note, settings
from hypothesis import strategies as st
from strategies import score_options

import cuflash
from cuflash import reference, testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests make their inputs with PyTorch")
cupy = pytest.importorskip("cupy")

DEVICE = "cuda"
DTYPES = ("float16", "bfloat16", "float32", "float64")
PAGE_SIZES = (1, 3, 16, 64, 256)
HEAD_DIMS = (1, 8, 33, 64, 80, 128, 200, 256)


@dataclass(frozen=True)
class KvCase:
    """One call. Sequence b uses lengths[b] rows of its cache before n_new rows are appended
    (None: no k_new). Contiguous caches (page_size None) have `slots` rows per sequence; paged
    ones pages of page_size rows, `slots` block-table columns, the pages in random order."""

    lengths: tuple[int, ...]
    seq_q: int
    heads_kv: int
    group: int
    head_dim: int
    dtype: str
    page_size: int | None = None
    slots: int = 64
    n_new: int | None = None
    seqlens: str = "tensor"  # cache_seqlens as an int32 tensor, an "int", or "none"
    num_splits: int | None = None
    causal: bool = False
    scale: float | None = None
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi: str | None = None  # slopes per head ("head", (Hq,)) or per sequence ("batch")
    pad: bool = False  # block table entries past each sequence's pages in use set to -1
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    @property
    def rows(self) -> int:
        """Rows of one page (paged) or of one sequence's cache (contiguous)."""
        return self.slots if self.page_size is None else self.page_size

    @property
    def capacity(self) -> int:
        return self.slots * (1 if self.page_size is None else self.page_size)

    @property
    def new_rows(self) -> int:
        return self.n_new or 0

    @property
    def totals(self) -> tuple[int, ...]:
        """Keys each sequence attends to: its length plus the new rows."""
        return tuple(n + self.new_rows for n in self.lengths)

    @property
    def scale_value(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)


@dataclass
class KvInputs:
    q: torch.Tensor
    k_cache: torch.Tensor  # views of k_buffer / v_buffer, between two guard pages
    v_cache: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    cache_seqlens: torch.Tensor | int | None
    block_table: torch.Tensor | None
    table: np.ndarray | None  # the block table on the host
    slopes: torch.Tensor | None


def sync() -> None:
    torch.cuda.synchronize()  # a fault of the kernels surfaces here


def raises(exc, *words):
    return pytest.raises(exc, match=".*".join(re.escape(w) for w in words))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1))


def restore(x: KvInputs, k: torch.Tensor, v: torch.Tensor) -> None:
    """Puts the caches back to the copies k, v."""
    x.k_cache.copy_(k)
    x.v_cache.copy_(v)


def inputs_read_only(x: KvInputs) -> list[torch.Tensor]:
    """The call's arrays other than the caches (which it must not write)."""
    arrays = (x.q, x.k_new, x.v_new, x.cache_seqlens, x.block_table, x.slopes)
    return [t for t in arrays if isinstance(t, torch.Tensor)]


def seqlens_tensor(lengths) -> torch.Tensor:
    return torch.tensor(list(lengths), dtype=torch.int32, device=DEVICE)


# ---------------------------------------------------------------------------------------------
# Inputs


def host_block_table(case: KvCase, gen: torch.Generator) -> tuple[np.ndarray, int]:
    """(block table, number of pages): B * slots distinct pages of B * slots + 1 in random
    order (one page no sequence uses); with `pad`, -1 past each sequence's pages in use."""
    cells = case.batch * case.slots
    pages = cells + 1
    table = torch.randperm(pages, generator=gen)[:cells].reshape(case.batch, case.slots).numpy()
    if case.pad:
        for b, n in enumerate(case.totals):
            table[b, -(-n // case.page_size) :] = -1
    return table.astype(np.int32), pages


def make_inputs(case: KvCase) -> KvInputs:
    """Standard normal q, caches (each between two guard pages of one buffer), new rows and
    ALiBi slopes in [0, 1) on the GPU; the block table and the lengths as the case asks."""
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    host_gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    d, hkv = case.head_dim, case.heads_kv

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)

    table, pages, block_table = None, case.batch, None
    if case.page_size is not None:
        table, pages = host_block_table(case, host_gen)
        block_table = torch.from_numpy(table).to(DEVICE)
    k_buffer, v_buffer = randn(pages + 2, case.rows, hkv, d), randn(pages + 2, case.rows, hkv, d)
    k_new = v_new = None
    if case.n_new is not None:
        k_new, v_new = randn(case.batch, case.n_new, hkv, d), randn(case.batch, case.n_new, hkv, d)
    seqlens = {
        "tensor": lambda: seqlens_tensor(case.lengths),
        "int": lambda: case.lengths[0],
        "none": lambda: None,
    }[case.seqlens]()
    slopes = None
    if case.alibi is not None:
        shape = (case.heads_q,) if case.alibi == "head" else (case.batch, case.heads_q)
        slopes = torch.rand(shape, generator=gen, device=DEVICE, dtype=torch.float32)
    return KvInputs(
        randn(case.batch, case.seq_q, case.heads_q, d),
        k_buffer[1:-1],
        v_buffer[1:-1],
        k_buffer,
        v_buffer,
        k_new,
        v_new,
        seqlens,
        block_table,
        table,
        slopes,
    )


def options_of(case: KvCase, x: KvInputs, **changes) -> dict:
    """The keyword arguments of attention_with_kvcache for the case."""
    options = dict(
        k_new=x.k_new,
        v_new=x.v_new,
        block_table=x.block_table,
        causal=case.causal,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=x.slopes,
        scale=case.scale,
        num_splits=case.num_splits,
    )
    options.update(changes)
    return options


def call(case: KvCase, x: KvInputs, k_cache=None, v_cache=None, **changes) -> tuple:
    """(o, lse) of the case's call (on x's caches unless others are given), shapes checked."""
    k_cache = x.k_cache if k_cache is None else k_cache
    v_cache = x.v_cache if v_cache is None else v_cache
    seqlens = changes.pop("cache_seqlens", x.cache_seqlens)
    o, lse = cuflash.attention_with_kvcache(
        x.q, k_cache, v_cache, seqlens, **options_of(case, x, **changes)
    )
    lse_dtype = torch.float64 if case.dtype == "float64" else torch.float32
    assert o.shape == x.q.shape and o.dtype == x.q.dtype and o.device == x.q.device
    assert lse.shape == (case.batch, case.heads_q, case.seq_q) and lse.dtype == lse_dtype
    return o, lse


def rows_of(case: KvCase, x: KvInputs, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, slot) index tensors of rows 0 .. n - 1 of sequence b (the reference's rule)."""
    page, slot = reference.kvcache_rows(b, n, x.table, case.rows)
    return torch.as_tensor(page, device=DEVICE), torch.as_tensor(slot, device=DEVICE)


def expected_caches(case: KvCase, x: KvInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches as they are now, with the new rows written where they belong."""
    k_want, v_want = x.k_cache.clone(), x.v_cache.clone()
    for b, n in enumerate(case.lengths):
        if case.new_rows:
            page, slot = rows_of(case, x, b, n + case.new_rows)
            k_want[page[n:], slot[n:]] = x.k_new[b]
            v_want[page[n:], slot[n:]] = x.v_new[b]
    return k_want, v_want


# ---------------------------------------------------------------------------------------------
# The check: every sequence against the float64 reference


def bhsd64(x: torch.Tensor):
    """(N, H, d) rows as a CuPy float64 (1, H, N, d) array."""
    return cupy.from_dlpack(x.detach().to(torch.float64).permute(1, 0, 2).contiguous())[None]


def sequence_slopes(slopes: torch.Tensor | None, b: int):
    if slopes is None:
        return None
    row = slopes if slopes.ndim == 1 else slopes[b]
    return cupy.from_dlpack(row.contiguous()).astype(cupy.float64)


def check_sequence(case, x, o, lse, k_after, v_after, b: int) -> tuple[list, list]:
    """(checks, failures) of sequence b, its keys gathered from the caches after the call."""
    n = case.totals[b]
    where = f"sequence {b} (Nq {case.seq_q}, {n} keys)"
    if n == 0:
        ok = bool(torch.all(o[b] == 0)) and bool(torch.all(torch.isneginf(lse[b])))
        return [], ([] if ok else [f"{where}: no keys, but o is not 0 or lse not -inf"])
    page, slot = rows_of(case, x, b, n)
    kw = dict(
        causal=case.causal,
        scale=case.scale_value,
        xp=cupy,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=sequence_slopes(x.slopes, b),
    )
    qb, kb, vb = bhsd64(x.q[b]), bhsd64(k_after[page, slot]), bhsd64(v_after[page, slot])
    o_ref, lse_ref = testing.naive_forward(qb, kb, vb, dtype="float64", **kw)
    o_low, lse_low = testing.naive_forward(qb, kb, vb, dtype=case.dtype, **kw)
    lse_b = cupy.from_dlpack(lse[b].to(torch.float64).contiguous())[None]
    checks = [
        testing.compare("o", bhsd64(o[b]), o_ref, o_low, case.dtype, cupy),
        testing.compare("lse", lse_b, lse_ref, lse_low, case.dtype, cupy),
    ]
    failures = [f"{where}: {c.message}" for c in checks if not c.passed]
    limit = {"float32": 1e-5, "float64": 1e-12}.get(case.dtype)  # the exact path
    if limit is not None:
        failures += [
            f"{where}: exact path above {limit} relative: {c.message}"
            for c in checks
            if not c.relative < limit
        ]
    return checks, failures


def check_outputs(case, x, o, lse, k_after, v_after, test_name: str) -> None:
    checks, failures = [], []
    for b in range(case.batch):
        c, f = check_sequence(case, x, o, lse, k_after, v_after, b)
        checks += c
        failures += f
    if checks:
        record(test_name, case.dtype, checks)
    assert not failures, f"{case}:\n" + "\n".join(failures)


def check_kvcache(case: KvCase, test_name: str = "kvcache property") -> tuple:
    """The call on fresh inputs: the caches afterwards exactly the expected copies (guard pages
    untouched), every sequence within the policy. Returns the inputs and (o, lse)."""
    x = make_inputs(case)
    k_want, v_want = expected_caches(case, x)
    k_buffer, v_buffer = x.k_buffer.clone(), x.v_buffer.clone()
    o, lse = call(case, x)
    sync()
    assert bitwise_equal(x.k_cache, k_want), f"{case}: k_cache is not the expected append"
    assert bitwise_equal(x.v_cache, v_want), f"{case}: v_cache is not the expected append"
    for guard in (0, -1):
        assert bitwise_equal(x.k_buffer[guard], k_buffer[guard]), "a write before/after k_cache"
        assert bitwise_equal(x.v_buffer[guard], v_buffer[guard]), "a write before/after v_cache"
    check_outputs(case, x, o, lse, k_want, v_want, test_name)
    return x, (o, lse)


# ---------------------------------------------------------------------------------------------
# The property test

CAPACITIES = st.one_of(
    st.integers(1, 40),
    st.sampled_from((63, 64, 65, 127, 128, 129, 255, 256, 257, 513, 1000)),
    st.integers(1, 2100),
)


@st.composite
def kv_cases(draw) -> KvCase:
    """Decoding (Nq 1..8) or chunked prefill (Nq 64 or 200), B 1..4, Hkv 1..3, group 1..8, any
    dtype, a head dim of HEAD_DIMS, a contiguous cache or pages of PAGE_SIZES rows (capacity up
    to ~2100 keys; ~700 for prefill), lengths 0..capacity - Nnew (0 and full often), 0..3 new
    rows or none, num_splits None / 1 / 3 / 17, the score options of the masks issue."""
    prefill = draw(st.integers(0, 4)) == 0
    seq_q = draw(st.sampled_from((64, 200))) if prefill else draw(st.integers(1, 8))
    batch = draw(st.integers(1, 3 if prefill else 4))
    target = min(draw(CAPACITIES), 700 if prefill else 2100)
    page_size = draw(st.one_of(st.none(), st.sampled_from(PAGE_SIZES)))
    slots = target if page_size is None else max(1, -(-target // page_size))
    capacity = slots * (page_size or 1)
    n_new = draw(st.one_of(st.none(), st.integers(0, min(3, capacity))))
    room = capacity - (n_new or 0)
    length = st.one_of(st.just(0), st.just(room), st.integers(0, room))
    seqlens = draw(st.sampled_from(("tensor", "tensor", "tensor", "int", "none")))
    if seqlens == "tensor":
        lengths = tuple(draw(st.lists(length, min_size=batch, max_size=batch)))
    else:
        lengths = (room if seqlens == "none" else draw(length),) * batch
    return KvCase(
        lengths,
        seq_q,
        draw(st.integers(1, 3)),
        draw(st.integers(1, 8)),
        draw(st.sampled_from(HEAD_DIMS)),
        draw(st.sampled_from(DTYPES + ("float16", "bfloat16"))),
        page_size=page_size,
        slots=slots,
        n_new=n_new,
        seqlens=seqlens,
        num_splits=draw(st.sampled_from((None, None, 1, 3, 17))),
        causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        pad=page_size is not None and draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
        **draw(score_options(capacity)),
    )


@settings(max_examples=60)
@given(case=kv_cases())
def test_each_sequence_matches_the_reference_and_the_cache_is_appended(case):
    note(repr(case))
    check_kvcache(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", (None,) + PAGE_SIZES)
def test_every_page_size(dtype, page_size):
    # empty, one key, a page edge, full: decoding with new rows, and a prefill chunk of 64 rows
    slots = 300 if page_size is None else -(-300 // page_size)
    capacity = slots * (page_size or 1)
    lengths = (0, 1, min(16, capacity - 3), capacity - 3)
    for seq_q, causal in ((1, False), (64, True)):
        case = KvCase(lengths, seq_q, 2, 4, 128, dtype, page_size, slots, 3, causal=causal)
        check_kvcache(case, "kvcache page sizes")


@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
def test_the_number_of_splits_changes_nothing_beyond_rounding(dtype):
    """A long cache split in 1..64 parts (more parts than key tiles included): every result
    within the policy, and each within rounding of the unsplit one."""
    base = KvCase((4999, 2500, 0, 17), 2, 2, 4, 128, dtype, 64, 79, 1, causal=True, softcap=20.0)
    _, (o1, lse1) = check_kvcache(replace(base, num_splits=1), "kvcache splits")
    for splits in (None, 2, 3, 17, 64, 1000):
        _, (o, lse) = check_kvcache(replace(base, num_splits=splits), "kvcache splits")
        torch.testing.assert_close(lse, lse1, rtol=1e-5, atol=1e-5)
        if dtype == "float32":
            torch.testing.assert_close(o, o1, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_step_in_a_cuda_graph_replays_with_new_lengths(dtype, append):
    """A decoding step captured once; cache_seqlens, q and the new rows changed in place before
    each replay: the replay gives the eager call's bits (o, lse and the appended caches) for the
    new lengths, and those pass the reference check."""
    case = KvCase(
        (5, 0, 40), 1, 2, 4, 128, dtype, 16, 8, 1 if append else None, causal=True, seed=31
    )
    x = make_inputs(case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernels and builds the plans
        call(case, x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = call(case, x)
    gen = torch.Generator(device=DEVICE).manual_seed(32)
    for lengths in ((6, 1, 41), (17, 0, 127), (100, 33, 2), (127, 127, 127)):
        step = replace(case, lengths=lengths)
        x.cache_seqlens.copy_(seqlens_tensor(lengths))
        for t in (x.q, x.k_new, x.v_new):
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=gen, device=DEVICE).to(t.dtype))
        k_eager, v_eager = x.k_cache.clone(), x.v_cache.clone()
        k_want, v_want = expected_caches(step, x)
        graph.replay()
        o_eager, lse_eager = call(step, x, k_eager, v_eager)
        sync()
        assert bitwise_equal(o, o_eager) and bitwise_equal(lse, lse_eager), lengths
        assert bitwise_equal(x.k_cache, k_want) and bitwise_equal(x.v_cache, v_want), lengths
        assert bitwise_equal(k_eager, k_want) and bitwise_equal(v_eager, v_want), lengths
        check_outputs(step, x, o, lse, k_want, v_want, "kvcache graph")


# ---------------------------------------------------------------------------------------------
# Malformed lengths and pages: trusted, and checked

INT32_MAX = 2**31 - 1
GOOD_LENGTHS = (37, 0, 100)  # capacity 128, 2 new rows


def bad_inputs(kind: str, case: KvCase, x: KvInputs) -> dict:
    """The call's changed arguments for a malformed `kind` (sequence 1 only; 0 and 2 good)."""
    lengths = list(case.lengths)
    if kind in ("length above capacity", "int32 max", "negative length"):
        lengths[1] = {
            "length above capacity": case.capacity + 5,
            "int32 max": INT32_MAX,
            "negative length": -3,
        }[kind]
        return {"cache_seqlens": seqlens_tensor(lengths)}
    table = x.block_table.clone()
    table[1, 0] = -1 if kind == "page -1" else x.k_cache.shape[0] + 5
    return {"block_table": table}


MALFORMED = ("length above capacity", "int32 max", "negative length")
MALFORMED_PAGES = ("page -1", "page past the end")


def malformed_cases() -> list:
    """(dtype, Nq, page size, kind): decoding (fp16 / bf16), the exact path, a prefill chunk."""
    return [
        pytest.param(dtype, seq_q, page_size, kind, id=f"{dtype}-{seq_q}-{page_size}-{kind}")
        for dtype, seq_q in (("bfloat16", 1), ("float32", 1), ("bfloat16", 64), ("float16", 3))
        for page_size in (None, 16)
        for kind in MALFORMED + (MALFORMED_PAGES if page_size else ())
    ]


@pytest.mark.parametrize("dtype,seq_q,page_size,kind", malformed_cases())
def test_malformed_lengths_and_pages_on_trust_are_survived(dtype, seq_q, page_size, kind):
    """check_inputs=False: the call returns, the device survives (synchronize), nothing outside
    the caches changes (their guard pages, the other inputs), and the next good call, on the
    caches as they were, gives the bits of the same call made before."""
    slots = 128 if page_size is None else 8
    case = KvCase(GOOD_LENGTHS, seq_q, 2, 2, 64, dtype, page_size, slots, 2, causal=True, seed=9)
    x = make_inputs(case)
    k0, v0 = x.k_cache.clone(), x.v_cache.clone()
    good = call(case, x)
    good_caches = (x.k_cache.clone(), x.v_cache.clone())
    restore(x, k0, v0)
    buffers = (x.k_buffer.clone(), x.v_buffer.clone())
    others = [t.clone() for t in inputs_read_only(x)]
    bad = bad_inputs(kind, case, x)
    call(case, x, **bad)
    sync()
    for was, now in zip(buffers, (x.k_buffer, x.v_buffer), strict=True):
        assert bitwise_equal(now[0], was[0]) and bitwise_equal(now[-1], was[-1]), "guard pages"
    now = inputs_read_only(x)
    assert all(bitwise_equal(a, b) for a, b in zip(now, others, strict=True)), "inputs written"
    restore(x, k0, v0)
    again = call(case, x)
    sync()
    assert bitwise_equal(again[0], good[0]) and bitwise_equal(again[1], good[1])
    assert bitwise_equal(x.k_cache, good_caches[0]) and bitwise_equal(x.v_cache, good_caches[1])


@pytest.mark.parametrize("dtype,seq_q,page_size,kind", malformed_cases())
def test_malformed_lengths_and_pages_checked_raise(dtype, seq_q, page_size, kind):
    """check_inputs=True: ValueError naming the argument, and the caches are not written."""
    slots = 128 if page_size is None else 8
    case = KvCase(GOOD_LENGTHS, seq_q, 2, 2, 64, dtype, page_size, slots, 2, causal=True, seed=9)
    x = make_inputs(case)
    k0, v0 = x.k_cache.clone(), x.v_cache.clone()
    bad = bad_inputs(kind, case, x)
    with raises(ValueError, next(iter(bad))):
        call(case, x, check_inputs=True, **bad)
    sync()
    assert bitwise_equal(x.k_cache, k0) and bitwise_equal(x.v_cache, v0)
    call(case, x, check_inputs=True)  # well-formed: no error


def test_arguments_of_the_wrong_kind_raise():
    case = KvCase(GOOD_LENGTHS, 1, 2, 2, 64, "bfloat16", 16, 8, 2)
    x = make_inputs(case)
    with raises(TypeError, "cache_seqlens"):
        call(case, x, cache_seqlens=x.cache_seqlens.long())
    with raises(ValueError, "cache_seqlens", "cpu"):
        call(case, x, cache_seqlens=x.cache_seqlens.cpu())
    with raises(TypeError, "block_table"):
        call(case, x, block_table=x.block_table.long())
    with raises(TypeError, "cache_seqlens"):
        call(case, x, cache_seqlens=cupy.from_dlpack(x.cache_seqlens))
    with raises(ValueError, "num_splits"):
        call(case, x, num_splits=0)


# ---------------------------------------------------------------------------------------------
# Determinism


@pytest.mark.parametrize("num_splits", [None, 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_identical_calls_give_the_same_bits(dtype, num_splits):
    case = KvCase(
        (700, 0, 1, 1500),
        4,
        2,
        4,
        128,
        dtype,
        64,
        24,
        2,
        num_splits=num_splits,
        causal=True,
        softcap=30.0,
        alibi="batch",
        seed=5,
    )
    x = make_inputs(case)
    k0, v0 = x.k_cache.clone(), x.v_cache.clone()
    first = call(case, x)
    caches = (x.k_cache.clone(), x.v_cache.clone())
    for _ in range(2):
        restore(x, k0, v0)
        again = call(case, x)
        sync()
        assert bitwise_equal(first[0], again[0]) and bitwise_equal(first[1], again[1])
        assert bitwise_equal(x.k_cache, caches[0]) and bitwise_equal(x.v_cache, caches[1])


@pytest.mark.parametrize("page_size", [None, 64, 256])
@pytest.mark.parametrize("head_dim", [40, 64, 120, 128])
def test_tiles_as_boxes_and_as_rows_give_the_same_bits(head_dim, page_size, monkeypatch):
    # On sm_90 at d = 33-64 and 97-128 the decoding kernel copies whole key/value tiles as
    # tensor-map boxes (kernels_cu/kvcache.cu, BOXES) where the TMA unit can address the caches
    # (strides of whole 16-byte units: not d = 100 with two KV heads); a box also holds the
    # cache rows past each sequence's keys in use (here NaN), which the kernel clears before P V.
    # With the maps taken away the plan copies rows: the same products in the same order, so the
    # same bits.
    from cuflash import _kernels, _kvcache_cuda, _plans

    if not _kernels.decode_boxes(_compile_arch(), head_dim):
        pytest.skip("no decoding kernel with boxes on this device")
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim)
    batch, hkv, group, rows = 3, 2, 4, 512
    pages = batch * rows // (page_size or rows)
    shape = (pages, page_size, hkv, head_dim) if page_size else (batch, rows, hkv, head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    table = None
    if page_size:
        table = torch.randperm(pages, device=DEVICE, generator=gen).to(torch.int32).view(batch, -1)
    lens = torch.tensor([100, 1, 450], device=DEVICE, dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):  # every row past the keys in use: NaN
        for r in range(n, rows):
            page, slot = (table[b, r // page_size].item(), r % page_size) if page_size else (b, r)
            k_cache[page, slot] = float("nan")
            v_cache[page, slot] = float("nan")
    q = torch.randn(
        batch, 1, hkv * group, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=gen
    )

    def run():
        _plans.clear()
        out = cuflash.attention_with_kvcache(
            q, k_cache, v_cache, lens, block_table=table, num_splits=3
        )
        plans = [v for v in _plans._plans.values() if isinstance(v, _kvcache_cuda.KVCachePlan)]
        assert len(plans) == 1
        return out, plans[0]

    (o_box, lse_box), plan = run()
    assert plan.decode_boxes is not None and plan.decode_rows is None
    monkeypatch.setattr(_kvcache_cuda, "decode_box_maps", lambda call: None)
    (o_rows, lse_rows), plan = run()
    assert plan.decode_boxes is None and plan.decode_rows is not None
    sync()
    assert torch.isfinite(o_box).all() and torch.isfinite(lse_box).all()
    assert bitwise_equal(o_box, o_rows) and bitwise_equal(lse_box, lse_rows)


def _compile_arch() -> str:
    from cuflash import _compile

    return _compile.device_arch(torch.cuda.current_device())


@pytest.mark.parametrize("route", ["decode", "packed", "dense"])
def test_the_cached_plan_keeps_no_array_alive(route):
    # Plans are cached per call signature (cuflash/_plans.py); one that held the caller's arrays
    # kept every cache it had seen allocated (a benchmark ran out of memory so).
    import gc
    import weakref

    dtype = torch.float32 if route == "packed" else torch.bfloat16
    q = torch.randn(2, 1 if route == "decode" else 80, 4, 64, device=DEVICE, dtype=dtype)
    k_cache = torch.randn(2, 256, 2, 64, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(2, 1, 2, 64, device=DEVICE, dtype=dtype)
    v_new = torch.randn_like(k_new)
    lens = 100 if route == "dense" else torch.tensor([100, 7], device=DEVICE, dtype=torch.int32)
    o, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, lens, k_new=k_new, v_new=v_new)
    sync()
    assert o.shape == q.shape and torch.isfinite(o).all()
    refs = [weakref.ref(t) for t in (q, k_cache, v_cache, k_new, v_new)]
    if route != "dense":
        refs.append(weakref.ref(lens))
    del q, k_cache, v_cache, k_new, v_new, lens
    gc.collect()
    assert all(r() is None for r in refs)


def _jitted_kvcache_step(jax):
    """cuflash.jax.attention_with_kvcache (causal) under jax.jit: (q, k_cache, v_cache, lengths,
    k_new, v_new, block table, slopes) -> (o, lse, k_cache, v_cache)."""
    import cuflash.jax as cfj

    @jax.jit
    def step(q, k_cache, v_cache, lengths, k_new, v_new, table, slopes=None):
        return cfj.attention_with_kvcache(
            q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, block_table=table,
            alibi_slopes=slopes, causal=True,
        )  # fmt: skip

    return step


@pytest.mark.parametrize("paged", [False, True])
def test_jax_wrapper_under_jit_on_the_gpu_equals_the_plain_api(paged):
    """cuflash.jax.attention_with_kvcache (jit, JAX GPU arrays) gives the plain API's o and lse
    (CuPy arrays, same inputs) to the float32 kernels' rounding, and its returned caches hold
    exactly the plain API's appends."""
    jax = pytest.importorskip("jax")
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip("JAX sees no GPU")

    rng = np.random.default_rng(3)
    batch, seq_q, heads_q, heads_kv, d = 3, 3, 8, 2, 64
    page_size = 16 if paged else 80
    pages = 17 if paged else batch
    k_cache = rng.standard_normal((pages, page_size, heads_kv, d)).astype(np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    table = rng.permutation(pages)[:15].reshape(3, 5).astype(np.int32) if paged else None
    q = rng.standard_normal((batch, seq_q, heads_q, d)).astype(np.float32)
    k_new = rng.standard_normal((batch, 2, heads_kv, d)).astype(np.float32)
    v_new = rng.standard_normal(k_new.shape).astype(np.float32)
    lengths = np.array([0, 33, 78], np.int32)
    gpu = [cupy.asarray(x) for x in (q, k_cache, v_cache, lengths, k_new, v_new)]
    gpu_table = None if table is None else cupy.asarray(table)
    o_want, lse_want = cuflash.attention_with_kvcache(
        gpu[0], gpu[1], gpu[2], gpu[3], k_new=gpu[4], v_new=gpu[5], block_table=gpu_table,
        causal=True,
    )  # fmt: skip

    step = _jitted_kvcache_step(jax)

    device = next(dev for dev in jax.devices() if dev.platform == "gpu")
    inputs = [jax.device_put(x, device) for x in (q, k_cache, v_cache, lengths, k_new, v_new)]
    jax_table = None if table is None else jax.device_put(table, device)
    o, lse, k_after, v_after = step(*inputs, jax_table)
    np.testing.assert_allclose(np.asarray(o), cupy.asnumpy(o_want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), cupy.asnumpy(lse_want), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(k_after), cupy.asnumpy(gpu[1]))
    np.testing.assert_array_equal(np.asarray(v_after), cupy.asnumpy(gpu[2]))


def _jax_decoding_inputs(paged: bool, alibi: bool):
    """bfloat16 decoding inputs (Nq = 1, groups of 4) as NumPy arrays: q, caches, lengths, new
    rows, block table (or None), slopes (or None)."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    batch, heads_q, heads_kv, d = 3, 8, 2, 128
    page_size = 64 if paged else 600
    pages = 40 if paged else batch

    def normal(*shape):
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)

    k_cache, v_cache = normal(pages, page_size, heads_kv, d), normal(pages, page_size, heads_kv, d)
    table = rng.permutation(pages)[:30].reshape(3, 10).astype(np.int32) if paged else None
    slopes = (rng.uniform(0.01, 0.5, heads_q)).astype(np.float32) if alibi else None
    lengths = np.array([0, 333, 597], np.int32)
    q, k_new, v_new = (
        normal(batch, 1, heads_q, d),
        normal(batch, 1, heads_kv, d),
        normal(batch, 1, heads_kv, d),
    )
    return q, k_cache, v_cache, lengths, k_new, v_new, table, slopes


@pytest.mark.parametrize("paged,alibi", [(False, False), (True, False), (False, True)])
def test_jax_decoding_runs_the_split_kv_kernels_and_gives_the_plain_api_bits(paged, alibi):
    """cuflash.jax.attention_with_kvcache on a decoding call (bfloat16, Nq = 1, jit, JAX GPU
    arrays) runs the split-KV decoding kernels in one custom call over the caches in place (no
    packed gather): its o and lse are, bit for bit, the plain API's on the same inputs (torch
    tensors: the same kernels and the same split of the keys), and its caches hold the appends."""
    jax = pytest.importorskip("jax")
    if jax.devices()[0].platform != "gpu":
        pytest.skip("JAX's default device is not a GPU")
    import cuflash.jax as cfj

    q, k_cache, v_cache, lengths, k_new, v_new, table, slopes = _jax_decoding_inputs(paged, alibi)

    # CuPy has no bfloat16: the plain API runs on torch tensors of the same bits
    def to_torch(x):
        if x is None:
            return None
        if x.dtype == np.int32 or x.dtype == np.float32:
            return torch.from_numpy(np.ascontiguousarray(x)).to(DEVICE)
        return torch.from_numpy(x.view(np.int16).copy()).to(DEVICE).view(torch.bfloat16)

    t = [to_torch(x) for x in (q, k_cache, v_cache, lengths, k_new, v_new, table, slopes)]
    o_want, lse_want = cuflash.attention_with_kvcache(
        t[0], t[1], t[2], t[3], k_new=t[4], v_new=t[5], block_table=t[6], alibi_slopes=t[7],
        causal=True,
    )  # fmt: skip
    sync()

    calls = []
    original = cfj._KVCacheDecodeCall.__call__

    def counting(self, ctx, outs, *inputs):
        calls.append(len(outs))
        return original(self, ctx, outs, *inputs)

    step = _jitted_kvcache_step(jax)

    device = jax.devices()[0]
    inputs = [None if x is None else jax.device_put(x, device) for x in
              (q, k_cache, v_cache, lengths, k_new, v_new, table, slopes)]  # fmt: skip
    cfj._KVCacheDecodeCall.__call__ = counting
    try:
        o, lse, k_after, v_after = step(*inputs)
        o.block_until_ready()
    finally:
        cfj._KVCacheDecodeCall.__call__ = original
    assert calls, "the decoding custom call did not run"
    got = np.asarray(o).view(np.uint16)
    want = o_want.view(torch.int16).cpu().numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(lse), lse_want.cpu().numpy())
    for after, cache in ((k_after, t[1]), (v_after, t[2])):
        want_cache = cache.view(torch.int16).cpu().numpy().view(np.uint16)
        np.testing.assert_array_equal(np.asarray(after).view(np.uint16), want_cache)


def test_jax_decoding_on_cpu_arrays_with_a_gpu_default_takes_the_numpy_backend():
    """Traced where the default device is a GPU but run on CPU arrays, the decoding custom call
    computes with the NumPy backend: the plain API's CPU results on the same inputs."""
    jax = pytest.importorskip("jax")
    if jax.devices()[0].platform != "gpu":
        pytest.skip("JAX's default device is not a GPU")

    q, k_cache, v_cache, lengths, k_new, v_new, table, _ = _jax_decoding_inputs(True, False)
    cpu = jax.devices("cpu")[0]
    inputs = [jax.device_put(x, cpu) for x in (q, k_cache, v_cache, lengths, k_new, v_new, table)]

    step = _jitted_kvcache_step(jax)

    o, lse, _, _ = step(*inputs)
    k_want, v_want = k_cache.copy(), v_cache.copy()
    o_want, lse_want = cuflash.attention_with_kvcache(
        q, k_want, v_want, lengths, k_new=k_new, v_new=v_new, block_table=table, causal=True
    )
    np.testing.assert_array_equal(np.asarray(o).view(np.uint16), o_want.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), lse_want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "seq_q,causal,window,nan_key",
    [(4, True, None, 1), (1, False, (50, 0), 120), (3, False, (10, 0), 12), (1, False, None, 7)],
)
def test_a_nonfinite_cache_row_reaches_only_the_rows_that_see_it(
    dtype, seq_q, causal, window, nan_key
):
    """A NaN and an Inf in the V row of key n - nan_key (n keys in use): the rows that see that
    key are non-finite, every other row is finite (the decoding kernel's P V skips P = 0 on tiles
    where a row does not see a loaded key; the tensor cores would give 0 x NaN = NaN)."""
    gen = torch.Generator(device=DEVICE).manual_seed(nan_key)
    tdtype = getattr(torch, dtype)
    q = torch.randn(1, seq_q, 8, 64, generator=gen, device=DEVICE).to(tdtype)
    k_cache = torch.randn(1, 300, 2, 64, generator=gen, device=DEVICE).to(tdtype)
    v_cache = torch.randn(1, 300, 2, 64, generator=gen, device=DEVICE).to(tdtype)
    n = 200
    v_cache[0, n - nan_key, :, 3] = float("nan")
    v_cache[0, n - nan_key, :, 5] = float("inf")
    o, _ = cuflash.attention_with_kvcache(q, k_cache, v_cache, n, causal=causal, window=window)
    left, right = window if window else (None, None)
    right = 0 if causal else right
    j = n - nan_key
    sees = []
    for i in range(seq_q):
        diag = i + n - seq_q
        sees.append((left is None or j >= diag - left) and (right is None or j <= diag + right))
    finite = torch.isfinite(o[0].float()).all(-1).cpu()  # (Nq, Hq)
    for i, seen in enumerate(sees):
        assert bool(finite[i].any()) != seen and bool(finite[i].all()) != seen, (i, seen)
