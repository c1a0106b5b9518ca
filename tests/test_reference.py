"""The float64 NumPy reference (cuflash.reference) checked against hand-computed values, finite
differences and the mathematical invariants of attention, and its blockwise form (the executable
specification of the CUDA kernels) checked against its naive form."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import Problem, attention_problems, make_inputs

from cuflash import reference

NEG = -np.inf
EPS = np.finfo(np.float64).eps
SEEDS = st.integers(0, 2**32 - 1)
BLOCKS = st.one_of(st.sampled_from(range(16, 129, 16)), st.integers(16, 128))
SCORE_RANGES = st.sampled_from([None, 1e2, 1e4])


# ---------------------------------------------------------------------------------------------
# Helpers (written here, independently of the reference's private ones)


def to_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    """(B, H, N, d) view of a q/k/v-shaped array; layout "bshd", "bhsd" or "2d"."""
    if x.ndim == 2:
        return x[None, None]
    return x.transpose(0, 2, 1, 3) if layout == "bshd" else x


def from_bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "2d":
        return x[0, 0]
    return x.transpose(0, 2, 1, 3) if layout == "bshd" else x


def lse_bh(lse: np.ndarray) -> np.ndarray:
    """(B, Hq, Nq) view of an lse ((Nq,) for 2-D input)."""
    return lse[None, None] if lse.ndim == 1 else lse


def scores_bh(s: np.ndarray) -> np.ndarray:
    """(B, Hq, Nq, Nk) view of S or P ((Nq, Nk) for 2-D input)."""
    return s[None, None] if s.ndim == 2 else s


def rows_seeing_a_key(nq: int, nk: int, causal: bool) -> np.ndarray:
    """Bool (nq,): query i sees at least key 0, i.e. 0 <= i + nk - nq (bottom-right causal)."""
    if nk == 0:
        return np.zeros(nq, dtype=bool)
    if not causal:
        return np.ones(nq, dtype=bool)
    return np.arange(nq) >= nq - nk


def assert_rel(got, want, tol: float, name: str = "", atol: float = 0.0) -> None:
    """max |got - want| <= tol * max |want| + atol over the finite entries of want; the
    non-finite entries (lse = -inf) must be equal; no NaN in got."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert not np.isnan(got).any(), f"{name}: NaN in result"
    assert not np.isnan(want).any(), f"{name}: NaN in expected"
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=name)
    assert np.isfinite(got[finite]).all(), f"{name}: inf where a finite value is expected"
    big = np.max(np.abs(want[finite]), initial=0.0)
    err = np.max(np.abs(got[finite] - want[finite]), initial=0.0)
    assert err <= tol * big + atol, (
        f"{name}: max abs error {err:.3g} > {tol:g} * {big:.3g} + {atol:g}"
    )


def grad_atols(problem: Problem, q, k, v, do) -> tuple[float, float, float]:
    """Absolute error floors of (dq, dk, dv) from rounding alone. dS = P * (dP - D) carries an
    error ~ eps * d * |dO| |v| per entry even where it is 0 in exact arithmetic (with Nk = 1,
    o = v and dq = dk = 0), so a relative bound alone fails on pure rounding noise there. dv_j
    sums P_ij dO_i over the rows (and heads) that see key j, terms up to |dO| that can cancel to
    far less than the largest entry (with Nk = 1, P = 1): summed in another order (another
    layout), it moves by up to ~ eps * rows * |dO|."""
    base = 8 * EPS * problem.scale_value * problem.d * np.abs(do).max() * np.abs(v).max()
    rows = problem.Nq * problem.group  # the query rows that feed one key's dk and dv
    dv_floor = 4 * EPS * rows * np.abs(do).max()
    return base * np.abs(k).max(), base * np.abs(q).max() * math.sqrt(rows), dv_floor


@contextlib.contextmanager
def no_warnings():
    """Any warning raises, RuntimeWarning from NumPy floating-point errors included (NumPy's
    default: divide by zero, overflow and invalid value warn; underflow to 0 is fine)."""
    with (
        warnings.catch_warnings(),
        np.errstate(divide="warn", over="warn", invalid="warn", under="ignore"),
    ):
        warnings.simplefilter("error")
        yield


def run_all(problem: Problem, q, k, v, do):
    o, lse = reference.forward(q, k, v, **problem.kwargs)
    grads = reference.backward(do, q, k, v, o, lse, **problem.kwargs)
    return (o, lse, *grads)


# ---------------------------------------------------------------------------------------------
# 1. The 4 x 4 worked example, by hand

Q4 = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=np.float64)
K4 = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 1]], dtype=np.float64)
V4 = np.arange(1, 17, dtype=np.float64).reshape(4, 4)
# S = Q K^T, dot products of the 0/1 rows above counted by hand (scale 1).
S4 = np.array([[1, 1, 2, 0], [1, 1, 1, 1], [2, 1, 1, 0], [2, 2, 3, 1]], dtype=np.float64)
# Causal with Nq = Nk = 4: the lower triangle.
MASK4 = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
S4_CAUSAL = np.array(
    [[1, NEG, NEG, NEG], [1, 1, NEG, NEG], [2, 1, 1, NEG], [2, 2, 3, 1]], dtype=np.float64
)
# Causal with Nq = 2 (the last two query rows), Nk = 4: query i sees keys j <= i + 2.
MASK24 = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
S24_CAUSAL = np.array([[2, 1, 1, NEG], [2, 2, 3, 1]], dtype=np.float64)


