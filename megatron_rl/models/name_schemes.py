"""The two parameter-name schemes of a Megatron GPT layer: local spec and Transformer Engine spec.

The local spec (``get_gpt_layer_local_spec``) has separate norm modules; the Transformer Engine
spec (``get_gpt_layer_with_transformer_engine_spec``) folds each pre-norm into the linear layer
after it (``TELayerNormColumnParallelLinear``), so the norm weights live under that linear as
``layer_norm_weight``::

    local                                          te
    decoder.layers.N.input_layernorm.weight        decoder.layers.N.self_attention.linear_qkv.layer_norm_weight
    decoder.layers.N.pre_mlp_layernorm.weight      decoder.layers.N.mlp.linear_fc1.layer_norm_weight

Every other parameter has the same name, shape and layout in both. The correspondence is not ours:
it is the ``sharded_state_dict_keys_map`` of Megatron's local layer spec (under which the local
spec's distributed checkpoints store its norms with the TE names); :func:`local_to_te_prefixes`
reads it from there.
"""

from __future__ import annotations

import functools
from typing import Literal

Scheme = Literal["local", "te"]
SCHEMES: tuple[str, ...] = ("local", "te")


@functools.lru_cache(maxsize=1)
def local_to_te_prefixes() -> tuple[tuple[str, str], ...]:
    """(local prefix, TE prefix) pairs of a layer's parameter names, from Megatron's local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    keys_map = spec.submodules.sharded_state_dict_keys_map
    if not keys_map:
        raise RuntimeError("Megatron's local layer spec declares no sharded_state_dict_keys_map: "
                           "cannot derive the Transformer Engine parameter names")
    return tuple(sorted(keys_map.items()))


def _check(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown parameter-name scheme {scheme!r}; known: {list(SCHEMES)}")


def layer_param_name(local_name: str, scheme: Scheme) -> str:
    """A layer-relative parameter name (e.g. ``input_layernorm.weight``) in ``scheme``."""
    _check(scheme)
    if scheme == "te":
        for local, te in local_to_te_prefixes():
            if local_name.startswith(local):
                return te + local_name[len(local):]
    return local_name


def local_layer_param_name(name: str, scheme: Scheme) -> str:
    """Inverse of :func:`layer_param_name`: the local-scheme name of a layer-relative ``name``."""
    _check(scheme)
    if scheme == "te":
        for local, te in local_to_te_prefixes():
            if name.startswith(te):
                return local + name[len(te):]
    return name


def model_param_name(name: str, scheme: Scheme, *, to: Scheme) -> str:
    """Rename a full model parameter name (``decoder.layers.N.<layer name>`` or any other) from
    ``scheme`` to scheme ``to``; names outside the layers are the same in both."""
    head, sep, rest = name.partition("decoder.layers.")
    if not sep:
        return name
    index, dot, inner = rest.partition(".")
    if not dot or not index.isdigit():
        return name
    return f"{head}{sep}{index}.{layer_param_name(local_layer_param_name(inner, scheme), to)}"
