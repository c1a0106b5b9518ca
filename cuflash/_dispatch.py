"""The one place that decides which kernels a call runs, with which tiles and launch shape.

From the problem (cuflash/_problem.py), the strides of its arrays, the GPU's architecture and
multiprocessor count, ``forward`` and ``backward`` pick per kernel family the path (tma, wgmma,
mma, exact; cuflash/_kernels.py lists what exists), the tiles, how O is stored, the work list of
the persistent kernels and its row blocks. A call's pointers are known only when it runs, so each
choice comes as a pair: the launch for 16-byte aligned pointers, and the one for any pointers;
the plan (cuflash/_cuda.py) takes one or the other per call.

Tests and benchmarks ask for other kernels with a KernelChoice; the library's own calls use
DEFAULT. Pure Python: no CuPy, no driver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from . import _kernels, _tma
from ._kernels import KernelSpec
from ._problem import Problem

Strides = dict[str, tuple[int, int, int]]  # tensor name -> (batch, head, row) element strides


@dataclass(frozen=True)
class KernelChoice:
    """What a test or benchmark asks for instead of the library's choice (None: the library's).

    path: the fastest path to allow ("tma", "wgmma", "mma"); a family without an instance there
        takes the next one. tiles: ((family, path), tiles) pairs that replace the table's tiles
        (cuflash/_kernels.py) of those instances. o_store: "registers" makes the TMA forward write
        O from registers. schedule: the TMA forward's key-tile loop (_kernels.FORWARD_SCHEDULES).
        backward: "fused" runs the fused backward where the call allows it (fused_backward_fits,
        TMA-readable tensors, path None or "tma"), "split" the dK/dV and dQ kernels. walk_heads:
        the dense TMA forward's and dQ kernel's order of work items (0: decode_paired_work's,
        C > 0: block-major over chunks of C heads; see walk_heads).
    """

    path: str | None = None
    tiles: tuple[tuple[tuple[str, str], tuple[int, ...]], ...] = ()
    o_store: str = "tma"
    schedule: str | None = None
    backward: str | None = None  # "fused" or "split": the Hopper backward (where the TMA runs)
    walk_heads: int | None = None

    def tiles_for(self, family: str, path: str) -> tuple[int, ...] | None:
        return dict(self.tiles).get((family, path))


DEFAULT = KernelChoice()


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the instance, its grid, and its launch fields of Params."""

    spec: KernelSpec
    grid: int
    num_blocks: int  # row blocks per head (slots, for the TMA forward)
    vec: bool = False  # 16-byte copies (tile.cuh)
    num_work: int = 0  # persistent kernels: work items
    paired: bool = False  # persistent kernels: items taken in pairs (common.cuh, WorkWalk)
    walk_heads: int = 0  # dense TMA forward and dQ: decode_chunked_work's chunk, or 0 (walk_heads)
    split_last: bool = False  # TMA forward: each head's last row block split by keys, walked first
    row_shift: int = 0  # TMA forward: rows of the first block before row 0
    lanes_per_row: int = 32  # preprocess
    dq_tile_rows: int = 0  # preprocess of the fused backward: its query tile rows (its counters)
    maps: tuple[tuple[str, int], ...] = field(default=())  # TMA: (tensor, box rows), in order
    sizes: tuple[tuple[str, int], ...] = ()  # Params sizes that differ from the problem's
    # Packed calls on the persistent kernels: the launch of build_work_list that writes this
    # launch's work list just before it (kernels_cu/work_list.cuh)
    builder: Launch | None = None

    def params_fields(self) -> dict[str, int]:
        return {
            "vec": int(self.vec),
            "num_blocks": self.num_blocks,
            "num_work": self.num_work,
            "paired": int(self.paired),
            "walk_heads": self.walk_heads,
            "split_last": int(self.split_last),
            "row_shift": self.row_shift,
            "lanes_per_row": self.lanes_per_row,
            "dq_tile_rows": self.dq_tile_rows,
            **dict(self.sizes),
        }