def _softmax_by_hand(s: np.ndarray) -> np.ndarray:
    e = np.exp(s)  # exp(-inf) = 0: masked entries drop out
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize(
    "q, causal, s_want, mask_want",
    [
        (Q4, False, S4, np.ones((4, 4), dtype=bool)),
        (Q4, True, S4_CAUSAL, MASK4),
        (Q4[2:], True, S24_CAUSAL, MASK24),
    ],
    ids=["4x4", "4x4-causal", "2x4-causal"],
)
def test_worked_example(q, causal, s_want, mask_want):
    nq, nk = q.shape[0], K4.shape[0]
    np.testing.assert_array_equal(reference.visible_mask(nq, nk, causal), mask_want)
    p_want = _softmax_by_hand(s_want)
    o_want = p_want @ V4
    lse_want = np.log(np.exp(s_want).sum(axis=1))

    s, p = reference.scores_and_probabilities(q, K4, causal=causal, scale=1.0)
    np.testing.assert_array_equal(s, s_want)  # exact, -inf where masked
    np.testing.assert_allclose(p, p_want, rtol=1e-15, atol=0)
    assert np.all(p[~mask_want] == 0)

    for fwd in (reference.forward, reference.forward_blockwise):
        o, lse = fwd(q, K4, V4, causal=causal, scale=1.0)
        np.testing.assert_allclose(o, o_want, rtol=1e-15, atol=0)
        np.testing.assert_allclose(lse, lse_want, rtol=1e-15, atol=0)


def test_worked_example_causal_rows_are_the_last_rows_of_the_square_case():
    """Bottom-right alignment: 2 queries against 4 keys are the last 2 rows of the 4 x 4 case."""
    o4, lse4 = reference.forward(Q4, K4, V4, causal=True, scale=1.0)
    o2, lse2 = reference.forward(Q4[2:], K4, V4, causal=True, scale=1.0)
    np.testing.assert_array_equal(o2, o4[2:])
    np.testing.assert_array_equal(lse2, lse4[2:])
    # and the default scale is 1/sqrt(d): scale 0.5 for d = 4
    o_def, _ = reference.forward(Q4, K4, V4)
    o_half, _ = reference.forward(Q4 * 0.5, K4, V4, scale=1.0)
    np.testing.assert_allclose(o_def, o_half, rtol=1e-15, atol=0)


# ---------------------------------------------------------------------------------------------
# 2. Finite differences of f = sum(o * dO)

FD_CASES = [
    # (layout, nq, nk, hq, hkv, causal, scale)
    ("2d", 4, 6, 1, 1, False, None),
    ("2d", 3, 5, 1, 1, True, 0.7),
    ("2d", 6, 3, 1, 1, True, None),  # Nq > Nk: rows 0..2 see no key
    ("bshd", 4, 6, 4, 2, False, 0.9),
    ("bshd", 3, 5, 4, 2, True, None),
    ("bshd", 6, 3, 4, 2, True, 1.3),
    ("bshd", 5, 5, 3, 1, True, None),  # multi-query
    ("bhsd", 4, 6, 4, 2, False, None),
    ("bhsd", 3, 5, 4, 2, True, 0.6),
    ("bhsd", 6, 3, 4, 2, True, None),
    ("bhsd", 5, 5, 2, 2, False, None),
]


def _central_differences(f, arrays, h=1e-5):
    """d f / d x for every element of every array (arrays are perturbed in place, restored)."""
    grads = []
    for x in arrays:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            x0 = x[idx]
            x[idx] = x0 + h
            fp = f()
            x[idx] = x0 - h
            fm = f()
            x[idx] = x0
            g[idx] = (fp - fm) / (2 * h)
        grads.append(g)
    return grads


