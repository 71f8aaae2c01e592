"""Packed vs padded sequences on the policy's update, on a long-tailed length mix, in one run.

A batch of ``--sequences`` sequences = a ``--prompt``-token prompt + a response whose length is
lognormal, scaled so that the longest is exactly ``--tail`` (8) x the median (reasoning responses'
shape: most near the median, a few very long), through the policy's own ``train_step`` (forward,
backward, one Adam step; the tiny demo architecture, ``--hidden`` wide, one rank) with
``policy.packed_sequences`` false (today's layout: one right-padded row per sequence, micro-batches
of similar lengths under the token budget) and true (the sequences of a micro-batch in one row,
attention within each). The token budget is ``--budget-ratio`` (4) x the longest sequence, the ratio
of the 7B recipe's stage 1 (32768 tokens for 8k responses). Prints:

- the share of padded positions in today's layout (and in the packed one: the tail segments only);
- update tokens/s (real tokens / ``train_step`` wall time; median of ``--repeats``, the two layouts
  alternated) for both, and their ratio (target >= 1.3);
- the log-prob pass (``compute_logprobs``, forward only) the same way;
- peak memory of one ``train_step`` (bytes the CPU allocator held over its start, from the PyTorch
  profiler's allocation events, as ``benchmarks/context_parallel.py`` measures);
- the largest log-prob difference between the layouts (they compute the same function).

The last line is one JSON object. The box is shared: the load average is printed before and after.

    python benchmarks/packing.py [--sequences 64] [--median 192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0]


def long_tailed(n: int, median: int, tail: float, seed: int) -> list[int]:
    """``n`` lognormal lengths rescaled (a power of the ratio to their median) so that the
    median is ``median`` and the longest exactly ``tail`` x the median."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(0.9 * torch.randn(n, generator=g, dtype=torch.float64))
    ratio = x / statistics.median(x.tolist())
    power = math.log(tail) / math.log(float(ratio.max()))
    return [max(1, round(median * float(r) ** power)) for r in ratio]


def make_batch(lengths: list[int], prompt: int, vocab: int, seed: int):
    from megatron_rl.models import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (prompt + n,), generator=g).tolist() for n in lengths]
    adv = [torch.randn(n, generator=g) for n in lengths]
    return SequenceBatch(sequences=seqs, prompt_lens=[prompt] * len(seqs), token_fields={"adv": adv})


