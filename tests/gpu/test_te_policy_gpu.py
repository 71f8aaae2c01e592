"""GPU: the policy on Megatron's Transformer Engine layer spec (skips without CUDA or TE).

* TE-spec policy built from HF against float64 transformers (bf16 tolerance) and against the local
  spec on the same GPU (fp32, TF32 off: the two specs compute the same function);
* one training step: TE vs local spec (grad norm, weights after the step);
* the export to vLLM is the same bytes from either spec (fp32: bit-exact with the HF checkpoint);
* with two or more GPUs: TE's context parallelism (CP=2, NCCL) against ours (CP=2 on the CPU, gloo)
  on the same model and batch: log-probs, loss and grad norm.

Tolerances: bf16 vs float64 log-probs 6e-2 absolute (bf16 has 8 bits of mantissa; observed values
are printed on failure); fp32 TE vs local 2e-4 (different kernels, fp32 accumulation).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]
pytest.importorskip("transformer_engine")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "integration" / "models"))
sys.path.insert(0, str(HERE))

from policy_testlib import (hf_reference, make_batch, make_loss_fn, max_abs_diff,  # noqa: E402
                            torchrun, write_hf_model)
from te_cp_worker import LENGTHS, PROMPTS, TEMPERATURE  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module")
def groups():
    from megatron_rl.compat import apply_compat
    from megatron_rl.models import ParallelConfig, destroy_distributed, init_distributed

    apply_compat()  # the entry point's one explicit call (the Megatron fixes; no shim with CUDA)
    g = init_distributed(ParallelConfig())
    yield g
    destroy_distributed()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llama": write_hf_model(root / "llama", "llama", kv_heads=2, hidden=64, heads=4),
            "qwen2": write_hf_model(root / "qwen2", "qwen2", tie=True, kv_heads=2, hidden=64,
                                    heads=4),
            "qwen3": write_hf_model(root / "qwen3", "qwen3", kv_heads=2, hidden=64, heads=4)}


def _policy(hf_dir, groups, spec, dtype="fp32"):
    from megatron_rl.models import OptimConfig, PolicyConfig
    from megatron_rl.models.policy import MegatronPolicy

    cfg = PolicyConfig(layer_spec=spec, params_dtype=dtype, micro_batch_tokens=128,
                       optim=OptimConfig(lr=1e-3, clip_grad=0.0))
    return MegatronPolicy.from_hf(str(hf_dir), cfg, groups)


def _export(policy):
    return {n: t.detach().cpu().clone() for n, t in policy.export_hf_weights() if t is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_te_policy_matches_transformers_and_local_spec(arch, hf_dirs, groups):
    batch = make_batch(LENGTHS, PROMPTS)
    ref_logps, ref_ents, _, _ = hf_reference(hf_dirs[arch], batch, TEMPERATURE, grads=False)
    te = _policy(hf_dirs[arch], groups, "te", "bf16")
    assert "layer_norm_weight" in " ".join(n for n, _ in te.named_parameters())  # TE names
    logps, ents = te.compute_logprobs(batch, TEMPERATURE)
    assert max_abs_diff(logps, ref_logps) < 6e-2, max_abs_diff(logps, ref_logps)
    assert max_abs_diff(ents, ref_ents) < 6e-2, max_abs_diff(ents, ref_ents)
    te32, local32 = (_policy(hf_dirs[arch], groups, s) for s in ("te", "local"))
    a, b = te32.compute_logprobs(batch, TEMPERATURE), local32.compute_logprobs(batch, TEMPERATURE)
    assert max_abs_diff(a[0], b[0]) < 2e-4 and max_abs_diff(a[1], b[1]) < 2e-4
    assert max_abs_diff(a[0], ref_logps) < 2e-4


def test_te_train_step_matches_local_spec(hf_dirs, groups):
    batch = make_batch(LENGTHS, PROMPTS, seed=3)
    out = {}
    for spec in ("te", "local"):
        policy = _policy(hf_dirs["llama"], groups, spec)
        metrics = policy.train_step(batch, make_loss_fn(batch), TEMPERATURE, with_entropy=True)
        out[spec] = metrics, _export(policy)
    (m_te, w_te), (m_local, w_local) = out["te"], out["local"]
    assert m_te["loss"] == pytest.approx(m_local["loss"], abs=1e-4)
    assert m_te["grad_norm"] == pytest.approx(m_local["grad_norm"], rel=1e-3)
    assert set(w_te) == set(w_local)
    assert max(float((w_te[n] - w_local[n]).abs().max()) for n in w_te) < 5e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_te_export_to_vllm_is_the_same_bytes(arch, hf_dirs, groups):
    from safetensors.torch import load_file

    original = load_file(str(hf_dirs[arch] / "model.safetensors"))
    if arch == "qwen2":
        original.pop("lm_head.weight", None)  # tied
    te, local = (_export(_policy(hf_dirs[arch], groups, s)) for s in ("te", "local"))
    assert list(te) == list(local)  # same names, same order (the engines' bucket layout)
    for name, tensor in original.items():
        assert torch.equal(te[name], tensor) and torch.equal(local[name], tensor), name


def _cp_run(out: Path, hf: Path, device: str) -> dict:
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None
    torchrun(HERE / "te_cp_worker.py", out, hf, nproc=2, timeout=600, env=env)
    return torch.load(out, weights_only=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TE context parallelism needs 2 GPUs")
def test_te_context_parallel_matches_ours(hf_dirs, tmp_path):
    te = _cp_run(tmp_path / "te.pt", hf_dirs["llama"], "cuda")
    ours = _cp_run(tmp_path / "ours.pt", hf_dirs["llama"], "cpu")
    assert max_abs_diff(te["logps"], ours["logps"]) < 2e-4
    assert max_abs_diff(te["ents"], ours["ents"]) < 2e-4
    assert te["metrics"]["loss"] == pytest.approx(ours["metrics"]["loss"], abs=1e-4)
    assert te["metrics"]["grad_norm"] == pytest.approx(ours["metrics"]["grad_norm"], rel=1e-3)
