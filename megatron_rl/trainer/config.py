"""Trainer configuration: the run, its stages, the SFT cold start and evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.base import ConfigBase

DEFAULT_RUN_DIR = "runs/default"


@dataclass(kw_only=True)
class PlateauConfig(ConfigBase):
    # Stop the stage early when validation accuracy has not improved by more than ``min_delta`` for
    # ``patience`` consecutive evaluations. 0 disables the rule (the stage runs max_steps).
    patience: int = 0
    min_delta: float = 0.0

    def validate(self) -> None:
        super().validate()
        self.check_range("patience", lo=0)
        self.check_range("min_delta", lo=0.0)


@dataclass(kw_only=True)
class StageConfig(ConfigBase):
    """One stage of multi-stage GRPO (the recipe: 8k -> 16k -> 32k max response length)."""

    # Stage name; its directory under the run dir is named after it.
    name: str
    # Maximum response length in tokens during this stage (overrides rollout.max_response_len).
    max_response_len: int
    # GRPO steps in this stage (the step budget).
    max_steps: int
    # Optional early end on a validation-accuracy plateau.
    plateau: PlateauConfig = field(default_factory=PlateauConfig)
    # Optional learning-rate override for this stage.
    lr: float | None = None

    def validate(self) -> None:
        super().validate()
        if not self.name or "/" in self.name:
            self.fail("name", f"must be a non-empty name without '/', got {self.name!r}")
        self.check_range("max_response_len", lo=1)
        self.check_range("max_steps", lo=1)
        self.check_range("lr", lo=0.0)


@dataclass(kw_only=True)
class SFTConfig(ConfigBase):
    """Cold start: SFT on reference solutions through the same objective with advantage 1 (SFT is
    RL with every sample positive)."""

    enabled: bool = False
    # Problems with reference solutions (extra_info.solution) to imitate; empty: data.train_path.
    # (A real recipe's cold-start data is its own set; the demo keeps its RL prompts out of it.)
    data_path: str = ""
    # Upper bound on SFT optimizer steps.
    max_steps: int = 2000
    # Sequences per SFT step.
    batch_size: int = 64
    lr: float = 1e-3
    # Lower the lr by this factor once held-out accuracy reaches ``slow_down_at`` (slows the jump).
    slow_down_factor: float = 0.3
    slow_down_at: float = 0.1
    # Evaluate greedy held-out accuracy every this many steps ...
    eval_every: int = 25
    # ... on this many held-out problems (a subset of the evaluation set, for speed) ...
    eval_size: int = 200
    # ... and stop once it reaches this accuracy (the cold start should leave room for RL).
    stop_accuracy: float = 0.25
    # Wall-clock cap in seconds (0: none). The threshold, not the clock, is the intended stop.
    max_seconds: float = 0.0
    # Control experiment after the GRPO stages: from the cold start's checkpoint, train SFT for as
    # long as the GRPO stages took, and report its held-out accuracy beside GRPO's (summary.json
    # "control"): how much of the gain RL itself adds.
    control: bool = False

    def validate(self) -> None:
        super().validate()
        for name in ("max_steps", "batch_size", "eval_every", "eval_size"):
            self.check_range(name, lo=1)
        self.check_range("lr", lo=0.0, lo_open=True)
        self.check_range("stop_accuracy", lo=0.0, hi=1.0)
        self.check_range("slow_down_factor", lo=0.0, hi=1.0, lo_open=True)
        self.check_range("slow_down_at", lo=0.0, hi=1.0)
        self.check_range("max_seconds", lo=0.0)


@dataclass(kw_only=True)
class EvalConfig(ConfigBase):
    # Held-out evaluation data (same format as training data); empty: no evaluation.
    path: str = ""
    # Greedy accuracy on the first ``size`` problems (0: all).
    size: int = 0
    # Evaluate every this many GRPO steps (0: only at stage ends).
    every: int = 0

    def validate(self) -> None:
        super().validate()
        self.check_range("size", lo=0)
        self.check_range("every", lo=0)


@dataclass(kw_only=True)
class TrainerConfig(ConfigBase):
    # Run directory: metrics, checkpoints, per-stage results. Relative paths are relative to the cwd.
    run_dir: str = DEFAULT_RUN_DIR
    # Global seed (model init of the tiny demo, data order, sampling seeds).
    seed: int = 1234
    # Save a resumable checkpoint every this many steps (0: only at stage ends and on signals).
    save_every: int = 0
    # Keep this many newest step checkpoints per stage (stage-final checkpoints are always kept).
    keep_checkpoints: int = 2
    # Start the first stage from this checkpoint directory (a stage's `final`) instead of model.path.
    init_from: str = ""
    # Stop the run with a diagnosis (outcome counts, a sample response) after this many consecutive
    # GRPO steps without an update (every group had zero reward variance); 0: never stop.
    max_steps_without_update: int = 10

    def validate(self) -> None:
        super().validate()
        if not self.run_dir.strip():
            self.fail("run_dir", "must be a directory path, got an empty string")
        self.check_range("seed", lo=0)
        self.check_range("save_every", lo=0)
        self.check_range("keep_checkpoints", lo=1)
        self.check_range("max_steps_without_update", lo=0)
