"""Argument checking: every public call goes through here before any work is done.

A bad argument raises TypeError (wrong kind of thing: not an array, a dtype we do not support,
mixed libraries) or ValueError (right kind, wrong value: shapes, devices, scale, layout), and the
message names the argument, what was expected and what came.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import replace
from typing import Any

import numpy as np

from . import _kernels, _mask, _tma
from ._dlpack import c_contiguous_strides
from ._interop import ArrayInfo, describe, probe
from ._problem import Problem

LAYOUTS = ("bshd", "bhsd")
SUPPORTED_DTYPES = _kernels.DTYPES


def option_kwargs(
    causal: Any, window: Any, softcap: Any, scale: Any, layout: Any
) -> dict[str, Any]:
    """A call's options as the keyword arguments of the API and of check_forward/check_backward
    (the framework wrappers pass them on through here)."""
    return {
        "causal": causal,
        "window": window,
        "softcap": softcap,
        "scale": scale,
        "layout": layout,
    }


def varlen_option_kwargs(causal: Any, window: Any, softcap: Any, scale: Any) -> dict[str, Any]:
    """A packed call's options as keyword arguments of check_varlen_forward/backward."""
    return {"causal": causal, "window": window, "softcap": softcap, "scale": scale}


def check_layout(layout: Any) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be 'bshd' or 'bhsd'; got {type(layout).__name__} {layout!r}")
    if layout not in LAYOUTS:
        raise ValueError(
            f"layout must be 'bshd' (B, N, H, d) or 'bhsd' (B, H, N, d); got {layout!r}"
        )
    return layout


def check_causal(causal: Any) -> bool:
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__} {causal!r}")
    return bool(causal)


def check_window(window: Any, causal: bool) -> tuple[int | None, int | None]:
    """(left, right) of the window argument, None for an unbounded side; causal sets right = 0."""
    if window is None:
        left = right = None
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(
                f"window must be None or a pair (left, right) of ints (-1 or None: unbounded); "
                f"got {type(window).__name__} {window!r}"
            )
        left, right = _window_bound("left", window[0]), _window_bound("right", window[1])
    return left, (0 if causal else right)


def _window_bound(side: str, bound: Any) -> int | None:
    if bound is None:
        return None
    if isinstance(bound, (bool, np.bool_)) or not isinstance(bound, numbers.Integral):
        raise TypeError(
            f"window[{side!r}] must be an int >= 0, -1 or None; got {type(bound).__name__} "
            f"{bound!r}"
        )
    value = int(bound)
    if value < -1:
        raise ValueError(
            f"window's {side} bound must be >= 0, or -1 / None for unbounded; got {value}"
        )
    return None if value == -1 else value


def check_softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(
            f"softcap must be a real number > 0 or None; got {type(softcap).__name__} {softcap!r}"
        )
    value = float(softcap)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"softcap must be a finite number > 0 (or None for none); got {value!r}")
    return value


def _check_alibi(info: ArrayInfo, problem: Problem) -> None:
    """Slopes: float32, (Hq,) or (B, Hq) (for 2-D input (1,) or (1, 1))."""
    if info.dtype != "float32":
        raise TypeError(f"alibi_slopes must have dtype float32; got {info.dtype}")
    shapes = ((problem.heads_q,), (problem.batch, problem.heads_q))
    if info.shape not in shapes:
        raise ValueError(
            f"alibi_slopes must have shape (Hq,) = {shapes[0]} or (B, Hq) = {shapes[1]}; "
            f"got {info.shape}"
        )


def alibi_strides(info: ArrayInfo) -> tuple[int, int, int]:
    """(batch, head, row) element strides of the slopes (batch 0 for one slope per head)."""
    return (0, info.strides[0], 0) if len(info.shape) == 1 else (*info.strides, 0)


def check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"scale must be a real number or None; got {type(scale).__name__} {scale!r}"
        )
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"scale must be a finite number > 0; got {value!r}")
    return value


def _shape_words(layout: str, ndim: int, heads: str) -> str:
    if ndim == 2:
        return "(N, d)"
    return f"(B, N, {heads}, d)" if layout == "bshd" else f"(B, {heads}, N, d)"


