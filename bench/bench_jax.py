"""cuflash.jax inside jax.jit against jax.nn.dot_product_attention: host overhead and training.

    python bench/bench_jax.py [--quick] [--out DIR] [--steps 20] [--heads-kv 4]

(a) Host overhead on a tiny problem (B=1, N=64, H=1, d=64, bfloat16; float32 where the platform
    cannot run bfloat16), forward and forward+backward: the time of one jitted call from Python
    (call + block_until_ready, median of many), and the time per call inside one jitted
    jax.lax.fori_loop of 1000 calls, each call's output feeding the next call's q (forward: q =
    o; forward+backward: q, k, v take a small gradient step), so XLA can neither hoist nor drop
    a call. Peers: cuflash.jax.attention and jax.nn.dot_product_attention with
    implementation="cudnn" and "xla" (an implementation that raises on this platform is listed
    with its error).
(b) A jitted training step (forward, jax.value_and_grad, Adam) of the transformer of
    tests/test_jax_training.py (imported from there by path: the test and the benchmark time the
    same model code; that module needs pytest), at B=4, N=2048, d_model=2048, Hq=16, Hkv=4,
    d=128, 4 layers, bfloat16 matmuls and attention (float32 master weights): the median time
    per step after warm-up, with cuflash and with cuDNN's attention; and the attention alone at
    that size (forward, and forward+backward as one jax.vjp), so that the kernels' ratio can be
    set beside the training step's. The step runs the attention's forward and backward once
    per layer, so "predicted" in the table is the step's difference if only the attention's
    forward+backward time changed: layers x (cuflash - peer).

--quick: fewer repetitions, and a tiny model (B=4, N=64, d_model=64, 2 layers) with the "xla"
implementation as the peer of (b), so that the script runs end to end on a CPU.

Times are wall-clock medians in microseconds. Writes jax_bench.json and jax_table.txt to --out
and prints the table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.jax as cfj  # noqa: E402

PEERS = ("cuflash", "cudnn", "xla")


def load_training_module() -> Any:
    """tests/test_jax_training.py as a module (Config, train_step, initial_state, ...)."""
    path = ROOT / "tests" / "test_jax_training.py"
    spec = importlib.util.spec_from_file_location("cuflash_jax_training", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def attention_fn(peer: str, causal: bool) -> Callable:
    if peer == "cuflash":
        return lambda q, k, v: cfj.attention(q, k, v, causal=causal)
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=peer
    )


def error_note(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 160 else text[:157] + "..."


def median_us(run: Callable[[], Any], reps: int, inner: int = 1) -> float:
    """Median over `reps` of the wall time of `inner` back-to-back calls of `run` followed by
    one block_until_ready, per call, in microseconds."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = run()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return 1e6 * statistics.median(times)


# ---------------------------------------------------------------------------------------------
# (a) host overhead


def overhead_fns(peer: str, loop: int) -> dict[str, tuple[Callable, Callable]]:
    """(one call, `loop` calls in a fori_loop) for the forward and forward+backward."""
    attend = attention_fn(peer, causal=False)

    def fwd_loop(q, k, v):
        return jax.lax.fori_loop(0, loop, lambda i, q: attend(q, k, v), q)

    def fwdbwd(q, k, v, do):
        _, vjp = jax.vjp(attend, q, k, v)
        return vjp(do)

    def fwdbwd_loop(q, k, v, do):
        def body(i, qkv):
            grads = fwdbwd(*qkv, do)
            return tuple((x - 1e-3 * g).astype(x.dtype) for x, g in zip(qkv, grads, strict=True))

        return jax.lax.fori_loop(0, loop, body, (q, k, v))

    return {
        "fwd": (
            jax.jit(lambda q, k, v, do: attend(q, k, v)),
            jax.jit(lambda q, k, v, do: fwd_loop(q, k, v)),
        ),
        "fwd+bwd": (jax.jit(fwdbwd), jax.jit(fwdbwd_loop)),
    }


def pick_dtype() -> str:
    """bfloat16 where the platform runs a bfloat16 attention, else float32."""
    try:
        x = jnp.ones((1, 8, 1, 8), jnp.bfloat16)
        jax.block_until_ready(jax.jit(attention_fn("xla", False))(x, x, x))
        return "bfloat16"
    except Exception:  # noqa: BLE001 - any failure means: use float32
        return "float32"


