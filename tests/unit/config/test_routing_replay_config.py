"""algo.routing_replay / algo.router_agreement / rollout.routes_source: refused with one line naming
the key where they cannot act (a dense model, an unknown value)."""

from __future__ import annotations

import pytest

from megatron_rl.config.base import ConfigError
from megatron_rl.trainer.schema import load_run_config

TINY = ['model.path=""', "model.tiny={hidden_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 2}",
        "stages=[{name: s1, max_response_len: 8, max_steps: 1}]", "rollout.max_prompt_len=16"]


@pytest.mark.parametrize("override,key", [("algo.routing_replay=r3", "algo.routing_replay"),
                                          ("algo.routing_replay=r2", "algo.routing_replay"),
                                          ("algo.router_agreement=true", "algo.router_agreement")])
def test_routing_replay_is_refused_for_a_dense_model(override, key):
    with pytest.raises(ConfigError, match=f"{key}.*dense model"):
        load_run_config(None, TINY + [override])
    cfg = load_run_config(None, TINY + ["model.tiny.arch=qwen3_moe", override])  # experts: accepted
    assert cfg.algo.engine_routes == (override != "algo.routing_replay=r2")


@pytest.mark.parametrize("override,key", [("algo.routing_replay=r1", "algo.routing_replay"),
                                          ("rollout.routes_source=gpu", "rollout.routes_source")])
def test_routing_replay_unknown_values_are_refused(override, key):
    with pytest.raises(ConfigError, match=f"{key}.*must be one of"):
        load_run_config(None, TINY + ["model.tiny.arch=qwen3_moe", override])
