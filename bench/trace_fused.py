"""Where a fused backward step's time goes: clock64 stamps in the consumers, the writer and the
loader of attention_backward_fused_tma (d = 64 and 128, which stage dQ_part in a tile of its own,
and d = 256, which stages it in the step's Q and dO buffers), on the GPU's own clocks.

A copy of kernels_cu with backward_sm90_fused.cu patched (in a temporary directory) records, for
the first TRACE_BLOCKS blocks and their first TRACE_STEPS query steps, clock64 at each phase's end
and %globaltimer at each step's start and at the writer's turn (acquired, released), into a
__device__ array read back after one eager call (the first calls compile and warm up). Printed:
the median and p90 cycles of each phase over steps 4.. of every traced block, the SM clock the
stamps imply, and the writer's hand-offs: how long after the previous addition to a tile was
released the next block's writer saw its turn, where it was already waiting.

    python bench/trace_fused.py [--head-dim 128] [--seq 4096] [--heads 16] [--causal]

Run under `ncu --clock-control base -k regex:fused --metrics gpu__time_duration.sum` for the same
stamps at the locked clock (ncu replays nothing for one metric: the array holds that launch's).
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
from cuflash import testing  # noqa: E402
from cuflash._dispatch import KernelChoice  # noqa: E402

TRACE_BLOCKS, TRACE_STEPS, SLOTS = 64, 160, 16
ROLES = ("consumer 0", "consumer 1", "writer", "loader")
TRACE = prelude(
    "fused_trace",
    TRACE_BLOCKS,
    TRACE_STEPS,
    SLOTS,
    skip="  if (role == 2 && (threadIdx.x >> 5) == 3) return nullptr;  // HALF_WRITERS: the first "
    "half's\n",
)
C = "if (tid == 0) "  # the consumers: thread 0 of each warpgroup, role wg

SOURCE = "backward_sm90_fused.cu"
# (anchor in SOURCE, text before it, text after it)
PATCHES = [
    ('#include "tma.cuh"\n', "", TRACE),
    # consumers (the non-DQ_IN_STAGE path): e0 before the stage wait .. e7 after dV and dK
    (
        "      mbar_wait(&bar.q_full[stage], (pipe / STAGES) & 1);\n",
        f"      {C}{{ TRACE_AT(wg, pipe, 0); TRACE_GLOBAL(wg, pipe, 8); }}\n",
        f"      {C}TRACE_AT(wg, pipe, 1);\n",
    ),
    (
        "        keys.issue_scores(q_tile, do_tile);\n        wgmma_wait<0>();\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 2);\n",
    ),
    (
        "        named_barrier_sync(1, CONSUMER_THREADS);  // both consumers' keys are in\n",
        f"        {C}TRACE_AT(wg, pipe, 3);\n",
        f"        {C}TRACE_AT(wg, pipe, 4);\n",
    ),
    (
        "        wgmma_wait<1>();                       // dQ_part's group\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 5);\n",
    ),
    (
        "          mbar_wait(&bar.dq_empty, (pipe & 1) ^ 1);\n",
        "",
        f"          {C}TRACE_AT(wg, pipe, 6);\n",
    ),
    (
        "          if (lane == 0) mbar_arrive(&bar.dq_full[0]);\n        }\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 7);\n",
    ),
    (
        "        dkdv_complete(keys.acc_dv, keys.acc_dk, f);\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 9);\n",
    ),
    # the consumers at d = 256 (SHARED_KEYS, DQ_IN_STAGE): e2 the scores waited for, e3 the
    # exchange done, e10 dV, dK and dQ's first half waited for, e11 the consumers' barrier, e12 the
    # second half waited for, e13 the halves staged (dq_full)
    (
        "        keys.issue_scores(x, q_tile, do_tile);\n        wgmma_wait<0>();\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 2);\n",
    ),
    (
        "      } else {\n        keys.issue_scores(q_tile, do_tile);\n",
        f"        {C}TRACE_AT(wg, pipe, 3);\n",
        "",
    ),
    (
        "        issue_dq_part<Elem, 64, BN, BN / 16>(acc_a, ds_rows, "
        "sK + (2 * wg) * (BN * 128), 0);\n        wgmma_wait<0>();\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 10);\n",
    ),
    (
        "        named_barrier_sync(2, CONSUMER_THREADS);\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 11);\n",
    ),
    (
        "        wgmma_wait<0>();\n        fence_accumulators(acc_b);\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 12);\n",
    ),
    (
        "        if (lane == 0) mbar_arrive(&bar.dq_full[stage]);\n",
        "",
        f"        {C}TRACE_AT(wg, pipe, 13);\n",
    ),
    # the writer: e0 its step's start, e1 its turn seen .. e5 the counter released (e6 fenced);
    # globaltimer at e0, e1, e5
    (
        "          const i64 tile = first_tile + at.head * tiles_q + at.tile;\n",
        "",
        "          TRACE_AT(2, staged, 0); TRACE_GLOBAL(2, staged, 8);\n"
        "          TRACE_VALUE(2, staged, 14, tile);\n",
    ),
    (
        "          const int stage = staged % STAGES;\n",  # the turn is ours (either way)
        "          TRACE_AT(2, staged, 1); TRACE_GLOBAL(2, staged, 9);\n"
        "          TRACE_VALUE(2, staged, 15, turn);\n",
        "",
    ),
    (
        "          fence_proxy_async_global();  // the earlier turns' additions before this one\n",
        "",
        "          TRACE_AT(2, staged, 2);\n",
    ),
    (
        "          bulk_wait_read<0>();  // the staged tile is read: the consumers (or the "
        "producer) may fill it\n",
        "",
        "          TRACE_AT(2, staged, 3);\n",
    ),
    ("          bulk_wait<0>();  // written\n", "", "          TRACE_AT(2, staged, 4);\n"),
    (  # e6: the proxy fence done; e5 the counter released
        "          release_turn<HALF_WRITERS>(p.dq_semaphores + tile, writer_half(), turn);\n",
        "          TRACE_AT(2, staged, 6);\n",
        "          TRACE_AT(2, staged, 5); TRACE_GLOBAL(2, staged, 10);\n",
    ),
    # the loader: e0 before the wait for a free stage, e1 after it
    (
        "          mbar_wait(&bar.q_empty[stage], ((pipe / STAGES) & 1) ^ 1);\n",
        "          if (lane == 0) { TRACE_AT(3, pipe, 0); TRACE_GLOBAL(3, pipe, 8); }\n",
        "          if (lane == 0) TRACE_AT(3, pipe, 1);\n",
    ),
]

# (role, label, from event, to event); "next" = the next step's e0. The consumers' phases at
# d = 64 and 128 (a staging tile) and at d = 256 (DQ_IN_STAGE); the writer's and the loader's.
CONSUMER_PHASES = [
    (0, "stage wait (q_full)", 0, 1),
    (0, "S^T, dP^T issued and waited", 1, 2),
    (0, "P, dS, dS^T stores", 2, 3),
    (0, "consumers' barrier", 3, 4),
    (0, "dQ_part issued and waited (dV, dK issued)", 4, 5),
    (0, "staging tile's wait (dq_empty)", 5, 6),
    (0, "staging stores, dq_full", 6, 7),
    (0, "dV, dK waited (dkdv_complete)", 7, 9),
    (0, "to the next step", 9, "next"),
    (0, "step", 0, "next"),
    (1, "stage wait (q_full)", 0, 1),
    (1, "staging tile's wait (dq_empty)", 5, 6),
    (1, "step", 0, "next"),
]
CONSUMER_PHASES_256 = [
    (0, "stage wait (q_full)", 0, 1),
    (0, "S^T (this one) or dP^T (the other), waited", 1, 2),
    (0, "the exchange (P^T, dS^T)", 2, 3),
    (0, "dV, dK, dQ's first half issued and waited", 3, 10),
    (0, "consumers' barrier (q_empty arrived)", 10, 11),
    (0, "first half staged, second half waited", 11, 12),
    (0, "second half staged, dq_full", 12, 13),
    (0, "to the next step", 13, "next"),
    (0, "step", 0, "next"),
    (1, "stage wait (q_full)", 0, 1),
    (1, "S^T (the other) or dP^T (this one), waited", 1, 2),
    (1, "the exchange (P^T, dS^T)", 2, 3),
    (1, "step", 0, "next"),
]
PRODUCER_PHASES = [
    (2, "turn (own poll, or warp 2's: POLL_AHEAD)", 0, 1),
    (2, "dq_full wait", 1, 2),
    (2, "bulk reduction read", 2, 3),
    (2, "bulk reduction written", 3, 4),
    (2, "proxy fence", 4, 6),
    (2, "release", 6, 5),
    (2, "to the next step", 5, "next"),
    (2, "step", 0, "next"),
    (3, "wait for a free stage (q_empty)", 0, 1),
    (3, "step", 0, "next"),
]


def report(raw: list[int], head_dim: int) -> None:
    def slot(b: int, role: int, s: int) -> list[int]:
        i = ((b * 4 + role) * TRACE_STEPS + s) * SLOTS
        return raw[i : i + SLOTS]

    blocks = [b for b in range(TRACE_BLOCKS) if slot(b, 0, 0)[0]]
    # the SM clock: cycles over ns between the consumers' first and last traced step starts
    rates = []
    for b in blocks:
        steps = [s for s in range(TRACE_STEPS) if slot(b, 0, s)[0]]
        a, z = slot(b, 0, steps[0]), slot(b, 0, steps[-1])
        if z[8] > a[8]:
            rates.append((z[0] - a[0]) / (z[8] - a[8]) * 1e3)
    clock = statistics.median(rates)
    print(f"{len(blocks)} blocks traced; SM clock from the stamps {clock:.0f} MHz")
    print(f"{'role':11s} {'phase':44s} {'median':>7s} {'p90':>7s} (cycles)")
    consumers = CONSUMER_PHASES if head_dim <= 128 else CONSUMER_PHASES_256
    for role, label, e0, e1 in consumers + PRODUCER_PHASES:
        xs = []
        for b in blocks:
            for s in range(4, TRACE_STEPS - 1):
                a = slot(b, role, s)
                z = slot(b, role, s + 1)[0] if e1 == "next" else a[e1]
                if a[e0] and z and a[0] and (e1 != "next" or slot(b, role, s + 1)[0]):
                    xs.append(z - a[e0])
        if xs:
            print(
                f"{ROLES[role]:11s} {label:44s} {statistics.median(xs):7.0f} "
                f"{quantile(xs, 0.9):7.0f}"
            )
    # the writer's hand-offs: turn t released (globaltimer) -> turn t + 1 seen, on another block,
    # where that block's wait began before the release
    released: dict[tuple[int, int], int] = {}
    for b in blocks:
        for s in range(TRACE_STEPS):
            w = slot(b, 2, s)
            if w[0] and w[10]:
                released[(w[14], w[15])] = w[10]
    handoffs, polls = [], []
    for b in blocks:
        for s in range(TRACE_STEPS):
            w = slot(b, 2, s)
            if not (w[0] and w[9]):
                continue
            polls.append((w[9] - w[8]) / 1e3)
            prev = released.get((w[14], w[15] - 1))
            if prev is not None and w[8] < prev:
                handoffs.append((w[9] - prev) / 1e3)
    if polls:
        print(
            f"writer's wait for its turn (us): median {statistics.median(polls):.2f}, "
            f"p90 {quantile(polls, 0.9):.2f}; waited on a traced release {len(handoffs)} times"
        )
    if handoffs:
        print(
            f"hand-off, release to the next turn seen (us): median "
            f"{statistics.median(handoffs):.2f}, p90 {quantile(handoffs, 0.9):.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    import torch  # here: the patches above are read by the CPU tests, which have no torch

    b, n, h, d = max(1, 16384 // args.seq), args.seq, args.heads, args.head_dim
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = cuflash.attention_forward(q, k, v, causal=args.causal)
    choice = KernelChoice(backward="fused")
    raw = traced_call(
        lambda: testing.attention_backward_with(choice, do, q, k, v, o, lse, causal=args.causal),
        SOURCE,
        PATCHES,
        "attention_backward_fused_tma",
        "fused_trace",
        TRACE_BLOCKS * 4 * TRACE_STEPS * SLOTS,
    )
    if raw is None:
        print("no fused backward module was loaded")
        return 1
    print(f"bf16 d={d} B={b} N={n} H={h} causal={args.causal}")
    report(raw, d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
