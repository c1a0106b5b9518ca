"""The host side of the Hopper TMA kernels, on the CPU: the tensor maps' strides and address
patching (with a stand-in for the driver's encoder), the TMA instances (shared memory, threads, the
long-sequence tiles) and the forward's row slots."""

from __future__ import annotations

import ctypes
import struct

import pytest

from cuflash import _dispatch, _kernels, _tma


def test_tma_strides():
    # (d, N, H, B) = (64, 100, 8, 2), bshd contiguous: seq stride H d, head stride d
    assert _tma.tma_strides((64, 100, 8, 2), (8 * 64, 64, 100 * 8 * 64), 2) == (1024, 128, 102400)
    # dimensions of length 1 get a packed stride whatever theirs is (2-D input: 0)
    assert _tma.tma_strides((64, 100, 1, 1), (64, 0, 0), 2) == (128, 12800, 12800)
    # strides the TMA unit cannot read: not a multiple of 16 bytes, zero, negative
    assert _tma.tma_strides((64, 100, 8, 2), (8 * 64 + 1, 64, 100 * 8 * 64), 2) is None
    assert _tma.tma_strides((64, 100, 8, 2), (8 * 64, 0, 100 * 8 * 64), 2) is None
    assert _tma.tma_strides((64, 100, 8, 2), (-512, 64, 100 * 8 * 64), 2) is None


def _fake_encoder(shift: int):
    """A stand-in for cuTensorMapEncodeTiled that stores the address (>> shift) at byte 8 and the
    box and dims elsewhere."""

    def encode(out, dtype, rank, address, dims, strides, box, elem_strides, *rest):
        blob = bytearray(128)
        blob[0:8] = (0xC0FFEE).to_bytes(8, "little")
        blob[8:16] = (address >> shift).to_bytes(8, "little")
        blob[16:48] = struct.pack("4Q", *(dims[i] for i in range(4)))
        blob[48:72] = struct.pack("3Q", *(strides[i] for i in range(3)))
        blob[72:88] = struct.pack("4I", *(box[i] for i in range(4)))
        ctypes.memmove(out, bytes(blob), 128)
        return 0

    return encode


@pytest.mark.parametrize("shift", [0, 4])
def test_tile_map_patches_the_address_only_where_it_found_the_field(monkeypatch, shift):
    calls = []
    fake = _fake_encoder(shift)

    def counting(*args):
        calls.append(args[3])
        return fake(*args)

    monkeypatch.setattr(_tma, "_encode_fn", counting)
    tile_map = _tma.TileMap((64, 100, 8, 2), (1024, 128, 102400), 128, 0x7F0000000000)
    made = len(calls)
    for address in (0x7F0000123450, 0x7E0000000010, 0x7E0000000010, 0x7F0000000000):
        want = bytearray(128)
        fake(
            ctypes.addressof((ctypes.c_uint8 * 128).from_buffer(want)),
            0,
            4,
            address,
            tile_map._dims,
            tile_map._strides,
            tile_map._box,
            tile_map._elem_strides,
        )
        assert tile_map.bytes_for(address) == bytes(want)
    if shift == 0:  # a plain 64-bit field: patched, the driver is not called again
        assert tile_map._split is not None and len(calls) == made
    else:  # not a plain field: every new address is encoded (a repeated one is remembered)
        assert tile_map._split is None and len(calls) == made + 3


def test_tile_map_reports_a_refusal(monkeypatch):
    monkeypatch.setattr(_tma, "_encode_fn", lambda *args: 1)  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(_tma.TensorMapError, match="CUresult 1"):
        _tma.TileMap((64, 100, 8, 2), (1024, 128, 102400), 128, 0x7F0000000000)


