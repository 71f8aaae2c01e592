"""torchrun worker for the parallel policy tests: runs every layout in one launch, saves results.

Usage: torchrun --nproc-per-node 4 policy_worker.py OUT_DIR HF_ROOT [CASES]
(the suite runs its cases with cp_worker.py's in one launch: parallel_worker.py)
HF_ROOT holds llama/ qwen2/ qwen3/ written by policy_testlib.write_hf_model. Rank 0 writes
OUT_DIR/<case>.pt with the Megatron numbers; the pytest side compares them with transformers.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint  # noqa: F401 - CheckpointException

sys.path.insert(0, str(Path(__file__).parent))
from policy_testlib import make_batch, make_loss_fn, run_cases, seq_means, thread_count  # noqa: E402

from megatron_rl.compat import apply_compat  # noqa: E402
from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig, init_distributed  # noqa: E402
from megatron_rl.models.batch import PerSequence  # noqa: E402
from megatron_rl.models.policy import MegatronPolicy  # noqa: E402

TEMPERATURE = 0.7
LENGTHS = [12, 7, 20, 5, 16, 9, 14, 6]
PROMPTS = [4, 3, 9, 2, 1, 8, 5, 2]
LR = 1e-3


def _policy(hf_dir, tp=1, pp=1, vpp=None, sp=False, distopt=False, tokens=48, packed=True):
    par = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline=vpp,
                         sequence_parallel=sp, use_distributed_optimizer=distopt, timeout_s=120)
    cfg = PolicyConfig(parallel=par, micro_batch_tokens=tokens, packed_sequences=packed,
                       optim=OptimConfig(lr=LR, clip_grad=0.0))
    groups = init_distributed(par)
    return MegatronPolicy.from_hf(str(hf_dir), cfg, groups)


def _export(policy, grads=False):
    it = policy.export_hf_grads() if grads else policy.export_hf_weights()
    return {name: t.clone() for name, t in it if t is not None}


def _save(out: Path, case: str, result: dict) -> None:
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / f"{case}.pt")


# Fewer sequences with response tokens (2) than DP ranks (4): two ranks run a stand-in micro-batch.
SPARSE_LENGTHS, SPARSE_PROMPTS = [12, 7, 9], [4, 7, 3]


def run_layout(out, hf_dir, case, grads=True, sparse=False, **layout):
    policy = _policy(hf_dir, **layout)
    batch = make_batch(SPARSE_LENGTHS, SPARSE_PROMPTS) if sparse else make_batch(LENGTHS, PROMPTS)
    logps, ents = policy.compute_logprobs(batch, TEMPERATURE)
    # this rank's micro-batch inputs: (packed, input shape) of each
    shapes = [(mb.layout.packed, tuple(mb.input_ids.shape)) for mb in policy._micro_batches(batch)]
    per_seq = PerSequence(seq_means, ("logp", "ent"), len(batch))
    metrics = policy.train_step(batch, make_loss_fn(batch), TEMPERATURE, with_entropy=True, per_sequence=per_seq)
    result = {"logps": logps, "ents": ents, "metrics": metrics, "per_seq": per_seq.values,
              "shapes": shapes,
              "grads": _export(policy, grads=True) if grads else None,
              "weights": _export(policy), "owned": _owned(policy)}
    _save(out, case, result)


def _owned(policy) -> list:
    """Every rank's owned export (sync.senders=owners): what each rank yielded, by rank."""
    plan = policy.export_plan()
    mine = {"names": [], "tensors": {}}
    for name, t in policy.export_owned(plan):
        mine["names"].append(name)
        mine["tensors"][name] = t.clone()
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    return ranks


def run_round_trip(out, hf_root):
    for arch in ("llama", "qwen2", "qwen3"):
        policy = _policy(hf_root / arch, tp=2, pp=2)
        _save(out, f"roundtrip_{arch}", {"weights": _export(policy)})


