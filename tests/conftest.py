"""Shared fixtures: tiny local models (random weights, local tokenizer), built once per session."""

from __future__ import annotations

import os

import pytest

# Subprocesses (torchrun workers, engines, `python -m megatron_rl.cli`) import this checkout.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from megatron_rl.demo import TinySpec, write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), TinySpec(num_kv_heads=2, seed=7)))
