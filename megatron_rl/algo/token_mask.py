"""Token masks, registered by name (``algo.token_mask.mode``): which response tokens the policy
loss trains, chosen from the old policy's token entropy over the whole rollout batch.

"high_entropy": the high-entropy minority (Wang et al. 2025, "Beyond the 80/20 rule": the forking
tokens; training only the top 20 % matches or beats training on all); "low_entropy": the opposite
end (the seed: "token masks for high/low-entropy tokens").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_rl.algo.config import TokenMaskConfig
from megatron_rl.algo.registry import TOKEN_MASKS, register_token_mask


def _kept(n: int, frac: float) -> int:
    return min(n, max(1, math.ceil(frac * n)))


@register_token_mask("high_entropy")
def high_entropy_mask(entropy: Tensor, frac: float) -> Tensor:
    """Tokens whose entropy is >= the ceil(frac * N)-th largest (ties at the threshold kept)."""
    threshold = torch.topk(entropy, _kept(entropy.numel(), frac)).values[-1]
    return entropy >= threshold


@register_token_mask("low_entropy")
def low_entropy_mask(entropy: Tensor, frac: float) -> Tensor:
    """Tokens whose entropy is <= the ceil(frac * N)-th smallest (ties at the threshold kept)."""
    threshold = torch.topk(entropy, _kept(entropy.numel(), frac), largest=False).values[-1]
    return entropy <= threshold


def token_masks(entropies: list[Tensor], cfg: TokenMaskConfig) -> tuple[list[Tensor], dict[str, float]]:
    """Per response, the bool mask of its trained tokens (from its tokens' entropies [L_i]), chosen
    over the whole batch by ``cfg.mode``, and the metrics: the kept fraction and the threshold's
    range (the kept tokens' entropy min / max)."""
    if not entropies:
        raise ValueError("entropies: empty batch")
    flat = torch.cat([e.detach().reshape(-1).to(torch.float64) for e in entropies])
    if flat.numel() == 0:
        raise ValueError("entropies: no response token in the batch")
    keep = TOKEN_MASKS[cfg.mode](flat, cfg.frac)
    kept = flat[keep]
    masks = list(torch.split(keep, [e.numel() for e in entropies]))
    return masks, {"mask/kept_frac": keep.double().mean().item(),
                   "mask/kept_entropy_min": kept.min().item(), "mask/kept_entropy_max": kept.max().item(),
                   "mask/entropy_mean": flat.mean().item()}
