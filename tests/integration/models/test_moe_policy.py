"""The Mixture-of-Experts policy in one process (EP = 1, gloo): Qwen3-MoE and Qwen2-MoE (gated shared
expert, top-k not renormalised) against float64 transformers.

Per architecture, one policy: HF -> Megatron -> HF bit-exact; the final hidden states and (through
the fused log-prob path) the response log-probs and entropies; one training step whose objective
holds the load-balancing and z-losses (coefficients 0.05 / 0.01, far above the HF default, so that
they move the gradients): every gradient against the float64 objective computed from transformers'
router logits over the same micro-batches, the logged ``moe/*`` metrics against the same numbers.
Tolerances: log-probs, entropies, hidden states 2e-5 absolute; gradients 1e-5 x the tensor's
largest entry; metrics 1e-6 relative (loads: exact counts).
"""

from __future__ import annotations

import pytest
import torch

from moe_testlib import hf_hidden_states, moe_reference
from policy_testlib import load_hf_float64, make_batch, make_loss_fn, max_abs_diff, write_hf_moe_model

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7
LENGTHS, PROMPTS = [12, 7, 20, 5, 16, 9], [4, 3, 9, 2, 1, 8]
AUX, ZLOSS = 0.05, 0.01
HIDDEN_IDS = [[5, 17, 33, 2, 40, 11, 9, 28, 3, 50], [7, 7, 21, 44, 13, 0, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def results(tmp_path_factory, groups):
    from safetensors.torch import load_file

    from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig
    from megatron_rl.models.config import MoEConfig
    from megatron_rl.models.micro_batches import MicroInputs
    from megatron_rl.models.moe_signals import padding_mask
    from megatron_rl.models.policy import MegatronPolicy

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for arch in ("qwen3_moe", "qwen2_moe"):
        hf = write_hf_moe_model(root / arch, arch)
        cfg = PolicyConfig(parallel=ParallelConfig(), micro_batch_tokens=48, layer_spec="local",
                           optim=OptimConfig(lr=1e-3, clip_grad=0.0),
                           moe=MoEConfig(aux_loss_coef=AUX, z_loss_coef=ZLOSS))
        policy = MegatronPolicy.from_hf(str(hf), cfg, groups)
        exported = {n: t.clone() for n, t in policy.export_hf_weights()}
        batch = make_batch(LENGTHS, PROMPTS)
        logps, ents = policy.compute_logprobs(batch, TEMPERATURE)
        ids = torch.tensor(HIDDEN_IDS)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        mb = MicroInputs(index=[0, 1], input_ids=ids, position_ids=pos, pos_s=None, pos_b=None, row=None,
                         col=None, labels=None, mask=None, width=0, seq_len=ids.shape[1],
                         padding_mask=ids.new_zeros(ids.shape, dtype=torch.bool))
        chunk = policy.model[0].module
        with torch.no_grad():
            chunk.eval()
            hidden = chunk(ids, pos, None, padding_mask=padding_mask(mb, chunk, groups))
            chunk.train()
        micro = [m.index for m in policy._micro_batches(batch)]
        metrics = policy.train_step(batch, make_loss_fn(batch), TEMPERATURE, with_entropy=True)
        grads = {n: t.clone() for n, t in policy.export_hf_grads()}
        out[arch] = {"hf": hf, "original": load_file(str(hf / "model.safetensors")),
                     "exported": exported, "logps": logps, "ents": ents, "metrics": metrics,
                     "hidden": hidden.transpose(0, 1), "grads": grads, "micro": micro,
                     "ref": moe_reference(hf, batch, TEMPERATURE, micro, AUX, ZLOSS)}
    return out


ARCHS = ["qwen3_moe", "qwen2_moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_hf_round_trip_is_bit_exact(arch, results):
    r = results[arch]
    assert set(r["exported"]) == set(r["original"])
    for name, tensor in r["original"].items():
        assert r["exported"][name].dtype == tensor.dtype and torch.equal(r["exported"][name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_logprobs_and_hidden_states_match_transformers(arch, results):
    r = results[arch]
    assert max_abs_diff(r["logps"], r["ref"]["logps"]) < 2e-5
    assert max_abs_diff(r["ents"], r["ref"]["ents"]) < 2e-5
    ref_hidden = hf_hidden_states(r["hf"], HIDDEN_IDS)
    assert float((r["hidden"].double() - ref_hidden).abs().max()) < 2e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_gradients_hold_the_aux_and_z_losses(arch, results):
    r = results[arch]
    assert len(r["micro"]) > 1  # the mean over micro-batches is exercised
    ref = r["ref"]
    assert r["metrics"]["loss"] == pytest.approx(ref["policy_loss"], abs=1e-5)
    assert set(r["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        err = float((r["grads"][name].double() - g).abs().max())
        assert err <= 1e-5 * float(g.abs().max()), (name, err)
    # the router's gradient is mostly the auxiliary losses' at these coefficients: a wrong scale
    # (e.g. Megatron's per-token scaling) is far outside the tolerance above
    router = "model.layers.0.mlp.gate.weight"
    assert float(r["grads"][router].abs().max()) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_metrics_match_the_reference(arch, results):
    r, ref = results[arch], results[arch]["ref"]
    m = r["metrics"]
    assert m["moe/aux_loss"] == pytest.approx(ref["aux"], rel=1e-6)
    assert m["moe/z_loss"] == pytest.approx(ref["z"], rel=1e-6)
    for layer, counts in enumerate(ref["counts"]):
        share = counts / counts.sum()
        assert m[f"moe/load_max/layer_{layer}"] == pytest.approx(float(share.max()), abs=1e-12)
        assert m[f"moe/load_min/layer_{layer}"] == pytest.approx(float(share.min()), abs=1e-12)


def test_moe_trained_policy_is_freed(tmp_path, groups):
    """A MoE policy after a training step is garbage, with its process groups' threads (Megatron's
    dispatcher kept its last ``probs``, whose graph closes a cycle through DDP's gradient hooks:
    compat.megatron_fixes)."""
    import gc
    import weakref

    from megatron_rl.models import ParallelConfig, PolicyConfig
    from megatron_rl.models.policy import MegatronPolicy

    hf = write_hf_moe_model(tmp_path / "m", "qwen3_moe")

    def step():
        policy = MegatronPolicy.from_hf(str(hf), PolicyConfig(parallel=ParallelConfig()), groups)
        batch = make_batch(LENGTHS[:2], PROMPTS[:2])
        policy.train_step(batch, make_loss_fn(batch), 1.0, with_entropy=True)
        return weakref.ref(policy.optimizer), weakref.ref(policy.model[0].module)

    refs = step()
    gc.collect()
    assert all(r() is None for r in refs)


def test_moe_recompute_keeps_the_objective_and_metrics(results, groups):
    """With full activation recomputation every router runs twice per micro-batch, the first time
    without autograd: the objective (gradients) and the metrics are the run's without it."""
    from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig, RecomputeConfig
    from megatron_rl.models.config import MoEConfig
    from megatron_rl.models.policy import MegatronPolicy

    r = results["qwen3_moe"]
    recompute = RecomputeConfig(granularity="full")
    cfg = PolicyConfig(parallel=ParallelConfig(), micro_batch_tokens=48, layer_spec="local",
                       optim=OptimConfig(lr=1e-3, clip_grad=0.0), recompute=recompute,
                       moe=MoEConfig(aux_loss_coef=AUX, z_loss_coef=ZLOSS))
    policy = MegatronPolicy.from_hf(str(r["hf"]), cfg, groups)
    batch = make_batch(LENGTHS, PROMPTS)
    calls = []
    for layer in policy.model[0].module.decoder.layers:
        layer.mlp.router.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    metrics = policy.train_step(batch, make_loss_fn(batch), TEMPERATURE, with_entropy=True)
    assert len(calls) == 2 * sum(calls) > 0  # each router ran twice, once with autograd
    grads = {n: t for n, t in policy.export_hf_grads()}
    for name, g in r["grads"].items():
        assert torch.allclose(grads[name], g, rtol=1e-6, atol=1e-7), name
    for key, value in r["metrics"].items():
        if key.startswith("moe/"):
            assert metrics[key] == pytest.approx(value, rel=1e-9), key


def test_moe_packed_equals_padded_logprobs_step_and_routing_replay(results, groups):
    """Qwen3-MoE at EP1, ``policy.packed_sequences`` on and off, the same weights.

    Log-probs, entropies, the routes a pass records and, replaying other routes (every recorded
    expert moved by one), the routes actually taken and the log-probs: packed = padded, with
    micro-batches that group the sequences differently (budget 48: padded {20, 16} {12, 9, 7, 5},
    packed {20, 9, 5} {16, 12, 7}), and the replayed log-probs are float64 transformers' with those
    experts forced. One training step with every sequence in one micro-batch in both layouts (the
    aux and z-losses are per micro-batch): the loss, aux / z-losses, per-layer expert load, every
    gradient and the updated weights. Tolerances: log-probs 5e-6 between the layouts (2e-5 from
    transformers), losses 1e-6 relative, gradients 1e-5 x the tensor's largest entry, weights 2e-5,
    routes exact."""
    from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig
    from megatron_rl.models.config import MoEConfig
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.routing_replay import Routes
    from tests.integration.rollout.routes_ref import forced_logprobs

    hf = results["qwen3_moe"]["hf"]
    batch = make_batch(LENGTHS, PROMPTS)
    got = {}
    for packed in (True, False):
        cfg = PolicyConfig(parallel=ParallelConfig(), micro_batch_tokens=48, layer_spec="local",
                           packed_sequences=packed, optim=OptimConfig(lr=1e-3, clip_grad=0.0),
                           moe=MoEConfig(aux_loss_coef=AUX, z_loss_coef=ZLOSS))
        policy = MegatronPolicy.from_hf(str(hf), cfg, groups)
        micro = policy._micro_batches(batch)
        assert len(micro) == 2 and all(mb.layout.packed == packed for mb in micro)
        free = Routes(record=True)
        logps, ents = policy.compute_logprobs(batch, TEMPERATURE, routes=free)
        forced = [(r.long() + 1) % 4 for r in free.recorded]
        again = Routes(replay=forced, record=True)
        replayed, _ = policy.compute_logprobs(batch, TEMPERATURE, with_entropy=False, routes=again)
        policy.cfg.micro_batch_tokens = 256  # the step: one micro-batch in both layouts
        assert [mb.index for mb in policy._micro_batches(batch)] == [[2, 4, 0, 5, 1, 3]]
        metrics = policy.train_step(batch, make_loss_fn(batch), TEMPERATURE, with_entropy=True)
        got[packed] = {"micro": [mb.index for mb in micro], "logps": logps, "ents": ents,
                       "recorded": free.recorded, "forced": forced, "replayed": again.recorded,
                       "replay_logps": replayed, "metrics": metrics,
                       "grads": {n: t.clone() for n, t in policy.export_hf_grads()},
                       "weights": {n: t.clone() for n, t in policy.export_hf_weights()}}
    a, b = got[True], got[False]
    assert a["micro"] != b["micro"]  # the replay's rows differ between the layouts, not only in shape
    assert max_abs_diff(a["logps"], b["logps"]) < 5e-6
    assert max_abs_diff(a["ents"], b["ents"]) < 5e-6
    assert all(torch.equal(x, y) for x, y in zip(a["recorded"], b["recorded"]))
    for r in (a, b):
        assert all(torch.equal(x.long(), f) for x, f in zip(r["replayed"], r["forced"]))
    assert max_abs_diff(a["replay_logps"], b["replay_logps"]) < 5e-6
    hf64 = load_hf_float64(hf)
    ref = [forced_logprobs(hf64, s, p, f.numpy(), TEMPERATURE)
           for s, p, f in zip(batch.sequences, batch.prompt_lens, a["forced"])]
    assert max_abs_diff(a["replay_logps"], ref) < 2e-5
    assert max_abs_diff(a["replay_logps"], a["logps"]) > 1e-2  # the forced experts matter
    m, n = a["metrics"], b["metrics"]
    for key in ("loss", "moe/aux_loss", "moe/z_loss", "grad_norm"):
        assert m[key] == pytest.approx(n[key], rel=1e-6), key
    loads = [k for k in n if k.startswith("moe/load_")]
    assert len(loads) == 4 and all(m[k] == pytest.approx(n[k], abs=1e-12) for k in loads)
    for name, g in b["grads"].items():
        err = float((a["grads"][name].double() - g.double()).abs().max())
        assert err <= 1e-5 * float(g.abs().max()), (name, err)
    assert max(float((a["weights"][k] - w).abs().max()) for k, w in b["weights"].items()) < 2e-5
