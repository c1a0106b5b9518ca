"""The CUDA backend: compiling, caching and launching the kernels of kernels_cu/.

Kernels are compiled on first use with NVRTC through ``cupy.RawModule`` for the device's own
architecture (sm_90a on Hopper, sm_80/86/89 otherwise), one module per template instance, so a
first call compiles only what it runs. CuPy keeps the binaries in its disk cache (keyed by the
expanded source text, so an edited header is a new key); loaded functions are kept here in memory
per (instance, device). A lock per instance makes concurrent first calls compile once.

Launches go on the caller's stream (torch's current stream for torch tensors, CuPy's current
stream otherwise) and never synchronise the host.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from . import _kernels
from ._interop import ArrayInfo, cuda_empty, cuda_result, launch_stream
from ._validate import Problem

_MAX_GRID_X = 2**31 - 1


class _StreamRef:
    """What cupy's Function.__call__ needs of a stream: its raw pointer."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Loaded:
    __slots__ = ("function", "spec")

    def __init__(self, function: Any, spec: _kernels.KernelSpec) -> None:
        self.function, self.spec = function, spec


_loaded: dict[tuple[str, int], _Loaded] = {}
_locks: dict[tuple[str, int], threading.Lock] = {}
_locks_guard = threading.Lock()
compile_count = 0  # modules built or read from the disk cache in this process (for tests)


def _device_arch(cupy: Any, device_index: int) -> str:
    return _kernels.kernel_arch(cupy.cuda.Device(device_index).compute_capability)


def load(spec: _kernels.KernelSpec, device_index: int) -> _Loaded:
    """The compiled function of `spec` on device `device_index` (compiled once per process)."""
    key = (spec.name_expression, device_index)
    loaded = _loaded.get(key)
    if loaded is not None:
        return loaded
    with _locks_guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        loaded = _loaded.get(key)
        if loaded is None:
            loaded = _compile(spec, device_index)
            _loaded[key] = loaded
    return loaded


def _compile(spec: _kernels.KernelSpec, device_index: int) -> _Loaded:
    global compile_count
    import cupy

    with cupy.cuda.Device(device_index) as device:
        limit = device.attributes["MaxSharedMemoryPerBlockOptin"]
        if spec.smem_bytes > limit:
            raise RuntimeError(
                f"{spec.name_expression} needs {spec.smem_bytes} bytes of shared memory per block; "
                f"GPU {device_index} allows {limit}"
            )
        # CuPy appends its own -arch=sm_XX after ours; NVRTC keeps the "a" feature suffix.
        options = _kernels.COMPILE_OPTIONS + (f"-arch={_device_arch(cupy, device_index)}",)
        module = cupy.RawModule(
            code=_kernels.expanded_source(spec.source),
            options=options,
            name_expressions=[spec.name_expression],
        )
        kernel = module.get_function(spec.name_expression)
        if spec.smem_bytes > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = spec.smem_bytes
        function = kernel.kernel  # the per-device cupy.cuda.function.Function
        compile_count += 1
    return _Loaded(function, spec)


def _launch(loaded: _Loaded, grid: int, device_index: int, stream_ptr: int, args: tuple) -> None:
    if grid > _MAX_GRID_X:
        raise ValueError(f"problem too large: {grid} thread blocks exceed the CUDA grid limit")
    import cupy

    with cupy.cuda.Device(device_index):
        loaded.function(
            (grid, 1, 1),
            (loaded.spec.threads, 1, 1),
            args,
            shared_mem=loaded.spec.smem_bytes,
            stream=_StreamRef(stream_ptr),
        )


# ---------------------------------------------------------------------------------------------
# Argument packing: pointers as uint64, strides as int64, sizes as int32, scale in the
# accumulator's precision.

_u64, _i64, _i32 = np.uint64, np.int64, np.int32


def _strides(p: Problem, strides: tuple[int, ...]) -> tuple:
    return tuple(_i64(s) for s in p.bhs_strides(strides))


def _lse_strides(p: Problem, info_or_buffer: Any) -> tuple:
    s = info_or_buffer.strides
    return (_i64(0), _i64(0), _i64(s[0])) if p.two_d else tuple(_i64(x) for x in s)


def _vectorisable(p: Problem, arrays: list[Any]) -> bool:
    """True when every tile row can move in 16-byte chunks: d, all strides and all base pointers
    aligned to 16 bytes (checked per call; views with odd offsets take the element-wise path)."""
    chunk = 16 // _kernels.ITEMSIZE[p.dtype]
    if p.head_dim % chunk:
        return False
    for a in arrays:
        if a.ptr % 16 or any(s % chunk for s in p.bhs_strides(a.strides)):
            return False
    return True


def _scale(p: Problem) -> Any:
    """The scale in the kernel's arithmetic type: float32 on the tensor cores, float64 on the
    exact path."""
    exact = p.dtype in _kernels.EXACT_DTYPES
    return np.float64(p.scale) if exact else np.float32(p.scale)


