"""PyTorch integration: differentiable attention, torch.compile support, an SDPA drop-in.

    import cuflash.torch as cft
    o = cft.attention(q, k, v, causal=True)                      # (B, N, H, d), autograd
    o = cft.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, d), SDPA's call
    o, lse = cft.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new=k, v_new=v)  # decoding

The forward and backward are registered as custom operators (``cuflash::attention_forward``,
``cuflash::attention_backward``) with fake implementations, so models that call them compile
under ``torch.compile(fullgraph=True)`` without graph breaks, and with an autograd formula that
saves q, k, v, o and lse and runs the three backward kernels. The kernels run on
``torch.cuda.current_stream()`` of the tensors' device, so the operators also work inside CUDA
graph capture once their kernels are compiled (run one call before capturing). The lse output of
``attention_forward`` is not differentiable.
"""

from __future__ import annotations

import math

import torch

from . import _validate, api

_LSE_DTYPE = {torch.float64: torch.float64}


def _resolve_scale(q: torch.Tensor, scale: float | None) -> float:
    if scale is None:
        d = q.shape[-1]
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    return scale


def _lse_shape(q: torch.Tensor, layout: str) -> tuple[int, ...]:
    if q.dim() == 2:
        return (q.shape[0],)
    if layout == "bshd":
        return (q.shape[0], q.shape[2], q.shape[1])
    return (q.shape[0], q.shape[1], q.shape[2])


# The operators take the options in a schema-friendly form: the window as two ints (-1:
# unbounded), the softcap as a float (0.0: none), the ALiBi slopes as an optional tensor.
def _api_options(causal, window_left, window_right, softcap, scale, layout) -> dict:
    window = None if window_left == window_right == -1 else (window_left, window_right)
    return _validate.option_kwargs(causal, window, softcap or None, scale, layout)


@torch.library.custom_op("cuflash::attention_forward", mutates_args=())
def _attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _api_options(causal, window_left, window_right, softcap, scale, layout)
    return api.attention_forward(q, k, v, alibi_slopes=alibi_slopes, **options)


@_attention_forward.register_fake
def _attention_forward_fake(q, k, v, alibi_slopes, causal, wl, wr, softcap, scale, layout):
    o = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, layout), dtype=_LSE_DTYPE.get(q.dtype, torch.float32))
    return o, lse


@torch.library.custom_op("cuflash::attention_backward", mutates_args=())
def _attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # autograd may hand over a non-contiguous gradient (e.g. from a transpose or an expand)
    do = do if do.stride(-1) == 1 or do.shape[-1] <= 1 else do.contiguous()
    options = _api_options(causal, window_left, window_right, softcap, scale, layout)
    return api.attention_backward(do, q, k, v, o, lse, alibi_slopes=alibi_slopes, **options)


@_attention_backward.register_fake
def _attention_backward_fake(do, q, k, v, o, lse, alibi_slopes, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, alibi_slopes, *options = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, alibi_slopes)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = _attention_backward(do, q, k, v, o, lse, alibi_slopes, *ctx.options)
    return (dq, dk, dv) + (None,) * (1 + len(ctx.options))  # no gradient for slopes or options


_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable :func:`cuflash.attention_forward` (o has a gradient; lse does not, nor do
    the ALiBi slopes). Options as there."""
    left, right = _validate.check_window(window, False)
    softcap = _validate.check_softcap(softcap)
    return _attention_forward(
        q,
        k,
        v,
        alibi_slopes,
        causal,
        -1 if left is None else left,
        -1 if right is None else right,
        0.0 if softcap is None else softcap,
        _resolve_scale(q, scale),
        layout,
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> torch.Tensor:
    """Differentiable exact attention; shapes and semantics as :func:`cuflash.attention`.

    ``layout="bshd"``: q ``(B, Nq, Hq, d)``, k/v ``(B, Nk, Hkv, d)``; ``"bhsd"``:
    ``(B, H, N, d)``. Causal masking and windows are aligned bottom-right (query i sees key j when
    ``j <= i + Nk - Nq``); ``window=(left, right)``, ``softcap`` and ``alibi_slopes`` as in
    :func:`cuflash.attention`. Gradients flow to q, k and v.
    """
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


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (the cases it shares).

    Takes SDPA's arguments and layout, ``(B, H, N, d)`` (or ``(H, N, d)``), and returns the same
    result, differentiable. Not supported (ValueError): ``attn_mask``, ``dropout_p > 0``, and
    ``is_causal=True`` with ``Nq != Nk`` (SDPA aligns that mask top-left, cuflash bottom-right;
    they agree when ``Nq == Nk``). As in SDPA, key/value heads fewer than query heads need
    ``enable_gqa=True``.
    """
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by cuflash; pass attn_mask=None")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0 (cuflash has no dropout); got {dropout_p}")
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"query, key and value must all be 4-D (B, H, N, d) or 3-D (H, N, d); got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query[None], key[None], value[None]
    if is_causal and query.shape[2] != key.shape[2]:
        raise ValueError(
            f"is_causal=True with query length {query.shape[2]} != key length {key.shape[2]}: "
            "SDPA aligns this mask top-left, cuflash bottom-right; call "
            "cuflash.torch.attention(..., causal=True, layout='bhsd') for the bottom-right mask"
        )
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[1]} heads but key has {key.shape[1]}; pass enable_gqa=True "
            "for grouped-query attention (as with SDPA)"
        )
    out = attention(query, key, value, causal=is_causal, scale=scale, layout="bhsd")
    return out[0] if squeeze else out