@pytest.mark.parametrize("layout, nq, nk, hq, hkv, causal, scale", FD_CASES)
def test_backward_matches_finite_differences(layout, nq, nk, hq, hkv, causal, scale):
    problem = Problem(2 if layout != "2d" else 1, hkv, hq // hkv, nq, nk, 3, causal, scale, layout)
    q, k, v, do = make_inputs(problem, np.random.default_rng(1234 + nq * 7 + nk))
    kw = problem.kwargs

    def f():
        return float(np.sum(reference.forward(q, k, v, **kw)[0] * do))

    o, lse = reference.forward(q, k, v, **kw)
    got = reference.backward(do, q, k, v, o, lse, **kw)
    want = _central_differences(f, [q, k, v])
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape
        assert np.abs(g).max() > 0.01, name  # a real gradient, not a vacuous 0 == 0
        assert_rel(w, g, 1e-6, name)  # relative to max |grad|
    if causal and nq > nk:  # rows that see no key have dq = 0
        dqb = to_bhsd(got[0], layout)
        assert np.all(dqb[:, :, : nq - nk] == 0)


# ---------------------------------------------------------------------------------------------
# 3. Blockwise (the kernels' algorithm) == naive


@given(
    problem=attention_problems(),
    block_m=BLOCKS,
    block_n=BLOCKS,
    score_range=SCORE_RANGES,
    seed=SEEDS,
)
def test_blockwise_matches_naive(problem, block_m, block_n, score_range, seed):
    q, k, v, do = make_inputs(problem, np.random.default_rng(seed), score_range=score_range)
    kw = problem.kwargs
    blocks = {"block_m": block_m, "block_n": block_n}
    s, _ = reference.scores_and_probabilities(q, k, problem.causal, problem.scale, kw["layout"])
    note(f"max |S| = {np.max(np.abs(s[np.isfinite(s)]), initial=0):.3g}")

    with no_warnings():
        o, lse = reference.forward(q, k, v, **kw)
        o_b, lse_b = reference.forward_blockwise(q, k, v, **kw, **blocks)
        grads = reference.backward(do, q, k, v, o, lse, **kw)
        grads_b = reference.backward_blockwise(do, q, k, v, o, lse, **kw, **blocks)
    assert_rel(o_b, o, 1e-10, "o")
    assert_rel(lse_b, lse, 1e-10, "lse")

    seen = rows_seeing_a_key(problem.Nq, problem.Nk, problem.causal)
    for z in (lse, lse_b):  # -inf exactly for the rows that see no key
        assert np.all(np.isneginf(lse_bh(z)[..., ~seen]))
    for z in (o, o_b):
        assert np.all(to_bhsd(z, problem.layout)[:, :, ~seen] == 0)
    if score_range == 1e4:  # no overflow: only differences to the running max are exponentiated
        for z in (lse, lse_b):
            assert np.isfinite(lse_bh(z)[..., seen]).all()
        for z in (o, o_b):
            assert np.isfinite(z).all()

    atols = grad_atols(problem, q, k, v, do)
    for name, g_b, g, atol in zip(("dq", "dk", "dv"), grads_b, grads, atols, strict=True):
        assert_rel(g_b, g, 1e-10, name, atol)


@given(
    problem=attention_problems(),
    block_m=BLOCKS,
    block_n=BLOCKS,
    score_range=SCORE_RANGES,
    slack=st.sampled_from([1.0, 8.0]),
    rise=st.sampled_from([0.0, 0.05, 1.0, -1.0]),
    seed=SEEDS,
)
def test_blockwise_with_a_trailing_max_matches_naive(
    problem, block_m, block_n, score_range, slack, rise, seed
):
    # The TMA forward's running max may trail the true one by `slack` log2 units
    # (kernels_cu/softmax.cuh): o and lse are the same function. `rise` adds a ramp along the keys
    # to every score (per key, in units of S), so that the max moves within the slack on some
    # blocks and past it on others.
    q, k, v, _ = make_inputs(problem, np.random.default_rng(seed), score_range=score_range)
    q, k = with_key_ramp(q, k, problem, rise)
    blocks = {"block_m": block_m, "block_n": block_n}
    assert_forward_blockwise_is_naive(q, k, v, problem.kwargs, blocks, rescale_slack=slack)


def with_key_ramp(q, k, problem, rise: float):
    """q and k with their first component set so that S gains `rise` per key (q, k as they are
    for rise 0)."""
    if not rise:
        return q, k
    ramp = rise * np.arange(problem.Nk) / problem.scale_value
    q, k = to_bhsd(q, problem.layout).copy(), to_bhsd(k, problem.layout).copy()
    q[..., 0], k[..., 0] = 1.0, ramp
    return from_bhsd(q, problem.layout), from_bhsd(k, problem.layout)


@given(
    problem=attention_problems(),
    block_m=BLOCKS,
    block_n=BLOCKS,
    slope_max=st.sampled_from([0.01, 0.3, 3.0]),
    window=st.sampled_from([None, (40, None), (None, 17), (25, 9)]),
    softcap=st.sampled_from([None, 5.0]),
    seed=SEEDS,
)
def test_blockwise_with_alibi_one_sided_matches_naive(
    problem, block_m, block_n, slope_max, window, softcap, seed
):
    # The TMA forward's ALiBi on the unmasked key blocks that lie on one side of every row's
    # diagonal (kernels_cu/score_mod.cuh, apply_one_sided): the score's part of the distance in
    # the scores, the row's (each lane's own) in the max, the blocks that straddle a diagonal the
    # general way. o and lse are the same function.
    rng = np.random.default_rng(seed)
    q, k, v, _ = make_inputs(problem, rng)
    slopes = rng.uniform(0.0, slope_max, problem.Hq)
    kw = dict(problem.kwargs, window=window, softcap=softcap, alibi_slopes=slopes)
    blocks = {"block_m": block_m, "block_n": block_n}
    assert_forward_blockwise_is_naive(q, k, v, kw, blocks, alibi_one_sided=True)


@given(
    problem=attention_problems(),
    block_m=BLOCKS,
    block_n=BLOCKS,
    score_range=SCORE_RANGES,
    softcap=st.sampled_from([0.5, 5.0, 30.0]),
    reach=st.sampled_from([0.0, 8.0, 40.0, 200.0]),
    slack=st.sampled_from([0.0, 8.0]),
    rise=st.sampled_from([0.0, 0.05, -0.05]),
    seed=SEEDS,
)
def test_blockwise_with_rows_pinned_at_the_softcap_matches_naive(
    problem, block_m, block_n, score_range, softcap, reach, slack, rise, seed
):
    # The TMA forward's bfloat16 rows under a softcap alone: a row whose max comes within `reach`
    # (log2 units) of the cap is pinned at cap - slack and its later blocks take no max
    # (kernels_cu/softmax.cuh, CEILING). Reaches from none to every row, scores that rise or fall
    # along the keys (rows pinned at a later block, the accumulator rescaled then): o and lse are
    # the same function.
    q, k, v, _ = make_inputs(problem, np.random.default_rng(seed), score_range=score_range)
    kw = dict(problem.kwargs, softcap=softcap)
    q, k = with_key_ramp(q, k, problem, rise)
    blocks = {"block_m": block_m, "block_n": block_n}
    form = {"rescale_slack": slack, "pin_reach": reach}
    assert_forward_blockwise_is_naive(q, k, v, kw, blocks, **form)


def test_blockwise_pins_only_under_a_softcap_alone():
    q = np.zeros((1, 4, 1, 8))
    with pytest.raises(ValueError, match="pin_reach"):
        reference.forward_blockwise(q, q, q, pin_reach=8.0)
    with pytest.raises(ValueError, match="pin_reach"):
        reference.forward_blockwise(q, q, q, softcap=5.0, alibi_slopes=np.ones(1), pin_reach=8.0)


def assert_forward_blockwise_is_naive(q, k, v, kw: dict, blocks: dict, **kernel_form) -> None:
    """forward_blockwise with one of the kernels' forms (`kernel_form`) gives the naive o, lse."""
    with no_warnings():
        o, lse = reference.forward(q, k, v, **kw)
        o_b, lse_b = reference.forward_blockwise(q, k, v, **kw, **blocks, **kernel_form)
    assert_rel(o_b, o, 1e-10, "o")
    assert_rel(lse_b, lse, 1e-10, "lse")


# ---------------------------------------------------------------------------------------------
# 4. Invariants of the naive reference

SMALL = {"max_n": 96, "max_d": 64, "max_elements": 400_000}


@given(problem=attention_problems(**SMALL), score_range=SCORE_RANGES, seed=SEEDS)
def test_probabilities_convex_hull_and_lse_bounds(problem, score_range, seed):
    q, k, v, _ = make_inputs(problem, np.random.default_rng(seed), score_range=score_range)
    kw = problem.kwargs
    s, p = reference.scores_and_probabilities(q, k, problem.causal, problem.scale, kw["layout"])
    o, lse = reference.forward(q, k, v, **kw)
    s, p, lse = scores_bh(s), scores_bh(p), lse_bh(lse)  # (B, Hq, Nq, Nk), (B, Hq, Nq)
    ob = to_bhsd(o, problem.layout)
    mask = reference.visible_mask(problem.Nq, problem.Nk, problem.causal)
    seen = mask.any(axis=1)
    np.testing.assert_array_equal(seen, rows_seeing_a_key(problem.Nq, problem.Nk, problem.causal))

    # P: a probability distribution over the visible keys; all 0 for a row that sees none
    assert np.all(p >= 0)
    assert np.all(p[..., ~mask] == 0)
    assert np.all(np.isneginf(s[..., ~mask]))
    # exp(S - lse) carries the rounding of lse, |lse| * eps, as a relative error
    row_tol = 4 * EPS * (problem.Nk + np.abs(lse[..., seen]))
    assert np.all(np.abs(p[..., seen, :].sum(axis=-1) - 1) <= row_tol)
    assert np.all(p[..., ~seen, :] == 0)

    # O in the convex hull of the visible V rows, per output column
    vb = np.repeat(to_bhsd(v, problem.layout), problem.group, axis=1)  # (B, Hq, Nk, d)
    vis = mask[None, None, :, :, None]  # (1, 1, Nq, Nk, 1)
    vmin = np.where(vis, vb[:, :, None], np.inf).min(axis=3)  # (B, Hq, Nq, d)
    vmax = np.where(vis, vb[:, :, None], -np.inf).max(axis=3)
    slack = 1e-12 * max(1.0, np.abs(v).max())
    assert np.all(ob[:, :, seen] >= vmin[:, :, seen] - slack)
    assert np.all(ob[:, :, seen] <= vmax[:, :, seen] + slack)
    assert np.all(ob[:, :, ~seen] == 0)

    # max_j S_ij <= lse_i <= max_j S_ij + log(#visible keys of row i)
    smax = s.max(axis=-1)[..., seen]
    count = mask.sum(axis=1)[seen]
    assert np.all(lse[..., seen] >= smax)
    assert np.all(lse[..., seen] <= smax + np.log(count) + 1e-12 * (1 + np.abs(smax)))
    assert np.all(np.isneginf(lse[..., ~seen]))


@given(
    problem=attention_problems(**SMALL),
    c=st.floats(-1e3, 1e3, allow_nan=False),
    pick=st.tuples(st.integers(0, 2**16), st.integers(0, 2**16), st.integers(0, 2**16)),
    seed=SEEDS,
)
def test_shift_invariance(problem, c, pick, seed):
    """Adding c to every score of one row adds c to its lse and leaves O unchanged. Realised by
    appending a column c/scale (at the chosen row, 0 elsewhere) to q and a column of ones to k, so
    that S_ij gains scale * (c/scale) * 1 = c for that row only."""
    q, k, v, _ = make_inputs(problem, np.random.default_rng(seed))
    layout, scale = problem.layout, problem.scale_value  # explicit: d changes to d + 1
    kw = {"causal": problem.causal, "scale": scale, "layout": problem.api_layout}
    # the chosen row (b, h, i) sees a key: the last row always does; rows >= Nq - Nk do
    first = max(0, problem.Nq - problem.Nk) if problem.causal else 0
    b, h = pick[0] % problem.B, pick[1] % problem.Hq
    i = first + pick[2] % (problem.Nq - first)

    qb, kb = to_bhsd(q, layout), to_bhsd(k, layout)
    col = np.zeros(qb.shape[:3] + (1,))
    col[b, h, i, 0] = c / scale
    q2 = np.ascontiguousarray(from_bhsd(np.concatenate([qb, col], axis=-1), layout))
    k2 = np.ascontiguousarray(
        from_bhsd(np.concatenate([kb, np.ones(kb.shape[:3] + (1,))], axis=-1), layout)
    )
    assert q2.shape[-1] == k2.shape[-1] == problem.d + 1

    s1, _ = reference.scores_and_probabilities(q, k, **kw)
    s2, _ = reference.scores_and_probabilities(q2, k2, **kw)
    s1, s2 = scores_bh(s1), scores_bh(s2)
    mask = reference.visible_mask(problem.Nq, problem.Nk, problem.causal)
    shift = np.zeros(s1.shape[:3])
    shift[b, h, i] = c
    kb_e = np.repeat(kb, problem.group, axis=1)
    sqk = scale * np.max(np.abs(qb) @ np.abs(kb_e).transpose(0, 1, 3, 2), initial=0)
    tol = 64 * EPS * (1 + abs(c) + sqk)  # rounding of scale * (q.k + c/scale)
    diff = s2[..., mask] - s1[..., mask]  # (B, Hq, #visible) vs the shift of each row
    want = np.broadcast_to(shift[..., None], s1.shape)[..., mask]
    assert np.all(np.abs(diff - want) <= tol), "the construction does not shift one row"
    assert np.all(np.isneginf(s2[..., ~mask]))

    o1, lse1 = reference.forward(q, k, v, **kw)
    o2, lse2 = reference.forward(q2, k2, v, **kw)
    lse1, lse2 = lse_bh(lse1), lse_bh(lse2)
    assert np.isfinite(lse2[b, h, i])
    np.testing.assert_array_equal(np.isneginf(lse1), np.isneginf(lse2))
    fin = np.isfinite(lse1)
    assert np.all(np.abs(lse2[fin] - lse1[fin] - shift[fin]) <= 2 * tol)
    assert np.all(np.abs(o2 - o1) <= 4 * tol * max(1.0, np.abs(v).max()))


# ---------------------------------------------------------------------------------------------
# 5. Rows that see no key


@pytest.mark.parametrize("score_range", [None, 1e4])
@pytest.mark.parametrize(
    "layout, nq, nk, hq, hkv",
    [("2d", 5, 2, 1, 1), ("bshd", 9, 1, 2, 1), ("bhsd", 130, 70, 2, 2), ("bshd", 64, 63, 1, 1)],
)
def test_fully_masked_rows(layout, nq, nk, hq, hkv, score_range):
    problem = Problem(1 if layout == "2d" else 2, hkv, hq // hkv, nq, nk, 5, True, None, layout)
    q, k, v, do = make_inputs(problem, np.random.default_rng(nq + nk), score_range=score_range)
    kw = problem.kwargs
    blind = ~rows_seeing_a_key(nq, nk, True)
    assert blind.sum() == nq - nk
    with no_warnings():
        naive = run_all(problem, q, k, v, do)
        o_b, lse_b = reference.forward_blockwise(q, k, v, **kw, block_m=16, block_n=17)
        grads_b = reference.backward_blockwise(
            do, q, k, v, o_b, lse_b, **kw, block_m=17, block_n=16
        )
        s, p = reference.scores_and_probabilities(q, k, **kw)
    for o, lse, dq, dk, dv in (naive, (o_b, lse_b, *grads_b)):
        for x in (o, lse, dq, dk, dv):
            assert not np.isnan(x).any()
        assert np.all(to_bhsd(o, layout)[:, :, blind] == 0)
        assert np.all(np.isneginf(lse_bh(lse)[..., blind]))
        assert np.all(np.isfinite(lse_bh(lse)[..., ~blind]))
        assert np.all(to_bhsd(dq, layout)[:, :, blind] == 0)
        assert np.all(scores_bh(p)[..., blind, :] == 0)

    # The rows that see a key are the causal problem Nq' = Nk on the last Nk queries: same o,
    # lse, dq there, and the blind rows add nothing to dk and dv.
    sub = Problem(problem.B, hkv, hq // hkv, nk, nk, 5, True, None, layout)
    tail = [from_bhsd(to_bhsd(x, layout)[:, :, nq - nk :], layout) for x in (q, do)]
    o2, lse2, dq2, dk2, dv2 = run_all(sub, tail[0], k, v, tail[1])
    o, lse, dq, dk, dv = naive
    atol_dq, atol_dk, _ = grad_atols(problem, q, k, v, do)
    assert_rel(to_bhsd(o, layout)[:, :, ~blind], to_bhsd(o2, layout), 1e-12, "o")
    assert_rel(lse_bh(lse)[..., ~blind], lse_bh(lse2), 1e-12, "lse")
    # (with Nk = 1, o = v and dq = dk = 0 up to rounding: hence the absolute term)
    assert_rel(to_bhsd(dq, layout)[:, :, ~blind], to_bhsd(dq2, layout), 1e-12, "dq", atol_dq)
    assert_rel(dk, dk2, 1e-12, "dk", atol_dk)
    assert_rel(dv, dv2, 1e-12, "dv")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["2d", "bshd", "bhsd"])
def test_no_keys_at_all(layout, causal):
    """Nk = 0: every row sees no key: o = 0, lse = -inf, without a warning."""
    b, h = (1, 1) if layout == "2d" else (2, 2)
    problem = Problem(b, h, 1, 7, 0, 4, causal, None, layout)
    q, k, v, _ = make_inputs(problem, np.random.default_rng(0))
    assert k.shape == problem.kv_shape and 0 in k.shape
    with no_warnings():
        results = [
            reference.forward(q, k, v, **problem.kwargs),
            reference.forward_blockwise(q, k, v, **problem.kwargs, block_m=16, block_n=16),
        ]
    for o, lse in results:
        assert o.shape == problem.q_shape and lse.shape == problem.lse_shape
        assert np.all(o == 0)
        assert np.all(np.isneginf(lse))


# ---------------------------------------------------------------------------------------------
# 6. Grouped heads == the same call on k, v repeated per group


@given(
    problem=attention_problems(**SMALL, layouts=("bshd", "bhsd"), max_group=4).filter(
        lambda p: p.group > 1
    ),
    seed=SEEDS,
)
def test_grouped_heads_equal_repeated_heads(problem, seed):
    q, k, v, do = make_inputs(problem, np.random.default_rng(seed))
    axis, g = problem.head_axis, problem.group
    k_rep, v_rep = np.repeat(k, g, axis=axis), np.repeat(v, g, axis=axis)
    full = dataclasses.replace(problem, Hkv=problem.Hq, group=1)
    assert k_rep.shape == full.kv_shape == k.shape[:axis] + (problem.Hq,) + k.shape[axis + 1 :]
    o, lse, dq, dk, dv = run_all(problem, q, k, v, do)
    o_r, lse_r, dq_r, dk_r, dv_r = run_all(full, q, k_rep, v_rep, do)
    assert_rel(o, o_r, 1e-13, "o")
    assert_rel(lse, lse_r, 1e-13, "lse")
    atol_dq, atol_dk, _ = grad_atols(problem, q, k, v, do)
    assert_rel(dq, dq_r, 1e-13, "dq", atol_dq)

    def per_group_sum(x):  # (.., Hq, ..) -> (.., Hkv, ..): query heads h*g .. h*g + g - 1
        shape = x.shape[:axis] + (problem.Hkv, g) + x.shape[axis + 1 :]
        return x.reshape(shape).sum(axis=axis + 1)

    assert_rel(dk, per_group_sum(dk_r), 1e-13, "dk", atol_dk)
    assert_rel(dv, per_group_sum(dv_r), 1e-13, "dv")


# ---------------------------------------------------------------------------------------------
# 7. Layouts


@given(problem=attention_problems(**SMALL, layouts=("bhsd",)), seed=SEEDS)
def test_bhsd_equals_transposed_bshd(problem, seed):
    q, k, v, do = make_inputs(problem, np.random.default_rng(seed))

    def t(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3))

    kw = {"causal": problem.causal, "scale": problem.scale}
    o, lse = reference.forward(q, k, v, layout="bhsd", **kw)
    o_t, lse_t = reference.forward(t(q), t(k), t(v), layout="bshd", **kw)
    assert o_t.shape == t(q).shape and lse_t.shape == lse.shape == problem.lse_shape
    assert_rel(t(o_t), o, 1e-14, "o")
    assert_rel(lse_t, lse, 1e-14, "lse")
    grads = reference.backward(do, q, k, v, o, lse, layout="bhsd", **kw)
    grads_t = reference.backward(t(do), t(q), t(k), t(v), t(o), lse, layout="bshd", **kw)
    atols = grad_atols(problem, q, k, v, do)
    for name, g, g_t, atol in zip(("dq", "dk", "dv"), grads, grads_t, atols, strict=True):
        assert g_t.shape == t(g).shape
        assert_rel(t(g_t), g, 1e-14, name, atol)
    # the blockwise form reads the layouts the same way
    o_b, lse_b = reference.forward_blockwise(t(q), t(k), t(v), layout="bshd", **kw)
    assert_rel(t(o_b), o, 1e-10, "o blockwise")
    assert_rel(lse_b, lse, 1e-10, "lse blockwise")


@pytest.mark.parametrize("causal", [False, True])
def test_2d_equals_one_batch_one_head(causal):
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.standard_normal((n, 6)) for n in (9, 13, 13, 9))

    def four(x):
        return x[None, :, None, :]  # (1, N, 1, d) in bshd

    o, lse = reference.forward(q, k, v, causal=causal)
    o4, lse4 = reference.forward(four(q), four(k), four(v), causal=causal)
    assert o.shape == (9, 6) and lse.shape == (9,) and lse4.shape == (1, 1, 9)
    np.testing.assert_array_equal(o, o4[0, :, 0])
    np.testing.assert_array_equal(lse, lse4[0, 0])
    grads = reference.backward(do, q, k, v, o, lse, causal=causal)
    grads4 = reference.backward(four(do), four(q), four(k), four(v), o4, lse4, causal=causal)
    for g, g4 in zip(grads, grads4, strict=True):
        np.testing.assert_array_equal(g, g4[0, :, 0])


