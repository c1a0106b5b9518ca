"""Training with cuflash.jax.attention inside one jitted step: a small transformer's loss curve
with cuflash's attention against the same run with jax.nn.dot_product_attention.

The model, the loss and the optimiser are module-level functions (Config, init_params, forward,
loss_fn, make_train_step, train) so that bench/bench_jax.py times the same step at a realistic
size. The model: token and position embeddings, pre-norm (RMSNorm) blocks of causal self-attention
with grouped key/value heads and a GELU MLP, a final norm and an output projection; next-token
cross-entropy on one fixed batch of random tokens (the model memorises it, so the loss falls
steeply and the attention matters); a hand-written Adam. jax.jit covers the whole step,
jax.value_and_grad included. Parameters and optimiser state stay float32; the matmuls and the
attention run in Config.compute_dtype (float32 on the CPU test, bfloat16 on the GPU test).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import cuflash.jax as cfj  # noqa: E402

Attention = Callable[[Any, Any, Any], Any]  # (q, k, v) (B, N, H, d) -> o, causal


class Config(NamedTuple):
    vocab: int = 128
    d_model: int = 64
    layers: int = 2
    heads_q: int = 4
    heads_kv: int = 2
    seq: int = 64
    batch: int = 4
    mlp_ratio: int = 4
    compute_dtype: str = "float32"
    lr: float = 1e-3

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads_q


# ---------------------------------------------------------------------------------------------
# The attention functions compared: same signature, causal, (B, N, H, d) in and out.


def jax_attention(implementation: str | None = None) -> Attention:
    """jax.nn.dot_product_attention (which takes grouped heads itself: Hq % Hkv == 0)."""

    def attend(q: Any, k: Any, v: Any) -> Any:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    return attend


def cuflash_attention(scale: float | None = None) -> Attention:
    """cuflash.jax.attention; `scale` None is 1/sqrt(d), as jax.nn.dot_product_attention's."""

    def attend(q: Any, k: Any, v: Any) -> Any:
        return cfj.attention(q, k, v, causal=True, scale=scale)

    return attend


# ---------------------------------------------------------------------------------------------
# The model.


def init_params(key: Any, cfg: Config) -> dict:
    """float32 parameters: embeddings of unit variance, projections 1/sqrt(fan_in) (so that the
    attention logits are O(1) from the start and the scale matters at step 0), norms at 1. One
    normal draw is cut into the matrices (one random-bits program compiles far faster on a CPU
    than one per matrix)."""
    d, hd, hidden = cfg.d_model, cfg.head_dim, cfg.mlp_ratio * cfg.d_model
    residual = 1.0 / math.sqrt(2 * cfg.layers)  # the gain of the projections into the residual
    block_shapes = {
        "wq": ((d, cfg.heads_q * hd), 1.0),
        "wk": ((d, cfg.heads_kv * hd), 1.0),
        "wv": ((d, cfg.heads_kv * hd), 1.0),
        "wo": ((cfg.heads_q * hd, d), residual),
        "w1": ((d, hidden), 1.0),
        "w2": ((hidden, d), residual),
    }
    shapes = [("embed", (cfg.vocab, d), 1.0), ("pos", (cfg.seq, d), 0.5)]
    shapes += [
        (f"{i}.{n}", s, g / math.sqrt(s[0]))
        for i in range(cfg.layers)
        for n, (s, g) in block_shapes.items()
    ]
    shapes.append(("head", (d, cfg.vocab), 1.0 / math.sqrt(d)))
    z = jax.random.normal(key, (sum(math.prod(s) for _, s, _ in shapes),), jnp.float32)
    drawn, at = {}, 0
    for name, shape, std in shapes:
        size = math.prod(shape)
        drawn[name] = std * z[at : at + size].reshape(shape)
        at += size
    ones = jnp.ones((d,), jnp.float32)
    blocks = [
        {"norm1": ones, "norm2": ones, **{n: drawn[f"{i}.{n}"] for n in block_shapes}}
        for i in range(cfg.layers)
    ]
    return {
        "embed": drawn["embed"],
        "pos": drawn["pos"],
        "blocks": blocks,
        "norm": ones,
        "head": drawn["head"],
    }


