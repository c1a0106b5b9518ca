"""The table of kernel template instances: what can be compiled, and its launch shape.

Plain Python (no CuPy), so that the CPU compile check, the dispatch (cuflash/_dispatch.py) and the
runtime loader read the same instances. This module says what exists; which instance a call runs
is decided in one place, cuflash/_dispatch.py.

Kernel families, each with one or more paths (one ``.cu`` file each in ``kernels_cu/``):
  forward     O and lse          tma (Hopper, warp-specialised), wgmma (Hopper), mma (sm_80+),
                                 exact (float32 / float64)
  preprocess  D = rowsum(dO * O) rows (every dtype)
  dkdv        dK, dV             tma, wgmma, mma, exact; fused (Hopper: dK, dV and dQ's float32
                                 partial sums in one kernel)
  dq          dQ                 tma, wgmma, mma, exact; fused (dQ from the fused kernel's sums)
Every instance has a FEATURES template argument: the bits of kernels_cu/features.cuh.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from . import _params, _problem

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
EXACT_DTYPES = ("float32", "float64")
DTYPES = TENSOR_CORE_DTYPES + EXACT_DTYPES
FAMILIES = ("forward", "preprocess", "dkdv", "dq")
# The FP8 forward's input dtype (e4m3: q, k and v; O in bfloat16; forward only, sm_90a, TMA).
FP8_DTYPE = _problem.FP8_DTYPE
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, FP8_DTYPE: 1}
# The paths of the tensor-core dtypes, fastest first (where an instance exists).
TENSOR_CORE_PATHS = ("tma", "wgmma", "mma")

# Bits of the FEATURES template argument (kernels_cu/features.cuh).
FEATURE_LOCAL = 1  # the mask has a left bound (a sliding window)
FEATURE_SOFTCAP = 2  # S = c tanh(S / c)
FEATURE_ALIBI = 4  # S -= slope |i + Nk - Nq - j|
FEATURE_PACKED = 8  # packed variable-length sequences (kernels_cu/params.cuh, Seq)
# The feature sets the library launches (every combination), and so the compile check builds.
FEATURE_SETS = tuple(range(16))
# Packed calls: the TMA kernels load boxes of the packed tensors at each sequence's rows (those
# past the sequence are masked, kernels_cu/forward_sm90_tma.cu, backward_sm90_tma.cu).
# The softcap's backward runs on the Hopper kernels (fused, split TMA, wgmma) since v29: v11 sent
# it to mma.sync, where the Hopper kernels spilled 20-112 B with the exact tanh (two MUFU
# operations); with tanh.approx (v25) 34 of their 160 softcap instances use 8-48 B
# (local_memory.txt), and the backward runs 2.4-3.2x faster (docs/perf/NOTES.md, v29).
# Buckets whose TMA backward spills with any of these features (the dK/dV kernel with ALiBi at
# d = 64: 36 B; packed at d = 256: 20-24 B): those calls take the wgmma or mma.sync backward.
# ALiBi at d = 256 (24-76 B until v29) builds clean alone and at 16-32 B beside a window or the
# softcap, and takes the TMA kernels since v30 (2.0-2.7x; docs/perf/NOTES.md, v30).
_TMA_BACKWARD_SPILLS = {64: FEATURE_ALIBI, 256: FEATURE_PACKED}

# C++ spelling of each dtype as a template argument.
_CPP_ELEM = {
    "float16": "cuflash::f16",
    "bfloat16": "cuflash::bf16",
    "float32": "float",
    "float64": "double",
    FP8_DTYPE: "cuflash::e4m3",
}
_SOURCE_FILE = {
    ("transpose_v", "fp8"): "fp8_transpose.cu",
    ("forward", "mma"): "forward.cu",
    ("forward", "wgmma"): "forward_sm90.cu",
    ("forward", "tma"): "forward_sm90_tma.cu",
    ("dq", "tma"): "backward_sm90_tma.cu",
    ("dkdv", "tma"): "backward_sm90_tma.cu",
    ("dkdv", "fused"): "backward_sm90_fused.cu",
    ("dq", "fused"): "backward_sm90_fused.cu",
    ("dq", "wgmma"): "backward_sm90.cu",
    ("dkdv", "wgmma"): "backward_sm90.cu",
    ("dq", "mma"): "backward_dq.cu",
    ("dkdv", "mma"): "backward_dkdv.cu",
    ("forward", "exact"): "exact.cu",
    ("dq", "exact"): "exact.cu",
    ("dkdv", "exact"): "exact.cu",
    ("preprocess", "rows"): "backward_preprocess.cu",
}
_TEMPLATE = {
    ("transpose_v", "fp8"): "transpose_v_fp8",
    ("forward", "mma"): "attention_forward_mma",
    ("forward", "wgmma"): "attention_forward_wgmma",
    ("forward", "tma"): "attention_forward_tma",
    ("dq", "tma"): "attention_backward_dq_tma",
    ("dkdv", "tma"): "attention_backward_dkdv_tma",
    ("dkdv", "fused"): "attention_backward_fused_tma",
    ("dq", "fused"): "attention_backward_dq_from_accum",
    ("dq", "wgmma"): "attention_backward_dq_wgmma",
    ("dkdv", "wgmma"): "attention_backward_dkdv_wgmma",
    ("dq", "mma"): "attention_backward_dq_mma",
    ("dkdv", "mma"): "attention_backward_dkdv_mma",
    ("forward", "exact"): "attention_forward_exact",
    ("dq", "exact"): "attention_backward_dq_exact",
    ("dkdv", "exact"): "attention_backward_dkdv_exact",
    ("preprocess", "rows"): "attention_backward_preprocess",
}
PREPROCESS_WARPS = 8  # kernels_cu/backward_preprocess.cu

# Tiles per (family, path): {bucket: tiles} (tensor-core paths) or {dtype: {bucket: tiles}}
# (exact). Chosen with sweeps on an H100 (docs/perf/NOTES.md) among the configurations that
# compile without register spills.
#
# mma (mma.sync, every architecture from sm_80): forward and dq (BM, BN, warps); dkdv (BM, BN,
# warps, DSPLIT). They fit in 99 KB of shared memory, the limit of sm_86/sm_89.
_MMA_TILES = {
    "forward": {
        32: (128, 64, 4),
        64: (128, 64, 4),
        96: (128, 32, 4),  # BN = 64 is 8% faster at d = 128 but spills registers
        128: (64, 64, 4),  # (128, 32, 4), the sweep's pick, spills with repair.cuh
        160: (64, 64, 4),
        192: (64, 64, 4),
        224: (64, 64, 4),
        256: (64, 64, 4),
    },
    "dq": {
        32: (64, 64, 4),
        64: (64, 64, 4),
        96: (64, 64, 4),
        128: (64, 64, 4),
        160: (64, 32, 4),
        192: (64, 32, 4),
        224: (64, 32, 4),
        256: (64, 16, 4),  # (64, 32, 4) spills 16 bytes with repair.cuh's check on sm_90a
    },
    "dkdv": {
        # larger query tiles (BM = 128 at d <= 64, 64 at d = 128 or 224) run 7-20% faster
        # but spill registers; (64, 32, 4, 2) at d = 256 also needs 512 B over sm_86's 99 KB
        32: (64, 64, 4, 1),
        64: (64, 64, 4, 1),
        96: (32, 64, 4, 1),
        128: (32, 64, 4, 1),
        160: (64, 32, 4, 2),
        192: (64, 32, 4, 2),
        224: (32, 32, 4, 2),
        256: (32, 32, 4, 2),
    },
}
# wgmma (Hopper, cp.async loads: calls the TMA unit cannot read): (BM, BN); BM / 64 warpgroups
# own the query rows (forward, dq), BN / 64 the keys (dkdv). Three warpgroups where the registers
# allow it; at d = 256 the backward's dK and dV accumulators do not fit (mma serves it). The
# forward at d = 128 had (192, 128) until its repair path spilled 64 bytes with the Params core
# (docs/perf/NOTES.md, v10).
_WGMMA_TILES = {
    "forward": {64: (192, 64), 128: (192, 64), 256: (128, 64)},
    "dq": {64: (192, 64), 128: (128, 64)},  # (192, 64) spills at d = 128 with a window
    "dkdv": {64: (64, 128), 128: (64, 128)},
}
# tma (Hopper, warp-specialised: a producer warpgroup loads tiles with the TMA unit, consumer
# warpgroups of 64 rows compute): (BM, BN, STAGES); BM / 64 consumers for forward and dq (query
# rows), BN / 64 for dkdv (keys); STAGES buffers of the streamed tiles.
_TMA_TILES = {
    "forward": {64: (128, 128, 2), 128: (128, 128, 2), 256: (128, 64, 2)},
    "dq": {64: (128, 128, 2), 128: (128, 64, 2), 256: (64, 64, 2)},
    "dkdv": {64: (128, 128, 2), 128: (64, 128, 2), 256: (64, 64, 2)},
}
# The FP8 forward (the TMA forward with e4m3 elements): its head-dim buckets (Q and K rows of 64
# bytes with the 64-byte swizzle at d <= 64, of 128-byte swizzle rows at d <= 128 and d <= 256;
# zero-padded), (BM, BN, STAGES) per bucket (V^T's tiles hold 128-key blocks), and its feature
# sets (masks only: no score modifier, not packed).
# Tiles and loop per bucket (measured, docs/perf/NOTES.md v27, H100): d = 64: three consumers
# (192, 128) with turns, 1.07-1.12x (128, 256) serial, (128, 256) turns 0.96-0.99x, (128, 128)
# turns 0.86-0.91x; with a window (LOCAL) (192, 128) spilled 4 B and (128, 256) serial serves.
# d = 128: 256-key tiles with the serial loop ran 1.15-1.17x (128, 128) with turns (256 keys with
# turns spill 236 B); d = 256: (128, 128) serial (turns spilled 28 B, the pipelined loop without
# turns 16 B; 256 keys need 296 KB of shared memory). Both now take turns without the pipelining
# ("serial_turns", v49, H200): whole call 1.04-1.21x the serial loop at d = 128, 1.05-1.08x at
# d = 256; at d = 64 it ran 0.99-1.01x the table's.
FP8_BUCKETS = (64, 128, 256)
_FP8_TABLE = {
    64: ((192, 128, 2), "turns"),
    128: ((128, 256, 2), "serial_turns"),
    256: ((128, 128, 2), "serial_turns"),
}
_FP8_LOCAL_TABLE = {64: ((128, 256, 2), "serial")}  # with a window, where it differs
FP8_FEATURE_SETS = (0, FEATURE_LOCAL)
TRANSPOSE_KEYS, TRANSPOSE_THREADS = 128, 256  # kernels_cu/fp8_transpose.cu


def map_row_bytes(dtype: str, head_dim: int, tensor: str) -> int:
    """The row of a TMA forward's box of `tensor` in bytes: 128 (the 128-byte swizzle), or 64
    for the FP8 forward's q and k at d <= 64 (the 64-byte swizzle; forward_sm90.cuh, ROW_BYTES)."""
    if dtype == FP8_DTYPE and tensor in ("q", "k") and fp8_bucket(head_dim) == 64:
        return 64
    return 128


