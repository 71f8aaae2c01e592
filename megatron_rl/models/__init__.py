"""Megatron-Core policy: build from HF checkpoints, log-probs/entropy, train step, HF export."""

from megatron_rl.models.batch import MicroBatch, SequenceBatch
from megatron_rl.models.config import OptimConfig, ParallelConfig, PolicyConfig
from megatron_rl.models.parallel import ParallelGroups, destroy_distributed, init_distributed

__all__ = ["MicroBatch", "OptimConfig", "ParallelConfig", "ParallelGroups", "PolicyConfig",
           "SequenceBatch", "destroy_distributed", "init_distributed"]


def __getattr__(name):  # MegatronPolicy imports megatron lazily: keep `import megatron_rl.models` light
    if name == "MegatronPolicy":
        from megatron_rl.models.policy import MegatronPolicy

        return MegatronPolicy
    raise AttributeError(name)
