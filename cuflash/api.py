"""The public API: exact attention forward and backward for any DLPack array.

Shapes (``layout="bshd"``, the FlashAttention / JAX order): q ``(B, Nq, Hq, d)``, k and v
``(B, Nk, Hkv, d)``; ``layout="bhsd"`` (the PyTorch SDPA order): ``(B, H, N, d)``. A 2-D ``(N, d)``
array is one sequence with one head. ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention;
query head h reads key/value head ``h // (Hq // Hkv)``).

Causal masking and sliding windows are aligned to the bottom-right corner: query i sees key j when
``j <= i + Nk - Nq`` (causal), or ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (window). The
score is ``S = scale * q . k``, then the softcap, then ALiBi, then the mask. A query row that sees
no key gives o = 0, lse = -inf and zero gradients.

dtypes: float16 and bfloat16 run on the tensor cores with float32 accumulation; float32 and
float64 run on an exact path. Outputs have the input dtype; lse is float32 (float64 for float64
inputs), shape ``(B, Hq, Nq)`` (``(N,)`` for 2-D input).

CUDA inputs run on their device, on the current stream of the library that owns them; CPU inputs
(NumPy, torch CPU, JAX CPU) run the NumPy backend with the same semantics. Results come back as
arrays of the caller's library.
"""

from __future__ import annotations

import os
from typing import Any

from . import _plans, _validate

Array = Any  # any object with __dlpack__ / __dlpack_device__ (NumPy, CuPy, torch, JAX, ...)


