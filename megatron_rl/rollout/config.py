"""Rollout configuration: how responses are sampled and where the engines run."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config.base import ConfigBase, ranged

ENGINES = ("vllm", "vllm_server")
PLACEMENTS = ("colocated", "dedicated", "external")
# The keys of a fleet of vLLM servers (placement, discovery, control timeouts, dispatch); the
# in-process engine has none of these.
SERVER_ONLY = ("placement", "engines_per_node", "server_urls", "hosts", "registry_dir", "start_timeout_s",
               "control_timeout_s", "max_inflight_seqs", "hedge_after")


@dataclass(kw_only=True)
class AsyncConfig(ConfigBase):
    """Asynchronous GRPO (``rollout.async``): generation overlaps training, and the step's groups
    are drawn by one scheduler (``megatron_rl.trainer.async_rollout``) that also does DAPO's dynamic
    sampling."""

    # How many weight versions older than the trainer's a sample trained on may be (a sample's
    # version is that of its oldest token). 0: today's loop exactly (generate, train, sync, in turn).
    # 1: one-step-off: step k+1's rollouts are generated while step k trains. Higher values allowed.
    max_staleness: int = ranged(0, ge=0)
    # At a weight update, requests in flight are frozen, the new weights loaded and generation
    # resumed (servers: /pause?mode=keep, load, /resume; in-process: between two engine steps; their
    # KV is recomputed with the new weights); each response records the version of each of its
    # segments. Off: a weight update first waits for the requests in flight. Needs max_staleness >= 1.
    partial_rollout: bool = False
    # Dispatch this fraction more prompts than a step needs (0.25: 25% more); the step takes the
    # first groups to finish, the others keep generating for later steps, and a group older than
    # max_staleness is dropped (and counted); leftovers that cannot be trained on in time are
    # aborted (servers: /abort_requests). Cuts the long tail.
    oversample: float = ranged(0.0, ge=0.0)
    # DAPO dynamic sampling: keep drawing prompts until the step has rollout_batch_size groups with
    # reward variance (zero-variance groups are generated, counted and dropped). Needs
    # algo.filter_zero_variance_groups; refused with algo.distill (every group trains there).
    dynamic_sampling: bool = False
    # Cap of dynamic sampling: at most this many times rollout_batch_size prompts are drawn for one
    # step; a step that reaches it trains on the groups it has. Refused without dynamic_sampling.
    max_draw_factor: float = ranged(3.0, ge=1.0)

    @property
    def enabled(self) -> bool:
        """Anything but today's synchronous loop."""
        return self.max_staleness > 0 or self.oversample > 0 or self.dynamic_sampling

    @property
    def needs_streaming(self) -> bool:
        """Requests must be loaded with weights in flight or stopped early (a streaming engine)."""
        return self.partial_rollout or self.oversample > 0

    def validate(self) -> None:
        super().validate()
        if not self.dynamic_sampling and self.differs_from_default("max_draw_factor"):
            self.fail("max_draw_factor", f"caps dynamic sampling's draws ({self.max_draw_factor:g} x "
                                         f"rollout_batch_size); without dynamic_sampling=true nothing draws "
                                         f"more than a step's prompts, so it would do nothing")
        if self.partial_rollout and self.max_staleness < 1:
            self.fail("partial_rollout", "needs max_staleness >= 1 (a response sampled across a weight "
                                         "update is one version old when it is trained on)")


