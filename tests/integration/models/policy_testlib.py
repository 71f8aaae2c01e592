"""Shared by the policy tests (in-process and torchrun workers): tiny HF models written with
transformers, batches, a test loss, and the float64 transformers reference for all of it."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 61  # deliberately not a multiple of 2: exercises vocabulary padding at TP=2
# A batch of six sequences (total lengths, prompt lengths) with uneven responses.
LENGTHS = [12, 7, 20, 5, 16, 9]
PROMPTS = [4, 3, 9, 2, 1, 8]


def write_hf_model(out_dir: str | Path, arch: str, *, tie: bool = False, vocab: int = VOCAB,
                   layers: int = 4, heads: int = 4, kv_heads: int = 2, hidden: int = 32,
                   seed: int = 0) -> Path:
    """A tiny random fp32 HF checkpoint; norms and biases perturbed so that they matter."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=48,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=5e5)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=1e6)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16)  # head_dim != hidden / heads
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(3.0)  # sharper distributions than the 0.02 init
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def write_hf_moe_model(out_dir: str | Path, arch: str = "qwen3_moe", *, experts: int = 4,
                       top_k: int = 2, layers: int = 2, vocab: int = VOCAB, hidden: int = 32,
                       heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A tiny random fp32 Mixture-of-Experts checkpoint (qwen3_moe: q/k norms, top-k renormalised;
    qwen2_moe: qkv bias, a gated shared expert, top-k not renormalised), weights sharpened and
    norms / biases perturbed so that routing and every parameter matter."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=40,
                  moe_intermediate_size=24, num_experts=experts, num_experts_per_tok=top_k,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                  router_aux_loss_coef=0.02)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=16, norm_topk_prob=True, rope_theta=1e6)
    elif arch == "qwen2_moe":
        cfg = Qwen2MoeConfig(**common, norm_topk_prob=False, shared_expert_intermediate_size=20,
                             rope_theta=1e6)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # decisive routing (no near-ties)
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.mul_(3.0)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def write_hf_models(root: str | Path) -> Path:
    """``root``/llama (untied), qwen2 (tied, qkv bias), qwen3 (q/k norms), 2 KV heads each, and the
    Mixture-of-Experts qwen3_moe and qwen2_moe (:func:`write_hf_moe_model`)."""
    root = Path(root)
    write_hf_model(root / "llama", "llama", tie=False, kv_heads=2)
    write_hf_model(root / "qwen2", "qwen2", tie=True, kv_heads=2)
    write_hf_model(root / "qwen3", "qwen3", tie=False, kv_heads=2)
    write_hf_moe_model(root / "qwen3_moe", "qwen3_moe")
    write_hf_moe_model(root / "qwen2_moe", "qwen2_moe")
    return root


def make_batch(lengths: list[int], prompt_lens: list[int], vocab: int = VOCAB, seed: int = 0):
    """A SequenceBatch with an advantage per response token and a weight per sequence."""
    from megatron_rl.models import SequenceBatch

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    adv = [torch.randn(n - p, generator=gen) for n, p in zip(lengths, prompt_lens)]
    weight = torch.rand(len(lengths), generator=gen) + 0.5
    return SequenceBatch(sequences=seqs, prompt_lens=list(prompt_lens),
                         token_fields={"adv": adv}, seq_fields={"w": weight})


ENT_COEF = 0.05


def make_loss_fn(batch, denominator: float | None = None):
    """-sum(w * adv * logp) / D - c * sum(entropy) / D over valid tokens; D = all response tokens
    of the whole batch (a global denominator, as the trainer passes)."""
    denom = float(denominator or sum(batch.response_lens))

    def loss_fn(mb):
        m = mb.mask.to(mb.logp.dtype)
        pg = -(mb.fields["w"][:, None] * mb.fields["adv"] * mb.logp * m).sum() / denom
        ent = (mb.entropy * m).sum() / denom
        loss = pg - ENT_COEF * ent
        valid = mb.logp[mb.mask]
        return loss, {"loss": loss.item(), "tokens": float(mb.mask.sum()),
                      "logp_min": valid.min().item(), "logp_max": valid.max().item()}

    return loss_fn


def seq_means(mb) -> dict[str, torch.Tensor]:
    """Per sequence of a micro-batch view: mean log-prob and entropy of its response tokens (a
    ``PerSequence`` function for the training forward)."""
    m = mb.mask
    n = m.sum(1).clamp(min=1)
    return {"logp": mb.logp.masked_fill(~m, 0.0).sum(1) / n,
            "ent": mb.entropy.masked_fill(~m, 0.0).sum(1) / n}


def load_hf_float64(hf_dir: str | Path):
    """The transformers model in float64, eval mode (MoE experts: the eager per-expert loop; the
    default grouped-GEMM path has no float64 kernel)."""
    import json

    from transformers import AutoModelForCausalLM

    moe = "moe" in json.loads((Path(hf_dir) / "config.json").read_text())["model_type"]
    kwargs = {"experts_implementation": "eager"} if moe else {}
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, **kwargs).eval()


def hf_reference(hf_dir: str | Path, batch, temperature: float, grads: bool = True):
    """float64 transformers: per-sequence response log-probs and entropies, the summed test loss
    and its gradient per HF parameter name."""
    model = load_hf_float64(hf_dir)
    denom = float(sum(batch.response_lens))
    logps, ents, total = [], [], 0.0
    model.zero_grad()
    for i, (seq, p) in enumerate(zip(batch.sequences, batch.prompt_lens)):
        logits = model(torch.tensor([seq])).logits[0] / temperature
        logsm = torch.log_softmax(logits, dim=-1)[p - 1: len(seq) - 1]
        lp = logsm.gather(1, torch.tensor(seq[p:])[:, None])[:, 0]
        ent = -(logsm.exp() * logsm).sum(-1)
        loss = (-(batch.seq_fields["w"][i].double() * batch.token_fields["adv"][i].double() * lp)
                .sum() - ENT_COEF * ent.sum()) / denom
        if grads:
            loss.backward()
        total += float(loss.detach())
        logps.append(lp.detach())
        ents.append(ent.detach())
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if model.config.tie_word_embeddings:
        g.pop("lm_head.weight", None)
    return logps, ents, total, g


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
               for x, y in zip(a, b))


def torchrun(script: str | Path, *args: str, nproc: int = 4, timeout: float = 900,
             env: dict | None = None) -> None:
    """Run ``script args`` under ``torchrun --nproc-per-node nproc`` on a free port with this
    checkout on PYTHONPATH; fail with the end of its output if it fails."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = str(Path(__file__).resolve().parents[3])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    print("".join(line + "\n" for line in proc.stdout.splitlines() if line.startswith("case ")))


def thread_count() -> int:
    """This process's threads, native ones included (gloo's live in C++, not in ``threading``)."""
    import os

    return len(os.listdir("/proc/self/task"))


def run_cases(cases: dict, only: set[str] | None) -> None:
    """Worker side: run the named cases (all, or those in ``only``), print each one's time on rank
    0, then end the process group."""
    import time

    import torch.distributed as dist

    for name, fn in cases.items():
        if only and name not in only:
            continue
        t0 = time.time()
        fn()
        if dist.get_rank() == 0:
            print(f"case {name}: {time.time() - t0:.1f}s, {thread_count()} threads", flush=True)
    dist.barrier()
    dist.destroy_process_group()