def fp8_bucket(head_dim: int) -> int:
    """The FP8 forward's template head dim for d (a multiple of 16 up to 256)."""
    return _smallest_bucket(head_dim, FP8_BUCKETS)


def bucket_of(dtype: str, head_dim: int) -> int:
    """The template head dim of an instance for this dtype: the FP8 forward's buckets, or
    HEAD_DIM_BUCKETS."""
    return fp8_bucket(head_dim) if dtype == FP8_DTYPE else head_dim_bucket(head_dim)


# The fused backward (kernels_cu/backward_sm90_fused.cu): its head-dim buckets, its (BM, BN,
# stages) per bucket (two consumer warpgroups of 64 keys; query tiles of 128 rows at d = 64, whose
# 64-row steps were short against a step's fixed costs, docs/perf/NOTES.md v30, and of 64 rows at
# d = 128; at d = 256 the two share 64 keys, each holding half of the head dim of dK and dV; the
# stages of Q and dO), the query tile rows each bucket's kernel has, its schedules
# (the dK/dV kernel's order of query tiles and turns: "rotated" for masks without a right bound,
# "bounded" for those with one, such as causal and windows), and the features it has (no
# packing; a left bound only with the bounded order).
FUSED_BACKWARD_BUCKETS = (64, 128, 256)
FUSED_TILES = {64: (128, 128, 2), 128: (64, 128, 2), 256: (64, 64, 2)}
# 64-row tiles at d = 64 (cuflash/_dispatch.py, fused_tiles): where the rotated schedule needs
# more query steps than 128-row tiles give, and for the (schedule, features) whose 128-row
# instances spill most (NVRTC: 168-192 B a thread) and ran slower (H100, bf16, 4k: causal with
# the softcap and ALiBi 0.94x; docs/perf/NOTES.md, v30). The bounded schedule with every modifier
# follows the causal one, unmeasured.
FUSED_SHORT_TILES = {64: (64, 128, 4)}
FUSED_SHORT_FOR = {
    64: (
        ("bounded", FEATURE_SOFTCAP | FEATURE_ALIBI),
        ("bounded", FEATURE_LOCAL | FEATURE_SOFTCAP | FEATURE_ALIBI),
    )
}
# The query tile rows each bucket's kernel has: its table's and its short tiles'.
FUSED_ROWS = {
    hd: tuple(sorted({tiles[0], FUSED_SHORT_TILES.get(hd, tiles)[0]}))
    for hd, tiles in FUSED_TILES.items()
}
FUSED_BN = {hd: tiles[1] for hd, tiles in FUSED_TILES.items()}  # each bucket's key block
# The fused kernel's slots of turns, from the warp that counts them to the writer
# (backward_sm90_fused.cu, FUSED_TURN_SLOTS).
FUSED_TURN_SLOTS = 4
SM90_MAX_SMEM = 227 * 1024  # dynamic shared memory a block may have on sm_90
FUSED_SCHEDULES = ("rotated", "bounded")
FUSED_FEATURES = FEATURE_LOCAL | FEATURE_SOFTCAP | FEATURE_ALIBI
# Feature sets a bucket's fused kernel lacks (the split kernels serve them): at d = 256 the
# softcap's (its consumers exchange P^T ds'/ds, which is not P^T: no room for P^T's own tile) and a
# window with ALiBi (20 B spilled, NVRTC).
FUSED_WITHOUT = {
    256: tuple(f for f in range(16) if f & FEATURE_SOFTCAP and not f & ~FUSED_FEATURES)
    + (FEATURE_LOCAL | FEATURE_ALIBI,)
}
# Calls of at least `rows` query rows with one of `feature sets` take `tiles` where those are
# faster than the table's (docs/perf/NOTES.md, v7-v8; v26): {(family, bucket): (rows, tiles,
# feature sets)}; the other feature sets keep the table's tiles at every length.
# - d = 64: taller query tiles from 1024 rows (H200, bf16, v47: 1.02 / 1.07 / 1.01x the 128-row
#   tiles with turns at 1k, dense / softcap / causal, 1.14 / 1.20 / 1.07x at 1536; at 512 1.03 /
#   1.08 / 0.95x; v18 on the H100 had them even at 1k); all but packed with ALiBi (three consumer
#   warpgroups spilled 8 B with ALiBi, 24-28 B with ALiBi and a window).
# - d = 128: longer key tiles from 4096 rows (fewer per-tile costs per key; FlashAttention-3 takes
#   176); O then goes from registers (no room for the staging tile: o_staging_fits).
# - d = 256: 80-key tiles at every length (the 64-key tiles' per-tile costs; FlashAttention-3
#   takes 80 too).
# d = 128 and 256: the sets that gained (v26, H100): dense (causal or not) and the softcap, and
# ALiBi at d = 256 (+4-8%). A causal window of 1024 keys lost 10% with d = 128's long tiles and
# did not move at d = 256; ALiBi at d = 128 read -0.4% at 4k and +3% at 16k (v26), 1.017 / 1.028
# (v32) and, with its one-sided form (v33), 1.00 / 1.02-1.03 (causal 1.00 / 1.01-1.03): taken
# since v33; packed calls were not measured. Packed with the softcap or ALiBi spill 16-68 B
# there, as do the softcap with ALiBi (d = 256: 8-44 B) and with a window and ALiBi (d = 128:
# 16 B).
_TMA_TILES_FOR = {
    ("forward", 64): (
        1024,
        (192, 128, 2),
        frozenset(f for f in FEATURE_SETS if f & FEATURE_PACKED == 0 or f & FEATURE_ALIBI == 0),
    ),
    ("forward", 128): (4096, (128, 160, 2), frozenset({0, FEATURE_SOFTCAP, FEATURE_ALIBI})),
    ("forward", 256): (0, (128, 80, 2), frozenset({0, FEATURE_SOFTCAP, FEATURE_ALIBI})),
}
# Windows of at most this many keys a row keep the table's tiles where _TMA_TILES_FOR has taller
# ones: {(family, bucket): keys}. d = 64 (H100, bf16, 4k and 16k, causal and two-sided windows,
# the walk of cuflash/_dispatch.py, walk_heads): (128, 128) with turns ran 1.08-1.09x (192, 128)
# serial at 256 keys, 1.04-1.06x at 512, 0.98-1.00x at 1024 and 0.90-0.94x at 4096
# (docs/perf/NOTES.md, v31).
_NARROW_WINDOW_KEYS = {("forward", 64): 512}
# Instances with softcap or ALiBi whose table tiles spill even at 255 registers take these:
# {(family, path, bucket): tiles}.
_SCORE_MOD_TILES = {("dkdv", "mma", 192): (32, 32, 4, 2)}  # (64, 32, 4, 2): 8 B on sm_90a
# Packed instances whose table tiles spill (the sequence's extents and offsets take registers):
# the d = 128 cp.async wgmma forward with three warpgroups spilled 4-16 B with score modifiers;
# the d = 128 mma.sync dK/dV with every modifier 8 B on sm_80.
_PACKED_TILES = {("forward", "wgmma", 128): (128, 64)}
_PACKED_SCORE_MOD_TILES = {("dkdv", "mma", 128): (32, 32, 4, 2)}
# The TMA forward writes O through a staging tile and TMA stores up to this head dim (shared
# memory has room for the tile there).
TMA_STORE_MAX_HEAD_DIM = 128
# The TMA forward's key-tile loop (kernels_cu/forward_sm90_tma.cu, SCHEDULE): each tile's steps one
# after the other ("serial"), pipelined within each consumer warpgroup ("overlap"), or pipelined
# with the consumers taking turns at the tensor cores ("turns"), or turns without the pipelining
# ("serial_turns": a turn issues P_j V_j, waits for it and issues S_{j+1}; the softmax follows).
FORWARD_SCHEDULES = ("serial", "overlap", "turns", "serial_turns")


