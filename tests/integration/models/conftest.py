"""Shared by the in-process (single-rank) policy tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def groups():
    """A one-rank gloo world with Megatron's groups, torn down after the module."""
    from megatron_rl.compat import apply_compat
    from megatron_rl.models import ParallelConfig, destroy_distributed, init_distributed

    apply_compat()  # the entry point's one explicit call (no-op with CUDA)
    g = init_distributed(ParallelConfig())
    yield g
    destroy_distributed()


@pytest.fixture(scope="session")
def parallel_run(tmp_path_factory):
    """One ``torchrun --nproc-per-node 4`` of parallel_worker.py for test_policy_parallel.py,
    test_context_parallel.py and test_moe_parallel.py: the HF models it read (HF_ROOT) and each
    worker's results."""
    from pathlib import Path

    from policy_testlib import torchrun, write_hf_models

    root = tmp_path_factory.mktemp("parallel")
    hf = write_hf_models(root / "hf")
    out = root / "out"
    out.mkdir()
    torchrun(Path(__file__).parent / "parallel_worker.py", out, hf)
    return {"hf": hf, "out": out}
