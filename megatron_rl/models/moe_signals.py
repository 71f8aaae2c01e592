"""Mixture-of-Experts training signals: the load-balancing and z-losses in the objective, and the
per-step routing metrics.

The objective. Megatron's router attaches its auxiliary losses to the router's output in the
forward pass (``MoEAuxLossAutoScaler``), so they reach every pipeline stage's gradients without
passing through the loss function. Per MoE layer and micro-batch it computes the switch-transformer
load-balancing loss ``E / (k T^2) sum_e P_e f_e`` (T valid tokens, f_e the top-k assignments to
expert e, P_e the router probability mass of e; 1 when the load is even) and the z-loss (the mean
over valid tokens of ``logsumexp(router logits)^2``). The policy adds

    aux_loss_coef * mean over the step's micro-batches of sum over layers of the aux loss
  + z_loss_coef   * the same for the z-loss

to its objective: :class:`Router` attaches the micro-batch's losses unscaled (Megatron scales them
by the micro-batch's token count when ``calculate_per_token_loss`` is on, which the policy's summed
losses need for the main loss) and takes the z-loss's mean over the whole micro-batch's valid tokens
(Megatron's is a mean of the tensor- / context-parallel ranks' means), and :meth:`MoESignals.begin_step` sets the coefficients to
``coef / M`` for the step's M micro-batches (all data-parallel ranks), 0 on a rank that runs only a
stand-in micro-batch. Padding tokens are excluded (the forward passes Megatron a padding mask).

The metrics (:meth:`MoESignals.end_step`), from a forward hook on every router, counted once per
micro-batch whatever the recomputation (only forwards with autograd on, so neither the no-grad
first pass of recomputed layers nor ``compute_logprobs``): ``moe/aux_loss`` and ``moe/z_loss``,
the mean over micro-batches and layers of the two losses above, computed here in float64 from the
router's logits over each micro-batch's valid tokens (whether or not the coefficients are 0), and
per layer ``moe/load_max/layer_<i>`` / ``moe/load_min/layer_<i>``: the most and least loaded
expert's share of the layer's (token, expert) assignments over the step (1/E when even).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_rl.models.config import MoEConfig
from megatron_rl.models.moe_arch import MoEArch
from megatron_rl.models.parallel import ParallelGroups


@functools.lru_cache(maxsize=1)
def router_class() -> type:
    """:class:`Router` (built on first use: Megatron is imported lazily)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    class Router(TopKRouter):
        """Megatron's top-k router whose auxiliary losses are per micro-batch, not multiplied by the
        micro-batch's token count (the policy averages them over the step's micro-batches by the
        coefficient it sets: :class:`MoESignals`), and whose z-loss is the mean over ALL the
        micro-batch's valid tokens: Megatron's averages each tensor- / context-parallel rank's own
        tokens and then the ranks, which weighs a token by how much padding its rank holds."""

        def __init__(self, config, pg_collection=None):
            super().__init__(config=config, pg_collection=pg_collection)
            self.calculate_per_token_loss = False

        def apply_z_loss(self, logits, padding_mask=None):
            coef = self.config.moe_z_loss_coeff
            if coef is None or not self.training or not torch.is_grad_enabled():
                return logits
            squares = torch.logsumexp(logits, dim=-1).square()
            if padding_mask is not None:
                squares = squares.masked_fill(padding_mask.reshape(-1), 0.0)
                tokens = (~padding_mask).sum().to(torch.float64)
            else:
                tokens = torch.tensor(float(squares.numel()), dtype=torch.float64,
                                      device=squares.device)
            if self.tp_cp_group.size() > 1:  # (a plain all-reduce: the count has no gradient)
                dist.all_reduce(tokens, group=self.tp_cp_group)
            z_loss = coef * squares.sum() / tokens.clamp(min=1).to(squares.dtype)
            return MoEAuxLossAutoScaler.apply(logits, z_loss)

    return Router


def aux_loss_value(counts: torch.Tensor, prob_mass: torch.Tensor, tokens: torch.Tensor,
                   top_k: int) -> torch.Tensor:
    """The switch load-balancing loss ``E / (k T^2) sum_e P_e f_e`` of one layer and micro-batch
    (``counts`` f_e and ``prob_mass`` P_e ``[..., E]``, ``tokens`` T ``[...]``)."""
    experts = counts.shape[-1]
    t = tokens.clamp(min=1)
    return (prob_mass * counts).sum(-1) * experts / (top_k * t * t)


