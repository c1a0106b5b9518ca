"""Ring attention (cuflash.torch.ring_attention) on CPU tensors over gloo, with 2 and 3 processes:
each rank's output and gradients are its zigzag shard of single-process attention on the
gathered sequence (float64: to rounding; float32: within the policy against the float64
reference, as the single-process call is), for causal and not, grouped heads, both layouts and
odd chunk lengths; the backward is bitwise repeatable; the zigzag helpers and the errors."""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import cuflash  # noqa: E402
import cuflash.torch as cft  # noqa: E402
from cuflash import testing  # noqa: E402

# (B, chunk length, Hq, Hkv, d): odd chunks, grouped heads
SHAPES = ((2, 3, 4, 2, 8), (1, 5, 3, 1, 16))


def _full_inputs(shape, layout: str, dtype, seed: int, world_size: int):
    b, chunk, hq, hkv, d = shape
    n = 2 * world_size * chunk
    gen = torch.Generator().manual_seed(seed)

    def make(h):
        x = torch.randn(b, n, h, d, generator=gen, dtype=torch.float64)
        return (x if layout == "bshd" else x.transpose(1, 2).contiguous()).to(dtype)

    return make(hq), make(hkv), make(hkv), make(hq)


def _bhsd64(x: torch.Tensor, layout: str) -> np.ndarray:
    x = x.detach().to(torch.float64)
    return (x.transpose(1, 2) if layout == "bshd" else x).numpy()


def _check_rank(
    world_size: int, rank: int, causal: bool, layout: str, dtype, shape, seed, window=None
) -> None:
    """Ring attention on this rank's shards against the shards of the single-process call."""
    seq_dim = 1 if layout == "bshd" else 2
    q, k, v, do = _full_inputs(shape, layout, dtype, seed, world_size)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_full = cft.attention(*leaves, causal=causal, window=window, layout=layout)
    o_full.backward(do)
    full = (o_full.detach(), *(x.grad for x in leaves))

    def shard(x):
        return cft.zigzag_shard(x, world_size, rank, seq_dim)

    local = [shard(x).clone().requires_grad_() for x in (q, k, v)]
    o = cft.ring_attention(*local, causal=causal, window=window, layout=layout)
    o.backward(shard(do))
    got = (o.detach(), *(x.grad for x in local))
    names = ("o", "dq", "dk", "dv")
    if dtype == torch.float64:
        for name, g, f in zip(names, got, full, strict=True):
            torch.testing.assert_close(g, shard(f), rtol=1e-10, atol=1e-12, msg=name)
    else:  # the policy against the float64 reference, shard by shard
        q64, k64, v64, do64 = (_bhsd64(x, layout) for x in (q, k, v, do))
        kw = dict(causal=causal, scale=1 / math.sqrt(shape[4]), window=window)
        o_ref, lse_ref = testing.naive_forward(q64, k64, v64, dtype="float64", **kw)
        o_low, _ = testing.naive_forward(q64, k64, v64, dtype="float32", **kw)
        refs = [o_ref]
        lows = [o_low]
        grads_ref = testing.naive_backward(
            do64, q64, k64, v64, o_ref, lse_ref, dtype="float64", **kw
        )
        grads_low = testing.naive_backward(
            do64, q64, k64, v64, o_ref, lse_ref, dtype="float32", **kw
        )
        refs += list(grads_ref)
        lows += list(grads_low)
        for name, g, ref, low in zip(names, got, refs, lows, strict=True):
            # references back to the call's layout, then this rank's shard
            to_layout = (lambda a: a.transpose(0, 2, 1, 3)) if layout == "bshd" else (lambda a: a)
            ref_s = shard(torch.from_numpy(np.ascontiguousarray(to_layout(ref))))
            low_s = shard(torch.from_numpy(np.ascontiguousarray(to_layout(low))))
            check = testing.compare(
                name, g.to(torch.float64).numpy(), ref_s.numpy(), low_s.numpy(), "float32"
            )
            assert check.passed, f"rank {rank}: {check.message}"
    # the same inputs give the same bits
    again = [shard(x).clone().requires_grad_() for x in (q, k, v)]
    o2 = cft.ring_attention(*again, causal=causal, window=window, layout=layout)
    o2.backward(shard(do))
    assert torch.equal(o2.detach(), got[0])
    for x, g in zip(again, got[1:], strict=True):
        assert torch.equal(x.grad, g)


