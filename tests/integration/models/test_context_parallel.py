"""Context parallelism under torchrun (gloo, 4 ranks), against the CP=1 run and transformers.

One ``torchrun --nproc-per-node 4`` launch (cp_worker.py's cases, with policy_worker.py's:
parallel_worker.py, the ``parallel_run`` fixture) runs every layout: CP=2 (x DP 2), CP=4,
CP=2 x TP=2 (with and without sequence parallelism), CP=2 x PP=2 (also interleaved, VPP=2), the
distributed optimizer, full recomputation, a sparse batch (a stand-in micro-batch, a CP rank with no
response token), tied embeddings + qkv bias (Qwen2) and q/k norms (Qwen3), and a checkpoint saved
at CP=2 x TP=2 and loaded at CP=1. Sequence lengths are odd (padding to 2·CP), several micro-batches.

Tolerances (fp32): log-probs and entropy 3e-6 absolute vs CP=1 (observed ~1e-6) and 2e-5 vs float64
transformers; summed loss 1e-6; gradients (summed over DP x CP) 1e-5 x the tensor's largest entry
(observed ~1.5e-6); weights after one Adam step (lr 1e-3) 1e-4 (Adam's first step is ~lr x sign, so
summation-order noise on near-zero gradients shows at up to ~3e-5).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from policy_testlib import hf_reference, make_batch, max_abs_diff

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
LLAMA = ["cp2", "cp4", "cp2_tp2", "cp2_tp2_sp", "cp2_pp2", "cp2_pp2_vpp2", "cp2_distopt",
         "cp2_recompute"]
OTHER = {"qwen2_cp2_pp2": "qwen2_cp1", "qwen3_cp2_tp2": "qwen3_cp1", "sparse_cp2": "sparse_cp1"}


@pytest.fixture(scope="module")
def run(parallel_run):
    hf, out = parallel_run["hf"], parallel_run["out"] / "cp"  # (one launch with the policy cases)
    sys.path.insert(0, str(HERE))
    import cp_worker

    return {"hf": hf, "worker": cp_worker,
            "load": lambda case: torch.load(out / f"{case}.pt", weights_only=False)}


def _max_rel_grad_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n].double() - b[n].double()).abs().max()
                     / b[n].double().abs().max().clamp(min=1e-30)) for n in a)


def _max_weight_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


@pytest.mark.parametrize("case", LLAMA + list(OTHER))
def test_context_parallel_equals_cp1(case, run):
    base = run["load"](OTHER.get(case, "cp1"))
    got = run["load"](case)
    assert [t.shape for t in got["logps"]] == [t.shape for t in base["logps"]]
    assert max_abs_diff(got["logps"], base["logps"]) < 3e-6
    assert max_abs_diff(got["ents"], base["ents"]) < 3e-6
    m, mb = got["metrics"], base["metrics"]
    assert m["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    assert m["tokens"] == mb["tokens"]  # counted once per CP group, not once per CP rank
    for name in ("logp", "ent"):  # per-sequence values of the training forward, once per group
        a, b = got["per_seq"][name], base["per_seq"][name]
        assert torch.equal(a.isnan(), b.isnan())
        assert float((a - b).nan_to_num().abs().max()) < 3e-6
    assert m["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    if got["grads"] is not None:  # not exported with the distributed optimizer
        assert _max_rel_grad_diff(got["grads"], base["grads"]) < 1e-5
    assert _max_weight_diff(got["weights"], base["weights"]) < 1e-4


def test_recomputation_is_exact(run):
    """Full (block, 2 layers) and selective (core_attn + mlp) recomputation against none: the same
    log-probs, gradients and step, bit for bit at the same layout; also full (uniform) at CP=2."""
    base = run["load"]("cp1")
    same = lambda a, b: set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
    # recomputation really ran: rank 0's MLP forwards in the step (4 layers per micro-batch)
    micro = base["mlp_calls"] // 4
    assert base["mlp_calls"] == 4 * micro and micro >= 1
    assert run["load"]("recompute_block")["mlp_calls"] == (4 + 2) * micro  # first 2 layers again
    assert run["load"]("recompute_selective")["mlp_calls"] == 8 * micro  # every MLP again
    cp2_micro = run["load"]("cp2")["mlp_calls"] // 4
    assert run["load"]("cp2_recompute")["mlp_calls"] == 8 * cp2_micro  # uniform, 1 layer a unit
    for case in ("recompute_block", "recompute_selective"):
        got = run["load"](case)
        assert all(torch.equal(a, b) for a, b in zip(got["logps"], base["logps"]))
        assert same(got["grads"], base["grads"]) and same(got["weights"], base["weights"])
    cp2, cp2_rc = run["load"]("cp2"), run["load"]("cp2_recompute")
    assert same(cp2_rc["grads"], cp2["grads"]) and same(cp2_rc["weights"], cp2["weights"])


def test_context_parallel_cp1_matches_transformers(run):
    """The CP=1 reference itself is right (float64 transformers), and the step really moved."""
    w = run["worker"]
    for case, arch, lengths, prompts in (("cp1", "llama", w.LENGTHS, w.PROMPTS),
                                         ("sparse_cp1", "llama", w.SPARSE_LENGTHS,
                                          w.SPARSE_PROMPTS),
                                         ("qwen3_cp1", "qwen3", w.LENGTHS, w.PROMPTS)):
        batch = make_batch(lengths, prompts)
        ref_logps, ref_ents, ref_loss, _ = hf_reference(run["hf"] / arch, batch, w.TEMPERATURE,
                                                        grads=False)
        got = run["load"](case)
        assert max_abs_diff(got["logps"], ref_logps) < 2e-5
        assert max_abs_diff(got["ents"], ref_ents) < 2e-5
        assert got["metrics"]["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert _max_weight_diff(run["load"]("cp2")["weights"], run["load"]("cp1")["weights"]) < 1e-4
    from safetensors.torch import load_file

    original = load_file(str(run["hf"] / "llama" / "model.safetensors"))
    assert _max_weight_diff(run["load"]("cp2")["weights"], original) > 5e-4


def test_context_parallel_checkpoint_loads_at_cp1(run):
    ck = run["load"]("checkpoint")
    assert set(ck["step1"]) == set(ck["b_loaded"])
    assert all(torch.equal(ck["step1"][n], ck["b_loaded"][n]) for n in ck["step1"])
    # the optimizer state came along: the next step agrees across layouts
    assert _max_weight_diff(ck["a_step2"], ck["b_step2"]) < 1e-6
    assert _max_weight_diff(ck["a_step2"], ck["step1"]) > 5e-4


def test_no_hang_a_collective_one_rank_skips_ends_at_its_timeout_naming_it(run, parallel_run):
    """Rank 0 waited for a broadcast rank 1 never joined (a 2 s group timeout): the wait ended with
    an error naming the collective, where it was called and the timeout, not a hang."""
    import json

    got = json.loads((parallel_run["out"] / "cp" / "collective_timeout.json").read_text())
    msg = got["message"]
    assert msg and got["seconds"] < 30, got
    assert msg.startswith("rank 0: the test's broadcast that rank 1 skips in run_collective_timeout (cp_worker.py:")
    assert "policy.parallel.timeout_s=2s" in msg and "another rank died, hung, or waits in another collective" in msg
    # ... and rank 0's input error is raised on every rank (trainer.context.raise_agreed)
    said = {f.name: f.read_text() for f in (parallel_run["out"] / "cp").glob("agreed_rank*.txt")}
    assert len(said) == 4 and set(said.values()) == {"InputError: rank 0's planted input error"}, said
