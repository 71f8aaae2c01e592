"""The Megatron-Core policy: log-probs and entropy of responses, one optimizer step, HF export.

Built from a Hugging Face checkpoint into any TP x PP (x VPP) x CP x DP layout (:meth:`from_hf`),
on the Transformer Engine or the local layer spec (``policy.layer_spec``). Both
:meth:`compute_logprobs` and :meth:`train_step` shard the batch over data-parallel ranks, bin-pack
micro-batches under a token budget and run them through Megatron's pipeline schedule
(``get_forward_backward_func``). On the last stage, log-probs and entropy of the response tokens
come from the final hidden states and the output-layer weight via
:func:`megatron_rl.ops.fused_logprob_entropy` (vocab-parallel under TP); the ``[s, b, V]`` logits
are never formed.

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
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.common.metrics import reduce_metrics
from megatron_rl.compat import megatron_cpu_scope
from megatron_rl.models import checkpoint, gpt
from megatron_rl.models.batch import MicroBatch, PerSequence, SequenceBatch, pad_token_fields
from megatron_rl.models.config import PolicyConfig
from megatron_rl.models.hf_config import HFArch, read_hf_config
from megatron_rl.models.hf_export import export_hf_metadata, export_hf_weights
from megatron_rl.models.hf_load import load_hf_weights
from megatron_rl.models.layers import resolve_layer_spec
from megatron_rl.models.micro_batches import MicroInputs, plan_micro_batches
from megatron_rl.models.optimizer import wrap_for_training
from megatron_rl.models.parallel import ParallelGroups, check_layout

LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, float]]]


class MegatronPolicy:
    """A Megatron-Core GPT policy on one layout; every method is collective over the world."""

    def __init__(self, arch: HFArch, cfg: PolicyConfig, groups: ParallelGroups,
                 model: list, optimizer, scheduler, layer_spec: str = "local"):
        self.arch = arch
        self.cfg = cfg
        self.layer_spec = layer_spec  # resolved: te or local (also the parameter-name scheme)
        self.groups = groups
        self.model = model  # DDP-wrapped chunks, one per virtual pipeline stage
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.steps = 0

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf(cls, hf_dir: str, cfg: PolicyConfig, groups: ParallelGroups) -> MegatronPolicy:
        """Build the model for ``groups``' layout from ``hf_dir`` and load its weights."""
        cfg.validate()
        groups.check_current()
        par = cfg.parallel
        got = (groups.tp, groups.pp, groups.vpp, groups.sequence_parallel, groups.cp)
        want = (par.tensor_parallel, par.pipeline_parallel, par.vpp, par.sequence_parallel,
                par.context_parallel)
        if got != want:
            raise ValueError(f"policy.parallel asks for (TP, PP, VPP, SP, CP) = {want} but the "
                             f"process groups were initialised for {got}: pass the same "
                             f"ParallelConfig to init_distributed")
        arch = read_hf_config(hf_dir)
        check_layout(par, groups.world_size, arch.shape)  # before building anything
        spec = _check_spec(cfg, groups)
        dtype = torch.bfloat16 if cfg.params_dtype == "bf16" else torch.float32
        with megatron_cpu_scope():  # construction allocates on "cuda" (no-op with CUDA)
            chunks = gpt.build_model_chunks(arch, groups, dtype, layer_spec=spec,
                                            recompute=cfg.recompute.megatron_kwargs(),
                                            cp_comm_type=par.cp_comm_type)
            load_hf_weights(arch, chunks, hf_dir, groups, scheme=spec)
            if groups.device.type == "cuda":  # built and loaded on the CPU (deterministic init)
                chunks = [chunk.cuda(groups.device) for chunk in chunks]
            model, optimizer, scheduler = wrap_for_training(chunks, cfg, dtype)
        return cls(arch, cfg, groups, model, optimizer, scheduler, layer_spec=spec)

    # ---------------------------------------------------------------- schedule plumbing
    def _token_stats(self, mb: MicroInputs, hidden: torch.Tensor, chunk, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-token log-probs and entropy, flat ``[N]``, from the last stage's hidden states."""
        from megatron_rl.ops import fused_logprob_entropy

        if self.groups.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        picked = hidden[mb.pos_s, mb.pos_b]  # [N, H]
        weight = gpt.output_weight(chunk.module)
        picked, weight = self._mask_vocab_padding(picked, weight)
        return fused_logprob_entropy(
            picked, weight, mb.labels, temperature=temperature,
            tp_group=self.groups.tp_group if self.groups.tp > 1 else None,
            compute_entropy=with_entropy)

    def _mask_vocab_padding(self, hidden: torch.Tensor, weight: torch.Tensor):
        """Keep the rows Megatron added to make the vocabulary divisible by TP out of the softmax.

        Appends a constant-1 feature to the hidden states and a bias column to the weight: 0 for
        real rows, -1e9 for padding rows, whose probability then underflows to exactly 0. Only used
        when Megatron's vocabulary is padded (see ``HFArch.padded_vocab``).
        """
        g = self.groups
        padded = self.arch.padded_vocab(g.tp)
        if padded == self.arch.vocab_size:
            return hidden, weight
        v_local = weight.shape[0]
        row = torch.arange(v_local, device=weight.device) + g.tp_rank * v_local
        bias = torch.where(row < self.arch.vocab_size, 0.0, -1e9).to(weight.dtype)
        ones = hidden.new_ones(hidden.shape[0], 1)
        return torch.cat([hidden, ones], dim=1), torch.cat([weight, bias[:, None]], dim=1)

    def _run(self, micro: list[MicroInputs], step_fn, forward_only: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        g = self.groups
        g.check_current()

        def forward_step(data_iterator, chunk):
            mb = next(data_iterator)
            hidden = chunk(mb.input_ids, mb.position_ids, None)
            return hidden, partial(step_fn, mb, chunk)

        iters = [iter(micro) for _ in self.model]
        fb = get_forward_backward_func()
        return fb(
            forward_step_func=forward_step,
            data_iterator=iters if len(iters) > 1 else iters[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(micro),
            seq_length=max(mb.seq_len for mb in micro),  # before the CP split (Megatron divides)
            micro_batch_size=max(mb.input_ids.shape[0] for mb in micro),
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    # ---------------------------------------------------------------- public API
    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, temperature: float, with_entropy: bool = True
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per sequence, the response tokens' log-probs (and entropy) at ``temperature``.

        No gradient. Collective; every rank returns the full result (CPU float32 tensors).
        """
        g = self.groups
        micro = plan_micro_batches(batch, self.groups, self.cfg.micro_batch_tokens)

        def collect(mb, chunk, hidden, non_loss_data=False):
            logp, ent = self._token_stats(mb, hidden, chunk, temperature, with_entropy)
            return mb, logp, ent

        out = self._run(micro, collect, forward_only=True)
        lens = batch.response_lens
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        total = offsets[-1]
        flat = torch.zeros(2, total, dtype=torch.float32, device=g.device)
        if g.is_last_stage and g.tp_rank == 0:
            starts = torch.tensor(offsets[:-1], dtype=torch.long, device=g.device)
            for mb, logp, ent in (o for o in out if not o[0].dummy):
                index = torch.tensor(mb.index, dtype=torch.long, device=g.device)
                where = starts[index[mb.pos_b]] + mb.col
                flat[0, where] = logp.float()
                if ent is not None:
                    flat[1, where] = ent.float()
        if g.world_size > 1:
            dist.all_reduce(flat)  # disjoint contributions: the sum is the gather
        flat = flat.cpu()
        logps = [flat[0, offsets[i]:offsets[i + 1]].clone() for i in range(len(lens))]
        ents = ([flat[1, offsets[i]:offsets[i + 1]].clone() for i in range(len(lens))]
                if with_entropy else None)
        return logps, ents

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn, temperature: float,
                   with_entropy: bool, per_sequence: PerSequence | None = None) -> dict[str, float]:
        """One optimizer step on this mini-batch; returns reduced metrics + grad_norm and lr.

        ``per_sequence`` (optional) also collects per-sequence values from this forward (before
        the update), gathered onto every rank."""
        g = self.groups
        micro = plan_micro_batches(batch, self.groups, self.cfg.micro_batch_tokens)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_step(mb, chunk, hidden):
            logp, ent = self._token_stats(mb, hidden, chunk, temperature, with_entropy)
            # With CP a rank may hold none of a micro-batch's response tokens (and a stand-in may
            # have none): its backward must still run through the model (the collectives in it).
            keep = hidden.sum() * 0.0 if (g.cp > 1 or mb.dummy) else 0.0
            if mb.dummy:  # keeps the graph (and the collectives in backward) with a zero loss
                return logp.sum() * 0.0 + keep, torch.tensor(0, dtype=torch.int), {}
            b = len(mb.index)
            dense = logp.new_zeros(b, mb.width).index_put((mb.pos_b, mb.col), logp)
            dense_ent = (ent.new_zeros(b, mb.width).index_put((mb.pos_b, mb.col), ent)
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

        stored = self._run(micro, loss_step, forward_only=False)
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
        if per_sequence is not None:
            per_sequence.gather(_all_reduce_cpu(g) if g.world_size > 1 else None)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        metrics["lr"] = lr
        if not ok:
            metrics["skipped_step"] = 1.0
        return metrics

    def set_lr(self, lr: float) -> None:
        """Make ``lr`` the peak learning rate from now on (warm-up/decay shape and the step count
        stay; ``min_lr`` is capped at ``lr``). Saved with the next checkpoint; a later
        :meth:`load_checkpoint` brings back the checkpoint's own value."""
        s = self.scheduler
        s.max_lr = float(lr)
        s.min_lr = min(s.min_lr, float(lr))
        for group in self.optimizer.param_groups:
            group["max_lr"] = float(lr)
            group["min_lr"] = min(group.get("min_lr", s.min_lr), float(lr))
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

    def export_hf_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(HF name, dtype, shape)`` of what :meth:`export_hf_weights` yields, in order (local)."""
        return export_hf_metadata(self.arch, [m.module for m in self.model], self.groups,
                                  scheme=self.layer_spec)

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

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint`, at this or another layout."""
        checkpoint.load_checkpoint(self, ckpt_dir)


def _all_reduce_cpu(g: ParallelGroups):
    """An in-place sum over the world for a CPU tensor (through the device NCCL needs)."""

    def reduce(t: torch.Tensor) -> None:
        on_device = t.to(g.device)
        dist.all_reduce(on_device)
        t.copy_(on_device.cpu())

    return reduce


def _check_spec(cfg: PolicyConfig, groups: ParallelGroups) -> str:
    """The layer spec ``cfg.layer_spec`` resolves to here, refusing what it cannot run."""
    spec = resolve_layer_spec(cfg.layer_spec, cfg.key("layer_spec"))
    if spec == "local" and groups.cp > 1 and groups.device.type != "cpu":
        cfg.parallel.fail("context_parallel", f"context_parallel={groups.cp} on GPUs needs the "
                          f"Transformer Engine spec (layer_spec te or auto with transformer-engine "
                          f"installed): the local spec's CP attention runs on the CPU")
    if "layernorm" in cfg.recompute.modules and cfg.recompute.granularity == "selective" \
            and spec != "te":
        cfg.recompute.fail("modules", "layernorm recomputation needs the Transformer Engine spec "
                           "(layer_spec te)")
    return spec


def _sum_over_cp(t: torch.Tensor, cp_group) -> torch.Tensor:
    """All-reduce over the CP group, identity in backward (Megatron's region op on that group)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t, group=cp_group)