@dataclass(frozen=True)
class Pair:
    """A family's launch for 16-byte aligned pointers, and the one for any pointers."""

    aligned: Launch
    unaligned: Launch


@dataclass(frozen=True)
class BackwardLaunches:
    preprocess: Pair
    dkdv: Pair
    dq: Pair


def forward(p: Problem, strides: Strides, arch: str, sm_count: int, choice=DEFAULT) -> Pair:
    """The forward's launches; `strides` holds q, k, v and o."""
    vec = _chunked(p, strides, ("q", "k", "v", "o"))
    table = _table_launch(p, "forward", arch, choice, vec)
    unaligned = replace(table, vec=False)
    if not (vec and "tma" in _allowed_paths(p, "forward", arch, choice)):
        return Pair(table, unaligned)
    if not _tma_readable(p, strides, ("q", "k", "v")):
        return Pair(table, unaligned)
    row_keys = min(p.mask.left + p.mask.right + 1, p.seq_k) if p.mask.local else None
    tiles = choice.tiles_for("forward", "tma") or _kernels.default_tiles(
        "forward", "tma", p.dtype, p.head_dim, p.seq_q, features(p), row_keys
    )
    return Pair(_tma_forward_launch(p, strides, sm_count, choice, tiles), unaligned)


def _tma_forward_launch(
    p: Problem, strides: Strides, sm_count: int, choice: KernelChoice, tiles: tuple
) -> Launch:
    """The TMA forward's persistent launch with these tiles (16-bit, or e4m3: the FP8 forward,
    whose V is read as V^T through the "vt" map)."""
    bucket = _kernels.bucket_of(p.dtype, p.head_dim)
    # O through a staging tile and TMA stores where shared memory has room for the tile and d
    # fills its bucket (the TMA unit would store partial boxes otherwise: forward_sm90_tma.cu).
    o_via_tma = (
        choice.o_store == "tma"
        and _kernels.o_staging_fits(bucket, tiles, p.dtype)
        and p.head_dim == bucket
        and _tma_readable(replace(p, dtype=p.out_dtype), strides, ("o",))
    )
    spec = _kernels.instance(
        "forward", "tma", p.dtype, p.head_dim, tiles, features(p), o_via_tma, choice.schedule
    )
    # Row blocks get costlier along the sequence under a right bound (causal): pair heavy with
    # light items, and put the partial block first, where it sees the fewest keys.
    slots, row_shift = row_slots(p.seq_q, spec.rows_per_block, end_aligned=p.mask.bounded_right)
    v_map = ("vt", bucket) if p.dtype == _kernels.FP8_DTYPE else ("v", spec.rows_per_step)
    maps = (("q", spec.rows_per_block), ("k", spec.rows_per_step), v_map)
    maps += (("o", 64),) if o_via_tma else (("q", spec.rows_per_block),)  # q's map stands in
    launch = _persistent_launch(p, spec, p.heads_q, slots, sm_count, maps, row_shift, choice=choice)
    if split_last_block(p, spec):
        launch = replace(launch, split_last=True)
    return launch


def split_last_block(p: Problem, spec: _kernels.KernelSpec) -> bool:
    """Whether the TMA forward splits each head's last row block by keys among its consumers
    (kernels_cu/forward_sm90_tma.cu, SPLIT_LAST), where the instance can and that block's real
    rows fit one consumer's 64: the three-consumer tiles (d = 64 from 1k rows) at Nq = 1k, 4k and
    16k (64 rows past a multiple of 192). Start-aligned blocks only (no right bound: under one the
    partial block comes first and is the cheapest)."""
    partial_rows = p.seq_q % spec.rows_per_block
    return _kernels.splits_last_block(spec) and not p.mask.bounded_right and 0 < partial_rows <= 64


@dataclass(frozen=True)
class Fp8Launches:
    """The FP8 forward's launches: V^T (kernels_cu/fp8_transpose.cu: its Params read v and write
    "o", which is the V^T buffer), then the TMA forward on e4m3 tiles."""

    transpose: Launch
    forward: Launch