# ---------------------------------------------------------------------------------------------
# Input dtypes and the strategies themselves


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_low_precision_inputs_are_computed_exactly_in_float64(dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    problem = Problem(2, 2, 2, 11, 19, 8, True, None, "bshd")
    q, k, v, do = make_inputs(problem, np.random.default_rng(3), dtype=dtype)
    assert q.dtype == np.dtype(dtype)
    q64, k64, v64, do64 = (x.astype(np.float32).astype(np.float64) for x in (q, k, v, do))
    got = run_all(problem, q, k, v, do)
    want = run_all(problem, q64, k64, v64, do64)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == np.float64
        np.testing.assert_array_equal(x, y)


@given(problem=attention_problems(), seed=SEEDS)
def test_strategies_respect_their_bounds(problem, seed):
    p = problem
    assert 1 <= p.Nq <= 300 and 1 <= p.Nk <= 300 and 1 <= p.d <= 256
    assert p.elements == p.B * p.Hq * p.Nq * p.Nk * p.d <= 2_000_000
    assert p.scale is None or 1e-3 <= p.scale <= 10
    if p.two_d:
        assert p.B == p.Hq == p.Hkv == 1
    q, k, v, do = make_inputs(p, np.random.default_rng(seed), dtype=np.float32)
    assert q.shape == do.shape == p.q_shape and k.shape == v.shape == p.kv_shape
    assert q.dtype == np.float32
    assert len(p.q_shape) == (2 if p.two_d else 4) and p.lse_shape[-1] == p.Nq


@pytest.mark.parametrize("score_range", [1e2, 1e4])
@pytest.mark.parametrize("d, scale", [(1, None), (64, None), (200, 0.01), (16, 7.5)])
def test_make_inputs_score_range(score_range, d, scale):
    problem = Problem(1, 1, 1, 200, 200, d, False, scale, "2d")
    q, k, _, _ = make_inputs(problem, np.random.default_rng(5), score_range=score_range)
    s = problem.scale_value * (q @ k.T)
    assert 0.8 < np.std(s) / (score_range / 3) < 1.25
    assert 0.5 * score_range < np.abs(s).max() < 3 * score_range
    assert math.isclose(problem.scale_value, 1 / math.sqrt(d) if scale is None else scale)


# ---------------------------------------------------------------------------------------------
# Non-finite inputs reach exactly the outputs that depend on them


def _rows_seeing(key: int, nq: int, nk: int) -> np.ndarray:
    return reference.visible_mask(nq, nk, True)[:, key]


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("where", ["v", "do"])
def test_nonfinite_value_reaches_only_what_depends_on_it(where, value):
    rng = np.random.default_rng(7)
    nq, nk, d, bad = 37, 45, 8, 20  # Nq != Nk: the causal mask is aligned bottom-right
    q = rng.standard_normal((1, nq, 2, d))
    k, v = (rng.standard_normal((1, nk, 2, d)) for _ in range(2))
    do = rng.standard_normal((1, nq, 2, d))
    clean_o, clean_lse = reference.forward(q, k, v, causal=True)
    clean_grads = reference.backward(do, q, k, v, clean_o, clean_lse, causal=True)
    v2, do2 = v.copy(), do.copy()
    (v2 if where == "v" else do2)[0, bad, 1, 3] = value
    o, lse = reference.forward(q, k, v2, causal=True)
    dq, dk, dv = reference.backward(do2, q, k, v2, o, lse, causal=True)
    for blockwise in (False, True):
        if blockwise:
            o_b, lse_b = reference.forward_blockwise(q, k, v2, causal=True, block_m=16, block_n=16)
            grads_b = reference.backward_blockwise(
                do2, q, k, v2, o_b, lse_b, causal=True, block_m=16, block_n=16
            )
            np.testing.assert_array_equal(np.isfinite(o_b), np.isfinite(o))
            for g_b, g in zip(grads_b, (dq, dk, dv), strict=True):
                np.testing.assert_array_equal(np.isfinite(g_b), np.isfinite(g))
    vis = reference.visible_mask(nq, nk, True)
    if where == "v":  # o rows that see key `bad`; dq of those rows; dk of the keys they see
        o_rows = vis[:, bad]
        dq_rows = o_rows
        dk_rows = vis[o_rows].any(axis=0)
        dv_rows = np.zeros(nk, dtype=bool)
    else:  # dO of query row `bad`: its dq, and dk, dv of the keys it sees
        o_rows = np.zeros(nq, dtype=bool)
        dq_rows = np.arange(nq) == bad
        dk_rows = dv_rows = vis[bad]
    for got, clean, rows in (
        (o, clean_o, o_rows),
        (dq, clean_grads[0], dq_rows),
        (dk, clean_grads[1], dk_rows),
        (dv, clean_grads[2], dv_rows),
    ):
        assert not np.isfinite(got[0, rows, 1]).all(axis=-1).any()  # every dependent row
        np.testing.assert_array_equal(got[0, ~rows, 1], clean[0, ~rows, 1])  # the rest: exact
        np.testing.assert_array_equal(got[0, :, 0], clean[0, :, 0])  # the other head
    np.testing.assert_array_equal(lse, clean_lse)


@given(
    problem=attention_problems(**SMALL),
    left=st.one_of(st.none(), st.integers(0, 40)),
    right=st.one_of(st.none(), st.integers(0, 40)),
    block_m=BLOCKS,
    block_n=BLOCKS,
    seed=SEEDS,
)
def test_blockwise_matches_naive_under_a_window(problem, left, right, block_m, block_n, seed):
    # The blockwise functions take their tile ranges from the kernels' mask mirror
    # (cuflash/_mask.py); the naive ones state the rule on their own (visible_mask).
    q, k, v, do = make_inputs(problem, np.random.default_rng(seed))
    kw = dict(problem.kwargs, window=(left, right))
    with no_warnings():
        o, lse = reference.forward(q, k, v, **kw)
        o_b, lse_b = reference.forward_blockwise(q, k, v, **kw, block_m=block_m, block_n=block_n)
        grads = reference.backward(do, q, k, v, o, lse, **kw)
        grads_b = reference.backward_blockwise(
            do, q, k, v, o, lse, **kw, block_m=block_m, block_n=block_n
        )
    assert_rel(o_b, o, 1e-10, "o")
    np.testing.assert_array_equal(np.isneginf(lse_b), np.isneginf(lse))
    seen = reference.visible_mask(problem.Nq, problem.Nk, problem.causal, (left, right)).any(1)
    assert (
        np.all(np.isneginf(lse_bh(lse)[..., ~seen])) and np.isfinite(lse_bh(lse)[..., seen]).all()
    )
    for name, g_b, g, atol in zip(
        ("dq", "dk", "dv"), grads_b, grads, grad_atols(problem, q, k, v, do), strict=True
    ):
        assert_rel(g_b, g, 1e-10, name, atol)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0, 50.0])
