"""Launching a compiled kernel: cuLaunchKernel with its arguments passed by value.

Every kernel takes one Params (cuflash/_params.py); the TMA kernels take their four tensor maps
first (kernels_cu/tma.cuh). The caller hands over the address of the kernelParams pointer array
(cuflash/_params.py, Arguments); the driver copies the argument bytes at launch, so the block can
be written again as soon as this returns. Launches go on the caller's stream and never synchronise
the host.
"""

from __future__ import annotations

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


def launch(loaded: Loaded, grid: int, device_index: int, stream: int, kernel_params: int) -> None:
    """Runs `loaded` on `grid` blocks; `kernel_params` is the address of the array of pointers to
    its parameters."""
    if _driver is None:
        _import_cupy()
    if grid > _MAX_GRID_X:
        raise ValueError(f"problem too large: {grid} thread blocks exceed the CUDA grid limit")
    spec = loaded.spec
    call = (
        loaded.ptr,
        grid,
        1,
        1,
        spec.threads,
        1,
        1,
        spec.smem_bytes,
        stream,
        kernel_params,
        0,
    )
    if _runtime.getDevice() == device_index and _context_ready(device_index):
        _driver.launchKernel(*call)
        return
    with _cupy.cuda.Device(device_index):
        _runtime.memGetInfo()  # binds the device's primary context to this thread
        _tls.contexts.add(device_index)
        _driver.launchKernel(*call)
