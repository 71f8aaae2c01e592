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

from megatron_rl.common.lazy import lazy_exports

# imported at first use (common.lazy): the run schema reads models.config without torch or megatron
_EXPORTS = {
    "MicroBatch": "batch", "SequenceBatch": "batch",
    "OptimConfig": "config", "ParallelConfig": "config", "PolicyConfig": "config", "RecomputeConfig": "config",
    "ParallelGroups": "parallel", "destroy_distributed": "parallel", "init_distributed": "parallel",
    "MegatronPolicy": "policy",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
