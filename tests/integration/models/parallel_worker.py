"""torchrun worker of the multi-rank policy modules: policy_worker.py's cases (TP / PP / VPP / SP /
DP, round trips, checkpoints), cp_worker.py's (context parallelism) and moe_worker.py's (Mixture of
Experts: expert layouts, their checkpoints) in one launch, each worker's results in its own
directory.

Usage: torchrun --nproc-per-node 4 parallel_worker.py OUT_DIR HF_ROOT
(results in OUT_DIR/policy, OUT_DIR/cp and OUT_DIR/moe). A launch costs 10-20 s of imports on two cores; the
cases share one since init_distributed destroys each layout's groups (before, every layout's gloo
groups kept their threads and one launch of both reached ~2100 threads per rank).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import cp_worker  # noqa: E402
import moe_worker  # noqa: E402
import policy_worker  # noqa: E402
from policy_testlib import run_cases  # noqa: E402

from megatron_rl.compat import apply_compat  # noqa: E402

WORKERS = {"policy": policy_worker, "cp": cp_worker, "moe": moe_worker}


def main() -> None:
    out, hf_root = Path(sys.argv[1]), Path(sys.argv[2])
    cases = {}
    for name, worker in WORKERS.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        cases.update({f"{name}/{case}": fn for case, fn in worker.cases(out / name, hf_root).items()})
    run_cases(cases, None)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    apply_compat()  # the entry point's one explicit call (no-op with CUDA)
    main()
