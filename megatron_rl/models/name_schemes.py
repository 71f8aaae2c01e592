"""The two parameter-name schemes of a Megatron GPT layer: local spec and Transformer Engine spec.

The local spec (``get_gpt_layer_local_spec``) has separate norm modules; the Transformer Engine
spec (``get_gpt_layer_with_transformer_engine_spec``) folds each pre-norm into the linear layer
after it (``TELayerNormColumnParallelLinear``), so the norm weights live under that linear as
``layer_norm_weight``::

    local                                          te
    decoder.layers.N.input_layernorm.weight        decoder.layers.N.self_attention.linear_qkv.layer_norm_weight
    decoder.layers.N.pre_mlp_layernorm.weight      decoder.layers.N.mlp.linear_fc1.layer_norm_weight

Every other parameter has the same name, shape and layout in both. The correspondence is not ours:
it is the ``sharded_state_dict_keys_map`` of the local layer spec (under which the local spec's
distributed checkpoints store its norms with the TE names); :func:`local_to_te_prefixes` reads it
from there.

Mixture-of-Experts layers (``moe=True``) keep their pre-MLP norm a module in both specs (only the
input norm folds), and hold their routed experts differently: the local spec's ``SequentialMLP``
as one MLP per local expert, TE's ``TEGroupedMLP`` as grouped linears with one weight per local
expert::

    local                                                  te
    mlp.experts.local_experts.J.linear_fc1.weight          mlp.experts.linear_fc1.weightJ
    mlp.experts.local_experts.J.linear_fc2.weight          mlp.experts.linear_fc2.weightJ
"""

from __future__ import annotations

import functools
import re
from typing import Literal

Scheme = Literal["local", "te"]
SCHEMES: tuple[str, ...] = ("local", "te")

_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


@functools.lru_cache(maxsize=2)
def local_to_te_prefixes(moe: bool = False) -> tuple[tuple[str, str], ...]:
    """(local prefix, TE prefix) pairs of a layer's parameter names, from the local spec's keys map
    (a dense layer's, or a MoE layer's)."""
    from megatron_rl.models.layers import local_layer_spec

    spec = local_layer_spec(qk_norm=False, num_experts=2 if moe else None)
    keys_map = spec.submodules.sharded_state_dict_keys_map
    if not keys_map:
        raise RuntimeError("the local layer spec declares no sharded_state_dict_keys_map: "
                           "cannot derive the Transformer Engine parameter names")
    return tuple(sorted(keys_map.items()))


def _check(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown parameter-name scheme {scheme!r}; known: {list(SCHEMES)}")


def layer_param_name(local_name: str, scheme: Scheme, moe: bool = False) -> str:
    """A layer-relative parameter name (e.g. ``input_layernorm.weight``) in ``scheme``; ``moe``:
    the layer is a Mixture-of-Experts layer."""
    _check(scheme)
    if scheme == "te":
        expert = _LOCAL_EXPERT.match(local_name) if moe else None
        if expert:
            j, linear, kind = expert.groups()
            return f"mlp.experts.{linear}.{kind}{j}"
        for local, te in local_to_te_prefixes(moe):
            if local_name.startswith(local):
                return te + local_name[len(local):]
    return local_name


def local_layer_param_name(name: str, scheme: Scheme, moe: bool = False) -> str:
    """Inverse of :func:`layer_param_name`: the local-scheme name of a layer-relative ``name``."""
    _check(scheme)
    if scheme == "te":
        expert = _TE_EXPERT.match(name) if moe else None
        if expert:
            linear, kind, j = expert.groups()
            return f"mlp.experts.local_experts.{j}.{linear}.{kind}"
        for local, te in local_to_te_prefixes(moe):
            if name.startswith(te):
                return local + name[len(te):]
    return name


def model_param_name(name: str, scheme: Scheme, *, to: Scheme, moe: bool = False) -> str:
    """Rename a full model parameter name (``decoder.layers.N.<layer name>`` or any other) from
    ``scheme`` to scheme ``to``; names outside the layers are the same in both."""
    head, sep, rest = name.partition("decoder.layers.")
    if not sep:
        return name
    index, dot, inner = rest.partition(".")
    if not dot or not index.isdigit():
        return name
    local = local_layer_param_name(inner, scheme, moe)
    return f"{head}{sep}{index}.{layer_param_name(local, to, moe)}"
