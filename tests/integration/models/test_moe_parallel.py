"""Mixture-of-Experts expert layouts under torchrun (4 ranks, gloo): EP 1 / 2 / 4, expert TP,
TP x EP, PP x EP, CP x EP with the distributed optimizer, Qwen2-MoE's shared expert at TP x EP,
HF round trips, checkpoints moving between EP 2 and EP 1 (and from EP 1 to EP 4 and expert TP 2 x EP 2).
Every layout runs packed (``policy.packed_sequences``); EP2, PP2 x EP2 and CP2 x EP2 also padded
(packed = padded: log-probs 5e-6, the step's expert load exactly; at EP2, where both group the
sequences alike, the loss, aux / z-losses and grad norm 1e-5 relative, gradients and weights as the
EP = 1 twins), and routing replay in both layouts (TP2 x EP2 too): recorded routes equal the padded
EP2 pass's exactly, replayed routes are routed exactly, log-probs 2e-5 from float64 transformers with
the same experts forced.

One ``torchrun`` launch runs every case (moe_worker.py, with the dense workers: parallel_worker.py,
the ``parallel_run`` fixture). Every layout against float64 transformers: log-probs and entropies
2e-5 absolute, hidden states 2e-5, every gradient of the objective (policy loss + 0.05 x the
load-balancing loss + 0.01 x the z-loss, each micro-batch's as its routers saw it) 1e-5 x the
tensor's largest entry, the ``moe/*`` metrics 1e-6 relative. Against the same layout at EP = 1 (the
same micro-batches): log-probs 5e-6, weights after one Adam step (lr 1e-3) 2e-5. Round trips and
checkpoint loads: bit-exact; the steps after a load 1e-6.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe_testlib import hf_hidden_states, moe_reference
from policy_testlib import load_hf_float64, make_batch, max_abs_diff

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
LAYOUTS = ["ep1", "ep2", "ep2_padded", "ep4", "etp2_ep2", "tp2_ep1", "tp2_ep2", "pp2_ep1", "pp2_ep2",
           "pp2_ep2_padded", "cp2_ep1", "cp2_ep2_distopt", "cp2_ep2_padded", "qwen2_tp2_ep2"]
TWINS = {"ep2": "ep1", "ep4": "ep1", "etp2_ep2": "ep1", "tp2_ep2": "tp2_ep1", "pp2_ep2": "pp2_ep1",
         "cp2_ep2_distopt": "cp2_ep1"}
# packed (the default) -> the same layout padded
PADDED = {"ep2": "ep2_padded", "pp2_ep2": "pp2_ep2_padded", "cp2_ep2_distopt": "cp2_ep2_padded"}
REPLAYED = ["ep2", "ep2_padded", "tp2_ep2", "pp2_ep2", "pp2_ep2_padded", "cp2_ep2_distopt", "cp2_ep2_padded"]


def _worker():
    sys.path.insert(0, str(HERE))
    import moe_worker

    return moe_worker


@pytest.fixture(scope="module")
def run(parallel_run):
    hf, out = parallel_run["hf"], parallel_run["out"] / "moe"
    worker = _worker()
    batch = make_batch(worker.LENGTHS, worker.PROMPTS)
    cache: dict = {}

    def load(case):
        if case not in cache:
            cache[case] = torch.load(out / f"{case}.pt", weights_only=False)
        return cache[case]

    refs: dict = {}

    def reference(case):
        got = load(case)
        arch = "qwen2_moe" if case.startswith("qwen2") else "qwen3_moe"
        key = (arch, tuple(map(tuple, got["micro"])))
        if key not in refs:
            refs[key] = moe_reference(hf / arch, batch, worker.TEMPERATURE, got["micro"],
                                      worker.AUX, worker.ZLOSS)
        return refs[key]

    forced: dict = {}

    def forced_reference(routes: list[torch.Tensor]) -> list[torch.Tensor]:
        """float64 transformers' log-probs of the batch with every MoE layer's experts forced."""
        from tests.integration.rollout.routes_ref import forced_logprobs

        key = tuple(r.numpy().tobytes() for r in routes)
        if key not in forced:
            if "hf" not in forced:
                forced["hf"] = load_hf_float64(hf / "qwen3_moe")
            forced[key] = [forced_logprobs(forced["hf"], s, p, r.numpy(), worker.TEMPERATURE)
                           for s, p, r in zip(batch.sequences, batch.prompt_lens, routes)]
        return forced[key]

    return {"hf": hf, "worker": worker, "load": load, "reference": reference, "batch": batch,
            "forced_reference": forced_reference}


def _loads(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("moe/load_")}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


@pytest.mark.parametrize("case", LAYOUTS)
def test_moe_layout_matches_transformers(case, run):
    got, ref = run["load"](case), run["reference"](case)
    assert max_abs_diff(got["logps"], ref["logps"]) < 2e-5
    assert max_abs_diff(got["ents"], ref["ents"]) < 2e-5
    m = got["metrics"]
    assert m["loss"] == pytest.approx(ref["policy_loss"], abs=1e-5)
    assert m["moe/aux_loss"] == pytest.approx(ref["aux"], rel=1e-6)
    assert m["moe/z_loss"] == pytest.approx(ref["z"], rel=1e-6)
    for layer, counts in enumerate(ref["counts"]):
        share = counts / counts.sum()
        assert m[f"moe/load_max/layer_{layer}"] == pytest.approx(float(share.max()), abs=1e-12)
        assert m[f"moe/load_min/layer_{layer}"] == pytest.approx(float(share.min()), abs=1e-12)
    if got["grads"] is not None:  # (not exported with the distributed optimizer)
        assert set(got["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            err = float((got["grads"][name].double() - g).abs().max())
            assert err <= 1e-5 * float(g.abs().max()), (name, err)


@pytest.mark.parametrize("case", ["ep1", "ep2", "etp2_ep2"])
def test_moe_hidden_states_match_transformers(case, run):
    got = run["load"](case)["hidden"]
    ref = hf_hidden_states(run["hf"] / "qwen3_moe", run["worker"].HIDDEN_IDS)
    assert float((got.double() - ref).abs().max()) < 2e-5


@pytest.mark.parametrize("case", sorted(TWINS))
def test_moe_update_matches_ep1(case, run):
    got, base = run["load"](case), run["load"](TWINS[case])
    assert max_abs_diff(got["logps"], base["logps"]) < 5e-6
    assert _max_diff(got["weights"], base["weights"]) < 2e-5
    assert got["metrics"]["grad_norm"] == pytest.approx(base["metrics"]["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("case", sorted(PADDED))
def test_moe_packed_equals_padded_at_expert_layouts(case, run):
    """The packed layout (policy.packed_sequences) against the same layout padded: log-probs, and
    the step's per-layer expert load (counts of the whole step, whatever the micro-batches); where
    both layouts group the sequences alike (EP2 at data parallel 4: one micro-batch per rank) the
    whole step too: loss, aux / z-losses, gradients and the updated weights."""
    packed, padded = run["load"](case), run["load"](PADDED[case])
    assert packed["packed"] and not padded["packed"]
    assert max_abs_diff(packed["logps"], padded["logps"]) < 5e-6
    assert max_abs_diff(packed["ents"], padded["ents"]) < 5e-6
    assert _loads(packed["metrics"]) == pytest.approx(_loads(padded["metrics"]), abs=1e-12)
    if case == "ep2":
        assert packed["micro"] == padded["micro"]
        m, n = packed["metrics"], padded["metrics"]
        for key in ("loss", "moe/aux_loss", "moe/z_loss", "grad_norm"):
            assert m[key] == pytest.approx(n[key], rel=1e-5), key
        for name, g in padded["grads"].items():
            err = float((packed["grads"][name].double() - g.double()).abs().max())
            assert err <= 1e-5 * float(g.abs().max()), (name, err)
        assert _max_diff(packed["weights"], padded["weights"]) < 2e-5


@pytest.mark.parametrize("case", REPLAYED)
def test_moe_routing_replay_packed_and_padded_at_expert_layouts(case, run):
    """Routing replay through either layout (TP2 x EP2 with sequence parallelism, PP2 x EP2, CP2 x
    EP2): the routes a pass records are the padded EP2 pass's (each token's own: the routers'
    choice does not depend on the layout), and replaying other routes (every expert moved by one)
    routes exactly through them and gives float64 transformers' log-probs with those experts
    forced."""
    got, base = run["load"](case)["routes"], run["load"]("ep2_padded")["routes"]
    same = [torch.equal(a, b) for a, b in zip(got["recorded"], base["recorded"])]
    assert all(same), f"{case}: recorded routes differ from the padded EP2 pass's in sequences {same}"
    for r, f in zip(got["replayed"], got["forced"]):
        assert torch.equal(r.long(), f), case
    assert max_abs_diff(got["logps"], run["forced_reference"](got["forced"])) < 2e-5
    # the forced experts matter: the log-probs moved far beyond the tolerance
    assert max_abs_diff(got["logps"], run["load"](case)["logps"]) > 1e-2


def test_moe_step_moved_the_weights(run):
    from safetensors.torch import load_file

    original = load_file(str(run["hf"] / "qwen3_moe" / "model.safetensors"))
    assert _max_diff(run["load"]("ep2")["weights"], original) > 5e-4


def test_moe_hf_round_trips_are_bit_exact(run):
    from safetensors.torch import load_file

    got = run["load"]("roundtrip")
    assert len(got) == 6
    for key, exported in got.items():
        original = load_file(str(run["hf"] / key.split("/")[0] / "model.safetensors"))
        assert set(exported) == set(original), key
        for name, tensor in original.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), (key, name)


def test_moe_checkpoint_reshards_across_expert_layouts(run):
    ck = run["load"]("checkpoint")
    same = lambda a, b: set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
    assert same(ck["a_step1"], ck["b_loaded"])  # saved at EP=2, loaded at EP=1
    assert same(ck["b_step2"], ck["c_loaded"])  # saved at EP=1, loaded at EP=2
    assert ck["steps"] == (2, 3)  # b: loaded step 1, took step 2; c: loaded step 2, took step 3
    # the optimizer state came along: the next steps agree with the run that stayed at EP=2
    assert _max_diff(ck["a_step2"], ck["b_step2"]) < 1e-6
    assert _max_diff(ck["a_step3"], ck["c_step3"]) < 1e-6
    assert _max_diff(ck["a_step2"], ck["a_step1"]) > 5e-4
    # the EP=1 checkpoint at EP=4 and at expert TP=2 x EP=2: the same weights, then the same step
    # (expert TP splits each expert's GEMMs: sums in another order, so 2e-5 as the EP=1 twins)
    for name, tol in (("ep4", 1e-6), ("etp2_ep2", 2e-5)):
        got = ck["resumed"][name]
        assert same(ck["c_loaded"], got["loaded"]), name
        assert got["steps"] == 3 and _max_diff(ck["a_step3"], got["step3"]) < tol, name


def test_moe_impossible_layouts_fail_before_a_model_is_built(run):
    res = run["load"]("bad_layouts")
    assert res["built"] == 0
    errors = res["errors"]
    assert set(errors) == {"ep3", "ep8", "etp3", "ep2_dense", "tp2_no_sp"}
    assert errors["ep3"][0].endswith("expert_parallel")
    assert "= 3 does not divide the world size 4" in errors["ep3"][1]
    assert "num_experts (4) is not divisible by expert_parallel (8)" in errors["ep8"][1] or \
        "= 8 does not divide the world size 4" in errors["ep8"][1]
    assert errors["etp3"][0].endswith("expert_tensor_parallel")
    assert "this model is dense" in errors["ep2_dense"][1]
    assert errors["tp2_no_sp"][0].endswith("sequence_parallel")


@pytest.mark.parametrize("layout", ["ep2", "etp2_ep2", "pp2_ep2", "tp2_ep2"])
def test_moe_owned_export_sends_each_expert_from_its_ep_rank(layout, run):
    """sync.senders=owners at expert layouts: a routed expert is sent by the rank holding it (its EP
    rank's expert-TP rank 0 in expert-data-parallel replica 0), every other tensor by a rank of its
    stage that holds it whole (TP rank 0, CP rank 0 of a replica) and is one of those expert
    owners where such ranks exist (else replica 0), the replicated tensors spread so that no
    sender carries more than its even share of the stage plus the largest replicated tensor;
    nothing by anyone else; an export gathers only within a rank's TP or expert-TP group and
    receives nothing point to point (no rank gets another EP rank's experts); the in-process sync
    of that plan hands the engine exactly the checkpoint's HF tensors."""
    from safetensors.torch import load_file

    got = run["load"]("owned_sync")[layout]
    original = load_file(str(run["hf"] / got["arch"] / "model.safetensors"))
    experts, layers = 4, 2
    places = [r["place"] for r in got["ranks"]]
    pp = 1 + max(p["pp"] for p in places)
    ep = 1 + max(p["ep"] for p in places)

    def stage(name: str) -> int:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) // (layers // pp)
        return 0 if "embed_tokens" in name else pp - 1

    def owner(name: str, **want) -> list[int]:
        return [r for r, p in enumerate(places) if p["pp"] == stage(name) and all(p[k] == v for k, v in want.items())]

    sent = {n: r for r, mine in enumerate(got["ranks"]) for n in mine["names"]}
    assert sorted(sent) == sorted(original) and sum(len(m["names"]) for m in got["ranks"]) == len(original)
    load, largest = {}, {}
    for name, rank in sent.items():
        if ".mlp.experts." in name:  # routed expert: held by one EP rank
            assert [rank] == owner(name, ep=int(name.split(".")[5]) // (experts // ep), etp=0, edp=0), (layout, name)
        else:  # replicated: a whole holder, an expert owner where one is
            holders = owner(name, tp=0, cp=0)
            owners = [r for r in holders if places[r]["etp"] == 0 and places[r]["edp"] == 0]
            assert rank in (owners or owner(name, tp=0, cp=0, dp=0)), (layout, name, rank)
            largest[stage(name)] = max(largest.get(stage(name), 0), original[name].numel())
        load.setdefault(stage(name), {}).setdefault(rank, 0)
        load[stage(name)][rank] += original[name].numel()
    for st, per_rank in load.items():  # spread: within the largest replicated tensor of an even share
        if len(per_rank) > 1:
            assert max(per_rank.values()) <= sum(per_rank.values()) / len(per_rank) + largest[st], (layout, per_rank)
    for rank, mine in enumerate(got["ranks"]):
        assert mine["recv"] == 0
        assert all(group in (mine["tp_ranks"], mine["etp_ranks"]) for group in map(list, mine["gather_groups"]))
    assert len(got["senders"]) > 1
    loaded = got["loaded"]
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
