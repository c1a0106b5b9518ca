"""Arrays in, arrays out: what an input is, and how to hand results back in the caller's library.

Each supported library has a small adapter. Inputs are described without copying (pointer, shape,
strides in elements, dtype name, device); outputs are allocated by the caller's own library on the
inputs' device, so results come back as the caller's array type with no copy:

  numpy       CPU only; bfloat16 through ml_dtypes where it is installed
  torch       CPU and CUDA; kernels run on torch.cuda.current_stream()
  cupy        CUDA; kernels run on cupy.cuda.get_current_stream()
  jax         CPU and CUDA; CUDA buffers are exchanged through DLPack (allocated by CuPy and handed
              to JAX without a copy; bfloat16 is relabelled in the capsule, never converted)
  dlpack      any other object with __dlpack__: read through its capsule; results come back as
              NumPy arrays (CPU) or CuPy arrays (CUDA)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _dlpack

CPU, CUDA = "cpu", "cuda"


@dataclass(frozen=True)
class ArrayInfo:
    """An input array as the kernels see it. Strides are in elements."""

    obj: Any
    name: str  # the argument's name, for error messages
    library: str
    device: tuple[str, int]  # ("cpu", 0) or ("cuda", index)
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    ptr: int


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _library_of(obj: Any) -> str:
    module = type(obj).__module__.split(".")[0]
    if isinstance(obj, np.ndarray):
        return "numpy"
    if module == "torch":
        return "torch"
    if module == "cupy":
        return "cupy"
    if module in ("jax", "jaxlib"):
        return "jax"
    return "dlpack"


def _is_jax_tracer(obj: Any) -> bool:
    import jax

    return isinstance(obj, jax.core.Tracer)


def probe(obj: Any, name: str) -> tuple[str, tuple[str, int]]:
    """(library, device) of an input, cheaply and without taking a DLPack capsule."""
    library = _library_of(obj)
    if library == "numpy":
        return library, (CPU, 0)
    if library == "torch":
        dev = obj.device
        if dev.type not in (CPU, CUDA):
            raise ValueError(
                f"{name} is on device '{dev}'; cuflash runs on 'cpu' and 'cuda' devices"
            )
        return library, (dev.type, dev.index or 0)
    if library == "cupy":
        return library, (CUDA, obj.device.id)
    if library == "jax" and _is_jax_tracer(obj):
        raise TypeError(
            f"{name} is a traced JAX array ({type(obj).__name__}): cuflash.attention and its "
            f"siblings run eagerly on concrete arrays; inside jax.jit, grad, vmap and other "
            f"transformations use cuflash.jax.attention (or cuflash.jax.attention_forward / "
            f"attention_backward), which run as XLA custom calls"
        )
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        raise TypeError(
            f"{name} must be an array that supports DLPack (NumPy, CuPy, PyTorch, JAX, ...); "
            f"got {_type_name(obj)}"
        )
    device_type, device_id = obj.__dlpack_device__()
    if device_type in (_dlpack.KDL_CPU, _dlpack.KDL_CUDA_HOST):
        return library, (CPU, 0)
    if device_type in (_dlpack.KDL_CUDA, _dlpack.KDL_CUDA_MANAGED):
        return library, (CUDA, int(device_id))
    raise ValueError(f"{name} is on an unsupported device (DLPack device type {device_type})")


def describe(obj: Any, name: str, library: str, device: tuple[str, int]) -> ArrayInfo:
    """Describes one input whose library and device `probe` returned."""
    if library == "numpy":
        itemsize = obj.itemsize
        return ArrayInfo(
            obj,
            name,
            library,
            device,
            obj.dtype.name,
            obj.shape,
            tuple(s // itemsize for s in obj.strides),
            obj.__array_interface__["data"][0],
        )
    if library == "torch":
        return ArrayInfo(
            obj,
            name,
            library,
            device,
            str(obj.dtype).removeprefix("torch."),
            tuple(obj.shape),
            tuple(obj.stride()),
            obj.data_ptr(),
        )
    if library == "cupy":
        itemsize = obj.itemsize
        return ArrayInfo(
            obj,
            name,
            library,
            device,
            obj.dtype.name,
            obj.shape,
            tuple(s // itemsize for s in obj.strides),
            obj.data.ptr,
        )
    if device[0] == CPU:
        capsule = obj.__dlpack__()
    else:
        # The producer makes our launch stream wait for its pending writes (no host sync).
        stream = launch_stream(library, device[1])
        capsule = obj.__dlpack__(stream=dlpack_stream_argument(stream))
    view = _dlpack.read_capsule(capsule)
    del capsule  # unconsumed: the producer's destructor releases its reference
    return ArrayInfo(obj, name, library, device, view.dtype, view.shape, view.strides, view.ptr)


# ---------------------------------------------------------------------------------------------
# CPU side: a NumPy view of any CPU input, and results in the caller's library.

# The NumPy dtype that stores each element format (bfloat16 as its 16 raw bits).
_STORAGE = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float64": np.float64,
    "int32": np.int32,  # the offsets of packed sequences
    "float8_e4m3fn": np.uint8,  # raw bits (the FP8 forward's inputs)
}


def numpy_view(info: ArrayInfo) -> np.ndarray:
    """The input as a NumPy array without a copy (bfloat16 as raw uint16 bits)."""
    if info.library == "numpy":
        return info.obj.view(np.uint16) if info.dtype == "bfloat16" else info.obj
    storage = np.dtype(_STORAGE[info.dtype])
    itemsize = storage.itemsize
    if any(n == 0 for n in info.shape):
        return np.empty(info.shape, storage)
    lo = sum((n - 1) * s for n, s in zip(info.shape, info.strides, strict=False) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(info.shape, info.strides, strict=False) if s > 0)
    span = (hi - lo + 1) * itemsize
    buffer = (ctypes.c_char * span).from_address(info.ptr + lo * itemsize)
    return np.ndarray(
        info.shape,
        storage,
        buffer=buffer,
        offset=-lo * itemsize,
        strides=tuple(s * itemsize for s in info.strides),
    )


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as the GPU's cvt.rn.bf16.f32 does; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 float8_e4m3fn bit patterns (no infinities; 0x7F and
    0xFF are NaN; exponent bias 7, subnormals m / 8 * 2^-6)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    normal = (1 + mantissa / 8) * np.exp2(exponent - 7.0)
    values = sign * np.where(exponent == 0, mantissa / 8 * 2.0**-6, normal)
    return np.where((codes & 0x7F) == 0x7F, np.nan, values).astype(np.float32)


E4M3_VALUES = _e4m3_values()


def as_float(info: ArrayInfo) -> np.ndarray:
    """The input's values as float32/float64 NumPy (a view where no conversion is needed)."""
    if info.dtype == "float8_e4m3fn":
        if info.library == "numpy":  # ml_dtypes' float8_e4m3fn
            return np.asarray(info.obj).astype(np.float32)
        return E4M3_VALUES[numpy_view(info)]
    view = numpy_view(info)
    return bf16_bits_to_float32(view) if info.dtype == "bfloat16" else view


