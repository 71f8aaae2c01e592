"""Configuration of the demo's pieces: the tiny model (``model.tiny``) and the synthetic task
(``synthetic``)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.base import ConfigBase, ranged

MOE_ARCHS = ("qwen3_moe", "qwen2_moe")
ARCHS = ("llama", "qwen2", "qwen3", *MOE_ARCHS)


@dataclass(kw_only=True)
class TinySpec(ConfigBase):
    """A tiny random model built locally (config section ``model.tiny``). Defaults: ≈0.86M
    parameters, the CPU demo's model."""

    # Architecture of the written HF checkpoint: llama (character tokenizer), qwen2 or qwen3 (byte BPE),
    # or a Mixture-of-Experts model: qwen3_moe, qwen2_moe (a gated shared expert beside the routed
    # ones) (byte BPE).
    arch: str = "llama"
    # Width of the residual stream.
    hidden_size: int = ranged(128, ge=1)
    # Width of the SwiGLU MLP.
    intermediate_size: int = ranged(384, ge=1)
    # Transformer layers.
    num_layers: int = ranged(4, ge=1)
    # Attention heads (hidden_size / num_heads >= 32: vLLM-CPU's attention has no head_dim 16 kernel).
    num_heads: int = ranged(4, ge=1)
    # Key/value heads (GQA when fewer than num_heads).
    num_kv_heads: int = ranged(4, ge=1)
    # Longest sequence the model supports (RoPE positions).
    max_position_embeddings: int = ranged(256, ge=1)
    # Share the input embedding and output layer weights.
    tie_word_embeddings: bool = False
    # The vocabulary is padded to a multiple of this.
    vocab_multiple: int = ranged(8, ge=1)
    # Seed of the random weights; null: the run's trainer.seed.
    seed: int | None = ranged(None, ge=0)
    # Mixture-of-Experts archs only (qwen3_moe, qwen2_moe): routed experts per MoE layer.
    num_experts: int = ranged(8, ge=1)
    # Experts each token is routed to (top-k).
    num_experts_per_tok: int = ranged(2, ge=1)
    # Width of each routed expert's SwiGLU MLP.
    moe_intermediate_size: int = ranged(64, ge=1)
    # qwen2_moe only: width of the gated shared expert's SwiGLU MLP.
    shared_expert_intermediate_size: int = ranged(128, ge=1)

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHS

    def validate(self) -> None:
        super().validate()
        if self.arch not in ARCHS:
            self.fail("arch", f"must be one of {list(ARCHS)}, got {self.arch!r}")
        if self.num_experts_per_tok > self.num_experts:
            self.fail("num_experts_per_tok", f"must be <= num_experts={self.num_experts}, got "
                      f"{self.num_experts_per_tok}")
        if self.hidden_size % self.num_heads:
            self.fail("num_heads", f"must divide hidden_size={self.hidden_size}, got {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            self.fail("num_kv_heads", f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")


@dataclass(kw_only=True)
class SyntheticConfig(ConfigBase):
    """Generate a built-in task's data (the demos) into RUN_DIR/data."""

    # Write RUN_DIR/data/{train,eval}.jsonl (verl format) if they do not exist yet.
    enabled: bool = False
    # Training prompts (distinct), RUN_DIR/data/train.jsonl.
    train_size: int = ranged(20000, ge=1)
    # Problems with reference solutions for the SFT cold start, RUN_DIR/data/sft.jsonl, distinct from
    # the training prompts (0: none written; point sft.data_path at the file to use it).
    sft_size: int = ranged(0, ge=0)
    # Held-out problems, drawn from a disjoint part of the problem space (never trained on).
    eval_size: int = ranged(500, ge=1)
    # Operand sizes in digits.
    min_digits: int = ranged(2, ge=1)
    max_digits: int = ranged(3, ge=1)
    # Plant wrong labels: this share of the training prompts get a wrong ground truth (the sum plus
    # a random nonzero offset). Their ids go to RUN_DIR/data/planted.json, against which `megatron-rl
    # analyze` scores the live suspected-wrong-label list (recall, precision).
    wrong_label_fraction: float = ranged(0.0, ge=0.0, le=0.5)
    # The task: "addition" (data source synthetic/addition) or "multiplication" (synthetic/multiplication:
    # the tool demo's, which the tiny model cannot do in its head).
    task: str = "addition"
    # The environment every row names (extra_info.env): "calculator" gives multi-turn prompts whose
    # reference solutions demonstrate a call, "<<a*b>>", the tool's answer and the boxed result;
    # "": single-turn rows whose solutions are the boxed answer.
    env: str = ""
    # This share of the training prompts become hard problems of a kind held out of the SFT data
    # and the rest of the task (one operand with max_digits + 1 digits; data source
    # "synthetic/addition_<max_digits+1>digit"), labelled right: they must stay off the
    # suspected-wrong-label list (listed in planted.json as "hard").
    hard_fraction: float = ranged(0.0, ge=0.0, le=0.5)

    def validate(self) -> None:
        super().validate()
        if self.max_digits < self.min_digits:
            self.fail("max_digits", f"must be >= min_digits ({self.min_digits}), got {self.max_digits}")
        if self.task not in ("addition", "multiplication"):
            self.fail("task", f"must be 'addition' or 'multiplication', got {self.task!r}")
        if self.env not in ("", "calculator"):
            self.fail("env", f"must be '' or 'calculator' (the demonstrations show its call format), got {self.env!r}")
