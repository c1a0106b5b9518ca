"""The fused backward's rotated order (no mask) in bench/model_fused_turns.py's time-stepped model
(CPU only): when the turns' chain, rather than the consumers, sets the step, and what a walk whose
waves hold fewer of each head's items would give back.

The kernel's walk (WorkWalk, unpaired: item i is step i // grid of block i % grid) and its turns
(FusedDqOrder, mirrored by tests/test_dispatch.py's fused_turns): within a wave, a head's m items
start their visits of the head's query steps span / m apart, and each tile's additions come in the
order the items reach it. With --split K the walk is reordered: K heads at a time, the first half
of each one's key blocks, then the second halves, so that a wave holds about half of each head's
items; the rotated offsets and the turns (the order of arrival, as the kernel's) follow from the
waves. The chain, in units of a consumers' step: the defaults are the H200's d = 256 figures
(docs/perf/NOTES.md v43: a consumers' step ~5,500 cycles, the read of both halves 3,375, the
release 1,428, the hand-off 0.61 us ~1,090, the walk 448). Printed: the time over the same walk's
without turns.

    python bench/model_fused_rotated.py [--seq 4096] [--heads 32] [--block 64] [--split 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_fused_turns import simulate  # noqa: E402

D256 = {"read": 0.61, "release": 0.26, "handoff": 0.2, "setup": 0.08}


def walk_order(heads: int, n: int, split: int) -> list[tuple[int, int]]:
    """(head, position) of each walk index: heads in order, or `split` heads at a time by halves."""
    if split <= 1:
        return [(h, pos) for h in range(heads) for pos in range(n)]
    order = []
    for g in range(0, heads, split):
        group = range(g, min(g + split, heads))
        for lo, hi in ((0, n // 2), (n // 2, n)):
            order += [(h, pos) for h in group for pos in range(lo, hi)]
    return order


def rotated_walks(heads: int, n: int, tiles: int, grid: int, split: int = 1) -> list[list]:
    """Each block's items in walk order, an item being the (tile, turn) of each of its steps."""
    order = walk_order(heads, n, split)
    visits = {}  # walk index -> the query steps it visits, in order
    for w0 in range(0, len(order), grid):
        wave = range(w0, min(w0 + grid, len(order)))
        for h in {order[i][0] for i in wave}:
            mine = sorted((i for i in wave if order[i][0] == h), key=lambda i: order[i][1])
            m = len(mine)
            span = tiles  # one query head a KV head here (steps = tiles)
            for r, i in enumerate(mine):
                offset = r * span // m
                visits[i] = [(offset + s) % tiles for s in range(tiles)]
    # turns: each tile's additions in the order the items reach it (wave, local step, walk index)
    arrivals: dict[tuple, list] = {}
    for i, qs in visits.items():
        for s, q in enumerate(qs):
            arrivals.setdefault((order[i][0], q), []).append((i // grid, s, i))
    turn = {}
    for tile, visitors in arrivals.items():
        for t, (_, _, i) in enumerate(sorted(visitors)):
            turn[(i, tile)] = t
    walks = []
    for b in range(grid):
        walk = []
        for i in range(b, len(order), grid):
            h = order[i][0]
            walk.append([((h, q), turn[(i, (h, q))]) for q in visits[i]])
        walks.append(walk)
    return walks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32, help="batch x heads")
    parser.add_argument("--block", type=int, default=64, help="keys a block (d = 256: 64)")
    parser.add_argument("--rows", type=int, default=64, help="rows a query tile")
    parser.add_argument("--grid", type=int, default=132)
    parser.add_argument("--split", type=int, default=4, help="heads a group of the split walk")
    args = parser.parse_args()
    n, tiles = -(-args.seq // args.block), -(-args.seq // args.rows)
    head = f"rotated, N = {args.seq}, {args.heads} heads, {n} key blocks, {args.grid} blocks"
    print(f"{head}: x the walk without turns")
    for label, split in (
        ("heads in order (the kernel)", 1),
        (f"split by {args.split}", args.split),
    ):
        walks = rotated_walks(args.heads, n, tiles, args.grid, split)
        free = simulate(walks, turns=False, epilogue=0.5, dt=0.02)
        for chain_label, chain in (("d = 256 chain", D256), ("chain x 0.8", None)):
            chain = chain or {k: v * 0.8 for k, v in D256.items()}
            took = simulate(walks, epilogue=0.5, dt=0.02, **chain)
            print(f"  {label:28s} {chain_label:14s} {took / free:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