def cpu_result(template: ArrayInfo, values: np.ndarray, dtype: str) -> Any:
    """`values` (float64) rounded to `dtype` and returned in the library of `template`."""
    if dtype == "bfloat16":
        storage = float_to_bf16_bits(values)
    else:
        storage = np.asarray(values).astype(dtype, copy=False)
    library = template.library
    if library == "torch":
        import torch

        if dtype == "bfloat16":
            return torch.from_numpy(storage.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(storage))
    if dtype == "bfloat16":
        storage = storage.view(_bfloat16_numpy_dtype(template))
    if library == "jax":
        import jax

        return jax.device_put(storage, next(iter(template.obj.devices())))
    return storage


def _bfloat16_numpy_dtype(template: ArrayInfo) -> Any:
    if template.library == "numpy" and template.dtype == "bfloat16":
        return template.obj.dtype
    try:
        import ml_dtypes
    except ImportError as exc:  # pragma: no cover - jax always brings ml_dtypes
        raise TypeError(
            f"{template.name} is bfloat16; bfloat16 NumPy results need the ml_dtypes package"
        ) from exc
    return ml_dtypes.bfloat16


# ---------------------------------------------------------------------------------------------
# CUDA side: the launch stream, output buffers, and results in the caller's library.


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            "cuflash needs CuPy to run on CUDA arrays: pip install 'cuflash[cuda12]' "
            "(cupy-cuda12x) or 'cuflash[cuda13]' (cupy-cuda13x)"
        ) from exc
    return cupy


def stream_getter(library: str):
    """A function device_index -> raw stream the kernels run on: the current stream of the
    framework that owns the inputs (torch's for torch tensors; CuPy's for everything else)."""
    if library == "torch":
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return raw
        return lambda index: torch.cuda.current_stream(index).cuda_stream
    cupy = _cupy()

    def current_stream(index: int) -> int:
        with cupy.cuda.Device(index):
            return cupy.cuda.get_current_stream().ptr

    return current_stream


