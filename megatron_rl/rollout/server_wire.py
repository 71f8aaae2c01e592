"""What a vLLM server's generate route takes and gives (:mod:`megatron_rl.rollout.server`): the
request body, the reply's choices, a sample's text decoded on the client, the weight-version labels.

Generation: one request per prompt, token ids in, ``n`` samples out with their token ids, text,
*processed* sampled-token log-probs (the server runs with ``--logprobs-mode processed_logprobs``) and
the weight-version spans the server attaches to the output tokens; the prompt's seed goes in the
request (vLLM samples child j of an n-request with seed + j, so the same prompt and seed give the
same samples on any server holding the same weights). A handle given the policy's tokenizer asks
for tokens only (``output_mode=tokens``, no detokenization on the server) and decodes each sample's
text itself, once, as vLLM's detokenizer would (:func:`completion_text`).

Owns: the route's name and request-id prefix, the body and reply formats, :data:`BASE_VERSION`.
May call: the tokenizer it is given (decode); :class:`~megatron_rl.rollout.base.SamplingSpec`.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.rollout.base import EngineError, SamplingSpec


BASE_VERSION = "default"  # what vLLM reports before any weight update: the weights it started with


def version_of(label: str | None, fallback: int) -> int:
    """Our integer weight version from a server's label (``default``: the base weights, 0)."""
    if label == BASE_VERSION:
        return 0
    try:
        return int(label)
    except (TypeError, ValueError):
        return fallback


def generate_body(prompt_ids: list[int], sampling: SamplingSpec, request_id: str | None = None,
                  text: bool = True) -> dict[str, Any]:
    """The ``/inference/v1/generate`` request for one prompt (vLLM's token-in / token-out route);
    ``text`` False: token ids and log-probs only, nothing detokenized on the server."""
    params: dict[str, Any] = {"n": sampling.n, "max_tokens": sampling.max_tokens,
                              "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 0}
    if not text:
        params["detokenize"] = False
    if sampling.top_k > 0:
        params["top_k"] = sampling.top_k
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.min_tokens:
        params["min_tokens"] = sampling.min_tokens
    body: dict[str, Any] = {"token_ids": list(prompt_ids), "sampling_params": params,
                            "output_mode": "text" if text else "tokens"}
    if request_id is not None:
        body["request_id"] = request_id
    return body


# Prompt tokens a client-side decode starts from (as vLLM's detokenizer seeds its stream with the
# prompt's last tokens): a SentencePiece tokenizer then keeps the first output token's leading space.
SEED_TOKENS = 8


def completion_text(tokenizer, prompt_ids: list[int], token_ids: list[int], finish_reason: str | None) -> str:
    """A sample's text as the server's detokenizer makes it (special tokens skipped; the token
    that stopped it, an EOS or a stop token id, left out of the text but kept in its ids)."""
    ids = list(token_ids[:-1]) if finish_reason == "stop" and token_ids else list(token_ids)
    if not ids:
        return ""
    seed = list(prompt_ids[-SEED_TOKENS:])
    if not seed:
        return tokenizer.decode(ids, skip_special_tokens=True)
    head = tokenizer.decode(seed, skip_special_tokens=True)
    full = tokenizer.decode(seed + ids, skip_special_tokens=True)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(ids, skip_special_tokens=True)


def parse_choices(reply: dict, n: int, where: str) -> list[dict]:
    """``n`` choices of a generate reply in sample order: token ids, log-probs, text, finish reason,
    and the weight-version spans over the output tokens."""
    choices = sorted(reply.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise EngineError(f"{where}: {len(choices)} choices for n={n}")
    out = []
    for c in choices:
        ids = list(c.get("token_ids") or [])
        lps = [float(x["logprob"]) for x in ((c.get("logprobs") or {}).get("content") or [])]
        if len(lps) != len(ids):
            raise EngineError(f"{where}: {len(lps)} log-probs for {len(ids)} tokens")
        out.append({"token_ids": ids, "logprobs": lps, "text": c.get("text") or "",
                    "finish_reason": c.get("finish_reason") or "abort",
                    "spans": c.get("weight_versions") or [], "routed_experts": c.get("routed_experts")})
    return out


GENERATE = "/inference/v1/generate"  # needs the server's --enable-scale-out
# The generate route names a request "generate-tokens-<request_id of the body>" inside vLLM
# (vllm/entrypoints/scale_out/token_in_token_out/serving.py); /abort_requests takes that name.
GENERATE_ID_PREFIX = "generate-tokens-"
