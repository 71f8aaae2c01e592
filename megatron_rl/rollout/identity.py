"""Is the server at a URL a vLLM server the trainer can drive, serving the policy's model?

Checked when the trainer connects, before the first request or weight update, so a wrong URL or a
server started for another model is one line naming the config key, the URL and what is wrong
(:class:`~megatron_rl.config.base.ConfigError`), not a timeout or an HTTP 500 at the first sync:

- :func:`health_answer`: what ``GET /health`` got. A connection refused, a timeout or a 5xx may
  be a server still starting (keep waiting); any other HTTP answer is a service that is not vLLM
  (another program on that port, a proxy's 404): refused at once, saying what it answered.
- :func:`check_service`: the routes the trainer drives answer: ``/v1/models`` (the OpenAI server),
  ``/is_paused`` (the RL and dev routes: ``VLLM_SERVER_DEV_MODE=1``) and ``/inference/v1/generate``
  (token in / token out: ``--enable-scale-out``).
- :func:`check_model`: the model it serves has the policy's architecture, vocabulary, hidden size
  and layer count (from vLLM's own description of the model it built, ``get_model_inspection`` on
  its workers), and holds the run's longest prompt + response (``--max-model-len``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import httpx

from megatron_rl.config.base import ConfigError

GENERATE = "/inference/v1/generate"


def _said(resp: httpx.Response, most: int = 160) -> str:
    """A server's answer on one line: status and the start of its body."""
    body = " ".join(resp.text.split())
    return f"HTTP {resp.status_code}" + (f" {body[:most]!r}" if body else "")


def health_answer(url: str, timeout_s: float) -> tuple[bool, str]:
    """``(final, what)`` for a server that is not healthy, ``(False, "")`` for one that is.

    ``final``: the answer will not change by waiting (an HTTP answer other than 200 or 5xx: a
    service that is not vLLM, or a wrong port or path)."""
    try:
        resp = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s)
    except httpx.TimeoutException:
        return False, f"no answer to GET /health within {timeout_s:g}s"
    except httpx.HTTPError as exc:
        return False, f"GET /health failed ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
    if resp.status_code == 200:
        return False, ""
    return resp.status_code < 500, f"answered GET /health with {_said(resp)}"


def health_or_refuse(url: str, key: str, timeout_s: float) -> str:
    """``""`` when the server at ``url`` is healthy, what went wrong when it may still be starting;
    a service that is no vLLM server is refused (:class:`ConfigError` naming ``key``)."""
    final, what = health_answer(url, timeout_s)
    if final:
        raise ConfigError(key, f"{url} {what}: not a vLLM server (another service on that port, or the wrong "
                               f"port or path?)")
    return what


def check_service(url: str, key: str, timeout_s: float, who: str | None = None) -> None:
    """Refuse a server that does not answer the routes the trainer drives (see the module doc);
    ``who`` names it in the message (default: its URL)."""
    base = url.rstrip("/")
    who = who or url
    try:
        models = httpx.get(f"{base}/v1/models", timeout=timeout_s)
        paused = httpx.get(f"{base}/is_paused", timeout=timeout_s)
        generate = httpx.get(f"{base}{GENERATE}", timeout=timeout_s)
    except httpx.HTTPError:  # answered /health a moment ago: left to the connection's own errors
        return
    try:
        cards = models.json().get("data") if models.status_code == 200 else None
    except (ValueError, AttributeError):
        cards = None
    if not (isinstance(cards, list) and cards and all(isinstance(c, dict) and isinstance(c.get("id"), str)
                                                      for c in cards)):
        raise ConfigError(key, f"{who} answered GET /v1/models with {_said(models)}: not a vLLM server "
                               f"(another service on that port, or the wrong port or path?)")
    if paused.status_code == 404:
        raise ConfigError(key, f"{who} is a vLLM server without the RL routes (GET /is_paused: "
                               f"{_said(paused)}): start it with VLLM_SERVER_DEV_MODE=1")
    if generate.status_code == 404:
        raise ConfigError(key, f"{who} is a vLLM server without the token-in/token-out route "
                               f"(GET {GENERATE}: {_said(generate)}): start it with --enable-scale-out")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a model is, as far as serving it for a policy goes (None: not known)."""

    architecture: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None

    FIELDS = (("architecture", "architecture"), ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
              ("num_layers", "num_hidden_layers"))

    def differences(self, policy: ModelShape, same_architecture=None) -> list[str]:
        """``"<what> <served> (policy: <its>)"`` for each known field that differs."""
        out = []
        for name, label in self.FIELDS:
            mine, theirs = getattr(self, name), getattr(policy, name)
            if mine is None or theirs is None or mine == theirs:
                continue
            if name == "architecture" and same_architecture is not None and same_architecture(theirs, mine):
                continue
            out.append(f"{label} {mine} (policy: {theirs})")
        return out


def policy_shape(model_path: str | Path) -> ModelShape:
    """The policy's model from its Hugging Face ``config.json`` (fields it lacks are unknown)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return ModelShape()
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg

    def num(key):
        v = text.get(key, cfg.get(key))
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    archs = cfg.get("architectures")
    return ModelShape(architecture=archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str)
                      else None, vocab_size=num("vocab_size"), hidden_size=num("hidden_size"),
                      num_layers=num("num_hidden_layers"))


