"""Hypothesis strategies and input makers shared by the test suite (CPU and GPU).

`attention_problems()` draws the shape of one attention call (batch, grouped heads, sequence
lengths, head dim, causal, scale, layout) as a `Problem`; `make_inputs()` fills a problem with
standard normal q, k, v, dO, optionally scaled so that the scores reach a chosen magnitude. The
size limits are arguments, so the GPU tests can draw far longer sequences than the CPU tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

LAYOUTS = ("bshd", "bhsd", "2d")
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class Problem:
    """The shape of one attention call. `layout` is "bshd", "bhsd" or "2d" (then B = Hq = Hkv = 1
    and the arrays are (N, d)). Query head h reads key/value head h // group."""

    B: int
    Hkv: int
    group: int
    Nq: int
    Nk: int
    d: int
    causal: bool
    scale: float | None
    layout: str

    @property
    def Hq(self) -> int:
        return self.Hkv * self.group

    @property
    def two_d(self) -> bool:
        return self.layout == "2d"

    @property
    def api_layout(self) -> str:
        """The `layout=` argument to pass ("bshd" for 2-D input, where it is ignored)."""
        return "bshd" if self.two_d else self.layout

    @property
    def kwargs(self) -> dict[str, Any]:
        """causal, scale and layout as keyword arguments of the reference and the public API."""
        return {"causal": self.causal, "scale": self.scale, "layout": self.api_layout}

    @property
    def scale_value(self) -> float:
        """The scale actually applied: `scale`, or 1/sqrt(d) when it is None."""
        return 1.0 / math.sqrt(self.d) if self.scale is None else float(self.scale)

    @property
    def elements(self) -> int:
        """B * Hq * Nq * Nk * d: the work of one matmul of the score matrix."""
        return self.B * self.Hq * self.Nq * self.Nk * max(self.d, 1)

    @property
    def head_axis(self) -> int | None:
        return {"bshd": 2, "bhsd": 1, "2d": None}[self.layout]

    @property
    def seq_axis(self) -> int:
        return {"bshd": 1, "bhsd": 2, "2d": 0}[self.layout]

    def shape(self, n: int, heads: int) -> tuple[int, ...]:
        if self.two_d:
            return (n, self.d)
        if self.layout == "bshd":
            return (self.B, n, heads, self.d)
        return (self.B, heads, n, self.d)

    @property
    def q_shape(self) -> tuple[int, ...]:
        """Shape of q, o, dO and dq."""
        return self.shape(self.Nq, self.Hq)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """Shape of k, v, dk and dv."""
        return self.shape(self.Nk, self.Hkv)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.Nq,) if self.two_d else (self.B, self.Hq, self.Nq)


def sequence_lengths(max_n: int) -> st.SearchStrategy[int]:
    """1..max_n, biased to tiny lengths (1..8) and to block edges (15, 16, 17, 31, 32, 33, ...)."""
    edges = sorted(
        {n for p in (16 << i for i in range(max_n.bit_length())) for n in (p - 1, p, p + 1)}
    )
    edges = [n for n in edges if 1 <= n <= max_n]
    parts = [st.integers(1, min(8, max_n))]
    if edges:
        parts.append(st.sampled_from(edges))
    parts.append(st.integers(1, max_n))
    return st.one_of(*parts)


def head_dims(max_d: int) -> st.SearchStrategy[int]:
    """1..max_d, biased to tiny dims and to the fast-path buckets (32, 64, ..., 256)."""
    buckets = [b for b in HEAD_DIM_BUCKETS if b <= max_d]
    parts = [st.integers(1, min(8, max_d))]
    if buckets:
        parts.append(st.sampled_from(buckets))
    parts.append(st.integers(1, max_d))
    return st.one_of(*parts)


def _fit(x: int, budget: int) -> int:
    return max(1, min(x, budget))


