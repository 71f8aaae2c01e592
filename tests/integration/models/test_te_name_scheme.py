"""The Transformer Engine parameter-name scheme, checked against Megatron-Core's TE spec objects.

Transformer Engine cannot be installed here, so no TE model can be built; the names a TE-spec layer
has come from the spec Megatron's ``get_gpt_layer_with_transformer_engine_spec`` returns (which
module class sits at which place) and the parameters each TE class declares (TE's
``LayerNormLinear``: ``weight``, ``bias``, ``layer_norm_weight``; ``Linear``: ``weight``; Megatron's
``TENorm`` for RMSNorm: ``weight``). Building that spec without TE needs two names answered that
Megatron resolves only when TE imports (the provider class in ``gpt_layer_specs`` and TE's version);
the test binds them for the call and nothing else.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policy_testlib import write_hf_model

pytestmark = pytest.mark.slow


def te_layer_spec(qk_norm: bool):
    from unittest import mock

    from megatron.core.extensions import transformer_engine_spec_provider as tsp
    from megatron.core.models.gpt import gpt_layer_specs

    with mock.patch.object(gpt_layer_specs, "TESpecProvider", tsp.TESpecProvider, create=True), \
            mock.patch.object(tsp, "is_te_min_version", lambda *a, **k: True):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)


def te_declared_names(spec, qkv_bias: bool) -> set[str]:
    """Parameter names of one TE-spec layer: walk the spec, each module class -> its parameters."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    p = TESpecProvider()
    declares = {id(p.column_parallel_layer_norm_linear()): ("weight", "layer_norm_weight"),
                id(p.row_parallel_linear()): ("weight",), id(TENorm): ("weight",),
                id(p.core_attention()): (), id(IdentityOp): (), id(IdentityFuncOp): ()}
    names: set[str] = set()

    def walk(node, prefix: str) -> None:
        if isinstance(node, ModuleSpec):
            if node.submodules is not None:
                walk(node.submodules, prefix)
            elif id(node.module) in declares:
                names.update(prefix + n for n in declares[id(node.module)])
            return
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            if field.name == "sharded_state_dict_keys_map" or value is None:
                continue
            if isinstance(value, ModuleSpec) or dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{field.name}.")
            elif id(value) in declares:
                names.update(f"{prefix}{field.name}.{n}" for n in declares[id(value)])
            elif callable(value) and not isinstance(value, type) and field.name.endswith("bda"):
                continue  # bias-dropout-add functions: no parameters
            else:
                raise AssertionError(f"the walk does not know {field.name}={value!r}")

    walk(spec, "")
    if qkv_bias:
        names.add("self_attention.linear_qkv.bias")
    return names


ARCHS = (("llama", False), ("qwen2", True), ("qwen3", False))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_names")
    return {arch: write_hf_model(root / arch, arch, tie=tie, kv_heads=2, layers=2)
            for arch, tie in ARCHS}


@pytest.fixture(scope="module")
def local_layers(hf_dirs):
    """One built local-spec layer per architecture: {arch: (HFArch, {name: shape})}."""
    from megatron_rl.compat import apply_compat, megatron_cpu_scope
    from megatron_rl.models import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.models.gpt import build_model_chunks
    from megatron_rl.models.hf_config import read_hf_config

    apply_compat()  # the entry point's one explicit call (no-op with CUDA)
    groups = init_distributed(ParallelConfig())
    out = {}
    for arch, hf in hf_dirs.items():
        spec = read_hf_config(hf)
        with megatron_cpu_scope():
            chunk = build_model_chunks(spec, groups, torch.float32)[0]
        out[arch] = (spec, {n: tuple(p.shape) for n, p in chunk.decoder.layers[0].named_parameters()})
    yield out
    destroy_distributed()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_te_scheme_names_are_the_te_spec_names(arch, local_layers):
    from megatron_rl.models.name_schemes import layer_param_name, local_layer_param_name

    spec, local = local_layers[arch]
    declared = te_declared_names(te_layer_spec(spec.qk_norm), spec.qkv_bias)
    renamed = {layer_param_name(n, "te"): shape for n, shape in local.items()}
    assert set(renamed) == declared
    # the folded norms have the shape TE's LayerNormLinear gives them: its input width
    for linear in ("self_attention.linear_qkv", "mlp.linear_fc1"):
        assert renamed[f"{linear}.layer_norm_weight"] == (renamed[f"{linear}.weight"][1],)
    # and back
    assert {local_layer_param_name(n, "te") for n in renamed} == set(local)
    assert all(layer_param_name(n, "local") == n for n in local)


def test_model_param_names_convert_both_ways():
    from megatron_rl.models.name_schemes import model_param_name

    pairs = [("decoder.layers.3.input_layernorm.weight",
              "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"),
             ("decoder.layers.0.pre_mlp_layernorm.weight",
              "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"),
             ("decoder.layers.1.self_attention.linear_qkv.weight",
              "decoder.layers.1.self_attention.linear_qkv.weight"),
             ("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"),
             ("embedding.word_embeddings.weight", "embedding.word_embeddings.weight")]
    for local, te in pairs:
        assert model_param_name(local, "local", to="te") == te
        assert model_param_name(te, "te", to="local") == local
    with pytest.raises(ValueError, match="unknown parameter-name scheme"):
        model_param_name("decoder.layers.0.input_layernorm.weight", "local", to="apex")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_te_scheme_state_dict_reads_back_as_the_local_one(arch, hf_dirs, local_layers):
    """The bridge writes a whole model's TP=2 shards in both schemes from one HF checkpoint: the TE
    dict holds the names the TE spec declares, equals the local dict name by name (after the
    renaming), and reads back (unshard) to the HF checkpoint's exact bytes, as the local one does."""
    from safetensors.torch import load_file

    from megatron_rl.models.hf_load import HFCheckpoint, megatron_shards
    from megatron_rl.models.hf_rules import model_rules, unshard
    from megatron_rl.models.name_schemes import model_param_name

    spec, _ = local_layers[arch]
    ckpt, tp = HFCheckpoint(hf_dirs[arch]), 2
    layers = list(range(spec.num_layers))
    rules = {scheme: model_rules(spec, layers, first=True, last=True,
                                 output_layer=not spec.tie_embeddings, scheme=scheme)
             for scheme in ("local", "te")}
    shards = {scheme: [dict(megatron_shards(spec, r, ckpt, tp, rank)) for rank in range(tp)]
              for scheme, r in rules.items()}
    declared = te_declared_names(te_layer_spec(spec.qk_norm), spec.qkv_bias)
    for i in layers:
        prefix = f"decoder.layers.{i}."
        assert {n[len(prefix):] for n in rules["te"] if n.startswith(prefix)} == declared
    for rank in range(tp):
        te, local = shards["te"][rank], shards["local"][rank]
        renamed = {model_param_name(n, "te", to="local"): t for n, t in te.items()}
        assert set(renamed) == set(local)
        for name, tensor in local.items():
            assert renamed[name].dtype == tensor.dtype and torch.equal(renamed[name], tensor), name
    original = load_file(str(hf_dirs[arch] / "model.safetensors"))
    for scheme, r in rules.items():
        read_back = {}
        for name, rule in r.items():
            for hf_name, t in zip(rule.hf, unshard(spec, rule, [s[name] for s in shards[scheme]])):
                read_back[hf_name] = t
        if spec.tie_embeddings:
            original.pop("lm_head.weight", None)
        assert set(read_back) == set(original), scheme
        for name, tensor in original.items():
            assert torch.equal(read_back[name], tensor), (scheme, name)
