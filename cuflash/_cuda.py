"""The CUDA backend: a validated call becomes a plan, and a plan runs the kernels.

A plan (ForwardPlan, BackwardPlan) holds what depends only on the call's signature (shapes,
strides, dtype, device, options): the launches that cuflash/_dispatch.py chose, each made ready
as a Run (compiled kernel, Params filled once, tensor maps). Running a plan reads the data
pointers, allocates the outputs, takes per family the launch for 16-byte aligned pointers or the
one for any pointers, and launches. The API keeps plans per call signature, so repeated calls
skip validation (cuflash/_plans.py).

Launches go on the caller's stream (torch's current stream for torch tensors, CuPy's current
stream otherwise) and never synchronise the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from . import _compile, _dispatch, _kernels, _launch, _params, _plans, _tma, _validate
from ._dlpack import c_contiguous_strides
from ._interop import ArrayInfo, CudaAllocator, stream_getter
from ._problem import Problem

# The tensors whose pointers a call hands to its launches, in this order (then "alibi", the ALiBi
# slopes, where the call has them).
FORWARD_TENSORS = ("q", "k", "v", "o", "lse")
BACKWARD_TENSORS = ("q", "k", "v", "o", "dout", "lse", "delta", "dq", "dk", "dv")


# Packed calls also pass the offsets of their sequences, after the tensors (and the slopes), then
# their work lists' workspace (_dispatch.work_list_bytes, sized from the problem alone: every
# packed call has one; launches without a list, off Hopper or unaligned, leave it unread).
PACKED_OFFSETS = ("cu_seqlens_q", "cu_seqlens_k", "work_list")
# Where the fused backward is chosen (_dispatch.backward_workspace), the backward's launches also
# take the pointers of its dQ sums and counters, inside D's buffer, last.
FUSED_WORKSPACE = ("dq_accum", "dq_semaphores")


def _with_extras(
    p: Problem, tensors: tuple[str, ...], strides: _dispatch.Strides, alibi: ArrayInfo | None
) -> tuple[str, ...]:
    """The pointers a call passes: the tensors, then the ALiBi slopes where it has them (their
    strides go into `strides`), then the packed sequences' offsets and the work lists'
    workspace where it has them."""
    if alibi is not None:
        strides["alibi"] = _validate.alibi_strides(alibi)
        tensors = (*tensors, "alibi")
    return (*tensors, *PACKED_OFFSETS) if p.packed else tensors


class Run:
    """One Launch made ready on a device: its compiled kernel, its Params, its tensor maps.

    A call passes the pointers of `tensors`, in that order. `template_address`, 16-byte aligned,
    stands in for every mapped tensor's address in the maps' templates (each call patches in its
    own pointers)."""

    def __init__(
        self,
        launch: _dispatch.Launch,
        p: Problem,
        strides: _dispatch.Strides,
        tensors: tuple[str, ...],
        template_address: int,
        device: int,
    ) -> None:
        self.launch, self.device, self.tensors = launch, device, tensors
        self.template = _params.fill(p, strides, **launch.params_fields())
        # (index of its pointer in a call's, map) of each mapped tensor, in the kernel's order;
        # o is in the output's dtype (bfloat16 for the FP8 forward's e4m3 inputs)
        self.maps = tuple(
            (
                tensors.index(name),
                _tma.tile_map(
                    p.map_shape(name),
                    strides[name],
                    _kernels.ITEMSIZE[p.out_dtype if name == "o" else p.dtype],
                    rows,
                    template_address,
                    _kernels.map_row_bytes(p.dtype, p.head_dim, name),
                ),
            )
            for name, rows in launch.maps
        )
        self.loaded = _compile.load(launch.spec, device)
        self._threads = threading.local()  # each thread's argument block (_params.Arguments)
        # packed calls on the persistent kernels: the launch that writes this one's work list
        self.builder = None
        if launch.builder is not None:
            self.builder = Run(launch.builder, p, strides, tensors, template_address, device)

    def __call__(self, stream: int, pointers: tuple[int, ...]) -> None:
        args = getattr(self._threads, "args", None)
        if args is None:
            args = _params.Arguments(self.template, self.tensors, len(self.maps))
            self._threads.args = args
        args.set_pointers(pointers)
        for index, (slot, tensor_map) in enumerate(self.maps):
            args.set_map(index, tensor_map.bytes_for(pointers[slot]))
        if self.builder is not None:
            self.builder(stream, pointers)
        _launch.launch(self.loaded, self.launch.grid, self.device, stream, args.address)


class Runs:
    """A family's Pair of launches made ready: the one for aligned pointers at once, the one for
    any pointers on first use (on Hopper it is another instance, compiled only if needed)."""

    def __init__(self, pair: _dispatch.Pair, make: Callable[[_dispatch.Launch], Run]) -> None:
        self.aligned = make(pair.aligned)
        self._pair, self._make, self._unaligned = pair, make, None

    def pick(self, aligned: bool) -> Run:
        if aligned:
            return self.aligned
        if self._unaligned is None:
            self._unaligned = self._make(self._pair.unaligned)
        return self._unaligned


def _ready(
    p: Problem,
    strides: _dispatch.Strides,
    tensors: tuple[str, ...],
    template_ptr: int,
    device: int,
    dispatch: Callable[[_dispatch.KernelChoice], Any],
    choice: _dispatch.KernelChoice,
) -> Any:
    """The dispatch's launches made ready: dispatch(choice) -> Pair or BackwardLaunches. Should
    the driver refuse a tensor map that the strides allow, the launches without TMA serve."""

    def make(launch: _dispatch.Launch) -> Run:
        return Run(launch, p, strides, tensors, template_ptr & ~15 or 16, device)

    chosen = dispatch(choice)
    try:
        return _make_all(chosen, make)
    except _tma.TensorMapError:
        return _make_all(dispatch(replace(choice, path="wgmma")), make)


def _make_all(chosen: Any, make: Callable[[_dispatch.Launch], Run]) -> Any:
    if isinstance(chosen, _dispatch.Pair):
        return Runs(chosen, make)
    return tuple(Runs(pair, make) for pair in (chosen.preprocess, chosen.dkdv, chosen.dq))


def workspace(alloc: CudaAllocator, words: int) -> tuple[Any, tuple[int, ...]]:
    """A packed call's work-list workspace of `words` int32 words: the buffer (hold it until the
    launches are queued) and its pointer, the last of a call's pointers (PACKED_OFFSETS); None and
    () for calls without one."""
    if not words:
        return None, ()
    buffer = alloc((words,), "int32")
    return buffer, (buffer.ptr,)


def _target(device: int) -> tuple[str, int]:
    return _compile.device_arch(device), _compile.sm_count(device)


def _forward_strides(p: Problem, qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo) -> _dispatch.Strides:
    """The (batch, head, row) strides of a forward's q, k and v, and of the C-contiguous o and
    lse it allocates."""
    return {
        "q": p.bhs_strides(qi.strides),
        "k": p.bhs_strides(ki.strides),
        "v": p.bhs_strides(vi.strides),
        "o": p.bhs_strides(c_contiguous_strides(p.q_shape)),
        "lse": p.lse_strides(c_contiguous_strides(p.lse_shape)),
    }


class _Plan:
    """What every plan holds: its problem and device, the allocator of its outputs, the stream
    getter of its library, and whether the problem has any work."""

    def __init__(self, p: Problem, library: str, poison: bool) -> None:
        self.p = p
        self.device = p.device[1]
        self.alloc = CudaAllocator(library, self.device, poison)
        self.stream = stream_getter(library)
        self.work = p.has_work


class ForwardPlan(_Plan):
    """attention_forward for one call signature (shapes, strides, dtype, device, options)."""

    def __init__(
        self,
        p: Problem,
        qi: ArrayInfo,
        ki: ArrayInfo,
        vi: ArrayInfo,
        choice: _dispatch.KernelChoice = _dispatch.DEFAULT,
        poison: bool = False,
        alibi: ArrayInfo | None = None,
    ) -> None:
        super().__init__(p, qi.library, poison)
        self.library = qi.library
        self.shapes = (p.q_shape, p.dtype, p.lse_shape, p.lse_dtype)
        # torch tensors take the shortest path (the host time of small calls matters)
        # packed calls' work lists (an int32 workspace; cuflash/_dispatch.py, work_list_bytes)
        self.work_list_words = _dispatch.work_list_bytes(p, "forward") // 4
        self.torch_fast = qi.library == "torch" and self.work and not poison and not p.packed
        if self.torch_fast:
            import torch

            self._torch_outputs = (
                torch.empty_like,
                torch.contiguous_format,
                torch.empty,
                self.alloc.torch_dtype(p.lse_dtype),
                self.alloc.torch_device,
            )
        if not self.work:
            return
        strides = _forward_strides(p, qi, ki, vi)
        tensors = _with_extras(p, FORWARD_TENSORS, strides, alibi)
        arch, sms = _target(self.device)
        self.runs = _ready(
            p,
            strides,
            tensors,
            qi.ptr,
            self.device,
            lambda c: _dispatch.forward(p, strides, arch, sms, c),
            choice,
        )

    def _run(self, pointers: tuple[int, ...]) -> None:
        """Launches on the pointers of FORWARD_TENSORS (and the slopes')."""
        self.launch(self.stream(self.device), pointers)

    def launch(self, stream: int, pointers: tuple[int, ...]) -> None:
        """Launches on `stream`, on the pointers of FORWARD_TENSORS (and the slopes', then a
        packed call's offsets and a workspace of work_list_words int32 words), o and lse
        C-contiguous: the outputs belong to the caller (XLA's buffers under cuflash.jax)."""
        aligned = not (pointers[0] | pointers[1] | pointers[2] | pointers[3]) & 15
        self.runs.pick(aligned)(stream, pointers)

    def call_arrays(self, arrays: tuple) -> tuple[Any, Any]:
        """Runs the plan on arrays whose signature it was built for (cuflash/_plans.py)."""
        if not self.torch_fast:
            return self(*_plans.pointers(arrays))
        q = arrays[0]
        empty_like, contiguous, empty, lse_dtype, device = self._torch_outputs
        o = empty_like(q, memory_format=contiguous)
        lse = empty(self.shapes[2], dtype=lse_dtype, device=device)
        pointers = (q.data_ptr(), arrays[1].data_ptr(), arrays[2].data_ptr())
        pointers += (o.data_ptr(), lse.data_ptr())
        self._run((*pointers, *(a.data_ptr() for a in arrays[3:])))
        return o, lse

    def __call__(self, q_ptr: int, k_ptr: int, v_ptr: int, *extra_ptr: int) -> tuple[Any, Any]:
        """Runs the plan on the pointers of q, k, v (then the ALiBi slopes and the packed
        sequences' offsets, where it has them; the plan allocates the work lists' workspace)."""
        o_shape, dtype, lse_shape, lse_dtype = self.shapes
        # a row that sees no key (no keys at all, here) has o = 0 and lse = -inf
        o = self.alloc(o_shape, dtype, None if self.work else 0.0)
        lse = self.alloc(lse_shape, lse_dtype, None if self.work else -np.inf)
        if self.work:
            # released when this returns: the allocators are stream-ordered (BackwardPlan's D)
            _held, work_list = workspace(self.alloc, self.work_list_words)
            self._run((q_ptr, k_ptr, v_ptr, o.ptr, lse.ptr, *extra_ptr, *work_list))
        return self.alloc.result(o), self.alloc.result(lse)


# The FP8 forward's pointers: FORWARD_TENSORS, its descale factors (0 for none) and V^T's buffer
# (read through its map only, _params.MAP_ONLY).
FP8_FORWARD_TENSORS = (*FORWARD_TENSORS, *_params.DESCALES, "vt")


class Fp8ForwardPlan(_Plan):
    """The FP8 forward for one call signature: V^T (kernels_cu/fp8_transpose.cu) into a buffer of
    the call, then the TMA forward on e4m3 tiles; O in bfloat16, lse in float32. q, k and v must
    be TMA-readable (16-byte aligned, d a multiple of 16; the caller checks)."""

    def __init__(
        self,
        p: Problem,
        qi: ArrayInfo,
        ki: ArrayInfo,
        vi: ArrayInfo,
        descales: tuple[ArrayInfo | None, ArrayInfo | None, ArrayInfo | None],
        choice: _dispatch.KernelChoice = _dispatch.DEFAULT,
        poison: bool = False,
    ) -> None:
        super().__init__(p, qi.library, poison)
        self.vt_words = -(-p.batch * p.heads_kv * p.head_dim * p.keys_padded // 4)
        if not self.work:
            return
        kp, d = p.keys_padded, p.head_dim
        strides = _forward_strides(p, qi, ki, vi)
        strides["vt"] = (p.heads_kv * d * kp, d * kp, kp)
        for name, info in zip(_params.DESCALES, descales, strict=True):
            strides[name] = (0, 0, 0) if info is None else (*info.strides, 0)
        arch, sms = _target(self.device)
        launches = _dispatch.forward_fp8(p, strides, arch, sms, choice)
        base = qi.ptr & ~15 or 16
        self.forward = Run(launches.forward, p, strides, FP8_FORWARD_TENSORS, base, self.device)
        # V^T's pass: Params' v is the source, its o the V^T buffer
        moved = {"v": strides["v"], "o": strides["vt"]}
        self.transpose = Run(launches.transpose, p, moved, ("v", "o"), base, self.device)

    def call_arrays(self, arrays: tuple, given: tuple[bool, bool, bool]) -> tuple[Any, Any]:
        """Runs the plan on q, k, v and the descale factors that are `given` (in that order)."""
        pointers = _plans.pointers(arrays)
        rest = iter(pointers[3:])
        return self(*pointers[:3], tuple(next(rest) if g else 0 for g in given))

    def __call__(
        self, q_ptr: int, k_ptr: int, v_ptr: int, descale_ptrs: tuple[int, int, int]
    ) -> tuple[Any, Any]:
        """Runs the plan on the pointers of q, k, v and of the descale factors (0: none)."""
        p = self.p
        if (q_ptr | k_ptr | v_ptr) & 15:
            raise ValueError(
                "attention_forward_fp8 reads q, k and v with the TMA unit: their data must be "
                "16-byte aligned; make a contiguous copy"
            )
        o = self.alloc(p.q_shape, p.out_dtype, None if self.work else 0.0)
        lse = self.alloc(p.lse_shape, p.lse_dtype, None if self.work else -np.inf)
        if self.work:
            # released when this returns: the allocators are stream-ordered
            vt = self.alloc((self.vt_words,), "int32")
            stream = self.stream(self.device)
            self.transpose(stream, (v_ptr, vt.ptr))
            pointers = (q_ptr, k_ptr, v_ptr, o.ptr, lse.ptr, *descale_ptrs, vt.ptr)
            self.forward(stream, pointers)
        return self.alloc.result(o), self.alloc.result(lse)


class BackwardPlan(_Plan):
    """attention_backward for one call signature: preprocess, dK/dV and dQ launches."""

    def __init__(
        self,
        p: Problem,
        doi: ArrayInfo,
        qi: ArrayInfo,
        ki: ArrayInfo,
        vi: ArrayInfo,
        oi: ArrayInfo,
        lsei: ArrayInfo,
        choice: _dispatch.KernelChoice = _dispatch.DEFAULT,
        poison: bool = False,
        alibi: ArrayInfo | None = None,
    ) -> None:
        super().__init__(p, qi.library, poison)
        if not self.work:
            return
        self.delta_dtype = "float64" if p.dtype in _kernels.EXACT_DTYPES else "float32"
        self.work_list_words = _dispatch.work_list_bytes(p, "backward") // 4
        strides = {
            "q": p.bhs_strides(qi.strides),
            "k": p.bhs_strides(ki.strides),
            "v": p.bhs_strides(vi.strides),
            "o": p.bhs_strides(oi.strides),
            "dout": p.bhs_strides(doi.strides),
            "lse": p.lse_strides(lsei.strides),
            "delta": p.lse_strides(c_contiguous_strides(p.lse_shape)),
            "dq": p.bhs_strides(c_contiguous_strides(p.q_shape)),
            "dk": p.bhs_strides(c_contiguous_strides(p.kv_shape)),
            "dv": p.bhs_strides(c_contiguous_strides(p.kv_shape)),
        }
        tensors = _with_extras(p, BACKWARD_TENSORS, strides, alibi)
        # D's buffer is the backward's workspace: where the fused backward is chosen, its counters
        # and dQ sums follow D, and their pointers follow a call's (launch)
        self.workspace = _dispatch.backward_workspace(p, choice)
        if self.workspace.accum:
            tensors = (*tensors, *FUSED_WORKSPACE)
        arch, sms = _target(self.device)
        self.preprocess, self.dkdv, self.dq = _ready(
            p,
            strides,
            tensors,
            qi.ptr,
            self.device,
            lambda c: _dispatch.backward(p, strides, arch, sms, c),
            choice,
        )

    def call_arrays(self, arrays: tuple) -> tuple[Any, Any, Any]:
        """Runs the plan on arrays whose signature it was built for (cuflash/_plans.py)."""
        return self(*_plans.pointers(arrays))

    def __call__(
        self,
        do_ptr: int,
        q_ptr: int,
        k_ptr: int,
        v_ptr: int,
        o_ptr: int,
        lse_ptr: int,
        *extra_ptr: int,
    ) -> tuple[Any, Any, Any]:
        """Runs the plan on the pointers of do, q, k, v, o, lse (then the ALiBi slopes and the
        packed sequences' offsets, where it has them)."""
        p = self.p
        fill = None if self.work else 0.0
        dq = self.alloc(p.q_shape, p.dtype, fill)
        dk = self.alloc(p.kv_shape, p.dtype, fill)
        dv = self.alloc(p.kv_shape, p.dtype, fill)
        if self.work:
            # D = rowsum(dO * O). Released when this returns: the allocators of torch and CuPy
            # are stream-ordered and every kernel that reads D runs on the allocating stream.
            if self.workspace.accum:  # D, then the fused backward's counters and sums
                delta = self.alloc((self.workspace.nbytes // 4,), "float32")
            else:
                delta = self.alloc(p.lse_shape, self.delta_dtype)
            _held, work_list = workspace(self.alloc, self.work_list_words)  # the same, packed
            pointers = (q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta.ptr, dq.ptr, dk.ptr)
            self.launch(self.stream(self.device), (*pointers, dv.ptr, *extra_ptr, *work_list))
        result = self.alloc.result
        return result(dq), result(dk), result(dv)

    def launch(self, stream: int, pointers: tuple[int, ...]) -> None:
        """Launches the three kernels on `stream`, on the pointers of BACKWARD_TENSORS (and the
        slopes', then a packed call's offsets and a workspace of work_list_words int32 words):
        delta, dq, dk and dv C-contiguous and owned by the caller; delta's buffer of
        workspace.nbytes bytes (_dispatch.backward_workspace)."""
        q, k, v, o, do, _, delta, dq, dk, dv = pointers[:10]
        if self.workspace.accum:
            ws = self.workspace
            pointers = (*pointers, delta + ws.accum, delta + ws.semaphores)
        self.preprocess.pick(not (o | do) & 15)(stream, pointers)
        aligned = not (q | k | v | do | dq | dk | dv | (delta if self.workspace.accum else 0)) & 15
        self.dkdv.pick(aligned)(stream, pointers)
        self.dq.pick(aligned)(stream, pointers)
