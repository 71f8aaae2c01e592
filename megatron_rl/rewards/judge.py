"""A generative judge: an OpenAI-compatible chat endpoint (e.g. a vLLM server) decides equivalence.

Rules fail on "96%" vs "96" or "π" vs "3.14"; a strong model that reads the required
answer format and knows equivalent forms judges better. The prompt tells the judge to compare, not to
solve. Every request has a timeout; a failed or unparsable reply is an ``error`` (a counted zero).
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from megatron_rl.rewards.base import CORRECT, ERROR, WRONG, Outcome, RewardItem, register_reward
from megatron_rl.rewards.extract import extract_answer

SYSTEM_PROMPT = (
    "You grade answers to problems. Do NOT solve the problem yourself. Decide only whether the "
    "candidate's final answer is equivalent to the reference answer: same value or set, in any "
    "equivalent form (fractions vs decimals, a percent sign the question already implies, symbolic "
    "constants vs their decimal value at the reference's precision, units the question implies), "
    "and in the format the question asks for. Reply with one line: VERDICT: CORRECT or "
    "VERDICT: INCORRECT."
)
_VERDICT = re.compile(r"VERDICT:\s*(CORRECT|INCORRECT)", re.I)
# Characters of the response tail shown to the judge when no final answer could be extracted.
_TAIL_CHARS = 2000


def judge_messages(item: RewardItem) -> list[dict]:
    answer = extract_answer(item.response)
    shown = answer if answer is not None else item.response[-_TAIL_CHARS:]
    question = item.extra.get("question", "(not given)")
    user = (f"Question:\n{question}\n\nReference answer:\n{item.ground_truth}\n\n"
            f"Candidate's final answer:\n{shown}\n")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_verdict(text: str) -> bool | None:
    found = _VERDICT.findall(text or "")
    return None if not found else found[-1].upper() == "CORRECT"


def judge_one(item: RewardItem, jcfg) -> Outcome:
    """One HTTP request to ``{base_url}/chat/completions``; never raises."""
    body = {"model": jcfg.model, "messages": judge_messages(item), "max_tokens": jcfg.max_tokens,
            "temperature": 0.0}
    headers = {"Content-Type": "application/json"}
    if jcfg.api_key_env:
        headers["Authorization"] = f"Bearer {os.environ.get(jcfg.api_key_env, '')}"
    req = urllib.request.Request(jcfg.base_url.rstrip("/") + "/chat/completions",
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=jcfg.timeout_s) as resp:
            reply = json.loads(resp.read(1 << 20))
        text = reply["choices"][0]["message"]["content"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return Outcome(0.0, ERROR, detail=f"judge request failed: {type(exc).__name__}: {exc}"[:500])
    verdict = parse_verdict(text)
    if verdict is None:
        return Outcome(0.0, ERROR, detail=f"judge reply has no verdict: {text[:200]!r}")
    return Outcome(1.0 if verdict else 0.0, CORRECT if verdict else WRONG,
                   extract_answer(item.response), "judge")


def judge_batch(items: list[RewardItem], jcfg) -> list[Outcome]:
    """Judge many items with at most ``jcfg.max_concurrency`` requests in flight."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(jcfg.max_concurrency, len(items))) as ex:
        return list(ex.map(lambda it: judge_one(it, jcfg), items))


@register_reward("llm_judge", judged=True)
def llm_judge_reward(item: RewardItem, cfg) -> Outcome:
    """The judge as the only verifier (the manager batches these requests)."""
    return judge_one(item, cfg.judge)
