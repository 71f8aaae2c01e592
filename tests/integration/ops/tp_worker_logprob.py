"""Run under torchrun (gloo, 2 ranks): vocab-parallel fused_logprob_entropy equals the unsplit op.

Every rank builds the same full inputs from a seed, keeps its vocabulary shard of the weight and runs
the op with the TP group; the reference is the same op on the full weight without a group (the TP=1
result) plus a float64 full-softmax check. Exits non-zero with a message on the first mismatch.
"""

import sys

import torch
import torch.distributed as dist

from megatron_rl.ops import fused_logprob_entropy, processed_logprobs


def check(name, ours, ref, tol):
    err = (ours.double() - ref.double()).abs().max().item()
    scale = max(ref.double().abs().max().item(), 1.0)
    if not err <= tol * scale:
        raise AssertionError(f"rank {dist.get_rank()} {name}: max err {err:.3g} > {tol * scale:.3g}")


def run_case(n, h, v, temperature, dtype, compute_entropy, use_ent_grad, chunks, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 2 / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[:: 5] = -100
    labels[1] = 0  # first row of rank 0's shard
    labels[2] = v - 1  # last row of the last shard
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    v_local = v // world
    kw = dict(temperature=temperature, compute_entropy=compute_entropy, backend="torch",
              chunk_tokens=chunks[0], chunk_vocab=chunks[1])

    def run(w_full_or_shard, group):
        hh = hidden.clone().requires_grad_()
        ww = w_full_or_shard.clone().requires_grad_()
        logp, ent = fused_logprob_entropy(hh, ww, labels, tp_group=group, **kw)
        loss = (logp * g_logp).sum()
        if compute_entropy and use_ent_grad:
            loss = loss + (ent * g_ent).sum()
        loss.backward()
        return logp.detach(), ent, hh.grad, ww.grad

    shard = weight[rank * v_local:(rank + 1) * v_local]
    tp = run(shard, dist.group.WORLD)
    one = run(weight, None)
    tag = f"case n={n} v={v} T={temperature} {dtype} ent={compute_entropy}/{use_ent_grad}"
    check(f"{tag} logp", tp[0], one[0], 1e-5)
    if compute_entropy:
        check(f"{tag} entropy", tp[1], one[1], 1e-5)
    else:
        assert tp[1] is None
    gtol = 1e-5 if dtype == torch.float32 else 1e-2
    check(f"{tag} grad_hidden", tp[2], one[2], gtol)
    check(f"{tag} grad_weight shard", tp[3], one[3][rank * v_local:(rank + 1) * v_local], gtol)
    # the TP=1 result itself against float64
    z = (hidden.double() @ weight.double().T) / temperature
    lp = torch.log_softmax(z, -1)
    valid = labels != -100
    ref_logp = torch.where(valid, lp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    check(f"{tag} logp vs float64", tp[0], ref_logp, 2e-5)
    if compute_entropy:
        ref_ent = torch.where(valid, -(lp.exp() * lp).sum(-1), 0.0)
        check(f"{tag} entropy vs float64", tp[1], ref_ent, 2e-5)


def run_processed_case(seed):
    """processed_logprobs with the weight split over the group equals the unsplit call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    n, h, v = 26, 16, 64
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 3 / h**0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[3] = -100
    g_logp = torch.randn(n, generator=g)
    v_local = v // world

    def run(w, group):
        hh, ww = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        logp = processed_logprobs(hh, ww, labels, temperature=0.9, top_k=12, top_p=0.8,
                                  tp_group=group, chunk_tokens=10)
        (logp * g_logp).sum().backward()
        return logp.detach(), hh.grad, ww.grad

    tp = run(weight[rank * v_local:(rank + 1) * v_local], dist.group.WORLD)
    one = run(weight, None)
    check("processed logp", tp[0], one[0], 1e-5)
    check("processed grad_hidden", tp[1], one[1], 1e-5)
    check("processed grad_weight shard", tp[2], one[2][rank * v_local:(rank + 1) * v_local], 1e-5)


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    cases = [
        # n, h, v, T, dtype, compute_entropy, use_ent_grad, (chunk_tokens, chunk_vocab)
        (48, 16, 128, 1.0, torch.float32, True, True, (16, 32)),
        (37, 24, 202, 0.7, torch.float32, True, True, (10, 33)),  # non-divisible tiles
        (29, 16, 90, 1.5, torch.float32, False, False, (8, 1000)),
        (31, 16, 96, 1.2, torch.float32, True, False, (31, 7)),
        (40, 32, 160, 0.9, torch.bfloat16, True, True, (12, 40)),
    ]
    for i, case in enumerate(cases):
        run_case(*case, seed=100 + i)
    run_processed_case(seed=7)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"OK {len(cases)} vocab-parallel cases + processed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except AssertionError as exc:
        print(f"FAIL {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