def forward_schedule(head_dim: int, tiles: tuple) -> str:
    """The TMA forward's loop for these tiles: pipelined with turns where a consumer's registers
    hold O's accumulator, S and the P fragments at once (d / 2 + 3 BN / 4 registers, and 52 for
    the rest: three consumers at d = 64 and BN = 128 spilled 16-160 bytes; two at d = 128 with
    BN = 160 and at d = 256 with BN = 80 fit with none, and at d = 128 with BN = 176 spilled
    88 B with the softcap). On an H100, turns ran 1.04-1.11x serial at d = 128 and 1.01-1.05x at
    d = 256, "overlap" (no turns) 0.97-1.02x serial (docs/perf/NOTES.md, v18); with d = 128's
    160-key tiles turns ran 1.10x serial, with d = 256's 80-key tiles 1.00-1.05x (v26)."""
    bm, bn = tiles[0], tiles[1]
    registers = 240 if bm // 64 == 2 else 160  # kernels_cu/tma.cuh, WarpSpecialisedRegisters
    bucket = head_dim_bucket(head_dim)
    if bucket // 2 + bn // 2 + bn // 4 + 52 > registers:
        return "serial"
    return "turns"


# exact (CUDA cores, float64 arithmetic): (BM, BN, threads per row), BM == BN.
_EXACT_TILES = {
    "float32": {
        32: (64, 64, 4),
        64: (64, 64, 4),
        96: (32, 32, 4),
        128: (32, 32, 4),
        160: (16, 16, 16),
        192: (16, 16, 16),
        224: (16, 16, 16),
        256: (16, 16, 16),
    },
    "float64": {
        32: (32, 32, 4),
        64: (32, 32, 4),
        96: (16, 16, 4),
        128: (16, 16, 4),
        160: (8, 8, 8),
        192: (8, 8, 8),
        224: (8, 8, 8),
        256: (8, 8, 8),
    },
}