def run_checkpoints(out, hf_dir, ckpt_root):
    batch = make_batch(LENGTHS, PROMPTS, seed=5)
    loss_fn = make_loss_fn(batch)
    a = _policy(hf_dir, tp=2, pp=2)
    a.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    step1 = _export(a)
    a.save_checkpoint(ckpt_root / "a_tp2pp2")
    a.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    a_step2, a_logps2 = _export(a), a.compute_logprobs(batch, TEMPERATURE, with_entropy=False)[0]

    b = _policy(hf_dir, tp=1, pp=1)
    b.load_checkpoint(ckpt_root / "a_tp2pp2")
    b_loaded = _export(b)
    b.save_checkpoint(ckpt_root / "b_tp1")
    b.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    b_step2, b_logps2 = _export(b), b.compute_logprobs(batch, TEMPERATURE, with_entropy=False)[0]

    c = _policy(hf_dir, tp=2, pp=2)
    c.load_checkpoint(ckpt_root / "b_tp1")
    c_loaded = _export(c)

    # distributed optimizer: saved at TP=2 x DP=2, loaded at the same layout and at PP=2 x DP=2;
    # refused by a plain optimizer
    d = _policy(hf_dir, tp=2, distopt=True)
    d.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    d_step1 = _export(d)
    d.save_checkpoint(ckpt_root / "d_distopt")
    d.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    d_step2 = _export(d)
    e = _policy(hf_dir, tp=2, distopt=True)
    e.load_checkpoint(ckpt_root / "d_distopt")
    e.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    e_step2 = _export(e)
    f = _policy(hf_dir, pp=2, distopt=True)
    f.load_checkpoint(ckpt_root / "d_distopt")
    f_loaded = _export(f)
    f.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    f_step2 = _export(f)
    mismatch = None
    try:
        _policy(hf_dir, pp=2).load_checkpoint(ckpt_root / "d_distopt")
    except ValueError as exc:
        mismatch = str(exc)
    # the weights only (stages[].optimizer_state=fresh), into a policy that trained before: from the
    # distributed optimizer's TP=2 x DP=2 checkpoint into a plain optimizer at PP=2 x DP=2; its next
    # step against a policy built anew at PP=2 from the checkpoint's weights exported to HF
    g = _policy(hf_dir, pp=2)
    g.train_step(make_batch(LENGTHS[:4], PROMPTS[:4], seed=8), loss_fn, TEMPERATURE, with_entropy=True)
    g.load_checkpoint(ckpt_root / "d_distopt", fresh_optimizer=True)
    g_loaded, g_steps = _export(g), g.steps
    g.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    g_step = _export(g)
    hf_d = ckpt_root / "d_step1_hf"
    if torch.distributed.get_rank() == 0:
        from safetensors.torch import save_file

        hf_d.mkdir()
        save_file({n: t.contiguous() for n, t in d_step1.items()}, str(hf_d / "model.safetensors"))
        for name in ("config.json", "generation_config.json"):
            if (Path(hf_dir) / name).exists():
                shutil.copy2(Path(hf_dir) / name, hf_d / name)
    torch.distributed.barrier()
    r = _policy(hf_d, pp=2)
    r.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    _save(out, "checkpoint", {"step1": step1, "b_loaded": b_loaded, "c_loaded": c_loaded,
                              "a_step2": a_step2, "b_step2": b_step2, "a_logps2": a_logps2,
                              "b_logps2": b_logps2, "b_steps": b.steps, "c_steps": c.steps,
                              "d_step1": d_step1, "d_step2": d_step2, "e_step2": e_step2,
                              "f_loaded": f_loaded, "f_step2": f_step2, "mismatch": mismatch,
                              "fresh_loaded": g_loaded, "fresh_steps": g_steps, "fresh_step": g_step,
                              "fresh_ref_step": _export(r)})


def run_resume_exact(out, hf_dir, ckpt_root):
    """Resume against the uninterrupted run, per layout: three steps with checkpoints before the
    first step (a stage whose groups all had zero variance so far) and after it; fresh policies
    load each and run the remaining steps. A failure is recorded (the other cases still run)."""
    batch = make_batch(LENGTHS, PROMPTS, seed=7)
    loss_fn = make_loss_fn(batch)

    def step(policy):
        policy.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
        return _export(policy)

    result = {}
    for name, layout in (("distopt_tp2_dp2", dict(tp=2, distopt=True)),
                         ("plain_tp2_pp2", dict(tp=2, pp=2))):
        try:
            ref = _policy(hf_dir, **layout)
            ref.save_checkpoint(ckpt_root / f"{name}_step0")
            uninterrupted = [step(ref)]
            ref.save_checkpoint(ckpt_root / f"{name}_step1")
            uninterrupted += [step(ref), step(ref)]
            resumed = {}
            for start in (0, 1):
                policy = _policy(hf_dir, **layout)
                policy.load_checkpoint(ckpt_root / f"{name}_step{start}")
                resumed[start] = [step(policy) for _ in range(3 - start)]
            result[name] = {"uninterrupted": uninterrupted, "resumed": resumed}
        except (Exception, torch.distributed.checkpoint.api.CheckpointException) as exc:
            # reported by the test (torch's CheckpointException is a BaseException)
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    _save(out, "resume_exact", result)