def forward_fp8(
    p: Problem, strides: Strides, arch: str, sm_count: int, choice=DEFAULT
) -> Fp8Launches:
    """The FP8 forward's launches (sm_90a only; q, k, v TMA-readable, d a multiple of 16: the
    caller checked). `strides` holds q, k, v, o and vt (V^T, C-contiguous (B, Hkv, d,
    keys_padded))."""
    if arch != "sm_90a":
        raise ValueError(f"the FP8 forward runs on sm_90 GPUs (H100, H200); this one is {arch}")
    tiles = choice.tiles_for("forward", "tma") or _kernels.fp8_table(p.head_dim, features(p))[0]
    forward = _tma_forward_launch(p, strides, sm_count, choice, tiles)
    transpose = _kernels.instance("transpose_v", "fp8", p.dtype, p.head_dim)
    blocks = _ceil_div(p.keys_padded, transpose.rows_per_block)
    return Fp8Launches(Launch(transpose, blocks * p.heads_kv * p.batch, blocks), forward)


# The work lists of packed calls on the persistent kernels (kernels_cu/work_list.cuh): a header and
# an entry per item, 32 bytes each (kernels_cu/params.cuh, work_item), in a workspace that the
# plan allocates per call: the forward's list, or the backward's two (dK/dV's, then dQ's). Its
# size depends on the problem alone (cuflash.jax declares it when tracing), so it is bounded with
# the smallest block of any persistent kernel; each list's capacity uses its kernel's own blocks.
WORK_LIST_ENTRY_BYTES = 32
_LIST_BOUND_ROWS = 64
_LIST_KEYS, _LIST_END_ALIGNED = 1, 2  # work_list.cuh, list_flags


def _list_capacity(p: Problem, heads: int, total_rows: int, rows: int) -> int:
    """Items of a well-formed packed batch's list: each sequence's blocks of `rows` rows (at most
    one partial), with an empty one to make a pair, for every head."""
    return heads * (_ceil_div(total_rows, rows) + 2 * p.batch)


def _list_bases(p: Problem) -> dict[str, int]:
    """The first entry (the header) of each family's list in the workspace."""
    return {
        "forward": 0,
        "dkdv": 0,
        "dq": 1 + _list_capacity(p, p.heads_kv, p.total_k, _LIST_BOUND_ROWS),
    }


def work_list_bytes(p: Problem, family: str) -> int:
    """The workspace of a packed call's work lists ("forward" or "backward"); 0 unless packed."""
    if not p.packed:
        return 0
    entries = 1 + _list_capacity(p, p.heads_q, p.total_q, _LIST_BOUND_ROWS)
    if family == "backward":
        entries += _list_bases(p)["dq"]
    if entries >= 2**31:
        raise ValueError(f"packed batch too large: {entries} work items exceed 2^31")
    return entries * WORK_LIST_ENTRY_BYTES


# The fused backward (kernels_cu/backward_sm90_fused.cu) keeps dQ's float32 partial sums and one
# counter per query tile (of its BM rows) in the backward's workspace, after D.
_WORKSPACE_ALIGN = 256


def fused_tiles(p: Problem, choice: KernelChoice = DEFAULT) -> tuple[int, int, int]:
    """The fused dK/dV kernel's (BM, BN, stages) for `p`: the choice's, else the table's
    (_kernels.FUSED_TILES), or its 64-row tiles (FUSED_SHORT_TILES) for the schedules and
    features of FUSED_SHORT_FOR and where the rotated schedule needs more query steps than the
    table's give (_rotated_fits). Only for buckets the fused backward has."""
    tiles = choice.tiles_for("dkdv", "fused")
    if tiles:
        return tiles
    bucket = _kernels.head_dim_bucket(p.head_dim)
    tiles = _kernels.default_tiles("dkdv", "fused", p.dtype, bucket, features=features(p))
    short = _kernels.FUSED_SHORT_TILES.get(bucket)
    if short is None:
        return tiles
    if (fused_schedule(p), features(p)) in _kernels.FUSED_SHORT_FOR[bucket]:
        return short
    if not p.mask.bounded_right and not _rotated_fits(p, tiles[0]):
        return short
    return tiles