def loss_for(batch):
    denom = float(sum(batch.response_lens))

    def loss_fn(mb):
        m = mb.mask.to(mb.logp.dtype)
        loss = -(mb.fields["adv"] * mb.logp * m).sum() / denom - 1e-3 * (mb.entropy * m).sum() / denom
        return loss, {"loss": loss.item()}

    return loss_fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--median", type=int, default=192, help="median response length")
    ap.add_argument("--tail", type=float, default=8.0, help="longest response / median")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--budget-ratio", type=float, default=4.0, help="micro_batch_tokens / longest sequence")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from context_parallel import peak_bytes

    from megatron_rl.compat import apply_compat
    from megatron_rl.demo.config import TinySpec
    from megatron_rl.demo.tiny import write_tiny_model
    from megatron_rl.models import OptimConfig, ParallelConfig, PolicyConfig, init_distributed
    from megatron_rl.models.policy import MegatronPolicy

    apply_compat()
    torch.set_num_threads(1)
    print(f"load average before: {loadavg()} (shared 2-core machine; times are upper bounds)", flush=True)
    lengths = long_tailed(args.sequences, args.median, args.tail, args.seed)
    longest = args.prompt + max(lengths)
    budget = int(args.budget_ratio * longest)
    groups = init_distributed(ParallelConfig())
    with tempfile.TemporaryDirectory(prefix="packing_bench_") as tmp:
        spec = TinySpec(seed=0, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                        num_layers=args.layers, max_position_embeddings=longest + 8)
        hf = write_tiny_model(Path(tmp) / "tiny", spec)
        policies = {}
        for packed in (False, True):
            cfg = PolicyConfig(micro_batch_tokens=budget, packed_sequences=packed,
                               optim=OptimConfig(lr=1e-5, clip_grad=0.0))
            policies["packed" if packed else "padded"] = MegatronPolicy.from_hf(str(hf), cfg, groups)
        vocab = policies["padded"].arch.vocab_size
    batch = make_batch(lengths, args.prompt, vocab, args.seed)
    loss_fn = loss_for(batch)
    real = sum(len(s) for s in batch.sequences)
    layouts = {name: p._micro_batches(batch) for name, p in policies.items()}
    positions = {name: sum(mb.input_ids.numel() for mb in mbs) for name, mbs in layouts.items()}
    print(f"{len(lengths)} sequences: prompt {args.prompt} + response median {statistics.median(lengths):.0f}, "
          f"longest {max(lengths)} ({max(lengths) / statistics.median(lengths):.1f}x), {real} tokens; "
          f"micro_batch_tokens {budget} (= {args.budget_ratio:g} x the longest sequence)")
    for name in ("padded", "packed"):
        print(f"  {name}: {len(layouts[name])} micro-batches, {positions[name]} positions, "
              f"{1 - real / positions[name]:.1%} padding")

    # warm-up (Adam's state, kernels), then the layouts alternated
    for p in policies.values():
        p.train_step(batch, loss_fn, 1.0, with_entropy=True)
    times = {n: [] for n in policies}
    fwd = {n: [] for n in policies}
    logps = {}
    for _ in range(args.repeats):
        for name, p in policies.items():
            t0 = time.perf_counter()
            p.train_step(batch, loss_fn, 1.0, with_entropy=True)
            times[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            logps[name], _ = p.compute_logprobs(batch, 1.0, with_entropy=False)
            fwd[name].append(time.perf_counter() - t0)
    peaks = {name: peak_bytes(lambda p=p: p.train_step(batch, loss_fn, 1.0, with_entropy=True))[0]
             for name, p in policies.items()}
    diff = max(float((a - b).abs().max()) for a, b in zip(logps["padded"], logps["packed"]))
    t = {n: statistics.median(v) for n, v in times.items()}
    f = {n: statistics.median(v) for n, v in fwd.items()}
    print(f"\n| layout | padding share | update s | update tokens/s | log-prob s | log-prob tokens/s | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for name in ("padded", "packed"):
        print(f"| {name} | {1 - real / positions[name]:.1%} | {t[name]:.3f} | {real / t[name]:,.0f} | "
              f"{f[name]:.3f} | {real / f[name]:,.0f} | {peaks[name] / 2**20:.1f} |")
    ratio = t["padded"] / t["packed"]
    print(f"\nupdate tokens/s packed / padded: {ratio:.2f} (target >= 1.3); log-prob pass "
          f"{f['padded'] / f['packed']:.2f}; peak memory packed / padded {peaks['packed'] / peaks['padded']:.2f}; "
          f"log-probs max |diff| {diff:.1e}")
    print(f"load average after: {loadavg()}")
    print(json.dumps({"padded_share_today": round(1 - real / positions["padded"], 4),
                      "padded_share_packed": round(1 - real / positions["packed"], 4),
                      "update_tokens_per_s_ratio": round(ratio, 3),
                      "update_tokens_per_s": {n: round(real / t[n]) for n in t},
                      "logprob_tokens_per_s_ratio": round(f["padded"] / f["packed"], 3),
                      "peak_mib": {n: round(v / 2**20, 1) for n, v in peaks.items()},
                      "max_abs_logprob_diff": diff, "micro_batch_tokens": budget, "tokens": real,
                      "sequences": len(lengths), "longest_over_median": round(max(lengths) / statistics.median(lengths), 2),
                      "repeats": args.repeats, "load_average": float(loadavg())}))


if __name__ == "__main__":
    main()
