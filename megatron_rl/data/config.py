"""Data configuration: where prompts come from, how they are read, filtered and templated."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.base import ConfigBase, ranged
from megatron_rl.data.wrong_labels import WrongLabelConfig

# Difficulty labels written by `megatron-rl data difficulty` (megatron_rl/tools/difficulty.py).
DIFFICULTY_LABELS = ("solved", "unsolved", "hard", "suspected_wrong_label", "mixed")


@dataclass(kw_only=True)
class DataConfig(ConfigBase):
    # Training prompts: a .jsonl, .json (a list of rows) or .parquet file in verl's format
    # (data_source, prompt as chat messages, reward_model.{ground_truth,style}, extra_info).
    train_path: str = ""
    # Column holding the prompt: a list of {"role", "content"} messages, or a plain string.
    prompt_key: str = "prompt"
    # Dotted paths of the ground truth and reward style inside a row.
    ground_truth_key: str = "reward_model.ground_truth"
    style_key: str = "reward_model.style"
    data_source_key: str = "data_source"
    extra_key: str = "extra_info"
    # Dotted path of the environment a row names (a multi-turn prompt with tools, megatron_rl.envs;
    # missing or "": none, unless envs.env_map / envs.default_env give one); "": never read.
    env_key: str = "extra_info.env"
    # "auto": apply the tokenizer's chat template when it has one; "always" (error without one);
    # "never": the prompt text is the messages' contents joined by newlines.
    chat_template: str = "auto"
    # Prepended as a system message when the prompt has none ("" = none).
    system_prompt: str = ""
    # Prompts longer than this many tokens are dropped and counted (0: rollout.max_prompt_len, which
    # the engines are sized for, alone; a run refuses a value above it).
    max_prompt_len: int = ranged(0, ge=0)
    # A malformed row: "raise" (error naming file and row) or "skip" (counted in the stats).
    on_bad_row: str = "raise"
    # Read at most this many rows (0 = all).
    max_rows: int = ranged(0, ge=0)
    # Offline filtering by the difficulty annotation (extra_info.difficulty): keep only these
    # labels ([] = any) and pass rates in [pass_rate_min, pass_rate_max]. With a filter set, rows
    # without an annotation are dropped and counted.
    keep_labels: list[str] = field(default_factory=list)
    pass_rate_min: float = ranged(0.0, ge=0.0, le=1.0)
    pass_rate_max: float = ranged(1.0, ge=0.0, le=1.0)
    # Live wrong-label detection during GRPO (the difficulty rule over each prompt's newest samples).
    wrong_labels: WrongLabelConfig = field(default_factory=WrongLabelConfig)

    def validate(self) -> None:
        super().validate()
        if self.chat_template not in ("auto", "always", "never"):
            self.fail("chat_template", f"must be 'auto', 'always' or 'never', got {self.chat_template!r}")
        if self.on_bad_row not in ("raise", "skip"):
            self.fail("on_bad_row", f"must be 'raise' or 'skip', got {self.on_bad_row!r}")
        if self.pass_rate_min > self.pass_rate_max:
            self.fail("pass_rate_min", f"{self.pass_rate_min} > pass_rate_max {self.pass_rate_max}")
        for label in self.keep_labels:
            if label not in DIFFICULTY_LABELS:
                self.fail("keep_labels", f"unknown label {label!r}; valid: {list(DIFFICULTY_LABELS)}")

    @property
    def filters_difficulty(self) -> bool:
        return bool(self.keep_labels) or self.pass_rate_min > 0.0 or self.pass_rate_max < 1.0
