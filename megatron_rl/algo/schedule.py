"""Off-policy control: which samples each optimizer step of a rollout batch uses.

A rollout batch is used for ``n_sgd`` passes of ``mini_batches`` optimizer steps each; the default
(1, 1) is strictly on-policy (one step on the whole batch). The seed (Skywork-OR1): more steps per
rollout cost little time but go off-policy, and entropy then collapses fast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algo.config import AlgoConfig


def sgd_schedule(num_samples: int, cfg: AlgoConfig, *, seed: int = 0) -> list[Tensor]:
    """Sample indices of every optimizer step: n_sgd passes x mini_batches steps, in order.

    Each pass is a fresh seeded permutation split into ``mini_batches`` near-equal parts (sizes
    differ by at most one); a single step keeps the natural order.
    """
    if num_samples < cfg.mini_batches:
        raise ValueError(f"algo.mini_batches: {cfg.mini_batches} mini-batches need at least as "
                         f"many samples, got {num_samples}")
    if cfg.n_sgd < 1:
        raise ValueError(f"algo.n_sgd: must be >= 1, got {cfg.n_sgd}")
    if cfg.n_sgd == 1 and cfg.mini_batches == 1:
        return [torch.arange(num_samples)]
    steps = []
    for sgd_pass in range(cfg.n_sgd):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + sgd_pass)
        order = torch.randperm(num_samples, generator=generator)
        steps.extend(torch.tensor_split(order, cfg.mini_batches))
    return steps