def _describe_all(named: list[tuple[Any, str]]) -> list[ArrayInfo]:
    """Checks that the arrays share one library and one device, then describes them."""
    probes = [(obj, name, *probe(obj, name)) for obj, name in named]
    _, first_name, first_lib, first_dev = probes[0]
    for _, name, library, device in probes[1:]:
        if library != first_lib:
            raise TypeError(
                f"{name} is a {library} array but {first_name} is a {first_lib} array; "
                f"pass arrays of one library"
            )
        if device != first_dev:
            raise ValueError(
                f"{name} is on {_device_words(device)} but {first_name} is on "
                f"{_device_words(first_dev)}; all arrays must be on one device"
            )
    return [describe(obj, name, library, device) for obj, name, library, device in probes]


def abstract_info(name: str, shape: tuple[int, ...], dtype: str, device: tuple[str, int]) -> Any:
    """An array known by shape and dtype only (a traced JAX array): C-contiguous, no data yet."""
    return ArrayInfo(None, name, "jax", device, dtype, shape, c_contiguous_strides(shape), 0)


def _device_words(device: tuple[str, int]) -> str:
    return "cpu" if device[0] == "cpu" else f"cuda:{device[1]}"


def _check_dtype(info: ArrayInfo, expected: str | None = None) -> None:
    if expected is None:
        if info.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{info.name} has dtype {info.dtype}; cuflash supports float16, bfloat16, float32 "
                f"and float64"
            )
    elif info.dtype != expected:
        raise TypeError(f"{info.name} must have dtype {expected} (like q); got {info.dtype}")


def _check_last_dim_contiguous(info: ArrayInfo) -> None:
    if info.shape and info.shape[-1] > 1 and all(info.shape) and info.strides[-1] != 1:
        raise ValueError(
            f"{info.name} must have a contiguous last dimension (stride 1); got strides "
            f"{info.strides} for shape {info.shape}. Make a contiguous copy first "
            f"(e.g. .contiguous() in PyTorch, numpy.ascontiguousarray)"
        )


def check_forward(
    q: Any,
    k: Any,
    v: Any,
    alibi_slopes: Any = None,
    *,
    causal: Any = False,
    window: Any = None,
    softcap: Any = None,
    scale: Any = None,
    layout: Any = "bshd",
) -> tuple[Problem, ArrayInfo, ArrayInfo, ArrayInfo, ArrayInfo | None]:
    """(problem, q, k, v, alibi_slopes or None) of a forward call, every argument checked."""
    named = [(q, "q"), (k, "k"), (v, "v")]
    infos = _describe_all(named + _named_alibi(alibi_slopes))
    return check_forward_infos(
        infos, causal=causal, window=window, softcap=softcap, scale=scale, layout=layout
    )


def check_forward_infos(
    infos: list[ArrayInfo], *, causal: Any, window: Any, softcap: Any, scale: Any, layout: Any
) -> tuple[Problem, ArrayInfo, ArrayInfo, ArrayInfo, ArrayInfo | None]:
    """check_forward on described arrays: q, k, v (and the slopes). cuflash.jax describes the
    abstract arrays of a trace this way (abstract_info)."""
    options = _check_options(causal, window, softcap, layout)
    problem, qi, ki, vi = _check_qkv(*infos[:3], scale, options)
    problem, alibi = _alibi_of(problem, infos[3:])
    return problem, qi, ki, vi, alibi


def _named_alibi(alibi_slopes: Any) -> list[tuple[Any, str]]:
    return [] if alibi_slopes is None else [(alibi_slopes, "alibi_slopes")]


def _alibi_of(problem: Problem, rest: list[ArrayInfo]) -> tuple[Problem, ArrayInfo | None]:
    """The problem with its ALiBi flag, and the slopes' info (None without slopes)."""
    if not rest:
        return problem, None
    _check_alibi(rest[0], problem)
    return replace(problem, alibi=True), rest[0]


def _check_options(causal: Any, window: Any, softcap: Any, layout: Any) -> dict[str, Any]:
    causal = check_causal(causal)
    return {
        "layout": check_layout(layout),
        "window": check_window(window, causal),
        "softcap": check_softcap(softcap),
    }


