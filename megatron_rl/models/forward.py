"""Forward-only Megatron-Core GPT on one layout: response log-probs (and entropy), no gradient.

Built from a Hugging Face checkpoint into any TP x PP (x VPP) x CP x DP layout, on the Transformer
Engine or the local layer spec (``policy.layer_spec``). :class:`PolicyForward` holds this rank's
model chunks and runs them through Megatron's pipeline
schedule (``get_forward_backward_func``, forward only) on micro-batches grouped under a token
budget and sharded over data-parallel ranks, padded or packed (``policy.packed_sequences``,
:mod:`megatron_rl.models.packing`). On the last stage, log-probs and entropy of the
response tokens come from the final hidden states and the output-layer weight via
:func:`megatron_rl.ops.fused_logprob_entropy` (vocab-parallel under TP); the ``[s, b, V]`` logits are
never formed. The trainable :class:`~megatron_rl.models.policy.MegatronPolicy` (DDP-wrapped chunks)
and the frozen :class:`~megatron_rl.models.reference.ReferencePolicy` (bare chunks) build on it.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from megatron_rl.compat import megatron_cpu_scope
from megatron_rl.models import gpt
from megatron_rl.models.batch import SequenceBatch
from megatron_rl.models.config import PolicyConfig
from megatron_rl.models.hf_config import HFArch, read_hf_config
from megatron_rl.models.hf_load import load_hf_weights
from megatron_rl.models.layers import resolve_layer_spec
from megatron_rl.models.micro_batches import MicroInputs, plan_micro_batches
from megatron_rl.models.moe_signals import padding_mask as moe_padding_mask
from megatron_rl.models.packing import attention_weight
from megatron_rl.models.parallel import ParallelGroups, check_layout
from megatron_rl.models.routing_replay import Routes, RoutingReplay


def params_dtype(cfg: PolicyConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.params_dtype == "bf16" else torch.float32


def bare(chunk) -> torch.nn.Module:
    """The ``GPTModel`` of a chunk, DDP-wrapped (the policy) or not (the reference)."""
    return getattr(chunk, "module", chunk)


def build_from_hf(hf_dir: str, cfg: PolicyConfig, groups: ParallelGroups) -> tuple[HFArch, list, str]:
    """This rank's chunks for ``groups``' layout with ``hf_dir``'s weights (on the trainer's device),
    and the layer spec they were built with (te or local: also the parameter-name scheme).

    Checks first that ``cfg.parallel`` is the layout the groups were initialised for and that the
    architecture splits over it (naming the values), before building anything.
    """
    cfg.validate()
    groups.check_current()
    par = cfg.parallel
    got = (groups.tp, groups.pp, groups.vpp, groups.sequence_parallel, groups.cp, groups.ep,
           groups.etp)
    want = (par.tensor_parallel, par.pipeline_parallel, par.vpp, par.sequence_parallel,
            par.context_parallel, par.expert_parallel, par.etp)
    if got != want:
        raise ValueError(f"policy.parallel asks for (TP, PP, VPP, SP, CP, EP, ETP) = {want} but "
                         f"the process groups were initialised for {got}: pass the same "
                         f"ParallelConfig to init_distributed")
    arch = read_hf_config(hf_dir)
    check_layout(par, groups.world_size, arch.shape)  # before building anything
    if arch.moe is None:
        for key in ("aux_loss_coef", "z_loss_coef"):
            if getattr(cfg.moe, key) not in (None, 0.0):
                cfg.moe.fail(key, f"is set but {hf_dir} is a dense model (no experts)")
    spec = check_spec(cfg, groups)
    with megatron_cpu_scope():  # construction allocates on "cuda" (no-op with CUDA)
        chunks = build_chunks(arch, cfg, groups, spec)
        load_hf_weights(arch, chunks, hf_dir, groups, scheme=spec)
    if groups.device.type == "cuda":  # built and loaded on the CPU (deterministic init)
        chunks = [chunk.cuda(groups.device) for chunk in chunks]
    return arch, chunks, spec


def build_chunks(arch: HFArch, cfg: PolicyConfig, groups: ParallelGroups, spec: str) -> list:
    """Randomly initialised chunks of ``cfg``'s dtype, recomputation and CP exchange."""
    return gpt.build_model_chunks(arch, groups, params_dtype(cfg), layer_spec=spec,
                                  recompute=cfg.recompute.megatron_kwargs(),
                                  cp_comm_type=cfg.parallel.cp_comm_type)


def check_spec(cfg: PolicyConfig, groups: ParallelGroups) -> str:
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


