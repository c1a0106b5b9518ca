"""JAX integration: cuflash inside ``jax.jit``, ``grad``, ``vmap``, ``checkpoint``, ``shard_map``.

    import cuflash.jax as cfj

    @jax.jit
    def loss(q, k, v):
        return cfj.attention(q, k, v, causal=True).sum()

    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

Shapes as :func:`cuflash.attention` (``layout="bshd"``: q ``(B, Nq, Hq, d)``, k/v
``(B, Nk, Hkv, d)``; ``"bhsd"``; or 2-D ``(N, d)``).

How it runs: each call is one XLA custom call (``jax.experimental.buffer_callback``). When the
compiled program reaches it, XLA hands a Python callback its stream and its buffers: the inputs,
and outputs XLA allocated. On a GPU the callback launches the same compiled kernel instances as
every other framework on that stream (no host synchronisation, no copies); on the CPU it runs
the NumPy backend into the output buffers, so jitted code also runs where there is no GPU. The
shapes are checked when the call is traced, with the errors of :func:`cuflash.attention`.

- ``attention`` has a custom VJP (the backward kernels); ``attention_forward`` returns
  ``(o, lse)`` and is differentiable through o (not through lse); ``attention_backward`` is the
  backward as a function (not differentiable again).
- ``vmap``: a batching rule folds the mapped axis into the batch (one launch, no Python loop).
- ``attention_with_kvcache`` is functional: it returns the updated caches beside o and lse.
- Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) is not supported: use ``jax.vjp``,
  ``jax.grad`` or ``jax.jacrev``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from . import _cpu, _dispatch, _dlpack, _interop, _jax_ring, _validate, _varlen
from ._jax_ring import zigzag_order, zigzag_restore  # noqa: F401 (public: cuflash.jax.zigzag_*)

_TRACE_DEVICE = ("cuda", -1)  # the device is known only when the call runs
_FORWARD_NAMES = ("q", "k", "v", "alibi_slopes")
_BACKWARD_NAMES = ("q", "k", "v", "do", "o", "lse", "alibi_slopes")

_JVP_MESSAGE = (
    "cuflash.jax.attention has no forward-mode derivative (jax.jvp, jax.jacfwd, "
    "jax.linearize of a jvp): its gradient is a custom VJP. Use reverse mode instead: "
    "jax.vjp, jax.grad, jax.value_and_grad or jax.jacrev."
)


class _Options(NamedTuple):
    """A call's options: static (hashable) parts of the trace."""

    causal: Any
    window: Any
    softcap: Any
    scale: Any
    layout: Any

    def kwargs(self) -> dict[str, Any]:
        return _validate.option_kwargs(*self)


def _options(causal: Any, window: Any, softcap: Any, scale: Any, layout: Any) -> _Options:
    window = tuple(window) if isinstance(window, list) else window  # hashable
    options = _Options(causal, window, softcap, scale, layout)
    try:
        hash(options)
    except TypeError:  # an unhashable option: let validation name it
        _validate.check_forward_infos([], **options.kwargs())
        raise
    return options


def _as_jax(x: Any, name: str) -> Any:
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    raise TypeError(f"{name} must be a JAX array (or a NumPy array); got {type(x).__name__}")


def _abstract(arrays: tuple, names: tuple[str, ...]) -> list[_interop.ArrayInfo]:
    """The arrays of a trace as the validation sees them: shape and dtype, C-contiguous."""
    return [
        _validate.abstract_info(name, tuple(x.shape), jnp.dtype(x.dtype).name, _TRACE_DEVICE)
        for x, name in zip(arrays, names, strict=False)
    ]


def _cpu_infos(buffers: tuple, names: tuple[str, ...]) -> list[_interop.ArrayInfo]:
    """XLA's CPU buffers as NumPy arrays, described for the NumPy backend (no copies)."""
    cpu = (_interop.CPU, 0)
    return [
        _interop.describe(np.asarray(b), name, "numpy", cpu)
        for b, name in zip(buffers, names, strict=False)
    ]


class _DefaultFloatEnvironment:
    """XLA's CPU threads flush subnormal numbers to zero (the FTZ and DAZ bits); the NumPy backend
    runs inside one of them. Under this context it computes in the default environment, as an
    eager call does, so that jitted and eager results agree bit for bit (C99 fegetenv/fesetenv
    through ctypes; a no-op where the C math library is not found)."""

    _FE_DFL_ENV = ctypes.c_void_p(-1)  # glibc's and macOS's FE_DFL_ENV: ((const fenv_t *) -1)

    def __init__(self) -> None:
        name = ctypes.util.find_library("m")
        self._libm = ctypes.CDLL(name) if name else None
        self._saved = ctypes.create_string_buffer(512)  # larger than any fenv_t

    def __enter__(self) -> None:
        if self._libm is not None:
            self._libm.fegetenv(self._saved)
            self._libm.fesetenv(self._FE_DFL_ENV)

    def __exit__(self, *_: Any) -> None:
        if self._libm is not None:
            self._libm.fesetenv(self._saved)


@functools.cache
def _float_environment() -> _DefaultFloatEnvironment:
    return _DefaultFloatEnvironment()


def _pointers(buffers: tuple) -> tuple[int, ...]:
    return tuple(b.__cuda_array_interface__["data"][0] for b in buffers)


