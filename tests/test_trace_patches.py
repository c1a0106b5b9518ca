"""The kernel traces' patches (bench/trace_forward.py, bench/trace_fused.py) against today's
sources: each anchor found once where the trace tool looks for it, so that a change to a kernel's
loops cannot leave its trace broken unnoticed until a device run (v50's change to the TMA
forward's loops moved three of the forward trace's anchors). CPU only: no kernel is built."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("tool", ["trace_forward", "trace_fused"])
def test_trace_patches_find_their_anchors(
    tool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module(tool)
    trace_patch = importlib.import_module("trace_patch")
    replacements = getattr(module, "REPLACEMENTS", ())
    kernels = trace_patch.patched_kernels(tmp_path, module.SOURCE, module.PATCHES, replacements)
    text = (kernels / module.SOURCE).read_text()
    # every patch and replacement landed: the stamps are in the source
    assert text.count("TRACE_AT(") >= len(module.PATCHES) - 1
    for _, new in replacements:
        assert new in text
