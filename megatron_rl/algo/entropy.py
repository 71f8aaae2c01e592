"""Entropy term: the adaptive coefficient controller (Skywork-OR1) and the sampled-token estimate.

Adaptive control: each ``update(e_k)`` with the latest measured mean token entropy e_k (the
old-log-prob pass of the step, or, strictly on-policy without a recompute, the previous update's
forward) and coefficient state c_k (c_0 = ``coef``) sets the alpha of the next loss computations:
    alpha_k = c_k if e_k <= target else 0          (the term only applies below target)
    c_{k+1} = clamp(c_k + delta if e_k < target, c_k - delta if e_k > target, coef_min, coef_max)
"fixed" mode: alpha = coef at every step; "off": alpha = 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_rl.algo.config import EntropyConfig


class EntropyController:
    """Owns the entropy coefficient alpha; its state is saved and restored with checkpoints."""

    def __init__(self, cfg: EntropyConfig):
        self.cfg = cfg
        self._coef = cfg.coef  # c_k, the adaptive state
        self._alpha = cfg.coef if cfg.mode == "fixed" else 0.0
        self._steps = 0

    @property
    def alpha(self) -> float:
        """The coefficient of the entropy term for the current step (pass to policy_objective)."""
        return self._alpha

    def update(self, mean_entropy: float) -> dict[str, float]:
        """Set alpha from the latest mean token entropy; advance the adaptive state."""
        entropy = float(mean_entropy)
        if not math.isfinite(entropy):
            raise ValueError(f"mean_entropy: must be finite, got {mean_entropy!r}")
        cfg = self.cfg
        self._steps += 1
        if cfg.mode == "adaptive":
            below = entropy <= cfg.target
            self._alpha = self._coef if below else 0.0
            step = cfg.delta if entropy < cfg.target else -cfg.delta if entropy > cfg.target else 0
            self._coef = min(max(self._coef + step, cfg.coef_min), cfg.coef_max)
        elif cfg.mode == "fixed":
            self._alpha = cfg.coef
        else:
            self._alpha = 0.0
        return {"actor/entropy_coef": self._alpha,
                "actor/entropy_coef_state": self._coef,
                "actor/entropy_measured": entropy,
                "actor/entropy_below_target": float(entropy <= cfg.target)}

    def state_dict(self) -> dict[str, float | int | str]:
        return {"mode": self.cfg.mode, "coef": self._coef, "alpha": self._alpha,
                "steps": self._steps}

    def load_state_dict(self, state: dict) -> None:
        missing = {"mode", "coef", "alpha", "steps"} - set(state)
        if missing:
            raise ValueError(f"state: entropy controller state lacks {sorted(missing)}")
        if state["mode"] != self.cfg.mode:
            raise ValueError(f"state: saved with entropy mode {state['mode']!r}, "
                             f"configured {self.cfg.mode!r} (algo.entropy.mode)")
        self._coef = float(state["coef"])
        self._alpha = float(state["alpha"])
        self._steps = int(state["steps"])


def sampled_entropy_surrogate(logp: Tensor, log_ratio: Tensor) -> Tensor:
    """Per-token surrogate of the sampled-token entropy estimate for tokens drawn from pi_old.

    Value -r * log pi(a) (r = pi / pi_old), an unbiased estimate of H(pi); gradient
    -r log pi(a) grad log pi(a), an unbiased estimate of grad H(pi).
    """
    return -torch.exp(log_ratio) * logp.detach()
