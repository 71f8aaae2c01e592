"""The policy's resumable checkpoints: Megatron distributed checkpointing of model, optimizer,
LR schedule and step count, plus each rank's RNG states.

Loadable at another TP x PP x CP x DP (x EP x expert TP) layout (context parallelism does not change what is stored;
the local spec stores its norms under the Transformer Engine names) with the same
``use_distributed_optimizer`` (the two optimizers store their state differently). Both restore
exactly: the step after a load equals the uninterrupted run's, also for a checkpoint written before
the first optimizer step (the Megatron fixes this needs are in :mod:`megatron_rl.compat.megatron_fixes`).
A load with ``fresh_optimizer`` takes only the model weights (at any layout, from either optimizer's
checkpoint) and starts the optimizer and the lr schedule as a newly built policy's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from megatron_rl.compat import megatron_cpu_scope
from megatron_rl.compat.megatron_fixes import init_optimizer_state
from megatron_rl.models.config import PolicyConfig
from megatron_rl.models.parallel import ParallelGroups, rng_tracker_states, set_rng_tracker_states


class Checkpointable(Protocol):
    """What a checkpoint holds of a policy (:class:`~megatron_rl.models.policy.MegatronPolicy`)."""

    cfg: PolicyConfig
    groups: ParallelGroups
    model: list  # DDP-wrapped chunks
    optimizer: Any  # Megatron optimizer
    scheduler: Any  # OptimizerParamScheduler
    steps: int

_OPTIM_CKPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_RNG_DIR = "rng"


def _sharded_state_dict(policy: Checkpointable, is_loading: bool) -> dict:
    sd = {f"model_chunk{i}": chunk.module.sharded_state_dict()
          for i, chunk in enumerate(policy.model)}
    sd["optimizer"] = policy.optimizer.sharded_state_dict(
        sd, is_loading=is_loading, metadata=_OPTIM_CKPT_METADATA)
    sd["scheduler"] = policy.scheduler.state_dict()
    sd["steps"] = policy.steps
    sd["distributed_optimizer"] = policy.cfg.parallel.use_distributed_optimizer
    return sd


def _layout(policy: Checkpointable) -> tuple[int, ...]:
    g = policy.groups
    return (g.world_size, g.tp, g.pp, g.vpp, g.cp, g.ep, g.etp)


def save_checkpoint(policy: Checkpointable, ckpt_dir: str | Path) -> None:
    """Collective. ``ckpt_dir`` must not exist or be empty."""
    from megatron.core import dist_checkpointing

    g = policy.groups
    g.check_current()
    path = Path(ckpt_dir)
    if g.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        if any(path.iterdir()):
            raise FileExistsError(f"checkpoint directory {path} is not empty")
    g.barrier()
    init_optimizer_state(policy.optimizer)  # before the first step there is none to save
    with megatron_cpu_scope():
        dist_checkpointing.save(_sharded_state_dict(policy, is_loading=False), str(path))
    rng_dir = path / _RNG_DIR
    if g.rank == 0:
        rng_dir.mkdir(exist_ok=True)
    g.barrier()
    torch.save({"layout": _layout(policy), "cpu": torch.get_rng_state(),
                "tracker": rng_tracker_states()}, rng_dir / f"rank{g.rank}.pt")
    g.barrier()


def load_checkpoint(policy: Checkpointable, ckpt_dir: str | Path, fresh_optimizer: bool = False) -> None:
    """Load a checkpoint written by :func:`save_checkpoint`, at this or another layout.

    ``fresh_optimizer``: only the model weights; the optimizer and the lr schedule then start as a
    newly built policy's (:func:`reset_optimizer`), whatever this policy trained before.

    RNG states are restored when the layout is the same (they are per rank); otherwise the
    current ones stay (the policy has no dropout, so the numbers do not depend on them).
    """
    from megatron.core import dist_checkpointing

    g = policy.groups
    g.check_current()
    path = Path(ckpt_dir)
    if fresh_optimizer:
        load_model_weights([chunk.module for chunk in policy.model], g, path)
        with megatron_cpu_scope():
            policy.optimizer.reload_model_params()  # main (fp32) copies of bf16 / sharded weights
        reset_optimizer(policy)
        _restore_rng(policy, path)
        return
    _check_exists(path)
    saved = bool(dist_checkpointing.load_common_state_dict(str(path))
                 .get("distributed_optimizer", False))
    ours = policy.cfg.parallel.use_distributed_optimizer
    if saved != ours:
        raise ValueError(f"{path} was written with use_distributed_optimizer={saved}, this "
                         f"policy has {ours}: Megatron stores the two optimizers' states differently")
    init_optimizer_state(policy.optimizer)
    # the optimizer's settings stay this policy's (its config, or a later set_lr): the checkpoint
    # brings back the step count and the Adam moments, not the hyperparameters its parameter groups
    # also saved (peak / minimum lr, which the scheduler reads first, betas, eps)
    # (and a fused Adam's per-group step count is the checkpoint's, not this policy's)
    settings = [{k: v for k, v in g.items() if k not in ("params", "step")}
                for g in policy.optimizer.param_groups]
    with megatron_cpu_scope():
        loaded = dist_checkpointing.load(_sharded_state_dict(policy, is_loading=True), str(path))
        for i, chunk in enumerate(policy.model):
            chunk.module.load_state_dict(loaded[f"model_chunk{i}"])
        policy.optimizer.load_state_dict(loaded["optimizer"])
        for group, mine in zip(policy.optimizer.param_groups, settings):
            group.update(mine)
        # Megatron's load adds the saved step count to the current one: from 0, not from where this
        # policy got to (an SFT or earlier stage in the same process); its settings: this policy's
        policy.scheduler.num_steps = 0
        policy.scheduler.load_state_dict(loaded["scheduler"])
    policy.steps = int(loaded["steps"])
    _restore_rng(policy, path)


def reset_optimizer(policy: Checkpointable) -> None:
    """The optimizer and lr schedule of a newly built policy: no Adam state (moments and step count
    start at zero on the next step, as a new optimizer's), the schedule at step 0 of its settings
    (``policy.optim``, or a later ``set_lr``), so the warm-up runs again. The weights stay."""
    for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            inner.state.clear()  # what a new torch / TE / Apex Adam starts from, lazily filled
            for group in inner.param_groups:
                group.pop("step", None)  # TE's and Apex's fused Adam count steps per group
    policy.scheduler.num_steps = 0
    policy.scheduler.step(increment=0)  # the parameter groups' lr and weight decay at step 0
    policy.steps = 0


def _check_exists(path: Path) -> None:
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a Megatron distributed checkpoint "
                                f"(no metadata.json)")


def _restore_rng(policy: Checkpointable, path: Path) -> None:
    rng_file = path / _RNG_DIR / f"rank{policy.groups.rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        if rng["layout"] == _layout(policy):
            torch.set_rng_state(rng["cpu"])
            set_rng_tracker_states(rng["tracker"])


def load_model_weights(chunks: list, groups: ParallelGroups, ckpt_dir: str | Path) -> None:
    """Only the model weights of a checkpoint written by :func:`save_checkpoint` into ``chunks``
    (bare ``GPTModel`` chunks of this rank, any layout): what a frozen copy of the policy needs."""
    from megatron.core import dist_checkpointing

    groups.check_current()
    path = Path(ckpt_dir)
    _check_exists(path)
    with megatron_cpu_scope():
        wanted = {f"model_chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
        loaded = dist_checkpointing.load(wanted, str(path))
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model_chunk{i}"])
