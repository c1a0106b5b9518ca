"""attention_with_kvcache on CUDA devices: the launches of kernels_cu/kvcache.cu.

1. The append (k_new / v_new written into the cache) when the call has new rows.
2. Decoding (float16 / bfloat16, at most DECODE_MAX_ROWS query rows per KV head: Nq * group):
   split-KV blocks over the cache, then the combine of the splits' partial results (one split
   writes o and lse directly). The split is picked from the shapes alone (no lengths are read):
   enough blocks for every multiprocessor, each split a whole number of key tiles.
3. Otherwise (chunked prefill, the exact dtypes): the forward kernels (cuflash/_cuda.py,
   ForwardPlan), on views of contiguous caches whose sequences all use the same rows, known on the
   host (the dense forward), or else on each sequence's keys in use gathered into a packed batch
   (the packed forward).

Nothing is read back to the host (unless check_inputs asked for it, in _kvcache.check), so a
decoding step can be captured in a CUDA graph. Launches go on the caller's stream.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

from . import _compile, _dispatch, _kernels, _launch, _params, _tma
from ._dlpack import c_contiguous_strides
from ._interop import ArrayInfo, CudaAllocator, cupy_stream, stream_getter
from ._kvcache import Call, map_arrays
from ._problem import Problem
from ._validate import alibi_strides


def _bhs(strides: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B or pages, rows, H, d) array."""
    return (strides[0], strides[2], strides[1])


def _lse_bhs(shape: tuple[int, ...]) -> tuple[int, int, int]:
    return tuple(c_contiguous_strides(shape))  # (B, H, N)


def decode_instance(p: Problem) -> _kernels.KernelSpec:
    """The decoding kernel for this problem on its device."""
    bulk = _kernels.decode_bulk(_compile.device_arch(p.device[1]))
    return _kernels.kvcache_instance("decode", p.dtype, p.head_dim, _dispatch.features(p), bulk)


def uses_decode(call: Call) -> bool:
    """Whether the call runs the split-KV decoding kernel (else the packed forward)."""
    p = call.problem
    if p.dtype not in _kernels.TENSOR_CORE_DTYPES:
        return False
    if p.seq_q * p.group > _kernels.DECODE_MAX_ROWS:
        return False
    spec = decode_instance(p)
    return spec.smem_bytes <= _compile.max_shared_memory(p.device[1])


