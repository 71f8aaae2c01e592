"""Everything a run holds, built once: policy, engines, weight sync, rewards, tracker, data.

The entry point starts the world (``init_distributed``) and passes its :class:`ParallelGroups` in.
Only global rank 0 drives the rollout engines, the rewards and tracking; the batch it builds is
broadcast to the other trainer ranks, which take part in every policy collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_rl.algo import EntropyController
from megatron_rl.common.errors import InputError
from megatron_rl.models.parallel import ParallelGroups, named_collective
from megatron_rl.trainer.state import RunDir
from megatron_rl.trainer.stop import StopRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.data import PromptRecord
    from megatron_rl.envs import Environments
    from megatron_rl.models.hf_export import ExportItem
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.reference import ReferencePolicy
    from megatron_rl.rewards import RewardManager
    from megatron_rl.rollout import RolloutEngine
    from megatron_rl.rollout.launcher import EngineLauncher
    from megatron_rl.sync.base import WeightSync
    from megatron_rl.tracking import Tracker
    from megatron_rl.trainer.observe import StepObserver
    from megatron_rl.trainer.schema import RunConfig

log = logging.getLogger("megatron_rl")


@dataclass
class Context:
    cfg: RunConfig
    run: RunDir
    groups: ParallelGroups
    policy: MegatronPolicy
    tokenizer: PreTrainedTokenizerBase
    model_path: str
    entropy_ctl: EntropyController
    stop: StopRequest
    # Driver only (global rank 0); None / empty on the other ranks.
    engine: RolloutEngine | None = None  # the in-process engine, or the fleet of vLLM servers
    reward_mgr: RewardManager | None = None
    tracker: Tracker | None = None
    train_records: list[PromptRecord] = field(default_factory=list)
    # The SFT cold start's problems (sft.data_path; the training prompts when it is empty).
    sft_records: list[PromptRecord] = field(default_factory=list)
    eval_records: list[PromptRecord] = field(default_factory=list)
    # Rollout dumps, W&B sample table and live wrong-label list of every GRPO step.
    observer: StepObserver | None = None
    # The environments of multi-turn prompts (None: the run's data has none; every prompt single-turn).
    envs: Environments | None = None
    # Every rank (the export is collective; each sending rank moves its own tensors).
    weight_sync: WeightSync | None = None
    # Every HF tensor a sync sends, with the trainer rank that sends it (sync.senders).
    export_plan: list[ExportItem] = field(default_factory=list)
    # This node's engines, when this trainer process started them (colocated, no node launcher).
    launcher: EngineLauncher | None = None
    # Colocated on GPUs: the engines free their KV cache (and offload weights) while the policy trains.
    sleep_while_training: bool = False
    engines_asleep: bool = False
    # Every rank, when algo.kl.enabled: built at the first stage (checkpointing.ensure_reference).
    reference: ReferencePolicy | None = None
    # Every rank, with algo.distill: the teacher, built at the first stage (teacher.ensure_teacher).
    teacher: ReferencePolicy | None = None

    @property
    def is_driver(self) -> bool:
        return self.groups.rank == 0

    def engines_sleep(self) -> None:
        """Colocated on GPUs: the engines give their memory to the training step (driver only)."""
        if self.sleep_while_training and self.is_driver and not self.engines_asleep:
            self.engine.sleep()
            self.engines_asleep = True

    def engines_wake(self) -> None:
        """Before a sync or a generation: the engines take their memory back (idempotent)."""
        if self.engines_asleep and self.is_driver:
            self.engine.wake_up()
            self.engines_asleep = False

    def broadcast(self, obj, what: str = "a broadcast from rank 0"):
        """Rank 0's ``obj`` on every trainer rank (a failure or timeout names ``what`` and the caller)."""
        if self.groups.world_size == 1:
            return obj
        box = [obj]
        with named_collective(what, self.groups.timeout_s, depth=3):
            torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def stop_agreed(self) -> bool:
        """Any rank's stop request stops every rank (so all of them write the same checkpoint)."""
        if self.groups.world_size == 1:
            return self.stop.requested
        flag = torch.tensor([1.0 if self.stop.requested else 0.0])
        with named_collective("the ranks' vote on a stop request", self.groups.timeout_s, depth=3):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def build_context(cfg: RunConfig, groups: ParallelGroups, model_path: str, stop: StopRequest) -> Context:
    """Policy on every rank; engines, rewards, data and tracker on the driver; the weight sync."""
    from megatron_rl.models.hf_config import HFModelError, read_hf_config
    from megatron_rl.models.parallel import check_layout
    from megatron_rl.trainer.schema import check_model_limits, check_routing_replay

    # The model's own limits, before anything is built from it (or its libraries imported).
    arch = read_hf_config(model_path)
    max_positions = arch.max_position_embeddings
    check_model_limits(cfg, max_positions, str(Path(model_path) / "config.json"))
    check_routing_replay(cfg, getattr(arch, "is_moe", False), str(Path(model_path) / "config.json"))
    # the layout against the model (heads, layers, experts), before any server starts
    check_layout(cfg.policy.parallel, groups.world_size, arch.shape)

    from transformers import AutoTokenizer

    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.rewards import RewardManager
    from megatron_rl.sync.base import build_weight_sync
    from megatron_rl.tracking import Tracker
    from megatron_rl.trainer.engines import build_engine, check_external_servers, expected_engines, start_colocated

    run = RunDir(cfg.trainer.run_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:  # no tokenizer files, or ones transformers cannot read
        raise HFModelError(f"{model_path}: cannot load the tokenizer ({exc})") from None
    train_records, sft_records, eval_records, problem, envs = [], [], [], None, None
    if groups.rank == 0:  # the data first: a bad file fails before any model or engine is built
        try:
            run.recover()  # what a save killed mid-way left behind
            train_records, sft_records, eval_records = load_run_data(cfg, tokenizer, max_positions)
            envs = open_envs(cfg, tokenizer, train_records, sft_records, eval_records)
            check_external_servers(cfg, model_path)
            check_model_dirs(cfg, run)
        except InputError as exc:
            problem = exc
    raise_agreed(problem, groups, "rank 0's start-up checks (data, run directory, external servers)")
    launcher = start_colocated(cfg, model_path)  # servers boot while the policy builds
    policy = MegatronPolicy.from_hf(model_path, cfg.policy, groups)
    ctx = Context(cfg=cfg, run=run, groups=groups, policy=policy, tokenizer=tokenizer, model_path=model_path,
                  entropy_ctl=EntropyController(cfg.algo.entropy), stop=stop, launcher=launcher,
                  train_records=train_records, sft_records=sft_records, eval_records=eval_records, envs=envs)
    names = expected_engines(cfg, groups) if cfg.rollout.engine == "vllm_server" else None
    if launcher is not None:
        launcher.wait_ready()
        launcher.supervise_in_background()  # a server that dies is restarted, then re-admitted
    ctx.sleep_while_training = (cfg.rollout.engine == "vllm_server" and cfg.rollout.placement == "colocated"
                                and torch.cuda.is_available())
    problem = None
    if ctx.is_driver:
        try:
            ctx.engine = build_engine(cfg, model_path, names)
        except Exception as exc:  # noqa: BLE001  (re-raised on every rank, here as it is)
            problem = exc
    raise_agreed(problem, groups, "rank 0's connection to the rollout engines")
    if ctx.is_driver:
        ctx.reward_mgr = RewardManager(cfg.reward)
        run_state = run.read_run_state()
        ctx.tracker = Tracker(cfg.tracking, run.root, cfg.to_dict(), wandb_run_id=run_state.get("wandb_run_id"))
        if ctx.tracker.wandb_run_id and run_state.get("wandb_run_id") != ctx.tracker.wandb_run_id:
            run.write_run_state({**run_state, "wandb_run_id": ctx.tracker.wandb_run_id})
        ctx.observer = build_observer(cfg, run.root, ctx.tracker)
    ctx.export_plan = policy.export_plan(to_rank=cfg.sync.gather_rank())
    ctx.weight_sync = build_weight_sync(cfg.sync, ctx.engine, rank=groups.rank, metadata=ctx.export_plan)
    ctx.weight_sync.connect()
    return ctx


def raise_agreed(problem: Exception | None, groups: ParallelGroups, what: str) -> None:
    """Rank 0's ``problem`` (None: none) raised on every trainer rank, so that none waits for a
    driver that stopped: an :class:`InputError` as one (each rank prints its line), anything else as
    a RuntimeError naming ``what`` rank 0 was doing; rank 0 raises its own."""
    if groups.world_size > 1:
        said = None if problem is None else (isinstance(problem, InputError), str(problem))
        box = [said]
        with named_collective(what, groups.timeout_s, depth=3):
            torch.distributed.broadcast_object_list(box, src=0)
        if box[0] is not None and problem is None:
            user, message = box[0]
            problem = InputError(message) if user else RuntimeError(f"rank 0 failed in {what}: {message}")
    if problem is not None:
        raise problem


def check_model_dirs(cfg: RunConfig, run: RunDir) -> None:
    """The checkpoint and model directories a later stage reads, checked at start-up: a wrong path
    stops the run before the SFT cold start or a stage trains, not when the stage that reads it
    begins. ``trainer.init_from`` (while the first stage has not started) a complete checkpoint;
    ``policy.reference.path`` (with the KL term) and ``algo.distill.teacher`` (with distillation) a
    readable ``config.json``."""
    from megatron_rl.models.hf_config import HFModelError, read_hf_config
    from megatron_rl.trainer.state import STATE_FILE, CheckpointError

    first = cfg.stages[0].name
    if cfg.trainer.init_from and not (RunDir.is_complete(run.final_dir(first)) or run.step_checkpoints(first)):
        if not RunDir.is_complete(Path(cfg.trainer.init_from)):
            raise CheckpointError(f"trainer.init_from={cfg.trainer.init_from} is not a complete checkpoint "
                                  f"(no {STATE_FILE})")
    for key, path in (("policy.reference.path", cfg.policy.reference.path if cfg.algo.kl.enabled else ""),
                      ("algo.distill.teacher", cfg.algo.distill.teacher if cfg.algo.distill.enabled else "")):
        if path:
            try:
                read_hf_config(path)
            except HFModelError as exc:
                raise HFModelError(f"{key}: {exc}") from None


def load_run_data(cfg: RunConfig, tokenizer, max_positions: int | None = None
                  ) -> tuple[list[PromptRecord], list[PromptRecord], list[PromptRecord]]:
    """Training, SFT cold-start (sft.data_path; the training prompts when it is empty) and held-out
    prompts (``eval.path``, its first ``eval.size``; never filtered by difficulty labels). Prompts
    longer than ``rollout.max_prompt_len`` (what the engines are sized for) or a stricter
    ``data.max_prompt_len`` are dropped and counted; a :class:`DataError` names the file when one
    cannot serve the run, and the file and row of an SFT problem without a reference solution or
    whose prompt + solution exceeds the model's ``max_positions``, or of a prompt whose reward style
    resolves to none (a RewardDataError, as is a code-scored set on a machine without the sandbox)."""
    from megatron_rl.data import DataConfig, DataError, load_prompts

    max_len = min(n for n in (cfg.rollout.max_prompt_len, cfg.data.max_prompt_len) if n > 0)
    train, stats = load_prompts(cfg.data.train_path, tokenizer, cfg.data, max_prompt_len=max_len)
    log.info("train data: %s", stats)
    sft, sft_path = train, cfg.data.train_path
    if cfg.sft.enabled and cfg.sft.data_path:
        sft, stats = load_prompts(cfg.sft.data_path, tokenizer, cfg.data, max_prompt_len=max_len)
        sft_path = cfg.sft.data_path
        log.info("sft data: %s", stats)
    if cfg.sft.enabled:
        check_demonstrations(sft, sft_path, tokenizer, max_positions)
    if cfg.sft.enabled and len(sft) <= cfg.sft.eval_size:
        raise DataError(f"{sft_path}: {len(sft)} usable prompts, but the SFT cold start "
                        f"holds out sft.eval_size={cfg.sft.eval_size} of them for validation and "
                        f"trains on the rest: lower sft.eval_size or add data")
    held_out: list[PromptRecord] = []
    if cfg.eval.path:
        eval_cfg = DataConfig.from_dict({**cfg.data.to_dict(), "keep_labels": [], "pass_rate_min": 0.0,
                                         "pass_rate_max": 1.0})
        held_out, stats = load_prompts(cfg.eval.path, tokenizer, eval_cfg, max_prompt_len=max_len)
        log.info("held-out data: %s", stats)
        if cfg.eval.size and len(held_out) < cfg.eval.size:
            log.warning("%s: eval.size=%d, but %d held-out prompts are usable (%d of %d rows dropped): "
                        "the evaluation scores %d", cfg.eval.path, cfg.eval.size, len(held_out),
                        stats["dropped"], stats["rows"], len(held_out))
        if cfg.eval.size:
            held_out = held_out[: cfg.eval.size]
    from megatron_rl.rewards import check_reward_styles

    for path, records in ((cfg.data.train_path, train), (cfg.eval.path, held_out)):  # what gets scored
        counts = check_reward_styles(cfg.reward, records, path)
        if counts:
            log.info("%s: prompts per reward style: %s", path, counts)
    return train, sft, held_out


def open_envs(cfg: RunConfig, tokenizer, train: list[PromptRecord], sft: list[PromptRecord],
              held_out: list[PromptRecord]) -> Environments | None:
    """The run's environments when any prompt has one (multi-turn rollouts), else None. A prompt
    naming an unknown environment is a DataError (file and row); so is a chat template that cannot
    render tool messages, when some prompt needs it."""
    from megatron_rl.envs import Environments

    envs = Environments(cfg.envs, tokenizer, max_turns=cfg.rollout.max_turns, sandbox=cfg.reward.code.sandbox,
                        wait_s=cfg.rollout.timeout_s)
    counts: dict[str, int] = {}
    sets = [(cfg.data.train_path, train), (cfg.eval.path, held_out)]
    if cfg.sft.enabled and cfg.sft.data_path:
        sets.append((cfg.sft.data_path, sft))
    for path, records in sets:
        for name, n in envs.check(records, path).items():
            counts[name] = counts.get(name, 0) + n
    if not counts:
        envs.close()
        return None
    log.info("multi-turn prompts per environment: %s (rollout.max_turns=%d)", counts, cfg.rollout.max_turns)
    return envs


def check_demonstrations(records: list[PromptRecord], path: str, tokenizer, max_positions: int | None,
                         chunk: int = 1024) -> None:
    """The SFT cold start trains on prompt + reference solution + EOS: every problem needs its
    solution, and the whole sequence must fit the model's positions (a :class:`DataError` naming
    file and row, before any model is built)."""
    from megatron_rl.data import DataError
    from megatron_rl.trainer.phases import demonstration, reference_solution

    sols = []
    for r in records:
        try:
            sols.append(reference_solution(r))
        except ValueError as exc:
            raise DataError(f"{path}: row {r.row}: {exc}") from None
    if max_positions is None:
        return
    texts = [(r, s) for r, s in zip(records, sols) if isinstance(s, str)]
    for r, sol in zip(records, sols):  # demonstrated trajectories: as the rollout lays them out
        if not isinstance(sol, str):
            try:
                n = len(r.prompt_ids) + len(demonstration(r, tokenizer)[0])
            except InputError as exc:  # the chat template cannot render its tool messages
                raise DataError(f"{path}: row {r.row}: {exc}") from None
            if n > max_positions:
                raise DataError(f"{path}: row {r.row}: the SFT sequence (prompt {len(r.prompt_ids)} + the "
                                f"demonstrated trajectory) is {n} tokens, more than the model's "
                                f"max_position_embeddings ({max_positions})")
    for start in range(0, len(texts), chunk):
        part = texts[start:start + chunk]
        ids = tokenizer([s for _, s in part], add_special_tokens=False)["input_ids"]
        for (r, _), sol in zip(part, ids):
            n = len(r.prompt_ids) + len(sol) + 1  # + EOS
            if n > max_positions:
                raise DataError(f"{path}: row {r.row}: the SFT sequence (prompt {len(r.prompt_ids)} + "
                                f"reference solution {len(sol)} + EOS) is {n} tokens, more than the "
                                f"model's max_position_embeddings ({max_positions})")


def build_observer(cfg: RunConfig, root, tracker: Tracker | None) -> StepObserver:
    from megatron_rl.data.wrong_labels import WrongLabelMonitor
    from megatron_rl.tracking.rollouts import RolloutDumper
    from megatron_rl.trainer.observe import StepObserver

    dump = cfg.tracking.rollouts
    return StepObserver(root, RolloutDumper(dump, root) if dump.enabled else None,
                        WrongLabelMonitor(cfg.data.wrong_labels) if cfg.data.wrong_labels.enabled else None,
                        tracker, dump.wandb_samples)