def launch_stream(library: str, device_index: int) -> int:
    """The raw stream the kernels run on for inputs of `library` on `device_index`."""
    return stream_getter(library)(device_index)


class _RawStream:
    """A raw stream handle as an object of the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(stream_ptr: int, device_index: int) -> Any:
    """A CuPy stream object over the raw stream `stream_ptr` of device `device_index`, for CuPy
    operations that must run on the caller's stream: ``Stream.from_external`` where CuPy has it
    (CuPy 14 deprecates ``ExternalStream``), else ``ExternalStream``."""
    cupy = _cupy()
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        with cupy.cuda.Device(device_index):
            return from_external(_RawStream(stream_ptr))
    return cupy.cuda.ExternalStream(stream_ptr, device_index)


def dlpack_stream_argument(stream_ptr: int) -> int:
    """The `stream` value of __dlpack__ for a raw stream: 0 is ambiguous there, 1 is the legacy
    default stream (the DLPack convention for CUDA)."""
    return 1 if stream_ptr == 0 else stream_ptr


class CudaBuffer:
    """An output allocated on a CUDA device: `array` is the owning array object."""

    __slots__ = ("array", "ptr", "dtype")

    def __init__(self, array: Any, ptr: int, dtype: str) -> None:
        self.array, self.ptr, self.dtype = array, ptr, dtype


class CudaAllocator:
    """Output buffers of one library on one device: C-contiguous, owned by that library (CuPy for
    JAX and other producers), optionally filled. With `poison`, every buffer that no fill is asked
    for starts as NaN, so that an element a kernel fails to write shows up (an allocator may
    otherwise hand back correct old results): the GPU tests build their plans so."""

    def __init__(self, library: str, device_index: int, poison: bool = False) -> None:
        self.library, self.device_index, self.poison = library, device_index, poison
        if library == "torch":
            import torch

            self._torch = torch
            self._device = self.torch_device = torch.device(CUDA, device_index)
            self._dtypes = {name: getattr(torch, name) for name in _STORAGE}
            self.torch_dtype = self._dtypes.__getitem__
        else:
            self._cupy = _cupy()

    def __call__(self, shape: tuple[int, ...], dtype: str, fill: float | None = None) -> CudaBuffer:
        if fill is None and self.poison:  # integer buffers (offsets) start as -1
            fill = -1 if dtype == "int32" else float("nan")
        if self.library == "torch":
            tdtype = self._dtypes[dtype]
            if fill is None:
                array = self._torch.empty(shape, dtype=tdtype, device=self._device)
            else:
                array = self._torch.full(shape, fill, dtype=tdtype, device=self._device)
            return CudaBuffer(array, array.data_ptr(), dtype)
        cupy = self._cupy
        storage = np.uint16 if dtype == "bfloat16" else dtype
        with cupy.cuda.Device(self.device_index):
            if fill is None:
                array = cupy.empty(shape, dtype=storage)
            elif dtype == "bfloat16":
                bits = float_to_bf16_bits(np.asarray(fill, dtype=np.float32)).item()
                array = cupy.full(shape, bits, dtype=storage)
            else:
                array = cupy.full(shape, fill, dtype=storage)
        return CudaBuffer(array, array.data.ptr, dtype)

    def result(self, buffer: CudaBuffer) -> Any:
        """The buffer as an array of the caller's library (no copy)."""
        if self.library in ("torch", "cupy"):
            return buffer.array
        if self.library == "jax":
            import jax.dlpack

            source = buffer.array
            if buffer.dtype == "bfloat16":
                source = _RelabelledExport(buffer.array, code=4, bits=16)
            # Under the buffer's device, CuPy's __dlpack__ makes JAX's stream wait on the stream
            # the kernels ran on (an event, no host synchronisation).
            with self._cupy.cuda.Device(self.device_index):
                return jax.dlpack.from_dlpack(source)
        if buffer.dtype == "bfloat16":
            raise TypeError(
                "bfloat16 results cannot be returned to this array library through CuPy; "
                "pass PyTorch, JAX or CuPy arrays"
            )
        return buffer.array


class _RelabelledExport:
    """A CuPy buffer exported through DLPack under another dtype label (uint16 -> bfloat16)."""

    def __init__(self, array: Any, code: int, bits: int) -> None:
        self._array, self._code, self._bits = array, code, bits

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()

    def __dlpack__(self, *, stream: Any = None, **_: Any) -> Any:
        capsule = self._array.__dlpack__(stream=stream)
        _dlpack.relabel_capsule_dtype(capsule, self._code, self._bits)
        return capsule
