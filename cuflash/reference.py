"""The float64 NumPy reference: the naive formulas, and the blockwise algorithm of the kernels.

Names follow docs/DESIGN.md: ``S = scale * Q K^T``; ``lse_i = log(sum_j exp(S_ij))`` over the keys
row i may see; ``P = exp(S - lse)``; ``O = P V``. Backward, given dO: ``D = rowsum(dO * O)``,
``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - D)``, ``dQ = scale dS K``, ``dK = scale dS^T Q``.

Shapes: ``layout="bshd"``: q ``(B, Nq, Hq, d)``, k/v ``(B, Nk, Hkv, d)``; ``layout="bhsd"``:
``(B, H, N, d)``; a 2-D ``(N, d)`` array is one sequence with one head (layout ignored). Query head
h reads key/value head ``h // (Hq // Hkv)``. Causal masking is aligned to the bottom-right corner:
query i sees key j when ``j <= i + Nk - Nq``. A row that sees no key has o = 0, lse = -inf and zero
gradients. ``window=(left, right)`` bounds what a query sees on either side of that diagonal:
query i sees key j iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (None or -1: no bound on
that side); ``causal=True`` sets right = 0. Score modifiers come between the scale and the mask:
``softcap=c`` makes ``S = c tanh(S / c)``, then ``alibi_slopes`` (``(Hq,)`` or ``(B, Hq)``) adds
``-slope * |i + Nk - Nq - j|``; the backward multiplies dS by ``dS'/dS = 1 - tanh^2`` (so that
``dQ = scale (dS * (1 - tanh^2)) K``). Every function computes in float64 whatever the input
dtype and returns float64 arrays (o, dq, dk, dv shaped like q, k, v; lse ``(B, Hq, Nq)``, or
``(Nq,)`` for 2-D input).

The blockwise functions are the executable specification of the CUDA kernels: the forward pass
with the online softmax over key blocks, the backward pass as preprocess D, a dK/dV pass over query
blocks and a dQ pass over key blocks, visiting the blocks in the kernels' order and skipping those
the mask hides entirely. They take the tile ranges from the host's mirror of the kernels' mask
(cuflash/_mask.py); visible_mask states the rule on its own, so that each checks the other.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _mask

Array = Any


# ---------------------------------------------------------------------------------------------
# Shared pieces


def resolve_window(causal: bool, window: Any = None) -> tuple[int | None, int | None]:
    """(left, right) bounds of the contract's window argument: None or -1 is no bound on that
    side, and causal=True sets right = 0."""
    left, right = (None, None) if window is None else window
    left = None if left is None or left == -1 else int(left)
    right = None if right is None or right == -1 else int(right)
    return left, (0 if causal else right)


class _ScoreMods:
    """The softcap and the ALiBi slopes ((B, Hq) float64) of a call, applied to score blocks."""

    def __init__(self, softcap: float | None, alibi_slopes: Any, batch: int, heads_q: int):
        self.softcap = None if softcap is None else float(softcap)
        self.slopes = None
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, dtype=np.float64).reshape(-1, heads_q)
            self.slopes = np.broadcast_to(slopes, (batch, heads_q))

    def apply(
        self, s: np.ndarray, rows: slice, cols: slice, nq: int, nk: int, heads: Any = slice(None)
    ) -> tuple[np.ndarray, Any]:
        """(S', dS'/dS) of the scaled scores `s` (B, H, rows, cols) of query rows `rows` and
        keys `cols` (of nq and nk) for query heads `heads`: the softcap, then ALiBi."""
        dcap = 1.0
        if self.softcap is not None:
            t = np.tanh(s / self.softcap)
            s, dcap = self.softcap * t, 1.0 - t * t
        if self.slopes is not None:
            i = np.arange(rows.start, rows.stop)[:, None] + (nk - nq)
            j = np.arange(cols.start, cols.stop)[None, :]
            s = s - self.slopes[:, heads][:, :, None, None] * np.abs(i - j)
        return s, dcap


def visible_mask(nq: int, nk: int, causal: bool = False, window: Any = None) -> np.ndarray:
    """Bool (nq, nk): True where query i may see key j (bottom-right aligned: with d = i + nk - nq,
    d - left <= j <= d + right; causal is right = 0)."""
    left, right = resolve_window(causal, window)
    diag = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    seen = np.ones((nq, nk), dtype=bool)
    if left is not None:
        seen &= j >= diag - left
    if right is not None:
        seen &= j <= diag + right
    return seen


def _masked_matmul(w: np.ndarray, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``w @ x`` summed only over the pairs ``mask`` lets meet (mask broadcasts against w).

    A plain product computes 0 * NaN = NaN, so a NaN or Inf in a row of x would reach every row of
    w, also those the mask hides it from; here it reaches exactly the rows that see it. Entries of
    w where the mask is False are ignored whatever they hold."""
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.where(mask, w, 0.0) @ np.where(finite, x, 0.0)
    if finite.all():
        return out
    seen_by = np.broadcast_to(mask, w.shape)
    bad_rows = np.nonzero(
        ~finite.all(axis=-1)
    )  # (leading indices..., j): rows j of x with a NaN/Inf
    for *lead, j in zip(*bad_rows, strict=True):
        lead = tuple(lead)
        nonfinite_part = np.where(finite[lead + (j,)], 0.0, x[lead + (j,)])
        rows = seen_by[lead][:, j]
        with np.errstate(invalid="ignore"):
            out[lead][rows] += w[lead][rows, j][:, None] * nonfinite_part[None, :]
    return out


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