def _rotated_fits(p: Problem, bm: int) -> bool:
    """The rotated turns need an item per start: at most group x query tiles (of bm rows) key
    blocks per head (backward_sm90_fused.cu, FusedDqOrder)."""
    blocks = _ceil_div(p.seq_k, _kernels.FUSED_BN[_kernels.head_dim_bucket(p.head_dim)])
    return 0 < blocks <= p.group * _ceil_div(p.seq_q, bm)


def _half_turns_fit(p: Problem) -> bool:
    """At d = 256, and at d = 128 under a right bound, a tile's turns are counted in 16 bits
    (HALF_WRITERS, backward_sm90_fused.cu: a half of the counter per writer), so fewer than 2^16
    key blocks."""
    bucket = _kernels.head_dim_bucket(p.head_dim)
    halves = bucket == 256 or (bucket == 128 and p.mask.bounded_right)
    return not halves or _ceil_div(p.seq_k, _kernels.FUSED_BN[bucket]) < 1 << 16


def fused_backward_fits(p: Problem, choice: KernelChoice = DEFAULT) -> bool:
    """Whether the fused backward can serve the call, the GPU and the strides aside: an instance
    for its features (not packed) and bucket; without a right bound, no left bound either and at
    most as many key blocks per head as query steps (group x query tiles of its BM: the rotated
    turns need an item per start, backward_sm90_fused.cu); with one (causal, sliding windows: the
    "bounded" schedule, fused_schedule), any group; at d = 256, and at d = 128 under a right
    bound, fewer than 2^16 key blocks (_half_turns_fit)."""
    available = _kernels.fused_backward_available(p.dtype, p.head_dim, features(p))
    if not (available and p.seq_q > 0 and p.seq_k > 0 and _half_turns_fit(p)):
        return False
    if p.mask.bounded_right:
        return True
    if p.mask.local:  # a left bound alone: every key block's list would start at the first tile
        return False
    return _rotated_fits(p, fused_tiles(p, choice)[0])


# d = 256 under a causal mask: the fused backward from this many query rows (fused_backward_chosen)
FUSED_CAUSAL_ROWS_256 = 4096


def fused_backward_chosen(p: Problem, choice: KernelChoice = DEFAULT) -> bool:
    """Whether the backward of `p` takes the fused kernels where the GPU (sm_90a) and the strides
    (TMA-readable) allow: where it fits (fused_backward_fits) and the choice allows it (backward
    not "split", path None or "tma"), and, unless the choice asks for it, where it is the faster.
    At d = 64 a causal mask (a right bound and no left bound) over more keys than queries runs
    faster on the split TMA kernels (fused 0.87-0.94x of them at Nk = 2 Nq, H100:
    docs/perf/NOTES.md, v23), where those serve the call (not with ALiBi: the table takes the
    wgmma kernels there). At d = 256 a right bound (causal, windows) runs faster on the split TMA
    kernels (fused 0.94x of them causal at 4k, H200: docs/perf/NOTES.md, v40), except a causal
    mask alone over at least FUSED_CAUSAL_ROWS_256 queries and no more keys than queries, where
    the fused kernel's halves of dQ in their own turns (v44) run 1.01-1.10x the split kernels
    (1k: 0.94-1.00x; more keys than queries 0.82-0.87x; ALiBi 0.88x)."""
    if choice.backward == "split" or choice.path not in (None, "tma"):
        return False
    if not fused_backward_fits(p, choice):
        return False
    if choice.backward == "fused":
        return True
    bucket = _kernels.head_dim_bucket(p.head_dim)
    causal_like = p.mask.bounded_right and not p.mask.local
    split_tma = "tma" in _kernels.paths("dkdv", p.dtype, p.head_dim, "sm_90a", features(p))
    if bucket == 256 and p.mask.bounded_right and split_tma:
        return (
            causal_like
            and features(p) == 0
            and p.seq_q >= FUSED_CAUSAL_ROWS_256
            and p.seq_k <= p.seq_q
        )
    return not (bucket == 64 and causal_like and p.seq_k > p.seq_q and split_tma)


