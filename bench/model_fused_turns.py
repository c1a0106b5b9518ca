"""A time-stepped model of the fused backward's turns under a bound (CPU only): what the writer's
chain of a tile costs, and what buffering or reordering the additions could win back.

Per block (the kernel's bounded walk, tests/test_dispatch.py's bounded_walk): the consumers compute
a query step (1 unit of time), wait for a free staging buffer (K of them), stage it and go on (an
epilogue after each item); the writer, one thread, takes a staged tile in its turn (the addition
before it visible), reads it (`read`: the buffer is free again), releases the tile's counter
(`release`; visible to the next block `handoff` later) and walks on (`setup`). In order, or
(--any-ready) the first of the K staged tiles whose turn has come. Times in units of a step; the
defaults are the H200's d = 128 figures at 1.78 GHz (docs/perf/NOTES.md v42: a step ~2.3 us, the
reduction's read 0.81 us, fence and release 0.57 us, the hand-off 0.35 us, the walk 0.19 us).
Printed: each variant's time over the same walk's without turns.

    python bench/model_fused_turns.py [--seq 4096] [--heads 64] [--grid 132]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_dispatch import bounded_walk  # noqa: E402

CHAIN = {"read": 0.35, "release": 0.24, "handoff": 0.15, "setup": 0.08}


def simulate(walks, buffers=1, any_ready=False, turns=True, epilogue=1.0, dt=0.01, **chain):
    """The time the last block ends."""
    c = {**CHAIN, **chain}
    blocks = len(walks)
    steps = [
        [(s, i == len(item) - 1) for item in walk for i, s in enumerate(item)] for walk in walks
    ]
    visible: dict[tuple, float] = {}  # (tile, turn): when that addition is visible to all
    nxt = [0] * blocks  # the consumers' next step
    busy = [0.0] * blocks  # the consumers' step (or epilogue) ends
    computing = [False] * blocks
    staged: list[list[tuple]] = [[] for _ in range(blocks)]
    used, freed = [0] * blocks, [[] for _ in range(blocks)]  # buffers in use; when they free
    writer = [0.0] * blocks  # the writer is free from
    done, left, t = [False] * blocks, blocks, 0.0
    while left:
        for b in range(blocks):
            if done[b]:
                continue
            while freed[b] and freed[b][0] <= t:
                freed[b].pop(0)
                used[b] -= 1
            while True:  # the consumers
                if computing[b]:
                    if busy[b] > t or used[b] >= buffers:
                        break
                    step, last = steps[b][nxt[b]]
                    used[b] += 1
                    staged[b].append(step)
                    computing[b], nxt[b] = False, nxt[b] + 1
                    busy[b] = t + epilogue if last else t
                if nxt[b] < len(steps[b]) and busy[b] <= t:
                    computing[b], busy[b] = True, t + 1.0
                else:
                    break
            if writer[b] <= t and staged[b]:  # the writer
                for tile, turn in staged[b][: buffers if any_ready else 1]:
                    if not turns or turn == 0 or visible.get((tile, turn - 1), 1e30) <= t:
                        staged[b].remove((tile, turn))
                        freed[b] = sorted(freed[b] + [t + c["read"]])
                        visible[(tile, turn)] = t + c["read"] + c["release"] + c["handoff"]
                        writer[b] = t + c["read"] + c["release"] + c["setup"]
                        break
            if nxt[b] == len(steps[b]) and not staged[b] and not computing[b]:
                done[b], left = True, left - 1
        t += dt
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=64, help="batch x heads")
    parser.add_argument("--grid", type=int, default=132)
    args = parser.parse_args()
    _, walks = bounded_walk(args.seq, args.seq, (None, 0), 1, args.heads, args.grid, bm=64)
    free = simulate(walks, turns=False)
    variants = [
        ("the kernel (one buffer, in order)", {}),
        ("two buffers, in order", {"buffers": 2}),
        ("two buffers, any ready", {"buffers": 2, "any_ready": True}),
        ("release 0.05", {"release": 0.05}),
        ("read 0.1", {"read": 0.1}),
        ("hand-off 0.3 (warp 2's, v42 v1)", {"handoff": 0.3}),
        ("every latency halved", {k: v / 2 for k, v in CHAIN.items()}),
    ]
    head = f"causal, N = {args.seq}, {args.heads} heads, {args.grid} blocks"
    print(f"{head}: x the walk without turns")
    for label, kw in variants:
        print(f"  {label:34s} {simulate(walks, **kw) / free:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