_EMBED = re.compile(r"\(embed_tokens\): \w+\((?:[^)]*?\bnum_embeddings=(?P<n>\d+))?(?:[^)]*?\bembedding_dim=(?P<d>\d+))?"
                    r"(?:[^)]*?\borg_vocab_size=(?P<v>\d+))?")
_TORCH_EMBED = re.compile(r"\(embed_tokens\): Embedding\((?P<v>\d+), (?P<d>\d+)")
_INDICES = re.compile(r"^\((?P<ranges>\d+(?:-\d+)?(?:, \d+(?:-\d+)?)*)\): ")


def inspected_shape(text: str) -> ModelShape:
    """The model vLLM built, from its ``get_model_inspection`` text (a transformers-style tree:
    ``LlamaForCausalLM(...)``, ``(embed_tokens): VocabParallelEmbedding(num_embeddings=...,
    embedding_dim=..., org_vocab_size=...)``, ``(layers): ModuleList(`` with ``(0-27): 28 x ...``)."""
    lines = text.splitlines()
    arch = re.match(r"\s*(\w+)", lines[0]).group(1) if lines and re.match(r"\s*(\w+)", lines[0]) else None
    vocab = hidden = layers = None
    m = _EMBED.search(text)
    if m and (m.group("v") or m.group("n")):
        vocab, hidden = int(m.group("v") or m.group("n")), int(m.group("d")) if m.group("d") else None
    else:
        m = _TORCH_EMBED.search(text)
        if m:
            vocab, hidden = int(m.group("v")), int(m.group("d"))
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if not stripped.startswith("(layers): "):
            continue
        depth, count = len(line) - len(stripped), 0
        for inner in lines[i + 1:]:
            body = inner.lstrip()
            indent = len(inner) - len(body)
            if indent <= depth:
                break
            idx = _INDICES.match(body) if indent == depth + 2 else None
            if idx:
                for part in idx.group("ranges").split(", "):
                    lo, _, hi = part.partition("-")
                    count += int(hi or lo) - int(lo) + 1
        layers = count or None
        break
    return ModelShape(architecture=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers)


def _vllm_class(hf_architecture: str, served: str) -> bool:
    """Whether vLLM serves ``hf_architecture`` with its class ``served`` (its registry maps some
    architectures onto another's class)."""
    try:
        from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS as known
    except ImportError:  # pragma: no cover
        return False
    entry = known.get(hf_architecture)
    return entry is not None and entry[1] == served


def check_model(server, key: str, policy: ModelShape, model_path: str, timeout_s: float,
                who: str | None = None) -> None:
    """Refuse a server whose model is not the policy's (``server``: a connected
    :class:`~megatron_rl.rollout.server.VLLMServer`; ``who`` names it, default its URL)."""
    from megatron_rl.rollout.base import EngineError

    try:
        text = server.collective_rpc("get_model_inspection", timeout=timeout_s)
    except EngineError:  # a vLLM without it: only the lengths are checked
        return
    if not text or not isinstance(text[0], str):
        return
    served = inspected_shape(text[0])
    wrong = served.differences(policy, same_architecture=_vllm_class)
    if wrong:
        raise ConfigError(key, f"{who or server.url} serves another model than the policy's ({model_path}): "
                               f"{', '.join(wrong)}; its model: {server.model}")
