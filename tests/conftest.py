"""Shared test setup: hypothesis profiles and the GPU marker.

HYPOTHESIS_PROFILE selects how many examples property tests draw: "ci" (default, CPU machines)
or "gpu" (the device machine). Tests marked `gpu` skip, with the reason, where no CUDA GPU and
CuPy are present.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from cuflash import testing

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "ci", max_examples=40, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.register_profile(
    "gpu", max_examples=200, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    reason = testing.gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
