"""Every ``policy.*`` key does something (the rest of the walk: tests/unit/config/test_every_key_acts.py).

Observables, from the real Megatron policy in this process (one rank, gloo): the layout a key asks
for (the data-parallel size of an 8-rank world, or the error naming what does not fit), what
Megatron is asked to build (its ``TransformerConfig`` and ``OptimizerConfig``), and what the policy
computes over three optimizer steps (learning rates, gradient norms, losses, weights, micro-batch
count); for the reference, its log-probs (or its refusal).
"""

from __future__ import annotations

import pytest
import torch

from policy_testlib import LENGTHS, PROMPTS, make_batch, make_loss_fn, write_hf_model, write_hf_moe_model

pytestmark = pytest.mark.slow

# Layouts of several ranks need the engines in processes of their own (the in-process engine is refused).
SERVERS = ["rollout.engine=vllm_server", "rollout.placement=external", "rollout.server_urls=[http://127.0.0.1:1]",
           "sync.transport=gloo"]
PROBES = {  # key: (changed value, given overrides)
    "policy.parallel.tensor_parallel": ("2", []),
    "policy.parallel.pipeline_parallel": ("2", []),
    "policy.parallel.virtual_pipeline": ("4", ["policy.parallel.pipeline_parallel=2"]),
    "policy.parallel.sequence_parallel": ("true", ["policy.parallel.tensor_parallel=2"]),
    "policy.parallel.use_distributed_optimizer": ("true", []),
    "policy.parallel.timeout_s": ("30.0", []),
    "policy.optim.lr": ("0.02", []),
    "policy.optim.min_lr": ("0.005", ["policy.optim.lr_decay_style=linear", "policy.optim.lr_decay_steps=2"]),
    "policy.optim.weight_decay": ("0.5", []),
    "policy.optim.adam_beta1": ("0.5", []),
    "policy.optim.adam_beta2": ("0.9", []),
    "policy.optim.adam_eps": ("0.1", []),
    "policy.optim.clip_grad": ("0.01", []),
    "policy.optim.lr_warmup_steps": ("2", []),
    "policy.optim.lr_decay_style": ("cosine", ["policy.optim.lr_decay_steps=3"]),
    "policy.optim.lr_decay_steps": ("2", ["policy.optim.lr_decay_style=linear", "policy.optim.lr_decay_steps=3"]),
    "policy.micro_batch_tokens": ("30", []),
    "policy.packed_sequences": ("false", []),
    "policy.params_dtype": ("bf16", []),
    "policy.seed": ("7", []),
    "policy.reference.path": ("{other}", ["algo.kl.enabled=true"]),
    "policy.reference.offload": ("true", ["algo.kl.enabled=true"]),
    "policy.parallel.context_parallel": ("2", []),
    # GPU-only (the CPU's CP attention always all-gathers): what a te-spec run asks TE for
    "policy.parallel.cp_comm_type": ("all_gather", ["policy.parallel.context_parallel=2"]),
    "policy.layer_spec": ("te", []),  # refused here (no CUDA), naming the key
    "policy.recompute.granularity": ("full", []),
    "policy.recompute.method": ("block", ["policy.recompute.granularity=full"]),
    "policy.recompute.num_layers": ("2", ["policy.recompute.granularity=full"]),
    "policy.recompute.modules": ("[mlp]", ["policy.recompute.granularity=selective"]),
    # Mixture-of-Experts keys: observed on a MoE model (MOE_KEYS)
    "policy.parallel.expert_parallel": ("2", []),
    "policy.parallel.expert_tensor_parallel": ("2", []),
    "policy.moe.aux_loss_coef": ("0.5", []),
    "policy.moe.z_loss_coef": ("0.1", []),
}
MOE_KEYS = {"policy.parallel.expert_parallel", "policy.parallel.expert_tensor_parallel",
            "policy.moe.aux_loss_coef", "policy.moe.z_loss_coef"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    return (write_hf_model(root / "a", "llama", kv_heads=2, layers=4),
            write_hf_model(root / "b", "llama", kv_heads=2, layers=4, seed=3),
            write_hf_moe_model(root / "moe", "qwen3_moe", experts=4))


def test_the_walk_covers_every_policy_key():
    from megatron_rl.config.reference import leaf_keys
    from megatron_rl.trainer.schema import RunConfig

    assert sorted(PROBES) == sorted(k for k in leaf_keys(RunConfig) if k.startswith("policy."))


def _observe(cfg, model_dir, groups) -> dict:
    from megatron.core import optimizer as megatron_optimizer

    from megatron_rl.models import gpt
    from megatron_rl.models.forward import check_spec
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.models.parallel import check_layout, rng_tracker_states
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.models.reference import ReferencePolicy

    p = cfg.policy
    arch = read_hf_config(model_dir)
    out: dict = {}
    try:  # the layout the keys ask for, in an 8-rank world
        out["dp"] = check_layout(p.parallel, 8, arch.shape)
        view = type("Groups", (), dict(vars(groups)))()  # the groups init_distributed would make
        view.tp, view.pp, view.vpp = p.parallel.tensor_parallel, p.parallel.pipeline_parallel, p.parallel.vpp
        view.sequence_parallel, view.cp = p.parallel.sequence_parallel, p.parallel.context_parallel
        view.ep, view.etp = p.parallel.expert_parallel, p.parallel.etp
        for spec in ("local", "te"):  # what this machine builds, and what a GPU run asks TE for
            tc = gpt.transformer_config(arch, view, torch.float32, layer_spec=spec,
                                        recompute=p.recompute.megatron_kwargs(),
                                        cp_comm_type=p.parallel.cp_comm_type)
            out[f"transformer_{spec}"] = (
                tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size,
                tc.virtual_pipeline_model_parallel_size, tc.sequence_parallel,
                tc.context_parallel_size, getattr(tc, "cp_comm_type", None), tc.recompute_granularity,
                tc.recompute_method, tc.recompute_num_layers, tc.recompute_modules,
                tc.expert_model_parallel_size, tc.expert_tensor_parallel_size)
    except Exception as exc:  # noqa: BLE001 - a layout that does not fit is what the key did
        out["dp"] = f"{type(exc).__name__}: {exc}"
    one_rank = type(p.parallel)(use_distributed_optimizer=p.parallel.use_distributed_optimizer,
                                timeout_s=p.parallel.timeout_s)
    from megatron_rl.models import init_distributed

    groups = init_distributed(one_rank, seed=p.seed)  # joins this world with the keys' settings
    out["timeout"] = groups.timeout_s
    out["rng"] = [float(s.double().sum()) for s in rng_tracker_states().values()]
    try:
        out["layer_spec"] = check_spec(p, groups)
    except Exception as exc:  # noqa: BLE001 - a spec this machine cannot run is refused
        return {**out, "layer_spec": f"{type(exc).__name__}: {exc}"}
    local = type(p)(**{**{f: getattr(p, f) for f in ("optim", "micro_batch_tokens", "params_dtype",
                                                       "seed", "reference", "layer_spec",
                                                       "recompute", "moe", "packed_sequences")},
                       "parallel": one_rank})
    seen = []
    real = megatron_optimizer.get_megatron_optimizer
    megatron_optimizer.get_megatron_optimizer = lambda config, *a, **k: seen.append(config) or real(config, *a, **k)
    try:
        policy = MegatronPolicy.from_hf(str(model_dir), local, groups)
    finally:
        megatron_optimizer.get_megatron_optimizer = real
    oc = seen[0]
    out["optimizer"] = (type(policy.optimizer).__name__, oc.use_distributed_optimizer, oc.lr,
                        oc.weight_decay, oc.adam_beta1, oc.adam_beta2, oc.adam_eps, oc.clip_grad,
                        oc.params_dtype, policy.model[0].ddp_config.use_distributed_optimizer)
    batch = make_batch(LENGTHS, PROMPTS, seed=3)
    # the policy's own micro-batches: how many, and laid out how (packed or padded, shape)
    out["micro_batches"] = [(mb.layout.packed, tuple(mb.input_ids.shape)) for mb in policy._micro_batches(batch)]
    steps = [policy.train_step(batch, make_loss_fn(batch), 1.0, with_entropy=True) for _ in range(3)]
    out["steps"] = [(m["lr"], round(m["grad_norm"], 6), round(m["loss"], 6)) for m in steps]
    out["weights"] = round(float(sum(t.double().sum() for _, t in policy.named_parameters())), 6)
    if cfg.algo.kl.enabled:
        try:
            ref = ReferencePolicy.from_hf(local.reference.path or str(model_dir), local, groups)
            out["reference"] = [round(float(t.sum()), 6) for t in ref.compute_logprobs(batch, 1.0)[0]]
        except Exception as exc:  # noqa: BLE001
            out["reference"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.parametrize("key", sorted(PROBES))
def test_changing_the_key_changes_what_it_drives(key, models, groups):
    from megatron_rl.trainer.schema import load_run_config

    value, given = PROBES[key]
    base = ["stages=[{name: s, max_response_len: 4, max_steps: 1}]", "model.path=x",
            "policy.optim.lr=0.01", "policy.micro_batch_tokens=200", *SERVERS, *given]
    value = value.replace("{other}", str(models[1]))
    model = models[2] if key in MOE_KEYS else models[0]
    before = _observe(load_run_config(None, base), model, groups)
    after = _observe(load_run_config(None, [*base, f"{key}={value}"]), model, groups)
    assert before != after, f"{key}={value} changed nothing its probe observes"
