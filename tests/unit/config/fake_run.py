"""A whole run of the real trainer code (``trainer.run.run``: SFT, stages, evaluation, checkpoints,
summary) on fakes at the two heavy boundaries, for the config walk (``test_every_key_acts.py``).

* :class:`BigramPolicy` stands for the Megatron policy: a bigram model ``theta[V, V]`` with the
  policy's interface (log-probs at a temperature, ``train_step(batch, loss_fn)`` with a real
  backward pass and an SGD step at the set learning rate, export, checkpoints).
* :class:`BigramEngine` stands for vLLM: it samples from the last synced ``theta`` with the asked
  temperature / top-k / top-p / seed, returns processed log-probs (plus a fixed "precision" error,
  so train and inference differ as they do on real hardware) and greedy outputs at T = 0.

Everything else is the product: the loop and its phases, the algorithms, the reward manager (with a
cheap in-process style registered here), the data loader, the run directory, the tracker, the
in-process weight sync. The transcript of a run (what each fake was asked, the logged metrics, the
files written) is what a config key must change.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_rl.envs import Environment, StepResult, register_env
from megatron_rl.models.batch import LOSS_MASK, MicroBatch, SequenceBatch, pad_token_fields
from megatron_rl.rewards import Outcome, register_reward
from megatron_rl.rollout import Completion, RolloutEngine, SamplingSpec
from megatron_rl.rollout.streaming import GroupStream

STYLE = "walk_digits"
ENV = "walk_env"


@register_reward(STYLE)
def walk_digits(item, cfg) -> Outcome:
    """A third per digit in the response, capped at 1: fractional rewards with group variance; the
    "answer" is the digit count (so samples agree on wrong answers, as the wrong-label rule needs)."""
    digits = sum(ch.isdigit() for ch in item.response)
    return Outcome(min(1.0, digits / 3), "correct" if digits >= 3 else "wrong" if digits else
                   "unparsable", extracted=str(digits))


def _walk_tool(turn: str) -> str:
    """The walk environment's tool: a few milliseconds' work, an answer longer than 16 characters."""
    time.sleep(0.05)
    return f"{len(turn) % 100:02d}:" + "01234567890123"  # 17 characters


@register_env(ENV)
class WalkEnv(Environment):
    """Two tool calls (each answers the turn's length), then the next turn is the answer."""

    def step(self, turn: str) -> StepResult:
        if self.calls >= 2:
            return StepResult(done=True)
        return self.use_tool("walk_tool", lambda: self.tools.call(_walk_tool, turn))


def write_data(path: Path, n: int, offset: int = 0) -> Path:
    """verl-format rows with the walk's reward style and a reference solution (for SFT)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(offset, offset + n):
            a, b = (37 * i) % 300 + 1, i % 5 + 2  # prompts of 9 to 13 tokens
            f.write(json.dumps({
                "data_source": "walk", "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "reward_model": {"ground_truth": str(a + b), "style": STYLE},
                "extra_info": {"solution": f"\\boxed{{{a + b}}}", "index": i,
                               "difficulty": {"label": "mixed" if i % 2 else "hard",
                                              "pass_rate": (i % 10) / 10}},
            }) + "\n")
    return path


class Log(list):
    """The run's transcript: (event, details) tuples, floats kept exact."""

    def add(self, *event) -> None:
        self.append(tuple(event))


def _sequence_logp(theta: torch.Tensor, seq: list[int], p: int, temperature: float):
    logits = theta[torch.tensor(seq[p - 1:-1])] / temperature
    lsm = torch.log_softmax(logits, -1)
    tok = torch.tensor(seq[p:])
    return lsm.gather(1, tok[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)


class BigramPolicy:
    def __init__(self, vocab: int, log: Log, seed: int = 0, on_step=None):
        g = torch.Generator().manual_seed(seed)
        self.on_step = on_step  # called after each optimizer step (a preemption, say)
        self.theta = (0.5 * torch.randn(vocab, vocab, generator=g)).requires_grad_(True)
        self.arch = SimpleNamespace(vocab_size=vocab)
        self.log = log
        self.lr = 0.0
        self.steps = 0

    def compute_logprobs(self, batch: SequenceBatch, temperature: float, with_entropy: bool = True,
                         routes=None):
        assert routes is None  # a dense model: nothing routes
        with torch.no_grad():
            out = [_sequence_logp(self.theta, s, p, temperature)
                   for s, p in zip(batch.sequences, batch.prompt_lens)]
        self.log.add("logprobs", temperature, len(batch))
        return [lp for lp, _ in out], ([e for _, e in out] if with_entropy else None)

    def train_step(self, batch: SequenceBatch, loss_fn, temperature: float, with_entropy: bool,
                   per_sequence=None, routes=None):
        assert routes is None  # a dense model: nothing routes
        width = max(batch.response_lens)
        rows = [_sequence_logp(self.theta, s, p, temperature)
                for s, p in zip(batch.sequences, batch.prompt_lens)]
        logp = torch.stack([torch.nn.functional.pad(lp, (0, width - lp.numel())) for lp, _ in rows])
        ent = torch.stack([torch.nn.functional.pad(e, (0, width - e.numel())) for _, e in rows])
        mask = torch.arange(width)[None, :] < torch.tensor(batch.response_lens)[:, None]
        fields = pad_token_fields(batch, list(range(len(batch))), width)
        if LOSS_MASK in fields:  # as the Megatron policy's micro-batches: tool observations untrained
            mask &= fields[LOSS_MASK]
        mb = MicroBatch(logp=logp, entropy=ent, mask=mask, fields=fields, index=torch.arange(len(batch)))
        loss, metrics = loss_fn(mb)
        if per_sequence is not None:  # what the rollout dumps get from the training forward
            per_sequence.add(mb)
            per_sequence.gather()
        self.theta.grad = None
        loss.backward()
        grad_norm = float(self.theta.grad.norm())
        with torch.no_grad():
            self.theta -= self.lr * self.theta.grad
        self.steps += 1
        self.log.add("train", [s[0] for s in batch.sequences], float(loss.detach()), temperature)
        if self.on_step is not None:
            self.on_step(self.steps)
        return {**{k: float(v) for k, v in metrics.items()}, "grad_norm": grad_norm, "lr": self.lr}

    def set_lr(self, lr: float) -> None:
        self.lr = float(lr)
        self.log.add("set_lr", self.lr)

    def export_hf_weights(self):
        yield "theta", self.theta.detach().clone()

    def export_plan(self, to_rank=None):
        return [("theta", self.theta.dtype, tuple(self.theta.shape), 0)]

    def export_owned(self, plan, placeholders=False):
        assert [item[0] for item in plan] == ["theta"], plan
        yield "theta", self.theta.detach().clone()

    def save_checkpoint(self, path) -> None:
        self.log.add("save", "/".join(Path(path).parts[-3:]))
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save({"theta": self.theta.detach().clone(), "lr": self.lr}, Path(path) / "theta.pt")

    def load_checkpoint(self, path, fresh_optimizer: bool = False) -> None:
        state = torch.load(Path(path) / "theta.pt")
        with torch.no_grad():
            self.theta.copy_(state["theta"])
        where = Path(path).parent.parent.name + "/" + Path(path).parent.name
        if fresh_optimizer:  # the weights only (plain SGD has no moments: the lr stays as it is)
            self.log.add("load_weights", where)
            return
        self.lr = state["lr"]
        self.log.add("load", where)


def _processed(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """log-probs after temperature, top-k and top-p (what vLLM's processed log-probs are)."""
    z = logits / spec.temperature
    if spec.top_k > 0:
        kth = torch.topk(z, min(spec.top_k, z.numel())).values[-1]
        z = torch.where(z < kth, torch.tensor(-math.inf), z)
    if spec.top_p < 1.0:
        order = torch.argsort(z, descending=True)
        probs = torch.softmax(z[order], -1)
        drop = (torch.cumsum(probs, -1) - probs) > spec.top_p
        z = z.clone()
        z[order[drop]] = -math.inf
    return torch.log_softmax(z, -1)


class BigramEngine(RolloutEngine):
    def __init__(self, theta: torch.Tensor, eos: int, log: Log, tokenizer, *, drop_version=False,
                 stale=False):
        self.theta = theta.detach().clone()
        self.stale = stale  # a broken engine: reports the new version, keeps computing with the old
        self.eos = eos
        self.log = log
        self.tokenizer = tokenizer
        self.drop_version = drop_version  # a broken engine: never reports the loaded version
        self.weight_version = 0

    def generate(self, prompt_ids, spec: SamplingSpec):
        self.log.add("generate", len(prompt_ids), spec.n, spec.temperature, spec.top_p, spec.top_k,
                     spec.max_tokens, spec.seed)
        out = []
        for i, prompt in enumerate(prompt_ids):
            group = []
            for j in range(spec.n):
                g = torch.Generator().manual_seed((spec.prompt_seed(i) or 0) * 31 + j)
                ids, lps, prev = [], [], prompt[-1]
                for t in range(spec.prompt_max_tokens(i)):
                    logits = self.theta[prev]
                    if spec.temperature == 0.0:
                        tok = int(torch.argmax(logits))
                        lp = float(torch.log_softmax(logits, -1)[tok])
                    else:
                        lsm = _processed(logits, spec)
                        tok = int(torch.multinomial(lsm.exp(), 1, generator=g))
                        lp = float(lsm[tok]) + 0.02 * math.sin(7 * t + j)  # engine precision
                    ids.append(tok)
                    lps.append(lp)
                    prev = tok
                    if tok == self.eos:
                        break
                truncated = ids[-1] != self.eos
                group.append(Completion(token_ids=ids, logprobs=lps,
                                        text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                        finish_reason="length" if truncated else "stop",
                                        truncated=truncated, weight_version=self.weight_version))
            out.append(group)
        return out

    def score(self, token_ids: list[int]) -> list[float]:
        lp, _ = _sequence_logp(self.theta, list(token_ids), 1, 1.0)
        return [float(x) + 1e-6 for x in lp]  # engine precision

    def update_weights(self, named_tensors, version: int) -> dict:
        new = dict(named_tensors)["theta"].clone()
        if not self.stale:
            self.theta = new
        if not self.drop_version:
            self.weight_version = version
        self.log.add("sync", version)
        return {}

    def reset_prefix_cache(self) -> None:
        pass


class BigramStream(BigramEngine, GroupStream):
    """The bigram engine as a streaming engine (what rollout.async's oversampling needs): a submit
    generates at once and delivers; nothing stays in flight."""

    keeps_in_flight = True
    can_abort = True

    def submit(self, prompt_ids, sampling, tags, on_done) -> None:
        on_done(list(zip(tags, self.generate(prompt_ids, sampling))))

    def abort(self, tags) -> None:
        pass

    def busy_seconds(self) -> float:
        return 0.0

    def in_flight(self) -> int:
        return 0


class Groups(SimpleNamespace):
    """One rank."""

    def __init__(self):
        super().__init__(rank=0, world_size=1)

    def barrier(self) -> None:
        pass


def transcript(log: Log, run_root: Path) -> dict:
    """What a run did: the fakes' calls, the logged metrics (wall-clock values dropped), the files
    it left (checkpoint contents' names) and its run state."""
    rows = []
    metrics = run_root / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            rows.append({k: v for k, v in row.items()
                         if not re.search(r"(time|timing|seconds|_s$)", k)})
    files = sorted(str(p.relative_to(run_root)) for p in run_root.rglob("*")
                   if p.is_file() and p.suffix in (".pt", ".json") and "wandb" not in p.parts)
    state = {}
    if (run_root / "run_state.json").exists():
        state = {k: v for k, v in json.loads((run_root / "run_state.json").read_text()).items()
                 if "seconds" not in k}
    return {"log": list(log), "rows": rows, "files": files, "state": state}
