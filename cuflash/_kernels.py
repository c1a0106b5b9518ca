"""The one table that maps a call to a kernel template instance.

Everything here is plain Python (no CuPy), so that the CPU compile check and the runtime loader
read the same instances, tile sizes and launch shapes.

Kernel families (one ``.cu`` file each in ``kernels_cu/``):
  forward      O and lse                           tensor cores (fp16/bf16) or exact (fp32/fp64)
  preprocess   D = rowsum(dO * O)                  every dtype
  dkdv         dK, dV, one key tile per block      tensor cores or exact
  dq           dQ, one query tile per block        tensor cores or exact
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from . import _plans

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]
TENSOR_CORE_DTYPES = ("float16", "bfloat16")
EXACT_DTYPES = ("float32", "float64")
DTYPES = TENSOR_CORE_DTYPES + EXACT_DTYPES
FAMILIES = ("forward", "preprocess", "dkdv", "dq")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

# C++ spelling of each dtype as a template argument.
_CPP_ELEM = {
    "float16": "cuflash::f16",
    "bfloat16": "cuflash::bf16",
    "float32": "float",
    "float64": "double",
}
_SOURCE_FILE = {
    ("forward", "mma"): "forward.cu",
    ("forward", "wgmma"): "forward_sm90.cu",
    ("forward", "tma"): "forward_sm90_tma.cu",
    ("dq", "tma"): "backward_sm90_tma.cu",
    ("dkdv", "tma"): "backward_sm90_tma.cu",
    ("dq", "wgmma"): "backward_sm90.cu",
    ("dkdv", "wgmma"): "backward_sm90.cu",
    ("dq", "mma"): "backward_dq.cu",
    ("dkdv", "mma"): "backward_dkdv.cu",
    ("forward", "exact"): "exact.cu",
    ("dq", "exact"): "exact.cu",
    ("dkdv", "exact"): "exact.cu",
    ("preprocess", "any"): "backward_preprocess.cu",
}
_TEMPLATE = {
    ("forward", "mma"): "attention_forward_mma",
    ("forward", "wgmma"): "attention_forward_wgmma",
    ("forward", "tma"): "attention_forward_tma",
    ("dq", "tma"): "attention_backward_dq_tma",
    ("dkdv", "tma"): "attention_backward_dkdv_tma",
    ("dq", "wgmma"): "attention_backward_dq_wgmma",
    ("dkdv", "wgmma"): "attention_backward_dkdv_wgmma",
    ("dq", "mma"): "attention_backward_dq_mma",
    ("dkdv", "mma"): "attention_backward_dkdv_mma",
    ("forward", "exact"): "attention_forward_exact",
    ("dq", "exact"): "attention_backward_dq_exact",
    ("dkdv", "exact"): "attention_backward_dkdv_exact",
    ("preprocess", "any"): "attention_backward_preprocess",
}
PREPROCESS_WARPS = 8  # kernels_cu/backward_preprocess.cu

# Tensor-core tile shapes per head-dim bucket. forward/dq: (BM, BN, warps);
# dkdv: (BM, BN, warps, DSPLIT). Chosen with bench/sweep_tiles.py on an H100 (bench/NOTES.md)
# among the configurations that compile without register spills and fit in 99 KB of shared
# memory, the limit of sm_86/sm_89, so that one table serves every architecture from sm_80 on.
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
# Hopper forward (kernels_cu/forward_sm90.cu, wgmma): (BM, BN) per head-dim bucket; BM / 64
# warpgroups. Used on sm_90a for these buckets; the others keep the mma.sync kernel. Chosen with
# bench/probe_sm90.py --sweep on an H100 (bench/NOTES.md): three warpgroups where the registers
# allow it (d = 64, 128), two at d = 256 (three spill).
# The backward kernels (kernels_cu/backward_sm90.cu): dq (BM query rows, BN keys per tile) and
# dkdv (BM query rows per tile, BN keys per block), BM resp. BN / 64 warpgroups; head dims 64 and
# 128 (at 256 the dK and dV accumulators do not fit in registers). These serve the calls the TMA
# kernels below cannot (unaligned rows); dkdv at 64 keeps (64, 128): (64, 192) spills with the
# step code it shares with the TMA kernel (backward_sm90.cuh).
_WGMMA_TILES = {
    "forward": {64: (192, 64), 128: (192, 128), 256: (128, 64)},
    "dq": {64: (192, 64), 128: (192, 64)},
    "dkdv": {64: (64, 128), 128: (64, 128)},
}
# The warp-specialised Hopper kernels (kernels_cu/forward_sm90_tma.cu, backward_sm90_tma.cu):
# (BM, BN, STAGES) with one producer warpgroup that loads the tiles with the TMA unit and
# consumer warpgroups of 64 rows each: BM / 64 of them for forward and dq (query rows), BN / 64
# for dkdv (keys); STAGES buffers of the streamed tiles. They run where the TMA unit can read the
# inputs (16-byte aligned base and strides, d a multiple of 8: cuflash/_tma.py); the kernels of
# the tables above serve every other call.
_TMA_TILES = {
    "forward": {64: (128, 128, 2), 128: (128, 128, 2), 256: (128, 64, 2)},
    "dq": {64: (128, 128, 2), 128: (128, 64, 2), 256: (64, 64, 2)},
    "dkdv": {64: (128, 128, 2), 128: (64, 128, 2), 256: (64, 64, 2)},
}
# Sequences of at least `threshold` query rows (not causal, causal) take taller query tiles where
# those are faster (bench/NOTES.md, v7): {(family, bucket): ((threshold, causal threshold), tiles)}.
# The causal threshold is 2048 with end-aligned causal row blocks (v8: at 2k causal the tall tiles
# ran 342 TFLOP/s end-aligned against 307 for the 128-row ones; start-aligned they ran 258).
_TMA_TILES_LONG = {("forward", 64): ((2048, 2048), (192, 128, 2))}
_wgmma_enabled = True
_tma_enabled = True
# The TMA forward's causal row blocks: aligned to the end of the sequence (True, the default since
# v9), or to its start (False, as in v7). See causal_row_slots. End alignment measured +5-9% on the
# d = 64 causal forward at 4k-8k in v8 (bench/NOTES.md) and no change elsewhere.
_causal_end_aligned = True
# The TMA forward writes O through a shared-memory staging tile and TMA stores where shared memory
# has room for it (head dims up to 128), or straight from registers (False: the v8 epilogue, for
# comparisons). See kernels_cu/forward_sm90_tma.cu and bench/NOTES.md, v9.
_tma_store_enabled = True
_TMA_STORE_MAX_HEAD_DIM = 128


def set_wgmma(enabled: bool) -> None:
    """Use the Hopper kernels on sm_90a (default) or the sm_80 ones (for comparisons). Plans
    built before the switch are dropped."""
    global _wgmma_enabled
    _wgmma_enabled = bool(enabled)
    kernel_spec.cache_clear()
    tma_spec.cache_clear()
    _plans.clear()


def set_tma(enabled: bool) -> None:
    """Use the TMA kernels (forward, dq, dkdv) on sm_90a where they apply (default), or the
    cp.async / mma.sync ones (for comparisons). Plans built before the switch are dropped."""
    global _tma_enabled
    _tma_enabled = bool(enabled)
    tma_spec.cache_clear()
    _plans.clear()


def set_tma_store(enabled: bool) -> None:
    """Write the TMA forward's O through a staging tile and TMA stores where it fits (default), or
    straight from registers (for comparisons). Plans built before the switch are dropped."""
    global _tma_store_enabled
    _tma_store_enabled = bool(enabled)
    tma_spec.cache_clear()
    _plans.clear()


def tma_store_enabled() -> bool:
    """Whether the TMA forward writes O through TMA stores where it fits (set_tma_store)."""
    return _tma_store_enabled


def set_causal_end_aligned(enabled: bool) -> None:
    """Align the causal TMA forward's row blocks to the end of the sequence (see
    causal_row_slots), or to its start. Plans built before the switch are dropped."""
    global _causal_end_aligned
    _causal_end_aligned = bool(enabled)
    _plans.clear()


def causal_end_aligned() -> bool:
    """Whether the causal TMA forward's row blocks are aligned to the end of the sequence."""
    return _causal_end_aligned