@dataclass(kw_only=True)
class RolloutConfig(ConfigBase):
    # Which engine: "vllm" (one engine in the trainer's process: the CPU demo) or "vllm_server"
    # (vLLM server processes driven over HTTP through vLLM's RL API; see ``placement``).
    engine: str = "vllm"
    # vllm_server: where the servers run. "colocated": every trainer node starts the engines for its
    # own GPUs (slurm/node_launch.sh, or the trainer itself when no launcher did); "dedicated": the
    # ROLLOUT_NODES hosts run them as their own srun step; "external": servers you run, at
    # ``server_urls``.
    placement: str = "colocated"
    # vllm_server: data-parallel engines the trainer waits for (all nodes together); each is one
    # vLLM server with vLLM TP = ``tensor_parallel_size``. 0: every node's ``engines_per_node``
    # (colocated: the trainer's nodes; dedicated: ``hosts``).
    num_engines: int = ranged(1, ge=0)
    # vllm_server (colocated / dedicated): engines each node's launcher starts.
    engines_per_node: int = ranged(1, ge=1)
    # vllm_server, external: base URLs of the servers (e.g. ["http://10.0.0.5:8000"]).
    server_urls: list[str] = field(default_factory=list)
    # vllm_server, dedicated: the hosts that run engines (set by the sbatch scripts); the trainer
    # then names the engines that did not come up. Empty: only their number is checked.
    hosts: list[str] = field(default_factory=list)
    # vllm_server: directory where launched engines register (host, port, model, version); empty:
    # RUN_DIR/engines.
    registry_dir: str = ""
    # vllm_server: seconds to wait for the engines to register and answer /health at start-up, and,
    # when every engine is lost (mid-step or at a sync), for their launchers to restart some.
    start_timeout_s: float = ranged(900.0, gt=0.0)
    # vllm_server: seconds a control call (/health, /pause, /reset_prefix_cache, ...) may take.
    control_timeout_s: float = ranged(30.0, gt=0.0)
    # vllm_server: sequences one engine is given at a time (requests wait for the least loaded
    # engine beyond that, so a slow engine gets fewer); 0: ``max_num_seqs``.
    max_inflight_seqs: int = ranged(0, ge=0)
    # vllm_server: tail hedging. When no request waits for room, an engine with room also takes a
    # request that has run on another engine for longer than this many times its own median request
    # time (same seed, so the same samples); the first answer is taken and the other copy aborted
    # (``rollout/hedged_requests``, ``rollout/hedge_wins``). A slow engine's last requests then finish
    # on the fast ones; one that stopped answering is still marked down within ``timeout_s`` (its
    # aborted copies must answer within it). 0: off.
    hedge_after: float = ranged(1.5, ge=1.0, also=(0.0,))
    # Prompts per step (the seed's rollout batch size).
    rollout_batch_size: int = ranged(64, ge=1)
    # Responses sampled per prompt (the GRPO group size).
    group_size: int = ranged(8, ge=1)
    # Sampling temperature; log-probs for the ratio are recomputed at this same temperature.
    temperature: float = ranged(1.0, gt=0.0)
    # Nucleus sampling; the recomputed log-probs honour it through vLLM's processed log-probs.
    top_p: float = ranged(1.0, gt=0.0, le=1.0)
    # -1 disables top-k.
    top_k: int = ranged(-1, ge=1, also=(-1,))
    # Maximum response length in tokens of a stage that does not set its own (stages[i].max_response_len:
    # 8k -> 16k -> 32k in the recipe).
    max_response_len: int = ranged(64, ge=1)
    # Maximum prompt length in tokens (longer prompts are filtered by the data loader).
    max_prompt_len: int = ranged(64, ge=1)
    # Multi-turn rollouts (prompts with an environment, section envs): model turns per trajectory; the
    # stage's max_response_len bounds the whole trajectory (model and tool-observation tokens).
    max_turns: int = ranged(4, ge=1)
    # vLLM: dtype of the engine weights ("float32" on CPU; "bfloat16" on GPUs).
    dtype: str = "float32"
    # vLLM: bytes of KV cache (CPU needs an explicit size); 0 lets vLLM decide (GPU).
    kv_cache_bytes: int = ranged(256 * 1024 * 1024, ge=0)
    # vLLM: gpu_memory_utilization (GPU only).
    gpu_memory_utilization: float = ranged(0.5, gt=0.0, le=1.0)
    # vLLM tensor parallel size per engine.
    tensor_parallel_size: int = ranged(1, ge=1)
    # vLLM: run without CUDA graphs / compilation (required on CPU, faster start).
    enforce_eager: bool = True
    # vLLM: maximum sequences batched together.
    max_num_seqs: int = ranged(256, ge=1)
    # Seconds one generation request (or, in-process, one generate call) may take before its engine
    # is treated as hung; a server that does not answer in time is marked down and its requests go
    # to the other engines.
    timeout_s: float = ranged(600.0, gt=0.0)
    # Greedy evaluation: how many tokens the evaluation may generate (unset: the max_response_len of
    # the stage it follows). The engines are sized for it; max_prompt_len + it must fit the model.
    eval_max_tokens: int | None = ranged(None, ge=1)
    # Asynchronous GRPO and DAPO dynamic sampling: how far generation may run ahead of training.
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})

    def validate(self) -> None:
        super().validate()
        if self.engine not in ENGINES:
            self.fail("engine", f"must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.placement not in PLACEMENTS:
            self.fail("placement", f"must be one of {list(PLACEMENTS)}, got {self.placement!r}")
        if self.engine == "vllm":  # the in-process engine: the fleet's keys would do nothing
            for name in SERVER_ONLY:
                if self.differs_from_default(name):
                    self.fail(name, f"acts on vLLM servers (engine='vllm_server') only, got {getattr(self, name)!r} "
                                    f"with engine='vllm' (the in-process engine), which ignores it")
        if self.engine == "vllm" and self.num_engines != 1:
            self.fail("num_engines", f"{self.num_engines} engines need engine='vllm_server' "
                                     "(the in-process engine is one)")
        if self.engine == "vllm_server" and self.placement == "external":
            if not self.server_urls:
                self.fail("server_urls", "placement 'external' needs the servers' URLs")
            for i, url in enumerate(self.server_urls):
                if not url.startswith(("http://", "https://")):
                    self.fail("server_urls", f"entry {i} must start with http:// or https://, got {url!r}")
            if self.num_engines not in (0, 1, len(self.server_urls)):
                self.fail("num_engines", f"is {self.num_engines} but server_urls lists "
                                         f"{len(self.server_urls)} servers")
        if self.num_engines == 0 and not (self.engine == "vllm_server" and self.placement != "external"):
            self.fail("num_engines", "0 (every node's engines) needs engine='vllm_server' launched per node")

    def expected_engines(self) -> int:
        """How many engines the trainer waits for."""
        return len(self.server_urls) if self.placement == "external" else self.num_engines

    def inflight_seqs(self) -> int:
        return self.max_inflight_seqs or self.max_num_seqs
