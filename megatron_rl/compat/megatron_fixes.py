"""Workarounds for megatron-core 0.16.1's distributed-optimizer checkpoints without TE / Apex.

Without Transformer Engine or Apex, Megatron's ``DistributedOptimizer`` wraps ``torch.optim.AdamW``,
whose per-parameter state holds a ``step`` tensor. Two code paths then break when a checkpoint is
loaded (seen on CPU, where TE never exists; the same holds on a GPU box without TE):

* ``state_dict()`` asserts that every parameter's state has one common ``step``, so building the
  state dict to load into fails on a fresh optimizer (empty state):
  :func:`init_empty_adam_state` gives it zero state first (the load overwrites all of it);
* ``_set_main_param_and_optimizer_states`` copies every key of the live state from the loaded
  tensors, but ``step`` is restored separately and is not among them: :func:`apply_megatron_fixes`
  makes it skip the keys the checkpoint does not carry.

Both are no-ops where Megatron uses TE's / Apex's fused Adam.
"""

from __future__ import annotations

import torch

_STATE = {"applied": False}


def apply_megatron_fixes() -> None:
    """Patch Megatron once per process (idempotent)."""
    if _STATE["applied"]:
        return
    _STATE["applied"] = True
    try:
        from megatron.core.optimizer import distrib_optimizer as do
    except ImportError:
        return
    if getattr(do, "HAVE_APEX_OR_TE", True):
        return
    original = do.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        held = {k: state.pop(k) for k in list(state) if k not in tensors}
        try:
            original(self, model_param, tensors)
        finally:
            state.update(held)

    do.DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def init_empty_adam_state(optimizer) -> None:
    """Zero Adam state and step 0 for every parameter of a torch Adam(W) inside a Megatron optimizer
    whose state is still empty (before loading a checkpoint into it)."""
    inner = [getattr(o, "optimizer", None)
             for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    for opt in inner:
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["step"] = torch.tensor(0.0)
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
