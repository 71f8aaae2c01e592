"""Multi-turn trajectories in the Megatron policy (single rank, gloo): a tool's observation tokens are
never trained on.

A gradient probe on the loss function's log-probs (a hook on the very tensor the objective reads)
sees exactly zero at every observation position and a non-zero gradient at every model token; the
same batch without its loss mask does reach those positions (the probe can fail). The parameter
gradients equal float64 transformers' gradient of the loss over the model's tokens alone, and the
recomputed log-probs equal transformers' teacher-forced pass over the whole interleaved sequence.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.slow

TEMPERATURE = 0.9


def _batch(vocab: int, with_mask: bool = True):
    """Two trajectories: prompt, model turn, observation, model turn (another: a longer observation)."""
    from megatron_rl.models.batch import LOSS_MASK, SequenceBatch

    g = torch.Generator().manual_seed(5)
    rows = [(6, [5, 4, 7]), (4, [3, 9, 2, 6])]  # (prompt, [model, obs, model, (obs)])
    seqs, plens, masks = [], [], []
    for prompt, parts in rows:
        seq = torch.randint(3, vocab, (prompt + sum(parts),), generator=g).tolist()
        mask = []
        for k, n in enumerate(parts):
            mask += [k % 2 == 0] * n
        seqs.append(seq)
        plens.append(prompt)
        masks.append(torch.tensor(mask))
    fields = {"rollout_logp": [torch.zeros(len(m)) for m in masks]}
    if with_mask:
        fields[LOSS_MASK] = masks
    return SequenceBatch(sequences=seqs, prompt_lens=plens, token_fields=fields,
                         seq_fields={"advantages": torch.tensor([1.0, -0.5])}), masks


def _probed(batch, cfg):
    """The trainer's loss function, with a gradient probe on the log-probs it reads."""
    from megatron_rl.trainer import phases

    loss_fn = phases.make_loss_fn(batch, cfg, alpha=0.0, max_response_len=None)
    grads = {}

    def probed(mb):
        mb.logp.register_hook(lambda g, index=mb.index.tolist(): grads.update(
            {i: g[r].detach().clone() for r, i in enumerate(index)}))
        return loss_fn(mb)

    return probed, grads


def test_multi_turn_observation_tokens_get_no_gradient_and_logprobs_match_transformers(tiny_llama, groups):
    from transformers import AutoModelForCausalLM

    from megatron_rl.algo.config import AlgoConfig
    from megatron_rl.models import OptimConfig, PolicyConfig
    from megatron_rl.models.policy import MegatronPolicy

    cfg = PolicyConfig(micro_batch_tokens=64, optim=OptimConfig(lr=1e-3, clip_grad=0.0))
    policy = MegatronPolicy.from_hf(tiny_llama, cfg, groups)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64).eval()
    vocab = hf.config.vocab_size
    algo = AlgoConfig()
    batch, masks = _batch(vocab)

    # the recomputed log-probs: transformers' teacher-forced pass over the interleaved sequences
    logps, _ = policy.compute_logprobs(batch, TEMPERATURE, with_entropy=False)
    ref = []
    for seq, p in zip(batch.sequences, batch.prompt_lens):
        logits = hf(torch.tensor([seq])).logits[0] / TEMPERATURE
        ref.append(torch.log_softmax(logits, -1)[p - 1:-1].gather(1, torch.tensor(seq[p:])[:, None])[:, 0])
    for lp, r in zip(logps, ref):
        assert float((lp.double() - r.detach()).abs().max()) < 2e-5

    # the parameter gradients: float64 transformers' gradient of the loss over model tokens alone
    # (strictly on-policy, ratio 1: -sum_seq A * sum_model_tokens logp / model tokens)
    hf.zero_grad()
    n_model = sum(int(m.sum()) for m in masks)
    loss = sum(-a * r[m].sum() for a, r, m in zip(batch.seq_fields["advantages"].double(), ref, masks)) / n_model
    loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}

    probed, grads = _probed(batch, algo)
    policy.train_step(batch, probed, TEMPERATURE, with_entropy=True)
    for i, mask in enumerate(masks):
        g = grads[i][: len(mask)]
        assert torch.all(g[~mask] == 0), f"sequence {i}: an observation token got a gradient {g[~mask]}"
        assert torch.all(g[mask] != 0), f"sequence {i}: a model token got no gradient"
    got = dict(policy.export_hf_grads())
    for name, want in ref_grads.items():
        scale = float(want.abs().max())
        assert float((got[name].double() - want).abs().max()) <= 1e-4 * scale + 1e-9, name

    # the probe can fail: without the loss mask the observation positions are trained on
    plain, _ = _batch(vocab, with_mask=False)
    probed, grads = _probed(plain, dataclasses.replace(algo))
    policy.train_step(plain, probed, TEMPERATURE, with_entropy=True)
    assert all(bool((grads[i][: len(m)][~m] != 0).any()) for i, m in enumerate(masks))
