"""TP / PP / VPP / SP / DP layouts, HF round trip and cross-layout checkpoints under torchrun (gloo).

One ``torchrun --nproc-per-node 4`` launch (policy_worker.py's cases, with cp_worker.py's:
parallel_worker.py, the ``parallel_run`` fixture) runs every case and saves the
Megatron numbers; this file compares them with float64 transformers and with the single-rank run.
Models: Llama (4 layers, 4 heads / 2 KV heads), Qwen2 with tied embeddings, Qwen3 with q/k norms;
vocabulary 61 (padded: exercises the padding mask); fp32. Tolerances:
  * log-probs, entropies vs transformers: 2e-5 absolute; summed loss: 1e-5 absolute;
  * gradients vs transformers: 1e-5 x the tensor's largest entry (observed ~1e-6);
  * vs the TP=1 run: log-probs 5e-6; weights after one Adam step (lr 1e-3): 2e-5 (Adam's first step
    is ~lr x sign(grad), so reduction-order noise on near-zero gradients shows at ~1e-5 x lr);
  * HF -> Megatron -> HF and checkpoint save -> load at another layout: bit-exact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from policy_testlib import hf_reference, make_batch, max_abs_diff

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
LAYOUTS = ["tp2", "tp2_sp", "pp2", "tp2pp2", "pp2_vpp2", "tp2_distopt", "tied_tp2pp2",
           "qknorm_tp2pp2"]
ARCH = {"tied_tp2pp2": "qwen2", "qknorm_tp2pp2": "qwen3"}  # others: llama


@pytest.fixture(scope="module")
def run(parallel_run):
    hf, out = parallel_run["hf"], parallel_run["out"] / "policy"  # (one launch with the CP cases)
    worker = _worker_module()
    batch = make_batch(worker.LENGTHS, worker.PROMPTS)
    sparse = make_batch(worker.SPARSE_LENGTHS, worker.SPARSE_PROMPTS)
    refs = {arch: hf_reference(hf / arch, batch, worker.TEMPERATURE)
            for arch in ("llama", "qwen2", "qwen3")}
    refs["sparse"] = hf_reference(hf / "llama", sparse, worker.TEMPERATURE)
    return {"out": out, "hf": hf, "refs": refs, "batch": batch, "sparse": sparse,
            "load": lambda case: torch.load(out / f"{case}.pt", weights_only=False)}


def _worker_module():
    sys.path.insert(0, str(HERE))
    import policy_worker

    return policy_worker


def _max_weight_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


@pytest.mark.parametrize("case", ["tp1", *LAYOUTS, "sparse_dp4"])
def test_layout_matches_transformers(case, run):
    got = run["load"](case)
    batch = run["sparse"] if case == "sparse_dp4" else run["batch"]
    ref = run["refs"]["sparse"] if case == "sparse_dp4" else run["refs"][ARCH.get(case, "llama")]
    ref_logps, ref_ents, ref_loss, ref_grads = ref
    assert [t.shape[0] for t in got["logps"]] == batch.response_lens
    assert max_abs_diff(got["logps"], ref_logps) < 2e-5
    assert max_abs_diff(got["ents"], ref_ents) < 2e-5
    metrics = got["metrics"]
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert metrics["tokens"] == sum(batch.response_lens)  # summed over micro-batches and DP
    valid = [t for t in ref_logps if t.numel()]
    assert metrics["logp_min"] == pytest.approx(min(float(t.min()) for t in valid), abs=2e-5)
    assert metrics["logp_max"] == pytest.approx(max(float(t.max()) for t in valid), abs=2e-5)
    # Per-sequence values from the training forward, gathered onto rank 0 (the rollout dumps').
    for i, (lp, ent) in enumerate(zip(ref_logps, ref_ents)):
        if lp.numel():
            assert float(got["per_seq"]["logp"][i]) == pytest.approx(float(lp.double().mean()), abs=2e-5)
            assert float(got["per_seq"]["ent"][i]) == pytest.approx(float(ent.double().mean()), abs=2e-5)
        else:  # no response tokens: no micro-batch held it
            assert torch.isnan(got["per_seq"]["logp"][i]) and torch.isnan(got["per_seq"]["ent"][i])
    ref_norm = float(torch.sqrt(sum((g ** 2).sum() for g in ref_grads.values())))
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    if got["grads"] is not None:  # not exported with the distributed optimizer
        assert set(got["grads"]) == set(ref_grads)
        for name, ref in ref_grads.items():
            err = float((got["grads"][name].double() - ref).abs().max())
            assert err <= 1e-5 * float(ref.abs().max()), (name, err)


@pytest.mark.parametrize("case", [c for c in LAYOUTS if c not in ARCH])
def test_layout_matches_single_rank(case, run):
    base, got = run["load"]("tp1"), run["load"](case)
    assert max_abs_diff(got["logps"], base["logps"]) < 5e-6
    assert _max_weight_diff(got["weights"], base["weights"]) < 2e-5
    # and the step moved the weights by far more than that
    assert _max_weight_diff(base["weights"], _original(run["hf"] / "llama")) > 5e-4


# (pipeline_parallel, tensor_parallel, data_parallel, virtual stages) of each 4-rank case
SHAPES = {"tp1": (1, 1, 4, 1), "tp2": (1, 2, 2, 1), "tp2_sp": (1, 2, 2, 1), "pp2": (2, 1, 2, 1),
          "tp2pp2": (2, 2, 1, 1), "pp2_vpp2": (2, 1, 2, 2), "tp2_distopt": (1, 2, 2, 1), "tied_tp2pp2": (2, 2, 1, 1),
          "qknorm_tp2pp2": (2, 2, 1, 1), "sparse_dp4": (1, 1, 4, 1)}


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_owned_export_sends_each_stage_from_its_tp_rank0_of_replica0(case, run):
    """sync.senders=owners: each rank yields exactly its stage's tensors when it is the stage's
    TP-rank-0 of data-parallel replica 0 (Megatron's rank order: a stage is a block of tp x dp ranks),
    nothing otherwise; together they are the gathered export, bit-exact."""
    got = run["load"](case)
    pp, tp, dp, vpp = SHAPES[case]
    layers = 4  # the test models'
    gathered, owned = got["weights"], got["owned"]

    def stage(name: str) -> int:
        if name.startswith("model.layers."):
            return (int(name.split(".")[2]) // (layers // (pp * vpp))) % pp
        return 0 if "embed_tokens" in name else pp - 1

    union = {}
    for rank, mine in enumerate(owned):
        sender = rank % (tp * dp) == 0
        want = sorted(n for n in gathered if stage(n) == rank // (tp * dp)) if sender else []
        assert sorted(mine["names"]) == want, (case, rank)
        union.update(mine["tensors"])
    assert set(union) == set(gathered)
    assert all(torch.equal(union[n], gathered[n]) for n in gathered), case


def test_distributed_optimizer_matches_plain_data_parallel(run):
    plain, distopt = run["load"]("tp2"), run["load"]("tp2_distopt")
    assert distopt["metrics"]["grad_norm"] == pytest.approx(plain["metrics"]["grad_norm"], rel=1e-6)
    assert _max_weight_diff(distopt["weights"], plain["weights"]) < 1e-6


def _original(hf_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_round_trip_at_tp2_pp2_is_bit_exact(arch, run):
    exported = run["load"](f"roundtrip_{arch}")["weights"]
    original = _original(run["hf"] / arch)
    if arch == "qwen2":  # tied embeddings: no separate lm_head in the export
        original.pop("lm_head.weight", None)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_checkpoint_moves_between_tp2pp2_and_tp1(run):
    ck = run["load"]("checkpoint")
    same = lambda a, b: set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)  # noqa: E731
    assert same(ck["step1"], ck["b_loaded"])  # saved at TP=2 x PP=2, loaded at TP=1
    assert same(ck["step1"], ck["c_loaded"])  # saved at TP=1, loaded back at TP=2 x PP=2
    assert ck["b_steps"] == 2 and ck["c_steps"] == 1
    # the optimizer state came along: the next step agrees across layouts
    assert _max_weight_diff(ck["a_step2"], ck["b_step2"]) < 1e-6
    assert _max_weight_diff(ck["a_step2"], ck["step1"]) > 5e-4
    assert max_abs_diff(ck["a_logps2"], ck["b_logps2"]) < 5e-6


def test_distributed_optimizer_checkpoint_weights_and_kind(run):
    ck = run["load"]("checkpoint")
    # saved at TP=2 x DP=2, loaded at PP=2 x DP=2: the weights come back bit-exact
    assert set(ck["f_loaded"]) == set(ck["d_step1"])
    assert all(torch.equal(ck["f_loaded"][n], ck["d_step1"][n]) for n in ck["d_step1"])
    # and so does the optimizer state: the next step agrees at the same layout (bit-exact: it used
    # to differ by ~3.5e-4 in the norm weights, every parameter's Adam step sharing one tensor) and
    # at the other one
    assert all(torch.equal(ck["e_step2"][n], ck["d_step2"][n]) for n in ck["d_step2"])
    assert _max_weight_diff(ck["f_step2"], ck["d_step2"]) < 1e-6
    assert _max_weight_diff(ck["d_step2"], ck["d_step1"]) > 5e-4
    # a plain optimizer refuses it with a clear message instead of a KeyError deep in Megatron
    assert "written with use_distributed_optimizer=True" in ck["mismatch"]


def test_fresh_optimizer_load_across_layouts_and_optimizers(run):
    """stages[].optimizer_state=fresh: the weights only of a distributed-optimizer TP=2 x DP=2
    checkpoint, into a plain-optimizer PP=2 x DP=2 policy that trained before; its next step equals
    that of a policy built anew at PP=2 from the checkpoint's weights (exported to HF), bit for bit."""
    ck = run["load"]("checkpoint")
    assert set(ck["fresh_loaded"]) == set(ck["d_step1"])
    assert all(torch.equal(ck["fresh_loaded"][n], ck["d_step1"][n]) for n in ck["d_step1"])
    assert ck["fresh_steps"] == 0
    assert set(ck["fresh_step"]) == set(ck["fresh_ref_step"])
    assert all(torch.equal(ck["fresh_step"][n], ck["fresh_ref_step"][n]) for n in ck["fresh_ref_step"])
    assert _max_weight_diff(ck["fresh_step"], ck["d_step1"]) > 5e-4  # the step changed them


@pytest.mark.parametrize("layout", ["distopt_tp2_dp2", "plain_tp2_pp2"])
@pytest.mark.parametrize("start", [0, 1])
def test_resume_matches_the_uninterrupted_run(layout, start, run):
    """Checkpoint before any optimizer step (0) or after the first (1), load into a fresh policy,
    run the remaining steps: bit-exact against the run that never stopped."""
    res = run["load"]("resume_exact")[layout]
    assert "error" not in res, res.get("error")
    ref, got = res["uninterrupted"][start:], res["resumed"][start]
    assert len(got) == len(ref) == 3 - start
    for k, (a, b) in enumerate(zip(ref, got)):
        assert set(a) == set(b)
        worst = max(float((a[n] - b[n]).abs().max()) for n in a)
        assert worst == 0.0, f"step {start + k + 1} after the load differs by {worst}"


def test_reinitialising_destroys_the_old_layouts_groups(run):
    """Megatron-Core's destroy_model_parallel drops its handles but leaves the gloo groups (and
    their threads) alive; init_distributed destroys every group the old layout created."""
    for rank, rounds in enumerate(run["load"]("threads")["ranks"]):
        first, *_, last = rounds
        # the same layout costs the same threads in the third round as in the first (a gloo group
        # holds 3 threads; without the destroy every re-initialisation added ~51 on every rank, and
        # a rank ended this case at ~1230 threads instead of ~64)
        assert all(b - a < 3 for a, b in zip(first, last)), (rank, rounds)
        assert max(map(max, rounds)) - min(map(min, rounds)) < 30, (rank, rounds)


def test_impossible_layouts_fail_before_a_model_is_built(run):
    res = run["load"]("bad_layouts")
    assert res["built"] == 0
    errors = res["errors"]
    assert set(errors) == {"tp3", "tp4_kv2", "pp2_vpp4", "tp4_pp2"}
    assert "tensor_parallel (3) x pipeline_parallel (1) = 3 does not divide the world size 4" \
        in errors["tp3"][1]
    assert "num_key_value_heads (2) is not divisible by tensor_parallel (4)" in errors["tp4_kv2"][1]
    assert errors["pp2_vpp4"][0].endswith("virtual_pipeline")
    assert "= 8 ranks needed but only 4 processes" in errors["tp4_pp2"][1]
