"""Attention over a key/value cache (cuflash.attention_with_kvcache) on the CPU backend.

Asserted here:
- the float64 reference (cuflash.reference.kvcache_forward) checks itself: a paged cache holding
  the same keys as a contiguous one gives the same bits; appending and then attending is
  attending over the cache's rows in use followed by the new ones; rows beyond a sequence's
  length and pages it does not use play no part; the inputs are not modified;
- the property: for drawn batches (contiguous or paged caches, permuted and shared pages, lengths
  0..capacity given as an array, an int or None, 0..4 appended rows or none, every mask and
  score modifier, num_splits, NumPy and torch CPU arrays), o is the float64 reference rounded
  once to the dtype, lse the reference to float32 (float64) rounding, each sequence is what
  cuflash.attention_forward gives on its gathered keys, and the caches afterwards are, bit for
  bit, the reference's appended copies (every other row as it was);
- splitting a sequence's keys over two calls and merging them with cuflash.combine gives the
  whole call's result;
- every bad argument raises TypeError / ValueError naming it, and a call that raises leaves the
  caches as they were.
GPU runs: tests/gpu/test_kvcache_gpu.py.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference

DTYPES = ["float32", "float64", "float16"]
PAGE_SIZES = [1, 2, 3, 5, 8]
# torch CPU tensors in some calls, where PyTorch is installed
LIBRARIES = ["numpy", "numpy", "torch"] if importlib.util.find_spec("torch") else ["numpy"]


def randn(rng, *shape, dtype="float32"):
    return rng.standard_normal(shape).astype(dtype)


def assert_rounded_from(got, exact, name=""):
    """got is `exact` (float64) rounded to got's dtype: within one unit in the last place, plus
    float64 summation-order noise (as tests/test_api.py)."""
    got = np.asarray(got)
    eps = {np.float16: 2.0**-10, np.float32: 2.0**-23, np.float64: 0.0}[got.dtype.type]
    err = np.abs(got.astype(np.float64) - exact)
    tiny = np.finfo(got.dtype).smallest_subnormal
    bound = eps * np.abs(exact) + tiny + 2.0**-44 * (np.abs(exact).max() if exact.size else 0)
    assert np.all(err <= bound), f"{name}: error above rounding by {np.max(err - bound):.3g}"


def assert_lse_close(got, want, name="lse"):
    """-inf exactly where want is -inf; elsewhere want to the rounding of got's dtype (float32:
    1e-6 relative; float64: 1e-12, summation-order noise)."""
    rtol = 1e-12 if np.asarray(got).dtype == np.float64 else 1e-6
    got = np.asarray(got).astype(np.float64)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=name)
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=1e-12, err_msg=name)


def assert_bitwise_equal(got, want, name=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{name} differs"


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class CacheCase:
    """One call. Sequence b uses lengths[b] rows of its cache before the append of n_new rows
    (None: no k_new). paged: page_size rows per page, `slots` block-table columns; contiguous
    (page_size None): `slots` = Ncache rows."""

    lengths: tuple[int, ...]
    seqlens: str  # cache_seqlens passed as "array" (int32 (B,)), "int" or "none"
    seq_q: int
    heads_kv: int
    group: int
    head_dim: int
    dtype: str
    page_size: int | None
    slots: int
    n_new: int | None
    shared: bool = False  # pages shared between sequences (only without k_new)
    pad: bool = False  # block table entries past the pages in use set to -1
    extra_pages: int = 0  # pages of the cache no sequence uses (unshared tables)
    options: dict = field(default_factory=dict)  # causal, window, softcap, scale
    alibi: str | None = None  # "heads": (Hq,) slopes; "batch": (B, Hq)
    num_splits: int | None = None
    library: str = "numpy"
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    @property
    def new_rows(self) -> int:
        return self.n_new or 0


@dataclass
class CacheArrays:
    """NumPy inputs of a call (torch CPU calls wrap these same buffers)."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    cache_seqlens: np.ndarray | int | None
    k_new: np.ndarray | None
    v_new: np.ndarray | None
    block_table: np.ndarray | None
    slopes: np.ndarray | None


