"""The run's schema: one typed section per component, the cross-component checks, and loading.

It sits above every component (it imports each one's config; none imports it), so it lives with
the trainer, the one package that takes the whole run config.

    cfg = load_run_config("configs/demo_cpu.yaml", ["rollout.temperature=0.8", "trainer.run_dir=runs/x"])

The string ``{run_dir}`` in any value is replaced by ``trainer.run_dir`` after merging, and
``{config_dir}`` by the directory of the config file (a task's own files beside its config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.algo.config import AlgoConfig
from megatron_rl.config.base import ConfigBase, ConfigError
from megatron_rl.config.loader import load, substitute
from megatron_rl.data.config import DataConfig
from megatron_rl.demo.config import SyntheticConfig, TinySpec
from megatron_rl.envs.config import EnvConfig
from megatron_rl.models.config import PolicyConfig
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.sync.config import ONE_SENDER, SyncConfig
from megatron_rl.tracking.config import TrackingConfig
from megatron_rl.trainer.config import DEFAULT_RUN_DIR, EvalConfig, SFTConfig, StageConfig, TrainerConfig


@dataclass(kw_only=True)
class ModelConfig(ConfigBase):
    # Hugging Face checkpoint directory (Qwen2 / Qwen3 / Llama). Empty with ``tiny`` set: build one.
    path: str = ""
    # Build a tiny random model into RUN_DIR/base_model when ``path`` is empty.
    tiny: TinySpec | None = None

    def validate(self) -> None:
        super().validate()
        if not self.path and self.tiny is None:
            self.fail("path", "set model.path to a Hugging Face checkpoint, or model.tiny to build one")


@dataclass(kw_only=True)
class RunConfig(ConfigBase):
    # The starting checkpoint.
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # Environments of multi-turn rollouts with tools (which prompts get one: the data, envs.env_map).
    envs: EnvConfig = field(default_factory=EnvConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # Multi-stage GRPO; each stage sets its max response length and step budget.
    stages: list[StageConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        for s in self.stages:  # a stage without its own length samples rollout.max_response_len
            if s.max_response_len is None:
                s.max_response_len = self.rollout.max_response_len

    def validate(self) -> None:
        super().validate()
        validate_cross(self)

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise ConfigError("stages", f"no stage named {name!r}; stages are {[s.name for s in self.stages]}")


# Why the in-process engine cannot run beside a multi-process trainer (the refusal's reason).
IN_PROCESS_ENGINE_ONE_RANK = (
    "rollout.engine='vllm' (vLLM in the trainer's process) runs with one trainer process only: vLLM "
    "builds its process groups on the trainer's torch.distributed world, and with several ranks it waits "
    "for the others forever. Use rollout.engine='vllm_server' (vLLM in processes of its own; "
    "sync.transport gloo on CPU, nccl on GPUs)")


def check_world_size(cfg: RunConfig, world_size: int, where: str = "WORLD_SIZE") -> None:
    """Checks that need the number of trainer processes (``where`` says where it comes from: the
    launcher's environment, ``nodes x procs per node``): the in-process engine needs one, and the
    layout must fit. Before anything starts, on every rank alike (no collective)."""
    if cfg.rollout.engine == "vllm" and world_size > 1:
        raise ConfigError("rollout.engine", f"{where}={world_size}, but {IN_PROCESS_ENGINE_ONE_RANK}")
    cfg.policy.parallel.check_world(world_size, where)


def validate_cross(cfg: RunConfig) -> None:
    """Checks that span components (each component checks its own fields in its validate)."""
    if not cfg.stages:
        raise ConfigError("stages", "at least one stage is required")
    names = [s.name for s in cfg.stages]
    if len(set(names)) != len(names):
        raise ConfigError("stages", f"stage names must be unique, got {names}")
    servers = cfg.rollout.engine == "vllm_server"
    if servers and cfg.sync.transport == "inprocess":
        raise ConfigError("sync.transport", "rollout.engine='vllm_server' runs engines in their own processes: "
                                            "use 'gloo' (CPU), 'nccl' or 'ipc' (GPUs)")
    if not servers and cfg.sync.transport != "inprocess":
        raise ConfigError("sync.transport", f"'{cfg.sync.transport}' drives vLLM servers: it needs "
                                            "rollout.engine='vllm_server' (the in-process engine uses 'inprocess')")
    if not servers:
        par = cfg.policy.parallel
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
            if getattr(par, name) > 1:
                raise ConfigError(f"policy.parallel.{name}", f"{getattr(par, name)} needs as many trainer processes, "
                                                             f"but {IN_PROCESS_ENGINE_ONE_RANK}")
    par = cfg.policy.parallel
    # the owners' plan has a sender per pipeline stage and, with expert parallelism, per EP rank
    many = [f"{k}={getattr(par, k)}" for k in ("pipeline_parallel", "expert_parallel") if getattr(par, k) > 1]
    if cfg.sync.transport in ONE_SENDER and cfg.sync.senders == "owners" and many:
        raise ConfigError("sync.senders", f"'owners' streams from several trainer ranks ({', '.join(many)}: "
                                          f"each stage its layers, each EP rank its experts), "
                                          f"but vLLM's {cfg.sync.transport} engine receives from one trainer "
                                          f"rank: set sync.senders=gather (rank 0 gathers the model and "
                                          f"sends it), or use sync.transport=gloo")
    if cfg.rollout.async_.dynamic_sampling and not cfg.algo.filter_zero_variance_groups:
        raise ConfigError("rollout.async.dynamic_sampling", "keeps drawing until the step has groups with reward "
                                                            "variance: it needs algo.filter_zero_variance_groups=true")
    if cfg.rollout.async_.dynamic_sampling and cfg.algo.distill.enabled:
        raise ConfigError("rollout.async.dynamic_sampling", "keeps drawing until the step has groups with reward "
                                                            "variance, but with algo.distill every group trains (the "
                                                            "teacher's signal): it would draw nothing more")
    ref = cfg.policy.reference
    if not cfg.algo.kl.enabled:
        for name, value in (("path", ref.path), ("offload", ref.offload)):
            if value:
                raise ConfigError(f"policy.reference.{name}", f"is set ({value!r}) but algo.kl.enabled "
                                                             f"is false: nothing uses a reference policy")
    n_mb = cfg.algo.mini_batches
    if cfg.rollout.rollout_batch_size % n_mb:
        raise ConfigError("algo.mini_batches", f"must divide rollout.rollout_batch_size="
                                               f"{cfg.rollout.rollout_batch_size}, got {n_mb}")
    if cfg.rollout.group_size < 2:  # every registered estimator centres rewards within a group
        raise ConfigError("rollout.group_size", f"must be >= 2 with algo.adv_estimator="
                                                f"{cfg.algo.adv_estimator!r}: a group of one response "
                                                f"has zero reward variance, so no response would ever "
                                                f"get an advantage, got {cfg.rollout.group_size}")
    a = cfg.algo
    uses_k = a.adv_estimator == "passk" or "passk" in a.shaping.shapers
    if uses_k and a.passk.k > cfg.rollout.group_size:
        raise ConfigError("algo.passk.k", f"pass@{a.passk.k} needs groups of at least k responses: "
                                          f"rollout.group_size is {cfg.rollout.group_size}")
    if "overlong" in a.shaping.shapers:
        for i, s in enumerate(cfg.stages):
            if a.shaping.overlong_buffer >= s.max_response_len:
                raise ConfigError("algo.shaping.overlong_buffer",
                                  f"{a.shaping.overlong_buffer} must be shorter than stages[{i}] "
                                  f"({s.name!r})'s max_response_len {s.max_response_len}: the soft "
                                  f"zone is the last overlong_buffer tokens before it")
    if cfg.sft.control and not cfg.sft.enabled:
        raise ConfigError("sft.control", "needs sft.enabled=true: the control experiment starts from "
                                         "the cold start's checkpoint")
    if cfg.data.max_prompt_len > cfg.rollout.max_prompt_len:
        raise ConfigError("data.max_prompt_len", f"{cfg.data.max_prompt_len} would keep prompts longer than "
                                                 f"rollout.max_prompt_len ({cfg.rollout.max_prompt_len}), "
                                                 f"which the engines are sized for: set it <= "
                                                 f"{cfg.rollout.max_prompt_len} (0: rollout.max_prompt_len "
                                                 f"alone) or raise rollout.max_prompt_len")
    if cfg.model.tiny is not None and not cfg.model.path:
        check_model_limits(cfg, cfg.model.tiny.max_position_embeddings, "model.tiny")
        check_routing_replay(cfg, cfg.model.tiny.is_moe, f"model.tiny.arch={cfg.model.tiny.arch!r}")


def check_routing_replay(cfg: RunConfig, is_moe: bool, model: str) -> None:
    """MoE routing replay (``algo.routing_replay``, ``algo.router_agreement``) needs a model with
    experts; ``model`` names where the architecture comes from."""
    if is_moe:
        return
    a = cfg.algo
    if a.routing_replay != "off":
        raise ConfigError("algo.routing_replay", f"{a.routing_replay!r} replays MoE routes, but {model} is a dense "
                                                 f"model (no experts, no routers): use 'off'")
    if a.router_agreement:
        raise ConfigError("algo.router_agreement", f"measures MoE routing, but {model} is a dense model (no "
                                                   f"experts, no routers): use false")


def sampled_lengths(cfg: RunConfig) -> list[tuple[str, str, int]]:
    """Every response length the engines are asked for, as (config key, what samples it, tokens):
    each stage's max_response_len and, when set, the greedy evaluation's rollout.eval_max_tokens
    (unset, an evaluation samples the length of the stage it follows)."""
    out = [(f"stages[{i}].max_response_len", f"stage {s.name!r}", s.max_response_len)
           for i, s in enumerate(cfg.stages)]
    if cfg.rollout.eval_max_tokens is not None:
        out.append(("rollout.eval_max_tokens", "the greedy evaluation", cfg.rollout.eval_max_tokens))
    return out


def max_sequence_len(cfg: RunConfig) -> int:
    """The longest prompt + response any engine is asked for: the engines' max model length."""
    return cfg.rollout.max_prompt_len + max(n for _, _, n in sampled_lengths(cfg))


def check_model_limits(cfg: RunConfig, max_positions: int, model: str) -> None:
    """Every prompt + response the run samples (each stage's, the evaluation's) must fit the
    model's positions (before anything is built); ``model`` says where the limit comes from (the
    config key or the model's config.json)."""
    for key, what, n in sampled_lengths(cfg):
        need = cfg.rollout.max_prompt_len + n
        if need > max_positions:
            raise ConfigError(key, f"{what}: rollout.max_prompt_len ({cfg.rollout.max_prompt_len}) + "
                                   f"{key.rsplit('.', 1)[-1]} ({n}) = {need} exceeds the model's "
                                   f"max_position_embeddings ({max_positions}, {model})")


def _substitute_run_dir(tree: dict, config_dir: str = ".") -> dict:
    tree = substitute(tree, "{config_dir}", config_dir)
    run_dir = str((tree.get("trainer") or {}).get("run_dir", DEFAULT_RUN_DIR))
    return substitute(tree, "{run_dir}", run_dir)


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None,
                    validate: bool = True) -> RunConfig:
    """The run config from ``path`` (YAML, ``defaults:`` inheritance) and ``a.b=value`` overrides."""
    config_dir = str(Path(path).resolve().parent) if path else "."
    return load(RunConfig, path, overrides, validate=validate,
                prepare=lambda tree: _substitute_run_dir(tree, config_dir))
