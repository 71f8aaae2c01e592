"""The Megatron-Core policy, one job per file:

* ``parallel.py``: the one interface to Megatron's global parallel state (``init_distributed`` ->
  :class:`ParallelGroups`; a chunk's place in the pipeline, the model-parallel RNG, a barrier);
* ``config.py``: the policy's typed config; ``batch.py``: the batches the policy consumes and their
  DP / micro-batch split; ``micro_batches.py``: one rank's micro-batches as model inputs;
* ``hf_config.py`` (HF architecture), ``gpt.py`` + ``layers.py`` (model construction),
  ``hf_rules.py`` (name and layout rules, shard / unshard), ``hf_load.py``, ``hf_export.py``;
* ``optimizer.py``: DDP, optimizer and LR schedule; ``checkpoint.py``: checkpoints + RNG;
* ``policy.py``: :class:`MegatronPolicy` (log-probs, train step through the pipeline schedule, export).
"""

from megatron_rl.models.batch import MicroBatch, SequenceBatch
from megatron_rl.models.config import OptimConfig, ParallelConfig, PolicyConfig, RecomputeConfig
from megatron_rl.models.parallel import ParallelGroups, destroy_distributed, init_distributed

__all__ = ["MicroBatch", "OptimConfig", "ParallelConfig", "ParallelGroups", "PolicyConfig",
           "RecomputeConfig", "SequenceBatch", "destroy_distributed", "init_distributed"]


def __getattr__(name):  # MegatronPolicy imports megatron lazily: keep `import megatron_rl.models` light
    if name == "MegatronPolicy":
        from megatron_rl.models.policy import MegatronPolicy

        return MegatronPolicy
    raise AttributeError(name)
