"""A model of the TMA forward's persistent schedule: how much of the causal work is useful, and
how evenly the blocks share it, with no GPU.

Counts key tiles, not time: each work item (a query row block of one head) costs the key tiles
it runs, and block g of the persistent grid runs the items WorkWalk gives it
(kernels_cu/common.cuh: causal pairs 2i, 2i + 1 of each round of 2G, heavy with light by
decode_paired_work). Efficiency = useful tiles (N (N + 1) / 2 of the score matrix under causal
masking, N^2 without) / (G x the busiest block's tiles): the fraction of the tensor-core time that
a perfect per-tile kernel would spend on useful work. It leaves out everything per tile (masking,
the softmax) and per item (the epilogue), so it bounds what the schedule costs, not the kernel.

    python bench/schedule_model.py [--seq 2048 4096 8192 16384] [--sms 132]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuflash import _kernels  # noqa: E402

# The library's causal row-block alignment, restored after each comparison of the two.
default_alignment = _kernels.causal_end_aligned()


def block_tiles(m0: int, bm: int, bn: int, n: int, causal: bool) -> int:
    """Key tiles of the rows [m0, m0 + bm) of a sequence of n (Nq == Nk), mask.cuh's count."""
    last_row = min(m0 + bm, n) - 1
    return -(-(last_row + 1) // bn) if causal else -(-n // bn)


def schedule(n: int, bm: int, bn: int, heads: int, causal: bool, sms: int) -> dict[str, float]:
    """Useful / computed tiles, mean / busiest block, and their product, for one launch."""
    slots, shift = _kernels.causal_row_slots(n, bm, causal)
    work = heads * slots
    grid = min(-(-work // (2 if causal else 1)), sms)
    load = [0] * grid
    for item in range(work):
        pos = item % slots
        if causal:
            slot = pos >> 1 if pos & 1 else slots - 1 - (pos >> 1)
            block = (item // 2) % grid
        else:
            slot, block = pos, item % grid
        m0 = slot * bm - shift
        if m0 + bm <= 0:
            continue
        load[block] += block_tiles(m0, bm, bn, n, causal)
    useful = heads * (n * (n + 1) / 2 if causal else n * n) / (bm * bn)
    computed = sum(load)
    return {
        "useful": useful / computed,
        "balance": computed / grid / max(load),
        "efficiency": useful / (grid * max(load)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dim", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args(argv)
    print(
        f"{'d':>3} {'tiles':>10} {'N':>6} | {'full':>5} | causal start: useful balance eff | "
        "end: useful balance eff | causal/full start end"
    )
    for d in args.head_dim:
        tile_sets = {
            _kernels.tma_spec("forward", "bfloat16", d, "sm_90a", n, c)
            for n in args.seq
            for c in (False, True)
        }
        for spec in sorted(tile_sets, key=lambda s: s.rows_per_block):
            bm, bn = spec.rows_per_block, spec.rows_per_step
            for n in args.seq:
                heads = (16384 // n) * (2048 // d)
                full = schedule(n, bm, bn, heads, False, args.sms)["efficiency"]
                rows = []
                for end in (False, True):
                    _kernels.set_causal_end_aligned(end)
                    rows.append(schedule(n, bm, bn, heads, True, args.sms))
                _kernels.set_causal_end_aligned(default_alignment)
                start, end_ = rows
                print(
                    f"{d:3d} {f'({bm},{bn})':>10} {n:6d} | {full:5.3f} | "
                    f"{start['useful']:.3f} {start['balance']:.3f} {start['efficiency']:.3f} | "
                    f"{end_['useful']:.3f} {end_['balance']:.3f} {end_['efficiency']:.3f} | "
                    f"{start['efficiency'] / full:.3f} {end_['efficiency'] / full:.3f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