def fused_schedule(p: Problem) -> str:
    """The fused dK/dV kernel's order of query tiles and turns for this mask
    (_kernels.FUSED_SCHEDULES)."""
    return "bounded" if p.mask.bounded_right else "rotated"


@dataclass(frozen=True)
class BackwardWorkspace:
    """The backward's workspace, sized from the problem and the choice alone (cuflash.jax declares
    it when tracing): D, then, where the fused backward is chosen (fused_backward_chosen), its
    counters and dQ sums (byte offsets; 0: none)."""

    nbytes: int
    semaphores: int = 0
    accum: int = 0


def backward_workspace(p: Problem, choice: KernelChoice = DEFAULT) -> BackwardWorkspace:
    delta = math.prod(p.lse_shape) * (8 if p.dtype in _kernels.EXACT_DTYPES else 4)
    if not fused_backward_chosen(p, choice):
        return BackwardWorkspace(delta)
    bm = fused_tiles(p, choice)[0]
    tiles = p.batch * p.heads_q * _ceil_div(p.seq_q, bm)
    semaphores = _round_up(delta, _WORKSPACE_ALIGN)
    accum = _round_up(semaphores + 4 * tiles, _WORKSPACE_ALIGN)
    sums = tiles * bm * _kernels.head_dim_bucket(p.head_dim) * 4
    return BackwardWorkspace(accum + sums, semaphores, accum)


