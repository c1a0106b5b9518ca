"""Where the host time of one small call goes: per-call time and a cProfile of 1000 forward calls
(B=1, H=1, N=64, d=64, bfloat16, torch tensors)."""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuflash  # noqa: E402

q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))


def calls(n):
    for _ in range(n):
        cuflash.attention_forward(q, k, v, layout="bhsd")


calls(100)
torch.cuda.synchronize()
t = time.perf_counter()
calls(1000)
torch.cuda.synchronize()
print(f"forward: {(time.perf_counter() - t) * 1e3:.1f} us per call")
o, lse = cuflash.attention_forward(q, k, v, layout="bhsd")
for _ in range(100):  # warm-up: compiles the backward kernels and builds the plan
    cuflash.attention_backward(q, q, k, v, o, lse, layout="bhsd")
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(1000):
    cuflash.attention_backward(q, q, k, v, o, lse, layout="bhsd")
torch.cuda.synchronize()
print(f"backward: {(time.perf_counter() - t) * 1e3:.1f} us per call")
profile = cProfile.Profile()
profile.enable()
calls(1000)
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(25)
