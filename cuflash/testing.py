"""The correctness policy of docs/DESIGN.md, as code shared by tests, demo and benchmark.

A result passes when its error against the float64 reference is at most twice the error of a naive
same-precision computation (inputs rounded to the dtype, matrix products with float32 accumulation
rounded to the dtype, softmax in float32) plus a small absolute term: the rounding noise of the
dtype at the magnitude of the values (the FlashAttention test-suite convention).

Every function takes the array module `xp` (NumPy, or CuPy to do the float64 work on the GPU) and
arrays in (B, H, N, d) order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .reference import visible_mask


def gpu_unavailable_reason() -> str | None:
    """None when a CUDA GPU can be used through CuPy, else why it cannot."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'cuflash[cuda12]' or 'cuflash[cuda13]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return f"no CUDA GPU ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA GPU (device count 0)"


EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
# float64 results are float64 arithmetic in another order than the reference's (exp, long dot
# products, the cancelling sums of dq and dk), while the naive float64 computation is the
# reference itself, with no error to measure: their bound gets a relative term of 2^-34 of the
# output's magnitude instead (about 5e5 units in the last place; the policy asks float32 kernels
# for 1e-4).
F64_RELATIVE = 2.0**-34


def round_to(x: Any, dtype: str, xp: Any = np) -> Any:
    """Values rounded to `dtype` (round to nearest even), returned as float64."""
    if dtype == "float64":
        return x.astype(xp.float64)
    if dtype in ("float16", "float32"):
        return x.astype(dtype).astype(xp.float64)
    bits = x.astype(xp.float32).view(xp.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & xp.uint32(0xFFFF0000)
    out = rounded.view(xp.float32).astype(xp.float64)
    return xp.where(xp.isnan(x), xp.nan, out)


def round_e4m3(x: Any, xp: Any = np) -> Any:
    """Values rounded to float8_e4m3fn (round to nearest even; 3 mantissa bits, subnormals below
    2^-6 in steps of 2^-9, saturated at +-448 as the kernels' satfinite conversion does; NaN
    stays NaN), returned as float64."""
    x = xp.asarray(x, dtype=xp.float64)
    mag = xp.abs(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = xp.floor(xp.log2(xp.where(mag > 0, mag, 1.0)))
    step = xp.exp2(xp.maximum(exponent, -6.0) - 3.0)
    out = xp.minimum(xp.rint(mag / step) * step, 448.0) * xp.sign(x)
    return xp.where(xp.isnan(x), xp.nan, out)


def naive_forward_fp8(
    q: Any,
    k: Any,
    v: Any,
    descales: tuple[Any, Any, Any],
    *,
    causal: bool,
    scale: float,
    window: Any = None,
    xp: Any = np,
) -> tuple[Any, Any]:
    """The FP8 forward computed naively (B, H, N, d inputs holding e4m3 values, descale factors
    (B, Hkv)): scores in float32 from the exact products, times scale and q's and k's factors,
    unnormalised probabilities exp(S - max) rounded to e4m3, P V in float32, times v's factor
    over the float32 row sums, rounded to bfloat16. Returns (o, lse) as float64."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    dq, dk, dv = (xp.repeat(xp.asarray(x, dtype=xp.float32), group, axis=1) for x in descales)
    k, v = _expand_heads(k, hq), _expand_heads(v, hq)
    s = q.astype(xp.float32) @ k.transpose(0, 1, 3, 2).astype(xp.float32)
    s = s * (xp.float32(scale) * dq * dk)[:, :, None, None]
    s = xp.where(_mask(q.shape[2], k.shape[2], causal, window, xp), s, -xp.inf)
    m_safe, e, l_ = _row_exponentials(s, xp)
    o = round_e4m3(e, xp).astype(xp.float32) @ v.astype(xp.float32)
    o = xp.where(l_ > 0, o * dv[:, :, None, None] / xp.where(l_ > 0, l_, 1), 0)
    return round_to(o, "bfloat16", xp), _row_lse(m_safe, l_, xp).astype(xp.float64)


def _matmul(a: Any, b: Any, dtype: str, xp: Any) -> Any:
    """a @ b as a tensor core computes it for `dtype` operands: exact products, float32
    accumulation (float64 for float64), result rounded to the dtype."""
    if dtype == "float64":
        return a @ b
    out = a.astype(xp.float32) @ b.astype(xp.float32)
    return round_to(out, dtype, xp)


def _expand_heads(x: Any, heads_q: int) -> Any:
    return x if x.shape[1] == heads_q else x.repeat(heads_q // x.shape[1], axis=1)


def _fold_heads(dx: Any, heads_kv: int) -> Any:
    b, hq, n, d = dx.shape
    return dx.reshape(b, heads_kv, hq // heads_kv, n, d).sum(axis=2)


def _mask(nq: int, nk: int, causal: bool, window: Any, xp: Any) -> Any:
    return xp.asarray(visible_mask(nq, nk, causal, window))


def _modified_scores(s: Any, softcap: Any, alibi_slopes: Any, xp: Any) -> tuple[Any, Any]:
    """(S', dS'/dS) of scores S (B, H, Nq, Nk) in the work precision: the softcap, then ALiBi
    (slopes (H,) or (B, H); -slope |i + Nk - Nq - j|); dS'/dS is 1 without the softcap."""
    work = s.dtype.type
    dcap = None
    if softcap is not None:
        t = xp.tanh(s / work(softcap))
        s, dcap = work(softcap) * t, 1 - t * t
    if alibi_slopes is not None:
        nq, nk = s.shape[-2:]
        slopes = xp.asarray(alibi_slopes).astype(s.dtype)
        slopes = slopes[None, :] if slopes.ndim == 1 else slopes
        dist = xp.abs(xp.arange(nq)[:, None] + (nk - nq) - xp.arange(nk)[None, :]).astype(s.dtype)
        s = s - slopes[:, :, None, None] * dist
    return s, (xp.ones_like(s) if dcap is None else dcap)


def _naive_scores(
    q: Any, k: Any, dtype: str, scale: float, causal, window, softcap, alibi_slopes, xp: Any
) -> tuple[Any, Any, Any]:
    """(S, dS/dS of the product, visibility) of the naive computation: the score product at
    `dtype` precision, then scale, softcap and ALiBi in the work precision, and the mask."""
    work = xp.float64 if dtype == "float64" else xp.float32
    s = _matmul(q, k.transpose(0, 1, 3, 2), dtype, xp).astype(work) * work(scale)
    s, dcap = _modified_scores(s, softcap, alibi_slopes, xp)
    return s, dcap, _mask(q.shape[2], k.shape[2], causal, window, xp)


def naive_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool,
    scale: float,
    dtype: str,
    xp: Any = np,
    window: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
) -> tuple[Any, Any]:
    """Naive attention at `dtype` precision (float64 = the reference). Inputs (B, H, N, d)
    already rounded to dtype; the softcap and ALiBi (slopes (H,) or (B, H)) in the work precision
    (float32, float64 for float64); returns (o, lse) as float64 arrays."""
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    mods = (causal, window, softcap, alibi_slopes)
    s, _, mask = _naive_scores(q, k, dtype, scale, *mods, xp)
    m_safe, e, l_ = _row_exponentials(xp.where(mask, s, -xp.inf), xp)
    p = xp.where(l_ > 0, e / xp.where(l_ > 0, l_, 1), 0)
    o = _matmul(round_to(p, dtype, xp), v, dtype, xp)
    return o.astype(xp.float64), _row_lse(m_safe, l_, xp).astype(xp.float64)


def _row_exponentials(s: Any, xp: Any) -> tuple[Any, Any, Any]:
    """(row max, 0 for a row with no visible score; exp(s - max); their row sums) of masked
    scores s (-inf where hidden)."""
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else xp.full(s.shape[:-1] + (1,), -xp.inf)
    m_safe = xp.where(xp.isneginf(m), 0, m)
    e = xp.exp(s - m_safe)
    return m_safe, e, e.sum(axis=-1, keepdims=True)


def _row_lse(m_safe: Any, l_: Any, xp: Any) -> Any:
    """lse of _row_exponentials' rows: -inf for a row that sees no key."""
    return xp.where(l_[..., 0] > 0, (m_safe + xp.log(xp.where(l_ > 0, l_, 1)))[..., 0], -xp.inf)


def naive_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    *,
    causal: bool,
    scale: float,
    dtype: str,
    xp: Any = np,
    window: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
) -> tuple[Any, Any, Any]:
    """Naive backward at `dtype` precision (float64 = the reference), (B, H, N, d) arrays; the
    gradient goes through the softcap's tanh."""
    hkv = k.shape[1]
    k, v = _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    work = xp.float64 if dtype == "float64" else xp.float32
    mods = (causal, window, softcap, alibi_slopes)
    s, dcap, mask = _naive_scores(q, k, dtype, scale, *mods, xp)
    mask = mask & ~xp.isneginf(lse)[..., None]
    lse_safe = xp.where(xp.isneginf(lse), 0, lse).astype(work)[..., None]
    p = xp.where(mask, xp.exp(xp.where(mask, s, 0) - lse_safe), 0)
    delta = (do.astype(work) * o.astype(work)).sum(axis=-1, keepdims=True)
    p_r = round_to(p, dtype, xp)
    dv = _matmul(p_r.transpose(0, 1, 3, 2), do, dtype, xp)
    dp = _matmul(do, v.transpose(0, 1, 3, 2), dtype, xp).astype(work)
    ds = round_to(p * (dp - delta) * dcap, dtype, xp)
    dq = round_to(
        _matmul(ds, k, "float64" if dtype == "float64" else "float32", xp) * scale, dtype, xp
    )
    dk = round_to(
        _matmul(ds.transpose(0, 1, 3, 2), q, "float64" if dtype == "float64" else "float32", xp)
        * scale,
        dtype,
        xp,
    )
    return (
        dq.astype(xp.float64),
        _fold_heads(dk, hkv).astype(xp.float64),
        _fold_heads(dv, hkv).astype(xp.float64),
    )


