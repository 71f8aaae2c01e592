"""The reference policy of the KL term: the starting weights, frozen, on the policy's layout. The
teacher of on-policy distillation (``algo.distill``) is the same kind of frozen forward.

Built like the policy (same TP x PP x VPP chunks, same forward, same log-prob kernel) but without
DDP, optimizer or gradients; :meth:`ReferencePolicy.compute_logprobs` is the policy's forward-only
pass. Its weights come from a Hugging Face checkpoint or from the model part of one of the policy's
own checkpoints (a stage's ``final`` or the SFT result). With ``offload`` (GPUs) they live in host
memory between uses and are copied to the GPU for each forward.

Building it consumes none of the run's random numbers (the chunks' random initialisation, which the
loaded weights overwrite, runs on forked RNG states), so a run with a reference samples and trains
exactly as it would without one until the KL term acts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.compat import megatron_cpu_scope
from megatron_rl.models.batch import SequenceBatch
from megatron_rl.models.checkpoint import load_model_weights
from megatron_rl.models.config import PolicyConfig
from megatron_rl.models.forward import PolicyForward, build_chunks, build_from_hf, check_spec
from megatron_rl.models.hf_config import HFArch
from megatron_rl.models.parallel import ParallelGroups, rng_tracker_states, set_rng_tracker_states


class _ForkedRng:
    """Restore the CPU and model-parallel RNG states on exit."""

    def __enter__(self):
        self.cpu = torch.get_rng_state()
        self.tracker = rng_tracker_states()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def __exit__(self, *exc):
        torch.set_rng_state(self.cpu)
        set_rng_tracker_states(self.tracker)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


class ReferencePolicy(PolicyForward):
    """Frozen chunks; ``compute_logprobs`` is collective over the world, like the policy's."""

    def __init__(self, arch: HFArch, cfg: PolicyConfig, groups: ParallelGroups, model: list,
                 layer_spec: str = "local", *, offload: bool | None = None,
                 offload_key: str = "policy.reference.offload"):
        super().__init__(arch, cfg, groups, model, layer_spec)
        for chunk in model:
            chunk.eval()
            chunk.requires_grad_(False)
        # ``offload``: None = policy.reference.offload; a teacher passes algo.distill.offload
        self.offload = cfg.reference.offload if offload is None else offload
        if self.offload and groups.device.type != "cuda":
            raise ValueError(f"{offload_key}: offloading moves the weights to host memory between "
                             f"uses; this run is on {groups.device.type}, where they are already "
                             f"(set it to false)")
        self._place(torch.device("cpu") if self.offload else groups.device)

    @classmethod
    def from_hf(cls, hf_dir: str, cfg: PolicyConfig, groups: ParallelGroups, **kw) -> ReferencePolicy:
        """The weights (and architecture) of a Hugging Face checkpoint; ``kw``: ``offload``,
        ``offload_key`` (see ``__init__``)."""
        with _ForkedRng():
            arch, chunks, spec = build_from_hf(hf_dir, cfg, groups)
        return cls(arch, cfg, groups, chunks, spec, **kw)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, arch: HFArch, cfg: PolicyConfig,
                        groups: ParallelGroups) -> ReferencePolicy:
        """The model weights of a policy checkpoint (``MegatronPolicy.save_checkpoint``), at any
        layout it was written at."""
        spec = check_spec(cfg, groups)
        with _ForkedRng(), megatron_cpu_scope():
            chunks = build_chunks(arch, cfg, groups, spec)
        if groups.device.type == "cuda":
            chunks = [chunk.cuda(groups.device) for chunk in chunks]
        load_model_weights(chunks, groups, ckpt_dir)
        return cls(arch, cfg, groups, chunks, spec)

    def _place(self, device: torch.device) -> None:
        for chunk in self.model:
            chunk.to(device)

    def compute_logprobs(self, batch: SequenceBatch, temperature: float, with_entropy: bool = False
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The reference's log-probs of the response tokens at ``temperature`` (collective)."""
        if not self.offload:
            return super().compute_logprobs(batch, temperature, with_entropy)
        self._place(self.groups.device)
        try:
            return super().compute_logprobs(batch, temperature, with_entropy)
        finally:
            self._place(torch.device("cpu"))
            torch.cuda.empty_cache()