def _worker(rank: int, world_size: int, init_file: str, cases: list) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        for case in cases:
            _check_rank(world_size, rank, *case)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world_size: int, cases: list) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world_size, init_file, cases), nprocs=world_size, join=True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_attention_equals_attention_on_the_gathered_sequence(world_size):
    cases = []
    for causal in (False, True):
        for layout in ("bshd", "bhsd"):
            for i, shape in enumerate(SHAPES):
                cases.append((causal, layout, torch.float64, shape, 10 * world_size + i))
        cases.append((causal, "bshd", torch.float32, SHAPES[0], 7))
    # windows over the whole sequence: within a chunk, reaching into the next chunks, one-sided
    for causal, window in ((True, (4, None)), (False, (2, 3)), (False, (0, 0)), (False, (6, -1))):
        cases.append((causal, "bshd", torch.float64, SHAPES[1], 3, window))
    cases.append((False, "bhsd", torch.float64, SHAPES[0], 4, (-1, 2)))
    cases.append((True, "bshd", torch.float32, SHAPES[0], 5, (3, 0)))
    _run(world_size, cases)


def test_zigzag_shards_put_back_together():
    x = torch.arange(2 * 3 * 12 * 2).reshape(2, 12, 3, 2)  # (B, N, H, d), P = 3: chunks of 2
    shards = [cft.zigzag_shard(x, 3, r) for r in range(3)]
    assert torch.equal(shards[0][0, :, 0, 0], x[0, [0, 1, 10, 11], 0, 0])  # chunks 0 and 5
    assert torch.equal(shards[2][0, :, 0, 0], x[0, [4, 5, 6, 7], 0, 0])  # chunks 2 and 3
    assert torch.equal(cft.zigzag_unshard(shards), x)
    bhsd = x.transpose(1, 2)
    assert torch.equal(
        cft.zigzag_unshard([cft.zigzag_shard(bhsd, 3, r, 2) for r in range(3)], 2), bhsd
    )


def test_errors():
    x = torch.zeros(1, 12, 2, 4)
    with pytest.raises(ValueError, match="2 x world_size = 10 equal chunks"):
        cft.zigzag_shard(x, 5, 0)
    with pytest.raises(ValueError, match="rank must be an int in"):
        cft.zigzag_shard(x, 3, 3)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        cft.zigzag_shard(x, 0, 0)
    with pytest.raises(ValueError, match="layout must be"):
        cft.ring_attention(x, x, x, layout="sbhd")
    with pytest.raises(ValueError, match="two equal chunks"):
        cft.ring_attention(x[:, :11], x[:, :11], x[:, :11])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        cft.ring_attention(x.numpy(), x, x)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            cft.ring_attention(x, x, x)
    assert cuflash.attention is not None


def test_each_call_sees_exactly_the_global_band_on_its_pair_of_chunks():
    """_rectangle's (rows, keys, window), read with cuflash's bottom-right mask, against the band
    x - left <= y <= x + right on global positions, for every pair of chunks and many bands."""
    from cuflash._ring import _rectangle

    bounds = (None, 0, 1, 2, 3, 5, 8, 13)
    for chunk in (1, 2, 3, 5):
        for q_id in range(6):
            for k_id in range(6):
                for left in bounds:
                    for right in bounds:
                        x = q_id * chunk + np.arange(chunk)[:, None]
                        y = k_id * chunk + np.arange(chunk)[None, :]
                        want = np.ones((chunk, chunk), bool)
                        if left is not None:
                            want &= y >= x - left
                        if right is not None:
                            want &= y <= x + right
                        got = np.zeros((chunk, chunk), bool)
                        call = _rectangle(q_id, k_id, chunk, left, right)
                        if call is not None:
                            rows, keys, window = call
                            nq, nk = rows.stop - rows.start, keys.stop - keys.start
                            i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
                            seen = np.ones((nq, nk), bool)
                            wl, wr = window or (None, None)
                            if wl is not None:
                                assert wl >= 0
                                seen &= j >= i + nk - nq - wl
                            if wr is not None:
                                assert wr >= 0
                                seen &= j <= i + nk - nq + wr
                            got[rows, keys] = seen
                        assert np.array_equal(got, want), (chunk, q_id, k_id, left, right, call)