@pytest.mark.parametrize("log2_keys", [0, 11, 14, 20, 31])
@pytest.mark.parametrize("slack", [0, 8])
def test_pinned_rows_keep_their_probabilities_in_float32s_range(softcap, log2_keys, slack):
    # The bounds kernels_cu/softmax.cuh (CEILING) rests on, for rows whose final scores come in
    # key blocks: the TMA forward's shift is p_shift + slack (p_shift = ceil(log2 Nk)), its reach
    # 96 - 2 p_shift. Every P it forms stays under 2^-p_shift (the accumulator's overflow bound),
    # and a pinned row's largest P (under its final max) is at least 2^(p_shift - 96), so that
    # the P that ftz flushes (under 2^-126, at most 2^p_shift of them) weigh under 2^-30 of it.
    # Rows: scores rising to, or falling from, a top that sweeps the capped range.
    cap = softcap * math.log2(math.e)  # log2 units
    shift, reach = log2_keys + slack, 96.0 - 2 * log2_keys
    for top in np.arange(-cap, cap, 0.25):
        rising = np.linspace(-cap, top, 300)
        for row in (rising, rising[::-1]):
            m = -np.inf
            for start in range(0, row.size, 64):
                block = row[start : start + 64]
                if not block.max() - m <= slack:  # the trailing max moves (or a first block)
                    m = max(m, block.max())
                if m >= cap - reach:  # pinned: the max sits at cap - slack from here on
                    m = cap - slack
                assert (block - m - shift).max() <= -log2_keys + 1e-9
            if m == cap - slack:
                assert row.max() - m - shift >= log2_keys - 96 - 1e-9
