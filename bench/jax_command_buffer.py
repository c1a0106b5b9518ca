"""Experiment: are cuflash.jax's custom calls recorded into XLA's CUDA graphs (command buffers)?

cuflash.jax declares its custom calls command-buffer compatible (buffer_callback's
command_buffer_compatible=True): where XLA builds command buffers for custom calls, the Python
callback runs while XLA captures the graph and its launches are replayed afterwards. This script
runs both declarations (swapping cuflash.jax._custom_call, here only), counts how often the
callback runs, and

  1. checks that a jitted loop and a gradient, called on several different inputs, give the same
     bits either way (a replay with stale pointers or parameters would not), and
  2. times a jitted call from Python and a jitted fori_loop of 1000 calls.

Usage: python bench/jax_command_buffer.py [--graph-flags] [--out DIR]
  --graph-flags   XLA_FLAGS that enable command buffers for custom calls (otherwise XLA's defaults)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# XLA reads its flags when the backend starts: set them before JAX is imported.
GRAPH_FLAGS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
    "--xla_gpu_graph_min_graph_size=1"
)
if "--graph-flags" in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + GRAPH_FLAGS).strip()

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

    cfj._custom_call = lambda callback, results: recording(callback, results)
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
    parser.add_argument(
        "--graph-flags",
        action="store_true",
        help="run with XLA_FLAGS that put custom calls into command buffers (default: XLA's own)",
    )
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
    flags = os.environ.get("XLA_FLAGS", "")
    report = {"xla_flags": flags, "bitwise_equal": same, "rows": rows}
    lines = [f"XLA_FLAGS={flags!r}: variants bitwise equal = {same}"]
    for r in rows:
        lines.append(json.dumps(r))
    text = "\n".join(lines)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = (
            "jax_command_buffer_graph_flags.json" if args.graph_flags else "jax_command_buffer.json"
        )
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(report, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
