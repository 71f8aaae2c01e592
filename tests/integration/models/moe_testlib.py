"""The float64 transformers reference of a Mixture-of-Experts policy step: log-probs, entropies,
the policy loss and, as Megatron's router adds them to the objective, the load-balancing and
z-losses of each micro-batch, their gradients and the routing statistics."""

from __future__ import annotations

import torch

from policy_testlib import ENT_COEF, load_hf_float64


def moe_reference(hf_dir, batch, temperature: float, micro: list[list[int]], aux_coef: float,
                  z_coef: float) -> dict:
    """Per sequence log-probs / entropies, and for the objective

        policy loss (policy_testlib.make_loss_fn) + aux_coef * mean_m sum_l aux(m, l)
                                                  + z_coef * mean_m sum_l z(m, l)

    over the micro-batches ``micro`` (lists of sequence indices: the tokens each router saw
    together): aux(m, l) = E / (k T^2) sum_e P_e f_e over the T tokens of micro-batch m at layer l
    (P_e: softmax mass of expert e, f_e: top-k assignments to e), z(m, l) = mean lse(logits)^2.
    Returns the gradients of that objective per HF name, the terms' values and the per-layer
    assignment counts of the whole step."""
    model = load_hf_float64(hf_dir)
    cfg = model.config
    experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
    denom = float(sum(batch.response_lens))
    model.zero_grad()
    logps, ents, router = [], [], []
    policy_loss = 0.0
    for i, (seq, p) in enumerate(zip(batch.sequences, batch.prompt_lens)):
        out = model(torch.tensor([seq]), output_router_logits=True)
        logsm = torch.log_softmax(out.logits[0] / temperature, dim=-1)[p - 1: len(seq) - 1]
        lp = logsm.gather(1, torch.tensor(seq[p:])[:, None])[:, 0]
        ent = -(logsm.exp() * logsm).sum(-1)
        loss = (-(batch.seq_fields["w"][i].double() * batch.token_fields["adv"][i].double() * lp)
                .sum() - ENT_COEF * ent.sum()) / denom
        policy_loss = policy_loss + loss
        logps.append(lp.detach())
        ents.append(ent.detach())
        router.append([r.reshape(len(seq), experts) for r in out.router_logits])
    layers = len(router[0])
    aux_total = z_total = 0.0
    counts = torch.zeros(layers, experts, dtype=torch.float64)
    for idx in micro:
        for layer in range(layers):
            logits = torch.cat([router[i][layer] for i in idx])
            scores = torch.softmax(logits, -1)
            routed = torch.zeros_like(scores).scatter(1, scores.topk(top_k, -1).indices, 1.0)
            tokens = logits.shape[0]
            aux_total = aux_total + (scores.sum(0) * routed.sum(0)).sum() * experts / (
                top_k * tokens * tokens)
            z_total = z_total + torch.logsumexp(logits, -1).square().mean()
            counts[layer] += routed.sum(0).detach()
    m = len(micro)
    objective = policy_loss + aux_coef * aux_total / m + z_coef * z_total / m
    objective.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logps": logps, "ents": ents, "policy_loss": float(policy_loss),
            "aux": float(aux_total) / (m * layers), "z": float(z_total) / (m * layers),
            "counts": counts, "grads": _hf_names(grads, cfg)}


def _hf_names(grads: dict, cfg) -> dict:
    """transformers 5 keeps each layer's experts as fused 3-D parameters
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``); the checkpoint and the
    export name them per expert (``experts.{e}.{gate,up,down}_proj.weight``)."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                gate, up = g[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


@torch.no_grad()
def hf_hidden_states(hf_dir, ids: list[list[int]]) -> torch.Tensor:
    """transformers' float64 final-norm hidden states ``[b, s, h]`` of ``ids`` (no attention mask:
    the causal model sees the rows exactly as Megatron does)."""
    model = load_hf_float64(hf_dir)
    return model.model(torch.tensor(ids)).last_hidden_state