def test_tma_instances():
    limit = 227 * 1024  # the sm_90 opt-in shared memory per block
    for family in ("forward", "dq", "dkdv"):
        for dtype in _kernels.DTYPES:
            for d in (1, 40, 64, 100, 128, 200, 232, 256):
                bucket = _kernels.head_dim_bucket(d)
                has_tma = "tma" in _kernels.paths(family, dtype, d, "sm_90a")
                assert has_tma == (
                    dtype in _kernels.TENSOR_CORE_DTYPES and bucket in (64, 128, 256)
                )
                assert "tma" not in _kernels.paths(family, dtype, d, "sm_80")
                if not has_tma:
                    continue
                for seq in (64, 1 << 20):
                    tiles = _kernels.default_tiles(family, "tma", dtype, d, seq)
                    spec = _kernels.instance(family, "tma", dtype, d, tiles)
                    assert spec.source.endswith("_tma.cu") and spec.head_dim == bucket
                    assert spec.smem_bytes <= limit, spec
                    # one producer warpgroup and consumer warpgroups of 64 query rows (keys for
                    # dkdv; at 256 two warpgroups share 64 keys and split the head dim)
                    split = family == "dkdv" and bucket == 256
                    consumers = 2 if split else spec.rows_per_block // 64
                    assert spec.threads == (consumers + 1) * 128, spec
    # long sequences at d = 64 take taller query tiles in the forward, from 1024 rows
    assert _kernels.default_tiles("forward", "tma", "bfloat16", 64, 1023) == (128, 128, 2)
    long_tiles = _kernels.default_tiles("forward", "tma", "bfloat16", 64, 1024)
    assert long_tiles == (192, 128, 2)
    # ... but not under a window of at most 512 keys a row
    local = _kernels.FEATURE_LOCAL
    for keys, tiles in ((256, (128, 128, 2)), (512, (128, 128, 2)), (513, (192, 128, 2))):
        assert _kernels.default_tiles("forward", "tma", "bfloat16", 64, 8192, local, keys) == tiles
    # ... and at d = 128 longer key tiles from 4096 rows, dense or with the softcap only, with O
    # from registers (no room for the staging tile)
    for features in (0, _kernels.FEATURE_SOFTCAP):
        tiles = [
            _kernels.default_tiles("forward", "tma", "bfloat16", 128, n, features)
            for n in (4095, 4096)
        ]
        assert tiles == [(128, 128, 2), (128, 160, 2)]
    # ... and at d = 256 80-key tiles at every length, dense or with the softcap or ALiBi alone
    sets = ((0, (128, 80, 2)), (2, (128, 80, 2)), (4, (128, 80, 2)), (6, (128, 64, 2)))
    for features, tiles in (*sets, (1, (128, 64, 2))):
        assert _kernels.default_tiles("forward", "tma", "bfloat16", 256, 100, features) == tiles
    assert _kernels.default_tiles("forward", "tma", "float16", 128, 8192, 1) == (128, 128, 2)
    assert _kernels.default_tiles("forward", "tma", "float16", 128, 8192, 10) == (128, 128, 2)
    assert not _kernels.o_staging_fits(128, (128, 160, 2))
    assert _kernels.o_staging_fits(128, (128, 128, 2))
    assert _kernels.o_staging_fits(64, (192, 128, 2))
    assert not _kernels.o_staging_fits(256, (128, 64, 2))
    # the compile check builds every TMA instance the dispatch can launch, and no other
    names = {s.name_expression for s in _kernels.all_specs("sm_90a")}
    for d in (64, 128):
        for seq in (1024, 4096):
            tiles = _kernels.default_tiles("forward", "tma", "bfloat16", d, seq)
            for o_via_tma in (False, True):
                if o_via_tma and not _kernels.o_staging_fits(d, tiles):
                    continue
                spec = _kernels.instance("forward", "tma", "bfloat16", d, tiles, 0, o_via_tma)
                assert spec.name_expression in names
    staged = _kernels.instance("forward", "tma", "bfloat16", 128, (128, 160, 2), 0, True)
    assert staged.name_expression not in names and staged.smem_bytes > _kernels.SM90_MAX_SMEM


def _template_args(spec: _kernels.KernelSpec) -> list[str]:
    name = spec.name_expression
    return name[name.index("<") + 1 : -1].split(", ")


def _loop(spec: _kernels.KernelSpec) -> str:
    return str(_kernels.FORWARD_SCHEDULES.index(spec.schedule))


def test_fp8_forward_loops():
    # The FP8 forward at d = 128 and 256 takes turns at the tensor cores without the pipelining
    # (serial_turns: 1.04-1.21x the serial loop on the H200, docs/perf/NOTES.md v49), its 256-key
    # tiles included, where the pipelined loops spill; d = 64 keeps three consumers with turns,
    # and (128, 256) serial with a window.
    fp8 = _kernels.FP8_DTYPE

    def spec(d: int, features: int = 0) -> _kernels.KernelSpec:
        return _kernels.instance("forward", "tma", fp8, d, None, features)

    for d in (128, 256):
        for features in _kernels.FP8_FEATURE_SETS:
            assert spec(d, features).schedule == "serial_turns"
            assert _template_args(spec(d, features))[6] == "3"
    assert spec(64).schedule == "turns"
    assert spec(64, _kernels.FEATURE_LOCAL).schedule == "serial"


def test_forward_schedules():
    # The TMA forward's key-tile loop: pipelined with turns at the tensor cores where a consumer's
    # registers hold O, S and the P fragments at once (not three consumers at d = 64 with BN =
    # 128: they spilled); a choice can ask for any loop, and the SCHEDULE template argument
    # follows it.
    def schedule(d: int, tiles: tuple) -> str:
        return _kernels.instance("forward", "tma", "bfloat16", d, tiles, 0).schedule

    assert schedule(64, (128, 128, 2)) == schedule(128, (128, 128, 2)) == "turns"
    assert schedule(64, (192, 128, 2)) == "serial"
    assert schedule(64, (192, 64, 2)) == "turns"
    assert schedule(256, (128, 64, 2)) == "turns"
    assert schedule(128, (128, 160, 2)) == "turns"  # no spill (docs/perf/NOTES.md, v26)
    assert schedule(128, (128, 176, 2)) == "serial"
    assert schedule(256, (128, 80, 2)) == "turns"
    for loop in _kernels.FORWARD_SCHEDULES:
        spec = _kernels.instance("forward", "tma", "float16", 128, None, 0, False, loop)
        assert spec.schedule == loop and _template_args(spec)[6] == _loop(spec)
    with pytest.raises(ValueError, match="schedule must be one of"):
        _kernels.instance("forward", "tma", "float16", 128, None, 0, False, "pingpong")
    with pytest.raises(ValueError, match="only the TMA forward"):
        _kernels.instance("forward", "wgmma", "float16", 128, None, 0, False, "serial")
    with pytest.raises(ValueError, match="only the TMA forward"):
        _kernels.instance("dq", "tma", "float16", 128, None, 0, False, "serial")


