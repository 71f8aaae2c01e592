"""The Megatron-Core policy: log-probs and entropy of responses, one optimizer step, HF export.

Built from a Hugging Face checkpoint into any TP x PP (x VPP) x DP layout (:meth:`from_hf`). Both
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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.compat import megatron_cpu_scope
from megatron_rl.compat.megatron_fixes import init_empty_adam_state
from megatron_rl.models import hf_bridge
from megatron_rl.models.batch import (MicroBatch, SequenceBatch, pack_micro_batches,
                                      pad_token_fields, shard_for_dp)
from megatron_rl.models.config import PolicyConfig
from megatron_rl.models.parallel import ParallelGroups, check_layout

LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, float]]]


@dataclasses.dataclass
class _Micro:
    """One micro-batch's model inputs and where its response tokens sit."""

    index: list[int]  # positions in the SequenceBatch
    input_ids: torch.Tensor  # [b, S]
    position_ids: torch.Tensor  # [b, S]
    pos_s: torch.Tensor  # [N] sequence position whose output predicts a response token
    pos_b: torch.Tensor  # [N] row of that token
    col: torch.Tensor  # [N] column of that token in the [b, T] response layout
    labels: torch.Tensor  # [N] the response token ids
    mask: torch.Tensor  # [b, T]
    width: int  # T
    # A stand-in so that a rank with no response tokens still runs the schedule (and joins the
    # gradient all-reduce): its outputs are ignored and its loss is 0.
    dummy: bool = False


def _make_micro(batch: SequenceBatch, index: list[int], seq_len: int, rows: int, device) -> _Micro:
    """Inputs ``[rows, seq_len]`` (right-padded; rows beyond ``index`` are padding) and the
    positions of the response tokens."""
    seqs = [batch.sequences[i] for i in index]
    prompts = [batch.prompt_lens[i] for i in index]
    ids = torch.zeros(rows, seq_len, dtype=torch.long)
    pos_s, pos_b, col, labels = [], [], [], []
    width = max(1, max(len(s) - p for s, p in zip(seqs, prompts)))
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for r, (s, p) in enumerate(zip(seqs, prompts)):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        n = len(s) - p
        pos_s.append(torch.arange(p - 1, len(s) - 1))
        pos_b.append(torch.full((n,), r, dtype=torch.long))
        col.append(torch.arange(n))
        labels.append(torch.tensor(s[p:], dtype=torch.long))
        mask[r, :n] = True
    cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
    return _Micro(index=index, input_ids=ids.to(device),
                  position_ids=torch.arange(seq_len).expand(rows, seq_len).to(device),
                  pos_s=cat(pos_s), pos_b=cat(pos_b), col=cat(col), labels=cat(labels),
                  mask=mask.to(device), width=width)


def _reduce_metrics(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Keys ending in ``_min`` / ``_max`` reduce with min / max, all others are summed."""
    out: dict[str, float] = {}
    for d in dicts:
        for key, value in d.items():
            value = float(value)
            if key not in out:
                out[key] = value
            elif key.endswith("_min"):
                out[key] = min(out[key], value)
            elif key.endswith("_max"):
                out[key] = max(out[key], value)
            else:
                out[key] += value
    return out


def _wrap_for_training(chunks: list, cfg: PolicyConfig, dtype: torch.dtype):
    """Megatron DDP around each chunk, the (distributed) Adam optimizer and the LR schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    par, oc = cfg.parallel, cfg.optim
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=par.use_distributed_optimizer, check_for_nan_in_grad=False)
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=oc.lr, min_lr=oc.min_lr, weight_decay=oc.weight_decay,
        adam_beta1=oc.adam_beta1, adam_beta2=oc.adam_beta2, adam_eps=oc.adam_eps,
        clip_grad=oc.clip_grad, bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
        use_distributed_optimizer=par.use_distributed_optimizer), model)
    decay_steps = oc.lr_decay_steps or oc.lr_warmup_steps + 1
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=oc.lr, min_lr=oc.min_lr,
        lr_warmup_steps=oc.lr_warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=oc.lr_decay_style, start_wd=oc.weight_decay, end_wd=oc.weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant")
    # Sum, never average: calculate_per_token_loss=True keeps Megatron from dividing the loss by
    # the micro-batch count and DDP from scaling by 1/DP; finalize without token scaling.
    config.finalize_model_grads_func = (
        lambda m, num_tokens, **kw: finalize_model_grads(m, None, **kw))
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler


