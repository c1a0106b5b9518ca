"""Shared test setup: hypothesis profiles and the GPU marker.

HYPOTHESIS_PROFILE selects how many examples property tests draw: "ci" (default, CPU machines)
or "gpu" (the device machine). Tests marked `gpu` skip, with the reason, where no CUDA GPU and
CuPy are present.
"""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "ci", max_examples=40, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.register_profile(
    "gpu", max_examples=200, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA GPU is usable through CuPy, else why not."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'cuflash[cuda12]' or 'cuflash[cuda13]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return f"no CUDA GPU: {type(exc).__name__}: {exc}"
    return None if count > 0 else "no CUDA GPU (device count 0)"


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
