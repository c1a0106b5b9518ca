"""Compiling the kernel instances of cuflash/_kernels.py, and keeping them.

Kernels are compiled on first use with NVRTC through ``cupy.RawModule`` for the device's own
architecture (sm_90a on Hopper, sm_80/86/89 otherwise), one module per template instance, so a
first call compiles only what it runs. CuPy keeps the binaries in its disk cache (keyed by the
source text, so an edited header is a new key); loaded functions are kept here in memory per
(instance, device). A lock per instance makes concurrent first calls compile once.
"""

from __future__ import annotations

import threading
from typing import Any

from . import _kernels
from ._kernels import KernelSpec


class Loaded:
    """A compiled instance on one device: the function handle and its launch shape."""

    __slots__ = ("function", "ptr", "spec")

    def __init__(self, function: Any, spec: KernelSpec) -> None:
        self.function, self.ptr, self.spec = function, function.ptr, spec


_loaded: dict[tuple[str, int], Loaded] = {}
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


_max_smem: dict[int, int] = {}


def max_shared_memory(device_index: int) -> int:
    """Bytes of shared memory one block may opt in to on GPU `device_index`."""
    limit = _max_smem.get(device_index)
    if limit is None:
        import cupy

        limit = _max_smem[device_index] = cupy.cuda.Device(device_index).attributes[
            "MaxSharedMemoryPerBlockOptin"
        ]
    return limit


_smem_per_sm: dict[int, int] = {}


def shared_memory_per_sm(device_index: int) -> int:
    """Bytes of shared memory of one multiprocessor of GPU `device_index`."""
    size = _smem_per_sm.get(device_index)
    if size is None:
        import cupy

        size = _smem_per_sm[device_index] = cupy.cuda.Device(device_index).attributes[
            "MaxSharedMemoryPerMultiprocessor"
        ]
    return size


def device_arch(device_index: int) -> str:
    """The kernel target of GPU `device_index` (sm_90a on Hopper, sm_80/86/89 otherwise)."""
    arch = _arch.get(device_index)
    if arch is None:
        import cupy

        arch = _arch[device_index] = _kernels.kernel_arch(
            cupy.cuda.Device(device_index).compute_capability
        )
    return arch


def load(spec: KernelSpec, device_index: int) -> Loaded:
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


def forget(names: set[str]) -> None:
    """Drops the loaded functions of these instances (tests that race a first compilation)."""
    for key in [key for key in _loaded if key[0] in names]:
        del _loaded[key]


def _compile(spec: KernelSpec, device_index: int) -> Loaded:
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
            code=_kernels.compiled_source(spec.source),
            options=options,
            name_expressions=[spec.name_expression],
        )
        kernel = module.get_function(spec.name_expression)
        if spec.smem_bytes > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = spec.smem_bytes
        function = kernel.kernel  # the per-device cupy.cuda.function.Function
        compile_count += 1
    return Loaded(function, spec)