def rms_norm(x: Any, weight: Any) -> Any:
    """RMSNorm computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def forward(params: dict, tokens: Any, cfg: Config, attention: Attention) -> Any:
    """Logits (B, N, vocab), float32. Matmuls and attention in cfg.compute_dtype."""
    dt = jnp.dtype(cfg.compute_dtype)
    p = jax.tree.map(lambda a: a.astype(dt), params)
    b, n = tokens.shape
    hq, hkv, hd = cfg.heads_q, cfg.heads_kv, cfg.head_dim
    x = p["embed"][tokens] + p["pos"][:n]
    for blk in p["blocks"]:
        h = rms_norm(x, blk["norm1"])
        q = (h @ blk["wq"]).reshape(b, n, hq, hd)
        k = (h @ blk["wk"]).reshape(b, n, hkv, hd)
        v = (h @ blk["wv"]).reshape(b, n, hkv, hd)
        a = attention(q, k, v)
        x = x + a.reshape(b, n, hq * hd) @ blk["wo"]
        h = rms_norm(x, blk["norm2"])
        x = x + jax.nn.gelu(h @ blk["w1"]) @ blk["w2"]
    x = rms_norm(x, p["norm"])
    return (x @ p["head"]).astype(jnp.float32)


def loss_fn(params: dict, tokens: Any, cfg: Config, attention: Attention) -> Any:
    """Mean next-token cross-entropy (float32)."""
    logits = forward(params, tokens, cfg, attention)[:, :-1]
    targets = tokens[:, 1:]
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def adam_init(params: dict) -> dict:
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"t": jnp.zeros((), jnp.int32), "m": zeros, "v": jax.tree.map(jnp.zeros_like, params)}


def train_step(
    params: dict, opt: dict, tokens: Any, *, cfg: Config, attention: Attention
) -> tuple[dict, dict, Any]:
    """One Adam step (beta1 0.9, beta2 0.999, eps 1e-8, bias-corrected): (params, opt, loss)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg, attention)
    b1, b2, eps = 0.9, 0.999, 1e-8
    t = opt["t"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    tf = t.astype(jnp.float32)
    lr = cfg.lr * jnp.sqrt(1 - b2**tf) / (1 - b1**tf)
    params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + eps), params, m, v)
    return params, {"t": t, "m": m, "v": v}, loss


def make_train_step(cfg: Config, attention: Attention) -> Callable:
    """The jitted step: (params, opt, tokens) -> (params, opt, loss)."""
    return jax.jit(functools.partial(train_step, cfg=cfg, attention=attention))


