"""The Megatron-Core policy: log-probs and entropy of responses, one optimizer step, HF export.

Built from a Hugging Face checkpoint into any TP x PP (x VPP) x CP x DP layout (:meth:`from_hf`),
a Mixture-of-Experts model's experts also over EP x expert TP, on the Transformer Engine or the
local layer spec (``policy.layer_spec``). A MoE policy's objective also holds the load-balancing
and z-losses, and :meth:`train_step` returns the routing metrics (:mod:`~megatron_rl.models.moe_signals`).
:meth:`compute_logprobs` is :class:`~megatron_rl.models.forward.PolicyForward`'s; :meth:`train_step`
shards and packs the batch the same way and runs it through the same pipeline schedule with the
backward pass, then one optimizer step.

Loss contract of :meth:`train_step`: ``loss_fn`` returns a loss already normalised by GLOBAL
denominators, so the gradient is d/dθ of the SUM of ``loss_fn`` over all micro-batches and all DP
ranks. Megatron is configured not to average (``calculate_per_token_loss=True`` with no token
scaling in ``finalize_model_grads``: micro-batch losses are summed, DP gradients are summed).

Context parallelism: each CP rank computes the log-probs (and entropy) of the response tokens in
its chunks; they are summed over the CP group into the micro-batch's full ``[b, T]`` layout (an
all-reduce whose backward is the identity), so ``loss_fn`` sees exactly what it sees without CP and
every CP rank computes the same loss. Each rank's backward then reaches only its own tokens (and,
through the attention's K/V exchange, the others' keys), and Megatron sums the gradients over the
data- and context-parallel ranks: the sum is the gradient of the one loss. Metrics and token counts
are taken from CP rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.common.metrics import reduce_metrics
from megatron_rl.compat import megatron_cpu_scope
from megatron_rl.models import checkpoint
from megatron_rl.models.batch import MicroBatch, PerSequence, SequenceBatch, pad_token_fields
from megatron_rl.models.config import PolicyConfig
from megatron_rl.models.forward import PolicyForward, build_from_hf, params_dtype
from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.hf_export import ExportItem, export_hf_weights, export_owned, export_plan
from megatron_rl.models.moe_signals import MoESignals
from megatron_rl.models.optimizer import wrap_for_training
from megatron_rl.models.parallel import ParallelGroups
from megatron_rl.models.routing_replay import Routes

LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, float]]]


class MegatronPolicy(PolicyForward):
    """A Megatron-Core GPT policy on one layout; every method is collective over the world."""

    def __init__(self, arch: HFArch, cfg: PolicyConfig, groups: ParallelGroups,
                 model: list, optimizer, scheduler, layer_spec: str = "local"):
        super().__init__(arch, cfg, groups, model, layer_spec)  # model: DDP-wrapped chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.steps = 0
        # Mixture-of-Experts: the load-balancing / z-losses and the routing metrics of each step
        self.moe = (MoESignals([m.module for m in model], arch.moe, arch.num_layers, cfg.moe, groups)
                    if arch.moe is not None else None)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf(cls, hf_dir: str, cfg: PolicyConfig, groups: ParallelGroups) -> MegatronPolicy:
        """Build the model for ``groups``' layout from ``hf_dir`` and load its weights."""
        arch, chunks, spec = build_from_hf(hf_dir, cfg, groups)
        with megatron_cpu_scope():
            model, optimizer, scheduler = wrap_for_training(chunks, cfg, params_dtype(cfg))
        return cls(arch, cfg, groups, model, optimizer, scheduler, layer_spec=spec)

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn, temperature: float,
                   with_entropy: bool, per_sequence: PerSequence | None = None,
                   routes: Routes | None = None) -> dict[str, float]:
        """One optimizer step on this mini-batch; returns reduced metrics + grad_norm and lr.

        ``per_sequence`` (optional) also collects per-sequence values from this forward (before
        the update), gathered onto every rank. ``routes``: MoE routing replay (the experts every
        token goes through, in the forward and any recomputation)."""
        g = self.groups
        micro = self._micro_batches(batch)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe is not None:
            self.moe.begin_step(len(micro), micro[0].dummy)

        def loss_step(mb, chunk, hidden):
            logp, ent = self._token_stats(mb, hidden, chunk, temperature, with_entropy)
            # With CP a rank may hold none of a micro-batch's response tokens (and a stand-in may
            # have none): its backward must still run through the model (the collectives in it).
            keep = hidden.sum() * 0.0 if (g.cp > 1 or mb.dummy) else 0.0
            if mb.dummy:  # keeps the graph (and the collectives in backward) with a zero loss
                return logp.sum() * 0.0 + keep, torch.tensor(0, dtype=torch.int), {}
            b = len(mb.index)
            dense = logp.new_zeros(b, mb.width).index_put((mb.row, mb.col), logp)
            dense_ent = (ent.new_zeros(b, mb.width).index_put((mb.row, mb.col), ent)
                         if ent is not None else None)
            if g.cp > 1:  # each CP rank filled its own tokens: the sum is the whole layout
                dense, dense_ent = (None if t is None else _sum_over_cp(t, g.cp_group)
                                    for t in (dense, dense_ent))
            fields = {k: v.to(g.device) for k, v in pad_token_fields(batch, mb.index,
                                                                     mb.width).items()}
            view = MicroBatch(logp=dense, entropy=dense_ent, mask=mb.mask, fields=fields,
                              index=torch.tensor(mb.index, dtype=torch.long, device=g.device))
            loss, metrics = loss_fn(view)
            # one contribution per sequence: every TP rank and (after the sum) every CP rank
            # holds the same view, and gather() sums the ranks' contributions
            if per_sequence is not None and g.tp_rank == 0 and g.cp_rank == 0:
                per_sequence.add(view)
            metrics = {k: float(v) for k, v in metrics.items()}
            return loss + keep, torch.tensor(int(mb.mask.sum()), dtype=torch.int), metrics

        stored = self._run(micro, loss_step, forward_only=False, batch=batch, routes=routes)
        moe_metrics = self.moe.end_step() if self.moe is not None else {}
        self.scheduler.step(increment=1)  # this step's learning rate (warm-up starts above 0)
        lr = self.lr
        with megatron_cpu_scope():
            ok, grad_norm, _ = self.optimizer.step()
        self.steps += 1
        mine = stored if (g.is_last_stage and g.tp_rank == 0 and g.cp_rank == 0) else []
        gathered: list = [None] * g.world_size
        if g.world_size > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        metrics = reduce_metrics(d for part in gathered for d in part)
        metrics.update(moe_metrics)
        if per_sequence is not None:
            per_sequence.gather(_all_reduce_cpu(g) if g.world_size > 1 else None)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        metrics["lr"] = lr
        if not ok:
            metrics["skipped_step"] = 1.0
        return metrics

    def set_lr(self, lr: float) -> None:
        """Make ``lr`` the peak learning rate from now on (warm-up/decay shape and the step count
        stay; ``min_lr`` is the config's, capped at ``lr``); a load keeps it."""
        s = self.scheduler
        s.max_lr = float(lr)
        s.min_lr = min(self.cfg.optim.min_lr, float(lr))
        for group in self.optimizer.param_groups:
            group["max_lr"] = float(lr)
            group["min_lr"] = s.min_lr
        s.step(increment=0)

    @property
    def lr(self) -> float:
        """The learning rate the last (or, before any, the first) optimizer step used."""
        return float(self.optimizer.param_groups[0]["lr"])

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(HF name, full tensor)`` on global rank 0, ``(HF name, None)`` elsewhere (collective:
        every rank iterates to the end)."""
        return export_hf_weights(self.arch, [m.module for m in self.model], self.groups,
                                 scheme=self.layer_spec)

    def export_plan(self, to_rank: int | None = None) -> list[ExportItem]:
        """Every HF tensor the policy exports, in order, with the global rank that sends it (local:
        no communication). ``to_rank=None``: each pipeline stage's TP-rank-0 of replica 0 sends its
        own tensors; ``to_rank=r``: rank ``r`` sends them all (:func:`~megatron_rl.models.hf_export.export_plan`)."""
        dtype = next(self.model[0].module.parameters()).dtype
        return export_plan(self.arch, self.groups, dtype, scheme=self.layer_spec, to_rank=to_rank)

    def export_owned(self, plan: list[ExportItem], placeholders: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(HF name, full tensor)`` of exactly the items of ``plan`` this rank sends, in plan
        order (with ``placeholders``: ``(HF name, None)`` for the others), collective: every rank
        iterates to the end; the weight sync's stream."""
        return export_owned(self.arch, [m.module for m in self.model], self.groups, plan,
                            scheme=self.layer_spec, placeholders=placeholders)

    def export_hf_grads(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Like :meth:`export_hf_weights` for the gradients of the last :meth:`train_step`
        (DP-summed, before clipping when ``optim.clip_grad`` is 0; not with the distributed
        optimizer, whose buffers hold only this rank's reduced shard)."""
        if self.cfg.parallel.use_distributed_optimizer and self.groups.dp > 1:
            raise RuntimeError("export_hf_grads is not available with the distributed optimizer "
                               "at DP > 1")
        return export_hf_weights(self.arch, [m.module for m in self.model], self.groups,
                                 value=lambda p: p.main_grad, scheme=self.layer_spec)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's (TP/PP-local) Megatron parameters, prefixed by chunk index."""
        for i, chunk in enumerate(self.model):
            for name, p in chunk.module.named_parameters():
                yield f"{i}.{name}", p

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Save model, optimizer, LR schedule, step count and RNG states (collective; see
        :mod:`megatron_rl.models.checkpoint`). ``ckpt_dir`` must not exist or be empty."""
        checkpoint.save_checkpoint(self, ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str | Path, fresh_optimizer: bool = False) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint`, at this or another layout; with
        ``fresh_optimizer`` only its model weights, the optimizer and lr schedule starting as a newly
        built policy's (no Adam moments, schedule step 0)."""
        checkpoint.load_checkpoint(self, ckpt_dir, fresh_optimizer=fresh_optimizer)


def _all_reduce_cpu(g: ParallelGroups):
    """An in-place sum over the world for a CPU tensor (through the device NCCL needs)."""

    def reduce(t: torch.Tensor) -> None:
        on_device = t.to(g.device)
        dist.all_reduce(on_device)
        t.copy_(on_device.cpu())

    return reduce


def _sum_over_cp(t: torch.Tensor, cp_group) -> torch.Tensor:
    """All-reduce over the CP group, identity in backward (Megatron's region op on that group)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t, group=cp_group)