def backward(
    p: Problem, strides: Strides, arch: str, sm_count: int, choice=DEFAULT
) -> BackwardLaunches:
    """The backward's launches; `strides` holds q, k, v, o, dout, lse, dq, dk and dv."""
    # D = rowsum(dO * O): 16-byte chunks, as many lanes per row as the row has chunks (a power of
    # two), where O and dO allow it; else a warp per row, element by element.
    pre = _kernels.instance("preprocess", "rows", p.dtype, 0)
    warps = pre.rows_per_block
    # Packed: the rows of every sequence, as one sequence of total_q rows per head.
    sizes = (("seq_q", p.total_q),) if p.packed else ()
    scalar = Launch(pre, _ceil_div(p.rows_q, warps), 0, sizes=sizes)
    if p.dtype in _kernels.TENSOR_CORE_DTYPES and _chunked(p, strides, ("o", "dout")):
        chunks = _ceil_div(p.head_dim, _chunk(p))
        lanes = 1 << max(0, math.ceil(math.log2(chunks)))
        vectors = Launch(
            pre,
            _ceil_div(p.rows_q, warps * (32 // lanes)),
            0,
            True,
            lanes_per_row=lanes,
            sizes=sizes,
        )
        preprocess = Pair(vectors, scalar)
    else:
        preprocess = Pair(scalar, scalar)

    vec = _chunked(p, strides, ("q", "k", "v", "dout", "dq", "dk", "dv"))
    dkdv = _table_launch(p, "dkdv", arch, choice, vec)
    dq = _table_launch(p, "dq", arch, choice, vec)
    unaligned = (replace(dkdv, vec=False), replace(dq, vec=False))
    readable = vec and _tma_readable(p, strides, ("q", "k", "v", "dout"))
    tma = (
        readable
        and "tma" in _allowed_paths(p, "dq", arch, choice)
        and "tma" in _allowed_paths(p, "dkdv", arch, choice)
    )
    # The fused kernel has instances of its own: ALiBi at d = 64 fits there, where the split TMA
    # dK/dV kernel spills and the table takes the wgmma kernels.
    fused = readable and arch == "sm_90a" and fused_backward_chosen(p, choice)
    maps = (("q", 64), ("k", 64), ("v", 64), ("dout", 64))
    if fused:
        tiles = fused_tiles(p, choice)  # (BM, BN, stages)
        spec = _kernels.instance(
            "dkdv", "fused", p.dtype, p.head_dim, tiles, features(p), schedule=fused_schedule(p)
        )
        blocks = _ceil_div(p.seq_k, spec.rows_per_block)
        dkdv = _persistent_launch(p, spec, p.heads_kv, blocks, sm_count, maps, family="dkdv")
        post = _kernels.instance("dq", "fused", p.dtype, p.head_dim, tiles[:1], features(p))
        tiles_q = _ceil_div(p.seq_q, post.rows_per_block)
        dq = Launch(post, p.batch * p.heads_q * tiles_q, tiles_q, vec=True)
        # the preprocess zeroes the counters, one per query tile
        preprocess = Pair(
            replace(preprocess.aligned, dq_tile_rows=tiles[0]),
            replace(preprocess.unaligned, dq_tile_rows=tiles[0]),
        )
    elif tma:
        launches = []
        for family, heads, seq in (("dkdv", p.heads_kv, p.seq_k), ("dq", p.heads_q, p.seq_q)):
            tiles = choice.tiles_for(family, "tma") or _kernels.default_tiles(
                family, "tma", p.dtype, p.head_dim
            )
            spec = _kernels.instance(family, "tma", p.dtype, p.head_dim, tiles, features(p))
            blocks = _ceil_div(seq, spec.rows_per_block)
            launch = _persistent_launch(
                p, spec, heads, blocks, sm_count, maps, family=family, choice=choice
            )
            launches.append(launch)
        dkdv, dq = launches
    return BackwardLaunches(preprocess, Pair(dkdv, unaligned[0]), Pair(dq, unaligned[1]))


def features(p: Problem) -> int:
    """The kernels' compile-time features (kernels_cu/features.cuh) that problem `p` needs."""
    return (
        (_kernels.FEATURE_LOCAL if p.mask.local else 0)
        | (_kernels.FEATURE_SOFTCAP if p.softcap is not None else 0)
        | (_kernels.FEATURE_ALIBI if p.alibi else 0)
        | (_kernels.FEATURE_PACKED if p.packed else 0)
    )


def row_slots(seq_q: int, rows_per_block: int, end_aligned: bool) -> tuple[int, int]:
    """(slots per head, row_shift) of the TMA forward's work list (kernels_cu/forward_sm90_tma.cu):
    slot b holds the query rows [b * rows_per_block - row_shift, (b + 1) * rows_per_block -
    row_shift), and a slot whose rows are all negative is empty.

    Start-aligned (row_shift 0) the last block is the partial one; under causal masking it runs
    every key tile for its few real rows (at N = 4096 and 192-row blocks, a third of the work of
    the head's heaviest block for 64 rows). End-aligned, the partial block is the first, which
    sees the fewest keys; an odd block count gets an empty slot 0 so that the kernel's
    heavy-with-light pairs (decode_paired_work) stay within one head. End alignment measured
    +5-9% on the d = 64 causal forward at 4k-8k (docs/perf/NOTES.md, v8)."""
    blocks = _ceil_div(seq_q, rows_per_block)
    if not end_aligned:
        return blocks, 0
    slots = blocks + (blocks & 1)
    return slots, slots * rows_per_block - seq_q


# ---------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _chunk(p: Problem) -> int:
    """Elements in 16 bytes: the unit of the kernels' vectorised tile copies."""
    return 16 // _kernels.ITEMSIZE[p.dtype]


def _chunked(p: Problem, strides: Strides, names: tuple[str, ...]) -> bool:
    """Whether d and these tensors' strides are whole 16-byte chunks (the pointers are checked
    per call)."""
    chunk = _chunk(p)
    return p.head_dim % chunk == 0 and all(s % chunk == 0 for n in names for s in strides[n])


def _tma_readable(p: Problem, strides: Strides, names: tuple[str, ...]) -> bool:
    """Whether the TMA unit can address these q/k/v-shaped tensors (cuflash/_tma.py)."""
    itemsize = _kernels.ITEMSIZE[p.dtype]
    for name in names:
        sb, sh, ss = strides[name]
        if _tma.tma_strides(p.map_shape(name), (ss, sh, sb), itemsize) is None:
            return False
    return True


def _allowed_paths(p: Problem, family: str, arch: str, choice: KernelChoice) -> tuple[str, ...]:
    """The paths of `family` for this call, fastest first, none faster than choice.path."""
    paths = _kernels.paths(family, p.dtype, p.head_dim, arch, features(p))
    if choice.path is None or choice.path not in _kernels.TENSOR_CORE_PATHS:
        return paths
    rank = _kernels.TENSOR_CORE_PATHS.index(choice.path)
    slower = tuple(q for q in paths if q not in _kernels.TENSOR_CORE_PATHS[:rank])
    return slower or paths


def _table_launch(p: Problem, family: str, arch: str, choice: KernelChoice, vec: bool) -> Launch:
    """The launch of the first path that reads any strides: a block per row block of every head
    (query rows for forward and dq, keys for dkdv)."""
    path = next(q for q in _allowed_paths(p, family, arch, choice) if q != "tma")
    tiles = choice.tiles_for(family, path)
    spec = _kernels.instance(family, path, p.dtype, p.head_dim, tiles, features(p))
    seq, heads = (p.seq_k, p.heads_kv) if family == "dkdv" else (p.seq_q, p.heads_q)
    blocks = _ceil_div(seq, spec.rows_per_block)
    return Launch(spec, blocks * p.batch * heads, blocks, vec)


def _persistent_launch(
    p: Problem,
    spec: _kernels.KernelSpec,
    heads: int,
    blocks: int,
    sm_count: int,
    maps: tuple,
    row_shift: int = 0,
    family: str = "forward",
    choice: KernelChoice = DEFAULT,
) -> Launch:
    """A TMA kernel's launch: a block per SM walks the work list of `blocks` row blocks of every
    (batch, head). Under a right bound (causal) later blocks see more keys: the walk pairs heavy
    items with light ones (common.cuh, WorkWalk), unless the forward's or dQ's walk takes the
    chunked order (walk_heads). Packed calls walk a list that build_work_list writes before the
    launch (kernels_cu/work_list.cuh): its capacity sets the grid, the count it writes ends the
    walk."""
    heavy_last = p.mask.bounded_right
    work, sizes, builder = blocks * p.batch * heads, (), None
    chunk = 0
    if family in ("forward", "dq") and not p.packed:
        chunk = choice.walk_heads
        if not p.mask.local:  # only the windowed instances have the chunked order (walk_heads)
            if chunk:
                raise ValueError(f"walk_heads {chunk} needs a window (a left bound)")
            chunk = 0
        elif chunk is None:
            costs = _row_block_costs(p, spec, blocks, row_shift)
            chunk = walk_heads(costs, p.batch * heads, heavy_last, min(work, sm_count))
        heavy_last = heavy_last and chunk == 0
    if p.packed:
        # end-aligned forward slots are even already; the list pairs a sequence's own blocks
        blocks += blocks & 1 if heavy_last else 0
        sizes = (("list_base", _list_bases(p)[family]),)
        work, builder = _work_list_builder(p, spec, heads, blocks, family, sizes)
    return Launch(
        spec,
        _persistent_grid(work, heavy_last, sm_count),
        blocks,
        vec=True,
        num_work=work,
        paired=heavy_last,
        walk_heads=chunk,
        row_shift=row_shift,
        maps=maps,
        sizes=sizes,
        builder=builder,
    )


def _work_list_builder(
    p: Problem, spec: _kernels.KernelSpec, heads: int, blocks: int, family: str, base: tuple
) -> tuple[int, Launch]:
    """(capacity, the build_work_list launch) of a packed launch of `family` on `spec`, whose
    list starts at `base` (its list_base field)."""
    heavy_last = p.mask.bounded_right
    keys = family == "dkdv"
    capacity = _list_capacity(p, heads, p.total_k if keys else p.total_q, spec.rows_per_block)
    capacity -= capacity & 1  # pairs stay whole
    flags = (_LIST_KEYS if keys else 0) | (
        _LIST_END_ALIGNED if family == "forward" and heavy_last else 0
    )
    builder = Launch(
        _kernels.work_list_instance(),
        1,
        blocks,
        num_work=capacity,
        paired=heavy_last,
        sizes=(
            ("list_rows", spec.rows_per_block),
            ("list_cost_rows", spec.rows_per_step),
            ("list_heads", heads),
            ("list_flags", flags),
            *base,
        ),
    )
    return capacity, builder


# The chunked order (walk_heads) replaces decode_paired_work's where the simulated walk's busiest
# block gets at least this much less work.
WALK_GAIN = 1.03
# A work item's fixed cost (its first products, the epilogue) in key tiles (docs/perf/NOTES.md,
# v26: ~2,900 cycles an item at d = 128, a key tile ~3,000).
ITEM_TILES = 1


def _row_block_costs(p: Problem, spec: KernelSpec, blocks: int, row_shift: int) -> list[int]:
    """Key tiles of each row block (slot) of a head: the work of one item of the forward or dQ
    (0 for an empty slot: key_tiles sees none for rows outside [0, Nq)), as mask.cuh's
    key_tiles counts them."""
    mask, bm, bn = p.mask, spec.rows_per_block, spec.rows_per_step
    tiles = [mask.key_tiles(b * bm - row_shift, bm, bn).count for b in range(blocks)]
    return [count + ITEM_TILES if count else 0 for count in tiles]


def walk_makespan(costs: list[int], heads: int, paired: bool, chunk: int, grid: int) -> int:
    """The busiest block's work (in key tiles) when `grid` blocks walk `heads` heads of row
    blocks costing `costs` (per block of a head) as common.cuh's WorkWalk does: over
    decode_paired_work's order (chunk 0, in pairs where `paired`) or decode_chunked_work's
    (chunk > 0, in a snake)."""
    nb = len(costs)
    item = np.arange(heads * nb, dtype=np.int64)
    cost = np.asarray(costs, dtype=np.int64)
    if chunk == 0:
        pos = item % nb
        block = np.where(pos & 1, pos >> 1, nb - 1 - (pos >> 1))
    else:
        first = item // (chunk * nb) * chunk
        size = np.minimum(chunk, heads - first)
        block = nb - 1 - (item - first * nb) // size
    rounds = item // (2 * grid) if paired else item // grid
    slot = (item % (2 * grid)) // 2 if paired else item % grid
    if chunk:
        slot = np.where(rounds & 1, grid - 1 - slot, slot)
    return int(np.bincount(slot, cost[block], minlength=grid).max())


def walk_heads(costs: list[int], heads: int, paired: bool, grid: int) -> int:
    """The TMA forward's and dQ kernel's order of work items under a window (Params::walk_heads;
    their windowed instances only): 0 for decode_paired_work's, or the smallest chunk of heads
    whose block-major order (in a snake) gives the busiest block WALK_GAIN less work than that, in
    the simulated walk (a window makes the first row blocks cheap and the rest equal: strided
    over whole heads, rounds of like blocks fall on the same SMs). Only where the blocks' costs
    differ and few items go to an SM (the rounds' unevenness averages out over many). Without a
    window the order stays decode_paired_work's: compiled into every instance, the chunked
    decode cost the d = 128 forward 2% (docs/perf/NOTES.md, v31)."""
    items = heads * len(costs)
    if len(set(costs)) == 1 or items > 64 * grid:
        return 0
    current = walk_makespan(costs, heads, paired, 0, grid)
    chunks = sorted({min(1 << i, heads) for i in range(heads.bit_length() + 1)})
    spans = {chunk: walk_makespan(costs, heads, False, chunk, grid) for chunk in chunks}
    best = min(spans.values())
    if best * WALK_GAIN > current:
        return 0
    # the smallest chunk within 1% of the best keeps the most of each head's keys in L2
    return min(chunk for chunk, span in spans.items() if span <= best * 1.01)


def _persistent_grid(work: int, paired: bool, sm_count: int) -> int:
    """A block per SM; paired work goes in pairs of items per block (common.cuh, WorkWalk)."""
    return max(1, min(_ceil_div(work, 2 if paired else 1), sm_count))
