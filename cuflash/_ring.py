"""Ring attention (context parallelism) over torch.distributed: exact attention over a sequence
split across ranks, built on cuflash's forward (which returns the logsumexp) and backward (which
takes o and lse).

Each of P ranks holds a zigzag shard of the sequence: cut into 2P equal chunks, rank r holds
chunks r and 2P - 1 - r, concatenated in that order along the sequence axis, which gives every
rank the same causal work. The key/value shards travel around the ring (rank r sends to r + 1 and
receives from r - 1), P steps; at each step a rank attends its two query chunks to the two
key/value chunks it holds. Under a mask (causal, a window) each pair of chunks is one call on the
rectangle of its rows and keys that see anything, with the window that rectangle's bottom-right
alignment needs (_rectangle): the diagonal pair is a causal call, a pair below the diagonal a
plain one, a pair the mask hides no call. The partial results are merged with their logsumexps
in float32 (float64 for float64 inputs); the backward runs cuflash's backward on each call with
the merged o and lse (so each pair's P is the global softmax), adds dQ locally and passes dK/dV
accumulators (float32) around the ring with their key/value shard, one more hop returning them
to the owner; a step's contributions are added to the accumulator when it arrives, so that its
transfer overlaps the step's products.
Additions happen in a fixed order: the result is deterministic for a given number of ranks.

Communication: asynchronous point-to-point (torch.distributed.batch_isend_irecv) on the
process group's backend (NCCL for CUDA tensors, gloo for CPU tensors, where the NumPy backend
computes); the next shard is in flight while the current one is computed (two buffers). Grouped
heads send only the Hkv heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _combine, _validate, api

LAYOUTS = {"bshd": 1, "bhsd": 2}  # the sequence axis of each layout


def _check_layout(layout: object) -> int:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout must be 'bshd' (B, N, H, d) or 'bhsd' (B, H, N, d); got {layout!r}"
        )
    return LAYOUTS[layout]


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring_attention needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def _check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    return world_size


def zigzag_shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of a full sequence: x cut into 2 world_size equal chunks along
    `dim` (1 for bshd, 2 for bhsd), chunks rank and 2 world_size - 1 - rank, concatenated."""
    world_size = _check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}); got {rank!r}")
    n = x.shape[dim]
    if n % (2 * world_size):
        raise ValueError(
            f"the sequence (dim {dim}, length {n}) must split into 2 x world_size = "
            f"{2 * world_size} equal chunks"
        )
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def zigzag_unshard(
    shards: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int = 1
) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard (shards[r] from rank r): the inverse of
    zigzag_shard."""
    world_size = len(shards)
    if world_size < 1:
        raise ValueError("shards must hold one shard per rank; got none")
    halves = [s.chunk(2, dim) for s in shards]
    ordered = [halves[i][0] for i in range(world_size)]
    ordered += [halves[world_size - 1 - i][1] for i in range(world_size)]
    return torch.cat(ordered, dim)


def _exchange(
    send: list[torch.Tensor], group, world_size: int, rank: int, tag: int = 0
) -> tuple[list, list]:
    """Posts sending `send` to the next rank and receiving as many tensors from the previous one;
    returns (requests, received buffers, the tensors sent: held until the requests complete).
    Ranks are translated to the default group's. Every rank posts its exchanges in the same order
    (tag: key/value shards 0, dK/dV accumulators 1)."""
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    if group is not None:
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    received = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prev, group, tag) for t in received]
    return dist.batch_isend_irecv(ops), received, send


def _rectangle(q_id: int, k_id: int, chunk: int, left, right):
    """The call that computes query chunk q_id against key chunk k_id under the global band
    x - left <= y <= x + right (None: unbounded; positions along the whole sequence): (rows, keys,
    window) with rows and keys slices of the chunks (those that see / are seen by anything) and the
    window that gives the band on that rectangle, whose mask cuflash aligns bottom-right; None
    where the mask hides the whole pair. Within the chunks, y - x = y' - x' - delta, so the band is
    y' - x' in [delta - left, delta + right]; on rows [x0, x1) and keys [y0, y1) a call with
    window (l, r) sees y' - x' in [y1 - x1 - l, y1 - x1 + r]."""
    delta = (q_id - k_id) * chunk
    x0 = 0 if right is None else max(0, -delta - right)
    x1 = chunk if left is None else min(chunk, chunk - delta + left)
    y0 = 0 if left is None else max(0, delta - left)
    y1 = chunk if right is None else min(chunk, chunk + delta + right)
    if x0 >= x1 or y0 >= y1:
        return None
    offset = y1 - x1
    window_left = None if left is None else offset - (delta - left)
    window_right = None if right is None else delta + right - offset
    # a side that reaches past the rectangle is unbounded there
    if window_left is not None and window_left >= x1 - x0 + y1 - y0:
        window_left = None
    if window_right is not None and window_right >= x1 - x0 + y1 - y0:
        window_right = None
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return slice(x0, x1), slice(y0, y1), window


def _calls(rank: int, owner: int, world_size: int, chunk: int, band):
    """(query half, key half, rows, keys, window) of every call of one ring step: this rank's
    query chunks (rank, 2P - 1 - rank) against the key/value chunks of `owner`'s shard."""
    q_ids = (rank, 2 * world_size - 1 - rank)
    k_ids = (owner, 2 * world_size - 1 - owner)
    for qi, q_id in enumerate(q_ids):
        for ki, k_id in enumerate(k_ids):
            rect = _rectangle(q_id, k_id, chunk, *band)
            if rect is not None:
                yield (qi, ki, *rect)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]], seq_dim: int):
    """(o, lse) over the union of the parts' key sets (cuflash.combine's merge)."""
    o = torch.stack([part[0] for part in parts])
    lse = torch.stack([part[1] for part in parts])
    return _combine.merge(o, lse, bshd=seq_dim == 1)


