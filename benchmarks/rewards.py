"""Reward cost per response: exact_boxed (in-process) vs math (math-verify in the pool) vs a sandboxed run.

Prints per-item times and ratios measured in this run, for a GRPO step's worth of responses
(``--n``, default 512 = 64 prompts x 8 samples), so the trainer's reward phase can be sized.

    python benchmarks/rewards.py [--n 512] [--workers 2]
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    from megatron_rl.rewards import RewardConfig, RewardItem, RewardManager
    from megatron_rl.rewards.math import exact_boxed
    from megatron_rl.rewards.sandbox import Sandbox, isolation_mode

    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sandbox-runs", type=int, default=10)
    args = p.parse_args()
    rng = random.Random(0)
    pairs = [(rng.randrange(100, 999), rng.randrange(100, 999)) for _ in range(args.n)]
    items = [RewardItem(f"{a}+{b}=\\boxed{{{a + b + rng.choice([0, 0, 1])}}}", str(a + b),
                        "exact_boxed") for a, b in pairs]

    t0 = time.perf_counter()
    for it in items:
        exact_boxed(it)
    exact_us = (time.perf_counter() - t0) / len(items) * 1e6

    cfg = RewardConfig(num_workers=args.workers)
    with RewardManager(cfg) as mgr:
        t0 = time.perf_counter()
        mgr.score(items)
        mgr_exact_us = (time.perf_counter() - t0) / len(items) * 1e6
        math_items = [RewardItem(it.response, it.ground_truth, "math") for it in items]
        mgr.score(math_items[:args.workers])  # start the workers outside the timing
        t0 = time.perf_counter()
        mgr.score(math_items)
        math_us = (time.perf_counter() - t0) / len(items) * 1e6
        # LaTeX answers take math-verify's full parse (no plain-number fast path)
        latex = [RewardItem(f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a}/{b}", "math") for a, b in pairs]
        t0 = time.perf_counter()
        mgr.score(latex)
        latex_us = (time.perf_counter() - t0) / len(items) * 1e6

    print(f"exact_boxed, direct        : {exact_us:10.1f} us/response")
    print(f"exact_boxed, via manager   : {mgr_exact_us:10.1f} us/response")
    print(f"math, pool of {args.workers}            : {math_us:10.1f} us/response "
          f"({math_us / exact_us:,.0f}x exact_boxed)")
    print(f"math, LaTeX answers        : {latex_us:10.1f} us/response "
          f"({latex_us / exact_us:,.0f}x exact_boxed)")
    print(f"  a {args.n}-response step: exact {exact_us * args.n / 1e3:.1f} ms, "
          f"math {math_us * args.n / 1e3:.0f} ms (numbers), "
          f"{latex_us * args.n / 1e3:.0f} ms (LaTeX)")
    if isolation_mode() != "none":
        sb = Sandbox()
        t0 = time.perf_counter()
        for _ in range(args.sandbox_runs):
            sb.run_python("print(1)")
        run_ms = (time.perf_counter() - t0) / args.sandbox_runs * 1e3
        print(f"sandboxed python run ({isolation_mode()}): {run_ms:8.1f} ms/run "
              f"({run_ms * 1e3 / exact_us:,.0f}x exact_boxed)")


if __name__ == "__main__":
    main()