@dataclass(frozen=True)
class Check:
    """One comparison: passed, and the numbers behind the verdict."""

    name: str
    passed: bool
    error: float  # max |got - ref| over finite reference entries
    naive_error: float  # max |naive - ref|
    bound: float  # 2 * naive_error + atol
    relative: float  # ||got - ref|| / ||ref||
    message: str

    @property
    def ratio(self) -> float:
        """error / naive_error: how the kernel compares with the naive same-precision result."""
        return (
            self.error / self.naive_error
            if self.naive_error > 0
            else (0.0 if self.error == 0 else float("inf"))
        )


def compare(name: str, got: Any, ref: Any, naive: Any, dtype: str, xp: Any = np) -> Check:
    """Applies the policy. Non-finite reference entries must be matched exactly (same inf, NaN
    where NaN); NaN where the reference is finite always fails."""
    got, ref, naive = (xp.asarray(x, dtype=xp.float64) for x in (got, ref, naive))
    with np.errstate(invalid="ignore"):
        return _compare(name, got, ref, naive, dtype, xp)


def _compare(name: str, got: Any, ref: Any, naive: Any, dtype: str, xp: Any) -> Check:
    finite = xp.isfinite(ref)
    same_nonfinite = bool(
        xp.all(xp.where(finite, True, (got == ref) | (xp.isnan(got) & xp.isnan(ref))))
    )
    bad_nan = int(xp.count_nonzero(finite & ~xp.isfinite(got)))
    diff = xp.where(finite, xp.abs(got - ref), 0)
    ndiff = xp.where(finite, xp.abs(naive - ref), 0)
    error = float(diff.max()) if diff.size else 0.0
    naive_error = float(xp.nan_to_num(ndiff, nan=0.0, posinf=0.0).max()) if ndiff.size else 0.0
    magnitude = float(xp.abs(xp.where(finite, ref, 0)).max()) if ref.size else 0.0
    atol = 2 * EPS[dtype] * max(magnitude, 0.3) + 1e-12  # rounding noise at this magnitude
    if dtype == "float64":
        atol += F64_RELATIVE * max(magnitude, 0.3)
    bound = 2 * naive_error + atol
    norm = float(xp.linalg.norm(xp.where(finite, ref, 0).ravel())) if ref.size else 0.0
    relative = float(xp.linalg.norm(diff.ravel())) / norm if norm > 0 else error
    passed = same_nonfinite and bad_nan == 0 and error <= bound
    message = (
        f"{name}: max error {error:.3g} vs naive {naive_error:.3g} (bound {bound:.3g}), "
        f"relative {relative:.3g}"
        + ("" if same_nonfinite else ", non-finite entries differ from the reference")
        + (f", {bad_nan} non-finite where the reference is finite" if bad_nan else "")
    )
    return Check(name, passed, error, naive_error, bound, relative, message)