def make_batch(key: Any, cfg: Config) -> Any:
    return jax.random.randint(key, (cfg.batch, cfg.seq), 0, cfg.vocab, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def initial_state(cfg: Config, seed: int = 0) -> tuple[dict, dict, Any]:
    """(params, Adam state, tokens) of `seed`, as one compiled program (eagerly, every random
    draw of the initialisation would compile on its own: seconds on a CPU)."""
    key_params, key_data = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(key_params, cfg)
    return params, adam_init(params), make_batch(key_data, cfg)


def train(cfg: Config, attention: Attention, steps: int = 50, seed: int = 0) -> np.ndarray:
    """The loss before each of `steps` steps from the weights and batch of `seed` (float64)."""
    params, opt, tokens = initial_state(cfg, seed)
    step = make_train_step(cfg, attention)
    losses = []
    for _ in range(steps):
        params, opt, loss = step(params, opt, tokens)
        losses.append(loss)
    return np.asarray(jax.device_get(losses), dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# The tests.

STEPS = 50
# float32: the two runs differ only in the attention's roundoff (XLA's float32 attention against
# cuflash's, which computes in float64 and rounds once). Each step feeds a fresh perturbation of a
# few float32 ulps (2^-24) into the parameters; with stable training dynamics these add up at most
# linearly over the steps, so the loss curves may drift apart by about STEPS x 4 ulps ~ 1.2e-5
# relative. Measured (jax 0.10.2, CPU): at most 3.3e-7 over the 50 steps (5.5 ulps), the size of
# XLA against XLA with its scale moved by one ulp (5.1e-7): roundoff, 36x inside the bound. A
# scale 0.1% off moves the curve by 5.3e-4, 45x outside it (test_the_comparison_fails_with_a_
# wrong_scale). These runs are pinned to the CPU device: on a GPU, XLA's float32 matmuls default
# to TF32 (10-bit mantissas), which this bound rejects (5.8e-5 measured on an H100); the GPU test
# below runs float32 at precision "highest".
RTOL_F32 = STEPS * 4 * 2.0**-24


def relative_gap(losses: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return np.abs(losses - reference) / np.abs(reference)


def assert_curves_agree(losses: np.ndarray, reference: np.ndarray, rtol: float) -> None:
    gap = relative_gap(losses, reference)
    worst = int(np.argmax(gap))
    assert np.all(np.isfinite(losses)), losses
    assert gap[worst] <= rtol, (
        f"loss curves differ at step {worst}: {losses[worst]!r} vs {reference[worst]!r} "
        f"(relative {gap[worst]:.3g} > {rtol:.3g})\nours: {losses}\nreference: {reference}"
    )


@functools.cache
def _cpu_curves() -> dict[str, np.ndarray]:
    cfg = Config()
    return {
        "xla": train_on_cpu(cfg, jax_attention()),
        "cuflash": train_on_cpu(cfg, cuflash_attention()),
    }


def train_on_cpu(cfg: Config, attention: Attention) -> np.ndarray:
    with jax.default_device(jax.devices("cpu")[0]):
        return train(cfg, attention, STEPS)


def test_training_curve_matches_jax_attention():
    curves = _cpu_curves()
    reference = curves["xla"]
    # the run trains: the fixed batch is memorised (5.3 -> 0.22 here), so the attention matters
    assert reference[-1] < 0.1 * reference[0], reference
    assert_curves_agree(curves["cuflash"], reference, RTOL_F32)


def test_the_comparison_fails_with_a_wrong_scale():
    """The tolerance has teeth: cuflash with its scale 0.1% off fails the same comparison."""
    cfg = Config()
    wrong = train_on_cpu(cfg, cuflash_attention(1.001 / math.sqrt(cfg.head_dim)))
    with pytest.raises(AssertionError, match="loss curves differ"):
        assert_curves_agree(wrong, _cpu_curves()["xla"], RTOL_F32)


# ---------------------------------------------------------------------------------------------
# The GPU run: float32 master weights, bfloat16 matmuls and attention (the usual mixed precision).

# bfloat16: the runs no longer agree to roundoff of the loss, since every attention output is
# rounded to bfloat16 (8 significant bits); the question is whether cuflash's bfloat16 curve
# strays from the float32 one further than JAX's own bfloat16 attention does. The bound is the
# repository's correctness policy (docs/DESIGN.md: at most twice the error of a naive computation
# in the same precision) applied to the loss curve: cuflash's largest relative distance from the
# float32 curve is at most BF16_FACTOR times XLA's bfloat16 attention's, plus a floor of
# BF16_FLOOR (a quarter of bfloat16's unit roundoff 2^-8) so that a lucky XLA run cannot make the
# bound vanish. Measured (H100, jax 0.11.2), largest relative distance from the float32 curve
# over 50 steps: XLA bfloat16 1.1e-3, cuDNN 7.7e-4, cuflash 1.3e-3, so the bound is 3.2e-3
# (cuflash 2.5x inside); cuflash with its scale 1% / 2% / 5% off: 5.7e-3 / 1.2e-2 / 2.6e-2 (the
# test uses 5%: 8x outside).
BF16_FACTOR = 2.0
BF16_FLOOR = 2.0**-10


def jax_gpu_unavailable_reason() -> str | None:
    """None when JAX has a CUDA backend, else why not."""
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        return f"JAX has no CUDA backend (install jax[cuda12] or jax[cuda13]): {exc}"
    return None


def gpu_curves(steps: int = STEPS, wrong_scale: float | None = None) -> dict[str, np.ndarray]:
    """Loss curves on the first GPU: float32 XLA (matmuls at 'highest': no TF32), float32
    cuflash (its exact path), and bfloat16 XLA and cuflash (and cuflash with its scale times
    `wrong_scale`)."""
    f32, bf16 = Config(), Config(compute_dtype="bfloat16")
    curves = {}
    with jax.default_device(jax.devices("gpu")[0]):
        with jax.default_matmul_precision("highest"):
            curves["xla_f32"] = train(f32, jax_attention("xla"), steps)
            curves["cuflash_f32"] = train(f32, cuflash_attention(), steps)
        curves["xla_bf16"] = train(bf16, jax_attention("xla"), steps)
        curves["cuflash_bf16"] = train(bf16, cuflash_attention(), steps)
        if wrong_scale is not None:
            scale = wrong_scale / math.sqrt(bf16.head_dim)
            curves["cuflash_bf16_wrong"] = train(bf16, cuflash_attention(scale), steps)
    return curves


def bf16_bound(curves: dict[str, np.ndarray]) -> float:
    return BF16_FACTOR * relative_gap(curves["xla_bf16"], curves["xla_f32"]).max() + BF16_FLOOR


@pytest.mark.gpu
def test_training_curve_on_gpu_bfloat16():
    reason = jax_gpu_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    curves = gpu_curves(wrong_scale=1.05)
    reference = curves["xla_f32"]
    assert reference[-1] < 0.1 * reference[0], reference
    # float32 on the GPU: cuflash's exact kernels against cuBLAS float32, as on the CPU
    assert_curves_agree(curves["cuflash_f32"], reference, RTOL_F32)
    bound = bf16_bound(curves)
    assert_curves_agree(curves["cuflash_bf16"], reference, bound)
    # the bound has teeth: a scale 5% off leaves it
    with pytest.raises(AssertionError, match="loss curves differ"):
        assert_curves_agree(curves["cuflash_bf16_wrong"], reference, bound)
