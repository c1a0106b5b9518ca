"""Reading a DLPack capsule without importing any array library.

``__dlpack__()`` hands over a PyCapsule named "dltensor" that holds a DLManagedTensor. We only
read it (data pointer, device, dtype, shape, strides) and never rename the capsule, so the
producer's capsule destructor calls the deleter when the capsule is dropped; the memory stays
valid because the caller's array object is kept alive for the whole call.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

# DLDeviceType codes (dlpack.h)
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
# DLDataTypeCode codes
_DTYPE_NAMES = {
    (0, 8): "int8",
    (0, 16): "int16",
    (0, 32): "int32",
    (0, 64): "int64",
    (1, 8): "uint8",
    (1, 16): "uint16",
    (1, 32): "uint32",
    (1, 64): "uint64",
    (2, 16): "float16",
    (2, 32): "float32",
    (2, 64): "float64",
    (4, 16): "bfloat16",
    (5, 64): "complex64",
    (5, 128): "complex128",
    (6, 8): "bool",
    (10, 8): "float8_e4m3fn",  # kDLFloat8_e4m3fn (DLPack 1.1): the FP8 forward's inputs
}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_GetPointer.restype = ctypes.c_void_p
_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_IsValid.restype = ctypes.c_int
_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


@dataclass(frozen=True)
class DLPackView:
    """What a DLPack capsule says about an array. Strides are in elements."""

    ptr: int
    device_type: int
    device_id: int
    dtype: str  # "float16", "bfloat16", ..., or "code<c>bits<b>lanes<l>" when unknown
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def c_contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def read_capsule(capsule: object) -> DLPackView:
    """Reads a legacy "dltensor" capsule in place (it stays unconsumed)."""
    if not _IsValid(capsule, b"dltensor"):
        raise TypeError("__dlpack__() did not return a 'dltensor' capsule")
    managed = _DLManagedTensor.from_address(_GetPointer(capsule, b"dltensor"))
    t = managed.dl_tensor
    ndim = t.ndim
    shape = tuple(t.shape[i] for i in range(ndim))
    strides = tuple(t.strides[i] for i in range(ndim)) if t.strides else c_contiguous_strides(shape)
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = (
        _DTYPE_NAMES.get((code, bits), f"code{code}bits{bits}")
        if lanes == 1
        else (f"code{code}bits{bits}lanes{lanes}")
    )
    return DLPackView(
        ptr=(t.data or 0) + t.byte_offset,
        device_type=t.device.device_type,
        device_id=t.device.device_id,
        dtype=dtype,
        shape=shape,
        strides=strides,
    )


def relabel_capsule_dtype(capsule: object, code: int, bits: int) -> None:
    """Rewrites the dtype recorded in an unconsumed capsule (e.g. uint16 -> bfloat16).

    Used to hand a bfloat16 buffer allocated by a library without bfloat16 (CuPy) to one that has
    it (JAX): same bytes, same owner, only the label changes.
    """
    managed = _DLManagedTensor.from_address(_GetPointer(capsule, b"dltensor"))
    managed.dl_tensor.dtype.code = code
    managed.dl_tensor.dtype.bits = bits