class MegatronPolicy:
    """A Megatron-Core GPT policy on one layout; every method is collective over the world."""

    def __init__(self, arch: hf_bridge.HFArch, cfg: PolicyConfig, groups: ParallelGroups,
                 model: list, optimizer, scheduler):
        self.arch = arch
        self.cfg = cfg
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
        got = (groups.tp, groups.pp, groups.vpp, groups.sequence_parallel)
        want = (par.tensor_parallel, par.pipeline_parallel, par.vpp, par.sequence_parallel)
        if got != want:
            raise ValueError(f"policy.parallel asks for (TP, PP, VPP, SP) = {want} but the process "
                             f"groups were initialised for {got}: pass the same ParallelConfig to "
                             f"init_distributed")
        arch = hf_bridge.read_hf_config(hf_dir)
        check_layout(par, groups.world_size, arch.shape)  # before building anything
        dtype = torch.bfloat16 if cfg.params_dtype == "bf16" else torch.float32
        with megatron_cpu_scope():  # construction allocates on "cuda" (no-op with CUDA)
            chunks = hf_bridge.build_model_chunks(arch, groups, dtype)
            hf_bridge.load_hf_weights(arch, chunks, hf_dir, groups)
            if groups.device.type == "cuda":  # built and loaded on the CPU (deterministic init)
                chunks = [chunk.cuda(groups.device) for chunk in chunks]
            model, optimizer, scheduler = _wrap_for_training(chunks, cfg, dtype)
        return cls(arch, cfg, groups, model, optimizer, scheduler)

    # ---------------------------------------------------------------- schedule plumbing
    def _micro_batches(self, batch: SequenceBatch) -> list[_Micro]:
        g = self.groups
        lengths = [len(s) for s in batch.sequences]
        # Sequences without response tokens contribute nothing: never sent through the model.
        useful = [i for i, n in enumerate(batch.response_lens) if n > 0]
        shard = shard_for_dp([lengths[i] for i in useful], g.dp)[g.dp_rank]
        mine = [useful[k] for k in shard]
        dummy = not mine
        if dummy:
            mine = [min(range(len(lengths)), key=lambda i: lengths[i])]
        groups = pack_micro_batches(lengths, mine, self.cfg.micro_batch_tokens,
                                    multiple_of=g.pp if g.vpp > 1 else 1)
        pad_to = g.tp if g.sequence_parallel else 1  # sequence parallel splits the sequence
        shapes = [(-(-max(lengths[i] for i in idx) // pad_to) * pad_to, len(idx)) for idx in groups]
        if g.vpp > 1:
            # The interleaved schedule hangs with variable shapes (seen with megatron-core 0.16.1
            # on gloo): one padded shape for every micro-batch of the step.
            common = (max(s for s, _ in shapes), max(r for _, r in shapes))
            shapes = [common] * len(groups)
        micro = [_make_micro(batch, idx, seq, rows, g.device)
                 for idx, (seq, rows) in zip(groups, shapes)]
        for mb in micro:
            mb.dummy = dummy
        return micro

    def _token_stats(self, mb: _Micro, hidden: torch.Tensor, chunk, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-token log-probs and entropy, flat ``[N]``, from the last stage's hidden states."""
        from megatron_rl.ops import fused_logprob_entropy

        if self.groups.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        picked = hidden[mb.pos_s, mb.pos_b]  # [N, H]
        weight = hf_bridge.output_weight(chunk.module)
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

    def _run(self, micro: list[_Micro], step_fn, forward_only: bool):
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
            seq_length=max(mb.input_ids.shape[1] for mb in micro),
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
        micro = self._micro_batches(batch)

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
                   with_entropy: bool) -> dict[str, float]:
        """One optimizer step on this mini-batch; returns reduced metrics + grad_norm and lr."""
        g = self.groups
        micro = self._micro_batches(batch)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_step(mb, chunk, hidden):
            logp, ent = self._token_stats(mb, hidden, chunk, temperature, with_entropy)
            if mb.dummy:  # keeps the graph (and the collectives in backward) with a zero loss
                return logp.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
            b = len(mb.index)
            dense = logp.new_zeros(b, mb.width).index_put((mb.pos_b, mb.col), logp)
            dense_ent = (ent.new_zeros(b, mb.width).index_put((mb.pos_b, mb.col), ent)
                         if ent is not None else None)
            fields = {k: v.to(g.device) for k, v in pad_token_fields(batch, mb.index,
                                                                     mb.width).items()}
            view = MicroBatch(logp=dense, entropy=dense_ent, mask=mb.mask, fields=fields,
                              index=torch.tensor(mb.index, dtype=torch.long, device=g.device))
            loss, metrics = loss_fn(view)
            metrics = {k: float(v) for k, v in metrics.items()}
            return loss, torch.tensor(int(mb.mask.sum()), dtype=torch.int), metrics

        stored = self._run(micro, loss_step, forward_only=False)
        self.scheduler.step(increment=1)  # this step's learning rate (warm-up starts above 0)
        lr = self.lr
        with megatron_cpu_scope():
            ok, grad_norm, _ = self.optimizer.step()
        self.steps += 1
        mine = stored if (g.is_last_stage and g.tp_rank == 0) else []
        gathered: list = [None] * g.world_size
        if g.world_size > 1:
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        metrics = _reduce_metrics([d for part in gathered for d in part])
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
        return hf_bridge.export_hf_weights(self.arch, [m.module for m in self.model], self.groups)

    def export_hf_grads(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Like :meth:`export_hf_weights` for the gradients of the last :meth:`train_step`
        (DP-summed, before clipping when ``optim.clip_grad`` is 0; not with the distributed
        optimizer, whose buffers hold only this rank's reduced shard)."""
        if self.cfg.parallel.use_distributed_optimizer and self.groups.dp > 1:
            raise RuntimeError("export_hf_grads is not available with the distributed optimizer "
                               "at DP > 1")
        return hf_bridge.export_hf_weights(self.arch, [m.module for m in self.model], self.groups,
                                           value=lambda p: p.main_grad)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's (TP/PP-local) Megatron parameters, prefixed by chunk index."""
        for i, chunk in enumerate(self.model):
            for name, p in chunk.module.named_parameters():
                yield f"{i}.{name}", p

    # ---------------------------------------------------------------- checkpoints
    def _sharded_state_dict(self, is_loading: bool) -> dict:
        sd = {f"model_chunk{i}": chunk.module.sharded_state_dict()
              for i, chunk in enumerate(self.model)}
        sd["optimizer"] = self.optimizer.sharded_state_dict(
            sd, is_loading=is_loading, metadata=_OPTIM_CKPT_METADATA)
        sd["scheduler"] = self.scheduler.state_dict()
        sd["steps"] = self.steps
        sd["distributed_optimizer"] = self.cfg.parallel.use_distributed_optimizer
        return sd

    def save_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Save model, optimizer, LR schedule and step count with Megatron's distributed
        checkpointing (loadable at another TP x PP x DP layout with the same
        ``use_distributed_optimizer``: the two optimizers store their state differently), plus
        this rank's RNG states. Known gap: with the distributed optimizer, weights, step and
        schedule restore exactly but the Adam moments of the norm weights do not (the next step
        differs by ~0.35 lr in those weights, also at the same layout); the plain optimizer's
        checkpoints are exact across layouts.

        Collective. ``ckpt_dir`` must not exist or be empty.
        """
        from megatron.core import dist_checkpointing

        g = self.groups
        g.check_current()
        path = Path(ckpt_dir)
        if g.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            if any(path.iterdir()):
                raise FileExistsError(f"checkpoint directory {path} is not empty")
        _barrier(g)
        with megatron_cpu_scope():
            dist_checkpointing.save(self._sharded_state_dict(is_loading=False), str(path))
        rng_dir = path / _RNG_DIR
        if g.rank == 0:
            rng_dir.mkdir(exist_ok=True)
        _barrier(g)
        torch.save({"layout": self._layout(), "cpu": torch.get_rng_state(),
                    "tracker": _rng_tracker_states()}, rng_dir / f"rank{g.rank}.pt")
        _barrier(g)

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint`, at this or another layout.

        RNG states are restored when the layout is the same (they are per rank); otherwise the
        current ones stay (the policy has no dropout, so the numbers do not depend on them).
        """
        from megatron.core import dist_checkpointing

        g = self.groups
        g.check_current()
        path = Path(ckpt_dir)
        if not (path / "metadata.json").is_file():
            raise FileNotFoundError(f"{path} is not a Megatron distributed checkpoint "
                                    f"(no metadata.json)")
        saved = bool(dist_checkpointing.load_common_state_dict(str(path))
                     .get("distributed_optimizer", False))
        if saved != self.cfg.parallel.use_distributed_optimizer:
            raise ValueError(f"{path} was written with use_distributed_optimizer={saved}, this "
                             f"policy has {self.cfg.parallel.use_distributed_optimizer}: Megatron "
                             f"stores the two optimizers' states differently")
        init_empty_adam_state(self.optimizer)
        with megatron_cpu_scope():
            loaded = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), str(path))
            for i, chunk in enumerate(self.model):
                chunk.module.load_state_dict(loaded[f"model_chunk{i}"])
            self.optimizer.load_state_dict(loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["scheduler"])
        self.steps = int(loaded["steps"])
        rng_file = path / _RNG_DIR / f"rank{g.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            if rng["layout"] == self._layout():
                torch.set_rng_state(rng["cpu"])
                _set_rng_tracker_states(rng["tracker"])

    def _layout(self) -> tuple[int, ...]:
        g = self.groups
        return (g.world_size, g.tp, g.pp, g.vpp)


_OPTIM_CKPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_RNG_DIR = "rng"


def _barrier(groups: ParallelGroups) -> None:
    if groups.world_size > 1:
        dist.barrier()


def _rng_tracker_states() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def _set_rng_tracker_states(states: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(states)
