"""Experiment: a typed XLA FFI handler built with ctypes alone, against buffer_callback.

    python bench/jax_ffi_ctypes.py        # OUT=DIR also writes DIR/jax_ffi_overhead.json

JAX's typed FFI (jax.ffi.register_ffi_target / jax.ffi.ffi_call, api_version=1) calls a C
function `XLA_FFI_Error* handler(XLA_FFI_CallFrame*)`. Such a function can be a ctypes.CFUNCTYPE
object (ctypes makes a C trampoline that takes the GIL and calls Python), wrapped in a PyCapsule
with jax.ffi.pycapsule, so no C compiler is needed. The question measured here: does that cost
less host time per call than jax.experimental.buffer_callback, which also ends in Python but
builds Buffer objects and an ExecutionContext for every call?

The structs below mirror xla/ffi/api/c_api.h as shipped with jaxlib (jax.ffi.include_dir()).
Only the fields a handler reads or writes are declared; a struct that XLA owns and we only read
through a pointer (XLA_FFI_Api) is declared as far as the last member we use, which is safe
because later members only follow it in memory.

What a handler must do, besides its work:
  * Answer the metadata query. When XLA registers a handler it first calls it with a call frame
    whose extension_start is an XLA_FFI_Metadata_Extension (api is NULL, no buffers); the handler
    writes the FFI API version it was built for and its traits, and returns NULL. XLA refuses a
    version outside the range it supports (jaxlib 0.10.2: 0.1 to 0.3; a handler that leaves it
    at 0.0 is refused), so the version is read from the header of the jaxlib in use. JAX defers
    the registration until the backend starts if it has not yet, and a refused handler then fails
    the backend's start ("Unable to initialize backend 'cpu'"), not the register() call.
  * Stages: XLA calls only the stages of the bundle it was given; a capsule (not a dict) registers
    the execute stage alone. Any other stage is answered with success all the same.
  * Errors: an exception that escaped a ctypes callback would be printed and the callback would
    return NULL, i.e. success with garbage results. So every exception is caught and turned into
    an XLA_FFI_Error made by the api's XLA_FFI_Error_Create; XLA takes ownership and JAX raises.

The GIL: a CFUNCTYPE trampoline takes it with PyGILState_Ensure. XLA runs the custom call on the
thread that called the executable (the main thread here, on CPU and CUDA alike), which released
the GIL while it waited, so taking it back is uncontended.

Findings (medians, us per call; "noop" rows have a launch that does nothing):
                          CPU, jax 0.10.2   CPU, jax 0.11.2   H100, jax 0.11.2
    per fori_loop step    ffi / callback    ffi / callback    ffi / callback
      copy                2.7 / 3.3         4.5 / 4.4         21-24 / 19-22
      noop                1.8 / 1.7         3.2 / 2.0         16-18 / 13
The ctypes trampoline alone (a handler returning at once) costs what buffer_callback's whole
no-op call costs; reading the call frame in Python then adds 1-3 us, which buffer_callback does
in C++. So the ctypes FFI handler is no cheaper than buffer_callback; its copy row wins on CPU only
because ctypes.memmove is cheaper than the NumPy copy in the callback. On the GPU every step of a
loop with a host-run custom call also pays the host-driven loop (~8 us with a kernel instead).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# ----------------------------------------------------------------------------------------------
# ctypes mirrors of xla/ffi/api/c_api.h. C enums are `int` here (4 bytes on the ABIs XLA
# supports); pointers we never follow from Python are c_void_p.
# ----------------------------------------------------------------------------------------------

c_int, c_int64, c_size_t, c_uint32, c_void_p = (
    ctypes.c_int,
    ctypes.c_int64,
    ctypes.c_size_t,
    ctypes.c_uint32,
    ctypes.c_void_p,
)

XLA_FFI_Extension_Metadata = 1  # XLA_FFI_Extension_Type
XLA_FFI_Error_Code_INTERNAL = 13  # XLA_FFI_Error_Code
XLA_FFI_ExecutionStage_EXECUTE = 3  # XLA_FFI_ExecutionStage
XLA_FFI_ArgType_BUFFER = 1  # XLA_FFI_ArgType
XLA_FFI_RetType_BUFFER = 1  # XLA_FFI_RetType


class XLA_FFI_Extension_Base(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("type", c_int), ("next", c_void_p)]


class XLA_FFI_Api_Version(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("major_version", c_int),
        ("minor_version", c_int),
    ]


class XLA_FFI_Error_Create_Args(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", c_int),
    ]


class XLA_FFI_Error_Destroy_Args(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("error", c_void_p)]


class XLA_FFI_Stream_Get_Args(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("ctx", c_void_p),
        ("stream", c_void_p),  # out: a cudaStream_t on CUDA
    ]


class XLA_FFI_Buffer(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("dtype", c_int),
        ("data", c_void_p),
        ("rank", c_int64),
        ("dims", ctypes.POINTER(c_int64)),
    ]


class XLA_FFI_Args(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("size", c_int64),
        ("types", ctypes.POINTER(c_int)),  # XLA_FFI_ArgType[size]
        ("args", ctypes.POINTER(c_void_p)),  # void*[size], each an XLA_FFI_Buffer* here
    ]


class XLA_FFI_Rets(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("size", c_int64),
        ("types", ctypes.POINTER(c_int)),  # XLA_FFI_RetType[size]
        ("rets", ctypes.POINTER(c_void_p)),
    ]


class XLA_FFI_Attrs(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("size", c_int64),
        ("types", c_void_p),
        ("names", c_void_p),
        ("attrs", c_void_p),
    ]


# Function pointer types of the XLA_FFI_Api members we call. PYFUNCTYPE, not CFUNCTYPE: a
# CFUNCTYPE call drops the GIL and takes it back, which costs more than these few-instruction
# functions (they never block nor call Python) and lets another thread in between.
_ErrorCreate = ctypes.PYFUNCTYPE(c_void_p, ctypes.POINTER(XLA_FFI_Error_Create_Args))
_ErrorDestroy = ctypes.PYFUNCTYPE(None, ctypes.POINTER(XLA_FFI_Error_Destroy_Args))
_StreamGet = ctypes.PYFUNCTYPE(c_void_p, ctypes.POINTER(XLA_FFI_Stream_Get_Args))


class XLA_FFI_Api(ctypes.Structure):
    # A prefix of the function table, up to XLA_FFI_Stream_Get (see the module docstring).
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),
        ("api_version", XLA_FFI_Api_Version),
        ("internal_api", c_void_p),
        ("XLA_FFI_Error_Create", _ErrorCreate),
        ("XLA_FFI_Error_GetMessage", c_void_p),
        ("XLA_FFI_Error_Destroy", _ErrorDestroy),
        ("XLA_FFI_Handler_Register", c_void_p),
        ("XLA_FFI_Stream_Get", _StreamGet),
    ]


class XLA_FFI_CallFrame(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("extension_start", c_void_p),  # XLA_FFI_Extension_Base*
        ("api", c_void_p),  # const XLA_FFI_Api*, viewed through _ApiCalls
        ("ctx", c_void_p),  # XLA_FFI_ExecutionContext*, opaque
        ("stage", c_int),
        ("args", XLA_FFI_Args),
        ("rets", XLA_FFI_Rets),
        ("attrs", XLA_FFI_Attrs),
        ("future", c_void_p),  # out; left NULL: the handler is synchronous
    ]


class XLA_FFI_Metadata(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("api_version", XLA_FFI_Api_Version),
        ("traits", c_uint32),  # XLA_FFI_Handler_Traits
        # state_type_id (XLA_FFI_TypeId) follows; XLA zero-fills it (no state), we leave it.
    ]


class XLA_FFI_Metadata_Extension(ctypes.Structure):
    _fields_ = [
        ("extension_base", XLA_FFI_Extension_Base),
        ("metadata", ctypes.POINTER(XLA_FFI_Metadata)),
    ]


def _struct_size(struct: type[ctypes.Structure], last_field: str) -> int:
    """XLA_FFI_STRUCT_SIZE(struct, last_field): the offset past `last_field`."""
    field = getattr(struct, last_field)
    return field.offset + field.size


# The sizes XLA_FFI_DEFINE_STRUCT_TRAITS gives; XLA checks the args structs we pass against them.
_ERROR_CREATE_ARGS_SIZE = _struct_size(XLA_FFI_Error_Create_Args, "errc")
_ERROR_DESTROY_ARGS_SIZE = _struct_size(XLA_FFI_Error_Destroy_Args, "error")
_STREAM_GET_ARGS_SIZE = _struct_size(XLA_FFI_Stream_Get_Args, "stream")
_API_VERSION_SIZE = _struct_size(XLA_FFI_Api_Version, "minor_version")
_CALL_FRAME_SIZE = _struct_size(XLA_FFI_CallFrame, "attrs")  # `future` is not counted
_METADATA_SIZE = _struct_size(XLA_FFI_Metadata, "traits")

# The handler type: XLA_FFI_Error* (*)(XLA_FFI_CallFrame*). The frame comes in as a plain address
# (cheaper than a ctypes POINTER, which builds an object per call) and is viewed with from_address.
_Handler = ctypes.CFUNCTYPE(c_void_p, c_void_p)


def ffi_api_version() -> tuple[int, int]:
    """(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR) of the c_api.h that ships with the jaxlib in use.

    The metadata answer must carry the version XLA implements, and the metadata call frame has no
    api pointer to read it from, so the installed header is the source of truth.
    """
    import jax.ffi

    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    text = header.read_text()
    found = {
        key: re.search(rf"^#define XLA_FFI_API_{key}\s+(\d+)", text, re.MULTILINE)
        for key in ("MAJOR", "MINOR")
    }
    if not all(found.values()):
        raise RuntimeError(f"no XLA_FFI_API_MAJOR/MINOR in {header}")
    return int(found["MAJOR"].group(1)), int(found["MINOR"].group(1))


# ----------------------------------------------------------------------------------------------
# The handler
# ----------------------------------------------------------------------------------------------

# "platform:name" -> (CFUNCTYPE object, launch). XLA keeps only the raw function pointer; if the
# ctypes object were collected, the next call would jump into freed memory. Never emptied.
_REGISTRY: dict[str, tuple[Any, Callable]] = {}

Launch = Callable[[int, list[int], list[int]], None]


class _ApiCalls:
    """The XLA_FFI_Api functions a handler calls, looked up once per api table.

    Reading a CFUNCTYPE member of a ctypes struct builds a new function object each time; the
    table is a static of the XLA runtime (one per process, or per PJRT plugin), so it is read once.
    """

    def __init__(self, address: int):
        api = XLA_FFI_Api.from_address(address)
        self.error_create = api.XLA_FFI_Error_Create
        self.error_destroy = api.XLA_FFI_Error_Destroy
        self.stream_get = api.XLA_FFI_Stream_Get

    def error(self, message: str) -> int | None:
        """A new XLA_FFI_Error (code INTERNAL) holding `message`; XLA owns and frees it."""
        args = XLA_FFI_Error_Create_Args(
            _ERROR_CREATE_ARGS_SIZE,
            None,
            message.encode("utf-8", "replace"),  # copied into an absl::Status by XLA
            XLA_FFI_Error_Code_INTERNAL,
        )
        return self.error_create(ctypes.byref(args))

    def stream(self, ctx: int) -> int | None:
        """XLA's stream for this call (a cudaStream_t, 0 for the default stream), or None where
        the backend has none (CPU: "XLA FFI GPU context is not available")."""
        # A fresh args struct per call: the launch may drop the GIL, so another thread may run
        # the same handler meanwhile (one thread per GPU, say).
        args = XLA_FFI_Stream_Get_Args(_STREAM_GET_ARGS_SIZE, None, ctx, None)
        failure = self.stream_get(ctypes.byref(args))
        if failure:
            # An error an API call returns belongs to the caller: free it.
            destroy = XLA_FFI_Error_Destroy_Args(_ERROR_DESTROY_ARGS_SIZE, None, failure)
            self.error_destroy(ctypes.byref(destroy))
            return None
        return args.stream or 0


_API_CALLS: dict[int, _ApiCalls] = {}  # XLA_FFI_Api address -> its functions


def _answer_metadata(extension_address: int, version: tuple[int, int]) -> None:
    """Fill in the metadata XLA asks for when it registers the handler."""
    extension = XLA_FFI_Metadata_Extension.from_address(extension_address)
    metadata = extension.metadata.contents
    # The frame has no api to make an error with; if the struct were too small to write into,
    # leaving the version at 0.0 makes XLA refuse the registration with a message that says so.
    if metadata.struct_size < _METADATA_SIZE:
        return
    metadata.api_version = XLA_FFI_Api_Version(_API_VERSION_SIZE, None, *version)
    # No traits: in particular not COMMAND_BUFFER_COMPATIBLE, so XLA:GPU never captures the call
    # into a CUDA graph (a replay would skip the Python launch).
    metadata.traits = 0


def _api_calls(address: int) -> _ApiCalls:
    calls = _API_CALLS.get(address)
    if calls is None:
        calls = _API_CALLS[address] = _ApiCalls(address)
    return calls


def _report(name: str, frame_address: int, exc: BaseException) -> int | None:
    """The XLA_FFI_Error to return for an exception raised while handling a call."""
    message = f"{name}: {type(exc).__name__}: {exc}"
    try:
        api_address = XLA_FFI_CallFrame.from_address(frame_address).api
        if api_address:
            return _api_calls(api_address).error(message)
    except BaseException:  # noqa: BLE001 - nothing may escape into C
        pass
    # No api to report through (the metadata frame has none): say it loudly instead.
    traceback.print_exception(exc)
    print(f"{name}: error not reported to XLA: {message}", file=sys.stderr)
    return None


def _make_handler(name: str, launch: Launch, version: tuple[int, int]) -> Any:
    """A CFUNCTYPE XLA_FFI_Handler that calls `launch` at the execute stage.

    The body is the per-call cost this experiment measures, so it touches few ctypes objects:
    each field read, pointer slice or from_address builds a Python object (0.02 to 0.15 us here),
    and explicit loops stand in for list comprehensions, which are a function call each before
    Python 3.12.
    """
    # Whether XLA_FFI_Stream_Get works for this handler: unknown until the first call. On CPU it
    # returns an error; the backend of a registered handler never changes, so after one failure
    # the handler stops asking and passes stream 0.
    stream_available = [True]

    def handler(frame_address: int) -> int | None:
        try:
            frame = XLA_FFI_CallFrame.from_address(frame_address)
            extension = frame.extension_start
            if extension:  # only the metadata query carries one (XLA registering the handler)
                base = XLA_FFI_Extension_Base.from_address(extension)
                if base.type == XLA_FFI_Extension_Metadata:
                    _answer_metadata(extension, version)
                return None
            if frame.stage != XLA_FFI_ExecutionStage_EXECUTE:
                return None  # instantiate / prepare / initialize: nothing to do
            if frame.struct_size < _CALL_FRAME_SIZE:
                raise RuntimeError(f"XLA_FFI_CallFrame of {frame.struct_size} bytes")

            stream = 0
            if stream_available[0]:
                got = _api_calls(frame.api).stream(frame.ctx)
                stream_available[0] = got is not None
                stream = got or 0

            # Every argument and result is a buffer: XLA_FFI_ArgType and XLA_FFI_RetType have no
            # other member, and ffi_call passes only arrays, so the type arrays are not read.
            args = frame.args
            inputs = []
            for buffer in args.args[: args.size]:
                inputs.append(XLA_FFI_Buffer.from_address(buffer).data or 0)
            rets = frame.rets
            outputs = []
            for buffer in rets.rets[: rets.size]:
                outputs.append(XLA_FFI_Buffer.from_address(buffer).data or 0)
            launch(stream, inputs, outputs)
            return None
        except BaseException as exc:  # noqa: BLE001 - nothing may escape into C
            return _report(name, frame_address, exc)

    return _Handler(handler)


def register(name: str, launch: Launch, platform: str) -> None:
    """Register `launch(stream, in_ptrs, out_ptrs)` as the typed FFI target `name`.

    platform: "cpu" or "CUDA" (any case). On every execution the handler passes XLA's stream (0
    on CPU), the data pointers of the argument buffers and those of the result buffers; `launch`
    must enqueue its work on that stream (or, on CPU, do it) and return. It runs with the GIL,
    taken by the ctypes trampoline, on whichever thread XLA executes the custom call.
    """
    import jax.ffi

    platform = {"cpu": "cpu", "cuda": "CUDA", "gpu": "CUDA"}.get(platform.lower())
    if platform is None:
        raise ValueError("platform must be 'cpu' or 'CUDA'")
    key = f"{platform}:{name}"
    if key in _REGISTRY:
        raise ValueError(f"FFI target {name!r} is already registered for {platform}")
    handler = _make_handler(name, launch, ffi_api_version())
    _REGISTRY[key] = (handler, launch)  # first: XLA may call it (metadata) during registration
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform=platform, api_version=1)


def call(name: str, result_shape_dtypes: Any, *args: Any) -> Any:
    """Call the registered target `name` (traceable: use it under jax.jit)."""
    import jax.ffi

    return jax.ffi.ffi_call(name, result_shape_dtypes)(*args)


# ----------------------------------------------------------------------------------------------
# The timing
# ----------------------------------------------------------------------------------------------

SHAPE = (1, 64, 1, 64)
LOOP = 1000  # calls inside one jitted fori_loop
ROUNDS = 11  # medians over this many rounds; each round times every op once, in turn
CALLS = 300  # Python-level calls per timing of a single call


def _seconds(fn: Callable, x: Any, calls: int) -> float:
    """Wall time of `calls` blocking calls of fn(x)."""
    start = time.perf_counter()
    for _ in range(calls):
        fn(x).block_until_ready()
    return time.perf_counter() - start


def _time_ops(ops: dict[str, Callable], x: Any) -> dict[str, dict[str, float]]:
    """Per-call microseconds of each op: one jitted call from Python, and one step of a jitted
    fori_loop of LOOP calls. The ops are timed in interleaved rounds, so that a drift of the
    machine (clocks, other load) reaches all of them alike; medians over the rounds."""
    import jax

    single = {label: jax.jit(op) for label, op in ops.items()}
    looped = {
        label: jax.jit(lambda v, op=op: jax.lax.fori_loop(0, LOOP, lambda i, y: op(y), v))
        for label, op in ops.items()
    }
    for fn in (*single.values(), *looped.values()):
        fn(x).block_until_ready()  # compile and warm up
    times: dict[str, dict[str, list[float]]] = {
        label: {"single_call_us": [], "in_fori_loop_us": []} for label in ops
    }
    for _ in range(ROUNDS):
        for label in ops:
            times[label]["single_call_us"].append(_seconds(single[label], x, CALLS) / CALLS * 1e6)
            times[label]["in_fori_loop_us"].append(_seconds(looped[label], x, 1) / LOOP * 1e6)
    return {
        label: {kind: statistics.median(values) for kind, values in row.items()}
        for label, row in times.items()
    }


def _copy_ops(platform: str, nbytes: int) -> tuple[Launch, Callable]:
    """The FFI launch and the buffer_callback callback that copy input 0 to output 0."""
    if platform == "cpu":
        import numpy as np

        def launch(stream: int, ins: list[int], outs: list[int]) -> None:
            ctypes.memmove(outs[0], ins[0], nbytes)

        def callback(ctx: Any, out: Any, x: Any) -> None:
            np.asarray(out)[...] = np.asarray(x)

        return launch, callback

    from cupy.cuda import runtime

    def launch(stream: int, ins: list[int], outs: list[int]) -> None:
        runtime.memcpyAsync(outs[0], ins[0], nbytes, runtime.memcpyDeviceToDevice, stream)

    def callback(ctx: Any, out: Any, x: Any) -> None:
        dst = out.__cuda_array_interface__["data"][0]
        src = x.__cuda_array_interface__["data"][0]
        runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToDevice, ctx.stream)

    return launch, callback


def main() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

    backend = jax.default_backend()
    platform = "cpu" if backend == "cpu" else "CUDA"
    dtype = getattr(jnp, "bfloat16", jnp.float32)
    x = jnp.arange(math.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE).astype(dtype)
    out_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    nbytes = x.size * x.dtype.itemsize

    launch, callback = _copy_ops(platform, nbytes)
    threads: set[int] = set()

    def traced_launch(stream: int, ins: list[int], outs: list[int]) -> None:
        threads.add(threading.get_ident())  # which thread XLA runs the handler on
        launch(stream, ins, outs)

    register("cuflash_bench_ffi_copy", traced_launch, platform)
    register("cuflash_bench_ffi_noop", lambda stream, ins, outs: None, platform)
    ops = {
        "ctypes_ffi": lambda v: call("cuflash_bench_ffi_copy", out_type, v),
        "buffer_callback": buffer_callback(callback, out_type),
        "jit_x_plus_0": lambda v: v + 0,
        # The same two mechanisms with a launch that does nothing (the output stays unwritten):
        # what each costs by itself, without the copy.
        "ctypes_ffi_noop": lambda v: call("cuflash_bench_ffi_noop", out_type, v),
        "buffer_callback_noop": buffer_callback(lambda ctx, out, v: None, out_type),
    }

    for label in ("ctypes_ffi", "buffer_callback", "jit_x_plus_0"):  # they must copy x
        if not bool(jnp.array_equal(jax.jit(ops[label])(x), x)):
            raise AssertionError(f"{label} did not copy its input")
    threads.clear()

    results = _time_ops(ops, x)

    report = {
        "jax": jax.__version__,
        "backend": backend,
        "device": str(jax.devices()[0].device_kind),
        "dtype": str(x.dtype),
        "shape": list(SHAPE),
        "loop": LOOP,
        "rounds": ROUNDS,
        "calls_per_timing": CALLS,
        "ffi_api_version": list(ffi_api_version()),
        "handler_threads": len(threads),
        "handler_on_main_thread": threads == {threading.main_thread().ident},
        "results_us": results,
    }

    print(f"jax {report['jax']} on {backend} ({report['device']}), {report['dtype']} {SHAPE}")
    print(f"{'op':<22}{'one jitted call':>18}{'per fori_loop step':>22}")
    for label, row in results.items():
        print(f"{label:<22}{row['single_call_us']:>15.2f} us{row['in_fori_loop_us']:>19.2f} us")
    print(
        f"FFI API {report['ffi_api_version']}; handler ran on {len(threads)} thread(s), "
        f"main thread only: {report['handler_on_main_thread']}"
    )
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "jax_ffi_overhead.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
