"""The framework's own overhead against the libraries alone, in one run (the CPU demo's settings).

1. **Rollout**: tokens/s of the trainer's generation path (the rollout scheduler of the synchronous
   loop: one wave of ``rollout_batch_size`` prompts x ``group_size`` samples through the in-process
   engine, every completion turned into our ``Completion`` with its per-token log-probs and seed)
   vs vLLM's offline ``LLM.generate`` on the same prompts on the same engine (one ``SamplingParams``
   with the same n / temperature / max_tokens / logprobs, what a vLLM user writes). Scoring is not
   counted. Target: ours >= 0.9x.
2. **Update**: one optimizer step on that rollout's sequences (every completion of the wave, the
   demo's advantages) through the policy's ``train_step`` (Megatron-Core: its schedule, DDP buffers,
   optimizer, our fused log-prob + entropy) vs a plain PyTorch loop over the same Hugging Face model:
   one right-padded batch through ``transformers``' forward, log-softmax at the temperature, the
   sampled tokens' log-probs and the entropy, **the same loss function** (``phases.make_loss_fn``:
   the demo's GRPO objective with its entropy term), backward, gradient clipping and ``AdamW`` with
   the same settings. Target: ours <= 1.3x.

Both sides alternate ``--repeats`` times (medians); the engine, the policy and the HF model live in
this one process, one thread (``--threads``), pinned to one core when ``--core`` is given. The model
is the demo's tiny Llama (``--model``: a Hugging Face directory, e.g. the A/B benchmark's SFT
weights ``runs/bench_ab/sft/stage1_12/final/hf``; default: a fresh random one). The last line is one
JSON object.

    python benchmarks/overhead.py [--model DIR] [--repeats 5] [--core 1] [key.sub=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "demo_cpu.yaml"
STAGE = "stage1_12"


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


def plain_update(model, opt, batch, loss_fn, temperature: float, clip: float) -> None:
    """The plain PyTorch step: one padded batch, the same loss, clip, AdamW."""
    import torch

    from megatron_rl.models.batch import MicroBatch, pad_token_fields

    seqs, plens = batch.sequences, batch.prompt_lens
    b, s = len(seqs), max(len(x) for x in seqs)
    ids = torch.zeros(b, s, dtype=torch.long)
    attn = torch.zeros(b, s, dtype=torch.long)
    for r, x in enumerate(seqs):
        ids[r, : len(x)] = torch.tensor(x)
        attn[r, : len(x)] = 1
    width = max(len(x) - p for x, p in zip(seqs, plens))
    # response token j of row r is predicted at position plens[r] - 1 + j
    col = torch.arange(width)[None, :]
    pos = (torch.tensor(plens)[:, None] - 1 + col).clamp(max=s - 2)
    mask = col < torch.tensor([len(x) - p for x, p in zip(seqs, plens)])[:, None]
    labels = ids.gather(1, pos + 1)
    opt.zero_grad(set_to_none=True)
    logsm = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float() / temperature, dim=-1)
    logsm = logsm.gather(1, pos[..., None].expand(-1, -1, logsm.shape[-1]))  # [b, T, V]
    logp = logsm.gather(-1, labels[..., None])[..., 0]
    entropy = -(logsm.exp() * logsm).sum(-1)
    fields = pad_token_fields(batch, list(range(b)), width)
    view = MicroBatch(logp=logp, entropy=entropy, mask=mask, fields=fields, index=torch.arange(b))
    loss, _ = loss_fn(view)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="Hugging Face model directory (default: a fresh tiny one)")
    ap.add_argument("--data", default=None, help="train.jsonl of the demo's task (default: generated)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--core", type=int, default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides on the demo's (key.sub=value)")
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(args.core)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    torch.set_num_threads(args.threads)
    from megatron_rl.compat import apply_compat
    from megatron_rl.data import PromptLoader
    from megatron_rl.data.dataset import load_prompts
    from megatron_rl.demo.inputs import prepare_inputs, tiny_model_dir
    from megatron_rl.models import ParallelConfig, init_distributed
    from megatron_rl.models.policy import MegatronPolicy
    from megatron_rl.rewards import RewardManager
    from megatron_rl.rollout.vllm_engine import VLLMEngine
    from megatron_rl.trainer import phases
    from megatron_rl.trainer.async_rollout import RolloutScheduler
    from megatron_rl.trainer.grpo import StepTimer
    from megatron_rl.trainer.schema import load_run_config, max_sequence_len

    apply_compat()
    cfg = load_run_config(CONFIG, ["tracking.wandb_mode=disabled", *args.overrides])
    stage = cfg.stage(STAGE)
    r = cfg.rollout
    print(f"load average before: {loadavg()} (shared 2-core machine; ratios within this run)", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="overhead_bench_")
    model, data = args.model, args.data
    if model is None or data is None:
        prepare_inputs(tmp.name, tiny=cfg.model.tiny, synthetic=cfg.synthetic, seed=cfg.trainer.seed)
        model = model or str(tiny_model_dir(tmp.name))
        data = data or str(Path(tmp.name) / "data" / "train.jsonl")
    engine = VLLMEngine(model, r, seed=0, max_model_len=max_sequence_len(cfg))
    records, _ = load_prompts(data, engine.tokenizer, cfg.data, max_prompt_len=r.max_prompt_len)
    rewards = RewardManager(cfg.reward)

    # -- 1. rollout ---------------------------------------------------------------------------------
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    plain_params = SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p,
                                  max_tokens=stage.max_response_len, logprobs=0)
    loader = PromptLoader(records, r.rollout_batch_size, seed=0)
    sched = RolloutScheduler(engine, loader, rewards, r, cfg.algo, run_seed=cfg.trainer.seed,
                             max_response_len=stage.max_response_len)
    ours_t, plain_t, ours_tok, plain_tok = [], [], [], []
    ro = None
    for rep in range(args.repeats + 1):  # the first of each is a warm-up
        timer = StepTimer()
        t0 = time.perf_counter()
        ro, _ = sched.next_rollout(rep, rep, 0, timer)
        elapsed = time.perf_counter() - t0 - timer.parts.get("reward", 0.0)
        tokens = sum(len(c.token_ids) for c in ro.completions)
        prompts = [TokensPrompt(prompt_token_ids=list(rec.prompt_ids)) for rec in ro.records]
        t0 = time.perf_counter()
        outs = engine.llm.generate(prompts, plain_params, use_tqdm=False)
        plain_elapsed = time.perf_counter() - t0
        if rep:
            ours_t.append(elapsed)
            ours_tok.append(tokens)
            plain_t.append(plain_elapsed)
            plain_tok.append(sum(len(c.token_ids) for o in outs for c in o.outputs))
    ours_rate = statistics.median(n / t for n, t in zip(ours_tok, ours_t))
    plain_rate = statistics.median(n / t for n, t in zip(plain_tok, plain_t))
    print(f"\n1. rollout, {r.rollout_batch_size} prompts x {r.group_size} samples, up to "
          f"{stage.max_response_len} tokens ({args.repeats} waves each, medians)")
    print(f"   ours  (rollout scheduler -> engine -> completions): {statistics.median(ours_t):.3f} s, "
          f"{ours_rate:,.0f} tokens/s")
    print(f"   vLLM  LLM.generate:                                {statistics.median(plain_t):.3f} s, "
          f"{plain_rate:,.0f} tokens/s")
    print(f"   ours / vLLM tokens/s {ours_rate / plain_rate:.3f} (target >= 0.9)", flush=True)

    # -- 2. update ----------------------------------------------------------------------------------
    from transformers import AutoModelForCausalLM

    batch, _ = phases.make_batch(ro, cfg.algo)
    if batch is None:  # every group without reward variance (a random model): train on all of it
        batch, _ = phases.make_batch(ro, dataclasses.replace(cfg.algo, filter_zero_variance_groups=False))
    alpha = cfg.algo.entropy.coef_max  # the entropy term on (the demo's controller moves within [0, max])
    loss_fn = phases.make_loss_fn(batch, cfg.algo, alpha=alpha, max_response_len=stage.max_response_len)
    groups = init_distributed(ParallelConfig())
    policy = MegatronPolicy.from_hf(model, cfg.policy, groups)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    o = cfg.policy.optim
    opt = torch.optim.AdamW(hf.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay)
    ours_u, plain_u = [], []
    for rep in range(args.repeats + 1):
        t0 = time.perf_counter()
        policy.train_step(batch, loss_fn, r.temperature, with_entropy=True)
        t1 = time.perf_counter()
        plain_update(hf, opt, batch, loss_fn, r.temperature, o.clip_grad)
        t2 = time.perf_counter()
        if rep:
            ours_u.append(t1 - t0)
            plain_u.append(t2 - t1)
    tokens = sum(len(s) for s in batch.sequences)
    u_ours, u_plain = statistics.median(ours_u), statistics.median(plain_u)
    print(f"\n2. update, {len(batch)} sequences ({tokens} tokens), one optimizer step "
          f"(policy.packed_sequences={cfg.policy.packed_sequences})")
    print(f"   ours  (MegatronPolicy.train_step): {u_ours:.3f} s")
    print(f"   plain PyTorch over transformers:   {u_plain:.3f} s")
    print(f"   ours / plain time {u_ours / u_plain:.3f} (target <= 1.3)")
    print(f"load average after: {loadavg()}")
    rewards.close()
    engine.close()
    print(json.dumps({"rollout_tokens_per_s_ratio": round(ours_rate / plain_rate, 4),
                      "rollout_tokens_per_s": {"ours": round(ours_rate), "vllm": round(plain_rate)},
                      "update_time_ratio": round(u_ours / u_plain, 4),
                      "update_s": {"ours": round(u_ours, 4), "plain": round(u_plain, 4)},
                      "sequences": len(batch), "tokens": tokens, "repeats": args.repeats,
                      "packed_sequences": cfg.policy.packed_sequences, "threads": args.threads,
                      "load_average": float(loadavg())}))


if __name__ == "__main__":
    main()