def _to_bhsd(x: Array, layout: str) -> np.ndarray:
    """float64 (B, H, N, d) view of a q/k/v-shaped array."""
    x = np.asarray(x)
    if x.dtype.name == "bfloat16":  # ml_dtypes arrays convert exactly through float32
        x = x.astype(np.float32)
    x = x.astype(np.float64, copy=False)
    if x.ndim == 2:
        return x[None, None]
    if layout == "bshd":
        return x.transpose(0, 2, 1, 3)
    if layout == "bhsd":
        return x
    raise ValueError(f"layout must be 'bshd' or 'bhsd'; got {layout!r}")


def _from_bhsd(x: np.ndarray, layout: str, two_d: bool) -> np.ndarray:
    if two_d:
        return np.ascontiguousarray(x[0, 0])
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3) if layout == "bshd" else x)


def _lse_to_bh(lse: Array, two_d: bool) -> np.ndarray:
    lse = np.asarray(lse, dtype=np.float64)
    return lse[None, None] if two_d else lse


def _check_layout(layout: str) -> None:
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd'; got {layout!r}")


def _group(hq: int, hkv: int) -> int:
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    return hq // hkv


def _expand(x: np.ndarray, group: int) -> np.ndarray:
    """(B, Hkv, N, d) -> (B, Hkv * group, N, d): each key/value head serves `group` query heads."""
    return np.repeat(x, group, axis=1) if group > 1 else x


