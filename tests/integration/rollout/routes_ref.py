"""Transformers references for the routing-replay engine tests: the router's top-k of every layer."""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from megatron_rl.demo import TinySpec

# A tiny Qwen3-MoE: 2 MoE layers of 8 experts, top-2 (head_dim 32: vLLM-CPU's smallest kernel).
SPEC = TinySpec(arch="qwen3_moe", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512,
                seed=11)
# Positions whose k-th and (k+1)-th router logits (float64) are closer than this are near ties, where
# the engine's float32 may legitimately pick the other expert: compared only when none is that close.
TIE = 1e-4


def hf_topk(hf, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The transformers router's top-k expert sets ``[T, L, k]`` (sorted) of every position of
    ``ids``, and whether each (position, layer) is clear of a near tie ``[T, L]``."""
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        out = hf(torch.tensor([list(ids)]), output_router_logits=True)
    sets, clear = [], []
    for logits in out.router_logits:
        logits = logits.reshape(len(ids), -1).double()
        top = torch.sort(logits, -1, descending=True)
        sets.append(np.sort(top.indices[:, :k].numpy(), -1))
        clear.append((top.values[:, k - 1] - top.values[:, k]).numpy() > TIE)
    return np.stack(sets, 1), np.stack(clear, 1)


def assert_routes_match(rows: np.ndarray, hf, ids: list[int], where: str = "") -> int:
    """``rows`` (an engine's ``[len(ids), L, k]``) are the transformers router's top-k sets at every
    (position, layer) that is not a near tie; returns how many were compared."""
    want, clear = hf_topk(hf, ids)
    return assert_rows_match(rows, want, clear, where)


def assert_rows_match(rows: np.ndarray, want: np.ndarray, clear: np.ndarray, where: str = "") -> int:
    """``rows`` equal the reference sets ``want`` wherever ``clear``; returns how many compared."""
    assert rows.shape == want.shape, (where, rows.shape, want.shape)
    diff = (np.sort(rows.astype(np.int64), -1) != want).any(-1) & clear
    assert not diff.any(), (f"{where}: {int(diff.sum())} of {int(clear.sum())} (position, layer) routes differ "
                            f"from transformers' top-k, first at {np.argwhere(diff)[:3].tolist()}")
    return int(clear.sum())


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint (HF) names, as the engines load them."""
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def perturb_routers(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """``weights`` with every router (``mlp.gate.weight``) moved by ``scale`` x N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) if k.endswith("mlp.gate.weight") else v
            for k, v in weights.items()}


def load_routers(hf, weights: dict[str, torch.Tensor]) -> None:
    """Give the transformers model the routers of ``weights`` (the only tensors the tests change)."""
    state = hf.state_dict()
    state.update({k: v.to(state[k].dtype) for k, v in weights.items() if k.endswith("mlp.gate.weight")})
    hf.load_state_dict(state)


def forced_logprobs(hf, ids: list[int], prompt_len: int, routes, temperature: float = 1.0) -> torch.Tensor:
    """float64 log-probs of ``ids[prompt_len:]`` under ``hf`` with every MoE layer's experts forced
    to ``routes`` (``[len(ids), L, k]``): each router's top-k replaced by the given experts, their
    weights the softmax of the router's logits over those experts (renormalised when the model's
    ``norm_topk_prob``: Megatron's replay gathers the same scores)."""
    import torch.nn.functional as F

    routes = torch.as_tensor(np.asarray(routes), dtype=torch.long)
    gates = [layer.mlp.gate for layer in hf.model.layers]
    saved = [g.forward for g in gates]

    def forced(gate, column):
        def forward(hidden):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden, gate.weight)
            probs = torch.softmax(logits.double(), dim=-1)
            index = routes[:, column]
            top = probs.gather(1, index)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), index
        return forward

    try:
        for column, gate in enumerate(gates):
            gate.forward = forced(gate, column)
        with torch.no_grad():
            logits = hf(torch.tensor([list(ids)])).logits[0].double() / temperature
    finally:
        for gate, fwd in zip(gates, saved):
            gate.forward = fwd
    logp = torch.log_softmax(logits[prompt_len - 1:-1], -1)
    return logp.gather(1, torch.tensor(ids[prompt_len:])[:, None])[:, 0]


def loud(model_dir: str, seed: int = 0, std: float = 0.2) -> None:
    """Matrices of std ``std`` (a random init's 0.02 makes every router nearly uniform and every
    next-token distribution nearly flat: which experts a token goes through would barely matter)."""
    from safetensors.torch import load_file, save_file

    path = f"{model_dir}/model.safetensors"
    g = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.randn(t.shape, generator=g) * std if t.dim() >= 2 else t) for n, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})