@st.composite
def attention_problems(
    draw,
    max_n: int = 300,
    max_d: int = 256,
    max_elements: int = 2_000_000,
    *,
    layouts: tuple[str, ...] = LAYOUTS,
    max_batch: int = 3,
    max_heads_kv: int = 3,
    max_group: int = 3,
    causal: bool | None = None,
) -> Problem:
    """A `Problem` with B in 1..max_batch, Hkv in 1..max_heads_kv, group in 1..max_group,
    Nq, Nk in 1..max_n, d in 1..max_d, causal drawn (or fixed when `causal` is a bool), scale None
    or in [1e-3, 10], layout from `layouts`; always B * Hq * Nq * Nk * d <= max_elements (when a
    draw is too big, the sequence lengths are shrunk, Nk first, never below 1)."""
    if max_elements < 1:
        raise ValueError(f"max_elements must be >= 1; got {max_elements}")
    layout = draw(st.sampled_from(layouts))
    two_d = layout == "2d"
    b = 1 if two_d else draw(st.integers(1, max_batch))
    hkv = 1 if two_d else draw(st.integers(1, max_heads_kv))
    group = 1 if two_d else draw(st.integers(1, max_group))
    nq = draw(sequence_lengths(max_n))
    nk = draw(sequence_lengths(max_n))
    d = draw(head_dims(max_d))
    is_causal = draw(st.booleans()) if causal is None else bool(causal)
    scale = draw(st.one_of(st.none(), st.floats(1e-3, 10.0)))

    # Fit the budget by shrinking, never by filtering: every product below stays <= max_elements.
    b = _fit(b, max_elements)
    hkv = _fit(hkv, max_elements // b)
    group = _fit(group, max_elements // (b * hkv))
    heads = b * hkv * group
    d = _fit(d, max_elements // heads)
    nq = _fit(nq, max_elements // (heads * d))
    nk = _fit(nk, max_elements // (heads * d * nq))
    return Problem(b, hkv, group, nq, nk, d, is_causal, scale, layout)


def make_inputs(
    problem: Problem,
    rng: np.random.Generator,
    dtype: Any = np.float64,
    score_range: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v, dO for `problem`, standard normal, as NumPy arrays of `dtype` (any NumPy dtype,
    ml_dtypes.bfloat16 included) in the problem's shapes.

    With `score_range=R`, q and k are both multiplied by sqrt(R / (3 * scale * sqrt(d))): the
    scaled scores scale * q.k then have standard deviation R / 3, so the largest |S| of a problem
    with more than a handful of scores is around R (exp(S) overflows float64 from R ~ 1e3 on)."""
    q = rng.standard_normal(problem.q_shape)
    k = rng.standard_normal(problem.kv_shape)
    v = rng.standard_normal(problem.kv_shape)
    do = rng.standard_normal(problem.q_shape)
    if score_range is not None:
        a = math.sqrt(score_range / (3.0 * problem.scale_value * math.sqrt(problem.d)))
        q, k = q * a, k * a
    return tuple(np.asarray(x).astype(dtype) for x in (q, k, v, do))


def window_bounds(longest: int) -> st.SearchStrategy[int | None]:
    """A window bound: none, -1, 0, 1, small, around the tiles' edges, up to `longest`."""
    return st.one_of(
        st.none(), st.just(-1), st.sampled_from([0, 1, 2, 63, 64, 65]), st.integers(0, longest)
    )


@st.composite
def score_options(draw, longest: int = 3000) -> dict:
    """The options of the masks issue, each drawn in about a third of the cases: a window
    (bounds up to `longest`), a softcap, ALiBi slopes per head or per batch ("head", "batch")."""
    options = {}
    if draw(st.integers(0, 2)) == 0:
        bounds = window_bounds(longest)
        options["window"] = (draw(bounds), draw(bounds))
    if draw(st.integers(0, 3)) == 0:
        options["softcap"] = draw(st.floats(0.5, 50.0))
    if draw(st.integers(0, 3)) == 0:
        options["alibi"] = draw(st.sampled_from(["head", "batch"]))
    return options
