"""Write tiny Hugging Face checkpoints (random weights, local character-level tokenizer).

Used by the CPU demo and by the tests: no hub, no downloads. The tokenizer is a fast (``tokenizers``)
word-level tokenizer over single characters, saved with a chat template, so vLLM, transformers and
our data loader all read it as they would a real model's.

Architecture note: with ``model_type=qwen2`` transformers 5.x swaps in ``Qwen2Tokenizer``
and rebuilds a byte-level BPE, which encodes a word-level vocabulary to nothing. A Llama config keeps
the tokenizer as saved, so Qwen2/Qwen3 tiny models here get a byte-level BPE tokenizer instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rl.demo.config import TinySpec
from megatron_rl.demo.synthetic import ALPHABET

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# Chat template: "Q:<question>\nA:" then the response; a tool's message (multi-turn rollouts) is
# "=<output>\n" before the next "A:". Kept short: every token costs CPU time.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}Q:{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}A:{{ m['content'] }}</s>"
    "{% elif m['role'] == 'tool' %}={{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def build_char_tokenizer(alphabet: list[str] = ALPHABET):
    """A fast tokenizer with one token per character and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *alphabet])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, BOS, EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_bpe_tokenizer(alphabet: list[str] = ALPHABET):
    """A byte-level BPE tokenizer with no merges (one token per byte) for Qwen-architecture models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *symbols])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hf_config(spec: TinySpec, vocab_size: int, tokenizer):
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if spec.arch == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if spec.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.arch == "qwen3":
        return Qwen3Config(**common, head_dim=spec.hidden_size // spec.num_heads, attention_bias=False,
                           use_sliding_window=False)
    moe = dict(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
               moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, head_dim=spec.hidden_size // spec.num_heads,
                              attention_bias=False, use_sliding_window=False)
    if spec.arch == "qwen2_moe":
        # Qwen2-MoE's released checkpoints do not normalise the top-k weights; keep that.
        return Qwen2MoeConfig(**{**common, **moe, "norm_topk_prob": False}, use_sliding_window=False,
                              shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    raise ValueError(f"TinySpec.arch must be one of llama, qwen2, qwen3, qwen3_moe, qwen2_moe; got "
                     f"{spec.arch!r}")


def write_tiny_model(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Write config, random fp32 weights (safetensors) and tokenizer to ``out_dir``; return it."""
    from transformers import AutoModelForCausalLM

    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer() if spec.arch == "llama" else build_bpe_tokenizer()
    n = len(tokenizer)
    vocab_size = -(-n // spec.vocab_multiple) * spec.vocab_multiple
    config = _hf_config(spec, vocab_size, tokenizer)
    torch.manual_seed(spec.seed or 0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    gen_cfg = out / "generation_config.json"
    if gen_cfg.exists():  # keep sampling defaults neutral: the engine gets explicit params
        gen_cfg.unlink()
    (out / "tiny_spec.json").write_text(json.dumps(spec.to_dict(), indent=1))
    return out
