"""torchrun worker of the context-parallel tests: every case in one launch, results saved by rank 0.

Usage: torchrun --nproc-per-node 4 cp_worker.py OUT_DIR HF_ROOT [CASES]
(the suite runs its cases with policy_worker.py's in one launch: parallel_worker.py)
HF_ROOT holds llama/ (4 layers, 4 heads / 2 KV heads), qwen2/ (tied, qkv bias) and qwen3/ (q/k
norms, head_dim 16). Every case
builds the policy at one layout, computes log-probs and entropy, takes one training step and saves
the numbers, the exported gradients (DP x CP summed) and weights; the pytest side compares each CP
layout with the CP=1 run of the same launch. Odd lengths everywhere: padding to 2·CP is exercised.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from policy_testlib import make_batch, make_loss_fn, run_cases, seq_means  # noqa: E402

from megatron_rl.compat import apply_compat  # noqa: E402
from megatron_rl.models import (OptimConfig, ParallelConfig, PolicyConfig,  # noqa: E402
                                RecomputeConfig, init_distributed)
from megatron_rl.models.batch import PerSequence  # noqa: E402
from megatron_rl.models.policy import MegatronPolicy  # noqa: E402

TEMPERATURE = 0.7
# odd lengths; one response sits wholly in the last chunk (prompt 20 of 21), one sequence is long
LENGTHS = [13, 7, 21, 5, 17, 9, 15, 31]
PROMPTS = [4, 3, 20, 2, 1, 8, 5, 6]
LR = 1e-3
# One sequence has response tokens (a single one, predicted from the last chunk): one DP rank runs
# a stand-in, and in the other's CP group one rank holds no response token at all.
SPARSE_LENGTHS, SPARSE_PROMPTS = [21, 9], [20, 9]


def _policy(hf_dir, tp=1, pp=1, cp=1, vpp=None, sp=False, distopt=False, tokens=40,
            recompute=None, packed=True):
    par = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                         virtual_pipeline=vpp, sequence_parallel=sp,
                         use_distributed_optimizer=distopt, timeout_s=120)
    cfg = PolicyConfig(parallel=par, micro_batch_tokens=tokens, layer_spec="local",
                       packed_sequences=packed,
                       recompute=recompute or RecomputeConfig(),
                       optim=OptimConfig(lr=LR, clip_grad=0.0))
    return MegatronPolicy.from_hf(str(hf_dir), cfg, init_distributed(par))


def _export(policy, grads=False):
    it = policy.export_hf_grads() if grads else policy.export_hf_weights()
    return {name: t.clone() for name, t in it if t is not None}


def _save(out: Path, case: str, result: dict) -> None:
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / f"{case}.pt")


def run_layout(out, hf_dir, case, grads=True, sparse=False, **layout):
    policy = _policy(hf_dir, **layout)
    batch = make_batch(SPARSE_LENGTHS, SPARSE_PROMPTS) if sparse else make_batch(LENGTHS, PROMPTS)
    logps, ents = policy.compute_logprobs(batch, TEMPERATURE)
    # this rank's micro-batch inputs: (packed, input shape) of each
    shapes = [(mb.layout.packed, tuple(mb.input_ids.shape)) for mb in policy._micro_batches(batch)]
    # MLP forward calls in the training step: with recomputation some run again in backward
    calls = [0]
    hooks = [layer.mlp.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
             for chunk in policy.model for layer in chunk.module.decoder.layers]
    per_seq = PerSequence(seq_means, ("logp", "ent"), len(batch))
    metrics = policy.train_step(batch, make_loss_fn(batch), TEMPERATURE, with_entropy=True,
                                per_sequence=per_seq)
    for h in hooks:
        h.remove()
    _save(out, case, {"logps": logps, "ents": ents, "metrics": metrics, "mlp_calls": calls[0],
                      "shapes": shapes,
                      "per_seq": per_seq.values,
                      "grads": _export(policy, grads=True) if grads else None,
                      "weights": _export(policy)})


def run_checkpoint(out, hf_dir, ckpt_root):
    """Saved at CP=2 x TP=2, loaded at CP=1 (and the next step agrees with CP=2's)."""
    batch = make_batch(LENGTHS, PROMPTS, seed=5)
    loss_fn = make_loss_fn(batch)
    a = _policy(hf_dir, tp=2, cp=2)
    a.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    step1 = _export(a)
    a.save_checkpoint(ckpt_root / "a_cp2")
    a.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    a_step2 = _export(a)
    b = _policy(hf_dir)
    b.load_checkpoint(ckpt_root / "a_cp2")
    b_loaded = _export(b)
    b.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
    _save(out, "checkpoint", {"step1": step1, "a_step2": a_step2, "b_loaded": b_loaded,
                              "b_step2": _export(b)})


def run_collective_timeout(out: Path) -> None:
    """A collective that one rank never reaches (issue 27: no wait without a timeout naming what it
    waited for): rank 0 waits for a broadcast rank 1 skips, on a group with a 2 s timeout; the wait
    ends there with an error naming it (``models.parallel.named_collective``), saved for the test."""
    import datetime
    import json
    import time

    import torch.distributed as dist

    from megatron_rl.models.parallel import CollectiveError, named_collective

    group = dist.new_group(ranks=[0, 1], timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 0:
        t0, message = time.time(), None
        try:
            with named_collective("the test's broadcast that rank 1 skips", 2.0):
                dist.broadcast_object_list([None], src=1, group=group)
        except CollectiveError as exc:
            message = str(exc)
        (out / "collective_timeout.json").write_text(json.dumps({"message": message, "seconds": time.time() - t0}))
    dist.destroy_process_group(group)
    # rank 0's input error reaches every rank (none waits for a driver that stopped)
    from types import SimpleNamespace

    from megatron_rl.common.errors import InputError
    from megatron_rl.trainer.context import raise_agreed

    rank = dist.get_rank()
    try:
        raise_agreed(InputError("rank 0's planted input error") if rank == 0 else None,
                     SimpleNamespace(world_size=dist.get_world_size(), timeout_s=30.0), "the test's start-up check")
        said = "nothing raised"
    except InputError as exc:
        said = f"InputError: {exc}"
    (out / f"agreed_rank{rank}.txt").write_text(said)


def cases(out: Path, hf_root: Path) -> dict:
    """Every case of this worker, by name (results under ``out``)."""
    llama, qwen2, qwen3 = hf_root / "llama", hf_root / "qwen2", hf_root / "qwen3"
    full = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    block = RecomputeConfig(granularity="full", method="block", num_layers=2)
    selective = RecomputeConfig(granularity="selective", modules=["core_attn", "mlp"])
    return {
        "cp1": lambda: run_layout(out, llama, "cp1"),
        "cp2": lambda: run_layout(out, llama, "cp2", cp=2),  # x DP 2
        "padded_cp2": lambda: run_layout(out, llama, "padded_cp2", cp=2, packed=False),
        "cp4": lambda: run_layout(out, llama, "cp4", cp=4),
        "cp2_tp2": lambda: run_layout(out, llama, "cp2_tp2", cp=2, tp=2),
        "cp2_tp2_sp": lambda: run_layout(out, llama, "cp2_tp2_sp", cp=2, tp=2, sp=True),
        "cp2_pp2": lambda: run_layout(out, llama, "cp2_pp2", cp=2, pp=2),
        "cp2_pp2_vpp2": lambda: run_layout(out, llama, "cp2_pp2_vpp2", cp=2, pp=2, vpp=2),
        "cp2_distopt": lambda: run_layout(out, llama, "cp2_distopt", grads=False, cp=2,
                                          distopt=True),
        "cp2_recompute": lambda: run_layout(out, llama, "cp2_recompute", cp=2, recompute=full),
        "recompute_block": lambda: run_layout(out, llama, "recompute_block", recompute=block),
        "recompute_selective": lambda: run_layout(out, llama, "recompute_selective",
                                                  recompute=selective),
        "sparse_cp1": lambda: run_layout(out, llama, "sparse_cp1", sparse=True),
        "sparse_cp2": lambda: run_layout(out, llama, "sparse_cp2", sparse=True, cp=2),
        "qwen2_cp1": lambda: run_layout(out, qwen2, "qwen2_cp1"),
        "qwen2_cp2_pp2": lambda: run_layout(out, qwen2, "qwen2_cp2_pp2", cp=2, pp=2),
        "qwen3_cp1": lambda: run_layout(out, qwen3, "qwen3_cp1"),
        "qwen3_cp2_tp2": lambda: run_layout(out, qwen3, "qwen3_cp2_tp2", cp=2, tp=2),
        "checkpoint": lambda: run_checkpoint(out, llama, out / "ckpt"),
        "collective_timeout": lambda: run_collective_timeout(out),
    }


def main() -> None:
    out, hf_root = Path(sys.argv[1]), Path(sys.argv[2])
    run_cases(cases(out, hf_root), set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    apply_compat()  # the entry point's one explicit call (no-op with CUDA)
    main()
