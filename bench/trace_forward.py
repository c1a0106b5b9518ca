"""Where a work item's time goes in the Hopper TMA forward (attention_forward_tma): clock64 stamps
in each consumer warpgroup and in the producer, on the GPU's own clocks.

A copy of kernels_cu with forward_sm90_tma.cu patched (in a temporary directory) records, for the
first TRACE_BLOCKS blocks and their first TRACE_ITEMS items, clock64 at the end of each phase of an
item (thread 0 of each consumer warpgroup; the producer's thread), the key-tile loop's phases
summed over its tiles, and %globaltimer at each item's start, into a __device__ array read back
after one eager call (the first calls compile and warm up). Printed: the median and p90 cycles of
each phase over items 1.. of every traced block, the SM clock the stamps imply, and an item's
cycles beyond its key tiles' (the loop's cycles per tile times the item's tiles): the fixed
cost of an item that the 1k points pay eight times as often per key as the 4k ones.

    python bench/trace_forward.py [--head-dim 128] [--seq 1024] [--causal] [--dtype bfloat16]

The loops with turns (SCHEDULE_OVERLAP, SCHEDULE_TURNS: every 16-bit table tile below d = 64's 1k
rows and d = 128 / 256; SCHEDULE_SERIAL_TURNS: the FP8 forward at d = 128 and 256, --dtype
float8_e4m3fn, descale factors 1); the serial loop's phases are not stamped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trace_patch import prelude, quantile, traced_call  # noqa: E402

import cuflash  # noqa: E402

TRACE_BLOCKS, TRACE_ITEMS, SLOTS = 32, 48, 24
ROLES = ("consumer 0", "consumer 1", "consumer 2", "producer")
TRACE = prelude("forward_trace", TRACE_BLOCKS, TRACE_ITEMS, SLOTS)
C = "if (tr_on) "  # thread 0 of each consumer warpgroup, role blk.wg, index tr_i
CT = "tr_t = clock64();"  # the loop's phases: tr_t the phase's start, tr_sum[k] += its cycles


# e8, the last P V waited for, and the loop's phase sums: at the end of either loop with turns
LOOP_DONE = (
    f"      {C}TRACE_AT(blk.wg, tr_i, 8);\n"
    f"      {C}for (int k = 0; k < 5; ++k) TRACE_VALUE(blk.wg, tr_i, 18 + k, tr_sum[k]);\n"
)


def lap(k: int) -> str:
    return (
        f"{{ const unsigned long long tr_n = clock64(); tr_sum[{k}] += tr_n - tr_t; tr_t = tr_n; }}"
    )


SOURCE = "forward_sm90_tma.cu"
# (anchor in SOURCE, text before it, text after it). Consumer events: e0 the item's
# start, e1 the item read, e2 set up (before the first turn), e3 the turn taken, e4 S_0 issued
# (K_0 waited), e5 S_0 waited, e6 P_0 ready, e7 the loop done, e8 the last P V waited (lse
# written under it: FINISH_UNDER_PV; the next Q taken there too: UNDER_PV), e9 O normalised
# (FINISH_UNDER_PV instances only), e10 O staged and its store issued, e11 O written from
# registers where not staged; values: e16 globaltimer at e0, e17 the key tiles, e18 .. e22 the
# loop's turns, issues (K / V waits), S waits, softmaxes, P V waits, summed over its tiles.
PATCHES = [
    ('#include "forward_sm90.cuh"\n', "", TRACE),
    (
        "  int qb = UNDER_PV ? acquire_to_read(bar.q_full, round) : 0;\n  for (;;) {\n",
        "  const bool tr_on = (threadIdx.x & 127) == 0;\n  int tr_item = 0;\n",
        "    const int tr_i = tr_item++;\n"
        f"    {C}{{ TRACE_AT(blk.wg, tr_i, 0); TRACE_VALUE(blk.wg, tr_i, 16, trace_global()); }}\n"
        "    unsigned long long tr_sum[5] = {0, 0, 0, 0, 0}, tr_t = 0;\n",
    ),
    (
        "    if (bar.item[qb].last) break;\n",
        f"    {C}TRACE_AT(blk.wg, tr_i, 1);\n",
        "",
    ),
    (
        "    if (count == 0) mbar_arrive(&bar.q_empty[qb]);\n",
        f"    {C}{{ TRACE_AT(blk.wg, tr_i, 2); TRACE_VALUE(blk.wg, tr_i, 17, count); }}\n",
        "",
    ),
    (
        "      if (count > 0) {\n        issue_pv(count - 1);\n",
        f"      {C}TRACE_AT(blk.wg, tr_i, 7);\n",
        "",
    ),
    ("    } else if constexpr (Tr::TURNS) {\n", LOOP_DONE, ""),
    # the serial loop with turns (SCHEDULE_SERIAL_TURNS): its last P V's turn, and after it
    (
        "        turns.begin();\n        issue_pv(count - 1);\n",
        f"        {C}TRACE_AT(blk.wg, tr_i, 7);\n",
        "",
    ),
    ("    } else {\n      auto serial_tile", LOOP_DONE, ""),
    (
        "      blk.softmax.rescale(blk.acc_o, inv_rows);\n",
        "",
        f"      {C}TRACE_AT(blk.wg, tr_i, 9);\n",
    ),
    (
        "    // Otherwise from registers, in 16-byte pieces",
        f"    {C}TRACE_AT(blk.wg, tr_i, 10);\n",
        "",
    ),
    (
        "    if (__any_sync(0xffffffffu, repair != 0)) {  // rare",
        f"    {C}TRACE_AT(blk.wg, tr_i, 11);\n",
        "",
    ),
    # the producer (role 3, indexed by its items): e0 before Q's buffer is free, e1 after, e2 the
    # item's loads issued; e16 globaltimer at e0; e18 the waits for free K / V stages, summed
    (
        "    int pipe = 0;  // key tiles of earlier items",
        "    int tr_item = 0;\n    unsigned long long tr_kv = 0;\n",
        "",
    ),
    (
        "        mbar_wait(&empty[stage], ((tile / STAGES) & 1) ^ 1);\n",
        "        const unsigned long long tr_w = clock64();\n",
        "        tr_kv += clock64() - tr_w;\n",
    ),
    (
        "      const int qb = acquire_to_fill(bar.q_empty, round);\n      bar.item[qb] =",
        "      const int tr_i = tr_item++;\n"
        "      TRACE_AT(3, tr_i, 0); TRACE_VALUE(3, tr_i, 16, trace_global());\n",
        "",
    ),
    (
        "      mbar_arrive_expect_tx(&bar.q_full[qb], Tr::Q_BYTES);\n",
        "      TRACE_AT(3, tr_i, 1);\n",
        "",
    ),
    (
        "      pipe += count;\n    }\n    const int qb = acquire_to_fill",
        "      TRACE_AT(3, tr_i, 2); TRACE_VALUE(3, tr_i, 18, tr_kv); tr_kv = 0;\n",
        "",
    ),
]
# The first key tile and the loop's, stamped (REPLACEMENTS)
FIRST_TILE = (
    f"      turns.begin();\n      {C}TRACE_AT(blk.wg, tr_i, 3);\n"
    f"      issue_scores(0);\n      turns.end();\n      {C}TRACE_AT(blk.wg, tr_i, 4);\n"
    f"      wgmma_wait<0>();\n      {C}TRACE_AT(blk.wg, tr_i, 5);\n"
    "      softmax_tile(0);\n"
    f"      {C}TRACE_AT(blk.wg, tr_i, 6);\n"
)
LOOP_TILE = (
    f"        {CT}\n        turns.begin();\n        {lap(0)}\n"
    "        issue_scores(it);\n        issue_pv(it - 1);\n"
    f"        turns.end();\n        {lap(1)}\n"
    f"        wgmma_wait<1>();  // S_it\n        {lap(2)}\n"
    f"        probabilities(it);\n        {lap(3)}\n"
    f"        wgmma_wait<0>();  // P_{{it-1}} V_{{it-1}}\n        {lap(4)}\n"
)
# The serial loop with turns: lap 1 holds the turn's products, P V waited for among them
SERIAL_TURNS_TILE = (
    f"        {CT}\n        turns.begin();\n        {lap(0)}\n"
    "        issue_pv(it - 1);\n        wgmma_wait<0>();\n        pv_done(it - 1);\n"
    f"        issue_scores(it);\n        turns.end();\n        {lap(1)}\n"
    f"        wgmma_wait<0>();\n        {lap(2)}\n"
    f"        softmax_tile(it);\n        {lap(3)}\n"
)
REPLACEMENTS = [
    (
        "      turns.begin();\n      issue_scores(0);\n      turns.end();\n"
        "      wgmma_wait<0>();\n      softmax_tile(0);\n",
        FIRST_TILE,
    ),
    (
        "        turns.begin();\n        issue_pv(it - 1);\n        wgmma_wait<0>();\n"
        "        pv_done(it - 1);\n        issue_scores(it);\n        turns.end();\n"
        "        wgmma_wait<0>();\n        softmax_tile(it);\n",
        SERIAL_TURNS_TILE,
    ),
    (
        "        turns.begin();\n        issue_scores(it);\n        issue_pv(it - 1);\n"
        "        turns.end();\n        wgmma_wait<1>();  // S_it\n"
        "        probabilities(it);\n        wgmma_wait<0>();  // P_{it-1} V_{it-1}\n",
        LOOP_TILE,
    ),
]

# (role, label, from event, to event); "next" = the next item's e0
PHASES = [
    ("the item read (its Q waited for: BN > 128)", 0, 1),
    ("set-up", 1, 2),
    ("first turn's wait", 2, 3),
    ("S_0 issued (K_0's wait)", 3, 4),
    ("S_0 waited", 4, 5),
    ("softmax of S_0", 5, 6),
    ("the loop (tiles 1 ..)", 6, 7),
    ("the last P V (lse; next Q where BN <= 128)", 7, 8),
    ("O normalised", 8, 9),
    ("O staged and stored", 9, 10),
    ("O from registers (not staged)", 10, 11),
    ("to the next item", 11, "next"),
    ("item", 0, "next"),
]
LOOP_PARTS = (
    "turn's wait",
    "S, P V issued (K, V waits; serial turns: P V waited)",
    "S waited",
    "softmax",
    "P V waited (pipelined)",
)


def report(raw: list[int]) -> None:
    def slot(b: int, role: int, i: int) -> list[int]:
        at = ((b * 4 + role) * TRACE_ITEMS + i) * SLOTS
        return raw[at : at + SLOTS]

    def items(b: int, role: int) -> list[int]:
        return [i for i in range(TRACE_ITEMS) if slot(b, role, i)[0]]

    blocks = [b for b in range(TRACE_BLOCKS) if slot(b, 0, 0)[0]]
    rates = []
    for b in blocks:
        its = items(b, 0)
        first, last = slot(b, 0, its[0]), slot(b, 0, its[-1])
        if last[16] > first[16]:
            rates.append((last[0] - first[0]) / (last[16] - first[16]) * 1e3)
    clock = statistics.median(rates) if rates else float("nan")
    print(f"{len(blocks)} blocks traced; SM clock from the stamps {clock:.0f} MHz")
    print(f"{'role':11s} {'phase':40s} {'median':>7s} {'p90':>7s} (cycles)")
    consumers = [r for r in range(3) if any(slot(b, r, 0)[0] for b in blocks)]
    for role in consumers:
        rows: dict[str, list[float]] = {}
        per_tile, overhead = [], []
        for b in blocks:
            its = items(b, role)
            for i in its[1:-1]:  # the first item's set-up and the end-of-walk post excluded
                a, z = slot(b, role, i), slot(b, role, i + 1)
                if not (a[11] and z[0]):
                    continue
                for label, e0, e1 in PHASES:
                    end = z[0] if e1 == "next" else a[e1]
                    if a[e0] and end:  # both ends stamped (e9: FINISH_UNDER_PV instances only)
                        rows.setdefault(label, []).append(end - a[e0])
                tiles = a[17]
                for k, label in enumerate(LOOP_PARTS):
                    rows.setdefault("  loop: " + label + " / tile", []).append(
                        a[18 + k] / max(1, tiles - 1)
                    )
                if tiles > 1:
                    per_tile.append((a[7] - a[6]) / (tiles - 1))
                    overhead.append((z[0] - a[0]) - tiles * (a[7] - a[6]) / (tiles - 1))
        for label, xs in rows.items():
            print(
                f"{ROLES[role]:11s} {label:40s} {statistics.median(xs):7.0f} "
                f"{quantile(xs, 0.9):7.0f}"
            )
        if per_tile:
            print(
                f"{ROLES[role]:11s} {'a key tile in the loop':40s} "
                f"{statistics.median(per_tile):7.0f} {quantile(per_tile, 0.9):7.0f}"
            )
            print(
                f"{ROLES[role]:11s} {'item beyond its tiles at the loop rate':40s} "
                f"{statistics.median(overhead):7.0f} {quantile(overhead, 0.9):7.0f}"
            )
    waits, loads, kv = [], [], []
    for b in blocks:
        for i in items(b, 3)[1:]:
            a = slot(b, 3, i)
            waits.append(a[1] - a[0])
            loads.append(a[2] - a[1])
            kv.append(a[18])
    if waits:
        for label, xs in (
            ("Q buffer's wait (q_empty)", waits),
            ("the item's K / V loads issued", loads),
            ("  of which waits for a free stage", kv),
        ):
            print(
                f"{ROLES[3]:11s} {label:40s} {statistics.median(xs):7.0f} {quantile(xs, 0.9):7.0f}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn")
    )
    args = parser.parse_args()
    import torch  # here: the patches above are read by the CPU tests, which have no torch

    b, n, d = max(1, 16384 // args.seq), args.seq, args.head_dim
    h = 2048 // d
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(b, n, h, d, device="cuda").to(dtype) for _ in range(3))
    forward = cuflash.attention_forward_fp8 if dtype.itemsize == 1 else cuflash.attention_forward
    raw = traced_call(
        lambda: forward(q, k, v, causal=args.causal),
        SOURCE,
        PATCHES,
        "attention_forward_tma",
        "forward_trace",
        TRACE_BLOCKS * 4 * TRACE_ITEMS * SLOTS,
        replacements=REPLACEMENTS,
    )
    if raw is None:
        print("no TMA forward module was loaded")
        return 1
    print(f"{args.dtype} d={d} B={b} N={n} H={h} causal={args.causal}")
    report(raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