def _on_cpu(buffer: Any) -> bool:
    return buffer.__dlpack_device__()[0] in (_dlpack.KDL_CPU, _dlpack.KDL_CUDA_HOST)


class _ForwardCall:
    """The callback of one forward problem. CUDA buffers: the plan of their device (built on its
    first call) launches on XLA's stream into XLA's outputs; CPU buffers: the NumPy backend."""

    def __init__(self, problem: Any, infos: list[_interop.ArrayInfo]) -> None:
        self.problem, self.infos, self.plans = problem, infos, {}

    def __call__(self, ctx: Any, outs: tuple, *inputs: Any) -> None:
        o, lse = outs
        if _on_cpu(inputs[0]):
            q, k, v, *alibi = _cpu_infos(inputs, _FORWARD_NAMES)
            with _float_environment():
                o_value, lse_value = _cpu.forward(self.problem, q, k, v, *alibi)
            np.asarray(o)[...] = o_value
            np.asarray(lse)[...] = lse_value
            return
        pointers = _pointers((*inputs[:3], o, lse, *inputs[3:]))
        device = inputs[0].__dlpack_device__()[1]
        plan = self.plans.get(device)
        if plan is None:
            plan = self.plans[device] = self._plan(device, pointers)
        plan.launch(ctx.stream, pointers)

    def _plan(self, device: int, pointers: tuple[int, ...]) -> Any:
        from . import _cuda

        problem, infos = _on_device(self.problem, self.infos, device, pointers[:3] + pointers[5:])
        q, k, v, *alibi = infos
        return _cuda.ForwardPlan(problem, q, k, v, alibi=alibi[0] if alibi else None)


class _BackwardCall:
    """The callback of one backward problem (outputs dq, dk, dv and the workspace D)."""

    def __init__(self, problem: Any, infos: list[_interop.ArrayInfo]) -> None:
        self.problem, self.infos, self.plans = problem, infos, {}

    def __call__(self, ctx: Any, outs: tuple, *inputs: Any) -> None:
        dq, dk, dv, delta = outs
        if _on_cpu(inputs[0]):
            q, k, v, do, o, lse, *alibi = _cpu_infos(inputs, _BACKWARD_NAMES)
            with _float_environment():
                grads = _cpu.backward(self.problem, do, q, k, v, o, lse, *alibi)
            for out, value in zip((dq, dk, dv), grads, strict=True):
                np.asarray(out)[...] = value
            return
        q, k, v, do, o, lse, *alibi = inputs
        pointers = _pointers((q, k, v, o, do, lse, delta, dq, dk, dv, *alibi))
        device = q.__dlpack_device__()[1]
        plan = self.plans.get(device)
        if plan is None:
            plan = self.plans[device] = self._plan(device, _pointers(inputs))
        plan.launch(ctx.stream, pointers)

    def _plan(self, device: int, pointers: tuple[int, ...]) -> Any:
        from . import _cuda

        problem, infos = _on_device(self.problem, self.infos, device, pointers)
        q, k, v, do, o, lse, *alibi = infos
        return _cuda.BackwardPlan(problem, do, q, k, v, o, lse, alibi=alibi[0] if alibi else None)


_VARLEN_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes")
_VARLEN_BACKWARD_NAMES = ("do", "q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k")
_VARLEN_BACKWARD_NAMES += ("alibi_slopes",)


class _VarlenForwardCall(_ForwardCall):
    """The callback of one packed forward problem (inputs q, k, v, the offsets, the slopes)."""

    def __call__(self, ctx: Any, outs: tuple, *inputs: Any) -> None:
        o, lse, work_list = outs
        if _on_cpu(inputs[0]):
            q, k, v, cq, ck, *alibi = _cpu_infos(inputs, _VARLEN_NAMES)
            p = self.problem
            offsets = _varlen.read_offsets(cq, ck, p.total_q, p.total_k)
            with _float_environment():
                o_value, lse_value = _varlen.cpu_forward(p, q, k, v, _first(alibi), offsets)
            np.asarray(o)[...] = o_value
            np.asarray(lse)[...] = lse_value
            return
        q, k, v, cq, ck, *alibi = inputs
        pointers = _pointers((q, k, v, o, lse, *alibi, cq, ck, work_list))
        device = q.__dlpack_device__()[1]
        plan = self.plans.get(device)
        if plan is None:
            plan = self.plans[device] = self._plan(device, _pointers(inputs))
        plan.launch(ctx.stream, pointers)

    def _plan(self, device: int, pointers: tuple[int, ...]) -> Any:
        from . import _cuda

        q, k, v, _, _, *alibi = self.infos
        problem, (q, k, v, *alibi) = _on_device(
            self.problem, [q, k, v, *alibi], device, pointers[:3] + pointers[5:]
        )
        return _cuda.ForwardPlan(problem, q, k, v, alibi=_first(alibi))


