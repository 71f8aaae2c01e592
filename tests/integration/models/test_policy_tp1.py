"""Single-rank Megatron policy against float64 Hugging Face transformers (in this process, gloo).

Tolerances (fp32 Megatron vs float64 HF): log-probs and entropies 2e-5 absolute; gradients 1e-4
relative to each tensor's largest entry.
"""

from __future__ import annotations

import pytest
import torch

from policy_testlib import (LENGTHS, PROMPTS, hf_reference, make_batch, make_loss_fn, max_abs_diff,
                            write_hf_model)

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": write_hf_model(root / "llama", "llama", tie=False, kv_heads=2),
        "qwen2": write_hf_model(root / "qwen2", "qwen2", tie=True, kv_heads=1),
        "qwen3": write_hf_model(root / "qwen3", "qwen3", tie=False, kv_heads=4),
    }


def _policy(hf_dir, groups, micro_batch_tokens=40, lr=1e-2, clip_grad=0.0, **optim):
    from megatron_rl.models import OptimConfig, PolicyConfig
    from megatron_rl.models.policy import MegatronPolicy

    cfg = PolicyConfig(micro_batch_tokens=micro_batch_tokens,
                       optim=OptimConfig(lr=lr, clip_grad=clip_grad, **optim))
    return MegatronPolicy.from_hf(str(hf_dir), cfg, groups)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logprobs_and_entropy_match_transformers(arch, hf_dirs, groups):
    policy = _policy(hf_dirs[arch], groups)
    batch = make_batch(LENGTHS, PROMPTS)
    logps, ents = policy.compute_logprobs(batch, TEMPERATURE)
    ref_logps, ref_ents, _, _ = hf_reference(hf_dirs[arch], batch, TEMPERATURE, grads=False)
    assert [t.shape[0] for t in logps] == batch.response_lens
    assert max_abs_diff(logps, ref_logps) < 2e-5
    assert max_abs_diff(ents, ref_ents) < 2e-5
    # the temperature matters: at T=1 the numbers differ from the T=0.7 reference
    logps_t1, none = policy.compute_logprobs(batch, 1.0, with_entropy=False)
    assert none is None and max_abs_diff(logps_t1, ref_logps) > 1e-2


def test_train_step_gradient_metrics_and_progress(hf_dirs, groups):
    hf_dir = hf_dirs["llama"]
    policy = _policy(hf_dir, groups, micro_batch_tokens=40)  # several micro-batches
    batch = make_batch(LENGTHS, PROMPTS, seed=3)
    loss_fn = make_loss_fn(batch)
    _, _, ref_loss, ref_grads = hf_reference(hf_dir, batch, TEMPERATURE)

    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    metrics = policy.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)

    # loss summed over micro-batches = the whole-batch loss; min/max reduce as min/max
    assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert metrics["tokens"] == sum(batch.response_lens)
    ref_logps, _, _, _ = hf_reference(hf_dir, batch, TEMPERATURE, grads=False)
    assert metrics["logp_min"] == pytest.approx(min(float(t.min()) for t in ref_logps), abs=1e-4)
    assert metrics["logp_max"] == pytest.approx(max(float(t.max()) for t in ref_logps), abs=1e-4)
    assert metrics["lr"] == pytest.approx(1e-2)
    ref_norm = torch.sqrt(sum((g ** 2).sum() for g in ref_grads.values())).item()
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)

    grads = dict(policy.export_hf_grads())
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        scale = float(ref.abs().max())
        assert float((grads[name].double() - ref).abs().max()) <= 1e-4 * scale + 1e-9, name

    after = {n: p.detach() for n, p in policy.named_parameters()}
    assert all(not torch.equal(before[n], after[n]) for n in before)

    # the same batch again: the loss went down
    second = policy.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    assert second["loss"] < metrics["loss"]


def test_export_round_trip_is_bit_exact(hf_dirs, groups):
    from safetensors.torch import load_file

    for arch, hf_dir in hf_dirs.items():
        policy = _policy(hf_dir, groups)
        exported = dict(policy.export_hf_weights())
        original = load_file(str(hf_dir / "model.safetensors"))
        if "lm_head.weight" in original and arch == "qwen2":  # tied: HF may keep a copy
            original.pop("lm_head.weight")
        assert set(exported) == set(original), arch
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), (arch, name)


def test_lr_schedule_and_set_lr(hf_dirs, groups):
    policy = _policy(hf_dirs["llama"], groups, lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                     lr_decay_style="linear", lr_decay_steps=4)
    batch = make_batch(LENGTHS[:2], PROMPTS[:2])
    loss_fn = make_loss_fn(batch)
    lrs = [policy.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"] for _ in range(5)]
    # warm-up 1/2, 2/2 of the peak, then linear decay to min_lr over steps 2..4, then flat
    assert lrs == pytest.approx([5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4])
    policy.set_lr(2e-3)
    assert policy.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"] == pytest.approx(1e-4)
    fresh = _policy(hf_dirs["llama"], groups, lr=1e-3)
    fresh.set_lr(3e-3)
    assert fresh.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"] == pytest.approx(3e-3)


def test_lr_schedule_after_a_checkpoint_load_is_the_configs_at_the_checkpoints_step(hf_dirs, groups, tmp_path):
    """A run that starts from a checkpoint (the previous stage's, trainer.init_from) with another
    peak lr in its config trains with that lr (Megatron's scheduler kept the checkpoint's, so the
    new value was silently ignored); the warm-up / decay position carries over."""
    sched = dict(min_lr=1e-5, lr_warmup_steps=4, lr_decay_style="linear", lr_decay_steps=8)
    a = _policy(hf_dirs["llama"], groups, lr=1e-3, **sched)
    batch = make_batch(LENGTHS[:2], PROMPTS[:2])
    loss_fn = make_loss_fn(batch)
    assert [a.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"] for _ in range(2)] == \
        pytest.approx([1e-3 / 4, 2e-3 / 4])
    a.save_checkpoint(tmp_path / "ckpt")
    b = _policy(hf_dirs["llama"], groups, lr=2e-3, adam_beta2=0.98, adam_eps=1e-6, **sched)
    b.load_checkpoint(tmp_path / "ckpt")
    assert all(g["betas"][1] == 0.98 and g["eps"] == 1e-6 for g in b.optimizer.param_groups)
    # Megatron's warm-up: max_lr * step / warmup_steps; step 3 of 4 at the new peak
    assert b.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"] == pytest.approx(2e-3 * 3 / 4)
    same = _policy(hf_dirs["llama"], groups, lr=1e-3, **sched)  # the same config resumes the same schedule
    same.load_checkpoint(tmp_path / "ckpt")
    assert same.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"] == pytest.approx(1e-3 * 3 / 4)