class MoESignals:
    """One policy's MoE losses and metrics; :meth:`begin_step` / :meth:`end_step` around each
    training step (collective over the world)."""

    def __init__(self, chunks: list, moe: MoEArch, num_layers: int, cfg: MoEConfig,
                 groups: ParallelGroups):
        self.moe = moe
        self.groups = groups
        self.num_layers = num_layers
        self.aux_coef = moe.aux_loss_coef if cfg.aux_loss_coef is None else cfg.aux_loss_coef
        self.z_coef = cfg.z_loss_coef
        self.layers: list[int] = []  # global (HF) index of each local MoE layer, in order
        self.configs = {}
        self.collecting = False
        self.partials: dict[int, list[torch.Tensor]] = {}
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                index = layer.layer_number - 1
                router = layer.mlp.router
                self.layers.append(index)
                self.configs[id(router.config)] = router.config
                router.register_forward_hook(functools.partial(self._record, index),
                                             with_kwargs=True)

    # ------------------------------------------------------------------ the step
    def begin_step(self, micro_batches: int, dummy: bool) -> None:
        """Before a training step with this rank's ``micro_batches`` (``dummy``: stand-ins only):
        set the loss coefficients to coef / M (M: the step's micro-batches over data parallel)."""
        g = self.groups
        count = torch.tensor([0.0 if dummy else float(micro_batches)], dtype=torch.float64,
                             device=g.device)
        if g.dp > 1:
            dist.all_reduce(count, group=g.dp_group)
        total = max(1.0, float(count.item()))
        scale = 0.0 if dummy else 1.0 / total
        for config in self.configs.values():
            config.moe_aux_loss_coeff = self.aux_coef * scale
            config.moe_z_loss_coeff = self.z_coef * scale if self.z_coef > 0 and not dummy else None
        self.partials = {index: [] for index in self.layers}
        self.collecting = not dummy

    def end_step(self) -> dict[str, float]:
        """After the step: restore the coefficients (off) and return the step's MoE metrics (on
        every rank)."""
        for config in self.configs.values():
            config.moe_aux_loss_coeff = 0.0
            config.moe_z_loss_coeff = None
        self.collecting = False
        return self._metrics()

    # ------------------------------------------------------------------ the hook
    def _record(self, index: int, router, args, kwargs, output) -> None:
        """Per router forward with autograd on: this rank's part of the micro-batch's statistics,
        ``[counts (E), probability mass (E), valid tokens, sum of z^2]`` over its valid tokens."""
        if not self.collecting or not torch.is_grad_enabled():
            return
        with torch.no_grad():
            self.partials[index].append(self._row(router, args, kwargs, output))

    def _row(self, router, args, kwargs, output) -> torch.Tensor:
        hidden = args[0]
        padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
        _, routing_map = output
        experts = self.moe.num_experts
        logits = hidden.reshape(-1, hidden.shape[-1]).double() @ router.weight.double().t()
        valid = (torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
                 if padding is None else ~padding.reshape(-1).bool())
        logits, routed = logits[valid], routing_map.reshape(-1, experts)[valid]
        return torch.cat([routed.double().sum(0), torch.softmax(logits, -1).sum(0),
                          logits.new_tensor([float(valid.sum())]),
                          torch.logsumexp(logits, -1).square().sum().reshape(1)])

    # ------------------------------------------------------------------ the metrics
    def _metrics(self) -> dict[str, float]:
        g = self.groups
        e, k = self.moe.num_experts, self.moe.top_k
        n = len(self.partials[self.layers[0]]) if self.layers else 0
        if n:  # [local layers, micro-batches, 2E + 2], summed over the ranks that split the tokens
            rows = torch.stack([torch.stack(self.partials[i]) for i in self.layers])
        else:
            rows = torch.zeros(len(self.layers), 0, 2 * e + 2, dtype=torch.float64, device=g.device)
        rows = rows.to(g.device)
        for size, group in ((g.tp, g.tp_group), (g.cp, g.cp_group)):
            if size > 1 and n:
                dist.all_reduce(rows, group=group)
        counts, mass, tokens, zsum = rows[..., :e], rows[..., e:2 * e], rows[..., 2 * e], rows[..., -1]
        aux = aux_loss_value(counts, mass, tokens, k).sum(1)  # [local layers]
        z = (zsum / tokens.clamp(min=1)).sum(1)
        # one contribution per micro-batch: tensor- and context-parallel rank 0 of each stage
        first = g.tp_rank == 0 and g.cp_rank == 0
        total = torch.zeros(self.num_layers, e + 3, dtype=torch.float64, device=g.device)
        if first:
            at = torch.tensor(self.layers, dtype=torch.long, device=g.device)
            total[at, :e] = counts.sum(1)
            total[at, e] = aux
            total[at, e + 1] = z
            if g.pp_rank == 0:  # the step's micro-batches, once per data-parallel replica
                total[0, e + 2] = float(n)
        if g.world_size > 1:
            dist.all_reduce(total)
        total = total.cpu()
        steps = max(1.0, float(total[0, e + 2]))
        out = {"moe/aux_loss": float(total[:, e].sum()) / (steps * self.num_layers),
               "moe/z_loss": float(total[:, e + 1].sum()) / (steps * self.num_layers)}
        for i in range(self.num_layers):
            share = total[i, :e] / total[i, :e].sum().clamp(min=1)
            out[f"moe/load_max/layer_{i}"] = float(share.max())
            out[f"moe/load_min/layer_{i}"] = float(share.min())
        return out


def padding_mask(mb, chunk, groups: ParallelGroups) -> torch.Tensor:
    """The padding mask (True at padding) Megatron's MoE layers get for micro-batch ``mb`` on this
    chunk: ``[b, S / CP]`` on the first stage (where Megatron splits it for sequence parallelism
    itself); on later stages already this tensor-parallel rank's sequence slice (megatron-core
    0.16.1 splits it only on the first stage)."""
    mask = mb.padding_mask
    if chunk.pre_process or not groups.sequence_parallel:
        return mask
    width = mask.shape[1] // groups.tp
    return mask[:, groups.tp_rank * width:(groups.tp_rank + 1) * width].contiguous()
