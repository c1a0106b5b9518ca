"""Experiment: can cuflash.jax's custom calls be recorded into XLA's CUDA graphs (command
buffers)? buffer_callback(command_buffer_compatible=True) runs the Python callback once while XLA
traces a command buffer and replays the recorded launches afterwards. This script swaps that
variant into cuflash.jax (here only, never in the package), then

  1. checks that a jitted loop whose every step changes the inputs gives the same bits as the
     plain variant (a replay with stale pointers or stale parameters would not), and
  2. times a jitted call from Python and a jitted fori_loop of 1000 calls, both variants, with
     the XLA flags that enable command buffers for custom calls.

Usage: python bench/jax_command_buffer.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
    "--xla_gpu_graph_min_graph_size=1",
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import buffer_callback as bc  # noqa: E402

import cuflash.jax as cfj  # noqa: E402

STAGES: list = []


def use_variant(command_buffer: bool) -> None:
    """Rebinds cuflash.jax's buffer_callback (and drops its cached operations)."""
    plain = bc.buffer_callback

    def recording(callback, results, **kw):
        def traced(ctx, *args):
            STAGES.append(str(ctx.stage))
            return callback(ctx, *args)

        return plain(traced, results, command_buffer_compatible=command_buffer, **kw)

    cfj.buffer_callback = recording
    cfj._forward_op.cache_clear()
    cfj._backward_op.cache_clear()


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def run(command_buffer: bool) -> dict:
    use_variant(command_buffer)
    STAGES.clear()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 64, 1, 64)), jnp.bfloat16)
    big = jnp.asarray(rng.standard_normal((2, 512, 4, 64)), jnp.bfloat16)

    def step(i, q):
        return (cfj.attention(q, big, big, causal=True) * 2).astype(q.dtype) + q * 0.5

    loop = jax.jit(lambda q: jax.lax.fori_loop(0, 20, step, q))
    results = [np.asarray(loop(big * s).astype(jnp.float32)) for s in (1.0, 0.5, 2.0)]
    grad = jax.jit(jax.grad(lambda q: cfj.attention(q, big, big).astype(jnp.float32).sum()))
    grads = [np.asarray(grad(big * s).astype(jnp.float32)) for s in (1.0, 0.25)]

    one = jax.jit(lambda q: cfj.attention(q, q, q))
    one(q).block_until_ready()
    call_us = median_us(lambda: one(q), 300)
    loop1000 = jax.jit(lambda q: jax.lax.fori_loop(0, 1000, lambda i, x: cfj.attention(x, q, q), q))
    loop1000(q).block_until_ready()
    loop_us = median_us(lambda: loop1000(q), 10) / 1000
    return {
        "command_buffer": command_buffer,
        "stages": sorted(set(STAGES)),
        "callbacks_run": len(STAGES),
        "call_us": call_us,
        "fori_loop_us_per_call": loop_us,
        "_results": results + grads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for variant in (False, True):
        try:
            rows.append(run(variant))
        except Exception as exc:  # the experiment reports, it does not stop the device run
            rows.append({"command_buffer": variant, "error": f"{type(exc).__name__}: {exc}"})
    same = None
    if all("_results" in r for r in rows):
        same = all(
            np.array_equal(a, b)
            for a, b in zip(rows[0]["_results"], rows[1]["_results"], strict=True)
        )
    for r in rows:
        r.pop("_results", None)
    report = {"xla_flags": os.environ["XLA_FLAGS"], "bitwise_equal": same, "rows": rows}
    lines = [f"command buffers: variants bitwise equal = {same}"]
    for r in rows:
        lines.append(json.dumps(r))
    text = "\n".join(lines)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "jax_command_buffer.json"), "w") as f:
            json.dump(report, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