class _VarlenBackwardCall(_BackwardCall):
    """The callback of one packed backward problem."""

    def __call__(self, ctx: Any, outs: tuple, *inputs: Any) -> None:
        dq, dk, dv, delta, work_list = outs
        if _on_cpu(inputs[0]):
            do, q, k, v, o, lse, cq, ck, *alibi = _cpu_infos(inputs, _VARLEN_BACKWARD_NAMES)
            p = self.problem
            offsets = _varlen.read_offsets(cq, ck, p.total_q, p.total_k)
            with _float_environment():
                grads = _varlen.cpu_backward(p, do, q, k, v, o, lse, _first(alibi), offsets)
            for out, value in zip((dq, dk, dv), grads, strict=True):
                np.asarray(out)[...] = value
            return
        do, q, k, v, o, lse, cq, ck, *alibi = inputs
        pointers = _pointers((q, k, v, o, do, lse, delta, dq, dk, dv, *alibi, cq, ck, work_list))
        device = q.__dlpack_device__()[1]
        plan = self.plans.get(device)
        if plan is None:
            plan = self.plans[device] = self._plan(device, _pointers(inputs))
        plan.launch(ctx.stream, pointers)

    def _plan(self, device: int, pointers: tuple[int, ...]) -> Any:
        from . import _cuda

        do, q, k, v, o, lse, _, _, *alibi = self.infos
        problem, (do, q, k, v, o, lse, *alibi) = _on_device(
            self.problem, [do, q, k, v, o, lse, *alibi], device, pointers[:6] + pointers[8:]
        )
        return _cuda.BackwardPlan(problem, do, q, k, v, o, lse, alibi=_first(alibi))