def _check_qkv(
    qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo, scale: Any, options: dict[str, Any]
) -> tuple[Problem, ArrayInfo, ArrayInfo, ArrayInfo]:
    layout = options["layout"]
    infos = [qi, ki, vi]
    if options.get("fp8"):
        if qi.dtype != _kernels.FP8_DTYPE:
            raise TypeError(
                f"q must have dtype {_kernels.FP8_DTYPE} for attention_forward_fp8; got {qi.dtype}"
            )
    else:
        _check_dtype(qi)
    _check_dtype(ki, qi.dtype)
    _check_dtype(vi, qi.dtype)

    ndim = len(qi.shape)
    if ndim not in (2, 4):
        raise ValueError(
            f"q must be a 4-D array {_shape_words(layout, 4, 'Hq')} for layout={layout!r} or a "
            f"2-D array (N, d); got shape {qi.shape}"
        )
    for info in (ki, vi):
        if len(info.shape) != ndim:
            raise ValueError(
                f"{info.name} must be {ndim}-D like q, {_shape_words(layout, ndim, 'Hkv')}; "
                f"got shape {info.shape}"
            )
    if ki.shape != vi.shape:
        raise ValueError(f"k and v must have the same shape; got k {ki.shape} and v {vi.shape}")

    if ndim == 2:
        batch, heads_q, heads_kv = 1, 1, 1
        (seq_q, d), (seq_k, dk) = qi.shape, ki.shape
        layout = "bshd"
    elif layout == "bshd":
        batch, seq_q, heads_q, d = qi.shape
        bk, seq_k, heads_kv, dk = ki.shape
    else:
        batch, heads_q, seq_q, d = qi.shape
        bk, heads_kv, seq_k, dk = ki.shape
    if ndim == 4 and bk != batch:
        raise ValueError(f"k and v must have batch size {batch} like q; got shape {ki.shape}")
    if dk != d:
        raise ValueError(
            f"k and v must have head dim {d} like q (last dimension); got k shape {ki.shape}"
        )
    if d == 0:
        raise ValueError(
            f"the head dim (last dimension of q, k, v) must be at least 1; got {qi.shape}"
        )
    if d > _kernels.MAX_HEAD_DIM:
        raise ValueError(
            f"the head dim (last dimension of q, k, v) must be at most {_kernels.MAX_HEAD_DIM}; "
            f"got {d}"
        )
    if (heads_kv == 0 and heads_q != 0) or (heads_kv and heads_q % heads_kv):
        raise ValueError(
            f"the number of query heads ({heads_q}) must be a multiple of the number of key/value "
            f"heads ({heads_kv}); got q shape {qi.shape}, k shape {ki.shape} (layout={layout!r})"
        )
    for info in infos:
        _check_last_dim_contiguous(info)
    for name, seq in (("q", seq_q), ("k", seq_k)):
        if seq >= _mask.MAX_SEQ:
            raise ValueError(
                f"sequence length of {name} must be below 2**29 = {_mask.MAX_SEQ}; got {seq}"
            )
    problem = Problem(
        batch,
        heads_q,
        heads_kv,
        seq_q,
        seq_k,
        d,
        qi.dtype,
        layout,
        ndim == 2,
        options["window"],
        check_scale(scale, d),
        qi.device,
        qi.library,
        options["softcap"],
    )
    return problem, qi, ki, vi


def check_fp8_forward(
    q: Any,
    k: Any,
    v: Any,
    descales: tuple[Any, Any, Any],
    *,
    causal: Any = False,
    window: Any = None,
    scale: Any = None,
    layout: Any = "bshd",
) -> tuple[Problem, ArrayInfo, ArrayInfo, ArrayInfo, tuple[ArrayInfo | None, ...]]:
    """(problem, q, k, v, the three descale factors' infos or None) of attention_forward_fp8:
    4-D e4m3 q, k, v, d a multiple of 16, strides the TMA unit can read (16-byte multiples; the
    GPU plan checks the pointers per call), descale factors float32 (B, Hkv). CPU arrays are held
    to the same rules, so that a call behaves alike on both backends."""
    names = ("q_descale", "k_descale", "v_descale")
    named = [(q, "q"), (k, "k"), (v, "v")]
    named += [(x, name) for x, name in zip(descales, names, strict=True) if x is not None]
    infos = _describe_all(named)
    options = _check_options(causal, window, None, layout)
    problem, qi, ki, vi = _check_qkv(*infos[:3], scale, {**options, "fp8": True})
    if problem.two_d:
        raise ValueError(f"attention_forward_fp8 takes 4-D q, k, v; got q shape {qi.shape}")
    if problem.head_dim % 16:
        raise ValueError(
            "attention_forward_fp8 needs a head dim that is a multiple of 16; "
            f"got {problem.head_dim}"
        )
    for info in (qi, ki, vi):
        sb, sh, ss = problem.bhs_strides(info.strides)
        if _tma.tma_strides(problem.map_shape(info.name), (ss, sh, sb), 1) is None:
            raise ValueError(
                f"{info.name}'s strides {info.strides} must be multiples of 16 elements (bytes) "
                f"for attention_forward_fp8; make a contiguous copy"
            )
    rest = iter(infos[3:])
    out = []
    for x, name in zip(descales, names, strict=True):
        if x is None:
            out.append(None)
            continue
        info = next(rest)
        if info.dtype != "float32":
            raise TypeError(f"{name} must have dtype float32; got {info.dtype}")
        expected = (problem.batch, problem.heads_kv)
        if info.shape != expected:
            raise ValueError(f"{name} must have shape (B, Hkv) = {expected}; got {info.shape}")
        out.append(info)
    return problem, qi, ki, vi, tuple(out)


