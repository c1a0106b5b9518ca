"""Running a script in a fresh Python process whose JAX sees several CPU devices (the device
count is fixed when JAX starts, so the tests that need a mesh cannot set it in-process)."""

from __future__ import annotations

import os
import subprocess
import sys

import cuflash


def run_on_host_devices(script: str, count: int = 4, timeout: int = 600) -> str:
    """Runs `script` with `count` CPU devices and cuflash importable; returns its stdout and
    fails the calling test with the end of its stderr if it exits with an error."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={count}",
        JAX_PLATFORMS="cpu",
    )
    env["PYTHONPATH"] = os.pathsep.join(
        [
            os.path.dirname(os.path.dirname(os.path.abspath(cuflash.__file__))),
            env.get("PYTHONPATH", ""),
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