def run_bad_layouts(out, hf_dir):
    """Impossible layouts: a ConfigError naming the values, and no model is ever built."""
    from megatron_rl.config.base import ConfigError
    from megatron_rl.models import gpt
    from megatron_rl.models.parallel import init_distributed as init

    built = []
    original = gpt.build_model_chunks
    gpt.build_model_chunks = lambda *a, **k: built.append(a) or original(*a, **k)
    errors = {}
    try:
        for name, layout in {"tp3": dict(tp=3), "tp4_kv2": dict(tp=4), "pp2_vpp4": dict(pp=2, vpp=4),
                             "tp4_pp2": dict(tp=4, pp=2)}.items():
            try:
                _policy(hf_dir, **layout)
            except ConfigError as exc:
                errors[name] = (exc.key, str(exc))
        # the groups of the last good layout survive a refused init_distributed
        good = init(ParallelConfig(tensor_parallel=2))
        try:
            init(ParallelConfig(tensor_parallel=3))
        except ConfigError:
            pass
        good.check_current()
    finally:
        gpt.build_model_chunks = original
    _save(out, "bad_layouts", {"errors": errors, "built": len(built)})


# Every group kind Megatron builds at 4 ranks: TP, PP (+ virtual), CP, DP with and without CP, and
# their mixes; the first layout comes back last, so its two counts can be compared.
THREAD_LAYOUTS = [dict(tensor_parallel=2, pipeline_parallel=2), dict(tensor_parallel=2),
                  dict(pipeline_parallel=2, virtual_pipeline=2), dict(context_parallel=2),
                  dict(context_parallel=4), dict(tensor_parallel=2, context_parallel=2),
                  dict(pipeline_parallel=2, context_parallel=2), dict()]


def run_threads(out):
    """Threads per rank after each of three rounds over THREAD_LAYOUTS: each re-initialisation
    destroys the old layout's groups (every gloo group holds threads until destroyed)."""
    rounds = []
    for _ in range(3):
        counts = []
        for layout in THREAD_LAYOUTS:
            init_distributed(ParallelConfig(**layout, timeout_s=120))
            counts.append(thread_count())
        rounds.append(counts)
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, rounds)
    _save(out, "threads", {"ranks": ranks})


def cases(out: Path, hf_root: Path) -> dict:
    """Every case of this worker, by name (results under ``out``)."""
    llama = hf_root / "llama"
    return {
        "threads": lambda: run_threads(out),  # first: nothing else has started threads yet
        "tp1": lambda: run_layout(out, llama, "tp1"),
        # the padded layout (every other case packs sequences: policy.packed_sequences)
        "padded_tp1": lambda: run_layout(out, llama, "padded_tp1", packed=False),
        "padded_tp2": lambda: run_layout(out, llama, "padded_tp2", tp=2, packed=False),
        "padded_pp2": lambda: run_layout(out, llama, "padded_pp2", pp=2, packed=False),
        "tp2": lambda: run_layout(out, llama, "tp2", tp=2),
        "tp2_sp": lambda: run_layout(out, llama, "tp2_sp", tp=2, sp=True),
        "pp2": lambda: run_layout(out, llama, "pp2", pp=2),
        "tp2pp2": lambda: run_layout(out, llama, "tp2pp2", tp=2, pp=2),
        "pp2_vpp2": lambda: run_layout(out, llama, "pp2_vpp2", pp=2, vpp=2),
        "tp2_distopt": lambda: run_layout(out, llama, "tp2_distopt", grads=False, tp=2,
                                          distopt=True),
        "tied_tp2pp2": lambda: run_layout(out, hf_root / "qwen2", "tied_tp2pp2", tp=2, pp=2),
        "qknorm_tp2pp2": lambda: run_layout(out, hf_root / "qwen3", "qknorm_tp2pp2", tp=2, pp=2),
        "sparse_dp4": lambda: run_layout(out, llama, "sparse_dp4", sparse=True),
        "roundtrip": lambda: run_round_trip(out, hf_root),
        "checkpoint": lambda: run_checkpoints(out, llama, out / "ckpt"),
        "resume_exact": lambda: run_resume_exact(out, llama, out / "ckpt"),
        "bad_layouts": lambda: run_bad_layouts(out, llama),
    }


def main() -> None:
    out, hf_root = Path(sys.argv[1]), Path(sys.argv[2])
    run_cases(cases(out, hf_root), set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    apply_compat()  # the entry point's one explicit call (no-op with CUDA)
    main()
