"""The CUDA plans (cuflash/_cuda.py) on the CPU, with stand-ins for the compiler, the driver and
the allocator: which launch a call takes for aligned and unaligned pointers, the Params and tensor
maps each launch gets, and the fallback when the driver refuses a tensor map."""

from __future__ import annotations

import ctypes
import struct

import pytest
from test_tma import _fake_encoder

from cuflash import _compile, _cuda, _launch, _params, _tma
from cuflash._dispatch import KernelChoice
from cuflash._interop import ArrayInfo
from cuflash._problem import Problem


class FakeBuffer:
    def __init__(self, ptr, shape, dtype):
        self.ptr, self.shape, self.dtype, self.array = ptr, shape, dtype, ("array", ptr)


class FakeAllocator:
    """Hands out distinct, 256-byte aligned addresses, or odd ones after misalign()."""

    next_ptr = 1 << 32

    def __init__(self, library, device, poison=False):
        self.poison, self.fills, self.offset = poison, [], 0

    def __call__(self, shape, dtype, fill=None):
        FakeAllocator.next_ptr += 1 << 20
        self.fills.append(fill)
        return FakeBuffer(FakeAllocator.next_ptr + self.offset, shape, dtype)

    def result(self, buffer):
        return buffer


@pytest.fixture
def fakes(monkeypatch):
    """Records every launch as (instance, grid, Params, maps bytes or None)."""
    launches = []

    class Loaded:
        def __init__(self, spec):
            self.spec = spec

    monkeypatch.setattr(_compile, "load", lambda spec, device: Loaded(spec))
    monkeypatch.setattr(_compile, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(_compile, "sm_count", lambda device: 132)
    monkeypatch.setattr(_cuda, "CudaAllocator", FakeAllocator)
    monkeypatch.setattr(_cuda, "stream_getter", lambda library: lambda device: 7)
    monkeypatch.setattr(_tma, "_encode_fn", _fake_encoder(0))

    def launch(loaded, grid, device, stream, kernel_params):
        # read the argument block while it holds this call's arguments
        assert stream == 7 and device == 0
        spec = loaded.spec  # the TMA kernels take their maps first
        count = 2 if spec.path == "tma" or (spec.path, spec.family) == ("fused", "dkdv") else 1
        pointers = (ctypes.c_void_p * count).from_address(kernel_params)
        size = ctypes.sizeof(_params.Params)
        params = _params.Params.from_buffer_copy(ctypes.string_at(pointers[-1], size))
        maps = ctypes.string_at(pointers[0], 512) if count == 2 else None
        launches.append((loaded.spec, grid, params, maps))

    monkeypatch.setattr(_cuda._launch, "launch", launch)
    assert _cuda._launch is _launch
    return launches


def info(name, shape, ptr, dtype="bfloat16"):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return ArrayInfo(None, name, "cupy", ("cuda", 0), dtype, shape, tuple(reversed(strides)), ptr)


def problem(causal=True, d=64, dtype="bfloat16", seq_q=300, seq_k=500):
    return Problem(
        2,
        4,
        2,
        seq_q,
        seq_k,
        d,
        dtype,
        "bshd",
        False,
        (None, 0) if causal else (None, None),
        0.125,
        ("cuda", 0),
        "cupy",
    )


def test_forward_plan_launches(fakes):
    p = problem()
    qi = info("q", (2, 300, 4, 64), 1 << 30)
    ki, vi = info("k", (2, 500, 2, 64), 2 << 30), info("v", (2, 500, 2, 64), 3 << 30)
    plan = _cuda.ForwardPlan(p, qi, ki, vi)
    assert plan.runs.aligned.launch.spec.path == "tma"
    o, lse = plan(qi.ptr, ki.ptr, vi.ptr)
    ((spec, grid, params, maps),) = fakes
    assert spec.path == "tma" and spec.o_via_tma and grid <= 132
    assert (params.q.ptr, params.k.ptr, params.v.ptr) == (qi.ptr, ki.ptr, vi.ptr)
    assert (params.o.ptr, params.lse.ptr) == (o.ptr, lse.ptr)
    assert (params.q.batch, params.q.head, params.q.seq) == (300 * 4 * 64, 64, 4 * 64)
    assert (params.lse.batch, params.lse.head, params.lse.seq) == (4 * 300, 300, 1)
    assert (params.window_left, params.window_right, params.paired) == (800, 0, 1)
    assert params.num_work == params.num_blocks * 2 * 4 and params.vec == 1
    # the four maps, each holding its tensor's address (the fake encoder keeps it at byte 8)
    addresses = [struct.unpack_from("<Q", maps, 128 * i + 8)[0] for i in range(4)]
    assert addresses == [qi.ptr, ki.ptr, vi.ptr, o.ptr]
    # a call whose q is not 16-byte aligned takes the cp.async wgmma kernel, without maps
    plan(qi.ptr + 2, ki.ptr, vi.ptr)
    spec, grid, params, maps = fakes[-1]
    assert spec.path == "wgmma" and maps is None and params.vec == 0 and params.q.ptr == qi.ptr + 2
    assert grid == params.num_blocks * 2 * 4


def test_forward_plan_without_keys_fills_and_launches_nothing(fakes):
    p = problem(seq_k=0)
    qi = info("q", (2, 300, 4, 64), 1 << 30)
    ki = vi = info("k", (2, 0, 2, 64), 2 << 30)
    plan = _cuda.ForwardPlan(p, qi, ki, vi, poison=True)
    plan(qi.ptr, ki.ptr, vi.ptr)
    assert not fakes and plan.alloc.fills == [0.0, float("-inf")] and plan.alloc.poison


def test_backward_plan_launches(fakes):
    p = problem(d=128)
    shapes = {
        "do": (2, 300, 4, 128),
        "q": (2, 300, 4, 128),
        "k": (2, 500, 2, 128),
        "v": (2, 500, 2, 128),
        "o": (2, 300, 4, 128),
    }
    infos = [info(n, s, (i + 1) << 30) for i, (n, s) in enumerate(shapes.items())]
    lsei = info("lse", (2, 4, 300), 9 << 30, "float32")
    plan = _cuda.BackwardPlan(p, *infos, lsei, KernelChoice())
    dq, dk, dv = plan(*(x.ptr for x in infos), lsei.ptr)
    (pre, _, pre_params, _), (dkdv, _, kv_params, kv_maps), (dqs, _, q_params, _) = fakes
    assert (pre.family, dkdv.family, dqs.family) == ("preprocess", "dkdv", "dq")
    # causal, d = 128, grouped heads: the fused backward (its sums and counters after D)
    assert dkdv.path == dqs.path == "fused" and pre_params.lanes_per_row == 16
    assert kv_params.dq_accum == q_params.dq_accum > pre_params.delta.ptr
    for params in (pre_params, kv_params, q_params):
        assert params.delta.ptr == pre_params.delta.ptr != 0
    assert (q_params.dq.ptr, kv_params.dk.ptr, kv_params.dv.ptr) == (dq.ptr, dk.ptr, dv.ptr)
    assert (kv_params.dout.ptr, kv_params.lse.ptr) == (infos[0].ptr, lsei.ptr)
    addresses = [struct.unpack_from("<Q", kv_maps, 128 * i + 8)[0] for i in range(4)]
    assert addresses == [infos[1].ptr, infos[2].ptr, infos[3].ptr, infos[0].ptr]  # q, k, v, dout
    # explicit path: mma.sync everywhere
    fakes.clear()
    plan = _cuda.BackwardPlan(p, *infos, lsei, KernelChoice(path="mma"))
    plan(*(x.ptr for x in infos), lsei.ptr)
    assert [f[0].path for f in fakes] == ["rows", "mma", "mma"]


def test_a_refused_tensor_map_falls_back_to_the_kernels_without_tma(fakes, monkeypatch):
    monkeypatch.setattr(_tma, "_encode_fn", lambda *args: 1)  # the driver refuses every map
    p = problem()
    qi = info("q", (2, 300, 4, 64), 1 << 30)
    ki, vi = info("k", (2, 500, 2, 64), 2 << 30), info("v", (2, 500, 2, 64), 3 << 30)
    plan = _cuda.ForwardPlan(p, qi, ki, vi)
    plan(qi.ptr, ki.ptr, vi.ptr)
    assert fakes[-1][0].path == "wgmma" and fakes[-1][2].vec == 1


def test_launch_hands_over_the_argument_block(monkeypatch):
    calls = []

    class Driver:
        @staticmethod
        def launchKernel(*args):  # reads the arguments while they live
            pointers = (ctypes.c_void_p * 2).from_address(args[9])
            blob = ctypes.string_at(pointers[0], 512)
            seq_q = _params.Params.from_buffer_copy(
                ctypes.string_at(pointers[1], ctypes.sizeof(_params.Params))
            ).seq_q
            calls.append((args[:9], blob, seq_q))

    class Runtime:
        @staticmethod
        def getDevice():
            return 0

    monkeypatch.setattr(_launch, "_driver", Driver)
    monkeypatch.setattr(_launch, "_runtime", Runtime)
    _launch._tls.contexts = {0}

    class Spec:
        threads, smem_bytes = 256, 4096

    class Loaded:
        ptr, spec = 0xF00, Spec

    template = _params.Params()
    template.seq_q = 77
    args = _params.Arguments(template, ("q",), maps=4)
    for index in range(4):
        args.set_map(index, bytes(range(128)))
    _launch.launch(Loaded, 10, 0, 5, args.address)
    ((head, got_blob, seq_q),) = calls
    assert head == (0xF00, 10, 1, 1, 256, 1, 1, 4096, 5)
    assert got_blob == bytes(range(128)) * 4 and seq_q == 77
    with pytest.raises(ValueError, match="grid limit"):
        _launch.launch(Loaded, 2**31, 0, 5, args.address)


def test_signature_tells_options_and_slopes_apart():
    from cuflash import _plans

    class FakeCupy:  # what the signature reads of a CuPy array
        __module__ = "cupy._core.core"

        def __init__(self, shape):
            self.shape, self.strides, self.dtype = shape, (8,) * len(shape), "float16"
            self.data = type("Memory", (), {"device_id": 0})()

    arrays = tuple(FakeCupy((1, 4, 2, 8)) for _ in range(3))

    def key(window=None, softcap=None, slopes=()):
        return _plans.signature("forward", arrays + slopes, False, window, softcap, None, "bshd")

    assert key() == key() and hash(key((3, 0))) == hash(key((3, 0)))
    assert key((3, 0)) != key() and key((3, 0)) != key((3, 1))
    assert key((3, 0)) != key((3.0, 0))  # a float bound fails validation: never a cached plan
    assert key(softcap=30) != key(softcap=30.0) and key(softcap=30.0) != key()
    assert key(slopes=(FakeCupy((2,)),)) != key()
    assert key(slopes=(FakeCupy((2,)),)) != key(slopes=(FakeCupy((1, 2)),))
