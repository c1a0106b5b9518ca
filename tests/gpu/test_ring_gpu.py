"""Ring attention over NCCL on 2 or more GPUs (one process per GPU): each rank's output and
gradients are its zigzag shard of single-GPU cuflash on the gathered sequence, bf16, d = 128,
causal and not, grouped heads, within the policy against the float64 reference as the
single-GPU call is; deterministic. Skips with fewer than two GPUs."""

from __future__ import annotations

import math
import os
import tempfile

import pytest

from cuflash import testing

pytestmark = pytest.mark.gpu
if testing.gpu_unavailable_reason():
    pytest.skip(f"GPU test: {testing.gpu_unavailable_reason()}", allow_module_level=True)
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
    pytest.skip("ring attention over NCCL needs two GPUs or more", allow_module_level=True)

import cuflash.torch as cft  # noqa: E402


def _check_rank(world: int, rank: int, causal: bool, seed: int) -> None:
    cupy = __import__("cupy")
    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(seed)
    b, n, hq, hkv, d = 1, 2 * world * 384, 16, 4, 128

    def make(h):
        return torch.randn(b, n, h, d, generator=gen, device=device).to(torch.bfloat16)

    q, k, v, do = make(hq), make(hkv), make(hkv), make(hq)

    def shard(x):
        return cft.zigzag_shard(x, world, rank)

    local = [shard(x).contiguous().requires_grad_() for x in (q, k, v)]
    o = cft.ring_attention(*local, causal=causal)
    o.backward(shard(do).contiguous())
    got = (o.detach(), *(x.grad for x in local))
    again = [shard(x).contiguous().requires_grad_() for x in (q, k, v)]
    o2 = cft.ring_attention(*again, causal=causal)
    o2.backward(shard(do).contiguous())
    assert torch.equal(o2.detach(), got[0])
    for x, g in zip(again, got[1:], strict=True):
        assert torch.equal(x.grad, g)

    def bhsd64(x):
        return cupy.from_dlpack(x.detach().to(torch.float64).transpose(1, 2).contiguous())

    kw = dict(causal=causal, scale=1 / math.sqrt(d), xp=cupy)
    q64, k64, v64, do64 = (bhsd64(x) for x in (q, k, v, do))
    o_ref, lse_ref = testing.naive_forward(q64, k64, v64, dtype="float64", **kw)
    o_low, _ = testing.naive_forward(q64, k64, v64, dtype="bfloat16", **kw)
    args = (do64, q64, k64, v64, o_ref, lse_ref)
    refs = (o_ref, *testing.naive_backward(*args, dtype="float64", **kw))
    lows = (o_low, *testing.naive_backward(*args, dtype="bfloat16", **kw))
    for name, g, ref, low in zip(("o", "dq", "dk", "dv"), got, refs, lows, strict=True):
        ref_s = shard(torch.from_dlpack(ref).transpose(1, 2))
        low_s = shard(torch.from_dlpack(low).transpose(1, 2))
        check = testing.compare(name, bhsd64(g), bhsd64(ref_s), bhsd64(low_s), "bfloat16", cupy)
        assert check.passed, f"rank {rank}: {check.message}"


def _worker(rank: int, world: int, init_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for seed, causal in enumerate((False, True)):
            _check_rank(world, rank, causal, seed)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ring_attention_over_nccl_equals_single_gpu_attention():
    import torch.multiprocessing as mp

    world = min(torch.cuda.device_count(), 4)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init")), nprocs=world, join=True)