@dataclass(frozen=True)
class KernelSpec:
    """One template instance: what to compile, and how to launch it."""

    family: str
    path: str
    dtype: str
    head_dim: int  # the bucket (template HD); 0 for preprocess
    features: int  # bits of kernels_cu/features.cuh
    source: str  # file name in kernels_cu/
    name_expression: str  # C++ name of the instance, for cupy.RawModule(name_expressions=...)
    threads: int
    smem_bytes: int
    rows_per_block: int  # sequence rows a block owns: queries (keys for dkdv; rows for preprocess)
    rows_per_step: int  # rows of each tile it streams: keys (queries for dkdv)
    o_via_tma: bool = False  # TMA forward: O written through a staging tile by the TMA unit
    schedule: str = ""  # TMA forward: its key-tile loop (FORWARD_SCHEDULES)


def head_dim_bucket(d: int) -> int:
    """Smallest template head dim >= d (d is padded with zeros inside the kernel)."""
    return _smallest_bucket(d, HEAD_DIM_BUCKETS)


def _smallest_bucket(d: int, buckets: tuple[int, ...]) -> int:
    for bucket in buckets:
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim must be at most {buckets[-1]}, got {d}")


def paths(family: str, dtype: str, head_dim: int, arch: str, features: int = 0) -> tuple[str, ...]:
    """The paths with an instance for `family` at this dtype and head dim on `arch` (kernel_arch's
    spelling: sm_80, sm_86, sm_89, sm_90a, ...) and these features, fastest first."""
    if family == "preprocess":
        return ("rows",)
    if dtype in EXACT_DTYPES:
        return ("exact",)
    bucket = head_dim_bucket(head_dim)
    hopper = arch == "sm_90a"
    tables = {"tma": _TMA_TILES, "wgmma": _WGMMA_TILES}
    spills = family in ("dq", "dkdv") and features & _TMA_BACKWARD_SPILLS.get(bucket, 0)
    return tuple(
        path
        for path in TENSOR_CORE_PATHS
        if path == "mma"
        or (hopper and bucket in tables[path][family] and not (path == "tma" and spills))
    )


def default_tiles(
    family: str,
    path: str,
    dtype: str,
    head_dim: int,
    seq_q: int = 0,
    features: int = 0,
    row_keys: int | None = None,
) -> tuple:
    """The table's tiles of an instance (for `seq_q` query rows, where long sequences take
    others; for `features`, where score modifiers need smaller ones; `row_keys`: the most keys a
    query row sees, where a narrow window keeps the short sequences' tiles: _NARROW_WINDOW_KEYS)."""
    bucket = head_dim_bucket(head_dim)
    if features & FEATURE_SOFTCAP and (family, path, bucket) in _SCORE_MOD_TILES:
        return _SCORE_MOD_TILES[(family, path, bucket)]
    if features & FEATURE_PACKED and (family, path, bucket) in _PACKED_TILES:
        return _PACKED_TILES[(family, path, bucket)]
    packed_mods = features & FEATURE_PACKED and features & FEATURE_SOFTCAP
    if packed_mods and (family, path, bucket) in _PACKED_SCORE_MOD_TILES:
        return _PACKED_SCORE_MOD_TILES[(family, path, bucket)]
    if path == "tma":
        rows, tiles, feature_sets = _TMA_TILES_FOR.get((family, bucket), (0, None, ()))
        narrow = row_keys is not None and row_keys <= _NARROW_WINDOW_KEYS.get((family, bucket), 0)
        if seq_q >= rows and features in feature_sets and not narrow:
            return tiles
        return _TMA_TILES[family][bucket]
    if path == "fused":
        return FUSED_TILES[bucket] if family == "dkdv" else FUSED_TILES[bucket][:1]
    if path == "wgmma":
        return _WGMMA_TILES[family][bucket]
    if path == "mma":
        return _MMA_TILES[family][bucket]
    if path == "exact":
        return _EXACT_TILES[dtype][bucket]
    return ()


@cache
def instance(
    family: str,
    path: str,
    dtype: str,
    head_dim: int,
    tiles: tuple | None = None,
    features: int = 0,
    o_via_tma: bool = False,
    schedule: str | None = None,
) -> KernelSpec:
    """The instance of `family` on `path` for `dtype` and head dim `head_dim` (any d in 1..256),
    with `tiles` (the table's, default_tiles, when None). `o_via_tma`: the TMA forward writes O
    through a staging tile and TMA stores (head dims up to TMA_STORE_MAX_HEAD_DIM only).
    `schedule`: the TMA forward's key-tile loop (FORWARD_SCHEDULES; forward_schedule's when
    None), or the fused dK/dV kernel's order (FUSED_SCHEDULES; "rotated" when None)."""
    if (family, path) not in _SOURCE_FILE:
        raise ValueError(f"no {path!r} kernel for family {family!r}")
    if dtype == FP8_DTYPE:
        return _fp8_instance(family, path, head_dim, tiles, features, o_via_tma, schedule)
    if dtype not in DTYPES:
        raise ValueError(f"no kernel for dtype {dtype!r}")
    key = (family, path)
    source, elem, itemsize = _SOURCE_FILE[key], _CPP_ELEM[dtype], ITEMSIZE[dtype]
    name = f"cuflash::{_TEMPLATE[key]}"

    def spec(expr: str, threads: int, smem: int, rows_per_block: int, rows_per_step: int):
        return KernelSpec(
            family,
            path,
            dtype,
            hd,
            features,
            source,
            expr,
            threads,
            smem,
            rows_per_block,
            rows_per_step,
            o_via_tma,
            schedule or "",
        )

    if family == "preprocess":
        hd = 0
        # rows with one warp per row (lanes_per_row = 32)
        return spec(f"{name}<{elem}>", PREPROCESS_WARPS * 32, 0, PREPROCESS_WARPS, 0)
    hd = head_dim_bucket(head_dim)
    if tiles is None:
        tiles = default_tiles(family, path, dtype, hd, features=features)
    tiles = tuple(tiles)
    if path == "tma" and family == "forward":
        schedule = schedule or forward_schedule(hd, tiles)
        if schedule not in FORWARD_SCHEDULES:
            raise ValueError(f"schedule must be one of {FORWARD_SCHEDULES}, got {schedule!r}")
    elif (family, path) == ("dkdv", "fused"):
        schedule = schedule or FUSED_SCHEDULES[0]
        if schedule not in FUSED_SCHEDULES:
            raise ValueError(f"schedule must be one of {FUSED_SCHEDULES}, got {schedule!r}")
    elif schedule is not None:
        raise ValueError("only the TMA forward and the fused dK/dV kernel take a schedule")
    if path == "fused":
        return _fused_instance(spec, name, family, elem, hd, tiles, features, schedule)
    if path == "tma":
        return _tma_instance(spec, name, family, elem, hd, tiles, features, o_via_tma, schedule)
    if o_via_tma:
        raise ValueError("only the TMA forward writes O with TMA stores")
    if path == "wgmma":
        bm, bn = tiles
        expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {features}>"
        # Swizzled tiles (no padding) and 1 KB to align them to 1024 bytes. forward: Q and two
        # stages of K and V; dq: Q, dO and two stages of K and V; dkdv: K, V and two stages of
        # Q, dO, lse and D. The block owns BM query rows (dkdv: BN keys) and streams the other.
        if family == "forward":
            return spec(expr, 2 * bm, (bm + 4 * bn) * hd * itemsize + 1024, bm, bn)
        if family == "dq":
            return spec(expr, 2 * bm, (2 * bm + 4 * bn) * hd * itemsize + 1024, bm, bn)
        smem = (2 * bn + 4 * bm) * hd * itemsize + 4 * bm * 4 + 1024
        return spec(expr, 2 * bn, smem, bn, bm)
    if path == "mma":
        pitch_bytes = (hd + 8) * itemsize
        if family == "dkdv":
            bm, bn, warps, dsplit = tiles
            smem = (2 * bn + 2 * bm) * pitch_bytes + 2 * bm * 4
            expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {warps}, {dsplit}, {features}>"
            return spec(expr, warps * 32, smem, bn, bm)  # owns BN keys, streams BM-row query tiles
        bm, bn, warps = tiles
        rows = bm + 2 * bn if family == "forward" else 2 * bm + 2 * bn
        expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {warps}, {features}>"
        return spec(expr, warps * 32, rows * pitch_bytes, bm, bn)
    bm, bn, tpr = tiles  # exact
    pitch_bytes = (hd + 1) * itemsize
    expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {tpr}, {features}>"
    if family == "forward":
        return spec(expr, bm * tpr, (bm + 2 * bn) * pitch_bytes, bm, bn)
    smem = (2 * bm + 2 * bn) * pitch_bytes
    if family == "dkdv":
        smem += 2 * bm * 8  # lse and D of the query tile, in float64
        return spec(expr, bn * tpr, smem, bn, bm)
    return spec(expr, bm * tpr, smem, bm, bn)


