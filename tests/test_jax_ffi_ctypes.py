"""bench/jax_ffi_ctypes.py on CPU: a typed XLA FFI handler made with ctypes alone.

Handlers are registered for the process and XLA keeps them; every test registers its own names.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
pytest.importorskip("jax.ffi")

_PATH = Path(__file__).resolve().parent.parent / "bench" / "jax_ffi_ctypes.py"
_spec = importlib.util.spec_from_file_location("jax_ffi_ctypes", _PATH)
ffi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ffi)

_names = itertools.count()


@pytest.fixture(autouse=True)
def on_cpu():
    """Run on the CPU backend (the handlers here are CPU ones) even where a GPU is the default."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no CPU backend here")
    with jax.default_device(cpu):
        yield


def unique(stem: str) -> str:
    return f"cuflash_test_{stem}_{next(_names)}"


def memcpy_launch(nbytes: int, calls: list | None = None):
    """A CPU launch that copies input i to output i, each `nbytes` long."""

    def launch(stream: int, ins: list[int], outs: list[int]) -> None:
        if calls is not None:
            calls.append((stream, list(ins), list(outs)))
        for src, dst in zip(ins, outs, strict=True):
            ctypes.memmove(dst, src, nbytes)

    return launch


def sample(shape, dtype):
    values = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) - 7.0
    return jnp.asarray(values).astype(dtype)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((1, 64, 1, 64), jnp.bfloat16),
        ((3, 5), jnp.float32),
        ((7,), jnp.int32),
        ((2, 3, 4), jnp.float16),
        ((), jnp.float32),
    ],
)
def test_copy_under_jit(shape, dtype):
    x = sample(shape, dtype)
    name = unique("copy")
    calls = []
    ffi.register(name, memcpy_launch(x.size * x.dtype.itemsize, calls), "cpu")
    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    got = jax.jit(lambda v: ffi.call(name, out_type, v))(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
    assert len(calls) == 1
    stream, ins, outs = calls[0]
    assert stream == 0  # CPU: XLA_FFI_Stream_Get fails and the handler passes 0
    assert len(ins) == 1 and len(outs) == 1 and ins[0] != outs[0]


def test_buffers_arrive_in_order():
    """Two inputs and two results: the launch sees them in call order (here it swaps them)."""
    a, b = sample((4, 8), jnp.float32), sample((4, 8), jnp.float32) * 3
    nbytes = a.size * a.dtype.itemsize

    def swap(stream, ins, outs):
        ctypes.memmove(outs[0], ins[1], nbytes)
        ctypes.memmove(outs[1], ins[0], nbytes)

    name = unique("swap")
    ffi.register(name, swap, "cpu")
    types = (jax.ShapeDtypeStruct(a.shape, a.dtype),) * 2
    p, q = jax.jit(lambda u, v: ffi.call(name, types, u, v))(a, b)
    np.testing.assert_array_equal(np.asarray(p), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(a))


def test_exception_in_launch_becomes_a_python_exception():
    def failing(stream, ins, outs):
        raise ValueError("launch failed on purpose")

    name = unique("fail")
    ffi.register(name, failing, "cpu")
    x = sample((5,), jnp.float32)
    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    fn = jax.jit(lambda v: ffi.call(name, out_type, v))
    with pytest.raises(Exception, match="launch failed on purpose") as caught:
        fn(x).block_until_ready()
    assert "ValueError" in str(caught.value)
    # The process and the backend are fine afterwards.
    copy = unique("copy_after_failure")
    ffi.register(copy, memcpy_launch(x.size * x.dtype.itemsize), "cpu")
    got = jax.jit(lambda v: ffi.call(copy, out_type, v))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


def test_inside_fori_loop():
    x = sample((2, 16), jnp.float32)
    name = unique("loop")
    calls = []
    ffi.register(name, memcpy_launch(x.size * x.dtype.itemsize, calls), "cpu")
    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    steps = 25

    @jax.jit
    def loop(v):
        return jax.lax.fori_loop(0, steps, lambda i, y: ffi.call(name, out_type, y) + 1, v)

    np.testing.assert_array_equal(np.asarray(loop(x)), np.asarray(x) + steps)
    assert len(calls) == steps
    np.testing.assert_array_equal(np.asarray(loop(x)), np.asarray(x) + steps)  # cached executable
    assert len(calls) == 2 * steps


def _metadata_query(handler):
    """Call `handler` as XLA does when it registers it: a frame carrying the metadata extension."""
    metadata = ffi.XLA_FFI_Metadata(struct_size=ffi._METADATA_SIZE)
    metadata.traits = 0xFFFF  # the handler must overwrite it
    extension = ffi.XLA_FFI_Metadata_Extension()
    extension.extension_base.struct_size = ctypes.sizeof(ffi.XLA_FFI_Metadata_Extension)
    extension.extension_base.type = ffi.XLA_FFI_Extension_Metadata
    extension.metadata = ctypes.pointer(metadata)
    frame = ffi.XLA_FFI_CallFrame(struct_size=ffi._CALL_FRAME_SIZE)
    frame.extension_start = ctypes.addressof(extension)
    frame.stage = ffi.XLA_FFI_ExecutionStage_EXECUTE
    as_pointer = ctypes.cast(handler, ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p))
    return as_pointer(ctypes.addressof(frame)), metadata


