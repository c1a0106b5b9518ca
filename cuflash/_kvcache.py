"""Attention over a key/value cache (attention_with_kvcache): the call's checks and the CPU backend.

A call attends q (B, Nq, Hq, d) to each sequence's cache: contiguous caches (B, Ncache, Hkv, d), or
paged caches (num_pages, page_size, Hkv, d) with a block table (B, max_pages), where row r of
sequence b lives on page block_table[b, r // page_size], slot r % page_size. Sequence b uses its
first cache_seqlens[b] rows; k_new / v_new (B, Nnew, Hkv, d) are first written after them, in
place, and the call attends to cache_seqlens[b] + Nnew keys. Masks are aligned to the bottom-right
corner of each sequence (Nq queries against its keys), as everywhere.

The lengths and the block table are read to the host only on the CPU or when the call asks
(check_inputs); the CUDA kernels clamp every row to the cache (kernels_cu/kvcache.cu, CacheRows).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import _mask, _validate, reference
from ._interop import ArrayInfo, as_float, cpu_result, numpy_view
from ._problem import Problem


@dataclass(frozen=True)
class Cache:
    """The cache's shape beside the call's Problem, whose seq_k is the capacity (the most keys
    one sequence can hold: Ncache, or max_pages * page_size)."""

    paged: bool
    rows: int  # Ncache (contiguous) or page_size (paged)
    num_pages: int  # paged: pages in the cache; contiguous: B
    max_pages: int  # paged: block table columns; contiguous: 1
    seq_new: int  # rows appended (k_new), 0 without
    cache_len: int | None  # rows in use of every sequence when cache_seqlens is an int or None
    num_splits: int | None  # the caller's split of the keys (None: the library picks)

    @property
    def capacity(self) -> int:
        return self.rows * self.max_pages


@dataclass(frozen=True)
class Call:
    """A checked call: its problem, its cache, and the arrays (None where not given)."""

    problem: Problem
    cache: Cache
    q: ArrayInfo
    k_cache: ArrayInfo
    v_cache: ArrayInfo
    cache_seqlens: ArrayInfo | None
    k_new: ArrayInfo | None
    v_new: ArrayInfo | None
    block_table: ArrayInfo | None
    alibi: ArrayInfo | None


_ARRAYS = ("q", "k_cache", "v_cache", "cache_seqlens", "k_new", "v_new", "block_table", "alibi")


def map_arrays(call: Call, change: Any) -> Call:
    """The call with `change(info)` in place of each of its ArrayInfos (absent ones stay None)."""
    infos = {name: getattr(call, name) for name in _ARRAYS}
    return replace(call, **{n: change(i) for n, i in infos.items() if i is not None})


def is_array(cache_seqlens: Any) -> bool:
    """Whether cache_seqlens is an array (not an int, not None)."""
    return cache_seqlens is not None and not isinstance(cache_seqlens, numbers.Integral)


def _check_int_array(info: ArrayInfo, shape: tuple[int, ...], words: str) -> None:
    if info.dtype != "int32":
        raise TypeError(f"{info.name} must have dtype int32; got {info.dtype}")
    if info.shape != shape:
        raise ValueError(f"{info.name} must have shape {words} = {shape}; got {info.shape}")


def _check_4d(info: ArrayInfo, words: str) -> None:
    if len(info.shape) != 4:
        raise ValueError(f"{info.name} must be a 4-D array {words}; got shape {info.shape}")


def check(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    k_new: Any,
    v_new: Any,
    block_table: Any,
    alibi_slopes: Any,
    *,
    causal: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    num_splits: Any,
    check_inputs: Any,
) -> Call:
    """Every argument of attention_with_kvcache checked; lengths and pages checked on the host
    for CPU arrays or with check_inputs."""
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (or neither)")
    if not isinstance(check_inputs, (bool, np.bool_)):
        raise TypeError(f"check_inputs must be a bool; got {type(check_inputs).__name__}")
    seqlens_array = is_array(cache_seqlens)
    if isinstance(cache_seqlens, (bool, np.bool_)):
        raise TypeError(
            f"cache_seqlens must be an int32 array, an int or None; got {cache_seqlens!r}"
        )
    named = [(q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")]
    optional = [
        (cache_seqlens if seqlens_array else None, "cache_seqlens"),
        (k_new, "k_new"),
        (v_new, "v_new"),
        (block_table, "block_table"),
        (alibi_slopes, "alibi_slopes"),
    ]
    present = [(obj, name) for obj, name in optional if obj is not None]
    infos = _validate._describe_all(named + present)
    call = check_described(
        {info.name: info for info in infos},
        None if seqlens_array else cache_seqlens,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        num_splits=num_splits,
    )
    if check_inputs or call.q.device[0] == "cpu":
        check_lengths_and_pages(call)
    return call


def check_described(
    by_name: dict[str, ArrayInfo],
    cache_len: int | None,
    *,
    causal: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    num_splits: Any,
) -> Call:
    """The checks of `check` on described arrays (by name: q, k_cache, v_cache and any of
    cache_seqlens, k_new, v_new, block_table, alibi_slopes; abstract ones under a JAX trace), with
    `cache_len` the int cache_seqlens (None: an array, or the whole cache)."""
    seqlens_array = "cache_seqlens" in by_name
    qi, ki, vi = by_name["q"], by_name["k_cache"], by_name["v_cache"]
    for info in (qi, ki, vi):
        _validate._check_dtype(info, None if info is qi else qi.dtype)
    _check_4d(qi, "(B, Nq, Hq, d)")
    bt = by_name.get("block_table")
    cache_words = "(num_pages, page_size, Hkv, d)" if bt is not None else "(B, Ncache, Hkv, d)"
    _check_4d(ki, cache_words)
    _check_4d(vi, cache_words)
    if ki.shape != vi.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape; got {ki.shape} and {vi.shape}"
        )
    batch, seq_q, heads_q, d = qi.shape
    pages, rows, heads_kv, dk = ki.shape
    if dk != d:
        raise ValueError(f"k_cache must have head dim {d} like q; got shape {ki.shape}")
    if d == 0 or d > 256:
        raise ValueError(f"the head dim (last dimension of q) must be in 1..256; got {d}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"the number of query heads ({heads_q}) must be a multiple of the number of key/value "
            f"heads ({heads_kv}); got q shape {qi.shape}, k_cache shape {ki.shape}"
        )
    for info in [qi, ki, vi] + [by_name[n] for n in ("k_new", "v_new") if n in by_name]:
        _validate._check_last_dim_contiguous(info)
    if bt is None:
        if pages != batch:
            raise ValueError(
                f"k_cache must have batch size {batch} like q (B, Ncache, Hkv, d); got shape "
                f"{ki.shape}"
            )
        max_pages = 1
    else:
        if bt.dtype != "int32":
            raise TypeError(f"block_table must have dtype int32; got {bt.dtype}")
        if len(bt.shape) != 2 or bt.shape[0] != batch:
            raise ValueError(
                f"block_table must have shape (B, max_pages) with B = {batch}; got {bt.shape}"
            )
        if bt.shape[1] > 1 and bt.strides[1] != 1:
            raise ValueError(f"block_table must have contiguous rows; got strides {bt.strides}")
        if rows == 0:
            raise ValueError(f"the page size (k_cache.shape[1]) must be at least 1; got {ki.shape}")
        max_pages = bt.shape[1]
    capacity = rows * max_pages
    seq_new = 0
    if "k_new" in by_name:
        ni, nvi = by_name["k_new"], by_name["v_new"]
        for info in (ni, nvi):
            _validate._check_dtype(info, qi.dtype)
            _check_4d(info, "(B, Nnew, Hkv, d)")
        if ni.shape != nvi.shape:
            raise ValueError(
                f"k_new and v_new must have the same shape; got {ni.shape} and {nvi.shape}"
            )
        if (ni.shape[0], ni.shape[2], ni.shape[3]) != (batch, heads_kv, d):
            raise ValueError(
                f"k_new must have shape (B, Nnew, Hkv, d) = ({batch}, Nnew, {heads_kv}, {d}); got "
                f"{ni.shape}"
            )
        seq_new = ni.shape[1]
        if qi.library == "jax":
            raise TypeError(
                "k_new/v_new with JAX caches: JAX arrays cannot be written in place; use "
                "cuflash.jax.attention_with_kvcache, which returns the updated caches"
            )
    if not seqlens_array:
        if cache_len is None:
            cache_len = capacity - seq_new
            if cache_len < 0:
                raise ValueError(
                    f"k_new has {seq_new} rows but the cache holds only {capacity} per sequence"
                )
        else:
            cache_len = int(cache_len)
            if cache_len < 0:
                raise ValueError(f"cache_seqlens must be >= 0; got {cache_len}")
            if cache_len + seq_new > capacity:
                raise ValueError(
                    f"cache_seqlens ({cache_len}) + the new rows ({seq_new}) exceed the cache's "
                    f"capacity of {capacity} rows per sequence"
                )
    else:
        _check_int_array(by_name["cache_seqlens"], (batch,), "(B,)")
    if num_splits is not None:
        if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
            raise TypeError(f"num_splits must be an int >= 1 or None; got {num_splits!r}")
        if int(num_splits) < 1:
            raise ValueError(f"num_splits must be >= 1 (or None); got {int(num_splits)}")
        num_splits = int(num_splits)
    for name, n in (("q", seq_q), ("k_cache", capacity)):
        if n >= _mask.MAX_SEQ:
            raise ValueError(f"{name}'s sequence length must be below 2**29; got {n}")
    options = _validate._check_options(causal, window, softcap, "bshd")
    problem = Problem(
        batch,
        heads_q,
        heads_kv,
        seq_q,
        capacity,
        d,
        qi.dtype,
        "bshd",
        False,
        options["window"],
        _validate.check_scale(scale, d),
        qi.device,
        qi.library,
        options["softcap"],
    )
    problem, alibi = _validate._alibi_of(
        problem, [by_name[n] for n in ("alibi_slopes",) if n in by_name]
    )
    cache = Cache(bt is not None, rows, pages, max_pages, seq_new, cache_len, num_splits)
    return Call(
        problem,
        cache,
        qi,
        ki,
        vi,
        by_name.get("cache_seqlens"),
        by_name.get("k_new"),
        by_name.get("v_new"),
        bt,
        alibi,
    )


def _host_ints(info: ArrayInfo) -> np.ndarray:
    from ._varlen import _host_copy

    return _host_copy(info)


def lengths(call: Call) -> np.ndarray:
    """Rows in use of each sequence before the append (int64, read to the host)."""
    if call.cache_seqlens is None:
        return np.full(call.problem.batch, call.cache.cache_len, dtype=np.int64)
    return _host_ints(call.cache_seqlens)


def check_lengths_and_pages(call: Call) -> None:
    """cache_seqlens + the new rows within the capacity, and every page a sequence uses (its
    rows in use and the appended ones) a page of the cache."""
    cache = call.cache
    used = lengths(call)
    if call.cache_seqlens is not None:
        if np.any(used < 0):
            b = int(np.argmax(used < 0))
            raise ValueError(f"cache_seqlens must be >= 0; got {used[b]} at index {b}")
        total = used + cache.seq_new
        if np.any(total > cache.capacity):
            b = int(np.argmax(total > cache.capacity))
            raise ValueError(
                f"cache_seqlens[{b}] ({used[b]}) + the new rows ({cache.seq_new}) exceed the "
                f"cache's capacity of {cache.capacity} rows per sequence"
            )
    if call.block_table is not None:
        table = _host_ints(call.block_table).reshape(call.block_table.shape)
        for b, n in enumerate(used + cache.seq_new):
            needed = table[b, : -(-int(n) // cache.rows)] if n > 0 else table[b, :0]
            bad = (needed < 0) | (needed >= cache.num_pages)
            if np.any(bad):
                j = int(np.argmax(bad))
                raise ValueError(
                    f"block_table[{b}, {j}] = {needed[j]} is not a page of the cache (0 .. "
                    f"{cache.num_pages - 1})"
                )


def cache_rows(call: Call, b: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(page, slot) indices of rows 0 .. n - 1 of sequence b (checked lengths and pages)."""
    r = np.arange(n)
    if call.block_table is None:
        return np.full(n, b), r
    table = _host_ints(call.block_table).reshape(call.block_table.shape)
    return table[b, r // call.cache.rows], r % call.cache.rows


def cpu_forward(call: Call) -> tuple[Any, Any]:
    """The append into the NumPy (or torch CPU) caches, in place, then each sequence as the dense
    CPU backend computes it alone (attention_forward over its keys gives the same bits)."""
    from . import _cpu

    p, cache = call.problem, call.cache
    used = lengths(call)
    k_store, v_store = numpy_view(call.k_cache), numpy_view(call.v_cache)
    if cache.seq_new:
        k_new, v_new = numpy_view(call.k_new), numpy_view(call.v_new)
        for b in range(p.batch):
            page, slot = cache_rows(call, b, int(used[b]) + cache.seq_new)
            page, slot = page[used[b] :], slot[used[b] :]
            k_store[page, slot] = k_new[b]
            v_store[page, slot] = v_new[b]
    q = as_float(call.q)
    o = np.zeros(p.q_shape)
    lse = np.full(p.lse_shape, -np.inf)
    slopes = None if call.alibi is None else np.asarray(as_float(call.alibi), dtype=np.float64)
    k_all, v_all = as_float(call.k_cache), as_float(call.v_cache)
    for b in range(p.batch):
        nk = int(used[b]) + cache.seq_new
        if nk == 0 or p.seq_q == 0:
            continue
        page, slot = cache_rows(call, b, nk)
        sub = replace(p, batch=1, seq_k=nk)
        o_b, lse_b = reference.forward_blockwise(
            q[b : b + 1],
            k_all[page, slot][None],
            v_all[page, slot][None],
            window=p.window,
            scale=p.scale,
            layout="bshd",
            softcap=p.softcap,
            alibi_slopes=None
            if slopes is None
            else (slopes if slopes.ndim == 1 else slopes[b : b + 1]),
            **_cpu._blocks(sub),
        )
        o[b], lse[b] = o_b[0], lse_b[0]
    return cpu_result(call.q, o, p.dtype), cpu_result(call.q, lse, p.lse_dtype)