def bench_overhead(args: argparse.Namespace) -> dict:
    dtype = pick_dtype()
    shape = (1, 64, 1, 64)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
    loop = args.loop
    rows: dict = {}
    for peer in PEERS:
        for which, (one, looped) in overhead_fns(peer, loop).items():
            row = rows.setdefault(which, {}).setdefault(peer, {})
            try:
                jax.block_until_ready(one(q, k, v, do))
                jax.block_until_ready(looped(q, k, v, do))
            except Exception as exc:  # noqa: BLE001 - e.g. cudnn on a CPU
                row["error"] = error_note(exc)
                continue
            row["call_us"] = median_us(lambda: one(q, k, v, do), args.calls)
            row["loop_us"] = median_us(lambda: looped(q, k, v, do), args.loop_reps) / loop
    return {
        "problem": {"B": 1, "N": 64, "H": 1, "d": 64, "dtype": dtype},
        "loop": loop,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------
# (b) training step and the attention alone at its size


def bench_training(args: argparse.Namespace, training: Any) -> dict:
    if args.quick:
        cfg = training.Config(compute_dtype=pick_dtype())
        peer = "xla"
    else:
        cfg = training.Config(
            vocab=args.vocab,
            d_model=args.d_model,
            layers=args.layers,
            heads_q=args.heads_q,
            heads_kv=args.heads_kv,
            seq=args.seq,
            batch=args.batch,
            compute_dtype="bfloat16",
        )
        peer = args.peer
    result: dict = {"config": {**cfg._asdict(), "head_dim": cfg.head_dim}, "peer": peer}
    result["step_us"], result["attention"], result["errors"] = {}, {}, {}
    state = training.initial_state(cfg, 0)
    for name in ("cuflash", peer):
        step = jax.jit(
            lambda p, o, t, name=name: training.train_step(
                p, o, t, cfg=cfg, attention=attention_fn(name, causal=True)
            ),
            donate_argnums=(0, 1),
        )
        params, opt, tokens = jax.tree.map(jnp.copy, state)
        try:
            for _ in range(args.warmup):
                params, opt, loss = step(params, opt, tokens)
            jax.block_until_ready(loss)
        except Exception as exc:  # noqa: BLE001
            result["errors"][name] = error_note(exc)
            continue
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            params, opt, loss = step(params, opt, tokens)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        result["step_us"][name] = 1e6 * statistics.median(times)
        result.setdefault("final_loss", {})[name] = float(loss)
        del params, opt

    # the attention alone: q (B, N, Hq, d), k/v (B, N, Hkv, d) of the compute dtype
    dt = cfg.compute_dtype
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    shapes = [(cfg.batch, cfg.seq, h, cfg.head_dim) for h in (cfg.heads_q, cfg.heads_kv)]
    q = jax.random.normal(keys[0], shapes[0], jnp.float32).astype(dt)
    k, v = (jax.random.normal(key, shapes[1], jnp.float32).astype(dt) for key in keys[1:3])
    do = jax.random.normal(keys[3], shapes[0], jnp.float32).astype(dt)
    for name in ("cuflash", peer):
        attend = attention_fn(name, causal=True)
        fwd = jax.jit(attend)
        fwdbwd = jax.jit(lambda q, k, v, do, attend=attend: jax.vjp(attend, q, k, v)[1](do))
        row = result["attention"][name] = {}
        try:
            jax.block_until_ready(fwd(q, k, v))
            jax.block_until_ready(fwdbwd(q, k, v, do))
        except Exception as exc:  # noqa: BLE001
            row["error"] = error_note(exc)
            continue
        row["fwd_us"] = median_us(lambda: fwd(q, k, v), args.kernel_reps, args.kernel_inner)
        row["fwdbwd_us"] = median_us(
            lambda: fwdbwd(q, k, v, do), args.kernel_reps, args.kernel_inner
        )
    return result


# ---------------------------------------------------------------------------------------------
# Report


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def us(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def table(report: dict) -> str:
    lines = []
    env = report["environment"]
    lines.append(
        f"cuflash.jax benchmark: jax {env['jax']}, jaxlib {env['jaxlib']}, "
        f"{env['platform']} device {env['device']}, XLA_FLAGS={env.get('xla_flags', '')!r}"
    )
    ov = report["overhead"]
    p = ov["problem"]
    lines.append("")
    lines.append(
        f"(a) host overhead, B={p['B']} N={p['N']} H={p['H']} d={p['d']} {p['dtype']}, "
        f"us per call: one jitted call from Python (call + block_until_ready), and inside one "
        f"jitted fori_loop of {ov['loop']} calls"
    )
    lines.append(
        f"{'pass':8s} {'peer':8s} {'jit call':>10s} {'in loop':>10s} {'cuflash/peer call':>18s} "
        f"{'cuflash/peer loop':>18s}"
    )
    for which, peers in ov["rows"].items():
        base = peers.get("cuflash", {})
        for peer, row in peers.items():
            if "error" in row:
                lines.append(f"{which:8s} {peer:8s} skipped: {row['error']}")
                continue
            lines.append(
                f"{which:8s} {peer:8s} {us(row['call_us']):>10s} {us(row['loop_us']):>10s} "
                f"{ratio(base.get('call_us'), row['call_us']):>18s} "
                f"{ratio(base.get('loop_us'), row['loop_us']):>18s}"
            )
    tr = report["training"]
    c = tr["config"]
    peer = tr["peer"]
    lines.append("")
    lines.append(
        f"(b) training step (forward + value_and_grad + Adam, jitted), B={c['batch']} "
        f"N={c['seq']} d_model={c['d_model']} Hq={c['heads_q']} Hkv={c['heads_kv']} "
        f"d={c['head_dim']} layers={c['layers']} vocab={c['vocab']} {c['compute_dtype']}; "
        f"peer {peer}"
    )
    for name, err in tr["errors"].items():
        lines.append(f"  {name}: step skipped: {err}")
    att = tr["attention"]
    lines.append(f"{'':22s} {'cuflash us':>12s} {peer + ' us':>12s} {'cuflash/' + peer:>14s}")
    s_cf, s_peer = tr["step_us"].get("cuflash"), tr["step_us"].get(peer)
    lines.append(
        f"{'training step':22s} {us(s_cf):>12s} {us(s_peer):>12s} {ratio(s_cf, s_peer):>14s}"
    )
    for key, label in (("fwd_us", "attention fwd"), ("fwdbwd_us", "attention fwd+bwd")):
        a, b = att.get("cuflash", {}).get(key), att.get(peer, {}).get(key)
        lines.append(f"{label:22s} {us(a):>12s} {us(b):>12s} {ratio(a, b):>14s}")
    for name, row in att.items():
        if "error" in row:
            lines.append(f"  {name}: attention skipped: {row['error']}")
    pred = tr.get("predicted_step_diff_us")
    share = tr.get("attention_share_of_peer_step")
    if pred is not None and share is not None and s_cf is not None:
        lines.append(
            f"step difference cuflash - {peer}: measured {us(s_cf - s_peer)} us, predicted from "
            f"the attention's fwd+bwd x {c['layers']} layers {us(pred)} us; attention share of "
            f"the {peer} step {100 * share:.1f}%"
        )
    return "\n".join(lines)


def environment() -> dict:
    import jaxlib

    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None) or jaxlib.version.__version__,
        "cuflash": getattr(cuflash, "__version__", None),
        "platform": dev.platform,
        "device": getattr(dev, "device_kind", str(dev)),
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions (CPU)")
    ap.add_argument("--out", help="directory for jax_bench.json and jax_table.txt")
    ap.add_argument("--calls", type=int, default=None, help="(a) timed jitted calls")
    ap.add_argument("--loop", type=int, default=1000, help="(a) calls inside the fori_loop")
    ap.add_argument("--loop-reps", type=int, default=None, help="(a) timed loops")
    ap.add_argument("--steps", type=int, default=20, help="(b) timed training steps")
    ap.add_argument("--warmup", type=int, default=3, help="(b) untimed steps first")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads-q", type=int, default=16)
    ap.add_argument("--heads-kv", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--peer", default="cudnn", choices=("cudnn", "xla"), help="(b) peer")
    args = ap.parse_args(argv)
    if args.calls is None:
        args.calls = 50 if args.quick else 300
    if args.loop_reps is None:
        args.loop_reps = 3 if args.quick else 7
    if args.quick:
        args.steps = min(args.steps, 5)
        args.warmup = min(args.warmup, 2)
        args.kernel_reps, args.kernel_inner = 5, 2
    else:
        args.kernel_reps, args.kernel_inner = 15, 10

    training = load_training_module()
    report = {"environment": environment(), "args": vars(args)}
    report["environment"]["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    report["overhead"] = bench_overhead(args)
    tr = report["training"] = bench_training(args, training)
    peer = tr["peer"]
    att_cf = tr["attention"].get("cuflash", {}).get("fwdbwd_us")
    att_peer = tr["attention"].get(peer, {}).get("fwdbwd_us")
    if att_cf is not None and att_peer is not None:
        layers = tr["config"]["layers"]
        tr["predicted_step_diff_us"] = layers * (att_cf - att_peer)
        if peer in tr["step_us"]:
            tr["attention_share_of_peer_step"] = layers * att_peer / tr["step_us"][peer]
    text = table(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "jax_bench.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "jax_table.txt").write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