def _common_tail(p: Problem, vec: bool, blocks: int) -> tuple:
    return (
        _i32(p.heads_q),
        _i32(p.group),
        _i32(p.seq_q),
        _i32(p.seq_k),
        _i32(p.head_dim),
        _scale(p),
        _i32(p.causal),
        _i32(vec),
        _i32(blocks),
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def forward(p: Problem, qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo) -> tuple[Any, Any]:
    device = p.device[1]
    nothing_to_see = p.seq_k == 0
    o = cuda_empty(qi, p.q_shape, p.dtype, fill=0.0 if nothing_to_see else None)
    lse = cuda_empty(qi, p.lse_shape, p.lse_dtype, fill=-np.inf if nothing_to_see else None)
    if p.batch * p.heads_q * p.seq_q and not nothing_to_see:
        loaded = load(_kernels.kernel_spec("forward", p.dtype, p.head_dim), device)
        blocks = _ceil_div(p.seq_q, loaded.spec.rows_per_block)
        vec = _vectorisable(p, [qi, ki, vi, o])
        args = (
            _u64(qi.ptr),
            _u64(ki.ptr),
            _u64(vi.ptr),
            _u64(o.ptr),
            _u64(lse.ptr),
            *_strides(p, qi.strides),
            *_strides(p, ki.strides),
            *_strides(p, vi.strides),
            *_strides(p, o.strides),
            *_common_tail(p, vec, blocks),
        )
        _launch(
            loaded, blocks * p.batch * p.heads_q, device, launch_stream(qi.library, device), args
        )
    return cuda_result(qi, o), cuda_result(qi, lse)


def backward(
    p: Problem,
    doi: ArrayInfo,
    qi: ArrayInfo,
    ki: ArrayInfo,
    vi: ArrayInfo,
    oi: ArrayInfo,
    lsei: ArrayInfo,
) -> tuple[Any, Any, Any]:
    device = p.device[1]
    some_queries = p.batch * p.heads_q * p.seq_q > 0
    some_keys = p.batch * p.heads_kv * p.seq_k > 0
    work = some_queries and some_keys
    dq = cuda_empty(qi, p.q_shape, p.dtype, fill=None if work else 0.0)
    dk = cuda_empty(qi, p.kv_shape, p.dtype, fill=None if work else 0.0)
    dv = cuda_empty(qi, p.kv_shape, p.dtype, fill=None if work else 0.0)
    if work:
        stream = launch_stream(qi.library, device)
        acc = "float64" if p.dtype in _kernels.EXACT_DTYPES else "float32"
        delta = cuda_empty(qi, (p.batch, p.heads_q, p.seq_q), acc)
        vec = _vectorisable(p, [qi, ki, vi, doi, dq, dk, dv])

        # D = rowsum(dO * O)
        pre = load(_kernels.kernel_spec("preprocess", p.dtype, p.head_dim), device)
        rows = p.batch * p.heads_q * p.seq_q
        _launch(
            pre,
            _ceil_div(rows, pre.spec.rows_per_block),
            device,
            stream,
            (
                _u64(oi.ptr),
                _u64(doi.ptr),
                _u64(delta.ptr),
                *_strides(p, oi.strides),
                *_strides(p, doi.strides),
                _i32(p.heads_q),
                _i32(p.seq_q),
                _i32(p.head_dim),
                _i64(rows),
            ),
        )

        inputs = (
            _u64(qi.ptr),
            _u64(ki.ptr),
            _u64(vi.ptr),
            _u64(doi.ptr),
            _u64(lsei.ptr),
            _u64(delta.ptr),
        )
        in_strides = (
            *_strides(p, qi.strides),
            *_strides(p, ki.strides),
            *_strides(p, vi.strides),
            *_strides(p, doi.strides),
            *_lse_strides(p, lsei),
        )

        dkdv = load(_kernels.kernel_spec("dkdv", p.dtype, p.head_dim), device)
        blocks = _ceil_div(p.seq_k, dkdv.spec.rows_per_block)
        _launch(
            dkdv,
            blocks * p.batch * p.heads_kv,
            device,
            stream,
            (
                *inputs,
                _u64(dk.ptr),
                _u64(dv.ptr),
                *in_strides,
                *_strides(p, dk.strides),
                *_strides(p, dv.strides),
                *_common_tail(p, vec, blocks),
            ),
        )

        dqk = load(_kernels.kernel_spec("dq", p.dtype, p.head_dim), device)
        blocks = _ceil_div(p.seq_q, dqk.spec.rows_per_block)
        _launch(
            dqk,
            blocks * p.batch * p.heads_q,
            device,
            stream,
            (
                *inputs,
                _u64(dq.ptr),
                *in_strides,
                *_strides(p, dq.strides),
                *_common_tail(p, vec, blocks),
            ),
        )
        # `delta` is released when this returns: the allocators of torch and CuPy are
        # stream-ordered and every kernel that reads it runs on the allocating stream.
    return cuda_result(qi, dq), cuda_result(qi, dk), cuda_result(qi, dv)