class PolicyForward:
    """Log-probs of responses under this rank's chunks; every method is collective over the world."""

    def __init__(self, arch: HFArch, cfg: PolicyConfig, groups: ParallelGroups, model: list,
                 layer_spec: str = "local"):
        self.arch = arch
        self.cfg = cfg
        self.layer_spec = layer_spec  # resolved: te or local (also the parameter-name scheme)
        self.groups = groups
        self.model = model  # one chunk per virtual pipeline stage
        self._routing: RoutingReplay | None = None  # MoE: this policy's own routers (built on first use)

    # ---------------------------------------------------------------- schedule plumbing
    def _micro_batches(self, batch: SequenceBatch) -> list[MicroInputs]:
        """This rank's micro-batches of ``batch``: padded or packed, balanced by tokens and
        attention cost (:func:`~megatron_rl.models.micro_batches.plan_micro_batches`). Either
        layout serves a Mixture-of-Experts policy: its routers' padding mask
        (``MicroInputs.padding_mask``) and routing replay's router rows follow the micro-batch's
        ``TokenLayout``."""
        a = self.arch
        weight = attention_weight(a.hidden_size, a.ffn_hidden_size, a.num_heads, a.num_kv_heads,
                                  a.head_dim, a.vocab_size)
        return plan_micro_batches(batch, self.groups, self.cfg.micro_batch_tokens,
                                  packed=self.cfg.packed_sequences, attn_weight=weight)

    def _token_stats(self, mb: MicroInputs, hidden: torch.Tensor, chunk, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-token log-probs and entropy, flat ``[N]``, from the last stage's hidden states."""
        from megatron_rl.ops import fused_logprob_entropy

        if self.groups.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        picked = hidden[mb.pos_s, mb.pos_b]  # [N, H]
        weight = gpt.output_weight(bare(chunk))
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

    def _run(self, micro: list[MicroInputs], step_fn, forward_only: bool, batch: SequenceBatch | None = None,
             routes: Routes | None = None):
        """The schedule over ``micro`` (of ``batch``); ``routes``: what the MoE routers replay /
        record in this pass (:mod:`~megatron_rl.models.routing_replay`)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        g = self.groups
        g.check_current()
        replay = self.routing_replay(routes)

        def forward_step(data_iterator, chunk):
            mb = next(data_iterator)
            kwargs = {}
            if self.arch.is_moe:  # padding stays out of the routers' losses and statistics
                kwargs["padding_mask"] = moe_padding_mask(mb, bare(chunk), g)
            if replay is not None:
                replay.before_forward(bare(chunk), mb)
            hidden = chunk(mb.input_ids, mb.position_ids, None,
                           packed_seq_params=mb.packed_seq_params, **kwargs)
            if replay is not None:
                replay.after_forward(bare(chunk), mb)
            return hidden, partial(step_fn, mb, chunk)

        iters = [iter(micro) for _ in self.model]
        fb = get_forward_backward_func()
        try:
            out = fb(
                forward_step_func=forward_step,
                data_iterator=iters if len(iters) > 1 else iters[0],
                model=self.model if len(self.model) > 1 else self.model[0],
                num_microbatches=len(micro),
                seq_length=max(mb.seq_len for mb in micro),  # before the CP split (Megatron divides)
                micro_batch_size=max(mb.input_ids.shape[0] for mb in micro),
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
            if replay is not None:
                replay.gather(batch)
        finally:
            if replay is not None:
                replay.finish()
        return out

    def routing_replay(self, routes: Routes | None) -> RoutingReplay | None:
        """This policy's router replay, begun for ``routes`` (None when they ask nothing)."""
        if routes is None or (routes.replay is None and not routes.record):
            return None
        if self._routing is None:
            moe = getattr(self.arch, "moe", None)
            if moe is None:
                raise ValueError("MoE routes were given for a dense model (no routers to replay)")
            self._routing = RoutingReplay([bare(c) for c in self.model], list(range(self.arch.num_layers)),
                                          moe.num_experts, moe.top_k, self.groups,
                                          recompute=bool(self.cfg.recompute.megatron_kwargs()))
        self._routing.begin(routes)
        return self._routing

    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, temperature: float, with_entropy: bool = True,
                         routes: Routes | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per sequence, the response tokens' log-probs (and entropy) at ``temperature``; MoE:
        through the experts ``routes`` replays (and records), else the routers' own.

        No gradient. Collective; every rank returns the full result (CPU float32 tensors).
        """
        g = self.groups
        micro = self._micro_batches(batch)

        def collect(mb, chunk, hidden, non_loss_data=False):
            logp, ent = self._token_stats(mb, hidden, chunk, temperature, with_entropy)
            return mb, logp, ent

        out = self._run(micro, collect, forward_only=True, batch=batch, routes=routes)
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
                where = starts[index[mb.row]] + mb.col
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