_TANH_KERNEL = r"""
extern "C" __global__ void tanh_of(const float* y, float* t, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) t[i] = cuflash::tanh_fast(y[i]);
}
"""


def kernel_tanh(y: Any) -> Any:
    """tanh of the float32 CuPy array `y` as the half-precision kernels compute it
    (kernels_cu/score_mod.cuh, tanh_fast: one tanh.approx.f32), on the current GPU: what the GPU
    test and bench/probe_softcap.py hold to the accuracy measured in docs/perf/NOTES.md, v25."""
    import cupy as cp

    from . import _kernels

    source = _kernels.expanded_source("score_mod.cuh") + _TANH_KERNEL
    kernel = cp.RawModule(code=source, options=("--std=c++17",)).get_function("tanh_of")
    t = cp.empty_like(y)
    kernel(((y.size + 255) // 256,), (256,), (y, t, np.int32(y.size)))
    return t


# ---------------------------------------------------------------------------------------------
# Explicit kernel choices, for tests and benchmarks (the public API always runs the library's)


def attention_forward_with(
    choice: Any, q: Any, k: Any, v: Any, alibi_slopes: Any = None, **options: Any
) -> tuple:
    """(o, lse, plan): cuflash.attention_forward on CUDA arrays through a plan built with
    `choice` (a cuflash._dispatch.KernelChoice), and that plan, to see which kernels it runs.
    options: causal, window, softcap, scale, layout, as the API takes them."""
    from . import _cuda, _validate, api

    problem, qi, ki, vi, alibi = _validate.check_forward(q, k, v, alibi_slopes, **options)
    plan = _cuda.ForwardPlan(problem, qi, ki, vi, choice, api.poison_outputs(), alibi)
    pointers = [info.ptr for info in (qi, ki, vi, alibi) if info is not None]
    return (*plan(*pointers), plan)


def _check_varlen(check: Any, arrays: tuple, options: dict) -> tuple:
    """check(*arrays, slopes, ...) (_validate.check_varlen_forward or _backward) on the public
    API's keywords (`options`: alibi_slopes, max_seqlen_q/k, check_seqlens, causal, window,
    softcap, scale)."""
    from . import _validate

    options = dict(options)
    slopes = options.pop("alibi_slopes", None)
    seqlens = {name: options.pop(name, None) for name in ("max_seqlen_q", "max_seqlen_k")}
    return check(
        *arrays,
        slopes,
        check_seqlens=options.pop("check_seqlens", False),
        **seqlens,
        **_validate.varlen_option_kwargs(
            options.get("causal", False),
            options.get("window"),
            options.get("softcap"),
            options.get("scale"),
        ),
    )


def attention_varlen_forward_with(
    choice: Any, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, **options: Any
) -> tuple:
    """(o, lse, plan): as attention_forward_with, for cuflash.attention_varlen_forward (options:
    its keywords)."""
    from . import _cuda, _validate, api

    arrays = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    problem, infos, _ = _check_varlen(_validate.check_varlen_forward, arrays, options)
    qi, ki, vi, alibi = infos[:4]
    plan = _cuda.ForwardPlan(problem, qi, ki, vi, choice, api.poison_outputs(), alibi)
    return (*plan(*(i.ptr for i in infos if i is not None)), plan)


def attention_backward_with(
    choice: Any,
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    alibi_slopes: Any = None,
    **options: Any,
) -> tuple:
    """(dq, dk, dv, plan): as attention_forward_with, for cuflash.attention_backward."""
    from . import _cuda, _validate, api

    problem, *infos = _validate.check_backward(do, q, k, v, o, lse, alibi_slopes, **options)
    plan = _cuda.BackwardPlan(problem, *infos[:6], choice, api.poison_outputs(), infos[6])
    return (*plan(*(info.ptr for info in infos if info is not None)), plan)


def attention_varlen_backward_with(
    choice: Any,
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    **options: Any,
) -> tuple:
    """(dq, dk, dv, plan): as attention_backward_with, for cuflash.attention_varlen_backward
    (options: its keywords)."""
    from . import _cuda, _validate, api

    arrays = (do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    problem, infos, _ = _check_varlen(_validate.check_varlen_backward, arrays, options)
    plan = _cuda.BackwardPlan(problem, *infos[:6], choice, api.poison_outputs(), infos[6])
    return (*plan(*(i.ptr for i in infos if i is not None)), plan)
