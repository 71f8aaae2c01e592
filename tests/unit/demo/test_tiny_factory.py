"""The tiny-model factory writes checkpoints transformers reloads with a working tokenizer.

The trap: with model_type=qwen2, transformers swaps in Qwen2Tokenizer and a word-level
vocabulary encodes to nothing; the factory gives Qwen models a byte-level BPE instead.
"""

import pytest
import torch

from megatron_rl.demo import Problem, TinySpec, write_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_tokenizer_round_trips_and_model_loads(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_model(tmp_path / arch, TinySpec(arch=arch, hidden_size=64, intermediate_size=96,
                                                      num_layers=1, num_heads=2, num_kv_heads=1))
    tok = AutoTokenizer.from_pretrained(path)
    p = Problem(123, 45)
    ids = tok(p.solution, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(p.solution)  # one token per character (byte)
    assert tok.decode(ids) == p.solution
    chat = tok.apply_chat_template([{"role": "user", "content": p.question}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == f"Q:{p.question}\nA:"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch and model.config.vocab_size >= len(tok)
    assert model.config.vocab_size % 8 == 0
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    spec = TinySpec(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=2, num_kv_heads=2, seed=3)
    a = load_file(str(write_tiny_model(tmp_path / "a", spec) / "model.safetensors"))
    b = load_file(str(write_tiny_model(tmp_path / "b", spec) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_synthetic_splits_are_disjoint_and_deterministic():
    from megatron_rl.demo.synthetic import sample_problems

    train = sample_problems(3000, seed=1, split="train")
    ev = sample_problems(300, seed=1, split="eval")
    assert not {(p.a, p.b) for p in train} & {(p.a, p.b) for p in ev}
    assert sample_problems(300, seed=1, split="eval") == ev
    assert all(10 <= p.a <= 999 and 10 <= p.b <= 999 for p in train + ev)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tiny_moe_model_has_the_experts_asked_for(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    spec = TinySpec(arch=arch, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                    num_kv_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
    model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / arch, spec))
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    names = {n for n, _ in model.named_parameters()}
    # The routed experts of every layer, and (qwen2_moe) the gated shared expert.
    assert any(n.startswith("model.layers.1.mlp.experts") for n in names)
    assert ("model.layers.0.mlp.shared_expert_gate.weight" in names) == (arch == "qwen2_moe")
    if arch == "qwen2_moe":
        assert cfg.shared_expert_intermediate_size == 48


def test_tiny_spec_refuses_more_experts_per_token_than_experts():
    from megatron_rl.config.base import ConfigError

    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        TinySpec(arch="qwen3_moe", num_experts=2, num_experts_per_tok=3).validate()