def router_row_tokens(mb, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sequence of the micro-batch (``mb.index`` order) and which of its positions each router
    row of this rank holds, read off the model input Megatron gets (not from the replay's layout
    code): ``mb.position_ids`` (this CP rank's positions, counting from 0 in every packed segment),
    one sequence per row when padded; packed (one row), a new segment wherever the positions drop
    (a CP rank holds two increasing chunks of each segment). Then this TP rank's contiguous slice
    under sequence parallelism, flattened sequence-major (row ``j * b + row``)."""
    pos = mb.position_ids.cpu().long()
    if mb.packed_seq_params is not None:
        drops = torch.cat([torch.zeros(1, dtype=torch.long), (pos[0, 1:] < pos[0, :-1]).long()])
        seq = torch.cumsum(drops, 0)[None]
    else:
        seq = torch.arange(pos.shape[0])[:, None].expand_as(pos)
    if groups.sequence_parallel and groups.tp > 1:
        w = pos.shape[1] // groups.tp
        pos, seq = (x[:, groups.tp_rank * w:(groups.tp_rank + 1) * w] for x in (pos, seq))
    return seq.t().reshape(-1), pos.t().reshape(-1)


class RouterTap:
    """The experts a policy's MoE layers actually routed each token to in replaying passes, from
    their routers' outputs (``routing_map``), placed back at (sequence, position) by
    :func:`router_row_tokens`: one entry per router call (a micro-batch's forward, and
    its recomputation), ``{id(sequence): [len, L, k]}`` (-1 where that call routed nothing; the
    sequences are the lists of ``batch.sequences``, which mini-batches share)."""

    def __init__(self, policy, batch):
        from megatron_rl.models.forward import bare

        self.policy, self.batch = policy, batch
        self.layers, self.top_k = policy.arch.num_layers, policy.arch.moe.top_k
        # Full recomputation: a layer's first forward runs without autograd, its recomputation in
        # backward (1F1B: in the forwards' order, after later micro-batches' forwards) with it.
        self.recompute = policy.cfg.recompute.granularity == "full"
        self._pending: dict[int, deque] = {}  # per router: micro-batches whose recomputation is due
        self.calls: list[dict[int, np.ndarray]] = []
        self._mb: dict = {}
        self._pass_batch = None
        self._hooks = []
        self._where: dict = {}
        for chunk in policy.model:
            model = bare(chunk)
            for layer in model.decoder.layers:
                self._where[id(layer.mlp.router)] = (id(model), layer.layer_number - 1)
                self._hooks.append(layer.mlp.router.register_forward_hook(self._hook))

    def _hook(self, router, args, output):
        chunk, column = self._where[id(router)]
        pending = self._pending.setdefault(id(router), deque())
        if self.recompute and torch.is_grad_enabled() and pending:
            mb = pending.popleft()  # the recomputation of the oldest forward
        else:
            mb = self._mb.get(chunk)
            if mb is None:
                return
            if self.recompute and not torch.is_grad_enabled():
                pending.append(mb)
        routing_map = output[1]
        picked = torch.nonzero(routing_map.reshape(routing_map.shape[0], -1))[:, 1].view(-1, self.top_k)
        seq, pos = router_row_tokens(mb, self.policy.groups)
        picked = picked.cpu().numpy()
        call = {}
        for j, i in enumerate(mb.index):
            tokens = self._pass_batch.sequences[i]
            rows = np.full((len(tokens), self.layers, self.top_k), -1)
            mine = ((seq == j) & (pos < len(tokens))).numpy()
            rows[pos.numpy()[mine], column] = picked[mine]
            call[id(tokens)] = rows
        self.calls.append(call)

    def __enter__(self):
        from megatron_rl.models import forward as fw
        from megatron_rl.models import routing_replay as rr

        self._saved = rr.RoutingReplay.before_forward, fw.PolicyForward._run
        tap = self

        def before_forward(replay, chunk, mb):
            tap._mb[id(chunk)] = mb
            return tap._saved[0](replay, chunk, mb)

        def run(policy, micro, step_fn, forward_only, batch=None, routes=None):
            tap._pass_batch, tap._mb = batch, {}
            return tap._saved[1](policy, micro, step_fn, forward_only, batch=batch, routes=routes)

        rr.RoutingReplay.before_forward, fw.PolicyForward._run = before_forward, run
        return self

    def __exit__(self, *exc):
        from megatron_rl.models import forward as fw
        from megatron_rl.models import routing_replay as rr

        rr.RoutingReplay.before_forward, fw.PolicyForward._run = self._saved
        for h in self._hooks:
            h.remove()

    def merged(self) -> list[np.ndarray]:
        """Per sequence of ``batch``, what the calls routed (a (position, layer) routed by more than
        one call must be routed alike by all)."""
        out = [np.full((len(s), self.layers, self.top_k), -1) for s in self.batch.sequences]
        index = {id(s): i for i, s in enumerate(self.batch.sequences)}
        for call in self.calls:
            for key, rows in call.items():
                o = out[index[key]]
                seen = rows[..., 0] >= 0
                both = seen & (o[..., 0] >= 0)
                assert (np.sort(o[both], -1) == np.sort(rows[both], -1)).all(), "two calls routed a token differently"
                o[seen] = rows[seen]
        return out
