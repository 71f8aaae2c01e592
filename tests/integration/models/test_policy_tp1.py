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


# ---------------------------------------------------------------- stages[].optimizer_state: fresh
# An "SFT" policy trained 2 steps at lr 1e-3 writes the start checkpoint (with the trainer state of a
# run at global step 5); the stage trains at lr 2e-3 with a 4-step warm-up. Per (dtype, optimizer):
# fp32 with the plain optimizer, bf16 (fp32 main copies of the weights) with the distributed one.
FRESH_SCHED = dict(min_lr=1e-5, lr_warmup_steps=4, lr_decay_style="linear", lr_decay_steps=8)
FRESH_CASES = [("fp32", False), ("bf16", True)]


def _stage_policy(hf_dir, groups, dtype, distributed, lr=2e-3):
    from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig
    from megatron_rl.models.policy import MegatronPolicy

    cfg = PolicyConfig(micro_batch_tokens=40, params_dtype=dtype,
                       parallel=ParallelConfig(use_distributed_optimizer=distributed),
                       optim=OptimConfig(lr=lr, **FRESH_SCHED))
    return MegatronPolicy.from_hf(str(hf_dir), cfg, groups)


def _ctx(policy):
    """What checkpointing.load_start reads of the trainer's context."""
    from types import SimpleNamespace

    return SimpleNamespace(policy=policy, cfg=SimpleNamespace(policy=policy.cfg))


def _params(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.named_parameters()}


@pytest.fixture(scope="module")
def fresh_start(hf_dirs, groups, tmp_path_factory):
    """Per case: the start checkpoint (a trainer checkpoint: policy/ + trainer state) and a Hugging
    Face export of its weights, written by the SFT policy."""
    from types import SimpleNamespace

    from megatron_rl.trainer.checkpointing import export_hf
    from megatron_rl.trainer.state import RunDir, TrainerState

    batch = make_batch(LENGTHS[:2], PROMPTS[:2])
    out = {}
    for dtype, distributed in FRESH_CASES:
        root = tmp_path_factory.mktemp(f"sft_{dtype}")
        sft = _stage_policy(hf_dirs["llama"], groups, dtype, distributed, lr=1e-3)
        for _ in range(2):
            sft.train_step(batch, make_loss_fn(batch), 1.0, with_entropy=True)
        sft.save_checkpoint(root / "final" / "policy")
        RunDir.write_state(root / "final", TrainerState(
            stage="sft", step=2, global_step=5, grpo_step=3, weight_version=7,
            data_loader={"epoch": 1}, entropy_controller={"coef": 0.25}))
        export_hf(SimpleNamespace(policy=sft, is_driver=True, model_path=str(hf_dirs["llama"])),
                  root / "hf")
        out[dtype, distributed] = root
    return out


@pytest.mark.parametrize("dtype,distributed", FRESH_CASES)
def test_fresh_optimizer_stage_start_trains_as_a_new_policy_from_the_weights(
        dtype, distributed, hf_dirs, groups, fresh_start):
    """stages[].optimizer_state=fresh: a stage that starts from a checkpoint takes its weights only;
    its first update equals that of a policy newly built from the checkpoint's exported weights
    (zero Adam moments, lr schedule at warm-up step 1 of the running config), bit for bit, also
    when the policy trained before in the same process, and differs from the carried optimizer's;
    the run-wide counters carry over either way."""
    from megatron_rl.trainer.checkpointing import load_start
    from megatron_rl.trainer.config import StageConfig

    root = fresh_start[dtype, distributed]
    batch = make_batch(LENGTHS[:3], PROMPTS[:3], seed=4)
    loss_fn = make_loss_fn(batch)

    reference = _stage_policy(root / "hf", groups, dtype, distributed)  # a brand-new optimizer
    ref_lr = reference.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"]
    assert ref_lr == pytest.approx(2e-3 * 1 / 4)  # Megatron's warm-up: max_lr * step / warmup_steps

    updates = {}
    for choice in ("fresh", "carry"):
        policy = _stage_policy(hf_dirs["llama"], groups, dtype, distributed)
        # as in a run whose SFT (or previous stage, at its own lr) trained this policy in the same
        # process: moments, step count, schedule position and peak lr it must not keep
        other = make_batch(LENGTHS[3:], PROMPTS[3:], seed=9)
        policy.set_lr(5e-3)
        policy.train_step(other, make_loss_fn(other), 1.0, with_entropy=True)
        stage = StageConfig(name="s1", max_steps=1, optimizer_state=choice)
        state = load_start(_ctx(policy), root / "final", stage, resume=False)
        assert (state.stage, state.step, state.global_step, state.grpo_step, state.weight_version,
                state.data_loader, state.entropy_controller) == \
            ("s1", 0, 5, 3, 7, {"epoch": 1}, {"coef": 0.25}), choice
        lr = policy.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"]
        updates[choice] = (lr, _params(policy))
    lr, fresh = updates["fresh"]
    assert lr == ref_lr
    ref = _params(reference)
    assert all(torch.equal(fresh[n], ref[n]) for n in ref)
    carry_lr, carry = updates["carry"]
    assert carry_lr == pytest.approx(2e-3 * 3 / 4)  # the checkpoint's step count: warm-up step 3
    assert any(not torch.allclose(carry[n].float(), ref[n].float(), rtol=0, atol=1e-3) for n in ref)


@pytest.mark.parametrize("dtype,distributed", FRESH_CASES)
def test_fresh_optimizer_resume_within_the_stage_restores_the_moments(
        dtype, distributed, hf_dirs, groups, fresh_start, tmp_path):
    """A stage with optimizer_state=fresh, preempted after its first step and resumed from its own
    step checkpoint, goes on with the moments and schedule built since it started: its second
    update equals the uninterrupted run's, bit for bit."""
    from megatron_rl.trainer.checkpointing import load_start
    from megatron_rl.trainer.config import StageConfig
    from megatron_rl.trainer.state import RunDir, TrainerState

    stage = StageConfig(name="s1", max_steps=2, optimizer_state="fresh")
    batch = make_batch(LENGTHS[:3], PROMPTS[:3], seed=4)
    loss_fn = make_loss_fn(batch)
    run = _stage_policy(hf_dirs["llama"], groups, dtype, distributed)
    load_start(_ctx(run), fresh_start[dtype, distributed] / "final", stage, resume=False)
    run.train_step(batch, loss_fn, 1.0, with_entropy=True)
    run.save_checkpoint(tmp_path / "step_1" / "policy")
    RunDir.write_state(tmp_path / "step_1", TrainerState(stage="s1", step=1, global_step=6))
    uninterrupted = run.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"]

    resumed = _stage_policy(hf_dirs["llama"], groups, dtype, distributed)
    state = load_start(_ctx(resumed), tmp_path / "step_1", stage, resume=True)
    assert (state.step, state.global_step) == (1, 6)
    lr = resumed.train_step(batch, loss_fn, 1.0, with_entropy=True)["lr"]
    assert lr == uninterrupted == pytest.approx(2e-3 * 2 / 4)
    expected = _params(run)
    assert all(torch.equal(p, expected[n]) for n, p in _params(resumed).items())
