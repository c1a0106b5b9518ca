"""The kernels' one argument: the host's mirror of Params (cuflash/_params.py) against the C++
struct of kernels_cu/params.cuh, and the fields a plan fills."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from cuflash import _dispatch, _kernels, _params, compile_check
from cuflash._problem import Problem


def problem(**kw) -> Problem:
    fields = dict(
        batch=2,
        heads_q=8,
        heads_kv=2,
        seq_q=300,
        seq_k=500,
        head_dim=64,
        dtype="bfloat16",
        layout="bshd",
        two_d=False,
        window=(None, 0),
        scale=0.125,
        device=("cuda", 0),
        library="torch",
    )
    fields.update(kw)
    return Problem(**fields)


def _compile_params_with_asserts(tmp_path: Path, arch: str) -> subprocess.CompletedProcess:
    """params.cuh followed by the mirror's static_asserts, compiled for the device with nvcc."""
    nvcc = compile_check.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: this check compiles kernels_cu/params.cuh")
    unit = tmp_path / "params.cu"
    unit.write_text(_kernels.expanded_source("params.cuh") + _params.layout_asserts())
    command = [nvcc, "-std=c++17", "-c", f"-gencode=arch=compute_{arch[3:]},code={arch}"]
    command += ["-o", str(tmp_path / "params.o"), str(unit)]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_host_and_device_layouts_agree(tmp_path: Path, arch: str):
    # The same static_asserts end every source the runtime compiles (cuflash/_kernels.py,
    # compiled_source); here they are compiled alone, for the device.
    proc = _compile_params_with_asserts(tmp_path, arch)
    assert proc.returncode == 0, proc.stderr


def test_layout_asserts_name_every_field():
    text = _params.layout_asserts()
    for name, _ in _params.Params._fields_:
        assert f"cuflash::Params, {name})" in text
    assert f"sizeof(cuflash::Params) == {ctypes.sizeof(_params.Params)}" in text


def test_a_drifted_mirror_fails_to_compile(tmp_path: Path, monkeypatch):
    class Drifted(ctypes.Structure):  # p_shift and vec swapped
        _fields_ = [
            (n, t)
            if n not in ("p_shift", "vec")
            else (("vec", t) if n == "p_shift" else ("p_shift", t))
            for n, t in _params.Params._fields_
        ]

    monkeypatch.setattr(_params, "Params", Drifted)
    proc = _compile_params_with_asserts(tmp_path, "sm_80")
    assert proc.returncode != 0 and "Params::vec offset" in proc.stderr


def test_fill_and_pointers():
    p = problem()
    strides = {"q": (300 * 8 * 64, 64, 8 * 64), "lse": (8 * 300, 300, 1)}
    launch = _dispatch.Launch(
        _kernels.instance("forward", "mma", "bfloat16", 64), 10, 3, vec=True, num_work=7
    )
    template = _params.fill(p, strides, **launch.params_fields())
    assert (template.q.batch, template.q.head, template.q.seq) == strides["q"]
    assert (template.batch, template.heads_q, template.heads_kv, template.group) == (2, 8, 2, 4)
    assert (template.seq_q, template.seq_k, template.head_dim) == (300, 500, 64)
    # causal: the right bound is 0, the left one unbounded (stored as nq + nk, mask.cuh)
    assert (template.window_left, template.window_right) == (800, 0)
    assert template.scale == 0.125 and template.p_shift == 9  # ceil(log2 500) for bfloat16
    assert (template.vec, template.num_blocks, template.num_work, template.rows) == (1, 3, 7, 4800)
    assert template.q.ptr == 0  # pointers come per call
    assert _params.fill(problem(dtype="float16"), {}).p_shift == 0
    # a window and the score modifiers: both bounds, the softcap (0: none), the slopes' strides
    mods = _params.fill(problem(window=(7, 3), softcap=30.0), {"alibi": (8, 1, 0)})
    assert (mods.window_left, mods.window_right, mods.softcap) == (7, 3, 30.0)
    assert (mods.alibi.batch, mods.alibi.head, mods.alibi.ptr) == (8, 1, 0)
    assert template.softcap == 0.0


def test_argument_blocks():
    template = _params.fill(problem(), {"q": (1, 2, 3)}, num_blocks=5)
    args = _params.Arguments(template, ("q", "lse", "alibi"), maps=2)
    args.set_pointers((0x1000, 0x2000, 0x3000))
    args.set_map(1, bytes(range(128)))
    call = args.params
    assert (call.q.ptr, call.lse.ptr, call.alibi.ptr, call.k.ptr) == (0x1000, 0x2000, 0x3000, 0)
    assert (call.q.batch, call.q.head, call.q.seq, call.num_blocks) == (1, 2, 3, 5)
    assert template.q.ptr == 0 and template.lse.ptr == 0  # the plan's template is untouched
    pointers = (ctypes.c_void_p * 2).from_address(args.address)
    assert ctypes.string_at(pointers[0] + 128, 128) == bytes(range(128))
    assert pointers[1] == ctypes.addressof(call)
    # without maps the block is Params alone
    plain = _params.Arguments(template, ("q",))
    assert (ctypes.c_void_p * 1).from_address(plain.address)[0] == ctypes.addressof(plain.params)