def check_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    alibi_slopes: Any = None,
    *,
    causal: Any = False,
    window: Any = None,
    softcap: Any = None,
    scale: Any = None,
    layout: Any = "bshd",
) -> tuple[Problem, ArrayInfo, ArrayInfo, ArrayInfo, ArrayInfo, ArrayInfo, ArrayInfo, Any]:
    """(problem, do, q, k, v, o, lse, alibi_slopes or None) of a backward call."""
    named = [(q, "q"), (k, "k"), (v, "v"), (do, "do"), (o, "o"), (lse, "lse")]
    infos = _describe_all(named + _named_alibi(alibi_slopes))
    return check_backward_infos(
        infos, causal=causal, window=window, softcap=softcap, scale=scale, layout=layout
    )


def check_backward_infos(
    infos: list[ArrayInfo], *, causal: Any, window: Any, softcap: Any, scale: Any, layout: Any
) -> tuple[Problem, ArrayInfo, ArrayInfo, ArrayInfo, ArrayInfo, ArrayInfo, ArrayInfo, Any]:
    """check_backward on described arrays: q, k, v, do, o, lse (and the slopes)."""
    options = _check_options(causal, window, softcap, layout)
    problem, qi, ki, vi = _check_qkv(*infos[:3], scale, options)
    doi, oi, lsei = infos[3:6]
    _check_outputs_like(problem, qi, doi, oi, lsei, "(N,)" if problem.two_d else "(B, Hq, Nq)")
    problem, alibi = _alibi_of(problem, infos[6:])
    return problem, doi, qi, ki, vi, oi, lsei, alibi


# ---------------------------------------------------------------------------------------------
# Packed variable-length sequences (attention_varlen_*)


def check_varlen_forward(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    alibi_slopes: Any = None,
    *,
    max_seqlen_q: Any = None,
    max_seqlen_k: Any = None,
    check_seqlens: Any = False,
    causal: Any = False,
    window: Any = None,
    softcap: Any = None,
    scale: Any = None,
) -> tuple[Problem, list[ArrayInfo], Any]:
    """(problem, [q, k, v, alibi or None, cu_seqlens_q, cu_seqlens_k], offsets or None) of a
    packed forward call; offsets (cuflash/_varlen.py, Offsets) when they were read to the host."""
    named = [(q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q")]
    named += [(cu_seqlens_k, "cu_seqlens_k")] + _named_alibi(alibi_slopes)
    infos = _describe_all(named)
    qi, ki, vi, cqi, cki = infos[:5]
    options = _check_options(causal, window, softcap, "bshd")
    problem, offsets = _check_packed(
        qi, ki, vi, cqi, cki, scale, options, max_seqlen_q, max_seqlen_k, check_seqlens
    )
    problem, alibi = _alibi_of(problem, infos[5:])
    return problem, [qi, ki, vi, alibi, cqi, cki], offsets


def check_varlen_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    alibi_slopes: Any = None,
    **options: Any,
) -> tuple[Problem, list[ArrayInfo], Any]:
    """(problem, [do, q, k, v, o, lse, alibi or None, cu_seqlens_q, cu_seqlens_k], offsets) of a
    packed backward call."""
    problem, (qi, ki, vi, alibi, cqi, cki), offsets = check_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, **options
    )
    doi, oi, lsei = _describe_all([(q, "q"), (do, "do"), (o, "o"), (lse, "lse")])[1:]
    _check_outputs_like(problem, qi, doi, oi, lsei, "(Hq, Tq)")
    return problem, [doi, qi, ki, vi, oi, lsei, alibi, cqi, cki], offsets


def _check_outputs_like(
    problem: Problem, qi: ArrayInfo, doi: ArrayInfo, oi: ArrayInfo, lsei: ArrayInfo, words: str
) -> None:
    """A backward's do and o (q's dtype and shape) and lse (the forward's dtype and shape, `words`
    naming that shape)."""
    for info in (doi, oi):
        _check_dtype(info, qi.dtype)
        if info.shape != qi.shape:
            raise ValueError(f"{info.name} must have the shape of q {qi.shape}; got {info.shape}")
        _check_last_dim_contiguous(info)
    if lsei.dtype != problem.lse_dtype:
        raise TypeError(
            f"lse must have dtype {problem.lse_dtype} (as the forward returns it for "
            f"{problem.dtype} inputs); got {lsei.dtype}"
        )
    if lsei.shape != problem.lse_shape:
        raise ValueError(f"lse must have shape {words} = {problem.lse_shape}; got {lsei.shape}")


