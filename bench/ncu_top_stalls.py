"""The SASS instructions of one profiled kernel with the most warp-stall samples, from ncu's
source page as CSV (`ncu --import REPORT --page source --csv --print-source sass > FILE`).

    python bench/ncu_top_stalls.py FILE [--top 30] [--by-opcode]

Prints each instruction's share of the samples, its executed count and its text, so that two
instances of a kernel (say dense and packed) can be compared line by line. --by-opcode adds the
samples of the instructions executed as often as the most sampled one (a loop body: the FP8
forward's key-tile loop, say) summed by opcode, where two versions of one loop compare at a
glance (docs/perf/NOTES.md, v50). gzip-compressed files (FILE.gz) are read as well.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_file")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--by-opcode", action="store_true")
    args = parser.parse_args()
    opener = gzip.open if args.csv_file.endswith(".gz") else open
    with opener(args.csv_file, "rt", newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not CSV
    # the table starts at its header row (a "Kernel Name" row may come before it)
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), 0)
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        print("no rows")
        return 1
    cols = list(rows[0])
    samples = next(c for c in cols if c.startswith("Warp Stall Sampling (All"))
    executed = next((c for c in cols if c.startswith("Instructions Executed")), None)
    text = next((c for c in cols if c in ("Source", "SASS")), cols[1])

    def number(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(number(r[samples]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} stall samples")
    reasons = [c for c in cols if c.startswith("stall_") and not c.endswith("(Not Issued)")]
    by_reason = {c: sum(number(r[c]) for r in rows) for c in reasons}
    print("  ".join(f"{c[6:]} {100 * v / total:.1f}%" for c, v in by_reason.items() if v > 0))
    for r in sorted(rows, key=lambda r: -number(r[samples]))[: args.top]:
        count = number(r[executed]) if executed else 0
        top = max(reasons, key=lambda c: number(r[c]), default="")
        print(
            f"{100 * number(r[samples]) / total:5.1f}%  {count:12.0f}  {top[6:]:12s}"
            f"  {r[text].strip()[:80]}"
        )
    if args.by_opcode and executed:
        hottest = max(rows, key=lambda r: number(r[samples]))
        body = [r for r in rows if number(r[executed]) == number(hottest[executed])]
        by_opcode: dict[str, float] = collections.Counter()
        for r in body:
            words = r[text].split()
            opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            by_opcode[opcode.split(".")[0]] += number(r[samples])
        in_body = sum(by_opcode.values())
        print(
            f"by opcode: {len(body)} instructions executed {number(hottest[executed]):.0f} times,"
            f" {in_body:.0f} samples ({100 * in_body / total:.1f}%)"
        )
        print("  ".join(f"{op} {v:.0f}" for op, v in by_opcode.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
