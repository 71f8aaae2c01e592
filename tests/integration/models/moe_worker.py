"""torchrun worker of the Mixture-of-Experts policy tests (test_moe_parallel.py): every expert
layout in one launch (with policy_worker.py's and cp_worker.py's cases: parallel_worker.py).

Usage: torchrun --nproc-per-node 4 moe_worker.py OUT_DIR HF_ROOT [CASES]
HF_ROOT holds qwen3_moe/ and qwen2_moe/ (policy_testlib.write_hf_moe_model: 2 layers, 4 experts,
top 2). Each layout case builds the policy, computes log-probs and entropy, the final hidden states
of a fixed batch (TP = PP = CP = 1 layouts), takes one training step (with the load-balancing and
z-losses on) and saves the numbers, gradients and weights; the pytest side compares them with
float64 transformers and with the same layout at EP = 1 (the same micro-batches, so the same
objective). Layouts run packed (``policy.packed_sequences``, the default); the ``*_padded`` twins
run the padded layout, and the cases with ``replay`` also record their routes and replay others
(routing replay in both layouts). Rank 0 writes OUT_DIR/<case>.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from policy_testlib import make_batch, make_loss_fn, run_cases  # noqa: E402

from megatron_rl.compat import apply_compat  # noqa: E402
from megatron_rl.models import (OptimConfig, ParallelConfig, PolicyConfig,  # noqa: E402
                                init_distributed)
from megatron_rl.models.config import MoEConfig  # noqa: E402
from megatron_rl.models.policy import MegatronPolicy  # noqa: E402
from megatron_rl.models.routing_replay import Routes  # noqa: E402

TEMPERATURE = 0.7
LENGTHS = [12, 7, 20, 5, 16, 9, 14, 6]
PROMPTS = [4, 3, 9, 2, 1, 8, 5, 2]
LR = 1e-3
AUX, ZLOSS = 0.05, 0.01
# the hidden-state batch: two rows, right-padded
HIDDEN_IDS = [[5, 17, 33, 2, 40, 11, 9, 28, 3, 50], [7, 7, 21, 44, 13, 0, 0, 0, 0, 0]]


def _policy(hf_dir, tp=1, pp=1, cp=1, ep=1, etp=None, distopt=False, tokens=48, packed=True):
    par = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                         expert_parallel=ep, expert_tensor_parallel=etp,
                         sequence_parallel=tp > 1, use_distributed_optimizer=distopt,
                         timeout_s=120)
    cfg = PolicyConfig(parallel=par, micro_batch_tokens=tokens, layer_spec="local", packed_sequences=packed,
                       optim=OptimConfig(lr=LR, clip_grad=0.0),
                       moe=MoEConfig(aux_loss_coef=AUX, z_loss_coef=ZLOSS))
    return MegatronPolicy.from_hf(str(hf_dir), cfg, init_distributed(par))


def _export(policy, grads=False):
    it = policy.export_hf_grads() if grads else policy.export_hf_weights()
    return {name: t.clone() for name, t in it if t is not None}


def _save(out: Path, case: str, result: dict) -> None:
    if dist.get_rank() == 0:
        torch.save(result, out / f"{case}.pt")


@torch.no_grad()
def _hidden_states(policy) -> torch.Tensor:
    """The final-norm hidden states ``[b, s, h]`` of HIDDEN_IDS (every rank runs the same rows;
    the experts' all-to-all still crosses the EP ranks)."""
    from megatron_rl.models.micro_batches import MicroInputs
    from megatron_rl.models.moe_signals import padding_mask

    ids = torch.tensor(HIDDEN_IDS)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    mb = MicroInputs(index=[0, 1], input_ids=ids, position_ids=pos, pos_s=None, pos_b=None, row=None,
                     col=None, labels=None, mask=None, width=0, seq_len=ids.shape[1],
                     padding_mask=torch.tensor([[False] * 10, [False] * 5 + [True] * 5]))
    chunk = policy.model[0].module
    chunk.eval()
    hidden = chunk(ids, pos, None, padding_mask=padding_mask(mb, chunk, policy.groups))
    chunk.train()
    return hidden.transpose(0, 1).clone()


def _micro_batches(policy, batch) -> list[list[int]]:
    """The step's micro-batches (sequence indices), every data-parallel replica's, in rank order."""

    mine = [mb.index for mb in policy._micro_batches(batch)
            if not mb.dummy]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (policy.groups.dp_rank, mine))
    return [idx for _, part in sorted(dict(every).items()) for idx in part]


