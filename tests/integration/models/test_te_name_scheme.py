"""The Transformer Engine parameter-name scheme, checked against Megatron-Core's TE spec objects.

Transformer Engine cannot be installed here, so no TE model can be built; the names a TE-spec layer
has come from the spec our ``layers.gpt_block_spec`` builds with Megatron's
``get_gpt_layer_with_transformer_engine_spec`` (which module class sits at which place) and the
parameters each TE class declares (TE's ``LayerNormLinear``: ``weight``, ``bias``,
``layer_norm_weight``; ``Linear``: ``weight``; ``GroupedLinear`` (a MoE layer's routed experts,
``TEGroupedMLP``): ``weight0`` ... ``weight{n-1}`` for its n local experts, the keys Megatron's
``TEGroupedMLP.sharded_state_dict`` reads; Megatron's ``TENorm`` for RMSNorm: ``weight``; the
router: ``weight``). Building that spec without TE needs names answered that Megatron resolves only
when TE imports (the provider class in ``gpt_layer_specs``, TE's version, the grouped linear
classes, which are None without TE); the test binds them for the call and nothing else.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policy_testlib import write_hf_model, write_hf_moe_model

pytestmark = pytest.mark.slow


class TEColumnParallelGroupedLinear:  # stand-ins for TE's grouped linears (None without TE)
    pass


class TERowParallelGroupedLinear:
    pass


def te_layer_spec(config, qk_norm: bool):
    """The layer spec our gpt_block_spec builds for the TE spec (``config``: a built model's)."""
    from unittest import mock

    from megatron.core.extensions import transformer_engine_spec_provider as tsp
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_rl.models.layers import gpt_block_spec

    with mock.patch.object(gpt_layer_specs, "TESpecProvider", tsp.TESpecProvider, create=True), \
            mock.patch.object(tsp, "is_te_min_version", lambda *a, **k: True), \
            mock.patch.object(tsp, "TEColumnParallelGroupedLinear", TEColumnParallelGroupedLinear), \
            mock.patch.object(tsp, "TERowParallelGroupedLinear", TERowParallelGroupedLinear):
        return gpt_block_spec(config, qk_norm, None, 0, "te").layer_specs[0]


def te_declared_names(spec, qkv_bias: bool, moe=None, local_experts: int = 0) -> set[str]:
    """Parameter names of one TE-spec layer: walk the spec, each module class -> its parameters
    (``moe``: the MoEArch of a MoE layer holding ``local_experts`` experts)."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_rl.models.moe_signals import router_class

    p = TESpecProvider()
    grouped = tuple(f"weight{j}" for j in range(local_experts))
    declares = {id(p.column_parallel_layer_norm_linear()): ("weight", "layer_norm_weight"),
                id(p.row_parallel_linear()): ("weight",), id(TENorm): ("weight",),
                id(p.column_parallel_linear()): ("weight",),
                id(TEColumnParallelGroupedLinear): grouped, id(TERowParallelGroupedLinear): grouped,
                id(router_class()): ("weight",),
                id(p.core_attention()): (), id(IdentityOp): (), id(IdentityFuncOp): ()}
    names: set[str] = set()

    def walk(node, prefix: str) -> None:
        if isinstance(node, ModuleSpec):
            if node.module is SharedExpertMLP and not (moe and moe.has_shared_expert):
                return  # built only with moe_shared_expert_intermediate_size
            if node.module is SharedExpertMLP and moe.shared_expert_gate:
                names.add(prefix + "gate_weight")
            if node.module is TEGroupedMLP:
                assert local_experts, "a grouped-GEMM expert module in a dense layer"
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
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")
ALL = [a for a, _ in ARCHS] + list(MOE_ARCHS)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_names")
    dirs = {arch: write_hf_model(root / arch, arch, tie=tie, kv_heads=2, layers=2)
            for arch, tie in ARCHS}
    dirs.update({arch: write_hf_moe_model(root / arch, arch) for arch in MOE_ARCHS})
    return dirs


@pytest.fixture(scope="module")
def local_layers(hf_dirs):
    """One built local-spec layer per architecture: {arch: (HFArch, {name: shape}, config)}."""
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
        out[arch] = (spec, {n: tuple(p.shape) for n, p in chunk.decoder.layers[0].named_parameters()},
                     chunk.config)
    yield out
    destroy_distributed()


def _declared(arch, local_layers) -> set[str]:
    spec, _, config = local_layers[arch]
    experts = spec.moe.num_experts if spec.moe else 0  # one rank holds them all here
    return te_declared_names(te_layer_spec(config, spec.qk_norm), spec.qkv_bias, spec.moe, experts)


@pytest.mark.parametrize("arch", ALL)
def test_te_scheme_names_are_the_te_spec_names(arch, local_layers):
    from megatron_rl.models.name_schemes import layer_param_name, local_layer_param_name

    spec, local, _ = local_layers[arch]
    moe = spec.is_moe
    renamed = {layer_param_name(n, "te", moe): shape for n, shape in local.items()}
    assert set(renamed) == _declared(arch, local_layers)
    # the folded norms have the shape TE's LayerNormLinear gives them: its input width (a MoE
    # layer keeps its pre-MLP norm a module: nothing to fold it into)
    for linear in ("self_attention.linear_qkv",) + (() if moe else ("mlp.linear_fc1",)):
        assert renamed[f"{linear}.layer_norm_weight"] == (renamed[f"{linear}.weight"][1],)
    if moe:  # one grouped weight per local expert, each of the local expert's shape
        for j in range(spec.moe.num_experts):
            for fc in ("linear_fc1", "linear_fc2"):
                assert renamed[f"mlp.experts.{fc}.weight{j}"] == \
                    local[f"mlp.experts.local_experts.{j}.{fc}.weight"]
    # and back
    assert {local_layer_param_name(n, "te", moe) for n in renamed} == set(local)
    assert all(layer_param_name(n, "local", moe) == n for n in local)


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


@pytest.mark.parametrize("arch", ALL)
def test_te_scheme_state_dict_reads_back_as_the_local_one(arch, hf_dirs, local_layers):
    """The bridge writes a whole model's TP=2 shards in both schemes from one HF checkpoint: the TE
    dict holds the names the TE spec declares, equals the local dict name by name (after the
    renaming), and reads back (unshard) to the HF checkpoint's exact bytes, as the local one does."""
    from safetensors.torch import load_file

    from megatron_rl.models.hf_load import HFCheckpoint, megatron_shards
    from megatron_rl.models.hf_rules import model_rules, unshard
    from megatron_rl.models.name_schemes import model_param_name

    spec, _, _ = local_layers[arch]
    ckpt, tp = HFCheckpoint(hf_dirs[arch]), 2
    layers = list(range(spec.num_layers))
    rules = {scheme: model_rules(spec, layers, first=True, last=True,
                                 output_layer=not spec.tie_embeddings, scheme=scheme)
             for scheme in ("local", "te")}
    shards = {scheme: [dict(megatron_shards(spec, r, ckpt, tp, rank)) for rank in range(tp)]
              for scheme, r in rules.items()}
    declared = _declared(arch, local_layers)
    for i in layers:
        prefix = f"decoder.layers.{i}."
        assert {n[len(prefix):] for n in rules["te"] if n.startswith(prefix)} == declared
    for rank in range(tp):
        te, local = shards["te"][rank], shards["local"][rank]
        renamed = {model_param_name(n, "te", to="local", moe=spec.is_moe): t for n, t in te.items()}
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
