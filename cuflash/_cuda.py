"""The CUDA backend: compiling, caching and launching the kernels of kernels_cu/.

Kernels are compiled on first use with NVRTC through ``cupy.RawModule`` for the device's own
architecture (sm_90a on Hopper, sm_80/86/89 otherwise), one module per template instance, so a
first call compiles only what it runs. CuPy keeps the binaries in its disk cache (keyed by the
expanded source text, so an edited header is a new key); loaded functions are kept here in memory
per (instance, device). A lock per instance makes concurrent first calls compile once.

A validated call becomes a *plan* (ForwardPlan, BackwardPlan): kernels, grid sizes and every
argument that depends only on shapes and strides. Running a plan reads the data pointers,
allocates the outputs, and launches with cuLaunchKernel from a per-thread argument buffer. The API
keeps plans per call signature, so repeated calls skip validation (cuflash/_plans.py).

Launches go on the caller's stream (torch's current stream for torch tensors, CuPy's current
stream otherwise) and never synchronise the host.
"""

from __future__ import annotations

import math
import re
import struct
import threading
from typing import Any

import numpy as np

from . import _interop, _kernels, _plans
from ._dlpack import c_contiguous_strides
from ._interop import ArrayInfo, CudaAllocator, stream_getter
from ._validate import Problem

_MAX_GRID_X = 2**31 - 1


class _Loaded:
    __slots__ = ("function", "ptr", "spec")

    def __init__(self, function: Any, spec: _kernels.KernelSpec) -> None:
        self.function, self.ptr, self.spec = function, function.ptr, spec


_loaded: dict[tuple[str, int], _Loaded] = {}
_locks: dict[tuple[str, int], threading.Lock] = {}
_locks_guard = threading.Lock()
compile_count = 0  # modules built or read from the disk cache in this process (for tests)


_arch: dict[int, str] = {}
_sm_count: dict[int, int] = {}


def sm_count(device_index: int) -> int:
    """Multiprocessors of GPU `device_index`: the grid of the persistent kernels."""
    count = _sm_count.get(device_index)
    if count is None:
        import cupy

        count = _sm_count[device_index] = cupy.cuda.Device(device_index).attributes[
            "MultiProcessorCount"
        ]
    return count


def device_arch(device_index: int) -> str:
    """The kernel target of GPU `device_index` (sm_90a on Hopper, sm_80/86/89 otherwise)."""
    arch = _arch.get(device_index)
    if arch is None:
        import cupy

        arch = _arch[device_index] = _kernels.kernel_arch(
            cupy.cuda.Device(device_index).compute_capability
        )
    return arch


def spec_for(family: str, dtype: str, head_dim: int, device_index: int) -> _kernels.KernelSpec:
    """The instance of the table that runs on GPU `device_index`."""
    return _kernels.kernel_spec(family, dtype, head_dim, device_arch(device_index))


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
        arch = _kernels.kernel_arch(device.compute_capability)
        # CuPy appends its own -arch=sm_XX after ours; NVRTC keeps the "a" feature suffix.
        options = _kernels.COMPILE_OPTIONS + (f"-arch={arch}",)
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


# ---------------------------------------------------------------------------------------------
# Launching: cuLaunchKernel with the arguments packed into a per-thread buffer. Each kernel
# argument's C type is one struct code: Q pointer, q int64, i int32, f float, d double, and
# 128s for a tensor map (128 bytes, passed by value).

_tls = threading.local()


def _argument_items(fmt: str) -> list[str]:
    """One struct code per kernel argument: "3Q128s" -> ["Q", "Q", "Q", "128s"]."""
    items: list[str] = []
    for count, code in re.findall(r"(\d*)([A-Za-z])", fmt):
        if code == "s":
            items.append(count + code)
        else:
            items.extend(code * int(count or 1))
    return items