# ---------------------------------------------------------------------------------------------
# Packed variable-length sequences: the same pattern, with the offsets as tensors and the longest
# lengths as ints (given: no device-to-host copy inside the operators).


@torch.library.custom_op("cuflash::attention_varlen_forward", mutates_args=())
def _attention_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _api_options(causal, window_left, window_right, softcap, scale, "bshd")
    del options["layout"]
    return api.attention_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes=alibi_slopes,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        **options,
    )


@_attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, cu_q, cu_k, alibi_slopes, *options):
    lse_dtype = _LSE_DTYPE.get(q.dtype, torch.float32)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


@torch.library.custom_op("cuflash::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    do = do if do.stride(-1) == 1 or do.shape[-1] <= 1 else do.contiguous()
    options = _api_options(causal, window_left, window_right, softcap, scale, "bshd")
    del options["layout"]
    return api.attention_varlen_backward(
        do,
        q,
        k,
        v,
        o,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes=alibi_slopes,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        **options,
    )


@_attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(do, q, k, v, o, lse, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, alibi_slopes, *options = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi_slopes)
    ctx.options = options
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    grads = _attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, alibi_slopes, *ctx.options)
    return (*grads, None, None, None) + (None,) * len(ctx.options)


_attention_varlen_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def _longest(cu_seqlens: torch.Tensor, given: int | None) -> int:
    """max_seqlen as given, or read from the offsets (a device-to-host copy: a graph break
    under torch.compile; pass it to avoid one)."""
    if given is not None:
        return given
    if cu_seqlens.numel() < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def attention_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable :func:`cuflash.attention_varlen_forward` (o has a gradient; lse, the
    offsets and the slopes do not). Give max_seqlen_q/k for torch.compile without graph breaks
    and CUDA graphs; the operators then trust the offsets (see the plain API)."""
    left, right = _validate.check_window(window, False)
    softcap = _validate.check_softcap(softcap)
    return _attention_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes,
        _longest(cu_seqlens_q, max_seqlen_q),
        _longest(cu_seqlens_k, max_seqlen_k),
        causal,
        -1 if left is None else left,
        -1 if right is None else right,
        0.0 if softcap is None else softcap,
        _resolve_scale(q, scale),
    )


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    **options,
) -> torch.Tensor:
    """Differentiable packed attention: q (Tq, Hq, d), k and v (Tk, Hkv, d), offsets int32
    (B + 1,); keywords as :func:`attention_varlen_forward`."""
    return attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)[0]


# KV cache: one operator that writes k_new / v_new into the caches (declared as mutating them, so
# torch.compile keeps the write) and returns o and lse. Inference only: no autograd formula.


@torch.library.custom_op("cuflash::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    cache_len: int,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _api_options(causal, window_left, window_right, softcap, scale, "bshd")
    del options["layout"]
    return api.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens if cache_seqlens is not None else (None if cache_len < 0 else cache_len),
        k_new=k_new,
        v_new=v_new,
        block_table=block_table,
        alibi_slopes=alibi_slopes,
        num_splits=num_splits or None,
        **options,
    )


@_attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, *rest):
    lse_dtype = _LSE_DTYPE.get(q.dtype, torch.float32)
    batch, seq_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seq_q), dtype=lse_dtype)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int | None = None,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cuflash.attention_with_kvcache` as a custom operator that mutates k_cache and
    v_cache (k_new / v_new are written into them in place), for torch.compile and CUDA graphs.
    Returns (o, lse); no gradients."""
    left, right = _validate.check_window(window, False)
    softcap = _validate.check_softcap(softcap)
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens, cache_len = cache_seqlens, -1
    else:
        if cache_seqlens is not None and (
            isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int)
        ):
            raise TypeError(
                f"cache_seqlens must be an int32 tensor, an int or None; got {cache_seqlens!r}"
            )
        if cache_seqlens is not None and cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0; got {cache_seqlens}")
        seqlens, cache_len = None, -1 if cache_seqlens is None else cache_seqlens
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise TypeError(f"num_splits must be an int >= 1 or None; got {num_splits!r}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None); got {num_splits}")
    return _attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        seqlens,
        cache_len,
        k_new,
        v_new,
        block_table,
        alibi_slopes,
        causal,
        -1 if left is None else left,
        -1 if right is None else right,
        0.0 if softcap is None else softcap,
        _resolve_scale(q, scale),
        num_splits or 0,
    )


# Context parallelism: ring attention over torch.distributed (cuflash/_ring.py).
from ._ring import ring_attention, zigzag_shard, zigzag_unshard  # noqa: E402, F401