def _fold(dx: np.ndarray, group: int) -> np.ndarray:
    """Sum of the gradients of the query heads that share a key/value head."""
    if group == 1:
        return dx
    b, h, n, d = dx.shape
    return dx.reshape(b, h // group, group, n, d).sum(axis=2)


def _prepare(q: Array, k: Array, v: Array, layout: str, scale: float | None):
    _check_layout(layout)
    two_d = np.ndim(q) == 2
    qb, kb, vb = _to_bhsd(q, layout), _to_bhsd(k, layout), _to_bhsd(v, layout)
    group = _group(qb.shape[1], kb.shape[1])
    scale = default_scale(qb.shape[-1]) if scale is None else float(scale)
    return qb, kb, vb, group, scale, two_d


# ---------------------------------------------------------------------------------------------
# Naive


def scores_and_probabilities(
    q: Array,
    k: Array,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
    window: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """S (scaled, softcapped, ALiBi added; masked entries -inf) and P = softmax(S) per row (rows
    that see no key are 0), float64, shape (B, Hq, Nq, Nk) (or (Nq, Nk) for 2-D input)."""
    _check_layout(layout)
    qb, kb = _to_bhsd(q, layout), _to_bhsd(k, layout)
    group = _group(qb.shape[1], kb.shape[1])
    scale = default_scale(qb.shape[-1]) if scale is None else float(scale)
    mods = _ScoreMods(softcap, alibi_slopes, qb.shape[0], qb.shape[1])
    s, _, _, p = _softmax(qb, _expand(kb, group), scale, causal, window, mods)
    return (s[0, 0], p[0, 0]) if np.ndim(q) == 2 else (s, p)


def _full_scores(qb: np.ndarray, ke: np.ndarray, scale: float, mods: _ScoreMods):
    """(S', dS'/dS) of every query and key: the scaled scores with the softcap and ALiBi."""
    nq, nk = qb.shape[2], ke.shape[2]
    return mods.apply(scale * (qb @ ke.transpose(0, 1, 3, 2)), slice(0, nq), slice(0, nk), nq, nk)


def _softmax(
    qb: np.ndarray, ke: np.ndarray, scale: float, causal: bool, window: Any, mods: _ScoreMods
):
    """(S' with hidden entries -inf, the visibility mask, lse, P) of (B, H, N, d) queries and keys
    expanded to the query heads."""
    mask = visible_mask(qb.shape[2], ke.shape[2], causal, window)
    with np.errstate(invalid="ignore"):
        s = np.where(mask, _full_scores(qb, ke, scale, mods)[0], -np.inf)
    lse = _logsumexp(s)
    return s, mask, lse, _probabilities(s, lse, mask)


def _logsumexp(s: np.ndarray) -> np.ndarray:
    """log(sum(exp(s))) along the last axis; -inf for rows of -inf only; exact for |s| ~ 1e4."""
    if s.shape[-1] == 0:
        return np.full(s.shape[:-1], -np.inf)
    m = s.max(axis=-1)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        return m_safe + np.log(np.exp(s - m_safe[..., None]).sum(axis=-1))


def _probabilities(s: np.ndarray, lse: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """P = exp(S - lse) on visible entries of rows that see a key, 0 elsewhere."""
    seen = mask & ~np.isneginf(lse)[..., None]
    return np.where(
        seen, np.exp(np.where(seen, s - np.where(np.isneginf(lse), 0, lse)[..., None], 0.0)), 0.0
    )


def forward(
    q: Array,
    k: Array,
    v: Array,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
    window: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Naive attention: (o, lse) in float64 (see the module docstring for shapes)."""
    qb, kb, vb, group, scale, two_d = _prepare(q, k, v, layout, scale)
    mods = _ScoreMods(softcap, alibi_slopes, qb.shape[0], qb.shape[1])
    _, mask, lse, p = _softmax(qb, _expand(kb, group), scale, causal, window, mods)
    o = _masked_matmul(p, _expand(vb, group), mask)
    return _from_bhsd(o, layout, two_d), (lse[0, 0] if two_d else lse)


def backward(
    do: Array,
    q: Array,
    k: Array,
    v: Array,
    o: Array,
    lse: Array,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
    window: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Naive backward: (dq, dk, dv) of sum(o * do), float64, shaped like q, k, v."""
    qb, kb, vb, group, scale, two_d = _prepare(q, k, v, layout, scale)
    dob, ob = _to_bhsd(do, layout), _to_bhsd(o, layout)
    lseb = _lse_to_bh(lse, two_d)
    ke, ve = _expand(kb, group), _expand(vb, group)
    mask = visible_mask(qb.shape[2], kb.shape[2], causal, window)
    mods = _ScoreMods(softcap, alibi_slopes, qb.shape[0], qb.shape[1])
    with np.errstate(invalid="ignore"):
        s, dcap = _full_scores(qb, ke, scale, mods)
    p = _probabilities(s, lseb, mask)
    delta = (dob * ob).sum(axis=-1, keepdims=True)
    mask_t = mask.T
    dv = _masked_matmul(p.transpose(0, 1, 3, 2), dob, mask_t)
    dp = dob @ ve.transpose(0, 1, 3, 2)
    with np.errstate(invalid="ignore"):
        ds = p * (dp - delta) * dcap  # entries the mask hides are ignored by _masked_matmul
    dq = scale * _masked_matmul(ds, ke, mask)
    dk = scale * _masked_matmul(ds.transpose(0, 1, 3, 2), qb, mask_t)
    return (
        _from_bhsd(dq, layout, two_d),
        _from_bhsd(_fold(dk, group), layout, two_d),
        _from_bhsd(_fold(dv, group), layout, two_d),
    )


# ---------------------------------------------------------------------------------------------
# Blockwise: the algorithm of the kernels, step by step


def _blocks(tiles: _mask.TileRange, size: int, n: int) -> list[slice]:
    """The tiles of `size` rows in the kernels' visit order (masked tiles first), as slices."""
    return [slice(t * size, min((t + 1) * size, n)) for t in tiles.order()]


def _alibi_side(m0: int, bm: int, n0: int, bn: int, diag_offset: int) -> int:
    """+1 where the key tile [n0, n0 + bn) lies wholly at or left of the diagonal of every row of
    [m0, m0 + bm), -1 right of it, 0 where it straddles one (Sm90ForwardBlock::alibi_side)."""
    first, last = m0 + diag_offset, m0 + bm - 1 + diag_offset
    return 1 if n0 + bn - 1 <= first else (-1 if n0 >= last else 0)


def _alibi_one_sided(
    raw: np.ndarray, mods: _ScoreMods, rows: slice, cols: slice, diag_offset: int, side: int
) -> tuple[np.ndarray, np.ndarray]:
    """(S', the block's row max) for an unmasked key block on one side of every row's diagonal, as
    the TMA forward forms them (ScoreMod::apply_one_sided, OnlineSoftmax::probabilities with row
    terms): a lane of the quad holds columns 2t, 2t + 1 of every 8 (t = 0..3, col0 = n0 + 2t); its
    scores take sign * slope * (col - col0), its row term sign * slope * (col0 - diag(i)), and its
    max plus its term enters the quad's max."""
    s, _ = _ScoreMods(mods.softcap, None, 1, 1).apply(raw, rows, cols, 0, 0)
    signed = side * mods.slopes[:, :, None, None]  # (B, H, 1, 1)
    col = np.arange(cols.start, cols.stop)
    lane = ((col - cols.start) % 8) // 2
    col0 = cols.start + 2 * lane
    diag = np.arange(rows.start, rows.stop)[:, None] + diag_offset
    t = s + signed * (col - col0)[None, :]  # the one FMA a score
    term = signed * (col0[None, :] - diag)  # (B, H, rows, cols): each column's lane's term
    lane_max = [
        (t[..., lane == i].max(axis=-1) + term[..., lane == i][..., 0])
        for i in range(4)
        if (lane == i).any()
    ]
    return t + term, np.max(lane_max, axis=0)


def forward_blockwise(
    q: Array,
    k: Array,
    v: Array,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
    block_m: int = 64,
    block_n: int = 64,
    window: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    rescale_slack: float = 0.0,
    alibi_one_sided: bool = False,
    pin_reach: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The forward kernel: per query block, the online softmax over key blocks (running max m,
    running sum l, accumulator rescaled by exp(m_old - m_new)), normalised once at the end. A row
    whose sum is 0 saw no key (o = 0, lse = -inf); a NaN sum is a row that met a NaN.
    `rescale_slack` (log2 units, the TMA forward's RESCALE_SLACK): a row keeps its running max
    unless a block's max passes it by more than that, so that its P reach 2^slack and the
    accumulator is rescaled only where the max moved (kernels_cu/softmax.cuh).
    `alibi_one_sided`: ALiBi as the TMA forward takes it on the unmasked key blocks that lie wholly
    on one side of every row's diagonal (_alibi_one_sided).
    `pin_reach` (log2 units; with a softcap and no ALiBi, the TMA forward's bfloat16 rows): a row
    whose max comes within the reach of the cap c is pinned at c - slack for good, no later block
    passing it by more than the slack (kernels_cu/softmax.cuh, CEILING)."""
    qb, kb, vb, group, scale, two_d = _prepare(q, k, v, layout, scale)
    b, hq, nq, d = qb.shape
    nk = kb.shape[2]
    visibility = _mask.Mask.of(nq, nk, resolve_window(causal, window))
    mods = _ScoreMods(softcap, alibi_slopes, b, hq)
    one_sided = alibi_one_sided and mods.slopes is not None
    if pin_reach is not None and (softcap is None or mods.slopes is not None):
        raise ValueError("pin_reach: the rows are pinned under a softcap alone")
    ke, ve = _expand(kb, group), _expand(vb, group)
    o = np.zeros((b, hq, nq, vb.shape[-1]))
    lse = np.full((b, hq, nq), -np.inf)
    for m0 in range(0, nq, block_m):
        rows = slice(m0, min(m0 + block_m, nq))
        qi = qb[:, :, rows]
        m = np.full(qi.shape[:3], -np.inf)  # running max of the scaled scores
        l_ = np.zeros(qi.shape[:3])  # running sum of exp(s - m)
        acc = np.zeros(qi.shape[:3] + (vb.shape[-1],))  # running sum of exp(s - m) v
        tiles = visibility.key_tiles(m0, block_m, block_n)
        for visit, cols in enumerate(_blocks(tiles, block_n, nk)):
            raw = scale * (qi @ ke[:, :, cols].transpose(0, 1, 3, 2))
            side = _alibi_side(m0, block_m, cols.start, block_n, nk - nq) if one_sided else 0
            one_sided_block = visit >= tiles.masked and side != 0  # unmasked: no mask to apply
            if one_sided_block:
                s, tile_max = _alibi_one_sided(raw, mods, rows, cols, nk - nq, side)
                m_new = np.maximum(m, tile_max)
            else:
                with np.errstate(invalid="ignore"):
                    s, _ = mods.apply(raw, rows, cols, nq, nk)
                mask = visibility.visible(
                    np.arange(rows.start, rows.stop), np.arange(cols.start, cols.stop)
                )
                s = np.where(mask, s, -np.inf)
                m_new = np.maximum(m, s.max(axis=-1))
            if rescale_slack:  # keep m where the block's max passes it by no more than the slack
                with np.errstate(invalid="ignore"):
                    moved = (m_new - m) * math.log2(math.e) > rescale_slack
                m_new = np.where(moved, m_new, m)
            if pin_reach is not None:  # within reach of the cap: pinned (and then kept)
                ln2 = math.log(2.0)
                pinned = m_new >= softcap - pin_reach * ln2
                m_new = np.where(pinned, softcap - rescale_slack * ln2, m_new)
            m_use = np.where(np.isneginf(m_new), 0.0, m_new)  # no -inf - -inf
            alpha = np.exp(m - m_use)
            p = np.exp(s - m_use[..., None])
            l_ = alpha * l_ + p.sum(axis=-1)
            if one_sided_block:
                acc = alpha[..., None] * acc + p @ ve[:, :, cols]
            else:
                acc = alpha[..., None] * acc + _masked_matmul(p, ve[:, :, cols], mask)
            m = m_new
        seen = l_ != 0
        o[:, :, rows] = np.where(seen[..., None], acc / np.where(seen, l_, 1.0)[..., None], 0.0)
        lse[:, :, rows] = np.where(seen, m + np.log(np.where(seen, l_, 1.0)), -np.inf)
    return _from_bhsd(o, layout, two_d), (lse[0, 0] if two_d else lse)


def backward_blockwise(
    do: Array,
    q: Array,
    k: Array,
    v: Array,
    o: Array,
    lse: Array,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bshd",
    block_m: int = 64,
    block_n: int = 64,
    window: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The backward kernels: preprocess D = rowsum(dO * O); the dK/dV pass (per key block, over
    the query blocks and query heads of its group that can see it); the dQ pass (per query block,
    over the key blocks it sees). P is recomputed from lse; dK and dQ are scaled once at the end."""
    qb, kb, vb, group, scale, two_d = _prepare(q, k, v, layout, scale)
    dob, ob = _to_bhsd(do, layout), _to_bhsd(o, layout)
    lseb = _lse_to_bh(lse, two_d)
    b, hq, nq, d = qb.shape
    hkv, nk = kb.shape[1], kb.shape[2]
    visibility = _mask.Mask.of(nq, nk, resolve_window(causal, window))
    mods = _ScoreMods(softcap, alibi_slopes, b, hq)

    def block_mask(rows: slice, cols: slice) -> np.ndarray:
        return visibility.visible(
            np.arange(rows.start, rows.stop), np.arange(cols.start, cols.stop)
        )

    delta = (dob * ob).sum(axis=-1)  # preprocess
    # A row that sees no key (lse = -inf) must give P = 0: use lse = +inf (as the kernels do).
    lse_p = np.where(np.isneginf(lseb), np.inf, lseb)

    def probs(qi, kj, lse_i, rows: slice, cols: slice, heads: Any = slice(None)):
        """(P, dS'/dS) of a block: P recomputed from lse, 0 where hidden."""
        with np.errstate(over="ignore", invalid="ignore"):
            s, dcap = mods.apply(scale * (qi @ kj.transpose(0, 1, 3, 2)), rows, cols, nq, nk, heads)
            p = np.exp(s - lse_i[..., None])
        return np.where(block_mask(rows, cols), p, 0.0), dcap

    dk = np.zeros_like(kb)
    dv = np.zeros_like(vb)
    for n0 in range(0, nk, block_n):  # dK/dV pass
        cols = slice(n0, min(n0 + block_n, nk))
        row_blocks = _blocks(visibility.query_tiles(n0, block_n, block_m), block_m, nq)
        kj, vj = kb[:, :, cols], vb[:, :, cols]
        acc_dk = np.zeros_like(kj)
        acc_dv = np.zeros_like(vj)
        for g in range(group):  # the query heads that share this key/value head
            heads = np.arange(hkv) * group + g  # query head h uses key head h // group
            for rows in row_blocks:
                qi, doi = qb[:, heads, rows], dob[:, heads, rows]
                p, dcap = probs(qi, kj, lse_p[:, heads, rows], rows, cols, heads)
                mask_t = block_mask(rows, cols).T
                acc_dv += _masked_matmul(p.transpose(0, 1, 3, 2), doi, mask_t)
                dp = doi @ vj.transpose(0, 1, 3, 2)
                with np.errstate(invalid="ignore"):  # an Inf input gives NaN, as in the naive form
                    ds = p * (dp - delta[:, heads, rows][..., None]) * dcap
                    acc_dk += _masked_matmul(ds.transpose(0, 1, 3, 2), qi, mask_t)
        dk[:, :, cols] = scale * acc_dk
        dv[:, :, cols] = acc_dv

    dq = np.zeros_like(qb)
    ke, ve = _expand(kb, group), _expand(vb, group)
    for m0 in range(0, nq, block_m):  # dQ pass
        rows = slice(m0, min(m0 + block_m, nq))
        qi, doi = qb[:, :, rows], dob[:, :, rows]
        acc_dq = np.zeros_like(qi)
        for cols in _blocks(visibility.key_tiles(m0, block_m, block_n), block_n, nk):
            p, dcap = probs(qi, ke[:, :, cols], lse_p[:, :, rows], rows, cols)
            dp = doi @ ve[:, :, cols].transpose(0, 1, 3, 2)
            with np.errstate(invalid="ignore"):
                ds = p * (dp - delta[:, :, rows][..., None]) * dcap
            acc_dq += _masked_matmul(ds, ke[:, :, cols], block_mask(rows, cols))
        dq[:, :, rows] = scale * acc_dq
    return (
        _from_bhsd(dq, layout, two_d),
        _from_bhsd(dk, layout, two_d),
        _from_bhsd(dv, layout, two_d),
    )


# ---------------------------------------------------------------------------------------------
# Key/value caches (attention_with_kvcache)


def kvcache_lengths(cache_seqlens: Any, batch: int, default: int) -> np.ndarray:
    """Rows in use of each sequence's cache before the append, int64 (B,): the array, the
    int for every sequence, or `default` (the capacity less the new rows) for None."""
    if cache_seqlens is None:
        cache_seqlens = default
    return np.broadcast_to(np.asarray(cache_seqlens, dtype=np.int64), (batch,)).copy()


def kvcache_rows(b: int, n: int, block_table: Any = None, page_size: int = 1):
    """(page, slot) index arrays of rows 0 .. n - 1 of sequence b: ``(b, r)`` in a contiguous
    cache (block_table None); ``(block_table[b, r // page_size], r % page_size)`` when paged."""
    r = np.arange(n)
    if block_table is None:
        return np.full(n, b), r
    return np.asarray(block_table)[b, r // page_size], r % page_size


def kvcache_keys(cache: Any, seqlens: Any, block_table: Any, b: int) -> Any:
    """The first seqlens[b] rows of sequence b of a cache (contiguous, or paged through
    block_table), in order: shape (seqlens[b], Hkv, d), the cache's dtype."""
    page, slot = kvcache_rows(b, int(seqlens[b]), block_table, cache.shape[1])
    return cache[page, slot]


def kvcache_forward(
    q: Array,
    k_cache: Array,
    v_cache: Array,
    cache_seqlens: Any = None,
    *,
    k_new: Array | None = None,
    v_new: Array | None = None,
    block_table: Any = None,
    causal: bool = False,
    window: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """attention_with_kvcache by its definition: (o, lse, k_cache_after, v_cache_after).

    Copies of the caches get k_new / v_new (B, Nnew, Hkv, d) at rows cache_seqlens[b] ..
    cache_seqlens[b] + Nnew - 1 of each sequence (None: the capacity less Nnew); then sequence b
    is the naive forward of q[b] over its first cache_seqlens[b] + Nnew rows (slopes row b of
    (B, Hq) slopes). o (B, Nq, Hq, d) and lse (B, Hq, Nq) are float64; the caches keep their
    dtype. The inputs are not modified. ValueError for lengths outside 0 .. capacity and for
    pages in use outside the cache."""
    q = np.asarray(q)
    k_after, v_after = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    batch, nq, hq, _ = q.shape
    page_size = k_after.shape[1]
    capacity = page_size * (1 if block_table is None else np.shape(block_table)[1])
    n_new = 0 if k_new is None else np.shape(k_new)[1]
    used = kvcache_lengths(cache_seqlens, batch, capacity - n_new)
    if np.any(used < 0) or np.any(used + n_new > capacity):
        raise ValueError(f"cache_seqlens {used} + {n_new} new rows outside 0 .. {capacity}")
    for b in range(batch):
        page, slot = kvcache_rows(b, int(used[b]) + n_new, block_table, page_size)
        if np.any((page < 0) | (page >= k_after.shape[0])):
            raise ValueError(f"block_table[{b}] lists pages outside the cache: {page}")
        if n_new:
            k_after[page[used[b] :], slot[used[b] :]] = np.asarray(k_new)[b]
            v_after[page[used[b] :], slot[used[b] :]] = np.asarray(v_new)[b]
    slopes = [None] * batch
    if alibi_slopes is not None:  # (Hq,) or (B, Hq): row b is sequence b's
        slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64).reshape(-1, hq), (batch, hq))
    o = np.zeros(q.shape)
    lse = np.full((batch, hq, nq), -np.inf)
    for b in range(batch):
        o_b, lse_b = forward(
            q[b : b + 1],
            kvcache_keys(k_after, used + n_new, block_table, b)[None],
            kvcache_keys(v_after, used + n_new, block_table, b)[None],
            causal=causal,
            scale=scale,
            window=window,
            softcap=softcap,
            alibi_slopes=slopes[b],
        )
        o[b], lse[b] = o_b[0], lse_b[0]
    return o, lse, k_after, v_after