def _check_max_seqlen(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0 or None; got {type(value).__name__} {value!r}")
    if int(value) < 0 or int(value) >= _mask.MAX_SEQ:
        raise ValueError(f"{name} must be in [0, 2**29); got {int(value)}")
    return int(value)


def _check_packed(
    qi: ArrayInfo,
    ki: ArrayInfo,
    vi: ArrayInfo,
    cqi: ArrayInfo,
    cki: ArrayInfo,
    scale: Any,
    options: dict[str, Any],
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    check_seqlens: Any,
) -> tuple[Problem, Any]:
    from . import _varlen

    for info in (qi, ki, vi):
        _check_dtype(info, None if info is qi else qi.dtype)
        if len(info.shape) != 3:
            heads = "Hq" if info is qi else "Hkv"
            raise ValueError(
                f"{info.name} must be a 3-D packed array (T, {heads}, d); got shape {info.shape}"
            )
        _check_last_dim_contiguous(info)
    if ki.shape != vi.shape:
        raise ValueError(f"k and v must have the same shape; got k {ki.shape} and v {vi.shape}")
    (total_q, heads_q, d), (total_k, heads_kv, dk) = qi.shape, ki.shape
    if dk != d:
        raise ValueError(f"k and v must have head dim {d} like q; got k shape {ki.shape}")
    if d == 0 or d > _kernels.MAX_HEAD_DIM:
        raise ValueError(
            f"the head dim (last dimension of q, k, v) must be in 1..{_kernels.MAX_HEAD_DIM}; "
            f"got {d}"
        )
    if (heads_kv == 0 and heads_q != 0) or (heads_kv and heads_q % heads_kv):
        raise ValueError(
            f"the number of query heads ({heads_q}) must be a multiple of the number of key/value "
            f"heads ({heads_kv}); got q shape {qi.shape}, k shape {ki.shape}"
        )
    for name, total in (("q", total_q), ("k", total_k)):
        if total >= _mask.MAX_SEQ:
            raise ValueError(f"{name} must have fewer than 2**29 rows; got {total}")
    for info in (cqi, cki):
        if info.dtype != "int32":
            raise TypeError(f"{info.name} must have dtype int32; got {info.dtype}")
        if len(info.shape) != 1 or info.shape[0] < 1:
            raise ValueError(
                f"{info.name} must be a 1-D array of B + 1 >= 1 offsets; got shape {info.shape}"
            )
        if info.shape[0] > 1 and info.strides[0] != 1:
            raise ValueError(f"{info.name} must be contiguous; got stride {info.strides[0]}")
    if cki.shape != cqi.shape:
        raise ValueError(
            f"cu_seqlens_k must have the length of cu_seqlens_q ({cqi.shape[0]} = B + 1); got "
            f"{cki.shape[0]}"
        )
    if not isinstance(check_seqlens, (bool, np.bool_)):
        raise TypeError(f"check_seqlens must be a bool; got {type(check_seqlens).__name__}")
    given = [
        None if m is None else _check_max_seqlen(n, m)
        for n, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))
    ]
    offsets = None
    if check_seqlens or None in given or qi.device[0] == "cpu":
        offsets = _varlen.read_offsets(cqi, cki, total_q, total_k)
        for name, longest, value in zip(
            ("max_seqlen_q", "max_seqlen_k"),
            (offsets.longest_q, offsets.longest_k),
            given,
            strict=True,
        ):
            if value is not None and value < longest:
                raise ValueError(
                    f"{name} must be at least the longest sequence's length ({longest}); got "
                    f"{value}"
                )
        given = [
            offsets.longest_q if given[0] is None else given[0],
            offsets.longest_k if given[1] is None else given[1],
        ]
    problem = Problem(
        cqi.shape[0] - 1,
        heads_q,
        heads_kv,
        given[0],
        given[1],
        d,
        qi.dtype,
        "bshd",
        False,
        options["window"],
        check_scale(scale, d),
        qi.device,
        qi.library,
        options["softcap"],
        packed=True,
        total_q=total_q,
        total_k=total_k,
    )
    return problem, offsets
