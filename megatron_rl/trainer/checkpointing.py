"""Where a stage starts, resumable checkpoints, and the end of a stage.

A stage resumes from its own newest intact checkpoint if there is one (a damaged newer one is passed
over with a warning naming the file); otherwise it starts from the previous stage's ``final`` (found
in the run directory, no conversion), or for the first stage from ``trainer.init_from``, the SFT
cold start's result, or the base model: with that checkpoint's optimizer state, or with its weights
only and a new optimizer (``stages[].optimizer_state``). A damaged start checkpoint is a
:class:`CheckpointError` naming the file. Saves are atomic (see :mod:`megatron_rl.trainer.state`).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.data import PromptLoader
from megatron_rl.trainer.config import StageConfig
from megatron_rl.trainer.context import Context
from megatron_rl.trainer.evaluate import sync_weights
from megatron_rl.trainer.state import (STATE_FILE, CheckpointError, RunDir, TrainerState, capture_rng,
                                      checkpoint_damage, commit, remove_dir, restore_rng, staging_dir,
                                      write_manifest)

if TYPE_CHECKING:
    from megatron_rl.trainer.async_rollout import RolloutScheduler

log = logging.getLogger("megatron_rl")

# The live wrong-label monitor's state, beside trainer_state.json (driver only).
MONITOR_FILE = "wrong_labels_state.json"


def start_point(ctx: Context, stage_name: str) -> Path | None:
    """The checkpoint a stage starts from when it has none of its own (None: the base model)."""
    cfg, run = ctx.cfg, ctx.run
    names = [s.name for s in cfg.stages]
    i = names.index(stage_name)
    if i > 0:
        prev = run.final_dir(names[i - 1])
        if not RunDir.is_complete(prev):
            raise CheckpointError(f"stage {stage_name!r} starts from stage {names[i - 1]!r}'s final "
                                  f"checkpoint, but {prev} does not exist (or is incomplete): run that "
                                  f"stage first")
        return _intact(prev)
    if cfg.trainer.init_from:
        p = Path(cfg.trainer.init_from)
        if not RunDir.is_complete(p):
            raise CheckpointError(f"trainer.init_from={p} is not a complete checkpoint (no {STATE_FILE})")
        return _intact(p)
    sft_final = run.final_dir("sft")
    return _intact(sft_final) if RunDir.is_complete(sft_final) else None


def _intact(ckpt: Path) -> Path:
    problem = checkpoint_damage(ckpt)
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {problem}")
    return ckpt


def resume_point(ctx: Context, stage_name: str) -> Path | None:
    """The stage's newest intact step checkpoint (:meth:`RunDir.latest_step_checkpoint`, which the
    rollout scheduler restores from too); a damaged newer one is passed over, with a warning naming
    the file (the steps since the previous checkpoint run again)."""
    for ckpt in ctx.run.step_checkpoints(stage_name):
        problem = checkpoint_damage(ckpt)
        if problem is None:
            return ckpt
        log.warning("stage %s: not resuming from %s, it is damaged (%s): falling back to the previous "
                    "checkpoint", stage_name, ckpt, problem)
    return None


def _choose(ctx: Context, stage_name: str) -> tuple[Path | None, bool]:
    """(checkpoint, resume?) for the stage, decided on the driver and the same on every rank."""
    choice: tuple | str | None = None
    if ctx.is_driver:
        try:
            ckpt = resume_point(ctx, stage_name)
            choice = (ckpt, True) if ckpt is not None else (start_point(ctx, stage_name), False)
        except CheckpointError as exc:
            choice = str(exc)
    choice = ctx.broadcast(choice)
    if isinstance(choice, str):
        raise CheckpointError(choice)
    return choice


def ensure_reference(ctx: Context) -> None:
    """Build the KL reference policy once (when ``algo.kl.enabled``), on every rank.

    Its weights are ``policy.reference.path`` (a Hugging Face checkpoint) or, by default, the
    weights the first stage starts from: ``trainer.init_from``, the SFT cold start's result, or the
    base model. So every stage of a run, and a run resumed in any stage, has the same reference.
    """
    from megatron_rl.models.reference import ReferencePolicy

    cfg = ctx.cfg
    if not cfg.algo.kl.enabled or ctx.reference is not None:
        return
    path = cfg.policy.reference.path
    if path:
        ref = ReferencePolicy.from_hf(path, cfg.policy, ctx.groups)
        if ref.arch.vocab_size != ctx.policy.arch.vocab_size:
            raise ValueError(f"policy.reference.path: {path} has a vocabulary of "
                             f"{ref.arch.vocab_size} tokens, the policy {ctx.policy.arch.vocab_size}: "
                             f"the reference must score the policy's tokens")
        source = path
    else:
        src = start_point(ctx, cfg.stages[0].name)
        if src is None:
            ref = ReferencePolicy.from_hf(ctx.model_path, cfg.policy, ctx.groups)
        else:
            ref = ReferencePolicy.from_checkpoint(src / "policy", ctx.policy.arch, cfg.policy, ctx.groups)
        source = src or ctx.model_path
    log.info("KL reference policy: %s%s", source, " (offloaded between uses)" if ref.offload else "")
    ctx.reference = ref


def load_start(ctx: Context, ckpt: Path | None, stage: StageConfig, resume: bool) -> TrainerState:
    """Load ``ckpt`` into the policy (None: the base model, the policy as built) and return the
    trainer state the stage goes on from.

    A resume (the stage's own step checkpoint) restores everything; a start from another checkpoint
    restores the run-wide counters and, by ``stage.optimizer_state``, the checkpoint's optimizer
    (``carry``) or only its weights with a new optimizer and lr schedule (``fresh``). The peak lr is
    the stage's ``lr`` or ``policy.optim.lr``, never an earlier stage's of this process."""
    state = _load(ctx, ckpt, stage, resume) if ckpt is not None else TrainerState(stage=stage.name)
    ctx.policy.set_lr(stage.lr if stage.lr is not None else ctx.cfg.policy.optim.lr)
    return state


def _load(ctx: Context, ckpt: Path, stage: StageConfig, resume: bool) -> TrainerState:
    fresh = not resume and stage.optimizer_state == "fresh"
    try:
        state = RunDir.read_state(ckpt)
        ctx.policy.load_checkpoint(str(ckpt / "policy"), fresh_optimizer=fresh)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        detail = str(exc).strip().splitlines()
        raise CheckpointError(f"checkpoint {ckpt} cannot be loaded ({type(exc).__name__}: "
                              f"{detail[-1] if detail else ''}); move it aside to start from the "
                              f"previous one") from exc
    if not resume:  # a new stage: counters restart, the run-wide ones carry over
        state = TrainerState(stage=stage.name, global_step=state.global_step, grpo_step=state.grpo_step,
                             weight_version=state.weight_version, data_loader=state.data_loader,
                             entropy_controller=state.entropy_controller, grpo_seconds=state.grpo_seconds)
    return state


def begin_stage(ctx: Context, stage: StageConfig) -> tuple[TrainerState, PromptLoader | None]:
    cfg = ctx.cfg
    ckpt, resume = _choose(ctx, stage.name)
    if resume:
        log.info("stage %s: resuming from %s", stage.name, ckpt)
    else:
        log.info("stage %s: starting from %s%s", stage.name, ckpt or f"the base model {ctx.model_path}",
                 " with a fresh optimizer" if ckpt and stage.optimizer_state == "fresh" else "")
    state = load_start(ctx, ckpt, stage, resume)
    loader = None
    if ctx.is_driver:
        loader = PromptLoader(ctx.train_records, cfg.rollout.rollout_batch_size, seed=cfg.trainer.seed)
        if state.data_loader:
            loader.load_state_dict(state.data_loader)
        monitor = ctx.observer.monitor if ctx.observer is not None else None
        saved = ckpt / MONITOR_FILE if ckpt is not None else None
        if monitor is not None and saved is not None and saved.exists():
            monitor.load_state_dict(json.loads(saved.read_text()))
        dumper = ctx.observer.dumper if ctx.observer is not None else None
        if dumper is not None and dumper.forget_after(state.global_step):  # steps to be redone
            log.info("stage %s: rollout dumps after step %d removed (those steps run again)", stage.name,
                     state.global_step)
    if state.entropy_controller:
        ctx.entropy_ctl.load_state_dict(state.entropy_controller)
    restore_rng(state.rng)
    # The engines must hold the weights this stage starts from, under their own version (a version
    # names weights: rollouts saved with a checkpoint keep their staleness). At version 0 too (the
    # base model): servers the trainer did not start itself (placement external, or already running)
    # may hold anything, another run's weights included, so they are synced and (sync.verify)
    # probed before the first rollout, whatever they report.
    sync_weights(ctx, state.weight_version)
    return state, loader


def write_checkpoint(ctx: Context, ckpt: Path, state: TrainerState, loader: PromptLoader | None,
                     also: Callable[[Path], None] | None = None) -> None:
    """Write a checkpoint atomically: into a staging directory, ``also(staging)`` adding more to it,
    the manifest and the trainer state last, then renamed to ``ckpt`` (replacing an older one)."""
    staging = staging_dir(ckpt)
    if ctx.is_driver:
        remove_dir(staging)  # left by a killed save
        staging.mkdir(parents=True)
    ctx.groups.barrier()
    ctx.policy.save_checkpoint(str(staging / "policy"))
    if also is not None:
        also(staging)
    if ctx.is_driver:
        state.data_loader = loader.state_dict() if loader is not None else state.data_loader
        state.entropy_controller = ctx.entropy_ctl.state_dict()
        state.rng = capture_rng()
        if ctx.observer is not None and ctx.observer.monitor is not None:
            (staging / MONITOR_FILE).write_text(json.dumps(ctx.observer.monitor.state_dict()))
        write_manifest(staging)
        RunDir.write_state(staging, state)  # last: the staging directory is complete
        commit(staging, ckpt)
    ctx.groups.barrier()


def save_checkpoint(ctx: Context, stage: StageConfig, state: TrainerState, loader: PromptLoader | None,
                    rollouts: RolloutScheduler | None = None) -> Path:
    """A resumable step checkpoint; with ``rollouts``, what is generated but not trained on yet too."""
    ckpt = ctx.run.step_dir(stage.name, state.step)
    write_checkpoint(ctx, ckpt, state, loader, also=rollouts.save if rollouts is not None else None)
    if ctx.is_driver:
        ctx.run.prune(stage.name, ctx.cfg.trainer.keep_checkpoints)
        log.info("stage %s: checkpoint %s", stage.name, ckpt)
    return ckpt


def export_hf(ctx: Context, out_dir: Path) -> None:
    """A Hugging Face checkpoint of the current policy (config and tokenizer from the base model)."""
    from safetensors.torch import save_file

    # Collective: every rank drains the iterator; only global rank 0 receives the full tensors.
    tensors = {name: t.contiguous().clone() for name, t in ctx.policy.export_hf_weights() if t is not None}
    if not ctx.is_driver:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    src = Path(ctx.model_path)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)


def finish_stage(ctx: Context, stage: StageConfig, state: TrainerState, loader: PromptLoader | None) -> Path:
    final = ctx.run.final_dir(stage.name)
    write_checkpoint(ctx, final, state, loader, also=lambda ckpt: export_hf(ctx, ckpt / "hf"))
    if ctx.is_driver:
        rs = ctx.run.read_run_state()
        if stage.name not in rs["finished_stages"]:
            rs["finished_stages"].append(stage.name)
        ctx.run.write_run_state(rs)
        remove_dir(ctx.run.stage_dir(stage.name) / "checkpoints")
        log.info("stage %s: finished at step %d -> %s", stage.name, state.step, final)
    return final