def causal_row_slots(seq_q: int, rows_per_block: int, causal: bool) -> tuple[int, int]:
    """(slots per head, row_shift) of the TMA forward's work list (kernels_cu/forward_sm90_tma.cu):
    slot b holds the query rows [b * rows_per_block - row_shift, (b + 1) * rows_per_block -
    row_shift), and a slot whose rows are all negative is empty.

    Start-aligned (row_shift 0) the last block is the partial one; under causal masking it runs
    every key tile for its few real rows (at N = 4096 and 192-row blocks, a third of the work of
    the head's heaviest block for 64 rows). End-aligned, the partial block is the first, which
    sees the fewest keys; an odd block count gets an empty slot 0 so that the kernel's
    heavy-with-light pairs (decode_paired_work) stay within one head."""
    blocks = -(-seq_q // rows_per_block)
    if not (causal and _causal_end_aligned):
        return blocks, 0
    slots = blocks + (blocks & 1)
    return slots, slots * rows_per_block - seq_q


# Exact-path tiles per (dtype, bucket): (BM, BN, threads per row). BM == BN. The exact path
# computes in float64 whatever the storage type (kernels_cu/exact.cu).
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


# Experiments (bench/sweep_tiles.py) replace table entries here: {(family, dtype, bucket): tiles}.
_overrides: dict[tuple[str, str, int], tuple[int, ...]] = {}


def set_tile_override(family: str, dtype: str, bucket: int, tiles: tuple[int, ...] | None) -> None:
    """Use `tiles` (the table's tuple form) for one instance; None restores the table. Plans
    built before the switch are dropped."""
    if tiles is None:
        _overrides.pop((family, dtype, bucket), None)
    else:
        _overrides[(family, dtype, bucket)] = tuple(tiles)
    kernel_spec.cache_clear()
    tma_spec.cache_clear()
    _plans.clear()


def _tiles(family: str, dtype: str, hd: int) -> tuple[int, ...]:
    found = _overrides.get((family, dtype, hd))
    if found is not None:
        return found
    if family.endswith("_sm90"):
        return _WGMMA_TILES[family[: -len("_sm90")]][hd]
    if family.endswith("_tma"):
        return _TMA_TILES[family[: -len("_tma")]][hd]
    if dtype in TENSOR_CORE_DTYPES:
        return _MMA_TILES[family][hd]
    return _EXACT_TILES[dtype][hd]


@dataclass(frozen=True)
class KernelSpec:
    """One template instance: what to compile, and how to launch it."""

    family: str
    dtype: str
    head_dim: int  # the bucket (template HD); 0 for preprocess
    source: str  # file name in kernels_cu/
    name_expression: str  # C++ name of the instance, for cupy.RawModule(name_expressions=...)
    threads: int
    smem_bytes: int
    rows_per_block: int  # sequence rows a block owns: queries (keys for dkdv; rows for preprocess)
    rows_per_step: int  # rows of each tile it streams: keys (queries for dkdv)
    o_via_tma: bool = False  # TMA forward: O written through a staging tile by the TMA unit


def head_dim_bucket(d: int) -> int:
    """Smallest template head dim >= d (d is padded with zeros inside the kernel)."""
    for bucket in HEAD_DIM_BUCKETS:
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {d}")


def path_of(dtype: str) -> str:
    return "mma" if dtype in TENSOR_CORE_DTYPES else "exact"


@cache
def kernel_spec(family: str, dtype: str, head_dim: int, arch: str = "sm_80") -> KernelSpec:
    """The instance that runs `family` for `dtype` and head dim `head_dim` (any d in 1..256) on a
    GPU of architecture `arch` (kernel_arch's spelling: sm_80, sm_86, sm_89, sm_90a, ...)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}")
    if dtype not in DTYPES:
        raise ValueError(f"no kernel for dtype {dtype!r}")
    elem, itemsize = _CPP_ELEM[dtype], ITEMSIZE[dtype]
    if family == "preprocess":
        key = ("preprocess", "any")
        return KernelSpec(
            family,
            dtype,
            0,
            _SOURCE_FILE[key],
            f"cuflash::{_TEMPLATE[key]}<{elem}>",
            PREPROCESS_WARPS * 32,
            0,
            PREPROCESS_WARPS,  # rows with one warp per row (lanes_per_row = 32)
            0,
        )
    hd = head_dim_bucket(head_dim)
    path = path_of(dtype)
    if path == "mma" and uses_wgmma(family, arch, hd):
        bm, bn = _tiles(family + "_sm90", dtype, hd)
        key = (family, "wgmma")
        expr = f"cuflash::{_TEMPLATE[key]}<{elem}, {hd}, {bm}, {bn}>"
        # Swizzled tiles (no padding) and 1 KB to align them to 1024 bytes. forward: Q and two
        # stages of K and V; dq: Q, dO and two stages of K and V; dkdv: K, V and two stages of
        # Q, dO, lse and D. The block owns BM query rows (dkdv: BN keys) and streams the other.
        if family == "forward":
            smem = (bm + 4 * bn) * hd * itemsize + 1024
            return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, 2 * bm, smem, bm, bn)
        if family == "dq":
            smem = (2 * bm + 4 * bn) * hd * itemsize + 1024
            return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, 2 * bm, smem, bm, bn)
        smem = (2 * bn + 4 * bm) * hd * itemsize + 4 * bm * 4 + 1024
        return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, 2 * bn, smem, bn, bm)
    key = (family, path)
    name = f"cuflash::{_TEMPLATE[key]}"
    if path == "mma":
        pitch_bytes = (hd + 8) * itemsize
        if family == "dkdv":
            bm, bn, warps, dsplit = _tiles("dkdv", dtype, hd)
            smem = (2 * bn + 2 * bm) * pitch_bytes + 2 * bm * 4
            expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {warps}, {dsplit}>"
            # the block owns BN keys and streams BM-row query tiles
            return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, warps * 32, smem, bn, bm)
        bm, bn, warps = _tiles(family, dtype, hd)
        rows = bm + 2 * bn if family == "forward" else 2 * bm + 2 * bn
        expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {warps}>"
        return KernelSpec(
            family, dtype, hd, _SOURCE_FILE[key], expr, warps * 32, rows * pitch_bytes, bm, bn
        )
    bm, bn, tpr = _tiles(family, dtype, hd)
    pitch_bytes = (hd + 1) * itemsize
    expr = f"{name}<{elem}, {hd}, {bm}, {bn}, {tpr}>"
    if family == "forward":
        smem = (bm + 2 * bn) * pitch_bytes
        return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, bm * tpr, smem, bm, bn)
    smem = (2 * bm + 2 * bn) * pitch_bytes
    if family == "dkdv":
        smem += 2 * bm * 8  # lse and D of the query tile, in float64
        return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, bn * tpr, smem, bn, bm)
    return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, bm * tpr, smem, bm, bn)


@cache
def tma_spec(
    family: str,
    dtype: str,
    head_dim: int,
    arch: str,
    seq_len: int = 0,
    causal: bool = False,
    o_via_tma: bool = True,
) -> KernelSpec | None:
    """The warp-specialised TMA instance for `family` on `arch` (for `seq_len` query rows, where
    long sequences take other tiles), or None where there is none. A plan runs it for the calls
    whose arrays the TMA unit can read, and kernel_spec's instance for the others. The forward
    writes O with TMA stores where it can (d = 64 or 128, filling its bucket; set_tma_store)
    unless `o_via_tma` is False (for outputs the TMA unit cannot write)."""
    hd = head_dim_bucket(head_dim)
    if not (uses_tma(family, arch, hd) and dtype in TENSOR_CORE_DTYPES):
        return None
    tiles = _tiles(family + "_tma", dtype, hd)
    long_tiles = _TMA_TILES_LONG.get((family, hd))
    if long_tiles and (family + "_tma", dtype, hd) not in _overrides:
        if seq_len >= long_tiles[0][1 if causal else 0]:
            tiles = long_tiles[1]
    bm, bn, stages = tiles[:3]
    key = (family, "tma")
    # The forward's template flags after the tiles: its consumers take turns at the tensor cores
    # (1) or not (0, the default; kernels_cu/tma.cuh, TensorCoreTurns), from the fourth tile
    # field; and O through a staging tile and TMA stores (1) or from registers (0).
    # Only where d fills the bucket, so that the TMA unit writes whole boxes (the kernel stages a
    # warpgroup's rows only when they all exist: partial boxes fault in TMA stores, NOTES v9).
    stage_o = (
        family == "forward"
        and o_via_tma
        and _tma_store_enabled
        and hd <= _TMA_STORE_MAX_HEAD_DIM
        and head_dim == hd
    )
    forward_flags = (
        f", {tiles[3] if len(tiles) > 3 else 0}, {int(stage_o)}" if family == "forward" else ""
    )
    expr = (
        f"cuflash::{_TEMPLATE[key]}<{_CPP_ELEM[dtype]}, {hd}, {bm}, {bn}, {stages}{forward_flags}>"
    )
    row_bytes = hd * ITEMSIZE[dtype]
    bufs = 1 if hd > 128 else 2  # buffers of the per-item tiles (kernels_cu/tma.cuh, ItemBuffers)
    # Swizzled tiles (1 KB alignment slack), lse2 and D rows (float32), then the barriers.
    if family == "forward":  # Q per buffer; K and V per stage; the O staging tile; two barriers
        # per buffer and three per stage
        tiles_rows = bufs * bm + 2 * stages * bn + (bm if stage_o else 0)
        smem = tiles_rows * row_bytes + 8 * (2 * bufs + 3 * stages) + 1024
        threads = (bm // 64 + 1) * 128
        return KernelSpec(
            family, dtype, hd, _SOURCE_FILE[key], expr, threads, smem, bm, bn, stage_o
        )
    if family == "dq":  # Q, dO, lse2, D per buffer; K and V per stage; two barriers each
        smem = (2 * bufs * bm + 2 * stages * bn) * row_bytes + 8 * bufs * bm
        smem += 8 * (2 * bufs + 2 * stages) + 1024
        threads = (bm // 64 + 1) * 128
        return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, threads, smem, bm, bn)
    # dkdv: K, V per buffer; Q, dO, lse2, D per stage; two barriers each. The block owns BN keys:
    # 64 per consumer warpgroup, or (hd > 128) 64 shared by two warpgroups that split the head dim.
    split = hd > 128
    smem = (2 * bufs * bn + 2 * stages * bm) * row_bytes + 8 * stages * bm
    smem += 8 * (2 * bufs + 2 * stages) + 1024
    threads = ((2 if split else bn // 64) + 1) * 128
    return KernelSpec(family, dtype, hd, _SOURCE_FILE[key], expr, threads, smem, bn, bm)


def uses_tma(family: str, arch: str, bucket: int) -> bool:
    """Whether `family` has a TMA (warp-specialised) kernel for this head-dim bucket on `arch`;
    it runs where the arrays allow TMA reads."""
    return (
        _wgmma_enabled
        and _tma_enabled
        and arch == "sm_90a"
        and bucket in _TMA_TILES.get(family, {})
    )


def uses_wgmma(family: str, arch: str, bucket: int) -> bool:
    """Whether `family` runs its Hopper (wgmma) kernel for this head-dim bucket on `arch`."""
    return _wgmma_enabled and arch == "sm_90a" and bucket in _WGMMA_TILES.get(family, {})


def all_specs(arch: str = "sm_80") -> list[KernelSpec]:
    """Every instance the library can launch on `arch`: what the compile check must cover."""
    specs = [kernel_spec("preprocess", dt, 0, arch) for dt in DTYPES]
    for family in ("forward", "dkdv", "dq"):
        for dt in DTYPES:
            specs.extend(kernel_spec(family, dt, hd, arch) for hd in HEAD_DIM_BUCKETS)
    tma = {
        tma_spec(f, dt, hd, arch, seq, False, o_via_tma)
        for f in ("forward", "dkdv", "dq")
        for dt in DTYPES
        for hd in HEAD_DIM_BUCKETS
        for seq in (0, 1 << 30)
        for o_via_tma in (True, False)  # the forward without TMA stores serves other outputs
    }
    return specs + sorted((s for s in tma if s is not None), key=lambda s: s.name_expression)


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
