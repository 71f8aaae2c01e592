"""Core attention on torch's ``scaled_dot_product_attention`` for Megatron's local layer spec.

Megatron's ``DotProductAttention`` (the local spec's core attention) forms the ``[b, heads, sq, sk]``
score matrix and its softmax copy: at 32k tokens that is 1.07e9 scores per head and sequence.
:class:`SDPAttention` takes its place through the layer spec (``core_attention``) and computes the
same function with torch's fused kernels (flash / memory-efficient on GPUs, the flash CPU kernel
here), which never hold the scores.

Contract and numerics are those of ``DotProductAttention`` (its torch-softmax path, the one used
whenever the fused CUDA softmax is not):

* inputs ``query [sq, b, np, hn]``, ``key`` / ``value [sk, b, ng, hn]`` (this rank's heads), output
  ``[sq, b, np * hn]``; query head ``i`` reads key/value group ``i // (np / ng)`` (GQA);
* scale ``config.softmax_scale`` or ``1 / sqrt(hn)`` (``apply_query_key_layer_scaling`` divides and
  multiplies by the same coefficient there, so it cancels);
* masks: a given ``attention_mask`` (bool, True = masked out, broadcastable to
  ``[b, np, sq, sk]``) is the whole mask, as in Megatron, whose torch path does not add the causal
  mask to a given one; without one, a causal layer with ``sq > 1`` is causal (key ``j`` visible to
  query ``i`` iff ``j <= i``) and anything else is unmasked. A query row whose keys are all masked
  attends uniformly to every key (Megatron fills masked scores with -10000, so such a row's softmax
  is uniform): its output is the mean of the values;
* attention dropout on the probabilities under the model-parallel RNG tracker, like Megatron's
  (the same distribution, not the same random draws).

With context parallelism (the ``cp`` group of ``pg_collection`` larger than 1), every rank holds two
of the sequence's 2·CP load-balanced chunks; the attention over the whole sequence is
:func:`megatron_rl.models.context_parallel.context_parallel_attention` (all-gather of K/V over the
CP group). That path supports the causal layer without an explicit mask and without dropout.

Packed sequences (``packed_seq_params`` with ``qkv_format="thd"``, ``models/packing.py``): inputs
``[t, np, hn]`` / ``[t, ng, hn]``, output ``[t, np * hn]``; causal attention within each sequence of
``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) — :func:`megatron_rl.models.packing.packed_causal_attention`,
or with CP the same all-gather attention, sequence by sequence.

Not supported, refused at construction: ``softmax_type`` other than ``vanilla``, sliding-window
attention; at call time: attention biases (neither does ``DotProductAttention``), and packed
sequences with an explicit mask or a non-causal layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_rl.models.context_parallel import context_parallel_attention
from megatron_rl.models.packing import packed_causal_attention


def _megatron_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SDPAttention(_megatron_base()):
    """Drop-in ``core_attention`` for Megatron's ``SelfAttention`` (see the module doc)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        from megatron.core.transformer.utils import is_layer_window_attention
        from megatron.core.utils import divide

        super().__init__(config=config)
        if pg_collection is None or not hasattr(pg_collection, "tp"):
            raise ValueError("SDPAttention needs the pg_collection (with tp and cp groups) that "
                             "Megatron's SelfAttention passes to its core attention")
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type={config.softmax_type!r} is not supported "
                             f"(only 'vanilla')")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            raise ValueError("SDPAttention: sliding-window attention is not supported")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = divide(config.kv_channels * config.num_attention_heads,
                               config.num_attention_heads)
        self.softmax_scale = (1.0 / math.sqrt(self.head_dim) if softmax_scale is None
                              else float(softmax_scale))
        self.dropout_p = float(config.attention_dropout if attention_dropout is None
                               else attention_dropout)
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        if self.cp_size > 1 and self.dropout_p > 0:
            raise ValueError("SDPAttention: attention dropout is not supported with context "
                             "parallelism")

    def _causal(self) -> bool:
        from megatron.core.transformer.enums import AttnMaskType

        return self.attn_mask_type == AttnMaskType.causal

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """``[sq, b, np, hn]`` x ``[sk, b, ng, hn]`` -> ``[sq, b, np * hn]``."""
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention biases")
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, attention_mask, packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.cp_size > 1:
            if attention_mask is not None or not self._causal():
                raise ValueError("SDPAttention with context parallelism supports only the causal "
                                 "layer without an explicit attention mask")
            out = context_parallel_attention(q, k, v, self.cp_group, self.softmax_scale)
        else:
            out = self._attend(q, k, v, attention_mask, sq)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def _forward_packed(self, query, key, value, attention_mask, params):
        """``[t, np, hn]`` x ``[t, ng, hn]`` -> ``[t, np * hn]``, causal within each sequence."""
        from megatron.core import tensor_parallel

        if params.qkv_format != "thd" or attention_mask is not None or not self._causal():
            raise ValueError(f"SDPAttention: packed sequences need qkv_format 'thd' (got "
                             f"{params.qkv_format!r}), the causal layer and no attention mask")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
            else params.cu_seqlens_q
        bounds = [int(x) for x in cu.tolist()]
        t = query.shape[0]
        if self.cp_size > 1:
            # [t, h, d] -> [1, h, t, d]: one row of packed sequences, each split over the CP group
            q, k, v = (x.permute(1, 0, 2)[None] for x in (query, key, value))
            out = context_parallel_attention(q, k, v, self.cp_group, self.softmax_scale,
                                             bounds=bounds)[0].permute(1, 0, 2)
        else:
            dropout = self.dropout_p if self.training else 0.0

            def attend():
                return packed_causal_attention(query, key, value, bounds, self.softmax_scale,
                                               dropout)

            if dropout > 0 and not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    out = attend()
            else:
                out = attend()
        return out.reshape(t, self.heads * self.head_dim)

    def _attend(self, q, k, v, attention_mask, sq: int):
        from megatron.core import tensor_parallel

        dropout = self.dropout_p if self.training else 0.0
        gqa = self.heads != self.groups
        mask, fully_masked = None, None
        if attention_mask is not None:
            keep = ~attention_mask.to(torch.bool)
            fully_masked = ~keep.any(dim=-1, keepdim=True)  # [.., sq, 1]
            if bool(fully_masked.any()):
                keep = keep | fully_masked  # any finite row; replaced by the mean below
            else:
                fully_masked = None
            mask = keep
        is_causal = mask is None and self._causal() and sq > 1

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=is_causal, scale=self.softmax_scale,
                                                  enable_gqa=gqa)

        if dropout > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attend()
        else:
            out = attend()
        if fully_masked is not None:
            vv = v.repeat_interleave(self.heads // self.groups, dim=1) if gqa else v
            out = torch.where(fully_masked, vv.mean(dim=-2, keepdim=True).to(out.dtype), out)
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """No parameters (``softmax_type`` is vanilla), so nothing to checkpoint."""
        return {}
