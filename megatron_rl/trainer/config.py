"""Trainer configuration: the run, its stages, the SFT cold start and evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.base import ConfigBase, ranged

DEFAULT_RUN_DIR = "runs/default"

# What a stage's optimizer starts with when the stage starts from a checkpoint (StageConfig.optimizer_state).
OptimizerStart = Literal["carry", "fresh"]


@dataclass(kw_only=True)
class PlateauConfig(ConfigBase):
    # Stop the stage early when validation accuracy has not improved by more than ``min_delta`` for
    # ``patience`` consecutive evaluations. 0 disables the rule (the stage runs max_steps).
    patience: int = ranged(0, ge=0)
    min_delta: float = ranged(0.0, ge=0.0)


@dataclass(kw_only=True)
class StageConfig(ConfigBase):
    """One stage of multi-stage GRPO (the recipe: 8k -> 16k -> 32k max response length)."""

    # Stage name; its directory under the run dir is named after it.
    name: str
    # Maximum response length in tokens during this stage; null (or omitted): rollout.max_response_len.
    max_response_len: int | None = ranged(None, ge=1)
    # GRPO steps in this stage (the step budget).
    max_steps: int = ranged(ge=1)
    # Optional early end on a validation-accuracy plateau.
    plateau: PlateauConfig = field(default_factory=PlateauConfig)
    # Optional learning-rate override for this stage.
    lr: float | None = ranged(None, ge=0.0)
    # The optimizer this stage starts with when it starts from a checkpoint (the previous stage's
    # `final`; for the first stage trainer.init_from or the SFT cold start's result): ``carry`` its
    # Adam moments, optimizer step count and lr-schedule position (the schedule's settings are the
    # running config's either way); ``fresh`` only its model weights: zero moments, the lr schedule
    # from step 0 (the warm-up runs again), as RL from an SFT model usually starts. A stage that starts
    # from the base model starts fresh anyway; a resume within the stage (its own step checkpoint)
    # always restores everything, the moments built since the stage started included.
    optimizer_state: OptimizerStart = "carry"

    def validate(self) -> None:
        super().validate()
        if not self.name or "/" in self.name:
            self.fail("name", f"must be a non-empty name without '/', got {self.name!r}")


@dataclass(kw_only=True)
class SFTConfig(ConfigBase):
    """Cold start: SFT on reference solutions through the same objective with advantage 1 (SFT is
    RL with every sample positive)."""

    enabled: bool = False
    # Problems with reference solutions (extra_info.solution) to imitate; empty: data.train_path.
    # (A real recipe's cold-start data is its own set; the demo keeps its RL prompts out of it.)
    data_path: str = ""
    # Upper bound on SFT optimizer steps.
    max_steps: int = ranged(2000, ge=1)
    # Sequences per SFT step.
    batch_size: int = ranged(64, ge=1)
    lr: float = ranged(1e-3, gt=0.0)
    # Lower the lr by this factor once held-out accuracy reaches ``slow_down_at`` (slows the jump).
    slow_down_factor: float = ranged(0.3, gt=0.0, le=1.0)
    slow_down_at: float = ranged(0.1, ge=0.0, le=1.0)
    # Evaluate greedy held-out accuracy every this many steps ...
    eval_every: int = ranged(25, ge=1)
    # ... on this many held-out problems (a subset of the evaluation set, for speed) ...
    eval_size: int = ranged(200, ge=1)
    # ... and stop once it reaches this accuracy (the cold start should leave room for RL).
    stop_accuracy: float = ranged(0.25, ge=0.0, le=1.0)
    # Wall-clock cap in seconds (0: none). The threshold, not the clock, is the intended stop.
    max_seconds: float = ranged(0.0, ge=0.0)
    # Control experiment after the GRPO stages: from the cold start's checkpoint, train SFT for as
    # long as the GRPO stages took, and report its held-out accuracy beside GRPO's (summary.json
    # "control"): how much of the gain RL itself adds.
    control: bool = False



@dataclass(kw_only=True)
class EvalConfig(ConfigBase):
    # Held-out evaluation data (same format as training data); empty: no evaluation.
    path: str = ""
    # Greedy accuracy on the first ``size`` problems (0: all).
    size: int = ranged(0, ge=0)
    # Evaluate every this many GRPO steps (0: only at stage ends).
    every: int = ranged(0, ge=0)


@dataclass(kw_only=True)
class TrainerConfig(ConfigBase):
    # Run directory: metrics, checkpoints, per-stage results. Relative paths are relative to the cwd.
    run_dir: str = DEFAULT_RUN_DIR
    # Global seed (model init of the tiny demo, data order, sampling seeds).
    seed: int = ranged(1234, ge=0)
    # Save a resumable checkpoint every this many steps (0: only at stage ends and on signals).
    save_every: int = ranged(0, ge=0)
    # Keep this many newest step checkpoints per stage (stage-final checkpoints are always kept).
    keep_checkpoints: int = ranged(2, ge=1)
    # Start the first stage from this checkpoint directory (a stage's `final`) instead of model.path.
    init_from: str = ""
    # Stop the run with a diagnosis (outcome counts, a sample response) after this many consecutive
    # GRPO steps without an update (every group had zero reward variance); 0: never stop.
    max_steps_without_update: int = ranged(10, ge=0)
    # CPU cores the trainer's process computes on (e.g. [0]); the computing thread of the vLLM servers
    # it launches and its reward workers then run on the other CPUs it may use, the servers' front end
    # (HTTP, output processing) and the fleet client's thread on any of them (common/cpus.py): on a
    # small CPU machine one-step-off overlaps generation and training only on separate cores. An
    # in-process engine computes on these cores too. Empty: nothing is pinned.
    cpu_cores: list[int] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        if any(c < 0 for c in self.cpu_cores) or len(set(self.cpu_cores)) != len(self.cpu_cores):
            self.fail("cpu_cores", f"must be distinct core numbers >= 0, got {self.cpu_cores}")
        if not self.run_dir.strip():
            self.fail("run_dir", "must be a directory path, got an empty string")