def _work_list_scratch(problem: Any, family: str) -> Any:
    """A packed call's work-list workspace (cuflash/_dispatch.py, work_list_bytes), a scratch
    output that XLA allocates: int32 words, as the plans take it."""
    return jax.ShapeDtypeStruct((_dispatch.work_list_bytes(problem, family) // 4,), jnp.int32)


def _first(items: list) -> Any:
    return items[0] if items else None


def _on_device(problem: Any, infos: list, device: int, pointers: tuple[int, ...]) -> tuple:
    """The traced problem and arrays on CUDA device `device`, at the first call's pointers (a
    plan's tensor-map templates take an address; every call patches in its own)."""
    from dataclasses import replace

    where = (_interop.CUDA, device)
    infos = [replace(i, device=where, ptr=p) for i, p in zip(infos, pointers, strict=True)]
    return replace(problem, device=where), infos


# ---------------------------------------------------------------------------------------------
# The operations: one custom call each, with a batching rule that folds vmap into the batch.


def _varying_axes(x: Any) -> frozenset:
    """The shard_map axes an array varies over: aval.mat.varying in newer JAX, aval.vma before."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _vary_like(outputs: tuple, inputs: tuple) -> tuple:
    """Inside shard_map, the outputs typed as varying over every mesh axis an input varies over
    (the custom call's result types carry no such axes; custom_vjp checks them)."""
    varying = frozenset().union(*(_varying_axes(x) for x in inputs))
    if not varying:
        return outputs

    def cast(x: Any) -> Any:
        missing = tuple(sorted(varying - _varying_axes(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)

    return tuple(cast(x) for x in outputs)


def _custom_call(callback: Any, results: tuple) -> Any:
    """One XLA custom call running `callback`. It may be recorded into XLA's CUDA graphs
    (command buffers): the callback then runs while XLA captures the graph and its launches are
    replayed. That is sound because a launch depends only on the problem and the buffers'
    addresses, and XLA captures again when the addresses change. Where XLA does not build command
    buffers for custom calls, the callback runs on every call."""
    return buffer_callback(callback, results, command_buffer_compatible=True)


def _slopes_tuple(alibi_slopes: Any) -> tuple:
    return () if alibi_slopes is None else (_as_jax(alibi_slopes, "alibi_slopes"),)


@functools.lru_cache(maxsize=256)
def _forward_op(options: _Options) -> Any:
    """(q, k, v, slopes) -> (o, lse) for these options, vmappable."""

    @jax.custom_batching.custom_vmap
    def forward(q: Any, k: Any, v: Any, slopes: tuple) -> tuple[Any, Any]:
        infos = _abstract((q, k, v, *slopes), _FORWARD_NAMES)
        problem, *_ = _validate.check_forward_infos(infos, **options.kwargs())
        if not problem.has_work:  # a row that sees no key: o = 0, lse = -inf
            outputs = (
                jnp.zeros(q.shape, q.dtype),
                jnp.full(problem.lse_shape, -jnp.inf, problem.lse_dtype),
            )
        else:
            results = (
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(problem.lse_shape, problem.lse_dtype),
            )
            call = _custom_call(_ForwardCall(problem, infos), results)
            outputs = tuple(call(q, k, v, *slopes))
        return outputs

    @forward.def_vmap
    def forward_vmap(size: int, batched: Any, q: Any, k: Any, v: Any, slopes: tuple) -> Any:
        fold = _Fold(size)
        q_shape = fold.example_shape(q, batched[0])
        folded = fold.inputs((q, k, v), batched[:3])
        o, lse = _forward_op(fold.options(options, q_shape))(
            *folded, fold.slopes(slopes, batched[3], q_shape)
        )
        lse_shape = _lse_shape(q_shape, options)
        return (fold.unfold(o, q_shape), fold.unfold(lse, lse_shape)), (True, True)

    return forward


@functools.lru_cache(maxsize=256)
def _backward_op(options: _Options) -> Any:
    """(do, q, k, v, o, lse, slopes) -> (dq, dk, dv) for these options, vmappable."""

    @jax.custom_batching.custom_vmap
    def backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, slopes: tuple) -> Any:
        arrays = (q, k, v, do, o, lse, *slopes)
        infos = _abstract(arrays, _BACKWARD_NAMES)
        problem, *_ = _validate.check_backward_infos(infos, **options.kwargs())
        if not problem.has_work:
            return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros_like(v)
        # D = rowsum(dO * O) is a workspace XLA allocates (as bytes: float64 for the exact
        # dtypes, which JAX without x64 could not name), with the fused backward's dQ sums and
        # counters after it where that kernel is chosen (_dispatch.backward_workspace)
        delta_bytes = _dispatch.backward_workspace(problem).nbytes
        results = (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((delta_bytes,), jnp.uint8),
        )
        call = _custom_call(_BackwardCall(problem, infos), results)
        return tuple(call(*arrays)[:3])

    @backward.def_vmap
    def backward_vmap(size: int, batched: Any, do, q, k, v, o, lse, slopes) -> Any:  # noqa: ANN001
        fold = _Fold(size)
        shapes = [fold.example_shape(x, b) for x, b in zip((q, k, v), batched[1:4], strict=True)]
        folded = fold.inputs((do, q, k, v, o), batched[:5])
        lse_folded = fold.lse(lse, batched[5], len(shapes[0]) == 2)
        grads = _backward_op(fold.options(options, shapes[0]))(
            *folded, lse_folded, fold.slopes(slopes, batched[6], shapes[0])
        )
        out = tuple(fold.unfold(g, s) for g, s in zip(grads, shapes, strict=True))
        return out, (True, True, True)

    return backward


_HALF = ("float16", "bfloat16")


def _lse_shape(q_shape: tuple[int, ...], options: _Options) -> tuple[int, ...]:
    """The lse shape of one example of q."""
    if len(q_shape) == 2:
        return (q_shape[0],)
    if options.layout == "bhsd":
        return q_shape[:3]
    return (q_shape[0], q_shape[2], q_shape[1])


class _Fold:
    """vmap of a call as one call with a larger batch: the mapped axis (axis 0 of the batched
    arguments; unbatched ones are broadcast) becomes part of B, so B' = V * B. A 2-D (N, d) call
    becomes a 4-D bshd one, (V, N, 1, d): B = the mapped size, one head."""

    def __init__(self, size: int) -> None:
        self.size = size

    @staticmethod
    def example_shape(x: Any, batched: bool) -> tuple[int, ...]:
        return tuple(x.shape[1:]) if batched else tuple(x.shape)

    @staticmethod
    def options(options: _Options, q_shape: tuple[int, ...]) -> _Options:
        return options._replace(layout="bshd") if len(q_shape) == 2 else options

    def _full(self, x: Any, batched: bool) -> Any:
        return x if batched else jnp.broadcast_to(x, (self.size, *x.shape))

    @staticmethod
    def _fold(x: Any) -> Any:
        if x.ndim == 3:  # a mapped 2-D array: (V, N, d) -> (V, N, 1, d)
            return x.reshape(x.shape[0], x.shape[1], 1, x.shape[2])
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    def inputs(self, arrays: tuple, batched: tuple) -> list:
        return [self._fold(self._full(x, b)) for x, b in zip(arrays, batched, strict=True)]

    def lse(self, lse: Any, batched: bool, two_d: bool) -> Any:
        lse = self._full(lse, batched)
        if two_d:  # (V, N) -> (V, 1, N)
            return lse.reshape(lse.shape[0], 1, lse.shape[1])
        return lse.reshape(lse.shape[0] * lse.shape[1], *lse.shape[2:])

    def slopes(self, slopes: tuple, batched: tuple, q_shape: tuple[int, ...]) -> tuple:
        """Slopes (Hq,) or (B, Hq), maybe mapped, for the folded call: (Hq,) unmapped stays as
        it is (one slope per head serves every batch); anything else becomes (V * B, Hq)."""
        if not slopes:
            return ()
        (s,), (b,) = slopes, batched
        if not b and s.ndim == 1:
            return (s,)
        batch = 1 if len(q_shape) == 2 else q_shape[0]
        s = self._full(s, b)  # (V, Hq) or (V, B, Hq)
        if s.ndim == 2:
            s = jnp.broadcast_to(s[:, None, :], (s.shape[0], batch, s.shape[1]))
        return (s.reshape(s.shape[0] * s.shape[1], s.shape[2]),)

    def unfold(self, x: Any, shape: tuple[int, ...]) -> Any:
        """A folded result as (V, *shape), `shape` the shape of one example."""
        return x.reshape(self.size, *shape)


# ---------------------------------------------------------------------------------------------
# Differentiation: attention's custom VJP, attention_forward's (through o), and the errors.


def _forward(options: _Options, q: Any, k: Any, v: Any, slopes: tuple) -> tuple[Any, Any]:
    # custom_vmap's results carry no shard_map axes: type them here, outside it
    return _vary_like(tuple(_forward_op(options)(q, k, v, slopes)), (q, k, v, *slopes))


def _backward(options: _Options, do, q, k, v, o, lse, slopes) -> tuple:  # noqa: ANN001
    arrays = (do, q, k, v, o, lse, *slopes)
    return _vary_like(tuple(_backward_op(options)(do, q, k, v, o, lse, slopes)), arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q: Any, k: Any, v: Any, slopes: tuple, options: _Options) -> Any:
    return _forward(options, q, k, v, slopes)[0]


def _attention_fwd(q: Any, k: Any, v: Any, slopes: tuple, options: _Options) -> Any:
    o, lse = _forward(options, q, k, v, slopes)
    return o, (q, k, v, slopes, o, lse)


def _attention_bwd(options: _Options, residuals: tuple, do: Any) -> tuple:
    q, k, v, slopes, o, lse = residuals
    dq, dk, dv = _backward(options, do, q, k, v, o, lse, slopes)
    return dq, dk, dv, tuple(jnp.zeros_like(s) for s in slopes)  # the slopes get no gradient


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention_forward(q: Any, k: Any, v: Any, slopes: tuple, options: _Options) -> Any:
    return _forward(options, q, k, v, slopes)


def _attention_forward_fwd(q: Any, k: Any, v: Any, slopes: tuple, options: _Options) -> Any:
    q, k, v = q.value, k.value, v.value
    slopes = tuple(s.value for s in slopes)
    o, lse = _forward(options, q, k, v, slopes)
    return (o, lse), (q, k, v, slopes, o, lse)


def _attention_forward_bwd(options: _Options, residuals: tuple, cotangents: tuple) -> tuple:
    q, k, v, slopes, o, lse = residuals
    do, dlse = cotangents
    if not isinstance(dlse, jax.custom_derivatives.SymbolicZero):
        raise TypeError(
            "cuflash.jax.attention_forward is differentiable through o only: the lse it returns "
            "must not feed the differentiated result (its cotangent is not zero). Differentiate "
            "through cuflash.jax.attention, or stop the gradient of lse with "
            "jax.lax.stop_gradient."
        )
    if isinstance(do, jax.custom_derivatives.SymbolicZero):
        do = jnp.zeros(o.shape, o.dtype)
    dq, dk, dv = _backward(options, do, q, k, v, o, lse, slopes)
    return dq, dk, dv, tuple(jnp.zeros_like(s) for s in slopes)


_attention_forward.defvjp(_attention_forward_fwd, _attention_forward_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(7,))
def _attention_backward(do, q, k, v, o, lse, slopes, options):  # noqa: ANN001, ANN202
    return _backward(options, do, q, k, v, o, lse, slopes)


@_attention_backward.defjvp
def _attention_backward_jvp(options, primals, tangents):  # noqa: ANN001, ANN202
    raise TypeError(
        "cuflash.jax.attention_backward is not differentiable (no second derivatives of "
        "attention); differentiate the model once, through cuflash.jax.attention"
    )


def _reraise_jvp(call: Any) -> Any:
    """JAX's own error for jax.jvp of a custom VJP does not say what to use instead."""
    try:
        return call()
    except TypeError as exc:
        if "forward-mode autodiff" in str(exc):
            raise TypeError(_JVP_MESSAGE) from exc
        raise


# ---------------------------------------------------------------------------------------------
# The public functions.


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
    *,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
) -> jax.Array:
    """Exact attention, differentiable in q, k and v (custom VJP: the backward kernels).

    Works eagerly and under ``jax.jit``, ``grad``/``value_and_grad``/``vjp``/``jacrev``,
    ``vmap``, ``checkpoint`` and ``shard_map``; on GPU arrays the cuflash kernels run on XLA's
    stream, on CPU arrays the NumPy backend. Arguments as :func:`cuflash.attention` (``window``,
    ``softcap``, ``alibi_slopes``; the slopes get no gradient). Raises TypeError under forward-mode
    differentiation (``jax.jvp``)."""
    options = _options(causal, window, softcap, scale, layout)
    q, k, v = (_as_jax(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    slopes = _slopes_tuple(alibi_slopes)
    return _reraise_jvp(lambda: _attention(q, k, v, slopes, options))


def attention_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> tuple[jax.Array, jax.Array]:
    """``(o, lse)`` as :func:`cuflash.attention_forward`, jittable and vmappable. Differentiable
    through o; the lse must not feed a differentiated result (TypeError otherwise)."""
    options = _options(causal, window, softcap, scale, layout)
    q, k, v = (_as_jax(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    slopes = _slopes_tuple(alibi_slopes)
    return _reraise_jvp(lambda: _attention_forward(q, k, v, slopes, options))


def attention_backward(
    do: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    o: jax.Array,
    lse: jax.Array,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` as :func:`cuflash.attention_backward`, jittable and vmappable (o and lse
    as attention_forward returned them). Not differentiable."""
    options = _options(causal, window, softcap, scale, layout)
    named = ((do, "do"), (q, "q"), (k, "k"), (v, "v"), (o, "o"), (lse, "lse"))
    do, q, k, v, o, lse = (_as_jax(x, n) for x, n in named)
    slopes = _slopes_tuple(alibi_slopes)
    return _attention_backward(do, q, k, v, o, lse, slopes, options)


# ---------------------------------------------------------------------------------------------
# Packed variable-length sequences


def _varlen_problem(arrays: tuple, names: tuple, options: _Options, longest: tuple) -> Any:
    """The traced packed call's problem: max_seqlen_q/k must be given (static ints)."""
    if None in longest:
        raise TypeError(
            "cuflash.jax.attention_varlen needs max_seqlen_q and max_seqlen_k (ints): under JAX "
            "the offsets are not read on the host"
        )
    infos = _abstract(arrays, names)
    by_name = dict(zip(names, infos, strict=False))
    q, k, v, cq, ck = (by_name[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    kw = _validate._check_options(options.causal, options.window, options.softcap, "bshd")
    problem, _ = _validate._check_packed(
        q, k, v, cq, ck, options.scale, kw, longest[0], longest[1], False
    )
    if "alibi_slopes" in by_name:
        problem, _ = _validate._alibi_of(problem, [by_name["alibi_slopes"]])
    return problem, infos


def _varlen_forward(options: _Options, longest: tuple, q, k, v, cq, ck, slopes) -> tuple:  # noqa: ANN001
    arrays = (q, k, v, cq, ck, *slopes)
    problem, infos = _varlen_problem(arrays, _VARLEN_NAMES, options, longest)
    if not problem.has_work:
        outputs = (
            jnp.zeros(q.shape, q.dtype),
            jnp.full(problem.lse_shape, -jnp.inf, problem.lse_dtype),
        )
    else:
        results = (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(problem.lse_shape, problem.lse_dtype),
            _work_list_scratch(problem, "forward"),
        )
        call = _custom_call(_VarlenForwardCall(problem, infos), results)
        outputs = tuple(call(*arrays)[:2])
    return _vary_like(outputs, arrays)


def _varlen_backward(options: _Options, longest: tuple, do, q, k, v, o, lse, cq, ck, slopes):  # noqa: ANN001, ANN202
    arrays = (do, q, k, v, o, lse, cq, ck, *slopes)
    names = _VARLEN_BACKWARD_NAMES
    problem, infos = _varlen_problem(arrays, names, options, longest)
    if not problem.has_work:
        grads = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros_like(v))
        return _vary_like(grads, arrays)
    delta_bytes = _dispatch.backward_workspace(problem).nbytes
    results = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct((delta_bytes,), jnp.uint8),
        _work_list_scratch(problem, "backward"),
    )
    call = _custom_call(_VarlenBackwardCall(problem, infos), results)
    return _vary_like(tuple(call(*arrays)[:3]), arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention_varlen(q, k, v, cq, ck, slopes, options, longest):  # noqa: ANN001, ANN202
    return _varlen_forward(options, longest, q, k, v, cq, ck, slopes)[0]


def _attention_varlen_fwd(q, k, v, cq, ck, slopes, options, longest):  # noqa: ANN001, ANN202
    o, lse = _varlen_forward(options, longest, q, k, v, cq, ck, slopes)
    return o, (q, k, v, cq, ck, slopes, o, lse)


def _attention_varlen_bwd(options, longest, residuals, do):  # noqa: ANN001, ANN202
    q, k, v, cq, ck, slopes, o, lse = residuals
    dq, dk, dv = _varlen_backward(options, longest, do, q, k, v, o, lse, cq, ck, slopes)
    # the offsets (integers) and the slopes get no gradient
    zero = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in (cq, ck))
    return (dq, dk, dv, *zero, tuple(jnp.zeros_like(s) for s in slopes))


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Packed attention (:func:`cuflash.attention_varlen`), differentiable in q, k and v (custom
    VJP), eagerly and under ``jax.jit``. q ``(Tq, Hq, d)``, k and v ``(Tk, Hkv, d)``, offsets
    int32 ``(B + 1,)``; max_seqlen_q/k are required (static ints): on a GPU the offsets are
    trusted as in the plain API with both given (never read out of bounds), on the CPU they are
    checked when the call runs. Not vmappable."""
    options = _options(causal, window, softcap, scale, "bshd")
    named = ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"))
    q, k, v, cq = (_as_jax(x, n) for x, n in named)
    ck = _as_jax(cu_seqlens_k, "cu_seqlens_k")
    longest = (max_seqlen_q, max_seqlen_k)
    slopes = _slopes_tuple(alibi_slopes)
    return _reraise_jvp(lambda: _attention_varlen(q, k, v, cq, ck, slopes, options, longest))


# ---------------------------------------------------------------------------------------------
# KV cache: functional. The append is JAX's own scatter (in place where XLA may reuse the caches'
# buffers: donate them). Decoding calls (the plain API's split-KV route: float16 / bfloat16, a few
# query rows per KV head) run the split-KV kernels in one custom call over the caches as they are;
# the rest gathers each sequence's keys in use into a packed batch for the packed forward
# (attention_varlen's custom call).


def _default_gpu() -> int | None:
    """The CUDA ordinal of JAX's default device when it is a GPU (where a trace will run unless
    its inputs sit elsewhere), else None."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    return int(getattr(device, "local_hardware_id", None) or device.id)


def _decode_call(arrays: tuple, names: tuple[str, ...], options: _Options) -> Any:
    """The traced call (q, the caches, the lengths in use after the append, block table, slopes)
    as the plain API would run it on the default GPU, when that is split-KV decoding, with its
    split of the keys fixed (the custom call's scratch outputs depend on it); else None."""
    from dataclasses import replace

    from . import _kvcache, _kvcache_cuda

    gpu = _default_gpu()
    if gpu is None:
        return None
    infos = [replace(i, device=("cuda", gpu)) for i in _abstract(arrays, names)]
    call = _kvcache.check_described(
        {i.name: i for i in infos},
        None,
        causal=options.causal,
        window=options.window,
        softcap=options.softcap,
        scale=options.scale,
        num_splits=None,
    )
    if _kvcache_cuda.route(call) != "decode":
        return None
    splits, _ = _kvcache_cuda.decode_splits(call, gpu)
    return replace(call, cache=replace(call.cache, num_splits=splits))


class _KVCacheDecodeCall:
    """The callback of one decoding call: on CUDA buffers, the plain API's decoding launches
    (cuflash/_kvcache_cuda.py, KVCachePlan) on XLA's stream into XLA's outputs (o, lse, and the
    splits' scratch); on CPU buffers, the NumPy backend (which checks the lengths and pages)."""

    def __init__(self, call: Any, names: tuple[str, ...]) -> None:
        self.call, self.names, self.plans = call, names, {}

    def __call__(self, ctx: Any, outs: tuple, *inputs: Any) -> None:
        if _on_cpu(inputs[0]):
            self._on_cpu(outs, inputs)
            return
        device = inputs[0].__dlpack_device__()[1]
        plan = self.plans.get(device)
        if plan is None:
            plan = self.plans[device] = self._plan(device)
        ptr = dict(zip(plan.inputs, _pointers(inputs), strict=True))
        ptr.update(zip(("o", "lse", "o_accum", "lse_accum"), _pointers(outs), strict=False))
        plan.launch_decode(ctx.stream, ptr)

    def _plan(self, device: int) -> Any:
        from dataclasses import replace

        from . import _kvcache, _kvcache_cuda
        from .api import poison_outputs

        where = (_interop.CUDA, device)
        call = _kvcache.map_arrays(self.call, lambda info: replace(info, device=where))
        call = replace(call, problem=replace(call.problem, device=where))
        plan = _kvcache_cuda.KVCachePlan(call, poison_outputs())
        if plan.route != "decode" or plan.splits != call.cache.num_splits:
            raise RuntimeError(
                f"cuflash.jax.attention_with_kvcache: GPU {device} does not run this call as the "
                f"GPU it was traced for did (split-KV decoding, {call.cache.num_splits} splits)"
            )
        return plan

    def _on_cpu(self, outs: tuple, inputs: tuple) -> None:
        from . import api

        by_name = dict(zip(self.names, (np.asarray(x) for x in inputs), strict=True))
        p = self.call.problem
        with _float_environment():
            o, lse = api.attention_with_kvcache(
                by_name["q"],
                by_name["k_cache"],
                by_name["v_cache"],
                by_name["cache_seqlens"],
                block_table=by_name.get("block_table"),
                window=p.window,
                softcap=p.softcap,
                alibi_slopes=by_name.get("alibi_slopes"),
                scale=p.scale,
            )
        np.asarray(outs[0])[...] = o
        np.asarray(outs[1])[...] = lse


def _kvcache_decode(call: Any, arrays: tuple, names: tuple[str, ...]) -> tuple[Any, Any]:
    from . import _kvcache_cuda

    p, splits = call.problem, call.cache.num_splits
    results = [
        jax.ShapeDtypeStruct(p.q_shape, p.dtype),
        jax.ShapeDtypeStruct(p.lse_shape, p.lse_dtype),
    ]
    if splits > 1:
        scratch = _kvcache_cuda.accum_shape(p, splits)
        results += [
            jax.ShapeDtypeStruct(scratch, jnp.float32),
            jax.ShapeDtypeStruct(scratch[:3], jnp.float32),
        ]
    outputs = _custom_call(_KVCacheDecodeCall(call, names), tuple(results))(*arrays)
    return tuple(_vary_like(tuple(outputs[:2]), arrays))


def _cache_rows(rows: Any, block_table: Any, page_size: int, num_pages: int) -> tuple[Any, Any]:
    """(page, slot) of rows (B, n) of each sequence; rows outside the cache get page num_pages
    (out of bounds: dropped by scatters, clamped by gathers)."""
    batch = rows.shape[0]
    if block_table is None:
        capacity = page_size
        page = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], rows.shape)
        slot = rows
    else:
        capacity = page_size * block_table.shape[1]
        index = jnp.clip(rows // page_size, 0, block_table.shape[1] - 1)
        page = jnp.take_along_axis(block_table, index, axis=1)
        slot = rows % page_size
    bad = (rows < 0) | (rows >= capacity) | (page < 0) | (page >= num_pages)
    return jnp.where(bad, num_pages, page), jnp.where(bad, 0, slot)


def attention_with_kvcache(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: jax.Array | int | None = None,
    *,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    block_table: jax.Array | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    alibi_slopes: jax.Array | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`cuflash.attention_with_kvcache` for JAX, functional: returns ``(o, lse, k_cache,
    v_cache)`` with k_new / v_new written into the returned caches. Eager and under ``jax.jit``
    (donate the caches to update them in place). Lengths and pages are trusted, as the plain
    API's GPU path trusts them: rows past the capacity or on pages outside the cache are neither
    written nor read. Where JAX's default device is a GPU and the plain API would decode (float16
    or bfloat16, at most 64 query rows per KV head), the split-KV decoding kernels read the caches
    in place, the keys split as the plain API splits them on that GPU; other calls gather each
    sequence's keys in use into a packed batch for the packed forward kernels."""
    names = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    q, k_cache, v_cache = (_as_jax(x, n) for n, x in names)
    if q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be (B, Nq, Hq, d) and k_cache, v_cache 4-D of one shape; got q {q.shape}, "
            f"k_cache {k_cache.shape}, v_cache {v_cache.shape}"
        )
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (or neither)")
    batch, seq_q, heads_q, d = q.shape
    pages, page_size, heads_kv, _ = k_cache.shape
    paged = block_table is not None
    if paged:
        block_table = _as_jax(block_table, "block_table")
        if block_table.dtype != jnp.int32 or block_table.ndim != 2:
            raise TypeError(f"block_table must be int32 (B, max_pages); got {block_table.dtype}")
    capacity = page_size * (block_table.shape[1] if paged else 1)
    seq_new = 0 if k_new is None else k_new.shape[1]
    if cache_seqlens is None:
        lengths = jnp.full((batch,), capacity - seq_new, jnp.int32)
    elif isinstance(cache_seqlens, int):
        lengths = jnp.full((batch,), cache_seqlens, jnp.int32)
    else:
        lengths = _as_jax(cache_seqlens, "cache_seqlens")
        if lengths.dtype != jnp.int32 or lengths.shape != (batch,):
            raise TypeError(
                f"cache_seqlens must be an int32 array (B,) = ({batch},); got {lengths.dtype} "
                f"{lengths.shape}"
            )
    if k_new is not None:
        k_new, v_new = _as_jax(k_new, "k_new"), _as_jax(v_new, "v_new")
        expected = (batch, seq_new, heads_kv, d)
        if k_new.shape != expected or v_new.shape != expected:
            raise ValueError(
                f"k_new and v_new must have shape (B, Nnew, Hkv, d) = {expected}; got "
                f"{k_new.shape}, {v_new.shape}"
            )
        rows = lengths[:, None] + jnp.arange(seq_new, dtype=jnp.int32)[None, :]
        page, slot = _cache_rows(rows, block_table, page_size, pages)
        k_cache = k_cache.at[page, slot].set(k_new.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[page, slot].set(v_new.astype(v_cache.dtype), mode="drop")
    used = jnp.clip(lengths + seq_new, 0, capacity)  # keys in use of each sequence
    options = _options(causal, window, softcap, scale, "bshd")
    slopes = _slopes_tuple(alibi_slopes)
    table_tuple = () if block_table is None else (block_table,)
    arrays = (q, k_cache, v_cache, used, *table_tuple, *slopes)
    names = ("q", "k_cache", "v_cache", "cache_seqlens")
    names += ("block_table",) * len(table_tuple) + ("alibi_slopes",) * len(slopes)
    decode = _decode_call(arrays, names, options)
    if decode is not None:
        o, lse = _kvcache_decode(decode, arrays, names)
        return o, lse, k_cache, v_cache
    # the keys in use, packed: sequence b's rows cu_k[b] .. cu_k[b + 1]
    cu_k = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(used, dtype=jnp.int32)])
    row = jnp.arange(batch * capacity, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(cu_k, row, side="right") - 1, 0, batch - 1)
    within = row - cu_k[owner]
    table = None if block_table is None else block_table[owner]
    if table is None:  # contiguous: row r of batch b
        page, slot = owner, within
    else:
        index = jnp.clip(within // page_size, 0, table.shape[1] - 1)
        page = jnp.take_along_axis(table, index[:, None], axis=1)[:, 0]
        slot = within % page_size
    page = jnp.where((within < capacity) & (page >= 0) & (page < pages), page, pages)
    in_cache = (page < pages)[:, None, None]
    page, slot = jnp.minimum(page, pages - 1), jnp.clip(slot, 0, page_size - 1)
    keys = jnp.where(in_cache, k_cache[page, slot], 0).astype(k_cache.dtype)
    values = jnp.where(in_cache, v_cache[page, slot], 0).astype(v_cache.dtype)
    # one more sequence, without queries, holds the unused rows (the offsets end at the rows)
    cu_q = jnp.minimum(jnp.arange(batch + 2, dtype=jnp.int32), batch) * seq_q
    cu_k = jnp.concatenate([cu_k, jnp.full(1, batch * capacity, jnp.int32)])
    q_packed = q.reshape(batch * seq_q, heads_q, d)
    if slopes and slopes[0].ndim == 2:  # (B, Hq): a row for the extra sequence
        slopes = (jnp.concatenate([slopes[0], jnp.zeros_like(slopes[0][:1])]),)
    o, lse = _varlen_forward(options, (seq_q, capacity), q_packed, keys, values, cu_q, cu_k, slopes)
    lse = lse.reshape(heads_q, batch, seq_q).transpose(1, 0, 2)
    return o.reshape(q.shape), lse, k_cache, v_cache


# ---------------------------------------------------------------------------------------------
# Context parallelism: ring attention inside shard_map (cuflash/_jax_ring.py)

_RING_OPS = _jax_ring.AttentionOps(attention_forward, attention_backward)


def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    axis_name: Any,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
) -> Any:
    """This device's shard of exact attention over a sequence split along the mesh axis
    `axis_name`; call it inside ``shard_map`` (or another per-device context with that axis).

    q, k, v: the device's zigzag shard (chunks r and 2P - 1 - r of 2P; `zigzag_order` arranges a
    full sequence so that an even split gives these), ``(B, n, H, d)`` (bshd) or ``(B, H, n, d)``
    (bhsd), n even; k and v may have fewer heads. causal: over the whole sequence. Differentiable
    (custom VJP); deterministic for a given number of devices."""
    return _jax_ring.ring_attention(
        q, k, v, _RING_OPS, axis_name=axis_name, causal=causal, scale=scale, layout=layout
    )