def _argument_buffer(fmt: str) -> tuple[np.ndarray, int]:
    """(bytes, address of the pointer array) for `fmt`, one pair per thread and format."""
    buffers = getattr(_tls, "buffers", None)
    if buffers is None:
        buffers = _tls.buffers = {}
    found = buffers.get(fmt)
    if found is None:
        items = _argument_items(fmt)
        data = np.zeros(struct.calcsize(fmt) + 8, dtype=np.uint8)
        base = data.ctypes.data
        # native alignment, as struct.pack_into lays the values out
        offsets = [
            struct.calcsize("".join(items[: i + 1])) - struct.calcsize(item)
            for i, item in enumerate(items)
        ]
        pointers = np.array([base + off for off in offsets], dtype=np.uint64)
        found = buffers[fmt] = (data, pointers, pointers.ctypes.data)
    return found[0], found[2]


def _context_ready(device_index: int) -> bool:
    ready = getattr(_tls, "contexts", None)
    if ready is None:
        ready = _tls.contexts = set()
    return device_index in ready


_runtime = _driver = _cupy = None


def _import_cupy() -> None:
    global _runtime, _driver, _cupy
    import cupy
    from cupy.cuda import runtime
    from cupy_backends.cuda.api import driver

    _runtime, _driver, _cupy = runtime, driver, cupy


def _launch(
    loaded: _Loaded, grid: int, device_index: int, stream: int, fmt: str, args: tuple
) -> None:
    if _driver is None:
        _import_cupy()
    if grid > _MAX_GRID_X:
        raise ValueError(f"problem too large: {grid} thread blocks exceed the CUDA grid limit")
    data, params = _argument_buffer(fmt)
    struct.pack_into(fmt, data, 0, *args)
    spec = loaded.spec
    launch = (loaded.ptr, grid, 1, 1, spec.threads, 1, 1, spec.smem_bytes, stream, params, 0)
    if _runtime.getDevice() == device_index and _context_ready(device_index):
        _driver.launchKernel(*launch)
        return
    with _cupy.cuda.Device(device_index):
        _runtime.memGetInfo()  # binds the device's primary context to this thread
        _tls.contexts.add(device_index)
        _driver.launchKernel(*launch)


# ---------------------------------------------------------------------------------------------
# Plans


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _chunk(p: Problem) -> int:
    """Elements in 16 bytes: the unit of the kernels' vectorised tile copies."""
    return 16 // _kernels.ITEMSIZE[p.dtype]


def _aligned(p: Problem, *bhs_strides: tuple[int, int, int]) -> bool:
    chunk = _chunk(p)
    return p.head_dim % chunk == 0 and all(s % chunk == 0 for ss in bhs_strides for s in ss)


def _tail(p: Problem) -> str:
    """struct codes of the trailing arguments: hq, group, nq, nk, d, scale, causal, vec, blocks."""
    return "iiiii" + ("d" if p.dtype in _kernels.EXACT_DTYPES else "f") + "iii"


def _tile_maps(
    p: Problem, infos: tuple, strides: tuple, seqs: tuple, heads: tuple, rows: tuple
) -> list | None:
    """TMA tensor maps of the arrays `infos` ((batch, head, seq) element strides `strides`, with
    `seqs` rows and `heads` heads), read in boxes of `rows` rows; None where the TMA unit cannot
    read one of them."""
    from . import _tma

    itemsize = _kernels.ITEMSIZE[p.dtype]
    maps = []
    for info, (sb, sh, ss), seq, nheads, box_rows in zip(
        infos, strides, seqs, heads, rows, strict=True
    ):
        shape = (p.head_dim, seq, nheads, p.batch)
        byte_strides = _tma.tma_strides(shape, (ss, sh, sb), itemsize)
        if byte_strides is None or info.ptr & 15:
            return None
        try:
            maps.append(_tma.TileMap(shape, byte_strides, box_rows, info.ptr))
        except _tma.TensorMapError:
            return None
    return maps


def _persistent_grid(work: int, causal: bool, device_index: int) -> int:
    """A block per SM; causal work goes in pairs of items per block (kernels_cu/common.cuh)."""
    return min(_ceil_div(work, 2 if causal else 1), sm_count(device_index))


