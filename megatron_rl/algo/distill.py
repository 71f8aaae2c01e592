"""On-policy distillation: a teacher's log-probs of the policy's own sampled tokens as a per-token
advantage (the reverse KL to the teacher, estimated on the student's samples).

With k_t = log pi_old(y_t) - log pi_teacher(y_t), an unbiased single-sample estimate of the
per-token reverse KL(pi_old || pi_teacher) at the sampled prefix, the advantage of token t is
    "add":     A_t = A_reward + coef * (-k_t)
    "replace": A_t = coef * (-k_t)
and the policy loss (algo.policy_loss) trains on it: minimising the reverse KL by policy gradient,
as in on-policy distillation (Agarwal et al. 2024, GKD; Qwen3; Thinking Machines 2025).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algo.config import DistillConfig


def distill_advantages(advantages: Tensor, old_logp: Tensor, teacher_logp: Tensor, mask: Tensor,
                       cfg: DistillConfig) -> tuple[Tensor, Tensor]:
    """Per-token advantages [b,T] mixed with the teacher's signal, and the per-token reverse-KL
    estimate k_t [b,T] (0 at padding). ``advantages`` [b,T] (the reward's, repeated per token)."""
    k = torch.where(mask, old_logp.detach() - teacher_logp.detach(), 0.0)
    signal = -cfg.coef * k
    mixed = signal if cfg.mode == "replace" else advantages + signal
    return torch.where(mask, mixed, 0.0).to(advantages.dtype), k
