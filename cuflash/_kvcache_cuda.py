"""attention_with_kvcache on CUDA devices: the launches of kernels_cu/kvcache.cu.

1. The append (k_new / v_new written into the cache) when the call has new rows.
2. Decoding (float16 / bfloat16, at most DECODE_MAX_ROWS query rows per KV head: Nq * group):
   split-KV blocks over the cache, then the combine of the splits' partial results (one split
   writes o and lse directly). The split is picked from the shapes alone (no lengths are read):
   enough blocks for every multiprocessor, each split a whole number of key tiles.
3. Otherwise (chunked prefill, the exact dtypes): each sequence's keys in use gathered into a
   packed batch, and the packed forward kernels (cuflash/_cuda.py, ForwardPlan) run on it.

Nothing is read back to the host (unless check_inputs asked for it, in _kvcache.check), so a
decoding step can be captured in a CUDA graph. Launches go on the caller's stream.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from . import _compile, _dispatch, _kernels, _launch, _params
from ._dlpack import c_contiguous_strides
from ._interop import ArrayInfo, CudaAllocator, stream_getter
from ._kvcache import Call
from ._problem import Problem
from ._validate import alibi_strides


def _bhs(strides: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B or pages, rows, H, d) array."""
    return (strides[0], strides[2], strides[1])


def _lse_bhs(shape: tuple[int, ...]) -> tuple[int, int, int]:
    return tuple(c_contiguous_strides(shape))  # (B, H, N)


def uses_decode(call: Call) -> bool:
    """Whether the call runs the split-KV decoding kernel (else the packed forward)."""
    p = call.problem
    if p.dtype not in _kernels.TENSOR_CORE_DTYPES:
        return False
    if p.seq_q * p.group > _kernels.DECODE_MAX_ROWS:
        return False
    spec = _kernels.kvcache_instance("decode", p.dtype, p.head_dim)
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