class ForwardPlan:
    """attention_forward for one call signature (shapes, strides, dtype, device, options).

    On Hopper the warp-specialised TMA kernel runs when the TMA unit can read q, k and v (see
    _tma_setup); otherwise, and for calls whose pointers are not 16-byte aligned, the kernel of
    kernel_spec's table (loaded on first use when the TMA kernel serves the plan)."""

    def __init__(self, p: Problem, qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo) -> None:
        self.p = p
        self.device = p.device[1]
        self.library = qi.library
        self.alloc = CudaAllocator(qi.library, self.device)
        self.stream = stream_getter(qi.library)
        self.shapes = (p.q_shape, p.dtype, p.lse_shape, p.lse_dtype)
        if qi.library == "torch":
            import torch

            self._torch_outputs = (
                torch.empty_like,
                torch.contiguous_format,
                torch.empty,
                self.alloc.torch_dtype(p.lse_dtype),
                self.alloc.torch_device,
            )
        self.empty_keys = p.seq_k == 0
        self.work = p.batch * p.heads_q * p.seq_q > 0 and not self.empty_keys
        if not self.work:
            return
        strides = [p.bhs_strides(x) for x in (qi.strides, ki.strides, vi.strides)]
        strides.append(p.bhs_strides(c_contiguous_strides(p.q_shape)))  # o
        self.strides_aligned = _aligned(p, *strides)
        self.fmt = "5Q12q" + _tail(p)
        self.extra: tuple = ()
        if p.dtype in _kernels.TENSOR_CORE_DTYPES:
            # P is scaled by 2^-extra (kernels_cu/softmax.cuh): bfloat16 V can reach float32's
            # range, where sum_j P_j V_j could overflow; float16 V cannot.
            self.fmt += "f"
            shift = math.ceil(math.log2(p.seq_k)) if p.dtype == "bfloat16" and p.seq_k > 1 else 0
            self.extra = (float(shift),)
        self.middle = tuple(s for ss in strides for s in ss) + (
            p.heads_q,
            p.group,
            p.seq_q,
            p.seq_k,
            p.head_dim,
            p.scale,
            int(p.causal),
        )
        self.tma = self.strides_aligned and self._tma_setup(p, (qi, ki, vi), strides)
        self.loaded = None if self.tma else self._load_table_kernel()

    def _load_table_kernel(self) -> _Loaded:
        loaded = load(spec_for("forward", self.p.dtype, self.p.head_dim, self.device), self.device)
        self.blocks = _ceil_div(self.p.seq_q, loaded.spec.rows_per_block)
        self.grid = self.blocks * self.p.batch * self.p.heads_q
        self.loaded = loaded
        return loaded

    def _tma_setup(self, p: Problem, infos: tuple, strides: list) -> bool:
        """Tensor maps of q, k and v (and of o, written in boxes of 64 rows, one per consumer
        warpgroup, where the instance stores O with the TMA unit) and the persistent grid, where
        the TMA kernel applies."""
        arch = device_arch(self.device)
        spec = _kernels.tma_spec("forward", p.dtype, p.head_dim, arch, p.seq_q, p.causal)
        if spec is None:
            return False
        kv_rows = spec.rows_per_step
        maps = _tile_maps(
            p,
            infos,
            tuple(strides[:3]),
            (p.seq_q, p.seq_k, p.seq_k),
            (p.heads_q, p.heads_kv, p.heads_kv),
            (spec.rows_per_block, kv_rows, kv_rows),
        )
        if maps is None:
            return False
        # o is allocated contiguous per call (q's address stands in until a call patches in its
        # own; its strides are 16-byte multiples, checked with q's). Should the driver refuse its
        # map, the instance that writes O from registers runs instead.
        o_map = None
        if spec.o_via_tma:
            o_maps = _tile_maps(p, infos[:1], (strides[3],), (p.seq_q,), (p.heads_q,), (64,))
            if o_maps is None:
                spec = _kernels.tma_spec(
                    "forward", p.dtype, p.head_dim, arch, p.seq_q, p.causal, o_via_tma=False
                )
            else:
                o_map = o_maps[0]
        self.maps = maps
        self.o_map = o_map
        self.tma_loaded = load(spec, self.device)
        self.tma_slots, self.tma_row_shift = _kernels.causal_row_slots(
            p.seq_q, spec.rows_per_block, p.causal
        )
        self.tma_work = self.tma_slots * p.batch * p.heads_q
        self.tma_grid = _persistent_grid(self.tma_work, p.causal, self.device)
        self.tma_fmt = "128s128s128s128s" + self.fmt + "ii"
        return True

    def _run(self, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int) -> None:
        aligned = not (q_ptr | k_ptr | v_ptr | o_ptr) & 15
        if self.tma and aligned:
            q_map, k_map, v_map = self.maps
            q_bytes = q_map.bytes_for(q_ptr)
            # without TMA stores the kernel never reads its O map: q's bytes stand in
            o_bytes = self.o_map.bytes_for(o_ptr) if self.o_map else q_bytes
            _launch(
                self.tma_loaded,
                self.tma_grid,
                self.device,
                self.stream(self.device),
                self.tma_fmt,
                (
                    q_bytes,
                    k_map.bytes_for(k_ptr),
                    v_map.bytes_for(v_ptr),
                    o_bytes,
                    q_ptr,
                    k_ptr,
                    v_ptr,
                    o_ptr,
                    lse_ptr,
                    *self.middle,
                    1,
                    self.tma_slots,
                    *self.extra,
                    self.tma_work,
                    self.tma_row_shift,
                ),
            )
            return
        loaded = self.loaded or self._load_table_kernel()
        _launch(
            loaded,
            self.grid,
            self.device,
            self.stream(self.device),
            self.fmt,
            (
                q_ptr,
                k_ptr,
                v_ptr,
                o_ptr,
                lse_ptr,
                *self.middle,
                int(self.strides_aligned and aligned),
                self.blocks,
                *self.extra,
            ),
        )

    def call_arrays(self, arrays: tuple) -> tuple[Any, Any]:
        """Runs the plan on arrays whose signature it was built for (cuflash/_plans.py)."""
        if self.library != "torch" or not self.work or _interop.poison_outputs:
            return self(*_plans.pointers(arrays))
        # torch tensors: the shortest path (the host time of small calls matters)
        q, k, v = arrays
        empty_like, contiguous, empty, lse_dtype, device = self._torch_outputs
        o = empty_like(q, memory_format=contiguous)
        lse = empty(self.shapes[2], dtype=lse_dtype, device=device)
        self._run(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr())
        return o, lse

    def __call__(self, q_ptr: int, k_ptr: int, v_ptr: int) -> tuple[Any, Any]:
        o_shape, dtype, lse_shape, lse_dtype = self.shapes
        o = self.alloc(o_shape, dtype, 0.0 if self.empty_keys else None)
        lse = self.alloc(lse_shape, lse_dtype, -np.inf if self.empty_keys else None)
        if self.work:
            self._run(q_ptr, k_ptr, v_ptr, o.ptr, lse.ptr)
        return self.alloc.result(o), self.alloc.result(lse)