def _slot_rows(seq_q: int, bm: int, end_aligned: bool) -> list[range]:
    """The query rows of each non-empty slot of the TMA forward's work list, as the kernel
    computes them from row_slots (kernels_cu/forward_sm90_tma.cu)."""
    slots, shift = _dispatch.row_slots(seq_q, bm, end_aligned)
    rows = []
    for b in range(slots):
        m0 = b * bm - shift
        if m0 + bm <= 0:  # empty slot: the kernel skips it
            continue
        rows.append(range(max(m0, 0), min(m0 + bm, seq_q)))
    return rows


def _causal_key_tiles(block_rows: range, bn: int) -> int:
    """Key tiles a causal row block runs (Nq == Nk): up to the one holding its last row."""
    return -(-block_rows.stop // bn)


@pytest.mark.parametrize("end_aligned", [False, True])
def test_row_slots_cover_every_query_row_once(end_aligned):
    for bm in (64, 128, 192):
        for seq_q in (1, 63, 64, 100, 191, 192, 193, 384, 1000, 2048, 4096, 8192):
            slots, shift = _dispatch.row_slots(seq_q, bm, end_aligned)
            rows = _slot_rows(seq_q, bm, end_aligned)
            covered = [i for r in rows for i in r]
            assert covered == list(range(seq_q)), (bm, seq_q)
            assert all(len(r) > 0 for r in rows)
            assert 0 <= shift < 2 * bm
            if end_aligned:
                # pairs of slots (decode_paired_work) never straddle two heads, and only the first
                # block (the one that sees the fewest keys) is partial
                assert slots % 2 == 0
                assert all(len(r) == bm for r in rows[1:])
            else:
                assert (slots, shift) == (-(-seq_q // bm), 0)
                assert all(len(r) == bm for r in rows[:-1])


def test_end_aligned_causal_blocks_run_fewer_key_tiles():
    # N = 4096 with 192-row blocks: start-aligned, the last block holds 64 rows but runs all 32
    # key tiles; end-aligned, the partial block runs one: 363 tiles where 341.5 are useful
    # (docs/perf/NOTES.md, v8).
    def tiles(seq_q, end_aligned):
        return sum(_causal_key_tiles(r, 128) for r in _slot_rows(seq_q, 192, end_aligned))

    assert tiles(4096, False) == 384 and tiles(4096, True) == 363
    for seq_q in (100, 1000, 2048, 8192, 16384, 5000):
        assert tiles(seq_q, True) <= tiles(seq_q, False)
    # no partial block: the same blocks either way
    assert tiles(3840, True) == tiles(3840, False)


def test_forward_stages_o_only_where_shared_memory_has_room():
    # An O staging tile (BM rows) fits beside Q and the K/V stages up to head dim 128; the
    # instances without it serve o_store="registers" and head dims below their bucket, and the
    # compile check builds both (kernels_cu/forward_sm90_tma.cu).
    limit = 227 * 1024  # sm_90's opt-in shared memory per block
    for dtype in _kernels.TENSOR_CORE_DTYPES:
        for d, seq in ((64, 1024), (64, 8192), (128, 1024)):
            tiles = _kernels.default_tiles("forward", "tma", dtype, d, seq)
            staged = _kernels.instance("forward", "tma", dtype, d, tiles, 0, True)
            direct = _kernels.instance("forward", "tma", dtype, d, tiles, 0, False)
            assert staged.o_via_tma and not direct.o_via_tma
            # template arguments: Elem, HD, BM, BN, STAGES, O_VIA_TMA, SCHEDULE, FEATURES
            assert _template_args(staged)[5:] == ["1", _loop(staged), "0"]
            assert _template_args(direct)[5:] == ["0", _loop(direct), "0"]
            assert staged.smem_bytes == direct.smem_bytes + staged.rows_per_block * d * 2 <= limit
    with pytest.raises(ValueError, match="TMA store"):
        _kernels.instance("forward", "tma", "bfloat16", 256, None, 0, True)
    with pytest.raises(ValueError, match="TMA store"):
        _kernels.instance("dq", "tma", "bfloat16", 128, None, 0, True)
