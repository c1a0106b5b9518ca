"""Probe: why the public API's forward reads 0-7% under the same kernel chosen explicitly.

docs/perf/NOTES.md (v18, v20) records it in every run of bench/probe_forward.py and leaves it
unexplained. This probe times, in interleaved rounds on the same inputs, the steps between the
two:
  api       cuflash.attention_forward (validation, the cached plan, torch's outputs)
  plan      the API's cached plan called on the arrays (plan.call_arrays: no validation)
  pointers  the same plan called on pointers (ForwardPlan.__call__: the plan's allocator)
  default   testing.attention_forward_with(KernelChoice()): a new plan with the library's choice
  explicit  the same with the table's tiles and schedule named (as probe_forward's columns)
A gap between two neighbours says which step costs the time. bf16, bshd, B = 16384 / N,
H = 2048 / d; TFLOP/s as bench_attention.py counts them.

    python bench/probe_api_path.py [--head-dim 64 128] [--seq 4096 16384] [--rounds 7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_forward import row  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _kernels, _plans, testing  # noqa: E402
from cuflash._dispatch import KernelChoice  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--seq", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d in args.head_dim:
        for n in args.seq:
            b, h = 16384 // n, 2048 // d
            q, k, v = (
                torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(3)
            )
            for causal in (False, True):
                cuflash.attention_forward(q, k, v, causal=causal)
                key = _plans.signature("forward", (q, k, v), causal, None, None, None, "bshd")
                plan = _plans.get(key)
                ptrs = [x.data_ptr() for x in (q, k, v)]
                tiles = _kernels.default_tiles("forward", "tma", "bfloat16", d, n, 0)
                schedule = _kernels.forward_schedule(d, tiles)
                choice = KernelChoice(tiles=((("forward", "tma"), tiles),), schedule=schedule)
                *_, default_plan = testing.attention_forward_with(
                    KernelChoice(), q, k, v, causal=causal
                )
                *_, explicit_plan = testing.attention_forward_with(choice, q, k, v, causal=causal)
                same = (
                    plan.runs.aligned.launch.spec.name_expression
                    == explicit_plan.runs.aligned.launch.spec.name_expression
                )
                print(f"  {plan.runs.aligned.launch.spec.name_expression} (explicit: same {same})")
                methods = {
                    "api": lambda c=causal: cuflash.attention_forward(q, k, v, causal=c),
                    "plan": lambda p=plan: p.call_arrays((q, k, v)),
                    "pointers": lambda p=plan: p(*ptrs),
                    "default": lambda p=default_plan: p(*ptrs),
                    "explicit": lambda p=explicit_plan: p(*ptrs),
                }
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                label = f"d={d} N={n} {'causal' if causal else 'full'} {tiles} {schedule}"
                row(label, methods, flops, args.rounds)


if __name__ == "__main__":
    main()
