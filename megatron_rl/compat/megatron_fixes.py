"""Workarounds for megatron-core 0.16.1's optimizer checkpoints without TE / Apex.

Without Transformer Engine or Apex, Megatron wraps ``torch.optim.AdamW``, whose per-parameter state
holds a ``step`` tensor. Three code paths then go wrong (seen on CPU, where TE never exists; the same
holds on a GPU box without TE):

* ``DistributedOptimizer.load_state_dict`` gives every parameter's state the *same* ``step`` tensor
  object (``s["step"] = step`` in a loop), and torch's ``Optimizer.load_state_dict`` keeps it as is
  (no copy for a non-fused, non-capturable Adam). AdamW then increments that one tensor once per
  parameter (``step_t += 1``), so after a restore every step advances it by the number of
  parameters and each parameter's bias correction uses a wrong step: the step after a resume
  differed by ~0.35 lr in the weights whose gradients keep one sign (the norms).
  :func:`apply_megatron_fixes` gives each parameter its own copy after every load;
* ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every key of the live state
  from the loaded tensors, but ``step`` is restored separately and is not among them:
  :func:`apply_megatron_fixes` makes it skip the keys the checkpoint does not carry;
* an optimizer that has not stepped yet has no state, so a checkpoint written then holds no Adam
  moments and loading it asks for keys that are not there (``KeyError: optimizer.state.exp_avg...``;
  the distributed optimizer's ``state_dict`` even asserts on the missing ``step``):
  :func:`init_optimizer_state` gives it the state a first step would start from (zero moments,
  step 0), which is exactly what Adam creates lazily, before such a save and before every load;
* the plain optimizers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``) save torch Adam's
  per-parameter step as one ``common_step``, but only ``if step:``, so step 0 is dropped and the
  load then fails in torch (``KeyError: 'step'``): :func:`apply_megatron_fixes` restores step 0.

The first two are no-ops where Megatron uses TE's / Apex's fused Adam; the last two apply to all
(the last one only matters for torch Adam, whose state carries the step).

Two more, for Mixture-of-Experts:

* without Transformer Engine, ``moe_utils.RouterGatingLinearFunction`` (the router's linear, every
  MoE forward and backward) tests ``te_general_gemm is not None``, a name ``moe_utils`` binds only
  when TE imports: a NameError on every router call. :func:`apply_megatron_fixes` binds it to None,
  which selects Megatron's own torch.mm path;
* the alltoall token dispatcher keeps the router's output ``probs`` on itself after the forward
  (``self.probs``, read once more for its dtype in ``combine_preprocess``). After a training step
  that tensor's autograd graph reaches the parameters' gradient accumulators, whose hooks (Megatron
  DDP's) hold the model: a cycle through C++ the garbage collector cannot see, so a trained MoE
  policy was never freed (with its process groups' threads: +48 per layout in a test launch).
  :func:`apply_megatron_fixes` drops the reference once ``combine_preprocess`` has read it.
"""

from __future__ import annotations

import torch

_STATE = {"applied": False}


def megatron_fixes_applied() -> bool:
    """Whether :func:`apply_megatron_fixes` has run in this process."""
    return _STATE["applied"]


def apply_megatron_fixes() -> None:
    """Patch Megatron once per process (idempotent); through ``megatron_rl.compat.apply_compat``,
    the entry point's one call."""
    if _STATE["applied"]:
        return
    _STATE["applied"] = True
    _bind_missing_te_gemm()
    _release_dispatcher_probs()
    try:
        from megatron.core.optimizer import distrib_optimizer as do
        from megatron.core.optimizer import optimizer as mo
    except ImportError:
        return
    for cls, key in ((mo.FP32Optimizer, None), (mo.Float16OptimizerWithFloat16Params, "optimizer")):
        cls.load_state_dict = _restoring_step_zero(cls.load_state_dict, key)
    if getattr(do, "HAVE_APEX_OR_TE", True):
        return
    original_set = do.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        held = {k: state.pop(k) for k in list(state) if k not in tensors}
        try:
            original_set(self, model_param, tensors)
        finally:
            state.update(held)

    original_load = do.DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        untie_adam_steps(self.optimizer)

    do.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    do.DistributedOptimizer.load_state_dict = load_state_dict


def _bind_missing_te_gemm() -> None:
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _release_dispatcher_probs() -> None:
    try:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    except ImportError:
        return
    original = MoEAlltoAllTokenDispatcher.combine_preprocess

    def combine_preprocess(self, hidden_states):
        try:
            return original(self, hidden_states)
        finally:
            self.probs = None  # its last reader: the graph must not outlive the step

    MoEAlltoAllTokenDispatcher.combine_preprocess = combine_preprocess


def _restoring_step_zero(original, key: str | None):
    def load_state_dict(self, state_dict):
        inner = state_dict.get(key, state_dict.get("optimizer_state_dict")) if key else state_dict
        if isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW) and isinstance(inner, dict):
            states = inner.get("state", {})
            if "common_step" not in states:
                for st in states.values():
                    if isinstance(st, dict) and st and "step" not in st:
                        st["step"] = torch.tensor(0.0)
        return original(self, state_dict)

    return load_state_dict


def untie_adam_steps(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a torch optimizer its own ``step`` tensor (same value)."""
    seen: set[int] = set()
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


def init_optimizer_state(optimizer) -> None:
    """The state a first step would start from, for every parameter of a Megatron (chained)
    optimizer that has none yet: zero moments and, for torch Adam(W), step 0; for other Adam
    implementations (TE / Apex) Megatron's own ``init_state_fn``. Parameters with state keep it."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        inner.state[p]["step"] = torch.tensor(0.0)
                        inner.state[p]["exp_avg"] = torch.zeros_like(p.data)
                        inner.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
        elif getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, getattr(opt, "config", None))
