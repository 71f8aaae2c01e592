"""Load a HF safetensors checkpoint into this rank's Megatron model chunks, for any TP x PP (x EP x
expert TP) layout: each rank reads only its own experts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_rl.models.hf_config import HFArch, HFModelError
from megatron_rl.models.hf_rules import Rule, chunk_rules, expected_hf_names, shard
from megatron_rl.models.moe_rules import local_experts
from megatron_rl.models.name_schemes import Scheme
from megatron_rl.models.parallel import ParallelGroups


class HFCheckpoint:
    """Read tensors by name from a HF safetensors checkpoint (single file or sharded with index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                self.files = {name: self.dir / f for name, f in weight_map.items()}
            except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise HFModelError(f"{index}: not a safetensors index ({exc!r})") from None
        else:
            single = self.dir / "model.safetensors"
            if not single.is_file():
                raise HFModelError(f"no model.safetensors or model.safetensors.index.json in "
                                   f"{self.dir}")
            self.files = {name: single for name in self._read(single, lambda f: list(f.keys()))}

    @staticmethod
    def _read(path: Path, fn):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(path, "pt") as f:
                return fn(f)
        except (SafetensorError, OSError) as exc:
            raise HFModelError(f"{path}: cannot read the weights ({exc})") from None

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise HFModelError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return self._read(self.files[name], lambda f: f.get_tensor(name))


def megatron_shards(arch: HFArch, rules: dict[str, Rule], ckpt: HFCheckpoint, tp: int,
                    tp_rank: int, etp: int | None = None, etp_rank: int | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """TP rank ``tp_rank``'s Megatron tensors (named as in ``rules``; routed experts: expert-TP rank
    ``etp_rank`` of ``etp``, by default the same as TP's) from the HF checkpoint, one at a time
    (only the HF tensors of the current one are held)."""
    for name, rule in rules.items():
        size, rank = (tp, tp_rank) if rule.expert is None or etp is None else (etp, etp_rank)
        yield name, shard(arch, rule, [ckpt.get(n) for n in rule.hf], size, rank)


def rank_experts(arch: HFArch, groups: ParallelGroups) -> range | None:
    """The global experts this rank holds (None for a dense model)."""
    return local_experts(arch.moe, groups.ep, groups.ep_rank) if arch.moe is not None else None


@torch.no_grad()
def load_hf_weights(arch: HFArch, chunks: list, hf_dir: str | Path, groups: ParallelGroups,
                    scheme: Scheme = "local") -> None:
    """Copy the HF checkpoint into this rank's (unwrapped) model chunks, whose parameter names are
    in ``scheme`` (their layer spec's).

    Raises if the checkpoint lacks a tensor the model needs or holds one we do not know how to map.
    """
    ckpt = HFCheckpoint(hf_dir)
    expected = expected_hf_names(arch)
    unknown = sorted(n for n in ckpt.names() - expected if not n.endswith("rotary_emb.inv_freq"))
    if arch.tie_embeddings:
        unknown = [n for n in unknown if n != "lm_head.weight"]  # some tied checkpoints keep it
    if unknown:
        raise HFModelError(f"{hf_dir}: tensors with no Megatron counterpart for {arch.model_type}: "
                           f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for chunk in chunks:
        rules = chunk_rules(arch, chunk, scheme, rank_experts(arch, groups))
        # (Transformer Engine may register an empty placeholder where a layer has no bias.)
        params = {n: p for n, p in chunk.named_parameters() if p.numel() or n in rules}
        unmapped = sorted(set(params) - set(rules))
        if unmapped:
            raise RuntimeError(f"Megatron parameters with no HF mapping ({scheme} names): "
                               f"{unmapped[:5]}")
        for name, piece in megatron_shards(arch, rules, ckpt, groups.tp, groups.tp_rank,
                                           groups.etp, groups.etp_rank):
            rule = rules[name]
            param = params[name]
            if tuple(piece.shape) != tuple(param.shape):
                raise HFModelError(f"{hf_dir}: {rule.hf} give shape {tuple(piece.shape)} for "
                                   f"Megatron parameter {name} of shape {tuple(param.shape)}")
            param.copy_(piece.to(param.dtype))