def block_table_of(case: CacheCase, rng) -> tuple[np.ndarray, int]:
    """(block table, number of pages): distinct pages in random order; or, with `shared`, pages
    drawn with repeats from a small cache; with `pad`, -1 past each sequence's pages in use."""
    cells = case.batch * case.slots
    if case.shared:
        num_pages = int(rng.integers(1, cells + 1))
        table = rng.integers(0, num_pages, size=(case.batch, case.slots))
    else:
        num_pages = cells + case.extra_pages
        table = rng.permutation(num_pages)[:cells].reshape(case.batch, case.slots)
    if case.pad:
        for b, n in enumerate(case.lengths):
            table[b, -(-(n + case.new_rows) // case.page_size) :] = -1
    return table.astype(np.int32), num_pages


def make_arrays(case: CacheCase) -> CacheArrays:
    rng = np.random.default_rng(case.seed)
    dt, d, hkv = case.dtype, case.head_dim, case.heads_kv
    table, pages = None, case.batch
    rows = case.slots
    if case.page_size is not None:
        table, pages = block_table_of(case, rng)
        rows = case.page_size
    seqlens = {
        "array": np.array(case.lengths, dtype=np.int32),
        "int": case.lengths[0],
        "none": None,
    }[case.seqlens]
    k_new = v_new = None
    if case.n_new is not None:
        k_new = randn(rng, case.batch, case.n_new, hkv, d, dtype=dt)
        v_new = randn(rng, case.batch, case.n_new, hkv, d, dtype=dt)
    slopes = {
        None: None,
        "heads": rng.uniform(0.05, 1, case.heads_q).astype(np.float32),
        "batch": rng.uniform(0.05, 1, (case.batch, case.heads_q)).astype(np.float32),
    }[case.alibi]
    return CacheArrays(
        randn(rng, case.batch, case.seq_q, case.heads_q, d, dtype=dt),
        randn(rng, pages, rows, hkv, d, dtype=dt),
        randn(rng, pages, rows, hkv, d, dtype=dt),
        seqlens,
        k_new,
        v_new,
        table,
        slopes,
    )


def reference_of(case: CacheCase, x: CacheArrays):
    """(o, lse, k_cache after, v_cache after) of the float64 reference."""
    return reference.kvcache_forward(
        x.q,
        x.k_cache,
        x.v_cache,
        x.cache_seqlens,
        k_new=x.k_new,
        v_new=x.v_new,
        block_table=x.block_table,
        alibi_slopes=x.slopes,
        **case.options,
    )


def call_api(case: CacheCase, x: CacheArrays):
    """cuflash.attention_with_kvcache on the case's library (torch CPU tensors share the NumPy
    buffers, so the append shows in x's caches); (o, lse) back as NumPy arrays, after checking
    that they are of the caller's library."""
    args = dict(vars(x))
    if case.library == "torch":
        import torch

        args = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in args.items()}
    o, lse = cuflash.attention_with_kvcache(
        args["q"],
        args["k_cache"],
        args["v_cache"],
        args["cache_seqlens"],
        k_new=args["k_new"],
        v_new=args["v_new"],
        block_table=args["block_table"],
        alibi_slopes=args["slopes"],
        num_splits=case.num_splits,
        **case.options,
    )
    assert type(o) is type(args["q"]) and type(lse) is type(args["q"])
    if case.library == "torch":
        o, lse = o.numpy(), lse.numpy()
    return o, lse


@st.composite
def cache_cases(draw) -> CacheCase:
    """B 1..4, Nq 1..6, Hkv 1..3, group 1..3, d in {1, 3, 8, 16, 33}; a contiguous cache of
    1..12 rows or pages of {1, 2, 3, 5, 8} rows (1..4 per sequence); 0..4 appended rows or no
    k_new; lengths 0..capacity - Nnew; every option; num_splits None, 1, 2, 5."""
    batch = draw(st.integers(1, 4))
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from(PAGE_SIZES)) if paged else None
    slots = draw(st.integers(1, 4)) if paged else draw(st.integers(1, 12))
    capacity = slots * (page_size or 1)
    n_new = draw(st.one_of(st.none(), st.integers(0, min(4, capacity))))
    room = capacity - (n_new or 0)
    seqlens = draw(st.sampled_from(["array", "array", "int", "none"]))
    if seqlens == "array":
        lengths = tuple(draw(st.lists(st.integers(0, room), min_size=batch, max_size=batch)))
    else:
        lengths = (room if seqlens == "none" else draw(st.integers(0, room)),) * batch
    bounds = st.one_of(st.none(), st.integers(-1, 8))
    options = {
        "causal": draw(st.booleans()),
        "window": draw(st.one_of(st.none(), st.tuples(bounds, bounds))),
        "softcap": draw(st.one_of(st.none(), st.floats(0.5, 50.0))),
        "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
    }
    return CacheCase(
        lengths,
        seqlens,
        draw(st.integers(1, 6)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 3)),
        draw(st.sampled_from([1, 3, 8, 16, 33])),
        draw(st.sampled_from(DTYPES)),
        page_size,
        slots,
        n_new,
        shared=paged and n_new is None and draw(st.booleans()),
        pad=paged and draw(st.booleans()),
        extra_pages=draw(st.integers(0, 2)),
        options=options,
        alibi=draw(st.sampled_from([None, "heads", "batch"])),
        num_splits=draw(st.sampled_from([None, 1, 2, 5])),
        library=draw(st.sampled_from(LIBRARIES)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ---------------------------------------------------------------------------------------------
# The reference checks itself (no implementation needed)


def paged_copies(caches, page_size: int, rng, spare: int = 2):
    """Contiguous caches (B, Ncache, H, d) cut into pages of page_size rows, stored in one random
    order among `spare` pages of noise: (list of paged caches, block table)."""
    batch, n = caches[0].shape[:2]
    per_seq = -(-n // page_size)
    num_pages = batch * per_seq + spare
    table = rng.permutation(num_pages)[: batch * per_seq].astype(np.int32)
    table = table.reshape(batch, per_seq)
    out = []
    for cache in caches:
        paged = randn(rng, num_pages, page_size, *cache.shape[2:], dtype=cache.dtype)
        for b in range(batch):
            page, slot = reference.kvcache_rows(b, n, table, page_size)
            paged[page, slot] = cache[b]
        out.append(paged)
    return out, table


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("append", [False, True])
def test_reference_paged_and_contiguous_caches_agree(page_size, append):
    """The same keys, stored contiguously or in permuted pages: the same o and lse, bit for bit,
    and the appended rows land at the same logical rows."""
    rng = np.random.default_rng(page_size)
    q = randn(rng, 3, 4, 4, 8, dtype="float64")
    k, v = randn(rng, 3, 11, 2, 8, dtype="float64"), randn(rng, 3, 11, 2, 8, dtype="float64")
    lengths = np.array([0, 5, 11 - 2 * append], dtype=np.int32)
    new = {}
    if append:
        new = dict(k_new=randn(rng, 3, 2, 2, 8, dtype="float64"))
        new["v_new"] = randn(rng, 3, 2, 2, 8, dtype="float64")
    options = dict(causal=True, window=(6, -1), softcap=4.0, alibi_slopes=np.ones(4, np.float32))
    o, lse, k_after, v_after = reference.kvcache_forward(q, k, v, lengths, **new, **options)
    (pk, pv), table = paged_copies([k, v], page_size, rng)
    o_p, lse_p, pk_after, pv_after = reference.kvcache_forward(
        q, pk, pv, lengths, block_table=table, **new, **options
    )
    assert_bitwise_equal(o_p, o, "o")
    assert_bitwise_equal(lse_p, lse, "lse")
    total = lengths + (2 if append else 0)
    for b in range(3):
        for after, p_after in ((k_after, pk_after), (v_after, pv_after)):
            want = after[b, : total[b]]
            assert_bitwise_equal(reference.kvcache_keys(p_after, total, table, b), want)


def test_reference_append_then_attend_is_attention_over_the_concatenation():
    """kvcache_forward with k_new is, per sequence, reference.forward over the cache's rows in
    use followed by k_new; only those rows of the copies change; the inputs stay as they were."""
    rng = np.random.default_rng(7)
    q = randn(rng, 2, 3, 6, 16, dtype="float64")
    k, v = randn(rng, 2, 9, 3, 16, dtype="float64"), randn(rng, 2, 9, 3, 16, dtype="float64")
    k_new, v_new = (randn(rng, 2, 3, 3, 16, dtype="float64") for _ in range(2))
    lengths = np.array([6, 2], dtype=np.int32)
    slopes = rng.uniform(0.1, 1, (2, 6)).astype(np.float32)
    saved = [x.copy() for x in (q, k, v, k_new, v_new, lengths)]
    options = dict(causal=True, softcap=9.0, scale=0.4)
    o, lse, k_after, v_after = reference.kvcache_forward(
        q, k, v, lengths, k_new=k_new, v_new=v_new, alibi_slopes=slopes, **options
    )
    for was, now in zip(saved, (q, k, v, k_new, v_new, lengths), strict=True):
        assert_bitwise_equal(now, was, "an input of the reference")
    for b, n in enumerate(lengths):
        keys = np.concatenate([k[b, :n], k_new[b]])[None]
        values = np.concatenate([v[b, :n], v_new[b]])[None]
        o_b, lse_b = reference.forward(
            q[b : b + 1], keys, values, alibi_slopes=slopes[b], **options
        )
        assert_bitwise_equal(o[b], o_b[0], "o")
        assert_bitwise_equal(lse[b], lse_b[0], "lse")
        for after, before, added in ((k_after, k, k_new), (v_after, v, v_new)):
            assert_bitwise_equal(after[b, n : n + 3], added[b])
            others = np.s_[n : n + 3]
            assert_bitwise_equal(np.delete(after[b], others, 0), np.delete(before[b], others, 0))
    # attending again over the appended caches, without new rows, gives the same results
    o2, lse2, k2, _ = reference.kvcache_forward(
        q, k_after, v_after, lengths + 3, alibi_slopes=slopes, **options
    )
    assert_bitwise_equal(o2, o, "o")
    assert_bitwise_equal(lse2, lse, "lse")
    assert_bitwise_equal(k2, k_after, "k_cache")


def test_reference_ignores_rows_past_the_length_and_pages_not_in_use():
    """What lies past a sequence's keys (rows beyond its length, pages its table lists beyond
    them, pages of other sequences) does not change its result; an empty sequence gives o = 0
    and lse = -inf; None lengths are the capacity less the new rows."""
    rng = np.random.default_rng(8)
    q = randn(rng, 2, 2, 2, 4, dtype="float64")
    k, v = randn(rng, 5, 3, 1, 4, dtype="float64"), randn(rng, 5, 3, 1, 4, dtype="float64")
    table = np.array([[4, 0, 2], [1, 3, -1]], dtype=np.int32)
    lengths = np.array([4, 0], dtype=np.int32)
    o, lse, _, _ = reference.kvcache_forward(q, k, v, lengths, block_table=table)
    noisy_k, noisy_v = k.copy(), v.copy()
    noisy_k[[0], 1:], noisy_v[2] = 1e6, -1e6  # rows 4, 5 of sequence 0; its third page
    noisy_k[[1, 3]] = np.nan  # sequence 1's pages
    o2, lse2, _, _ = reference.kvcache_forward(q, noisy_k, noisy_v, lengths, block_table=table)
    assert_bitwise_equal(o2, o, "o")
    assert_bitwise_equal(lse2, lse, "lse")
    assert np.all(o[1] == 0) and np.all(np.isneginf(lse[1]))
    keys = np.concatenate([k[4], k[0, :1]])[None]
    o_0, _ = reference.forward(q[:1], keys, np.concatenate([v[4], v[0, :1]])[None])
    assert_bitwise_equal(o[0], o_0[0], "o")
    k_new, short = randn(rng, 2, 2, 1, 4, dtype="float64"), table[:, :2]  # capacity 6
    by_none = reference.kvcache_forward(q, k, v, None, k_new=k_new, v_new=k_new, block_table=short)
    by_int = reference.kvcache_forward(q, k, v, 4, k_new=k_new, v_new=k_new, block_table=short)
    for a, b in zip(by_none, by_int, strict=True):
        assert_bitwise_equal(a, b)


def test_reference_rejects_lengths_beyond_the_capacity_and_pages_outside_the_cache():
    q = np.zeros((1, 1, 1, 2))
    k = np.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match="cache_seqlens"):
        reference.kvcache_forward(q, k, k, 3, k_new=k[:, :2], v_new=k[:, :2])
    with pytest.raises(ValueError, match="cache_seqlens"):
        reference.kvcache_forward(q, k, k, np.array([-1], np.int32))
    table = np.array([[0, -1]], np.int32)  # rows 2, 3 on page -1
    with pytest.raises(ValueError, match="block_table"):
        reference.kvcache_forward(q, k[:, :2], k[:, :2], 3, block_table=table)


# ---------------------------------------------------------------------------------------------
# The property


def written_rows(case: CacheCase, x: CacheArrays) -> np.ndarray:
    """Bool (pages, rows): the cache rows the append writes."""
    written = np.zeros(x.k_cache.shape[:2], dtype=bool)
    for b, n in enumerate(case.lengths):
        page, slot = reference.kvcache_rows(b, n + case.new_rows, x.block_table, written.shape[1])
        written[page[n:], slot[n:]] = True
    return written


def check_sequences_against_the_dense_api(case, x, o, lse, k_after, v_after):
    """Each sequence is attention_forward over its gathered keys, up to rounding."""
    totals = np.array(case.lengths) + case.new_rows
    for b in range(case.batch):
        one = dict(case.options)
        if x.slopes is not None:
            one["alibi_slopes"] = x.slopes if x.slopes.ndim == 1 else x.slopes[b : b + 1]
        keys = reference.kvcache_keys(k_after, totals, x.block_table, b)[None]
        values = reference.kvcache_keys(v_after, totals, x.block_table, b)[None]
        o_b, lse_b = cuflash.attention_forward(x.q[b : b + 1], keys, values, **one)
        assert_rounded_from(o[b], o_b[0].astype(np.float64), f"o of sequence {b} vs dense")
        assert_lse_close(lse[b], lse_b[0].astype(np.float64), f"lse of sequence {b} vs dense")


@given(case=cache_cases())
@settings(max_examples=60)
def test_each_sequence_matches_the_reference_and_the_cache_is_appended(case):
    note(repr(case))
    x = make_arrays(case)
    before = {n: np.copy(a) for n, a in vars(x).items() if isinstance(a, np.ndarray)}
    o_ref, lse_ref, k_ref, v_ref = reference_of(case, x)
    o, lse = call_api(case, x)

    assert o.shape == x.q.shape and o.dtype == x.q.dtype
    lse_dtype = np.float64 if case.dtype == "float64" else np.float32
    assert lse.shape == (case.batch, case.heads_q, case.seq_q) and lse.dtype == lse_dtype
    assert_rounded_from(o, o_ref, "o")
    assert_lse_close(lse, lse_ref)
    # the caches: the reference's appended copies, bit for bit; every other row as it was
    assert_bitwise_equal(x.k_cache, k_ref, "k_cache")
    assert_bitwise_equal(x.v_cache, v_ref, "v_cache")
    kept = ~written_rows(case, x)
    for name in ("k_cache", "v_cache"):
        assert_bitwise_equal(getattr(x, name)[kept], before[name][kept], f"{name} elsewhere")
    for name, was in before.items():  # the other inputs are read only
        if name not in ("k_cache", "v_cache"):
            assert_bitwise_equal(getattr(x, name), was, name)
    check_sequences_against_the_dense_api(case, x, o, lse, x.k_cache, x.v_cache)


def test_sequences_without_keys_give_zero_and_minus_infinity():
    """nk_b = 0 (an empty cache, no new rows), or causal rows above the first key: o = 0 and
    lse = -inf, exactly."""
    rng = np.random.default_rng(9)
    q, k = randn(rng, 2, 4, 2, 8), randn(rng, 2, 6, 2, 8)
    lengths = np.array([0, 2], dtype=np.int32)
    o, lse = cuflash.attention_with_kvcache(q, k, k, lengths, causal=True)
    assert np.all(o[0] == 0) and np.all(np.isneginf(lse[0]))
    # sequence 1: 4 queries, 2 keys, bottom-right aligned: rows 0 and 1 see no key
    assert np.all(o[1, :2] == 0) and np.all(np.isneginf(lse[1, :, :2]))
    assert np.all(np.isfinite(lse[1, :, 2:]))
    k_new = randn(rng, 2, 0, 2, 8)  # Nnew = 0: nothing written
    saved = k.copy()
    o2, lse2 = cuflash.attention_with_kvcache(q, k, k, lengths, k_new=k_new, v_new=k_new)
    assert_bitwise_equal(k, saved, "k_cache")
    assert np.all(o2[0] == 0) and np.all(np.isneginf(lse2[0]))


def test_bfloat16_numpy_caches():
    """ml_dtypes bfloat16: the append is bitwise, o the reference rounded to bfloat16."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(10)
    bf16 = ml_dtypes.bfloat16
    q, k, v = (randn(rng, *s).astype(bf16) for s in ((2, 3, 4, 16), (6, 4, 2, 16), (6, 4, 2, 16)))
    k_new, v_new = (randn(rng, 2, 2, 2, 16).astype(bf16) for _ in range(2))
    table = np.array([[5, 0, 3], [1, 4, 2]], dtype=np.int32)
    lengths = np.array([7, 10], dtype=np.int32)
    o_ref, lse_ref, k_ref, v_ref = reference.kvcache_forward(
        q, k, v, lengths, k_new=k_new, v_new=v_new, block_table=table, causal=True
    )
    o, lse = cuflash.attention_with_kvcache(
        q, k, v, lengths, k_new=k_new, v_new=v_new, block_table=table, causal=True
    )
    assert o.dtype == bf16 and lse.dtype == np.float32
    np.testing.assert_allclose(o.astype(np.float64), o_ref, rtol=2**-8, atol=1e-30)
    assert_lse_close(lse, lse_ref)
    assert_bitwise_equal(k, k_ref, "k_cache")
    assert_bitwise_equal(v, v_ref, "v_cache")


def test_jax_caches_without_new_rows_give_the_numpy_results():
    jax = pytest.importorskip("jax")
    case = CacheCase((3, 7), "array", 2, 2, 2, 8, "float32", 3, 3, None, options={"causal": True})
    x = make_arrays(case)
    want = call_api(case, x)
    arrays = {n: None if a is None else jax.numpy.asarray(a) for n, a in vars(x).items()}
    o, lse = cuflash.attention_with_kvcache(
        arrays["q"],
        arrays["k_cache"],
        arrays["v_cache"],
        arrays["cache_seqlens"],
        block_table=arrays["block_table"],
        causal=True,
    )
    assert isinstance(o, jax.Array) and isinstance(lse, jax.Array)
    np.testing.assert_array_equal(np.asarray(o), want[0])
    np.testing.assert_array_equal(np.asarray(lse), want[1])


# ---------------------------------------------------------------------------------------------
# Merging partial results


@pytest.mark.parametrize("lengths", [None, 0, 5, 9])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (3, 1), "softcap": 4.0}])
@pytest.mark.parametrize("slopes", [False, True])
def test_dense_route_is_attention_forward_on_views_of_the_caches(lengths, options, slopes):
    # On the GPU, contiguous caches whose lengths the host knows run the dense forward on views
    # of their first rows (cuflash/_kvcache_cuda.py, route "dense"): its problem and key/value
    # descriptions must be what attention_forward validates for k_cache[:, :n], v_cache[:, :n].
    from cuflash import _kvcache, _kvcache_cuda, _validate

    rng = np.random.default_rng(0)
    q = randn(rng, 2, 6, 4, 16)
    k_cache, v_cache = randn(rng, 2, 12, 2, 16), randn(rng, 2, 12, 2, 16)
    k_new, v_new = randn(rng, 2, 3, 2, 16), randn(rng, 2, 3, 2, 16)
    alibi = randn(rng, 2, 4) if slopes else None
    call = _kvcache.check(
        q, k_cache, v_cache, lengths, k_new, v_new, None, alibi,
        causal=options.get("causal", False), window=options.get("window"),
        softcap=options.get("softcap"), scale=None, num_splits=None, check_inputs=False,
    )  # fmt: skip
    n = 12 if lengths is None else lengths + 3
    problem, keys, values = _kvcache_cuda.dense_view(call)
    want, _, k_view, v_view, alibi_info = _validate.check_forward(
        q, k_cache[:, :n], v_cache[:, :n], alibi, **options
    )
    assert problem == want
    for got, view in ((keys, k_view), (values, v_view)):
        assert (got.shape, got.strides, got.dtype, got.device) == (
            view.shape, view.strides, view.dtype, view.device
        )  # fmt: skip
    assert (alibi_info is None) == (call.alibi is None)


@pytest.mark.parametrize("paged", [False, True])
def test_two_disjoint_calls_combine_into_the_whole(paged):
    """Non-causal, no ALiBi: the first L1 keys of each sequence (cache_seqlens = L1) and the rest
    (a second cache holding them at rows 0..), merged with cuflash.combine, give the call over
    all L keys (float64: to summation-order rounding)."""
    rng = np.random.default_rng(11)
    q = randn(rng, 3, 5, 4, 16, dtype="float64")
    k, v = randn(rng, 3, 12, 2, 16, dtype="float64"), randn(rng, 3, 12, 2, 16, dtype="float64")
    whole_lengths = np.array([12, 7, 9], dtype=np.int32)
    head = np.array([4, 1, 9], dtype=np.int32)
    rest_k, rest_v = np.zeros_like(k), np.zeros_like(v)
    for b, (n0, n) in enumerate(zip(head, whole_lengths, strict=True)):
        rest_k[b, : n - n0], rest_v[b, : n - n0] = k[b, n0:n], v[b, n0:n]
    options = dict(softcap=6.0, scale=0.3)
    table = None
    if paged:
        (k, v), table = paged_copies([k, v], 5, rng)
    whole = cuflash.attention_with_kvcache(q, k, v, whole_lengths, block_table=table, **options)
    first = cuflash.attention_with_kvcache(q, k, v, head, block_table=table, **options)
    second = cuflash.attention_with_kvcache(q, rest_k, rest_v, whole_lengths - head, **options)
    o, lse = cuflash.combine(np.stack([first[0], second[0]]), np.stack([first[1], second[1]]))
    np.testing.assert_allclose(o, whole[0], rtol=1e-12, atol=1e-13)
    assert_lse_close(lse, whole[1])


# ---------------------------------------------------------------------------------------------
# Errors


def valid_call(paged: bool) -> dict:
    """A valid call: B = 2, Nq = 3, Hq = 4, Hkv = 2, d = 8, float32, 2 new rows; contiguous
    caches of 10 rows, or 6 pages of 4 rows with a (2, 3) block table (capacity 12)."""
    rng = np.random.default_rng(12)
    shape = (6, 4, 2, 8) if paged else (2, 10, 2, 8)
    call = dict(
        q=randn(rng, 2, 3, 4, 8),
        k_cache=randn(rng, *shape),
        v_cache=randn(rng, *shape),
        cache_seqlens=np.array([3, 5], dtype=np.int32),
        k_new=randn(rng, 2, 2, 2, 8),
        v_new=randn(rng, 2, 2, 2, 8),
    )
    if paged:
        call["block_table"] = np.array([[4, 0, 2], [1, 5, 3]], dtype=np.int32)
    return call


def run_call(call: dict):
    args = [call.pop(name) for name in ("q", "k_cache", "v_cache")]
    return cuflash.attention_with_kvcache(*args, **call)


def f32(*shape):
    return np.zeros(shape, np.float32)


def i32(*values):
    return np.array(values, dtype=np.int32)


def as_dtype(dtype):
    """A change that casts the valid call's array to dtype."""
    return lambda a: a.astype(dtype)


# (exception, pattern the message matches, changes to the valid call: values, or functions of
# the valid call's array)
CONTIGUOUS_ERRORS = [  # cache shapes of the contiguous call
    (ValueError, "v_cache", dict(v_cache=f32(2, 9, 2, 8))),
    (ValueError, "k_cache", dict(k_cache=f32(2, 10, 2, 4), v_cache=f32(2, 10, 2, 4))),
    (ValueError, r"\bq\b|k_cache", dict(k_cache=f32(2, 10, 3, 8), v_cache=f32(2, 10, 3, 8))),
    (ValueError, "k_cache", dict(k_cache=f32(3, 10, 2, 8), v_cache=f32(3, 10, 2, 8))),
    (ValueError, "k_cache", dict(k_cache=f32(10, 2, 8), v_cache=f32(10, 2, 8))),
]
ERRORS = [  # both layouts
    (ValueError, r"\bq\b", dict(q=f32(3, 4, 8))),
    (ValueError, r"\bq\b", dict(q=f32(1, 2, 3, 4, 8))),
    (TypeError, "cache_seqlens", dict(cache_seqlens=np.array([3, 5], np.int64))),
    (TypeError, "cache_seqlens", dict(cache_seqlens=np.array([3.0, 5.0], np.float32))),
    (ValueError, "cache_seqlens", dict(cache_seqlens=i32(3, 5, 1))),
    (ValueError, "cache_seqlens", dict(cache_seqlens=i32(3, 5)[None])),
    (ValueError, "cache_seqlens", dict(cache_seqlens=-1)),
    ((TypeError, ValueError), "v_new", dict(v_new=None)),
    ((TypeError, ValueError), "k_new", dict(k_new=None)),
    (ValueError, "k_new", dict(k_new=f32(3, 2, 2, 8))),
    (ValueError, "k_new", dict(k_new=f32(2, 2, 1, 8), v_new=f32(2, 2, 1, 8))),
    (ValueError, "k_new", dict(k_new=f32(2, 2, 2, 4), v_new=f32(2, 2, 2, 4))),
    (ValueError, "k_new", dict(k_new=f32(2, 2, 8), v_new=f32(2, 2, 8))),
    (ValueError, "v_new", dict(v_new=f32(2, 1, 2, 8))),
    (TypeError, "k_cache", dict(k_cache=as_dtype(np.float64), v_cache=as_dtype(np.float64))),
    (TypeError, "v_cache", dict(v_cache=as_dtype(np.float16))),
    (TypeError, "k_new", dict(k_new=as_dtype(np.float64), v_new=as_dtype(np.float64))),
    (TypeError, "v_new", dict(v_new=as_dtype(np.float16))),
    (ValueError, "num_splits", dict(num_splits=0)),
    (ValueError, "num_splits", dict(num_splits=-3)),
    (TypeError, "num_splits", dict(num_splits=2.0)),
    (TypeError, "num_splits", dict(num_splits="2")),
    (ValueError, "alibi_slopes", dict(alibi_slopes=f32(3))),
    (ValueError, "alibi_slopes", dict(alibi_slopes=f32(3, 4))),
]
PAGED_ERRORS = [
    (TypeError, "block_table", dict(block_table=np.array([[4, 0, 2], [1, 5, 3]], np.int64))),
    (ValueError, "block_table", dict(block_table=i32(4, 0, 2))),
    (ValueError, "block_table", dict(block_table=i32(4, 0, 2)[None])),
    (ValueError, "block_table", dict(block_table=np.zeros((3, 3), np.int32))),
    (ValueError, "v_cache", dict(v_cache=f32(6, 3, 2, 8))),
    (ValueError, "k_cache", dict(k_cache=f32(6, 4, 2, 4), v_cache=f32(6, 4, 2, 4))),
]
# values, always read on the CPU (with check_inputs or not)
VALUE_ERRORS = [  # both layouts (capacity 10 or 12)
    (ValueError, "cache_seqlens", dict(cache_seqlens=i32(-1, 5))),
    (ValueError, "cache_seqlens", dict(cache_seqlens=13, k_new=None, v_new=None)),
    (ValueError, "cache_seqlens|k_new", dict(cache_seqlens=None, k_new=f32(2, 13, 2, 8))),
]
CONTIGUOUS_VALUE_ERRORS = [  # capacity 10
    (ValueError, "cache_seqlens", dict(cache_seqlens=i32(3, 9))),  # 9 + 2 new rows > 10
    (ValueError, "cache_seqlens", dict(cache_seqlens=i32(3, 11), k_new=None, v_new=None)),
    (ValueError, "cache_seqlens", dict(cache_seqlens=9)),
]
PAGED_VALUE_ERRORS = [  # capacity 12, 6 pages
    (ValueError, "cache_seqlens", dict(cache_seqlens=i32(3, 11))),  # 11 + 2 new rows > 12
    (ValueError, "cache_seqlens", dict(cache_seqlens=i32(13, 5), k_new=None, v_new=None)),
    (ValueError, "block_table", dict(block_table=i32([4, 0, 2], [-1, 5, 3]))),
    (ValueError, "block_table", dict(block_table=i32([4, 0, 2], [1, 6, 3]))),
    (ValueError, "block_table", dict(block_table=i32([4, 11, 2], [1, 5, 3]))),
    # sequence 0 appends rows 3, 4 (its second page, which is bad); sequence 1 is good
    (ValueError, "block_table", dict(block_table=i32([4, -7, 2], [1, 5, 3]))),
]


def check_raises(exc, pattern: str, changes: dict, paged: bool) -> None:
    """The call with `changes` raises exc matching pattern, and leaves the caches untouched."""
    call = valid_call(paged)
    call.update({n: c(call[n]) if callable(c) else c for n, c in changes.items()})
    k_before, v_before = np.copy(call["k_cache"]), np.copy(call["v_cache"])
    k_cache, v_cache = call["k_cache"], call["v_cache"]
    with pytest.raises(exc, match=pattern):
        run_call(call)
    if k_cache.shape == k_before.shape:
        assert_bitwise_equal(k_cache, k_before, "k_cache after a failed call")
        assert_bitwise_equal(v_cache, v_before, "v_cache after a failed call")


def error_params(cases, layouts):
    """pytest params (exc, pattern, changes, paged) of each case in each layout."""
    for paged in layouts:
        for exc, pattern, changes in cases:
            layout = "paged" if paged else "contiguous"
            yield pytest.param(exc, pattern, changes, paged, id=f"{layout}-{'-'.join(changes)}")


@pytest.mark.parametrize(
    "exc,pattern,changes,paged",
    [
        *error_params(ERRORS, (False, True)),
        *error_params(CONTIGUOUS_ERRORS, (False,)),
        *error_params(PAGED_ERRORS, (True,)),
    ],
)
def test_bad_arguments_raise_naming_the_argument(exc, pattern, changes, paged):
    check_raises(exc, pattern, changes, paged)


@pytest.mark.parametrize("check_inputs", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_lengths_and_pages_outside_the_cache_raise_on_the_cpu(paged, check_inputs):
    """On CPU arrays the lengths and the pages in use are always checked: a length beyond the
    capacity, a negative one, a page outside [0, num_pages) raise ValueError naming them."""
    cases = VALUE_ERRORS + (PAGED_VALUE_ERRORS if paged else CONTIGUOUS_VALUE_ERRORS)
    for exc, pattern, changes in cases:
        check_raises(exc, pattern, dict(changes, check_inputs=check_inputs), paged)


def test_pages_a_sequence_does_not_use_are_not_checked():
    """Block table entries past a sequence's pages in use (its rows and the appended ones) may
    hold anything; the result is the one of a valid table."""
    want_call = valid_call(paged=True)
    want = run_call(dict(want_call))
    call = valid_call(paged=True)
    # sequence 0 uses rows 0..4 (pages 0, 1), sequence 1 rows 0..6 (pages 0, 1)
    call["block_table"] = i32([4, 0, -1], [1, 5, 10**6])
    got = run_call(dict(call))
    for a, b in zip(got, want, strict=True):
        assert_bitwise_equal(a, b)
    assert_bitwise_equal(call["k_cache"], want_call["k_cache"], "k_cache")


def test_cache_seqlens_of_another_library_raises():
    torch = pytest.importorskip("torch")
    call = valid_call(paged=False)
    call["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match="cache_seqlens"):
        run_call(call)


def test_jax_caches_with_new_rows_raise():
    jax = pytest.importorskip("jax")
    call = {n: jax.numpy.asarray(a) for n, a in valid_call(paged=False).items()}
    with pytest.raises(TypeError, match="k_new"):
        run_call(call)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("slopes", [None, "batch"])
def test_jax_functional_wrapper_under_jit_equals_the_plain_api(paged, slopes):
    """cuflash.jax.attention_with_kvcache under jax.jit returns what the plain API returns and
    the caches the plain API leaves behind (written functionally), with the lengths an array."""
    jax = pytest.importorskip("jax")
    import cuflash.jax as cfj

    rng = np.random.default_rng(7)
    batch, seq_q, heads_q, heads_kv, d = 3, 2, 4, 2, 8
    page_size = 5 if paged else 12
    pages = 11 if paged else batch
    k_cache = rng.standard_normal((pages, page_size, heads_kv, d)).astype(np.float32)
    v_cache = rng.standard_normal(k_cache.shape).astype(np.float32)
    table = rng.permutation(pages)[:9].reshape(3, 3).astype(np.int32) if paged else None
    q = rng.standard_normal((batch, seq_q, heads_q, d)).astype(np.float32)
    k_new = rng.standard_normal((batch, 2, heads_kv, d)).astype(np.float32)
    v_new = rng.standard_normal(k_new.shape).astype(np.float32)
    lengths = np.array([0, 5, 10], np.int32)
    alibi = None if slopes is None else rng.uniform(0.1, 1, (batch, heads_q)).astype(np.float32)
    options = {"causal": True, "window": (6, None), "alibi_slopes": alibi}
    k_want, v_want = k_cache.copy(), v_cache.copy()
    o_want, lse_want = cuflash.attention_with_kvcache(
        q, k_want, v_want, lengths, k_new=k_new, v_new=v_new, block_table=table, **options
    )

    @jax.jit
    def step(q, k_cache, v_cache, lengths, k_new, v_new, table, alibi):
        return cfj.attention_with_kvcache(
            q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, block_table=table,
            causal=True, window=(6, None), alibi_slopes=alibi,
        )  # fmt: skip

    o, lse, k_after, v_after = step(q, k_cache, v_cache, lengths, k_new, v_new, table, alibi)
    np.testing.assert_allclose(np.asarray(o), o_want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), lse_want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(k_after), k_want)
    np.testing.assert_array_equal(np.asarray(v_after), v_want)


def test_torch_operator_mutates_the_caches_and_compiles():
    """cuflash.torch.attention_with_kvcache (a custom operator declared as mutating the caches)
    gives the plain API's results and appends, eagerly and under torch.compile(fullgraph=True)."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as cft

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 8, generator=gen, dtype=torch.float64)
    k_cache = torch.randn(2, 10, 2, 8, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(2, 10, 2, 8, generator=gen, dtype=torch.float64)
    k_new = torch.randn(2, 1, 2, 8, generator=gen, dtype=torch.float64)
    v_new = torch.randn(2, 1, 2, 8, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    o_want, lse_want = cuflash.attention_with_kvcache(
        q, k_want, v_want, lengths, k_new=k_new, v_new=v_new, causal=True
    )
    k_got, v_got = k_cache.clone(), v_cache.clone()
    o, lse = cft.attention_with_kvcache(
        q, k_got, v_got, lengths, k_new=k_new, v_new=v_new, causal=True
    )
    assert torch.equal(o, o_want) and torch.equal(lse, lse_want)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)

    def step(q, k_cache, v_cache, k_new, v_new):
        return cft.attention_with_kvcache(q, k_cache, v_cache, 7, k_new=k_new, v_new=v_new)

    k_got, v_got = k_cache.clone(), v_cache.clone()
    o, _ = torch.compile(step, fullgraph=True)(q, k_got, v_got, k_new, v_new)
    assert torch.equal(k_got[:, 7], k_new[:, 0]) and torch.equal(v_got[:, 7], v_new[:, 0])
    want, _ = cuflash.attention_forward(q, k_got[:, :8], v_got[:, :8])
    torch.testing.assert_close(o, want, rtol=0, atol=1e-12)


def test_decoding_copies_whole_tiles_as_boxes_on_sm90_at_head_dims_64_and_128():
    # kernels_cu/kvcache.cu, attention_decode_boxes: on sm_90 the buckets 64 and 128 (rows of one
    # or two 128-byte swizzle rows) also come with key tiles copied as tensor-map boxes; the
    # other buckets and the other devices copy rows. The boxes' instance keeps two blocks a
    # multiprocessor of an H100 (228 KB, 1 KB of it reserved per block), as the rows' does.
    from cuflash import _kernels

    specs = _kernels.kvcache_specs("sm_90a")
    for d in range(1, 257):
        boxes = _kernels.head_dim_bucket(d) in (64, 128)
        assert _kernels.decode_boxes("sm_90a", d) == boxes, d
        assert not _kernels.decode_boxes("sm_80", d)
    for dtype in _kernels.TENSOR_CORE_DTYPES:
        for hd in (64, 128):
            for features in _kernels.DECODE_FEATURE_SETS:
                boxes = _kernels.kvcache_instance("decode", dtype, hd, features, True, boxes=True)
                rows = _kernels.kvcache_instance("decode", dtype, hd, features, True)
                assert boxes in specs and rows in specs
                assert "attention_decode_boxes<" in boxes.name_expression
                assert 2 * (boxes.smem_bytes + 1024) <= 228 * 1024
        with pytest.raises(ValueError, match="boxes"):
            _kernels.kvcache_instance("decode", dtype, 256, 0, True, boxes=True)
    assert not any("decode_boxes" in s.name_expression for s in _kernels.kvcache_specs("sm_80"))