def run_layout(out, hf_dir, case, grads=True, hidden=False, replay=False, **layout):
    """One layout's numbers; ``replay``: the first pass also records its routes, and one more
    pass replays other routes (every recorded expert moved by one) and records what it routed."""
    policy = _policy(hf_dir, **layout)
    batch = make_batch(LENGTHS, PROMPTS)
    free = Routes(record=True) if replay else None
    logps, ents = policy.compute_logprobs(batch, TEMPERATURE, routes=free)
    routes = None
    if replay:
        forced = [(r.long() + 1) % policy.arch.moe.num_experts for r in free.recorded]
        again = Routes(replay=forced, record=True)
        forced_logps, _ = policy.compute_logprobs(batch, TEMPERATURE, with_entropy=False, routes=again)
        routes = {"recorded": free.recorded, "forced": forced, "replayed": again.recorded,
                  "logps": forced_logps}
    states = _hidden_states(policy) if hidden else None
    micro = _micro_batches(policy, batch)
    metrics = policy.train_step(batch, make_loss_fn(batch), TEMPERATURE, with_entropy=True)
    _save(out, case, {"logps": logps, "ents": ents, "metrics": metrics, "hidden": states,
                      "micro": micro, "grads": _export(policy, grads=True) if grads else None,
                      "weights": _export(policy), "routes": routes,
                      "packed": policy.cfg.packed_sequences})


def run_round_trip(out, hf_root):
    """HF -> Megatron -> HF before any step, at layouts that split every MoE tensor."""
    result = {}
    for arch in ("qwen3_moe", "qwen2_moe"):
        for name, layout in (("tp2_ep2", dict(tp=2, ep=2)), ("etp2_ep2", dict(ep=2, etp=2)),
                             ("pp2_ep2", dict(pp=2, ep=2))):
            result[f"{arch}/{name}"] = _export(_policy(hf_root / arch, **layout))
    _save(out, "roundtrip", result)


class RecordingEngine:
    """The in-process transport's engine side, recording what it is asked to load."""

    name = "recorder"

    def __init__(self):
        self.loaded: dict = {}
        self.weight_version = 0

    def update_weights(self, named_tensors, version: int) -> dict:
        for name, tensor in named_tensors:
            assert name not in self.loaded, f"{name} loaded twice"
            self.loaded[name] = tensor.clone()
        self.weight_version = version
        return {}


def run_owned_sync(out, hf_root):
    """The owners' export plan at expert layouts: what each rank sends, which groups its export
    gathers over and whether it receives anything point to point; then one in-process weight sync
    of that plan into a recording engine on rank 0."""
    from megatron_rl.sync.base import build_weight_sync
    from megatron_rl.sync.config import SyncConfig

    result = {}
    for name, arch, layout in (("ep2", "qwen3_moe", dict(ep=2)), ("etp2_ep2", "qwen3_moe", dict(ep=2, etp=2)),
                               ("pp2_ep2", "qwen3_moe", dict(pp=2, ep=2)),
                               ("tp2_ep2", "qwen2_moe", dict(tp=2, ep=2))):
        policy = _policy(hf_root / arch, **layout)
        g = policy.groups
        plan = policy.export_plan()
        seen = {"recv": 0, "gather_groups": set()}
        real_recv, real_gather = dist.recv, dist.gather

        def recv(*a, **k):
            seen["recv"] += 1
            return real_recv(*a, **k)

        def gather(tensor, gather_list=None, dst=0, group=None, **k):
            seen["gather_groups"].add(tuple(dist.get_process_group_ranks(group)))
            return real_gather(tensor, gather_list, dst=dst, group=group, **k)

        dist.recv, dist.gather = recv, gather
        try:
            names = [n for n, _ in policy.export_owned(plan)]
        finally:
            dist.recv, dist.gather = real_recv, real_gather
        mine = {"names": names, "recv": seen["recv"], "gather_groups": sorted(seen["gather_groups"]),
                "place": dict(pp=g.pp_rank, tp=g.tp_rank, cp=g.cp_rank, dp=g.dp_rank, ep=g.ep_rank,
                              etp=g.etp_rank, edp=g.edp_rank),
                "tp_ranks": list(g.tp_ranks), "etp_ranks": list(g.etp_ranks)}
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        engine = RecordingEngine() if g.rank == 0 else None
        sync = build_weight_sync(SyncConfig(transport="inprocess", verify=False),
                                 [engine] if engine else None, rank=g.rank, metadata=plan)
        sync.sync(policy.export_owned(plan, placeholders=sync.placeholders), 1)
        result[name] = {"arch": arch, "ranks": ranks, "loaded": engine.loaded if engine else None,
                        "senders": sorted({i.sender for i in plan})}
    _save(out, "owned_sync", result)