def split_keys(call: Call, sms: int, per_sm: int) -> tuple[int, int]:
    """(splits, keys per split) of a decoding call: the caller's num_splits, or the fewest splits
    (of whole key tiles) whose blocks fill their last wave (per_sm blocks on each of sms
    multiprocessors) within 95% as well as the best choice does. (On an H100 at d = 128, B = 8
    and 32k keys: 5 splits, 1.2 waves, ran at 0.73 of the copy bandwidth; 8 splits, 1.94 waves,
    at 0.95.)"""
    p, cache = call.problem, call.cache
    tile = _kernels.DECODE_KEYS
    key_tiles = max(1, -(-p.seq_k // tile))
    if cache.num_splits is not None:
        per_split = -(-key_tiles // min(cache.num_splits, key_tiles, _kernels.DECODE_MAX_SPLITS))
        return -(-key_tiles // per_split), per_split * tile
    row_tiles = -(-p.seq_q * p.group // _kernels.DECODE_ROWS)
    blocks = max(1, p.batch * p.heads_kv * row_tiles)
    slots = sms * per_sm

    def fill(splits: int) -> float:  # how full the waves of these splits' blocks are
        return blocks * splits / slots / -(-blocks * splits // slots)

    # every split count that whole tiles give, at most DECODE_MAX_SPLITS, fewest first
    counts = sorted({-(-key_tiles // t) for t in range(1, key_tiles + 1)})
    counts = [n for n in counts if n <= _kernels.DECODE_MAX_SPLITS]
    best = max(fill(n) for n in counts)
    splits = next(n for n in counts if fill(n) >= 0.95 * best)
    per_split = -(-key_tiles // splits)
    return -(-key_tiles // per_split), per_split * tile


def decode_splits(call: Call, device: int) -> tuple[int, int]:
    """split_keys for the decoding kernel on GPU `device` (its multiprocessors, and the blocks
    of this call's decoding instance one of them holds)."""
    spec = decode_instance(call.problem)
    return split_keys(call, _compile.sm_count(device), blocks_per_sm(spec, device))


def route(call: Call) -> str:
    """How a call runs on its device: "empty" (no query row or no key: o = 0, lse = -inf),
    "decode" (split-KV), "dense" (the dense forward on views of the caches) or "packed" (the
    keys gathered for the packed forward)."""
    p = call.problem
    if p.batch * p.heads_q * p.seq_q == 0 or p.seq_k == 0:
        return "empty"
    if uses_decode(call):
        return "decode"
    return "dense" if _dense_view_possible(call) else "packed"


def accum_shape(p: Problem, splits: int) -> tuple[int, int, int, int]:
    """The shape of the splits' float32 partial outputs (the first three dimensions: their
    lse): rows padded to the head-dim bucket, which the combine reads in float4s."""
    return (splits * p.batch, p.heads_q, p.seq_q, _kernels.head_dim_bucket(p.head_dim))


def blocks_per_sm(spec: _kernels.KernelSpec, device: int) -> int:
    """Decoding blocks one multiprocessor holds: shared memory bounds them (1 KB per block is the
    driver's reserve)."""
    return max(1, _compile.shared_memory_per_sm(device) // (spec.smem_bytes + 1024))


def decode_box_maps(call: Call) -> tuple[_tma.TileMap, _tma.TileMap] | None:
    """The tensor maps (K, V) of the caches for the decoding kernel that copies whole key tiles
    (kernels_cu/kvcache.cu, attention_decode_boxes): each cache as (d, rows, Hkv, sequences or
    pages), read in boxes of DECODE_KEYS rows of 64 columns under the 128-byte swizzle (columns
    past d read as zeros). None where its device has no such kernel for this head dim, where a
    tile would span pages (a page size that is no multiple of DECODE_KEYS), or where the TMA unit
    cannot address the caches' strides. Four copies a tile at d = 128 where a copy per row took
    most of a tile's time (docs/perf/NOTES.md, v24)."""
    p, cache = call.problem, call.cache
    arch = _compile.device_arch(p.device[1])
    if not _kernels.decode_boxes(arch, p.head_dim):
        return None
    if cache.paged and cache.rows % _kernels.DECODE_KEYS:
        return None
    maps = []
    for info in (call.k_cache, call.v_cache):
        shape = (p.head_dim, info.shape[1], p.heads_kv, info.shape[0])
        try:
            maps.append(
                _tma.tile_map(
                    shape,
                    _bhs(info.strides),
                    _kernels.ITEMSIZE[p.dtype],
                    _kernels.DECODE_KEYS,
                    _MAP_TEMPLATE_ADDRESS,
                )
            )
        except _tma.TensorMapError:
            return None
    return maps[0], maps[1]


_MAP_TEMPLATE_ADDRESS = 1 << 20  # a map template's address (each call writes its own in)


def _vec_strides(p: Problem, *infos: ArrayInfo) -> bool:
    """Whether the strides and head dim are whole 16-byte units (the pointers are checked per
    call: _vec_pointers)."""
    unit = 16 // _kernels.ITEMSIZE[p.dtype]
    return p.head_dim % unit == 0 and all(all(s % unit == 0 for s in i.strides[:3]) for i in infos)


def _vec_pointers(*pointers: int) -> bool:
    return all(x % 16 == 0 for x in pointers)


class _Ready:
    """One launch made ready once: its compiled kernel, grid and Params; a call writes only its
    pointers (and, where the kernel copies in 16-byte units, whether this call's pointers allow
    them) into its thread's copy of the arguments."""

    def __init__(  # noqa: ANN001
        self,
        spec,
        grid: int,
        params,
        tensors: tuple[str, ...],
        device: int,
        programmatic=False,
        maps: tuple[_tma.TileMap, ...] = (),
    ) -> None:
        self.loaded = _compile.load(spec, device)
        self.grid, self.params, self.tensors, self.device = grid, params, tensors, device
        self.programmatic = programmatic  # a programmatic launch (cuflash/_launch.py)
        # tensor maps before Params (the decoding kernel's DecodeMaps), of the first tensors
        self.maps = maps
        self._threads = threading.local()

    def __call__(self, stream: int, pointers: dict[str, int], vec: int | None = None) -> None:
        args = getattr(self._threads, "args", None)
        if args is None:
            args = _params.Arguments(self.params, self.tensors, len(self.maps))
            self._threads.args = args
        ptrs = tuple(pointers[name] for name in self.tensors)
        args.set_pointers(ptrs)
        for index, (tile_map, address) in enumerate(zip(self.maps, ptrs, strict=False)):
            args.set_map(index, tile_map.bytes_for(address))
        if vec is not None:
            args.params.vec = vec
        _launch.launch(self.loaded, self.grid, self.device, stream, args.address, self.programmatic)


def _without_arrays(call: Call) -> Call:
    """The call's metadata: every ArrayInfo with its array and pointer dropped."""
    return map_arrays(call, lambda info: replace(info, obj=None, ptr=0))


class KVCachePlan:
    """attention_with_kvcache for one call signature (shapes, strides, dtypes, device, options):
    the launches chosen and made ready once; a call passes its arrays' pointers (in the order of
    `inputs`) and gets (o, lse) in q's library."""

    def __init__(self, call: Call, poison: bool) -> None:
        # The plan outlives the call (cuflash/_plans.py): it keeps the arrays' metadata, never the
        # arrays, which would otherwise stay allocated as long as the plan is cached.
        call = _without_arrays(call)
        p, cache = call.problem, call.cache
        self.call, self.p, self.poison = call, p, poison
        self.device = p.device[1]
        self.alloc = CudaAllocator(p.library, self.device, poison)
        self.stream = stream_getter(p.library)
        named = (
            ("q", call.q),
            ("k", call.k_cache),
            ("v", call.v_cache),
            ("seqused_k", call.cache_seqlens),
            ("k_new", call.k_new),
            ("v_new", call.v_new),
            ("block_table", call.block_table),
            ("alibi", call.alibi),
        )
        self.inputs = tuple(name for name, info in named if info is not None)
        self.strides = {
            "q": _bhs(call.q.strides),
            "k": _bhs(call.k_cache.strides),
            "v": _bhs(call.v_cache.strides),
            "o": _bhs(c_contiguous_strides(p.q_shape)),
            "lse": _lse_bhs(p.lse_shape),
        }
        if call.alibi is not None:
            self.strides["alibi"] = alibi_strides(call.alibi)
        self.fields = {
            "page_size": cache.rows if cache.paged else p.seq_k,
            "num_pages": cache.num_pages,
            "cache_len": cache.cache_len or 0,
            "seq_new": cache.seq_new,
            "block_table_stride": call.block_table.strides[0] if cache.paged else 0,
        }
        self.append = None
        if cache.seq_new and p.batch * p.heads_kv * p.head_dim:
            self.strides["k_new"] = _bhs(call.k_new.strides)
            self.strides["v_new"] = _bhs(call.v_new.strides)
            elements = p.batch * cache.seq_new * p.heads_kv * p.head_dim
            grid = min(-(-elements // _kernels.APPEND_THREADS), 65536)
            spec = _kernels.kvcache_instance("append", p.dtype)
            self.append = self._ready(spec, grid, ("k", "v", "k_new", "v_new"))
        self.vec_ok = _vec_strides(p, call.q, call.k_cache, call.v_cache)
        self.gather_vec_ok = _vec_strides(p, call.k_cache, call.v_cache)
        self.route = route(call)
        self.empty = self.route == "empty"
        if self.route == "decode":
            self._make_decode()
        elif self.route == "dense":
            self._make_dense()
        elif self.route == "packed":
            self._make_packed()

    def _ready(  # noqa: ANN001
        self,
        spec,
        grid: int,
        tensors: tuple[str, ...],
        problem=None,
        programmatic=False,
        maps=(),
        **fields,
    ) -> _Ready:
        """A launch whose Params hold the problem, the cache fields and `fields`; its pointers
        are `tensors` plus the call's optional inputs (lengths, block table, slopes); `maps`:
        tensor maps of its first tensors, passed before Params."""
        extras = tuple(n for n in ("seqused_k", "block_table", "alibi") if n in self.inputs)
        params = _params.fill(problem or self.p, self.strides, **self.fields, **fields)
        return _Ready(spec, grid, params, tensors + extras, self.device, programmatic, maps)

    def _make_decode(self) -> None:
        p, device = self.p, self.device
        spec = decode_instance(p)
        splits, per_split = decode_splits(self.call, device)
        row_tiles = -(-p.seq_q * p.group // _kernels.DECODE_ROWS)
        fields = {"num_splits": splits, "keys_per_split": per_split, "num_blocks": row_tiles}
        self.splits = splits
        grid = splits * row_tiles * p.heads_kv * p.batch
        tensors = ("q", "k", "v", "o", "lse")
        if splits > 1:
            self.accum_shape = accum_shape(p, splits)
            self.strides["o_accum"] = tuple(c_contiguous_strides(self.accum_shape)[:3])
            self.strides["lse_accum"] = tuple(c_contiguous_strides(self.accum_shape[:3]))
            tensors += ("o_accum", "lse_accum")
            combine = _kernels.kvcache_instance("decode_combine", p.dtype, p.head_dim)
            # With bulk copies (sm_90) the combine's blocks may start while the decoding
            # kernel's last ones run, and wait for its results there (kernels_cu/kvcache.cu)
            bulk = _kernels.decode_bulk(_compile.device_arch(device))
            self.combine = self._ready(
                combine, p.batch * p.heads_q * p.seq_q, tensors, programmatic=bulk, **fields
            )
        # Whole tiles as tensor-map boxes where the caches have maps; the row copies otherwise,
        # and for calls whose pointers are not 16-byte aligned (made on the first such call).
        self.decode_rows: _Ready | None = None
        self.decode_boxes: _Ready | None = None
        self._decode_args = (grid, tensors, fields)
        maps = decode_box_maps(self.call)
        if maps is not None:
            boxes = _kernels.kvcache_instance(
                "decode", p.dtype, p.head_dim, _dispatch.features(p), True, boxes=True
            )
            # the maps are of the tensors k and v: those come first
            ordered = ("k", "v") + tuple(t for t in tensors if t not in ("k", "v"))
            self.decode_boxes = self._ready(boxes, grid, ordered, maps=maps, **fields)
        else:
            self.decode_rows = self._ready(spec, grid, tensors, **fields)

    def _make_dense(self) -> None:
        """Chunked prefill on contiguous caches with lengths known on the host: the dense forward
        on views of the caches' first rows (no copy of the keys)."""
        from . import _cuda

        problem, keys, values = dense_view(self.call)
        self.forward = _cuda.ForwardPlan(
            problem, self.call.q, keys, values, poison=self.poison, alibi=self.call.alibi
        )

    def _make_packed(self) -> None:
        """Chunked prefill and the exact dtypes: the keys in use of every sequence gathered into
        a packed batch (B * capacity rows, of which the first sum of lengths are used), then the
        packed forward over it; its lse (Hq, B * Nq) transposed into (B, Hq, Nq)."""
        from . import _cuda

        p = self.p
        total_k = p.batch * p.seq_k
        self.packed_kv_shape = (total_k, p.heads_kv, p.head_dim)
        packed_strides = tuple(c_contiguous_strides(self.packed_kv_shape))
        self.strides["k_new"] = self.strides["v_new"] = (0, packed_strides[1], packed_strides[0])
        offsets = ("cu_seqlens_q", "cu_seqlens_k")
        spec = _kernels.kvcache_instance("pack_offsets", "float32")
        self.pack_offsets = self._ready(spec, 1, offsets)
        spec = _kernels.kvcache_instance("gather", p.dtype)
        self.gather = self._ready(spec, total_k, ("k", "v", "k_new", "v_new", *offsets))
        self.packed = replace(p, packed=True, total_q=p.batch * p.seq_q, total_k=total_k)
        q = self.call.q
        self.q_copy = p.batch > 1 and q.strides[0] != p.seq_q * q.strides[1]
        s = c_contiguous_strides(q.shape) if self.q_copy else q.strides
        qi = replace(q, shape=self.packed.q_shape, strides=(s[1], s[2], s[3]))

        def info(name: str) -> ArrayInfo:
            return ArrayInfo(
                None, name, p.library, p.device, p.dtype, self.packed_kv_shape, packed_strides, 0
            )

        self.forward = _cuda.ForwardPlan(
            self.packed, qi, info("k"), info("v"), poison=self.poison, alibi=self.call.alibi
        )

    def run(self, arrays: tuple, pointers: tuple[int, ...]) -> tuple[Any, Any]:
        """Runs on the call's arrays and their pointers (both in the order of `inputs`)."""
        p = self.p
        ptr = dict(zip(self.inputs, pointers, strict=True))
        stream = self.stream(self.device)
        if self.append is not None:
            self.append(stream, ptr)
        if self.route == "dense":
            alibi = (ptr["alibi"],) if "alibi" in ptr else ()
            return self.forward(ptr["q"], ptr["k"], ptr["v"], *alibi)
        alloc = self.alloc
        o = alloc(p.q_shape, p.dtype, 0.0 if self.empty else None)
        lse = alloc(p.lse_shape, p.lse_dtype, float("-inf") if self.empty else None)
        ptr["o"], ptr["lse"] = o.ptr, lse.ptr
        if self.route == "decode":
            if self.splits > 1:
                o_accum = alloc(self.accum_shape, "float32")
                lse_accum = alloc(self.accum_shape[:3], "float32")
                ptr["o_accum"], ptr["lse_accum"] = o_accum.ptr, lse_accum.ptr
            self.launch_decode(stream, ptr)
        elif self.route == "packed":
            self._run_packed(stream, ptr, lse, alloc, arrays)
        return alloc.result(o), alloc.result(lse)

    def launch_decode(self, stream: int, ptr: dict[str, int]) -> None:
        """The decoding launches (route "decode") on `stream`: `ptr` holds the inputs' pointers
        (by the names of `inputs`), o and lse, and with several splits the float32 scratch
        o_accum (shape `accum_shape`) and lse_accum (its first three dimensions)."""
        vec = int(self.vec_ok and _vec_pointers(ptr["q"], ptr["k"], ptr["v"]))
        if vec and self.decode_boxes is not None:
            self.decode_boxes(stream, ptr, vec)
        else:
            if self.decode_rows is None:  # a plan with maps meets unaligned pointers
                grid, tensors, fields = self._decode_args
                spec = decode_instance(self.p)
                self.decode_rows = self._ready(spec, grid, tensors, **fields)
            self.decode_rows(stream, ptr, vec)
        if self.splits > 1:
            self.combine(stream, ptr)

    def _run_packed(self, stream: int, ptr: dict, lse, alloc, arrays: tuple) -> None:  # noqa: ANN001
        p = self.p
        cu_q = alloc((p.batch + 1,), "int32")
        cu_k = alloc((p.batch + 1,), "int32")
        keys = alloc(self.packed_kv_shape, p.dtype, 0.0)
        values = alloc(self.packed_kv_shape, p.dtype, 0.0)
        ptr.update(cu_seqlens_q=cu_q.ptr, cu_seqlens_k=cu_k.ptr, k_new=keys.ptr, v_new=values.ptr)
        self.pack_offsets(stream, ptr)
        vec = int(self.gather_vec_ok and _vec_pointers(ptr["k"], ptr["v"]))
        self.gather(stream, ptr, vec)
        q_ptr = ptr["q"]
        if self.q_copy:
            q_info = replace(self.call.q, obj=arrays[0], ptr=q_ptr)
            q_ptr = _contiguous_copy(q_info, alloc, stream).ptr
        lse_packed = alloc(self.packed.lse_shape, p.lse_dtype)
        launch = (q_ptr, keys.ptr, values.ptr, ptr["o"], lse_packed.ptr)
        if "alibi" in ptr:
            launch += (ptr["alibi"],)
        from . import _cuda

        _held, work_list = _cuda.workspace(alloc, self.forward.work_list_words)
        self.forward.launch(stream, (*launch, cu_q.ptr, cu_k.ptr, *work_list))
        _transpose_lse(lse_packed, lse, p, stream)


def _dense_view_possible(call: Call) -> bool:
    """Whether the keys are a view of the caches: contiguous caches whose every sequence uses
    the same rows, known on the host (cache_seqlens an int or None). Torch and CuPy arrays only,
    the libraries the GPU tests run this route with (JAX arrays take the packed route)."""
    return (
        not call.cache.paged
        and call.cache_seqlens is None
        and call.problem.library in ("torch", "cupy")
    )


def dense_view(call: Call) -> tuple[Problem, ArrayInfo, ArrayInfo]:
    """The route "dense" as attention_forward would take it: the problem over the
    cache_len + Nnew keys in use, and the keys and values as views of the caches (their first rows:
    the same pointers and strides)."""
    p, cache = call.problem, call.cache
    n = cache.cache_len + cache.seq_new
    shape = (p.batch, n, p.heads_kv, p.head_dim)
    keys, values = (replace(info, shape=shape) for info in (call.k_cache, call.v_cache))
    return replace(p, seq_k=n), keys, values


def _cupy_of(buffer_ptr: int, shape, strides, dtype: str, owner, device: int):
    import cupy

    storage = "uint16" if dtype == "bfloat16" else dtype
    itemsize = cupy.dtype(storage).itemsize
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if all(shape) else 0
    mem = cupy.cuda.UnownedMemory(buffer_ptr, max(span, 1) * itemsize, owner, device)
    return cupy.ndarray(
        shape, storage, cupy.cuda.MemoryPointer(mem, 0), tuple(s * itemsize for s in strides)
    )


def _contiguous_copy(info: ArrayInfo, alloc: CudaAllocator, stream: int) -> ArrayInfo:
    import cupy

    out = alloc(info.shape, info.dtype)
    src = _cupy_of(info.ptr, info.shape, info.strides, info.dtype, info.obj, info.device[1])
    dst_strides = tuple(c_contiguous_strides(info.shape))
    dst = _cupy_of(out.ptr, info.shape, dst_strides, info.dtype, out.array, info.device[1])
    with cupy.cuda.Device(info.device[1]), cupy_stream(stream, info.device[1]):
        dst[...] = src
    return replace(info, obj=out.array, strides=dst_strides, ptr=out.ptr)


def _transpose_lse(src, dst, p: Problem, stream: int) -> None:
    import cupy

    b, h, n = p.batch, p.heads_q, p.seq_q
    a = _cupy_of(src.ptr, (h, b, n), (b * n, n, 1), p.lse_dtype, src.array, p.device[1])
    z = _cupy_of(dst.ptr, (b, h, n), (h * n, n, 1), p.lse_dtype, dst.array, p.device[1])
    with cupy.cuda.Device(p.device[1]), cupy_stream(stream, p.device[1]):
        z[...] = a.transpose(1, 0, 2)