def attention_forward(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> tuple[Array, Array]:
    """Attention output and logsumexp.

    Args:
        q: queries, ``(B, Nq, Hq, d)`` for ``layout="bshd"``, ``(B, Hq, Nq, d)`` for ``"bhsd"``,
            or ``(Nq, d)``; float16, bfloat16, float32 or float64; last dimension contiguous.
        k, v: keys and values, ``(B, Nk, Hkv, d)`` (or the ``bhsd`` / 2-D equivalents), same
            dtype and device as q; ``Hq % Hkv == 0``.
        causal: bottom-right aligned causal mask (query i sees key j iff ``j <= i + Nk - Nq``);
            with a window it sets the window's right bound to 0.
        window: ``(left, right)`` sliding window around the bottom-right diagonal: query i sees
            key j iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``; ints >= 0, or -1 /
            None for no bound on that side (FlashAttention's ``window_size``). Default: none.
        softcap: ``S = softcap * tanh(S / softcap)`` (Gemma 2), a finite number > 0; default none.
        alibi_slopes: float32 array ``(Hq,)`` or ``(B, Hq)`` of q's library and device: adds
            ``-slope * |i + Nk - Nq - j|`` to the score of query i and key j (FlashAttention's
            convention). Applied after the softcap, before the mask.
        scale: softmax scale, a finite number > 0; defaults to ``1 / sqrt(d)``.
        layout: ``"bshd"`` or ``"bhsd"`` (ignored for 2-D input).

    Returns:
        ``(o, lse)``: o shaped and typed like q; lse ``(B, Hq, Nq)`` (``(Nq,)`` for 2-D input)
        holding ``log(sum_j exp(S_ij))`` over the keys row i sees (S after scale, softcap and
        ALiBi), float32 (float64 for float64 input), ``-inf`` for a row that sees no key. Arrays
        of q's library.

    Raises:
        TypeError: an argument is not an array, has an unsupported dtype, or libraries are mixed;
            causal is not a bool, scale or softcap not a real number, window not a pair of ints,
            layout not a string, alibi_slopes not float32.
        ValueError: shapes disagree, arrays are on different devices, the head dim is 0 or above
            256, the last dimension is not contiguous, scale or softcap is not finite and > 0, a
            window bound is below -1, alibi_slopes has the wrong shape, or layout is neither
            "bshd" nor "bhsd".
    """
    arrays = (q, k, v) if alibi_slopes is None else (q, k, v, alibi_slopes)
    key = _plans.signature("forward", arrays, causal, window, softcap, scale, layout)
    plan = _plans.get(key)
    if plan is not None:  # this signature was validated before
        return plan.call_arrays(arrays)
    options = _validate.option_kwargs(causal, window, softcap, scale, layout)
    problem, qi, ki, vi, alibi = _validate.check_forward(q, k, v, alibi_slopes, **options)
    if problem.device[0] == "cpu":
        from . import _cpu

        return _cpu.forward(problem, qi, ki, vi, alibi)
    from . import _cuda

    plan = _cuda.ForwardPlan(problem, qi, ki, vi, poison=poison_outputs(), alibi=alibi)
    _plans.put(key, plan)
    return plan(*(info.ptr for info in (qi, ki, vi, alibi) if info is not None))


def attention_forward_fp8(
    q: Array,
    k: Array,
    v: Array,
    *,
    q_descale: Array | None = None,
    k_descale: Array | None = None,
    v_descale: Array | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> tuple[Array, Array]:
    """The forward on float8_e4m3fn inputs (FlashAttention-3's FP8 forward), on sm_90 GPUs.

    CPU arrays (torch CPU, NumPy with ml_dtypes' float8_e4m3fn) run the NumPy backend: the
    float64 forward of the dequantised inputs, O rounded to bfloat16 (P is not rounded there).

    Computes attention of the dequantised inputs, ``q_descale * q`` (and k, v likewise): the
    scores ``S = scale * q_descale * k_descale * (q . k)`` on the tensor cores from the e4m3
    values, P rounded to e4m3 for ``P V`` (FlashAttention-3's choice: about 2^-4 relative per
    probability), accumulation in float32, then ``O = v_descale * P V / rowsum(P)``.

    Args:
        q, k, v: float8_e4m3fn arrays (PyTorch's ``torch.float8_e4m3fn``), 4-D as in
            :func:`attention_forward`; d a multiple of 16 up to 256; strides multiples of 16
            elements and (on the GPU) 16-byte aligned data (contiguous arrays are).
        q_descale, k_descale, v_descale: float32 ``(B, Hkv)`` arrays of the same library and
            device: the factor each (batch, key/value head) of q (its query heads), k and v is
            multiplied by; None stands for 1.
        causal, window, scale, layout: as in :func:`attention_forward` (no softcap or ALiBi).

    Returns:
        ``(o, lse)``: o bfloat16, shaped like q; lse float32 ``(B, Hq, Nq)``, over the dequantised
        scores.

    Raises:
        TypeError: q, k or v is not float8_e4m3fn, a descale factor is not float32, or an option
            has the wrong type (as in :func:`attention_forward`).
        ValueError: q is 2-D, d is not a multiple of 16 (or above 256), strides or data pointers
            are not 16-byte multiples, a descale factor is not (B, Hkv), or the GPU is not
            sm_90; and the shape errors of :func:`attention_forward`.
    """
    descales = (q_descale, k_descale, v_descale)
    given = tuple(x for x in descales if x is not None)
    kind = "forward_fp8:" + "".join("0" if x is None else "1" for x in descales)
    arrays = (q, k, v, *given)
    key = _plans.signature(kind, arrays, causal, window, None, scale, layout)
    plan = _plans.get(key)
    if plan is not None:  # this signature was validated before
        return plan.call_arrays(arrays, tuple(x is not None for x in descales))
    problem, qi, ki, vi, infos = _validate.check_fp8_forward(
        q, k, v, descales, causal=causal, window=window, scale=scale, layout=layout
    )
    if problem.device[0] == "cpu":
        from . import _cpu

        return _cpu.forward_fp8(problem, qi, ki, vi, infos)
    from . import _cuda

    plan = _cuda.Fp8ForwardPlan(problem, qi, ki, vi, infos, poison=poison_outputs())
    _plans.put(key, plan)
    return plan(qi.ptr, ki.ptr, vi.ptr, tuple(0 if i is None else i.ptr for i in infos))


def attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> Array:
    """``softmax(S) v``: the output of :func:`attention_forward` without the lse."""
    return attention_forward(
        q,
        k,
        v,
        causal=causal,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        scale=scale,
        layout=layout,
    )[0]


def attention_backward(
    do: Array,
    q: Array,
    k: Array,
    v: Array,
    o: Array,
    lse: Array,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> tuple[Array, Array, Array]:
    """Gradients of ``sum(o * do)`` with respect to q, k and v.

    Args:
        do: gradient of the output, shaped and typed like q.
        q, k, v, causal, window, softcap, alibi_slopes, scale, layout: as given to
            :func:`attention_forward`.
        o, lse: what :func:`attention_forward` returned for them.

    Returns:
        ``(dq, dk, dv)`` shaped and typed like q, k and v; with grouped heads dk and dv sum over
        the query heads of each group. The gradient goes through the softcap's tanh; the slopes
        get none. Deterministic: the same inputs give the same bits.

    Raises:
        TypeError, ValueError: as :func:`attention_forward`, and for ``do``, ``o`` or ``lse`` of
            the wrong shape, dtype, library or device.
    """
    arrays = (do, q, k, v, o, lse) if alibi_slopes is None else (do, q, k, v, o, lse, alibi_slopes)
    key = _plans.signature("backward", arrays, causal, window, softcap, scale, layout)
    plan = _plans.get(key)
    if plan is not None:
        return plan.call_arrays(arrays)
    options = _validate.option_kwargs(causal, window, softcap, scale, layout)
    problem, *infos = _validate.check_backward(do, q, k, v, o, lse, alibi_slopes, **options)
    if problem.device[0] == "cpu":
        from . import _cpu

        return _cpu.backward(problem, *infos)
    from . import _cuda

    plan = _cuda.BackwardPlan(problem, *infos[:6], poison=poison_outputs(), alibi=infos[6])
    _plans.put(key, plan)
    return plan(*(info.ptr for info in infos if info is not None))


def poison_outputs() -> bool:
    """Whether new plans fill their outputs with NaN before the kernels run (the environment
    variable CUFLASH_POISON_OUTPUTS=1; read when a plan is built, never per call): a debugging
    aid that makes every element a kernel fails to write show up. The GPU tests run so."""
    return os.environ.get("CUFLASH_POISON_OUTPUTS") == "1"


# ---------------------------------------------------------------------------------------------
# Packed variable-length sequences


def attention_varlen_forward(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    check_seqlens: bool = False,
) -> tuple[Array, Array]:
    """Attention over B sequences packed without padding (FlashAttention's varlen).

    Args:
        q: ``(Tq, Hq, d)``, the queries of every sequence one after the other; k, v:
            ``(Tk, Hkv, d)``. dtypes, head dims, grouped heads and views as attention_forward.
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)`` offsets, of q's library and device:
            sequence b's queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q, its keys
            rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v. They start at 0, never
            decrease and end at Tq (Tk). Empty sequences and Nq != Nk are allowed.
        max_seqlen_q, max_seqlen_k: the longest sequence's query rows and keys. Given both, the
            call copies nothing to the host and never synchronises (CUDA graphs, torch.compile):
            the offsets are trusted. Malformed offsets then give unspecified values but never a
            read or write outside q, k, v and the outputs (each sequence is clamped to the arrays'
            rows and to max_seqlen). Omitted (or check_seqlens=True, or CPU arrays): the offsets
            are copied to the host once and checked, and a malformed one raises ValueError.
        causal, window, softcap, alibi_slopes, scale: as attention_forward, per sequence (causal
            and windows aligned to each sequence's bottom-right corner); slopes ``(Hq,)`` or
            ``(B, Hq)``.
        check_seqlens: check the offsets (one device-to-host copy) even when both max_seqlen are
            given.

    Returns:
        ``(o, lse)``: o like q; lse ``(Hq, Tq)`` float32 (float64 for float64 input). Each
        sequence's rows are what attention_forward gives for that sequence alone.
    """
    from . import _varlen

    problem, infos, offsets = _validate.check_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        check_seqlens=check_seqlens,
        **_validate.varlen_option_kwargs(causal, window, softcap, scale),
    )
    qi, ki, vi, alibi, cqi, cki = infos
    if problem.device[0] == "cpu":
        return _varlen.cpu_forward(problem, qi, ki, vi, alibi, offsets)
    from . import _cuda

    plan = _cuda.ForwardPlan(problem, qi, ki, vi, poison=poison_outputs(), alibi=alibi)
    return plan(*(i.ptr for i in (qi, ki, vi, alibi, cqi, cki) if i is not None))


def attention_varlen(
    q: Array,
    k: Array,
    v: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    **options: Any,
) -> Array:
    """The output of :func:`attention_varlen_forward` without the lse (same keywords)."""
    return attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)[0]


def attention_varlen_backward(
    do: Array,
    q: Array,
    k: Array,
    v: Array,
    o: Array,
    lse: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    check_seqlens: bool = False,
) -> tuple[Array, Array, Array]:
    """Gradients of :func:`attention_varlen_forward`: ``(dq, dk, dv)`` like q, k and v, each
    sequence's what attention_backward gives for it alone; o and lse as the forward returned
    them. Keywords and the offsets' handling as the forward. Deterministic."""
    from . import _varlen

    problem, infos, offsets = _validate.check_varlen_backward(
        do,
        q,
        k,
        v,
        o,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        check_seqlens=check_seqlens,
        **_validate.varlen_option_kwargs(causal, window, softcap, scale),
    )
    doi, qi, ki, vi, oi, lsei, alibi, cqi, cki = infos
    if problem.device[0] == "cpu":
        return _varlen.cpu_backward(problem, doi, qi, ki, vi, oi, lsei, alibi, offsets)
    from . import _cuda

    plan = _cuda.BackwardPlan(
        problem, doi, qi, ki, vi, oi, lsei, poison=poison_outputs(), alibi=alibi
    )
    pointers = (doi, qi, ki, vi, oi, lsei, alibi, cqi, cki)
    return plan(*(i.ptr for i in pointers if i is not None))


def combine(o_partials: Array, lse_partials: Array, *, layout: str = "bshd") -> tuple[Array, Array]:
    """Attention over the union of disjoint key sets from each set's result.

    Args:
        o_partials: what attention_forward returned for each key set (same queries), stacked on
            a new first axis: ``(S, B, Nq, Hq, d)`` (bshd), ``(S, B, Hq, Nq, d)`` (bhsd) or
            ``(S, Nq, d)``; float16, bfloat16, float32 or float64.
        lse_partials: their lse, stacked the same way: ``(S, B, Hq, Nq)`` or ``(S, Nq)``.
        layout: "bshd" or "bhsd", as the parts were computed.

    Returns:
        ``(o, lse)`` as attention_forward over every key set together would return them (up to
        rounding): merged in float32 (float64 for float64 parts), o in the parts' dtype, lse
        float32 (float64). Rows that see no key in any part give o = 0 and lse = -inf. Arrays of
        the parts' library (NumPy, CuPy, PyTorch, JAX, traced values included) on their device.
    """
    from . import _combine

    bshd = _combine.check(o_partials, lse_partials, layout)
    return _combine.merge(o_partials, lse_partials, bshd)


# ---------------------------------------------------------------------------------------------
# KV cache


def attention_with_kvcache(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    cache_seqlens: Array | int | None = None,
    *,
    k_new: Array | None = None,
    v_new: Array | None = None,
    block_table: Array | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: Array | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    check_inputs: bool = False,
) -> tuple[Array, Array]:
    """Attention of new queries over a key/value cache (decoding, chunked prefill), after writing
    k_new / v_new into the cache in place (FlashAttention's ``flash_attn_with_kvcache``).

    Args:
        q: ``(B, Nq, Hq, d)``, float16, bfloat16, float32 or float64; Nq from 1 (decoding) up.
        k_cache, v_cache: contiguous caches ``(B, Ncache, Hkv, d)``, or paged caches
            ``(num_pages, page_size, Hkv, d)`` with ``block_table``; q's dtype and device,
            ``Hq % Hkv == 0``. Sequence b's row r lives at ``[b, r]`` (contiguous) or on page
            ``block_table[b, r // page_size]``, slot ``r % page_size`` (paged).
        cache_seqlens: int32 ``(B,)`` (q's library and device) or an int: the rows in use of each
            sequence's cache before the append; None: the whole cache (less the new rows).
        k_new, v_new: ``(B, Nnew, Hkv, d)``, written in place at rows ``cache_seqlens[b] ..``
            of the caches; the call then attends to ``cache_seqlens[b] + Nnew`` keys.
        block_table: int32 ``(B, max_pages)`` page indices of each sequence (paged caches).
        causal, window, softcap, alibi_slopes, scale: as attention_forward, per sequence: Nq
            queries against its keys, aligned bottom-right (the last query sees the last key).
        num_splits: how many parts the keys are split into on the GPU (merged with their lse);
            None picks from the shapes alone, with no device-to-host copy (CUDA graphs).
        check_inputs: read cache_seqlens and block_table to the host and raise ValueError for a
            length beyond the capacity or a page outside the cache (always done on the CPU).
            Without it, GPU calls trust them: bad values give unspecified results but never a
            read or write outside the arrays.

    Returns:
        ``(o, lse)``: o like q; lse ``(B, Hq, Nq)`` float32 (float64 for float64 input): per
        sequence what attention_forward returns over its keys. Arrays of q's library.

    Raises:
        TypeError, ValueError: as attention_forward, and for caches, lengths, new rows, block
            tables or num_splits of the wrong shape, dtype, library or device.
    """
    from . import _kvcache

    named = (
        (q, "q"),
        (k_cache, "k_cache"),
        (v_cache, "v_cache"),
        (cache_seqlens if _kvcache.is_array(cache_seqlens) else None, "cache_seqlens"),
        (k_new, "k_new"),
        (v_new, "v_new"),
        (block_table, "block_table"),
        (alibi_slopes, "alibi_slopes"),
    )
    arrays = tuple(a for a, _ in named if a is not None)
    key = None
    if not check_inputs:  # checked calls read the lengths and pages every time
        base = _plans.signature("kvcache", arrays, causal, window, softcap, scale, "bshd")
        if base is not None:
            present = tuple(name for a, name in named if a is not None)
            lengths = None if _kvcache.is_array(cache_seqlens) else cache_seqlens
            key = (*base, present, type(lengths), lengths, type(num_splits), num_splits)
    plan = _plans.get(key)
    if plan is not None:
        return plan.run(arrays, tuple(_plans.pointers(arrays)))
    call = _kvcache.check(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k_new,
        v_new,
        block_table,
        alibi_slopes,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        num_splits=num_splits,
        check_inputs=check_inputs,
    )
    if call.problem.device[0] == "cpu":
        return _kvcache.cpu_forward(call)
    from . import _kvcache_cuda

    plan = _kvcache_cuda.KVCachePlan(call, poison_outputs())
    _plans.put(key, plan)
    infos = (call.q, call.k_cache, call.v_cache, call.cache_seqlens, call.k_new, call.v_new)
    infos += (call.block_table, call.alibi)
    return plan.run(arrays, tuple(i.ptr for i in infos if i is not None))