def run_checkpoint(out, hf_dir, ckpt_root):
    """Saved at EP=2 after a step, resumed at EP=1, saved there after another step and resumed
    at EP=2, EP=4 and expert TP=2 x EP=2 (TP=1, DP=4 throughout: the same micro-batches, so the same
    steps)."""
    batch = make_batch(LENGTHS, PROMPTS, seed=5)
    loss_fn = make_loss_fn(batch)

    def step(policy):
        policy.train_step(batch, loss_fn, TEMPERATURE, with_entropy=True)
        return _export(policy)

    a = _policy(hf_dir, ep=2)
    a_step1 = step(a)
    a.save_checkpoint(ckpt_root / "moe_ep2")
    a_step2 = step(a)
    a_step3 = step(a)
    b = _policy(hf_dir, ep=1)
    b.load_checkpoint(ckpt_root / "moe_ep2")
    b_loaded = _export(b)
    b_step2 = step(b)
    b.save_checkpoint(ckpt_root / "moe_ep1")
    c = _policy(hf_dir, ep=2)
    c.load_checkpoint(ckpt_root / "moe_ep1")
    c_loaded = _export(c)
    c_step3 = step(c)
    resumed = {}  # the EP=1 checkpoint at the other expert layouts of 4 ranks
    for name, layout in (("ep4", dict(ep=4)), ("etp2_ep2", dict(ep=2, etp=2))):
        d = _policy(hf_dir, **layout)
        d.load_checkpoint(ckpt_root / "moe_ep1")
        resumed[name] = {"loaded": _export(d), "step3": step(d), "steps": d.steps}
    _save(out, "checkpoint", {"a_step1": a_step1, "a_step2": a_step2, "a_step3": a_step3,
                              "b_loaded": b_loaded, "b_step2": b_step2, "c_loaded": c_loaded,
                              "c_step3": c_step3, "steps": (b.steps, c.steps), "resumed": resumed})


def run_bad_layouts(out, hf_root):
    """Impossible expert layouts: a ConfigError naming the values, and no model is ever built."""
    from megatron_rl.config.base import ConfigError
    from megatron_rl.models import gpt

    built = []
    original = gpt.build_model_chunks
    gpt.build_model_chunks = lambda *a, **k: built.append(a) or original(*a, **k)
    errors = {}
    cases = {"ep3": (hf_root / "qwen3_moe", dict(ep=3)),
             "ep8": (hf_root / "qwen3_moe", dict(ep=8)),
             "etp3": (hf_root / "qwen3_moe", dict(ep=1, etp=3)),
             "ep2_dense": (hf_root / "llama", dict(ep=2))}
    try:
        for name, (hf_dir, layout) in cases.items():
            try:
                _policy(hf_dir, **layout)
            except ConfigError as exc:
                errors[name] = (exc.key, str(exc))
        try:  # MoE with TP needs sequence parallelism
            par = ParallelConfig(tensor_parallel=2, expert_parallel=2, timeout_s=120)
            MegatronPolicy.from_hf(str(hf_root / "qwen3_moe"), PolicyConfig(parallel=par),
                                   init_distributed(par))
        except ConfigError as exc:
            errors["tp2_no_sp"] = (exc.key, str(exc))
    finally:
        gpt.build_model_chunks = original
    _save(out, "bad_layouts", {"errors": errors, "built": len(built)})


def cases(out: Path, hf_root: Path) -> dict:
    """Every case of this worker, by name (results under ``out``)."""
    q3, q2 = hf_root / "qwen3_moe", hf_root / "qwen2_moe"
    return {
        "ep1": lambda: run_layout(out, q3, "ep1", hidden=True),
        "ep2": lambda: run_layout(out, q3, "ep2", hidden=True, replay=True, ep=2),
        "ep2_padded": lambda: run_layout(out, q3, "ep2_padded", replay=True, ep=2, packed=False),
        "ep4": lambda: run_layout(out, q3, "ep4", ep=4),
        "etp2_ep2": lambda: run_layout(out, q3, "etp2_ep2", hidden=True, ep=2, etp=2),
        "tp2_ep1": lambda: run_layout(out, q3, "tp2_ep1", tp=2),
        "tp2_ep2": lambda: run_layout(out, q3, "tp2_ep2", replay=True, tp=2, ep=2),
        "pp2_ep1": lambda: run_layout(out, q3, "pp2_ep1", pp=2),
        "pp2_ep2": lambda: run_layout(out, q3, "pp2_ep2", replay=True, pp=2, ep=2),
        "pp2_ep2_padded": lambda: run_layout(out, q3, "pp2_ep2_padded", replay=True, pp=2, ep=2,
                                             packed=False),
        "cp2_ep1": lambda: run_layout(out, q3, "cp2_ep1", cp=2),
        "cp2_ep2_distopt": lambda: run_layout(out, q3, "cp2_ep2_distopt", grads=False, cp=2, ep=2,
                                              distopt=True, replay=True),
        "cp2_ep2_padded": lambda: run_layout(out, q3, "cp2_ep2_padded", replay=True, cp=2, ep=2,
                                             packed=False),
        "qwen2_tp2_ep2": lambda: run_layout(out, q2, "qwen2_tp2_ep2", tp=2, ep=2),
        "roundtrip": lambda: run_round_trip(out, hf_root),
        "owned_sync": lambda: run_owned_sync(out, hf_root),
        "checkpoint": lambda: run_checkpoint(out, q3, out / "ckpt"),
        "bad_layouts": lambda: run_bad_layouts(out, hf_root),
    }


def main() -> None:
    out, hf_root = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    run_cases(cases(out, hf_root), set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    apply_compat()  # the entry point's one explicit call (no-op with CUDA)
    main()
