"""A Hugging Face ``config.json`` read into the architecture we build (Llama, Qwen2, Qwen3, and the
Mixture-of-Experts Qwen3-MoE and Qwen2-MoE: their MoE fields in :mod:`megatron_rl.models.moe_arch`).

:func:`read_hf_config` refuses what we cannot map: rope scaling, sliding windows, biases Megatron's
local layers lack, non-SiLU MLPs, MoE families and layouts we do not map. Megatron-Bridge needs Python >= 3.12, so on Python 3.11 the
HF <-> Megatron mapping (this file, ``gpt.py``, ``hf_rules.py``, ``hf_load.py``, ``hf_export.py``) is ours.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from megatron_rl.models.hf_errors import HFModelError
from megatron_rl.models.moe_arch import MOE_TYPES, UNMAPPED_MOE_TYPES, MoEArch, read_moe_arch
from megatron_rl.models.parallel import ModelShape

SUPPORTED = ("llama", "qwen2", "qwen3", *MOE_TYPES)
# Sizes a model's config.json must give as positive integers.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Megatron's vocabulary is padded to a multiple of lcm(VOCAB_MULTIPLE, TP) (see HFArch.padded_vocab).
VOCAB_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class HFArch:
    """What we need from a HF ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    # Mixture-of-Experts models: every layer's MLP is a MoE layer (None: dense).
    moe: MoEArch | None = None

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def shape(self) -> ModelShape:
        moe = self.moe
        return ModelShape(num_layers=self.num_layers, num_heads=self.num_heads,
                          num_kv_heads=self.num_kv_heads, vocab_size=self.vocab_size,
                          num_experts=moe.num_experts if moe else 0,
                          moe_ffn_hidden_size=moe.ffn_hidden_size if moe else 0)

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows in Megatron: the HF vocabulary rounded up to a multiple of lcm(128, TP).

        The same for every TP that divides 128, so checkpoints move between those layouts; no
        padding at all for vocabularies that are multiples of 128 (Qwen2.5, Qwen3, Llama 3).
        """
        multiple = math.lcm(VOCAB_MULTIPLE, tp)
        return -(-self.vocab_size // multiple) * multiple


def _rope_theta(cfg: dict, path: Path) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for where, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", None):
            raise HFModelError(f"{path}: {where}.rope_type={kind!r} is not supported (only "
                                f"default RoPE)")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise HFModelError(f"{path}: no rope_theta (looked in rope_parameters and the top level)")
    return float(theta)


def _positive(cfg: dict, key: str, path: Path, default=None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise HFModelError(f"{path}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFModelError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def read_hf_config(hf_dir: str | Path) -> HFArch:
    """Parse ``hf_dir/config.json``; raise :class:`HFModelError` naming the file and field on
    anything missing, non-positive or unsupported."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFModelError(f"no Hugging Face model at {hf_dir}: {path} does not exist")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise HFModelError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise HFModelError(f"{path}: expected a JSON object")
    model_type = cfg.get("model_type")
    if model_type in UNMAPPED_MOE_TYPES:
        raise HFModelError(f"{path}: model_type={model_type!r}: this Mixture-of-Experts family is "
                            f"not mapped; supported: {list(SUPPORTED)}")
    if model_type not in SUPPORTED:
        raise HFModelError(f"{path}: model_type={model_type!r} is not supported; supported: "
                            f"{list(SUPPORTED)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFModelError(f"{path}: hidden_act={act!r} is not supported (only silu / SwiGLU)")
    if cfg.get("use_sliding_window"):
        raise HFModelError(f"{path}: use_sliding_window=true is not supported")
    if model_type == "llama":
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise HFModelError(f"{path}: {key}=true is not supported for llama")
        qkv_bias = False
    elif model_type == "qwen2":
        qkv_bias = True
    elif model_type == "qwen2_moe":
        qkv_bias = cfg.get("qkv_bias", True)
        if not isinstance(qkv_bias, bool):
            raise HFModelError(f"{path}: qkv_bias must be true or false, got {qkv_bias!r}")
    else:
        if cfg.get("attention_bias"):
            raise HFModelError(f"{path}: attention_bias=true is not supported for {model_type}")
        qkv_bias = False
    sizes = {key: _positive(cfg, key, path) for key in _SIZES}
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = _positive(cfg, "num_key_value_heads", path, default=heads)
    if heads % kv_heads:
        raise HFModelError(f"{path}: num_attention_heads ({heads}) is not a multiple of "
                            f"num_key_value_heads ({kv_heads})")
    head_dim = cfg.get("head_dim")
    head_dim = _positive(cfg, "head_dim", path) if head_dim is not None else hidden // heads
    if head_dim < 1:
        raise HFModelError(f"{path}: hidden_size ({hidden}) / num_attention_heads ({heads}) < 1 "
                            f"and no head_dim")
    return HFArch(
        model_type=model_type,
        vocab_size=sizes["vocab_size"],
        hidden_size=hidden,
        ffn_hidden_size=sizes["intermediate_size"],
        num_layers=sizes["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=_rope_theta(cfg, path),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=_positive(cfg, "max_position_embeddings", path, default=4096),
        moe=read_moe_arch(cfg, path) if model_type in MOE_TYPES else None,
    )
