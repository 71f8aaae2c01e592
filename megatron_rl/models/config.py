"""Configuration of the Megatron policy: parallel layout, optimizer and schedule, micro-batching."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.config.base import ConfigBase, ranged


@dataclasses.dataclass(kw_only=True)
class ParallelConfig(ConfigBase):
    """How the policy is split over the trainer's ranks; data parallel = world size / (TP x PP x CP).

    Mixture-of-Experts models split their experts on a second grid over the same ranks (Megatron's):
    world size = expert_tensor_parallel x expert_parallel x PP x expert data parallel.
    """

    # Tensor-parallel size: attention heads, MLP and vocabulary split across this many ranks.
    tensor_parallel: int = ranged(1, ge=1)
    # Pipeline-parallel size: transformer layers split into this many stages.
    pipeline_parallel: int = ranged(1, ge=1)
    # Virtual pipeline stages (model chunks) per pipeline rank for the interleaved 1F1B schedule;
    # None = plain 1F1B. Needs pipeline_parallel > 1.
    virtual_pipeline: int | None = ranged(None, ge=1)
    # Sequence parallelism (shards LayerNorm/dropout activations over the TP group); needs TP > 1.
    sequence_parallel: bool = False
    # Context-parallel size: every sequence is split over this many ranks (2 x CP load-balanced
    # chunks, Megatron's layout), which divides each rank's activation memory by about CP.
    # Attention over the split sequence: Transformer Engine's on GPUs (layer_spec te), ours (an
    # all-gather of K/V over the CP group) on the CPU.
    context_parallel: int = ranged(1, ge=1)
    # How Transformer Engine's attention exchanges K/V over the CP group: p2p (ring), all_gather,
    # a2a (heads all-to-all; needs the attention heads per TP rank divisible by CP). The CPU path
    # always all-gathers; the result is the same.
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    # Mixture-of-Experts models only: expert-parallel size, the routed experts of every MoE layer
    # split into this many groups, one per rank of an expert-parallel group (tokens travel to their
    # experts' ranks by all-to-all). Must divide the number of experts; expert_parallel x
    # expert_tensor_parallel x pipeline_parallel must divide the world size.
    expert_parallel: int = ranged(1, ge=1)
    # Mixture-of-Experts models only: tensor-parallel size inside each routed expert (its SwiGLU
    # split like a dense MLP's); null: tensor_parallel (Megatron's default). Must divide
    # moe_intermediate_size.
    expert_tensor_parallel: int | None = ranged(None, ge=1)
    # Shard the optimizer state over the data-parallel ranks (Megatron's distributed optimizer).
    use_distributed_optimizer: bool = False
    # Seconds any collective may wait before the run fails with a timeout instead of hanging.
    timeout_s: float = ranged(600.0, gt=0.0)

    def validate(self) -> None:
        super().validate()
        if self.virtual_pipeline is not None and self.pipeline_parallel < 2 and self.virtual_pipeline > 1:
            self.fail("virtual_pipeline", f"needs pipeline_parallel > 1, got pipeline_parallel="
                      f"{self.pipeline_parallel}")
        if self.sequence_parallel and self.tensor_parallel < 2:
            self.fail("sequence_parallel", f"needs tensor_parallel > 1, got tensor_parallel="
                      f"{self.tensor_parallel}")

    def check_world(self, world_size: int, where: str = "") -> int:
        """The data-parallel size of this layout on ``world_size`` processes (``where``: where that
        number comes from); a layout that does not fit is refused, naming the key."""
        tp, pp, cp = self.tensor_parallel, self.pipeline_parallel, self.context_parallel
        what = f"tensor_parallel ({tp}) x pipeline_parallel ({pp})" + (f" x context_parallel ({cp})" if cp > 1 else "")
        from_ = f" ({where})" if where else ""
        if tp * pp * cp > world_size:
            self.fail("tensor_parallel", f"{what} = {tp * pp * cp} ranks needed but only {world_size} "
                                         f"processes are running{from_}")
        if world_size % (tp * pp * cp):
            self.fail("tensor_parallel", f"{what} = {tp * pp * cp} does not divide the world size "
                                         f"{world_size}{from_}")
        self.check_expert_world(world_size, where)
        return world_size // (tp * pp * cp)

    def check_expert_world(self, world_size: int, where: str = "") -> None:
        """The experts' grid on the same ranks: expert_tensor_parallel x expert_parallel x
        pipeline_parallel must divide the world size (whether the model has experts at all is
        checked where its config is read)."""
        ep, etp, pp = self.expert_parallel, self.etp, self.pipeline_parallel
        if ep == 1 and self.expert_tensor_parallel is None:
            return
        if world_size % (etp * ep * pp):
            from_ = f" ({where})" if where else ""
            self.fail("expert_parallel" if ep > 1 else "expert_tensor_parallel",
                      f"expert_tensor_parallel ({etp}) x expert_parallel ({ep}) x pipeline_parallel ({pp}) = "
                      f"{etp * ep * pp} does not divide the world size {world_size}{from_}")

    @property
    def etp(self) -> int:
        """Tensor-parallel size inside each routed expert (expert_tensor_parallel, else TP)."""
        return self.expert_tensor_parallel or self.tensor_parallel

    @property
    def model_parallel(self) -> int:
        """Ranks that run one copy of the model on one batch share (TP x PP x CP)."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (1 without the interleaved schedule)."""
        return self.virtual_pipeline or 1


@dataclasses.dataclass(kw_only=True)
class OptimConfig(ConfigBase):
    """AdamW with Megatron's gradient clipping and learning-rate schedule. A stage that starts from
    a checkpoint (the previous stage's, a resume, ``trainer.init_from``) continues its step count and
    Adam moments under these settings, not the checkpoint's."""

    # Peak learning rate (after warm-up).
    lr: float = ranged(1e-6, ge=0.0)
    # Floor of the decayed learning rate.
    min_lr: float = ranged(0.0, ge=0.0)
    # Decoupled (AdamW) weight decay; norms and biases are not decayed.
    weight_decay: float = ranged(0.0, ge=0.0)
    # Adam beta1.
    adam_beta1: float = ranged(0.9, ge=0.0, le=1.0)
    # Adam beta2.
    adam_beta2: float = ranged(0.999, ge=0.0, le=1.0)
    # Adam epsilon.
    adam_eps: float = ranged(1e-8, gt=0.0)
    # Clip the global gradient norm to this value; 0 disables clipping.
    clip_grad: float = ranged(1.0, ge=0.0)
    # Optimizer steps of linear warm-up from 0 to lr.
    lr_warmup_steps: int = ranged(0, ge=0)
    # Shape of the decay after warm-up.
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    # Optimizer steps over which lr decays to min_lr (after which it stays there); None = constant
    # style only.
    lr_decay_steps: int | None = ranged(None, ge=1)

    def validate(self) -> None:
        super().validate()
        if self.min_lr > self.lr:
            self.fail("min_lr", f"must be <= lr ({self.lr}), got {self.min_lr}")
        if self.lr_decay_style != "constant":
            if self.lr_decay_steps is None:
                self.fail("lr_decay_steps", f"is required with lr_decay_style="
                          f"{self.lr_decay_style!r}")
            if self.lr_decay_steps <= self.lr_warmup_steps:
                self.fail("lr_decay_steps", f"must be > lr_warmup_steps ({self.lr_warmup_steps}), "
                          f"got {self.lr_decay_steps}")


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")


@dataclasses.dataclass(kw_only=True)
class RecomputeConfig(ConfigBase):
    """Activation recomputation (Megatron's): keep fewer activations, recompute them in backward.
    The gradients are the same as without it (the forward is deterministic)."""

    # none (keep every activation), selective (recompute the submodules in `modules`), full (keep
    # only the inputs of whole layers, see `method` / `num_layers`).
    granularity: Literal["none", "selective", "full"] = "none"
    # full only: uniform = every `num_layers` consecutive layers are one recomputed unit; block =
    # the first `num_layers` layers of each pipeline stage are recomputed, the rest keep theirs.
    method: Literal["uniform", "block"] = "uniform"
    # full only: layers per unit (uniform) or recomputed layers per pipeline stage (block).
    num_layers: int = ranged(1, ge=1)
    # selective only: core_attn (the attention scores; pointless with fused attention, which keeps
    # none), mlp (the dense MLP), layernorm (the norms; needs the Transformer Engine spec).
    modules: list[str] = dataclasses.field(default_factory=lambda: ["core_attn"])

    def validate(self) -> None:
        super().validate()
        bad = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        if bad:
            self.fail("modules", f"unknown module(s) {bad}; known: {list(RECOMPUTE_MODULES)}")
        if self.granularity == "selective" and not self.modules:
            self.fail("modules", "granularity selective needs at least one module")

    def megatron_kwargs(self) -> dict:
        """The ``TransformerConfig`` fields for this setting."""
        if self.granularity == "none":
            return {}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": list(self.modules)}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}


@dataclasses.dataclass(kw_only=True)
class ReferenceConfig(ConfigBase):
    """The reference policy of the KL term (``algo.kl``): frozen weights on the policy's layout,
    forward only, its log-probs computed with the old log-probs at the sampling temperature."""

    # Hugging Face checkpoint of the reference weights; empty: the weights the first GRPO stage
    # starts from (trainer.init_from, else the SFT cold start's result, else model.path).
    path: str = ""
    # GPUs: keep the reference's weights in host memory between uses (copied to the GPU for each
    # forward, back after it). Refused on CPU-only runs, where they are in host memory already.
    offload: bool = False


@dataclasses.dataclass(kw_only=True)
class MoEConfig(ConfigBase):
    """Mixture-of-Experts training signals (refused for dense models when set). Both losses are
    Megatron's router losses, added to the policy objective; their values are logged as
    ``moe/aux_loss`` and ``moe/z_loss`` (README, metrics)."""

    # Coefficient of the load-balancing (auxiliary) loss in the objective: coef x the sum over the
    # MoE layers of the mean over the step's micro-batches of Megatron's switch-transformer loss
    # E / (k T^2) sum_e f_e P_e (T tokens, f_e top-k assignments to expert e, P_e its router
    # probability mass; 1 when the load is even; padding excluded); null: the model's
    # router_aux_loss_coef (config.json); 0 turns it off.
    aux_loss_coef: float | None = ranged(None, ge=0.0)
    # Coefficient of the router z-loss in the objective, summed and averaged as aux_loss_coef's:
    # the mean over a micro-batch's tokens of logsumexp(router logits)^2 (keeps the logits small);
    # 0: off.
    z_loss_coef: float = ranged(0.0, ge=0.0)


@dataclasses.dataclass(kw_only=True)
class PolicyConfig(ConfigBase):
    """The Megatron-Core policy: layout, optimizer, micro-batching, precision, seed."""

    _section = "policy"

    # Parallel layout.
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    # Optimizer and learning-rate schedule.
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    # Token budget of one micro-batch per rank (divided by context_parallel): padded, sequences x
    # longest sequence; packed, the sequences' summed lengths. Sequences are grouped under it, a
    # longer one gets a micro-batch of its own.
    micro_batch_tokens: int = ranged(8192, ge=1)
    # Packed sequences: a micro-batch's sequences concatenated in one row without padding,
    # attention within each (THD: Transformer Engine's kernels on GPUs, ours on the CPU); false:
    # one right-padded row per sequence. Same log-probs, losses and gradients either way, dense or
    # Mixture-of-Experts (the routers' padding mask leaves each sequence's alignment padding and
    # the row's tail out of the aux / z-losses and routing statistics; routing replay places every
    # token's routes through the micro-batch's layout).
    packed_sequences: bool = True
    # Megatron layer spec: te (Transformer Engine: fused norm + linear, fused/flash attention,
    # context parallelism on GPUs; needs CUDA and transformer-engine), local (Megatron-Core's own
    # layers with our attention on torch's scaled_dot_product_attention), auto (te where it can
    # run, else local). Same parameters and the same export to the engines either way.
    layer_spec: Literal["auto", "te", "local"] = "auto"
    # Activation recomputation.
    recompute: RecomputeConfig = dataclasses.field(default_factory=RecomputeConfig)
    # Parameter dtype; bf16 keeps fp32 master weights in the optimizer.
    params_dtype: Literal["fp32", "bf16"] = "fp32"
    # Seed of Megatron's model-parallel RNG (dropout, initialisation of anything not loaded).
    seed: int = ranged(1234, ge=0)
    # The reference policy (used only when algo.kl.enabled).
    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)
    # Mixture-of-Experts models: load-balancing and z-loss coefficients.
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
