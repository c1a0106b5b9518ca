"""Probe: the softcap backward of this tree against other checkouts (--baseline) on the mma.sync
instances whose register allocation moved with the softcap's tanh form (docs/perf/NOTES.md v25):
dQ at d = 224 with a window, softcap and ALiBi (feature set 7), and dK/dV at d = 160 on packed
sequences with a softcap and ALiBi, with and without a window (sets 14 and 15); the d = 128
softcap backward beside them.

    python bench/probe_softcap_backward.py --baseline DIR ... [--rounds 5] [--out DIR]

bf16, 16k tokens (B = 4 x 4096, or 4 packed sequences of 4096), 2048 / d heads, softcap 30.
Times the whole backward (preprocess, dK/dV, dQ) in interleaved rounds; TFLOP/s count 2.5x the
forward's 4 N^2 d over all pairs (the window's lost pairs are not subtracted: a ratio between
trees is what this probe is for).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_forward import row  # noqa: E402
from probe_softcap import checkouts, write  # noqa: E402

# (label, head dim, packed, window)
CASES = [
    ("d=128 softcap", 128, False, None),
    ("d=224 window+softcap+alibi", 224, False, (1024, 1024)),
    ("d=160 packed softcap+alibi", 160, True, None),
    ("d=160 packed window+softcap+alibi", 160, True, (1024, 1024)),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    modules = checkouts(args.baseline)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lines = [f"{torch.cuda.get_device_name()}, bf16 backward TFLOP/s (all pairs), softcap 30"]
    n, b = 4096, 4
    for label, d, packed, window in CASES:
        h = 2048 // d
        shape = (b * n, h, d) if packed else (b, n, h, d)
        q, k, v, do = (
            torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(4)
        )
        slopes = torch.rand(h, device="cuda", generator=gen) * 0.1 if d != 128 else None
        options = dict(softcap=30.0, window=window, alibi_slopes=slopes)
        cu = torch.arange(0, b * n + 1, n, device="cuda", dtype=torch.int32)
        methods = {}
        for name, m in modules.items():
            if packed:
                lengths = dict(max_seqlen_q=n, max_seqlen_k=n)
                o, lse = m.attention_varlen_forward(q, k, v, cu, cu, **lengths, **options)
                methods[name] = lambda m=m, o=o, lse=lse, lengths=lengths: (
                    m.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, **lengths, **options)
                )
            else:
                o, lse = m.attention_forward(q, k, v, **options)
                methods[name] = lambda m=m, o=o, lse=lse: m.attention_backward(
                    do, q, k, v, o, lse, **options
                )
        flops = 2.5 * 4 * b * h * n * n * d
        lines.append(row(label, methods, flops, args.rounds))
    write(args.out, "probe_softcap_backward.txt", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
