"""The config keys walked on real vLLM servers (tests/integration/rollout/test_fleet.py, with the
fleet's shared servers): the engines' set-up, where they run and how they are found, their timeouts,
dispatch, and the weight transfer. The rest of the walk (test_every_key_acts.py) skips them; each of
the two walks checks that it covers its share."""

FLEET_KEYS = frozenset({
    # what the launched servers run with (their command lines, read back from the started processes)
    "rollout.engine", "rollout.dtype", "rollout.kv_cache_bytes", "rollout.gpu_memory_utilization",
    "rollout.tensor_parallel_size", "rollout.expert_parallel", "rollout.enforce_eager", "rollout.max_num_seqs", "sync.transport",
    # where the engines run and how the trainer finds them (the fleet it connects to)
    "rollout.placement", "rollout.num_engines", "rollout.engines_per_node", "rollout.server_urls",
    "rollout.hosts", "rollout.registry_dir",
    # timeouts firing on a server that stops answering (or registers late)
    "rollout.timeout_s", "rollout.control_timeout_s", "rollout.start_timeout_s", "sync.timeout_s",
    # dispatch (and tail hedging), the weight transfer, partial rollouts across a sync
    "rollout.max_inflight_seqs", "rollout.hedge_after", "sync.bucket_bytes", "sync.master_addr", "sync.retries",
    "rollout.async.partial_rollout",
})
