"""``sync.verify``'s functional check (``trainer.evaluate.verify_probe``), on pure-logic fakes.

Behaviour checked, whatever the engine or transport: after a sync every engine scores the fixed
probe sequence (teacher-forced log-probs, ``engine.score``) and the trainer compares them with its
own log-probs of the same tokens. An engine that reports the new weights but computes with other
ones (a stale output layer, a cache, a tensor never sent) fails the sync, named, with the gap; a
faithful engine passes and the gap is logged (``sync/probe_gap_mean``, ``sync/probe_gap_max``).
The probe fits the engines' context (prompt + longest response, one token left to sample).
The real-engine side: ``tests/integration/rollout/test_vllm_engine.py`` (a tied model at TP 1 / 2)
and the e2e miniature on a tied model (``tests/e2e/test_grpo_pipeline.py``), whose every sync
passes this check.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.sync import probe
from megatron_rl.sync.base import SyncMismatch
from megatron_rl.trainer.evaluate import verify_probe
from megatron_rl.trainer.schema import load_run_config

V = 50


def _logp(theta: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """float64 bigram reference: log p(tokens[i] | tokens[i-1])."""
    lsm = torch.log_softmax(theta.double()[torch.tensor(tokens[:-1])], -1)
    return lsm.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


class Policy:
    def __init__(self, theta):
        self.theta, self.arch = theta, SimpleNamespace(vocab_size=V)

    def compute_logprobs(self, batch, temperature, with_entropy=True):
        assert temperature == 1.0 and batch.prompt_lens == [1]
        return [_logp(self.theta, batch.sequences[0]).float()], None


class Engine:
    def __init__(self, name, theta):
        self.name, self.theta, self.scored = name, theta, []

    def score(self, token_ids):
        self.scored.append(list(token_ids))
        return _logp(self.theta, list(token_ids)).tolist()


def _ctx(engines, theta, *, prompt_len=16, response_len=8, tolerance="null"):
    cfg = load_run_config(None, ["rollout.dtype=float32", f"rollout.max_prompt_len={prompt_len}", f"sync.probe_tolerance={tolerance}",
                                 f"stages=[{{name: s, max_response_len: {response_len}, max_steps: 1}}]"],
                          validate=False)
    return SimpleNamespace(cfg=cfg, tokenizer=[0] * V, policy=Policy(theta), is_driver=True, engines=engines)


def test_a_faithful_engine_passes_and_the_gap_is_logged():
    theta = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    good = Engine("e0", theta.clone())
    m = verify_probe(_ctx([good], theta))
    assert m["sync/probe_gap_mean"] < 1e-6 and m["sync/probe_gap_max"] >= m["sync/probe_gap_mean"]
    assert good.scored == [probe.probe_tokens(V, 16 + 8 - 1)]  # fits the engine's context


def test_an_engine_computing_with_other_weights_fails_the_sync_named():
    theta = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    old = theta.clone()
    theta[:, 3] += 0.5  # the update changed one output column: a stale output layer misses it
    engines = [Engine("e0", theta.clone()), Engine("e1", old)]
    with pytest.raises(SyncMismatch, match=r"engine e1: after the sync its log-probs of the probe "
                                           r"sequence differ .* by [0-9.e-]+ on average"):
        verify_probe(_ctx(engines, theta, prompt_len=200, response_len=16))
    assert len(engines[1].scored[0]) == probe.PROBE_LEN  # longer than one 128-token KV block


def test_the_tolerance_is_the_configured_one_else_the_engine_dtypes():
    theta = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(V, V, generator=torch.Generator().manual_seed(1))
    off = Engine("e0", theta + 3e-3 * noise)  # a half-precision-sized gap
    with pytest.raises(SyncMismatch):
        verify_probe(_ctx([off], theta))  # fp32 engine default: 1e-4
    assert verify_probe(_ctx([off], theta, tolerance=1e-2))["sync/probe_gap_mean"] > 1e-4
    assert probe.default_tolerance("bfloat16") > probe.default_tolerance("float32")
