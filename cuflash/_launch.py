"""Launching a compiled kernel: cuLaunchKernel with its arguments passed by value.

Every kernel takes one Params (cuflash/_params.py); the TMA kernels take their four tensor maps
first (kernels_cu/tma.cuh). The caller hands over the address of the kernelParams pointer array
(cuflash/_params.py, Arguments); the driver copies the argument bytes at launch, so the block can
be written again as soon as this returns. Launches go on the caller's stream and never synchronise
the host.

A programmatic launch (`launch(..., programmatic=True)`, sm_90) may start its blocks before the
previous kernel on the stream has finished, once every block of that kernel has run
griddepcontrol.launch_dependents (or exited); the kernel runs griddepcontrol.wait before it reads
what the previous one wrote. It goes through cuLaunchKernelEx (ctypes: CuPy's driver module
launches without attributes); stream capture records it as a programmatic graph edge.
"""

from __future__ import annotations

import ctypes
import threading

from ._compile import Loaded

_MAX_GRID_X = 2**31 - 1

_tls = threading.local()
_runtime = _driver = _cupy = None


def _import_cupy() -> None:
    global _runtime, _driver, _cupy
    import cupy
    from cupy.cuda import runtime
    from cupy_backends.cuda.api import driver

    _runtime, _driver, _cupy = runtime, driver, cupy


def _context_ready(device_index: int) -> bool:
    ready = getattr(_tls, "contexts", None)
    if ready is None:
        ready = _tls.contexts = set()
    return device_index in ready


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, then a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_launch_kernel_ex = None


def _programmatic(loaded: Loaded, grid: int, stream: int, kernel_params: int) -> None:
    global _launch_kernel_ex
    if _launch_kernel_ex is None:
        function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        function.restype = ctypes.c_int
        function.argtypes = (
            ctypes.POINTER(_LaunchConfig),
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        )
        _launch_kernel_ex = function
    config = getattr(_tls, "config", None)
    if config is None:
        attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attribute.value[0] = 1  # programmaticStreamSerializationAllowed
        config = _tls.config = _LaunchConfig(attrs=ctypes.pointer(attribute), num_attrs=1)
        _tls.attribute = attribute
    config.grid[:] = (grid, 1, 1)
    config.block[:] = (loaded.spec.threads, 1, 1)
    config.shared_mem_bytes = loaded.spec.smem_bytes
    config.stream = stream
    status = _launch_kernel_ex(ctypes.byref(config), loaded.ptr, kernel_params, None)
    if status != 0:
        raise RuntimeError(
            f"cuLaunchKernelEx of {loaded.spec.name_expression} failed: CUresult {status}"
        )


def launch(
    loaded: Loaded,
    grid: int,
    device_index: int,
    stream: int,
    kernel_params: int,
    programmatic: bool = False,
) -> None:
    """Runs `loaded` on `grid` blocks; `kernel_params` is the address of the array of pointers to
    its parameters. `programmatic`: a programmatic launch (the module's docstring)."""
    if _driver is None:
        _import_cupy()
    if grid > _MAX_GRID_X:
        raise ValueError(f"problem too large: {grid} thread blocks exceed the CUDA grid limit")
    spec = loaded.spec
    if not (_runtime.getDevice() == device_index and _context_ready(device_index)):
        with _cupy.cuda.Device(device_index):
            _runtime.memGetInfo()  # binds the device's primary context to this thread
            _tls.contexts.add(device_index)
            launch(loaded, grid, device_index, stream, kernel_params, programmatic)
        return
    if programmatic:
        _programmatic(loaded, grid, stream, kernel_params)
        return
    _driver.launchKernel(
        loaded.ptr, grid, 1, 1, spec.threads, 1, 1, spec.smem_bytes, stream, kernel_params, 0
    )
