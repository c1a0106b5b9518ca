"""cuflash.jax.attention_with_kvcache on decoding calls: the split-KV custom call against the
packed route (each sequence's keys gathered, then the packed forward), which every call took
before, and the plain API on torch tensors, in the same process. bf16, d = 128, Hq = 32, Hkv = 8,
Nq = 1, contiguous caches, jitted steps without an append; time per call from a loop of calls
(wall clock after block_until_ready, median of rounds).

    python bench/bench_jax_decode.py [--points B:KEYS ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cuflash.jax as cfj  # noqa: E402

HQ, HKV, D = 32, 8, 128


def loop_time(fn, args, reps: int = 50, rounds: int = 5) -> float:
    fn(*args)[0].block_until_ready()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        out[0].block_until_ready()
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", default=["1:8192", "8:8192", "8:32768", "64:4096"])
    args = parser.parse_args()
    key = jax.random.PRNGKey(0)
    for point in args.points:
        batch, keys = (int(x) for x in point.split(":"))
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (batch, 1, HQ, D), jnp.bfloat16)
        k = jax.random.normal(kk, (batch, keys, HKV, D), jnp.bfloat16)
        v = jax.random.normal(kv, (batch, keys, HKV, D), jnp.bfloat16)
        lens = jnp.full((batch,), keys, jnp.int32)

        def make_step():  # a new function each time: jit caches its traces per function
            def step(q, k, v, lens):
                return cfj.attention_with_kvcache(q, k, v, lens)[:2]

            return jax.jit(step)

        t_decode = loop_time(make_step(), (q, k, v, lens))
        chosen = cfj._decode_call
        cfj._decode_call = lambda *a: None  # the packed route, as before
        try:
            packed = make_step()
            t_packed = loop_time(packed, (q, k, v, lens))
            o_packed = np.asarray(packed(q, k, v, lens)[0], np.float32)
        finally:
            cfj._decode_call = chosen
        o_new = np.asarray(make_step()(q, k, v, lens)[0], np.float32)
        gap = float(np.abs(o_new - o_packed).max())
        cache_mib = 2 * k.size * 2 / 2**20
        print(
            f"B={batch} keys={keys} cache {cache_mib:.0f} MiB: split-KV {t_decode * 1e6:.1f} us, "
            f"packed route {t_packed * 1e6:.1f} us ({t_packed / t_decode:.2f}x); "
            f"largest |o difference| {gap:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
