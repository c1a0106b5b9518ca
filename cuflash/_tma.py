"""Tensor maps for the Hopper TMA kernels (kernels_cu/tma.cuh), made with the driver's
``cuTensorMapEncodeTiled`` through ctypes.

A q, k or v array is described to the TMA unit as a 4-D tensor of 16-bit (or, for the FP8
forward, 8-bit) elements, innermost first: (d, N, H, B) with byte strides (seq, head, batch). One
copy moves a box of 128 bytes a row (64 or 128 columns: the span of the 128-byte swizzle) by
`rows` rows into shared memory; rows past N and columns past d are filled with zeros, which is
what the kernels' padding needs.

A map holds the array's address. Plans are built once per call signature and run on new arrays,
so a map is made once (a template) and only its address changes per call. The address field is
located at plan creation by encoding the same map for three addresses and comparing the bytes;
where that comparison does not find one plain 64-bit field, every call encodes its maps afresh.
"""

from __future__ import annotations

import ctypes
import threading

MAP_BYTES = 128
BOX_BYTES = 128  # a box row: the 128-byte swizzle's row (64 bytes: the 64-byte swizzle's)

# CU_TENSOR_MAP_DATA_TYPE_UINT8 / _UINT16 by element size: bits moved as they are (e4m3; fp16, bf16)
_DATA_TYPES = {1: 0, 2: 1}
_INTERLEAVE_NONE = 0
_SWIZZLE = {128: 3, 64: 2}  # CU_TENSOR_MAP_SWIZZLE_128B, _64B by box row bytes
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-range elements read as zeros

_encode_fn = None
_encode_lock = threading.Lock()


class TensorMapError(RuntimeError):
    """The driver refused to encode a map (the kernel without TMA runs instead)."""


def _encoder():
    global _encode_fn
    if _encode_fn is not None:  # encodes that find no address field run on every call
        return _encode_fn
    with _encode_lock:
        if _encode_fn is None:
            lib = ctypes.CDLL("libcuda.so.1")  # the driver CuPy has loaded already
            fn = lib.cuTensorMapEncodeTiled
            u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_uint32,
                ctypes.c_void_p,
                u64p,
                u64p,
                u32p,
                u32p,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
            ]
            fn.restype = ctypes.c_int
            _encode_fn = fn
    return _encode_fn


def tma_strides(
    shape_dnhb: tuple[int, int, int, int], strides_shb: tuple[int, int, int], itemsize: int
) -> tuple[int, int, int] | None:
    """Byte strides (seq, head, batch) for a map, or None where the TMA unit cannot read the
    array: each stride of a dimension longer than 1 must be a positive multiple of 16 bytes.
    Dimensions of length 1 get a packed stride (their stride is never used)."""
    d, n, h, _ = shape_dnhb
    packed = (d * itemsize, n * d * itemsize, h * n * d * itemsize)
    out = []
    for size, stride, pack in zip((n, h, shape_dnhb[3]), strides_shb, packed, strict=True):
        if size == 1:
            stride_bytes = -(-pack // 16) * 16
        else:
            stride_bytes = stride * itemsize
            if stride_bytes <= 0 or stride_bytes % 16:
                return None
        if stride_bytes >= 1 << 40:
            return None
        out.append(stride_bytes)
    return tuple(out)


class TileMap:
    """The tensor map of one array (d, N, H, B) of `itemsize`-byte elements, read in boxes of
    (`row_bytes` bytes: 128, or 64 with the 64-byte swizzle; `rows` rows)."""

    def __init__(
        self,
        shape_dnhb: tuple[int, int, int, int],
        strides_bytes: tuple[int, int, int],
        rows: int,
        address: int,
        itemsize: int = 2,
        row_bytes: int = BOX_BYTES,
    ) -> None:
        self._dims = (ctypes.c_uint64 * 4)(*shape_dnhb)
        self._strides = (ctypes.c_uint64 * 3)(*strides_bytes)
        self._box = (ctypes.c_uint32 * 4)(row_bytes // itemsize, rows, 1, 1)
        self._data_type = _DATA_TYPES[itemsize]
        self._swizzle = _SWIZZLE[row_bytes]
        self._elem_strides = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        self.template = self.encode(address)
        self._split = self._find_address_field(address)
        self._last = (address, self.template)  # calls often repeat the last address

    def encode(self, address: int) -> bytes:
        out = (ctypes.c_uint8 * (MAP_BYTES + 64))()  # the driver wants 64-byte alignment
        base = (ctypes.addressof(out) + 63) & ~63
        err = _encoder()(
            base,
            self._data_type,
            4,
            address,
            self._dims,
            self._strides,
            self._box,
            self._elem_strides,
            _INTERLEAVE_NONE,
            self._swizzle,
            _L2_PROMOTION_256B,
            _OOB_FILL_ZEROS,
        )
        if err != 0:
            raise TensorMapError(f"cuTensorMapEncodeTiled failed with CUresult {err}")
        return ctypes.string_at(base, MAP_BYTES)

    def _find_address_field(self, address: int) -> tuple[bytes, bytes] | None:
        """(bytes before, bytes after) the 8-byte field that holds the address verbatim, checked
        on two more addresses; None where no such field exists."""
        others = [address + 4096, address + (1 << 20)]
        try:
            maps = [self.template] + [self.encode(a) for a in others]
        except TensorMapError:
            return None
        for offset in range(0, MAP_BYTES, 8):
            head, tail = self.template[:offset], self.template[offset + 8 :]
            if all(
                m[:offset] == head
                and m[offset + 8 :] == tail
                and int.from_bytes(m[offset : offset + 8], "little") == a
                for m, a in zip(maps, [address] + others, strict=True)
            ):
                return head, tail
        return None

    def bytes_for(self, address: int) -> bytes:
        """The map's 128 bytes for an array at `address` (16-byte aligned)."""
        last = self._last  # one read: another thread may replace it
        if last[0] == address:
            return last[1]
        if self._split is None:
            blob = self.encode(address)
        else:
            head, tail = self._split
            blob = head + address.to_bytes(8, "little") + tail
        self._last = (address, blob)
        return blob


def tile_map(
    shape_dnhb: tuple[int, int, int, int],
    strides_bhs: tuple[int, int, int],
    itemsize: int,
    rows: int,
    address: int,
    row_bytes: int = BOX_BYTES,
) -> TileMap:
    """The map of a q/k/v-shaped tensor (d, N, H, B) with element strides (batch, head, seq), read
    or written in boxes of `rows` rows of `row_bytes` bytes; TensorMapError where the TMA unit
    cannot address it."""
    sb, sh, ss = strides_bhs
    byte_strides = tma_strides(shape_dnhb, (ss, sh, sb), itemsize)
    if byte_strides is None or address & 15:
        raise TensorMapError(f"the TMA unit cannot address strides {strides_bhs}")
    return TileMap(shape_dnhb, byte_strides, rows, address, itemsize, row_bytes)