def test_metadata_query_is_answered_without_work():
    calls = []
    handler = ffi._make_handler("meta", lambda *a: calls.append(a), ffi.ffi_api_version())
    error, metadata = _metadata_query(handler)
    assert error is None  # success
    version = metadata.api_version
    assert (version.major_version, version.minor_version) == ffi.ffi_api_version()
    assert version.struct_size == ctypes.sizeof(ffi.XLA_FFI_Api_Version)
    assert metadata.traits == 0
    assert calls == []


def test_mirrors_match_the_header_sizes():
    """A few layouts against offsets worked out from c_api.h by hand (LP64)."""
    assert ffi._CALL_FRAME_SIZE == 8 * 5 + 40 + 40 + 48  # ..stage (padded), Args, Rets, Attrs
    assert ffi.XLA_FFI_CallFrame.future.offset == ffi._CALL_FRAME_SIZE
    assert ffi.XLA_FFI_Buffer.data.offset == 24 and ffi.XLA_FFI_Buffer.dims.offset == 40
    assert ffi.XLA_FFI_Api.XLA_FFI_Error_Create.offset == 48
    assert ffi.XLA_FFI_Api.XLA_FFI_Stream_Get.offset == 48 + 4 * 8
    assert ffi._METADATA_SIZE == 8 + 24 + 4
    assert ffi._ERROR_CREATE_ARGS_SIZE == 28 and ffi._STREAM_GET_ARGS_SIZE == 32


def test_register_rejects_a_second_registration_and_unknown_platforms():
    name = unique("twice")
    ffi.register(name, memcpy_launch(4), "cpu")
    with pytest.raises(ValueError, match="already registered"):
        ffi.register(name, memcpy_launch(4), "cpu")
    with pytest.raises(ValueError, match="platform"):
        ffi.register(unique("tpu"), memcpy_launch(4), "tpu")


@pytest.mark.gpu
def test_cuda_copy_on_xla_stream():
    """The CUDA path: XLA's stream reaches the launch, and a copy enqueued on it is seen."""
    cupy = pytest.importorskip("cupy")
    try:
        gpu = jax.devices("cuda")[0]
    except RuntimeError:
        pytest.skip("JAX has no CUDA backend here")
    runtime = cupy.cuda.runtime
    x = jax.device_put(sample((1, 64, 1, 64), jnp.bfloat16), gpu)
    nbytes = x.size * x.dtype.itemsize
    streams = []

    def launch(stream, ins, outs):
        streams.append(stream)
        runtime.memcpyAsync(outs[0], ins[0], nbytes, runtime.memcpyDeviceToDevice, stream)

    name = unique("cuda_copy")
    ffi.register(name, launch, "CUDA")
    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    got = jax.jit(lambda v: jax.lax.fori_loop(0, 3, lambda i, y: ffi.call(name, out_type, y), v))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
    assert len(streams) == 3 and all(isinstance(s, int) for s in streams)
