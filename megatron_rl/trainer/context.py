"""Everything a run holds, built once: parallel groups, policy, engine, weight sync, rewards, data.

Only global rank 0 drives the rollout engine, the rewards and tracking; the batch it builds is
broadcast to the other trainer ranks, which take part in every policy collective.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rl.algo import EntropyController
from megatron_rl.trainer.state import RunDir

log = logging.getLogger("megatron_rl")

REQUEUE_EXIT_CODE = 99


@dataclass
class Context:
    cfg: object
    run: RunDir
    groups: object
    policy: object
    tokenizer: object
    model_path: str
    engine: object = None  # the one engine, or an EnginePool over ``engines``
    engines: list = field(default_factory=list)
    weight_sync: object = None
    reward_mgr: object = None
    tracker: object = None
    train_records: list = field(default_factory=list)
    eval_records: list = field(default_factory=list)
    entropy_ctl: EntropyController | None = None
    stop_requested: bool = False

    @property
    def is_driver(self) -> bool:
        return self.groups.rank == 0

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every trainer rank."""
        if self.groups.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.groups.world_size > 1:
            torch.distributed.barrier()

    def install_signal_handlers(self) -> None:
        """SIGUSR1 / SIGTERM: finish the step, checkpoint, exit with REQUEUE_EXIT_CODE."""

        def request_stop(signum, _frame):
            log.warning("signal %s: will checkpoint after this step and exit %d", signum, REQUEUE_EXIT_CODE)
            self.stop_requested = True

        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, request_stop)

    def stop_agreed(self) -> bool:
        """Any rank's stop request stops every rank (so all of them write the same checkpoint)."""
        if self.groups.world_size == 1:
            return self.stop_requested
        flag = torch.tensor([1.0 if self.stop_requested else 0.0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def prepare_inputs(cfg, run: RunDir) -> None:
    """Build the tiny model and the synthetic data when the config asks for them (idempotent)."""
    from megatron_rl.data.synthetic import sample_problems, write_dataset
    from megatron_rl.models.tiny import write_tiny_model

    out = run.root / "base_model"
    if not cfg.model.path and not (out / "config.json").exists():
        spec = cfg.model.tiny
        write_tiny_model(out, spec if spec.seed is not None else dataclasses.replace(spec, seed=cfg.trainer.seed))
    s = cfg.synthetic
    if s.enabled:
        data_dir = run.root / "data"
        if not (data_dir / "eval.jsonl").exists():
            kw = dict(min_digits=s.min_digits, max_digits=s.max_digits)
            write_dataset(data_dir / "train.jsonl", sample_problems(s.train_size, cfg.trainer.seed, "train", **kw), "train")
            write_dataset(data_dir / "eval.jsonl", sample_problems(s.eval_size, cfg.trainer.seed, "eval", **kw), "eval")


def build_context(cfg) -> Context:
    from transformers import AutoTokenizer

    from megatron_rl.data import DataConfig, load_prompts
    from megatron_rl.models import MegatronPolicy, init_distributed
    from megatron_rl.rewards import RewardManager
    from megatron_rl.rollout import EnginePool, make_engines
    from megatron_rl.sync.base import build_weight_sync
    from megatron_rl.tracking import Tracker

    run = RunDir(cfg.trainer.run_dir)
    groups = init_distributed(cfg.policy.parallel, seed=cfg.policy.seed)
    model_path = cfg.model.path or str(run.root / "base_model")
    if groups.rank == 0:
        prepare_inputs(cfg, run)
    if groups.world_size > 1:
        torch.distributed.barrier()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy = MegatronPolicy.from_hf(model_path, cfg.policy, groups)
    ctx = Context(cfg=cfg, run=run, groups=groups, policy=policy, tokenizer=tokenizer, model_path=model_path,
                  entropy_ctl=EntropyController(cfg.algo.entropy))
    max_len = cfg.rollout.max_prompt_len + max(s.max_response_len for s in cfg.stages)
    if ctx.is_driver:
        ctx.engines = make_engines(model_path, cfg.rollout, seed=cfg.trainer.seed, max_model_len=max_len)
        ctx.engine = ctx.engines[0] if len(ctx.engines) == 1 else EnginePool(ctx.engines, cfg.rollout.timeout_s)
        ctx.reward_mgr = RewardManager(cfg.reward)
        max_len = cfg.rollout.max_prompt_len
        ctx.train_records, stats = load_prompts(cfg.data.train_path, tokenizer, cfg.data, max_prompt_len=max_len)
        log.info("train data: %s", stats)
        if cfg.eval.path:  # the held-out set is never filtered by difficulty labels
            eval_cfg = DataConfig.from_dict({**cfg.data.to_dict(), "keep_labels": [], "pass_rate_min": 0.0,
                                             "pass_rate_max": 1.0})
            ctx.eval_records, _ = load_prompts(cfg.eval.path, tokenizer, eval_cfg, max_prompt_len=max_len)
            if cfg.eval.size:
                ctx.eval_records = ctx.eval_records[: cfg.eval.size]
        run_state = run.read_run_state()
        ctx.tracker = Tracker(cfg.tracking, run.root, cfg.to_dict(), wandb_run_id=run_state.get("wandb_run_id"))
        if ctx.tracker.wandb_run_id and run_state.get("wandb_run_id") != ctx.tracker.wandb_run_id:
            run.write_run_state({**run_state, "wandb_run_id": ctx.tracker.wandb_run_id})
    ctx.weight_sync = build_weight_sync(cfg.sync, ctx.engines, sender=ctx.is_driver)
    ctx.weight_sync.connect()
    ctx.install_signal_handlers()
    return ctx
