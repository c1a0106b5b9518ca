"""The host's mirror of kernels_cu/params.cuh: the one argument of every kernel.

``Params`` is a ctypes structure laid out as the C++ struct is (natural alignment, the same field
order). ``layout_asserts()`` states that layout as C++ static_asserts, which every compiled source
ends with (cuflash/_kernels.py, compiled_source), so that the two cannot drift: a field added on
one side only fails every compile, and tests/test_params.py checks it with nvcc on the CPU.

A plan fills one Params per launch once (``fill``); each thread that runs the launch keeps a copy in
an ``Arguments`` block, into which a call writes its pointers.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

from ._problem import Problem

_i64, _i32, _f64, _f32, _ptr = (
    ctypes.c_int64,
    ctypes.c_int32,
    ctypes.c_double,
    ctypes.c_float,
    ctypes.c_uint64,
)


class TensorRef(ctypes.Structure):
    """One (batch, head, sequence[, dim]) tensor: address and element strides."""

    _fields_ = [("ptr", _ptr), ("batch", _i64), ("head", _i64), ("seq", _i64)]


TENSORS = (
    "q",
    "k",
    "v",
    "o",
    "dout",
    "dq",
    "dk",
    "dv",
    "lse",
    "delta",
    "alibi",
    "k_new",
    "v_new",
    "o_accum",
    "lse_accum",
)

# The FP8 forward's float32 descale factors, one per (batch, key/value head), after the rest.
DESCALES = ("descale_q", "descale_k", "descale_v")
# Tensors a launch reads only through a tensor map, never through Params (the FP8 forward's V^T):
# a call's pointers list them last, and no field of Params takes them.
MAP_ONLY = ("vt",)


class Params(ctypes.Structure):
    _fields_ = (
        [(name, TensorRef) for name in TENSORS]
        + [
            ("cu_seqlens_q", _ptr),
            ("cu_seqlens_k", _ptr),
            ("seqused_k", _ptr),
            ("block_table", _ptr),
            ("work_list", _ptr),
            ("dq_accum", _ptr),
            ("dq_semaphores", _ptr),
            ("scale", _f64),
            ("softcap", _f64),
            ("batch", _i32),
            ("heads_q", _i32),
            ("heads_kv", _i32),
            ("group", _i32),
            ("seq_q", _i32),
            ("seq_k", _i32),
            ("head_dim", _i32),
            ("window_left", _i32),
            ("window_right", _i32),
            ("p_shift", _f32),
            ("vec", _i32),
            ("num_blocks", _i32),
            ("row_shift", _i32),
            ("paired", _i32),
            ("walk_heads", _i32),
            ("split_last", _i32),
            ("lanes_per_row", _i32),
            ("dq_tile_rows", _i32),
            ("total_q", _i32),
            ("total_k", _i32),
            ("page_size", _i32),
            ("num_pages", _i32),
            ("cache_len", _i32),
            ("seq_new", _i32),
            ("num_splits", _i32),
            ("keys_per_split", _i32),
            ("list_rows", _i32),
            ("list_cost_rows", _i32),
            ("list_heads", _i32),
            ("list_flags", _i32),
            ("num_work", _i64),
            ("rows", _i64),
            ("block_table_stride", _i64),
            ("list_base", _i64),
        ]
        + [(name, TensorRef) for name in DESCALES]
    )


def fill(p: Problem, strides: dict[str, tuple[int, int, int]], **launch: Any) -> Params:
    """The Params of one launch of problem `p`: the (batch, head, row) element strides of the
    tensors it touches, every size and option of the problem, and the launch's own fields
    (cuflash/_dispatch.py, Launch.params_fields). Pointers are left 0: each call writes its own
    (``Arguments.set_pointers``)."""
    params = Params()
    for name, (sb, sh, ss) in strides.items():
        if name in MAP_ONLY:
            continue
        ref = getattr(params, name)
        ref.batch, ref.head, ref.seq = sb, sh, ss
    mask = p.mask
    params.scale = p.scale
    params.softcap = p.softcap or 0.0
    params.batch, params.heads_q, params.heads_kv, params.group = (
        p.batch,
        p.heads_q,
        p.heads_kv,
        p.group,
    )
    params.seq_q, params.seq_k, params.head_dim = p.seq_q, p.seq_k, p.head_dim
    params.window_left, params.window_right = mask.left, mask.right
    params.rows = p.rows_q
    params.total_q, params.total_k = p.total_q, p.total_k
    # The forward scales P by 2^-p_shift (kernels_cu/softmax.cuh): bfloat16 V can reach float32's
    # range, where sum_j P_j V_j could overflow; float16 V cannot.
    if p.dtype == "bfloat16" and p.seq_k > 1:
        params.p_shift = math.ceil(math.log2(p.seq_k))
    for name, value in launch.items():
        setattr(params, name, value)
    return params


def pointer_offset(name: str) -> int:
    """Where the pointer of `name` lies in Params: a TensorRef's ptr (TENSORS, DESCALES), or a
    plain pointer field (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, work_list,
    dq_accum, dq_semaphores)."""
    field = getattr(Params, name)
    if name in TENSORS or name in DESCALES:
        return field.offset + TensorRef.ptr.offset
    return field.offset


class Arguments:
    """One launch's argument block: the bytes of its kernel parameters (the tensor maps, then
    Params) and the pointer array that cuLaunchKernel reads. A Run keeps one per thread, so that
    threads sharing a plan never share one; a call writes only its pointers (for `tensors`, in
    that order) and maps into it."""

    MAP_BYTES = 128

    def __init__(self, template: Params, tensors: tuple[str, ...], maps: int = 0) -> None:
        self.params = Params.from_buffer_copy(template)
        self.maps = (ctypes.c_char * (self.MAP_BYTES * maps))() if maps else None
        block = ([self.maps] if maps else []) + [self.params]
        self._pointers = (ctypes.c_void_p * len(block))(*(ctypes.addressof(a) for a in block))
        self.address = ctypes.addressof(self._pointers)  # kernelParams of cuLaunchKernel
        self._map_bytes = memoryview(self.maps).cast("B") if maps else None
        fields = tuple(name for name in tensors if name not in MAP_ONLY)
        if tensors[: len(fields)] != fields:
            raise ValueError(f"map-only tensors {MAP_ONLY} come last, got {tensors}")
        self._fields = tuple(
            ctypes.c_uint64.from_buffer(self.params, pointer_offset(name)) for name in fields
        )
        self._count = len(fields)

    def set_pointers(self, pointers: tuple[int, ...]) -> None:
        for field, ptr in zip(self._fields, pointers[: self._count], strict=True):
            field.value = ptr

    def set_map(self, index: int, blob: bytes) -> None:
        start = index * self.MAP_BYTES
        self._map_bytes[start : start + self.MAP_BYTES] = blob


def layout_asserts() -> str:
    """C++ static_asserts of Params' size and of every field's offset, from this mirror. The
    offsets need __builtin_offsetof, which nvcc has (the compile check, tests/test_params.py) and
    NVRTC 13.0 (CuPy's runtime compiler) does not: there, the size alone is checked."""
    lines = [
        "// The host's mirror of Params (cuflash/_params.py): any difference fails to compile.",
        f"static_assert(sizeof(cuflash::TensorRef) == {ctypes.sizeof(TensorRef)}, "
        '"TensorRef size (cuflash/_params.py)");',
        f"static_assert(sizeof(cuflash::Params) == {ctypes.sizeof(Params)}, "
        '"Params size (cuflash/_params.py)");',
        "#ifndef __CUDACC_RTC__",
    ]
    for struct, cls in (("TensorRef", TensorRef), ("Params", Params)):
        for name, _ in cls._fields_:
            offset = getattr(cls, name).offset
            lines.append(
                f"static_assert(__builtin_offsetof(cuflash::{struct}, {name}) == {offset}, "
                f'"{struct}::{name} offset (cuflash/_params.py)");'
            )
    lines.append("#endif")
    return "\n".join(lines) + "\n"