class BackwardPlan:
    """attention_backward for one call signature: preprocess, dK/dV and dQ launches.

    On Hopper the warp-specialised TMA kernels run when the TMA unit can read q, k, v and dO;
    otherwise, and for calls whose pointers are not 16-byte aligned, the kernels of
    kernel_spec's table (loaded on first use when the TMA kernels serve the plan)."""

    def __init__(
        self,
        p: Problem,
        doi: ArrayInfo,
        qi: ArrayInfo,
        ki: ArrayInfo,
        vi: ArrayInfo,
        oi: ArrayInfo,
        lsei: ArrayInfo,
    ) -> None:
        self.p = p
        self.device = p.device[1]
        self.library = qi.library
        self.alloc = CudaAllocator(qi.library, self.device)
        self.stream = stream_getter(qi.library)
        self.work = p.batch * p.heads_q * p.seq_q > 0 and p.batch * p.heads_kv * p.seq_k > 0
        if not self.work:
            return
        dev, dt, d = self.device, p.dtype, p.head_dim
        self.delta_dtype = "float64" if dt in _kernels.EXACT_DTYPES else "float32"
        self.pre = load(spec_for("preprocess", dt, d, dev), dev)

        rows = p.batch * p.heads_q * p.seq_q
        s_o, s_do = p.bhs_strides(oi.strides), p.bhs_strides(doi.strides)
        # D = rowsum(dO * O) (kernels_cu/backward_preprocess.cu): 16-byte chunks, as many lanes
        # per row as the row has chunks (a power of two), where O and dO allow it; else a warp
        # per row, element by element.
        self.pre_middle = (*s_o, *s_do, p.heads_q, p.seq_q, d, rows)
        warps = self.pre.spec.rows_per_block
        lanes = 32
        if dt in _kernels.TENSOR_CORE_DTYPES and _aligned(p, s_o, s_do):
            lanes = 1 << max(0, math.ceil(math.log2(_ceil_div(d, _chunk(p)))))
        self.pre_vec = (_ceil_div(rows, warps * (32 // lanes)), lanes, int(lanes < 32))
        self.pre_scalar = (_ceil_div(rows, warps), 32, 0)
        s_q, s_k, s_v = (p.bhs_strides(x.strides) for x in (qi, ki, vi))
        s_lse = (0, 0, lsei.strides[0]) if p.two_d else tuple(lsei.strides)
        s_dq = p.bhs_strides(c_contiguous_strides(p.q_shape))
        s_dkv = p.bhs_strides(c_contiguous_strides(p.kv_shape))  # dk and dv alike
        self.strides_aligned = _aligned(p, s_q, s_k, s_v, s_do, s_dq, s_dkv)
        options = (p.heads_q, p.group, p.seq_q, p.seq_k, d, p.scale, int(p.causal))
        inputs = (*s_q, *s_k, *s_v, *s_do, *s_lse)
        self.dkdv_middle = (*inputs, *s_dkv, *s_dkv, *options)
        self.dq_middle = (*inputs, *s_dq, *options)
        self.fmt_pre = "3Q6qiiiqii"
        self.fmt_dkdv = "8Q21q" + _tail(p)
        self.fmt_dq = "7Q18q" + _tail(p)
        self.tma = self.strides_aligned and self._tma_setup(
            p, (qi, ki, vi, doi), (s_q, s_k, s_v, s_do)
        )
        self.dkdv = self.dq = None
        if not self.tma:
            self._load_table_kernels()

    def _load_table_kernels(self) -> tuple[_Loaded, _Loaded]:
        p, dev = self.p, self.device
        dkdv = load(spec_for("dkdv", p.dtype, p.head_dim, dev), dev)
        dq = load(spec_for("dq", p.dtype, p.head_dim, dev), dev)
        self.dkdv_blocks = _ceil_div(p.seq_k, dkdv.spec.rows_per_block)
        self.dq_blocks = _ceil_div(p.seq_q, dq.spec.rows_per_block)
        self.dkdv, self.dq = dkdv, dq
        return dkdv, dq

    def _tma_setup(self, p: Problem, infos: tuple, strides: tuple) -> bool:
        """Tensor maps of q, k, v and dO (boxes of 64 rows, kernels_cu/backward_sm90_tma.cu) and
        the persistent grids, where the TMA kernels apply."""
        arch = device_arch(self.device)
        dq = _kernels.tma_spec("dq", p.dtype, p.head_dim, arch)
        dkdv = _kernels.tma_spec("dkdv", p.dtype, p.head_dim, arch)
        if dq is None or dkdv is None:
            return False
        maps = _tile_maps(
            p,
            infos,
            strides,
            (p.seq_q, p.seq_k, p.seq_k, p.seq_q),
            (p.heads_q, p.heads_kv, p.heads_kv, p.heads_q),
            (64, 64, 64, 64),
        )
        if maps is None:
            return False
        self.maps = maps
        self.tma_dq, self.tma_dkdv = load(dq, self.device), load(dkdv, self.device)
        self.tma_dq_blocks = _ceil_div(p.seq_q, dq.rows_per_block)
        self.tma_dkdv_blocks = _ceil_div(p.seq_k, dkdv.rows_per_block)
        self.tma_dq_work = self.tma_dq_blocks * p.batch * p.heads_q
        self.tma_dkdv_work = self.tma_dkdv_blocks * p.batch * p.heads_kv
        self.tma_dq_grid = _persistent_grid(self.tma_dq_work, p.causal, self.device)
        self.tma_dkdv_grid = _persistent_grid(self.tma_dkdv_work, p.causal, self.device)
        self.tma_fmt_dq = "128s" * 4 + self.fmt_dq + "i"
        self.tma_fmt_dkdv = "128s" * 4 + self.fmt_dkdv + "i"
        return True

    def call_arrays(self, arrays: tuple) -> tuple[Any, Any, Any]:
        """Runs the plan on arrays whose signature it was built for (cuflash/_plans.py)."""
        return self(*_plans.pointers(arrays))

    def __call__(
        self, do_ptr: int, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, lse_ptr: int
    ) -> tuple[Any, Any, Any]:
        p = self.p
        fill = None if self.work else 0.0
        dq = self.alloc(p.q_shape, p.dtype, fill)
        dk = self.alloc(p.kv_shape, p.dtype, fill)
        dv = self.alloc(p.kv_shape, p.dtype, fill)
        if self.work:
            dev = self.device
            stream = self.stream(dev)
            # D = rowsum(dO * O). Released when this returns: the allocators of torch and CuPy
            # are stream-ordered and every kernel that reads D runs on the allocating stream.
            delta = self.alloc((p.batch, p.heads_q, p.seq_q), self.delta_dtype)
            grid, lanes, vec = self.pre_vec if not (o_ptr | do_ptr) & 15 else self.pre_scalar
            _launch(
                self.pre,
                grid,
                dev,
                stream,
                self.fmt_pre,
                (o_ptr, do_ptr, delta.ptr, *self.pre_middle, lanes, vec),
            )
            aligned = not (q_ptr | k_ptr | v_ptr | do_ptr | dq.ptr | dk.ptr | dv.ptr) & 15
            inputs = (q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta.ptr)
            if self.tma and aligned:
                maps = tuple(
                    m.bytes_for(ptr)
                    for m, ptr in zip(self.maps, (q_ptr, k_ptr, v_ptr, do_ptr), strict=True)
                )
                _launch(
                    self.tma_dkdv,
                    self.tma_dkdv_grid,
                    dev,
                    stream,
                    self.tma_fmt_dkdv,
                    (
                        *maps,
                        *inputs,
                        dk.ptr,
                        dv.ptr,
                        *self.dkdv_middle,
                        1,
                        self.tma_dkdv_blocks,
                        self.tma_dkdv_work,
                    ),
                )
                _launch(
                    self.tma_dq,
                    self.tma_dq_grid,
                    dev,
                    stream,
                    self.tma_fmt_dq,
                    (
                        *maps,
                        *inputs,
                        dq.ptr,
                        *self.dq_middle,
                        1,
                        self.tma_dq_blocks,
                        self.tma_dq_work,
                    ),
                )
            else:
                dkdv_kernel, dq_kernel = (
                    (self.dkdv, self.dq) if self.dkdv is not None else self._load_table_kernels()
                )
                vec = int(self.strides_aligned and aligned)
                grid = self.dkdv_blocks * p.batch * p.heads_kv
                _launch(
                    dkdv_kernel,
                    grid,
                    dev,
                    stream,
                    self.fmt_dkdv,
                    (*inputs, dk.ptr, dv.ptr, *self.dkdv_middle, vec, self.dkdv_blocks),
                )
                grid = self.dq_blocks * p.batch * p.heads_q
                _launch(
                    dq_kernel,
                    grid,
                    dev,
                    stream,
                    self.fmt_dq,
                    (*inputs, dq.ptr, *self.dq_middle, vec, self.dq_blocks),
                )
        result = self.alloc.result
        return result(dq), result(dk), result(dv)


def forward(p: Problem, qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo) -> tuple[Any, Any]:
    return ForwardPlan(p, qi, ki, vi)(qi.ptr, ki.ptr, vi.ptr)


def backward(
    p: Problem,
    doi: ArrayInfo,
    qi: ArrayInfo,
    ki: ArrayInfo,
    vi: ArrayInfo,
    oi: ArrayInfo,
    lsei: ArrayInfo,
) -> tuple[Any, Any, Any]:
    plan = BackwardPlan(p, doi, qi, ki, vi, oi, lsei)
    return plan(doi.ptr, qi.ptr, ki.ptr, vi.ptr, oi.ptr, lsei.ptr)