def blocks_per_sm(spec: _kernels.KernelSpec, device: int) -> int:
    """Decoding blocks one multiprocessor holds: shared memory bounds them (1 KB per block is the
    driver's reserve)."""
    return max(1, _compile.shared_memory_per_sm(device) // (spec.smem_bytes + 1024))


def _vec(p: Problem, *infos: ArrayInfo) -> bool:
    """16-byte copies: aligned pointers, and strides and head dim in whole 16-byte units."""
    unit = 16 // _kernels.ITEMSIZE[p.dtype]
    if p.head_dim % unit:
        return False
    return all(i.ptr % 16 == 0 and all(s % unit == 0 for s in i.strides[:3]) for i in infos)


class _Launcher:
    """Fills Params for the call's launches and runs them on the caller's stream."""

    def __init__(self, call: Call, strides: dict[str, tuple[int, int, int]]) -> None:
        self.call = call
        self.device = call.problem.device[1]
        self.stream = stream_getter(call.problem.library)(self.device)
        self.strides = strides
        cache = call.cache
        self.fields = {
            "page_size": cache.rows if cache.paged else call.problem.seq_k,
            "num_pages": cache.num_pages,
            "cache_len": cache.cache_len or 0,
            "seq_new": cache.seq_new,
            "block_table_stride": call.block_table.strides[0] if cache.paged else 0,
        }

    def __call__(
        self,
        spec: _kernels.KernelSpec,
        grid: int,
        pointers: dict[str, int],
        problem: Problem | None = None,
        **fields: Any,
    ) -> None:
        params = _params.fill(problem or self.call.problem, self.strides, **self.fields, **fields)
        args = _params.Arguments(params, tuple(pointers))
        args.set_pointers(tuple(pointers.values()))
        loaded = _compile.load(spec, self.device)
        _launch.launch(loaded, grid, self.device, self.stream, args.address)


def forward(call: Call, poison: bool) -> tuple[Any, Any]:
    """Runs the call; returns (o, lse) as arrays of q's library."""
    p, cache = call.problem, call.cache
    alloc = CudaAllocator(p.library, p.device[1], poison)
    strides = {
        "q": _bhs(call.q.strides),
        "k": _bhs(call.k_cache.strides),
        "v": _bhs(call.v_cache.strides),
        "o": _bhs(c_contiguous_strides(p.q_shape)),
        "lse": _lse_bhs(p.lse_shape),
    }
    pointers = {"q": call.q.ptr, "k": call.k_cache.ptr, "v": call.v_cache.ptr}
    if call.cache_seqlens is not None:
        pointers["seqused_k"] = call.cache_seqlens.ptr
    if call.block_table is not None:
        pointers["block_table"] = call.block_table.ptr
    if call.alibi is not None:
        strides["alibi"] = alibi_strides(call.alibi)
        pointers["alibi"] = call.alibi.ptr
    run = _Launcher(call, strides)
    if cache.seq_new and p.batch * p.heads_kv * p.head_dim:
        strides["k_new"] = _bhs(call.k_new.strides)
        strides["v_new"] = _bhs(call.v_new.strides)
        new = {**pointers, "k_new": call.k_new.ptr, "v_new": call.v_new.ptr}
        elements = p.batch * cache.seq_new * p.heads_kv * p.head_dim
        grid = min(-(-elements // _kernels.APPEND_THREADS), 65536)
        run(_kernels.kvcache_instance("append", p.dtype), grid, new)
    empty = p.batch * p.heads_q * p.seq_q == 0 or p.seq_k == 0
    o = alloc(p.q_shape, p.dtype, 0.0 if empty else None)
    lse = alloc(p.lse_shape, p.lse_dtype, float("-inf") if empty else None)
    if not empty and not uses_decode(call) and _dense_view_possible(call):
        return _dense(call)
    if not empty:
        if uses_decode(call):
            _decode(call, run, alloc, pointers, o, lse)
        else:
            _packed(call, run, alloc, pointers, o, lse, poison)
    return alloc.result(o), alloc.result(lse)


def _dense_view_possible(call: Call) -> bool:
    """Whether the keys are a view of the caches: contiguous caches whose every sequence uses
    the same rows, known on the host (cache_seqlens an int or None), in a library that slices."""
    return (
        not call.cache.paged
        and call.cache_seqlens is None
        and call.problem.library in ("torch", "cupy")
    )


def _dense(call: Call) -> tuple[Any, Any]:
    """The dense forward on views of the caches' first rows: no copy of the keys (chunked prefill
    with lengths known on the host runs at the forward's speed)."""
    from . import api

    p, cache = call.problem, call.cache
    n = cache.cache_len + cache.seq_new
    k, v = call.k_cache.obj[:, :n], call.v_cache.obj[:, :n]
    return api.attention_forward(
        call.q.obj,
        k,
        v,
        window=p.window,
        softcap=p.softcap,
        alibi_slopes=None if call.alibi is None else call.alibi.obj,
        scale=p.scale,
    )


def _decode(call: Call, run: _Launcher, alloc: CudaAllocator, pointers: dict, o, lse) -> None:
    p = call.problem
    spec = _kernels.kvcache_instance("decode", p.dtype, p.head_dim, _dispatch.features(p))
    device = p.device[1]
    splits, per_split = split_keys(call, _compile.sm_count(device), blocks_per_sm(spec, device))
    row_tiles = -(-p.seq_q * p.group // _kernels.DECODE_ROWS)
    fields = {
        "num_splits": splits,
        "keys_per_split": per_split,
        "num_blocks": row_tiles,
        "vec": int(_vec(p, call.q, call.k_cache, call.v_cache)),
    }
    pointers = {**pointers, "o": o.ptr, "lse": lse.ptr}
    grid = splits * row_tiles * p.heads_kv * p.batch
    if splits == 1:
        run(spec, grid, pointers, **fields)
        return
    # rows padded to the head-dim bucket: the combine reads them in float4s
    accum_shape = (splits * p.batch, p.heads_q, p.seq_q, _kernels.head_dim_bucket(p.head_dim))
    o_accum = alloc(accum_shape, "float32")
    lse_accum = alloc(accum_shape[:3], "float32")
    run.strides["o_accum"] = tuple(c_contiguous_strides(accum_shape)[:3])
    run.strides["lse_accum"] = tuple(c_contiguous_strides(accum_shape[:3]))
    pointers = {**pointers, "o_accum": o_accum.ptr, "lse_accum": lse_accum.ptr}
    run(spec, grid, pointers, **fields)
    combine = _kernels.kvcache_instance("decode_combine", p.dtype, p.head_dim)
    run(combine, p.batch * p.heads_q * p.seq_q, pointers, **fields)


def _packed(call: Call, run: _Launcher, alloc, pointers: dict, o, lse, poison: bool) -> None:
    """Chunked prefill and the exact dtypes: the keys in use of every sequence gathered into a
    packed batch (B * capacity rows, of which the first sum of lengths are used), then the packed
    forward over it; its lse (Hq, B * Nq) transposed into (B, Hq, Nq)."""
    from . import _cuda

    p = call.problem
    total_k = p.batch * p.seq_k
    cu_q = alloc((p.batch + 1,), "int32")
    cu_k = alloc((p.batch + 1,), "int32")
    keys = {name: alloc((total_k, p.heads_kv, p.head_dim), p.dtype, 0.0) for name in ("k", "v")}
    packed_strides = tuple(c_contiguous_strides((total_k, p.heads_kv, p.head_dim)))
    run.strides["k_new"] = run.strides["v_new"] = (0, packed_strides[1], packed_strides[0])
    offsets = {"cu_seqlens_q": cu_q.ptr, "cu_seqlens_k": cu_k.ptr}
    run(_kernels.kvcache_instance("pack_offsets", "float32"), 1, {**pointers, **offsets})
    gather = {**pointers, **offsets, "k_new": keys["k"].ptr, "v_new": keys["v"].ptr}
    vec = int(_vec(p, call.k_cache, call.v_cache))
    run(_kernels.kvcache_instance("gather", p.dtype), total_k, gather, vec=vec)

    packed = replace(p, packed=True, total_q=p.batch * p.seq_q, total_k=total_k)
    q_rows = call.q
    if p.batch > 1 and q_rows.strides[0] != p.seq_q * q_rows.strides[1]:
        q_rows = _contiguous_copy(call.q, alloc, run.stream)
    s = q_rows.strides
    qi = replace(q_rows, shape=packed.q_shape, strides=(s[1], s[2], s[3]))

    def info(name: str, buffer) -> ArrayInfo:
        return ArrayInfo(
            buffer.array,
            name,
            p.library,
            p.device,
            p.dtype,
            packed.kv_shape,
            (packed_strides),
            buffer.ptr,
        )

    plan = _cuda.ForwardPlan(
        packed, qi, info("k", keys["k"]), info("v", keys["v"]), poison=poison, alibi=call.alibi
    )
    lse_packed = alloc(packed.lse_shape, p.lse_dtype)
    ptrs = (qi.ptr, keys["k"].ptr, keys["v"].ptr, o.ptr, lse_packed.ptr)
    if call.alibi is not None:
        ptrs += (call.alibi.ptr,)
    plan.launch(run.stream, (*ptrs, cu_q.ptr, cu_k.ptr))
    _transpose_lse(lse_packed, lse, p, run.stream)


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
    with cupy.cuda.Device(info.device[1]), cupy.cuda.ExternalStream(stream):
        dst[...] = src
    return replace(info, obj=out.array, strides=dst_strides, ptr=out.ptr)


def _transpose_lse(src, dst, p: Problem, stream: int) -> None:
    import cupy

    b, h, n = p.batch, p.heads_q, p.seq_q
    a = _cupy_of(src.ptr, (h, b, n), (b * n, n, 1), p.lse_dtype, src.array, p.device[1])
    z = _cupy_of(dst.ptr, (b, h, n), (h * n, n, 1), p.lse_dtype, dst.array, p.device[1])
    with cupy.cuda.Device(p.device[1]), cupy.cuda.ExternalStream(stream):
        z[...] = a.transpose(1, 0, 2)