def _tma_instance(
    spec, name, family, elem, hd, tiles, features, o_via_tma, schedule, itemsize=2
) -> KernelSpec:
    bm, bn, stages = tiles
    if o_via_tma and (family != "forward" or hd > TMA_STORE_MAX_HEAD_DIM):
        raise ValueError(f"no TMA store of O for {family} at head dim {hd}")
    row_bytes = hd * itemsize
    bufs = 1 if hd > 128 else 2  # buffers of the per-item tiles (kernels_cu/tma.cuh, ItemBuffers)
    # Swizzled tiles (1 KB alignment slack), lse2 and D rows (float32), then the barriers.
    if family == "forward":  # Q per buffer; K and V per stage; the O staging tile (16-bit); two
        # barriers per buffer and four per stage (K and V: full and empty); the work item posted
        # with each Q buffer
        loop = FORWARD_SCHEDULES.index(schedule)
        expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {stages}, {int(o_via_tma)}, {loop}, {features}>"
        smem = (bufs * bm + 2 * stages * bn) * row_bytes + (bm * hd * 2 if o_via_tma else 0)
        if _splits_last_block(bm, schedule, itemsize, features):  # the partial rows' area
            smem += (bm // 64 - 1) * 128 * (hd // 2 + 5) * 4
        smem += 8 * (2 * bufs + 4 * stages) + POSTED_ITEM_BYTES * bufs + 1024
        return spec(expr, (bm // 64 + 1) * 128, smem, bm, bn)
    expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {stages}, {features}>"
    if family == "dq":  # Q, dO, lse2, D per buffer; K and V per stage; two barriers each
        smem = (2 * bufs * bm + 2 * stages * bn) * row_bytes + 8 * bufs * bm
        smem += 8 * (2 * bufs + 2 * stages) + 1024
        return spec(expr, (bm // 64 + 1) * 128, smem, bm, bn)
    # dkdv: K, V per buffer; Q, dO, lse2, D per stage; two barriers each, and a packed item's
    # sequence and head per buffer. The block owns BN keys: 64 per consumer warpgroup, or
    # (hd > 128) 64 shared by two warpgroups that split the head dim and exchange P^T ds'/ds
    # (float32), dS^T (16-bit) and with a softcap P^T (16-bit) through shared memory, with their
    # barriers (Sm90DkdvKeysExchanged).
    split = hd > 128
    smem = (2 * bufs * bn + 2 * stages * bm) * row_bytes + 8 * stages * bm
    if split:  # the exchange area, then dS^T's tile
        smem += _exchange_bytes(bm, bn, bool(features & FEATURE_SOFTCAP)) + bn * bm * 2
    smem += 8 * (2 * bufs + 2 * stages) + 16 * bufs + 1024
    return spec(expr, ((2 if split else bn // 64) + 1) * 128, smem, bn, bm)


def _splits_last_block(bm: int, schedule: str, itemsize: int, features: int) -> bool:
    """Whether a TMA forward instance can split its heads' last row block by keys among its
    consumers (kernels_cu/forward_sm90_tma.cu, SPLIT_LAST: three consumers, the serial loop,
    16-bit, no window, not packed, not the softcap with ALiBi)."""
    return (
        bm // 64 == 3
        and schedule == "serial"
        and itemsize == 2
        and features & (FEATURE_LOCAL | FEATURE_PACKED) == 0
        and features & (FEATURE_SOFTCAP | FEATURE_ALIBI) != FEATURE_SOFTCAP | FEATURE_ALIBI
    )


def splits_last_block(spec: KernelSpec) -> bool:
    """_splits_last_block of a TMA forward instance."""
    return (
        spec.family == "forward"
        and spec.path == "tma"
        and spec.dtype != FP8_DTYPE
        and _splits_last_block(spec.rows_per_block, spec.schedule, 2, spec.features)
    )


def _fp8_instance(family, path, head_dim, tiles, features, o_via_tma, schedule) -> KernelSpec:
    """The FP8 forward ("forward", "tma") and its V^T pass ("transpose_v", "fp8")."""
    hd = fp8_bucket(head_dim)
    name = f"cuflash::{_TEMPLATE[(family, path)]}"
    source = _SOURCE_FILE[(family, path)]
    if (family, path) == ("transpose_v", "fp8"):
        return KernelSpec(
            family, path, FP8_DTYPE, hd, 0, source, f"{name}<{hd}>", TRANSPOSE_THREADS, 0,
            TRANSPOSE_KEYS, 0,
        )  # fmt: skip
    if (family, path) != ("forward", "tma"):
        raise ValueError(f"no {path!r} {family} kernel for dtype {FP8_DTYPE}")
    if features not in FP8_FEATURE_SETS:
        raise ValueError(f"the FP8 forward has no instance with features {features}")
    table_tiles, table_schedule = fp8_table(hd, features)
    tiles = tuple(tiles or table_tiles)
    if tiles[1] % 128:
        raise ValueError(f"the FP8 forward's key tiles are multiples of 128, got {tiles}")
    if schedule is None:  # the table's loop for its tiles, the register model's for others
        schedule = table_schedule if tiles == table_tiles else forward_schedule(hd, tiles)
    if schedule not in FORWARD_SCHEDULES:
        raise ValueError(f"schedule must be one of {FORWARD_SCHEDULES}, got {schedule!r}")

    def spec(expr: str, threads: int, smem: int, rows_per_block: int, rows_per_step: int):
        return KernelSpec(
            family, path, FP8_DTYPE, hd, features, source, expr, threads, smem, rows_per_block,
            rows_per_step, o_via_tma, schedule,
        )  # fmt: skip

    elem = _CPP_ELEM[FP8_DTYPE]
    made = _tma_instance(spec, name, family, elem, hd, tiles, features, o_via_tma, schedule, 1)
    if made.smem_bytes > SM90_MAX_SMEM:
        raise ValueError(f"FP8 tiles {tiles} at d = {hd} need {made.smem_bytes} B of shared memory")
    return made


def fp8_table(head_dim: int, features: int = 0) -> tuple[tuple[int, int, int], str]:
    """The FP8 forward's tiles and loop for this head dim and these features."""
    bucket = fp8_bucket(head_dim)
    if features & FEATURE_LOCAL and bucket in _FP8_LOCAL_TABLE:
        return _FP8_LOCAL_TABLE[bucket]
    return _FP8_TABLE[bucket]


def fused_backward_available(dtype: str, head_dim: int, features: int) -> bool:
    """Whether the fused backward (sm_90a) has instances for these (with either schedule: the
    dispatch picks it from the mask, cuflash/_dispatch.py)."""
    bucket = head_dim_bucket(head_dim)
    return (
        dtype in TENSOR_CORE_DTYPES
        and bucket in FUSED_BACKWARD_BUCKETS
        and not features & ~FUSED_FEATURES
        and features not in FUSED_WITHOUT.get(bucket, ())
    )


def _fused_instance(spec, name, family, elem, hd, tiles, features, schedule) -> KernelSpec:
    if (
        hd not in FUSED_BACKWARD_BUCKETS
        or features & ~FUSED_FEATURES
        or features in FUSED_WITHOUT.get(hd, ())
    ):
        raise ValueError(f"no fused backward at head dim {hd} with features {features}")
    if family == "dkdv" and features & FEATURE_LOCAL and schedule != "bounded":
        raise ValueError("a window (FEATURE_LOCAL) takes the fused backward's bounded schedule")
    if family == "dq":  # a block per (batch, query head, query tile): (BM,) of the dK/dV kernel
        if len(tiles) != 1 or tiles[0] not in FUSED_ROWS[hd]:
            raise ValueError(f"fused dQ tiles must be (BM,), BM in {FUSED_ROWS[hd]}, got {tiles}")
        bm = tiles[0]
        return spec(f"{name}<{elem}, {hd}, {bm}, {FUSED_BN[hd]}, {features}>", 2 * bm, 0, bm, 0)
    ok = len(tiles) == 3 and tiles[0] in FUSED_ROWS[hd] and tiles[1] == FUSED_BN[hd]
    if not (ok and 2 <= tiles[2] <= 4):
        raise ValueError(
            f"fused dK/dV tiles at d = {hd} must be (BM in {FUSED_ROWS[hd]}, {FUSED_BN[hd]}, 2-4 "
            f"stages), got {tiles}"
        )
    bm, bn = tiles[0], tiles[1]
    stages = tiles[2]
    # K and V (one buffer), Q and dO per stage, two dS^T tiles, the float32 staging tile of dQ
    # (and with 64-row tiles at d = 64 the first consumer's part; at d = 256, none: dQ is staged
    # in the stage's Q and dO buffers, DQ_IN_STAGE), lse2 and D per stage, the barriers (9 of 8
    # bytes with two stages; at d = 256 one dq_full per stage), the repair flags (8 of 4 bytes),
    # the turn slots (FusedTurnSlots: 8 barriers and 4 turns; counted for every instance, used by
    # some; at d = 256 a set per writer), 1 KB of alignment slack
    shared_keys = hd > 128  # SHARED_KEYS: two consumers share 64 keys
    consumers = 2 if shared_keys else bn // 64
    row_bytes = hd * 2
    if shared_keys:
        dq_tiles, dq_fulls = 0, stages
    else:
        dq_tiles = 2 if bm == 64 and hd < 64 * consumers else 1  # SPLIT_KEYS
        dq_fulls = 1
    # the consumers' exchange area where they share keys (no softcap at d = 256 here)
    exchange = _exchange_bytes(bm, bn, False) if shared_keys else 0
    smem = (2 * bn + 2 * stages * bm) * row_bytes + 2 * bn * bm * 2 + dq_tiles * bm * hd * 4
    smem += exchange
    smem += 8 * stages * bm + 8 * (4 + 2 * stages + dq_fulls) + 4 * 8
    turn_sets = 2 if shared_keys else 1  # d = 256: one set of slots per writer (HALF_WRITERS)
    smem += (8 * 2 * FUSED_TURN_SLOTS + 4 * FUSED_TURN_SLOTS) * turn_sets + 1024
    if smem > SM90_MAX_SMEM:
        raise ValueError(f"fused dK/dV tiles {tiles} at d = {hd} need {smem} B of shared memory")
    bounded = int(schedule == "bounded")
    expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {stages}, {bounded}, {features}>"
    return spec(expr, (consumers + 1) * 128, smem, bn, bm)


def o_staging_fits(head_dim: int, tiles: tuple, dtype: str = "float16") -> bool:
    """Whether the TMA forward with these tiles has room in shared memory for O's staging tile
    (kernels_cu/forward_sm90_tma.cu, O_VIA_TMA): head dims up to TMA_STORE_MAX_HEAD_DIM, and
    not with d = 128's long key tiles."""
    bucket = bucket_of(dtype, head_dim)
    if bucket > TMA_STORE_MAX_HEAD_DIM:
        return False
    spec = instance("forward", "tma", dtype, bucket, tiles, 0, True)
    return spec.smem_bytes <= SM90_MAX_SMEM


def all_specs(arch: str = "sm_80") -> list[KernelSpec]:
    """Every instance the library's dispatch can launch on `arch` (cuflash/_dispatch.py): what
    the compile check must cover."""
    specs = {instance("preprocess", "rows", dt, 0) for dt in DTYPES} | kvcache_specs(arch)
    specs.add(work_list_instance())
    for hd in FP8_BUCKETS if arch == "sm_90a" else ():
        specs.add(instance("transpose_v", "fp8", FP8_DTYPE, hd))
        for features in FP8_FEATURE_SETS:
            tiles = fp8_table(hd, features)[0]
            for o_via_tma in (False, True) if o_staging_fits(hd, tiles, FP8_DTYPE) else (False,):
                specs.add(instance("forward", "tma", FP8_DTYPE, hd, tiles, features, o_via_tma))
    for dt in TENSOR_CORE_DTYPES if arch == "sm_90a" else ():
        for hd in FUSED_BACKWARD_BUCKETS:
            for features in FEATURE_SETS:
                if not fused_backward_available(dt, hd, features):
                    continue
                for schedule in FUSED_SCHEDULES:
                    if not (features & FEATURE_LOCAL and schedule == "rotated"):
                        fused = instance("dkdv", "fused", dt, hd, None, features, schedule=schedule)
                        specs.add(fused)
                specs.add(instance("dq", "fused", dt, hd, None, features))
                # 64-row tiles: the rotated schedule's where 128 rows give too few query steps,
                # and FUSED_SHORT_FOR's
                short = FUSED_SHORT_TILES.get(hd)
                for schedule in FUSED_SCHEDULES if short else ():
                    rotated = schedule == "rotated" and not features & FEATURE_LOCAL
                    if rotated or (schedule, features) in FUSED_SHORT_FOR[hd]:
                        fused = instance(
                            "dkdv", "fused", dt, hd, short, features, schedule=schedule
                        )
                        specs.add(fused)
                        specs.add(instance("dq", "fused", dt, hd, short[:1], features))
    for family in ("forward", "dkdv", "dq"):
        for dt in DTYPES:
            for hd in HEAD_DIM_BUCKETS:
                for features in FEATURE_SETS:
                    for path in paths(family, dt, hd, arch, features):
                        if path != "tma":  # the first path that reads any strides
                            specs.add(instance(family, path, dt, hd, None, features))
                            break
                        for seq_q in (0, 1 << 30):  # short and long sequences' tiles
                            tiles = default_tiles(family, path, dt, hd, seq_q, features)
                            stores = (False, True) if family == "forward" else (False,)
                            for o_via_tma in stores:
                                if o_via_tma and not o_staging_fits(hd, tiles):
                                    continue
                                specs.add(
                                    instance(family, path, dt, hd, tiles, features, o_via_tma)
                                )
    return sorted(specs, key=lambda s: s.name_expression)


# ---------------------------------------------------------------------------------------------
# The work lists of packed calls on the persistent kernels (kernels_cu/work_list.cu)

WORK_LIST_SOURCE = "work_list.cu"
WORK_LIST_THREADS = 1024  # one block (LIST_THREADS)


@cache
def work_list_instance() -> KernelSpec:
    """build_work_list: one block writes a packed launch's work list (kernels_cu/work_list.cuh)."""
    expr = "cuflash::build_work_list"
    return KernelSpec(
        "work_list",
        "sequences",
        "float32",
        0,
        0,
        WORK_LIST_SOURCE,
        expr,
        WORK_LIST_THREADS,
        0,
        0,
        0,
    )


# ---------------------------------------------------------------------------------------------
# Sources


def kernel_dir() -> Path:
    """kernels_cu/: inside the installed package (wheel) or beside it (source tree)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "forward.cu").is_file():
            return candidate
    raise FileNotFoundError(
        f"cuflash could not find its CUDA sources (kernels_cu/) next to {here}; "
        "the installation is incomplete"
    )


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@cache
def expanded_source(filename: str) -> str:
    """The file with its local #include lines inlined (each header once).

    The compiled-module cache is keyed by the source text, so the text handed to the compiler must
    contain every header: an edited header then means a new key, never a stale binary.
    """
    root = kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (root / name).read_text()
        text = text.replace("#pragma once\n", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(filename)


# Shared memory the TMA forward gives the work item posted with each Q buffer
# (forward_sm90_tma.cu, PostedItem; compiled_source holds the kernel's constant to this).
POSTED_ITEM_BYTES = 64
# The d = 256 dK/dV consumers' exchange area's mbarriers (backward_sm90_tma.cuh,
# Sm90DkdvKeysExchanged): the split and fused kernels' shared memory counts them.
EXCHANGE_BARRIER_BYTES = 32


def _exchange_bytes(bm: int, bn: int, softcap: bool) -> int:
    """Sm90DkdvKeysExchanged::EXCHANGE_BYTES: G (float32), the mbarriers, and with a softcap P^T's
    16-bit tile."""
    return bn * bm * 4 + EXCHANGE_BARRIER_BYTES + (bn * bm * 2 if softcap else 0)


_EXCHANGE_ASSERT = (
    f"static_assert(cuflash::EXCHANGE_BARRIER_BYTES == {EXCHANGE_BARRIER_BYTES}, "
    '"cuflash/_kernels.py, EXCHANGE_BARRIER_BYTES");\n'
)
# Static_asserts that hold a source's constants to the host's: {source: C++ statements}.
_SOURCE_ASSERTS = {
    "forward_sm90_tma.cu": f"static_assert(cuflash::POSTED_ITEM_BYTES == {POSTED_ITEM_BYTES}, "
    '"cuflash/_kernels.py, POSTED_ITEM_BYTES");\n',
    "backward_sm90_fused.cu": f"static_assert(cuflash::FUSED_TURN_SLOTS == {FUSED_TURN_SLOTS}, "
    '"cuflash/_kernels.py, FUSED_TURN_SLOTS");\n' + _EXCHANGE_ASSERT,
    "backward_sm90_tma.cu": _EXCHANGE_ASSERT,
}


@cache
def compiled_source(filename: str) -> str:
    """What the compiler gets for a kernel source: the expanded file, then the static_asserts
    that hold its Params to the host's mirror (cuflash/_params.py) and its constants to the
    host's (_SOURCE_ASSERTS)."""
    asserts = _params.layout_asserts() + _SOURCE_ASSERTS.get(filename, "")
    return expanded_source(filename) + "\n" + asserts


def kernel_arch(compute_capability: str) -> str:
    """Target for a device's compute capability, e.g. '90' -> 'sm_90a', '86' -> 'sm_86'."""
    cc = int(compute_capability)
    if cc < 80:
        raise RuntimeError(
            f"cuflash needs an NVIDIA GPU of compute capability 8.0 or newer (Ampere or later); "
            f"this one is {cc // 10}.{cc % 10}"
        )
    return "sm_90a" if cc == 90 else f"sm_{cc}"


COMPILE_OPTIONS = ("--std=c++17",)
# CuPy (cupy/cuda/compiler.py, 13 and 14) appends to the options of cupy.RawModule: this flag
# (flush float32 denormals to zero), its own -arch=sm_XX (NVRTC keeps the feature suffix of ours)
# and --device-as-default-execution-space. The binaries that run are built so; nvcc without
# -ftz=true gave other registers at the limit and missed spills (docs/perf/NOTES.md, v17).
FLUSH_DENORMALS = "-ftz=true"


def runtime_options(arch: str) -> tuple[str, ...]:
    """NVRTC's options for an instance on `arch` (e.g. "sm_90a"), as the runtime compiles it:
    cuflash/_compile.py passes COMPILE_OPTIONS and -arch, CuPy appends the rest."""
    cupy_arch = f"-arch={arch.rstrip('a')}"
    cupy = (FLUSH_DENORMALS, cupy_arch, "--device-as-default-execution-space")
    return (*COMPILE_OPTIONS, f"-arch={arch}", *cupy)


# ---------------------------------------------------------------------------------------------
# KV cache (kernels_cu/kvcache.cu): the append, split-KV decoding and its combine, and the packing
# of the cache for the packed forward (chunked prefill, the exact dtypes).

KVCACHE_SOURCE = "kvcache.cu"
DECODE_ROWS = 16  # query rows of a decoding block (kernels_cu/kvcache.cu)
DECODE_KEYS = 64  # keys of each of its key tiles
DECODE_THREADS = 128
# Decoding blocks per KV head and sequence: calls with more query rows (Nq * group) take the
# packed forward kernels, whose query tiles reuse each key tile for many more rows.
DECODE_MAX_ROWS = 64
DECODE_MAX_SPLITS = 128  # the combine's block reads one split per thread (COMBINE_MAX_SPLITS)
DECODE_FEATURE_SETS = tuple(range(8))  # LOCAL, SOFTCAP, ALIBI: no PACKED
# Families whose instances have no FEATURES template argument (they apply no mask or modifier).
FEATURELESS_FAMILIES = (
    "preprocess",
    "transpose_v",
    "append",
    "gather",
    "pack_offsets",
    "decode_combine",
    "work_list",
)


def featureless(spec: KernelSpec) -> bool:
    """Whether an instance has no FEATURES template argument: it applies no mask or modifier (the
    families above)."""
    return spec.family in FEATURELESS_FAMILIES


APPEND_THREADS = 256
COMBINE_WARPS = 8
GATHER_THREADS = 128
_CPP_STORAGE = {
    "float16": "unsigned short",
    "bfloat16": "unsigned short",
    "float32": "float",
    "float64": "double",
}


def decode_bulk(arch: str) -> bool:
    """Whether the decoding kernel has its key and value rows copied by the TMA unit (bulk copies,
    sm_90) rather than with cp.async (kernels_cu/kvcache.cu, BULK)."""
    return arch == "sm_90a"


# Head dims whose decoding kernel on sm_90 also comes with its key/value tiles copied as boxes of
# the caches' tensor maps (kernels_cu/kvcache.cu, attention_decode_boxes): rows of 64 or 128
# elements, whole 128-byte swizzle rows.
DECODE_BOX_HEAD_DIMS = (64, 128)


def decode_boxes(arch: str, head_dim: int) -> bool:
    """Whether `arch` has a decoding instance that copies whole tiles as tensor-map boxes at this
    head dim (its bucket)."""
    return decode_bulk(arch) and head_dim_bucket(head_dim) in DECODE_BOX_HEAD_DIMS


def decode_stages(head_dim: int) -> int:
    """Key/value stages of the decoding kernel: three up to d = 128, two above (shared memory)."""
    return 3 if head_dim_bucket(head_dim) <= 128 else 2


@cache
def kvcache_instance(
    family: str,
    dtype: str,
    head_dim: int = 0,
    features: int = 0,
    bulk: bool = False,
    boxes: bool = False,
) -> KernelSpec:
    """An instance of kernels_cu/kvcache.cu: family "append", "decode", "decode_combine",
    "pack_offsets" or "gather"; `bulk`: the decoding kernel's bulk-copy loads (decode_bulk);
    `boxes`: its tiles as tensor-map boxes (decode_boxes)."""
    if dtype not in DTYPES:
        raise ValueError(f"no kernel for dtype {dtype!r}")
    if family in ("append", "gather") and dtype == "bfloat16":
        dtype = "float16"  # one instance per storage type: both move 16-bit words
    storage = _CPP_STORAGE[dtype]

    def spec(expr: str, threads: int, smem: int = 0, hd: int = 0, rows: int = 0, step: int = 0):
        return KernelSpec(
            family, "kvcache", dtype, hd, features, KVCACHE_SOURCE, expr, threads, smem, rows, step
        )

    if family == "append":
        return spec(f"cuflash::kvcache_append<{storage}>", APPEND_THREADS)
    if family == "gather":
        return spec(f"cuflash::kvcache_gather<{storage}>", GATHER_THREADS)
    if family == "pack_offsets":
        return spec("cuflash::kvcache_pack_offsets", 32)
    if dtype not in TENSOR_CORE_DTYPES:
        raise ValueError(
            f"no {family} kernel for dtype {dtype}: the exact dtypes take the packed path"
        )
    elem = _CPP_ELEM[dtype]
    hd = head_dim_bucket(head_dim)
    if family == "decode_combine":  # a block per row
        expr = f"cuflash::attention_decode_combine<{elem}, {hd}>"
        return spec(expr, COMBINE_WARPS * 32, 0, hd, 1)
    if family != "decode":
        raise ValueError(f"no KV-cache kernel family {family!r}")
    stages = decode_stages(hd)
    if boxes and hd not in DECODE_BOX_HEAD_DIMS:
        raise ValueError(f"no decoding kernel with boxes at head dim {hd}")
    # Q, the stages' K and V tiles (rows of hd + 8 elements, or boxes' rows of hd after up to
    # 1 KB of alignment), the row offsets of two key tiles, a barrier per stage (bulk copies)
    tile_row = hd if boxes else hd + 8
    smem = DECODE_ROWS * (hd + 8) * 2 + 2 * stages * DECODE_KEYS * tile_row * 2
    smem += 2 * 2 * DECODE_KEYS * 8 + (8 * stages if bulk or boxes else 0) + (1024 if boxes else 0)
    if boxes:
        expr = f"cuflash::attention_decode_boxes<{elem}, {hd}, {stages}, {features}>"
    else:
        flag = "true" if bulk else "false"
        expr = f"cuflash::attention_decode<{elem}, {hd}, {stages}, {flag}, {features}>"
    return spec(expr, DECODE_THREADS, smem, hd, DECODE_ROWS, DECODE_KEYS)


def kvcache_specs(arch: str = "sm_80") -> set[KernelSpec]:
    """Every KV-cache instance the library can launch on `arch` (the packed forward's are in
    all_specs)."""
    specs = {kvcache_instance(f, dt) for f in ("append", "gather") for dt in DTYPES}
    specs.add(kvcache_instance("pack_offsets", "float32"))
    for dt in TENSOR_CORE_DTYPES:
        for hd in HEAD_DIM_BUCKETS:
            specs.add(kvcache_instance("decode_combine", dt, hd))
            for features in DECODE_FEATURE_SETS:
                specs.add(kvcache_instance("decode", dt, hd, features, decode_bulk(arch)))
                if decode_boxes(arch, hd):
                    specs.add(kvcache_instance("decode", dt, hd, features, True, boxes=True))
    return specs