def _rows(x: torch.Tensor, seq_dim: int, rows: slice) -> torch.Tensor:
    return x.narrow(seq_dim, rows.start, rows.stop - rows.start)


def _whole_rows(part, rows: slice, chunk: int, seq_dim: int):
    """A call's (o, lse) on rows `rows` of a chunk as (o, lse) of all its rows: the others see
    no key of that call (o = 0, lse = -inf)."""
    o_rows, lse_rows = part
    if rows.start == 0 and rows.stop == chunk:
        return part
    o_shape = list(o_rows.shape)
    o_shape[seq_dim] = chunk
    o = o_rows.new_zeros(o_shape)
    lse = lse_rows.new_full((*lse_rows.shape[:-1], chunk), -float("inf"))
    _rows(o, seq_dim, rows).copy_(o_rows)
    lse[..., rows].copy_(lse_rows)
    return o, lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, band, scale, layout):
        seq_dim = _check_layout(layout)
        world_size, rank = _world(group)
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        options = dict(scale=scale, layout=layout)
        chunk = q.shape[seq_dim] // 2
        q_halves = q.chunk(2, seq_dim)
        parts: list[list] = [[], []]
        block = [k.contiguous(), v.contiguous()]
        for step in range(world_size):
            pending = None
            if step + 1 < world_size:  # the next shard travels while this one is computed
                pending = _exchange(block, group, world_size, rank)
            owner = (rank - step) % world_size
            if band == (None, None):  # every pair visible: one call on the whole shards
                o_s, lse_s = api.attention_forward(q, *block, **options)
                for qi, (o_h, lse_h) in enumerate(
                    zip(o_s.chunk(2, seq_dim), lse_s.chunk(2, -1), strict=True)
                ):
                    parts[qi].append((o_h, lse_h))
            else:
                k_halves, v_halves = block[0].chunk(2, seq_dim), block[1].chunk(2, seq_dim)
                for qi, ki, rows, keys, window in _calls(rank, owner, world_size, chunk, band):
                    part = api.attention_forward(
                        _rows(q_halves[qi], seq_dim, rows),
                        _rows(k_halves[ki], seq_dim, keys),
                        _rows(v_halves[ki], seq_dim, keys),
                        window=window,
                        **options,
                    )
                    parts[qi].append(_whole_rows(part, rows, chunk, seq_dim))
            if pending is not None:
                for request in pending[0]:
                    request.wait()
                block = pending[1]
        merged = [_merge(p, seq_dim) for p in parts]
        o = torch.cat([m[0] for m in merged], seq_dim).to(q.dtype)
        lse = torch.cat([m[1] for m in merged], -1).to(acc_dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.ring = (group, band, scale, layout)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        group, band, scale, layout = ctx.ring
        seq_dim = LAYOUTS[layout]
        world_size, rank = _world(group)
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        options = dict(scale=scale, layout=layout)
        chunk = q.shape[seq_dim] // 2
        do = do.contiguous()
        q_halves, o_halves, do_halves = (x.chunk(2, seq_dim) for x in (q, o, do))
        lse_halves = lse.chunk(2, -1)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dq_halves = dq.chunk(2, seq_dim)
        block = [k.contiguous(), v.contiguous()]
        # The dK/dV accumulator of the shard held at step s comes from the previous rank, which held
        # that shard at step s - 1; this step's contributions go into a zeroed buffer meanwhile
        # and are added to it (received first) once it has arrived, then it moves on: its
        # transfer overlaps the next step's products.
        accumulator = None  # (requests, buffers) of the accumulator in flight to this rank
        for step in range(world_size):
            pending = None
            if step + 1 < world_size:  # prefetch the next key/value shard
                pending = _exchange(block, group, world_size, rank)
            owner = (rank - step) % world_size
            grads = [torch.zeros(k.shape, dtype=acc_dtype, device=k.device) for _ in range(2)]
            if band == (None, None):
                calls = [(None, None, slice(0, 2 * chunk), slice(0, 2 * chunk), None)]
                halves = [(do,), (q,), (o,), (lse,), (dq,)], [(block[0],), (block[1],)]
                keys_of = [(grads[0],), (grads[1],)]
            else:
                calls = list(_calls(rank, owner, world_size, chunk, band))
                halves = (
                    [do_halves, q_halves, o_halves, lse_halves, dq_halves],
                    [
                        block[0].chunk(2, seq_dim),
                        block[1].chunk(2, seq_dim),
                    ],
                )
                keys_of = [grads[0].chunk(2, seq_dim), grads[1].chunk(2, seq_dim)]
            (do_h, q_h, o_h, lse_h, dq_h), (k_h, v_h) = halves
            for qi, ki, rows, keys, window in calls:
                qi, ki = qi or 0, ki or 0
                dq_p, dk_p, dv_p = api.attention_backward(
                    _rows(do_h[qi], seq_dim, rows),
                    _rows(q_h[qi], seq_dim, rows),
                    _rows(k_h[ki], seq_dim, keys),
                    _rows(v_h[ki], seq_dim, keys),
                    _rows(o_h[qi], seq_dim, rows),
                    lse_h[qi][..., rows].contiguous(),
                    window=window,
                    **options,
                )
                _rows(dq_h[qi], seq_dim, rows).add_(dq_p.to(acc_dtype))
                _rows(keys_of[0][ki], seq_dim, keys).add_(dk_p.to(acc_dtype))
                _rows(keys_of[1][ki], seq_dim, keys).add_(dv_p.to(acc_dtype))
            if accumulator is not None:
                for request in accumulator[0]:
                    request.wait()
                grads = [held + new for held, new in zip(accumulator[1], grads, strict=True)]
            # the accumulator follows its shard; after the last step one hop takes it home
            if world_size > 1:
                accumulator = _exchange(grads, group, world_size, rank, tag=1)
            if pending is not None:
                for request in pending[0]:
                    request.wait()
                block = pending[1]
        if accumulator is not None:
            for request in accumulator[0]:
                request.wait()
            grads = accumulator[1]
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    layout: str = "bshd",
) -> torch.Tensor:
    """This rank's shard of exact attention over a sequence split across the ranks of `group`.

    q, k, v: this rank's zigzag shards (zigzag_shard: chunks r and 2P - 1 - r of the sequence, in
    that order), ``(B, n, H, d)`` (bshd) or ``(B, H, n, d)`` (bhsd) with n even and the same on
    every rank; k and v may have fewer heads (grouped heads). causal and window=(left, right)
    (None or -1 unbounded) as in cuflash.attention, over positions in the whole sequence.
    scale defaults to 1 / sqrt(d). Differentiable (autograd); deterministic for a given number
    of ranks. Every rank of the group must call it with shards of the same shapes."""
    seq_dim = _check_layout(layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions ({layout}); got shape {tuple(x.shape)}"
            )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    n = q.shape[seq_dim]
    if n % 2 or k.shape[seq_dim] != n or v.shape[seq_dim] != n:
        raise ValueError(
            f"q, k and v must be zigzag shards of one sequence (two equal chunks each): sequence "
            f"lengths {n}, {k.shape[seq_dim]}, {v.shape[seq_dim]} along dim {seq_dim}"
        )
    band = _validate.check_window(window, causal)  # (left, right), None: unbounded
    _world(group)
    return _RingAttention.apply(q, k, v, group, band, scale, layout)
