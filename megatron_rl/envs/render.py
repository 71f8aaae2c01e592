"""Tool messages as tokens: what a multi-turn trajectory appends after a model turn.

The conversation is never re-tokenized: the model's turns stay the tokens the engine sampled, and an
observation is tokenized on its own and appended, as the tokenizer's chat template renders a tool
message after an assistant turn, through the generation prompt of the next assistant turn. The
template's wrapping is found once, by rendering a conversation with marker contents (so any template
that renders a ``tool`` role works); the tool's text is tokenized with special-token strings split
(a tool printing ``<|im_end|>`` cannot forge a turn boundary).

A model turn ends with the end-of-sequence token (the one the template closes an assistant turn
with); whatever the template writes after it (``\\n`` in ChatML) is not sampled, so it is rendered as
the start of the observation.
"""

from __future__ import annotations

from megatron_rl.common.errors import InputError

_USER, _MODEL, _TOOL = "\x1fuser\x1f", "\x1fmodel\x1f", "\x1ftool\x1f"


class TemplateError(InputError):
    """The tokenizer's chat template cannot render tool messages between assistant turns."""


class TurnRenderer:
    """Token ids of tool observations (and of demonstrations) for ``tokenizer``'s chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.before, self.after = _tool_wrapping(tokenizer)
        self._before_ids = self._encode(self.before)
        self._after_ids = self._encode(self.after)

    def _encode(self, text: str, split_special: bool = False) -> list[int]:
        if not text:
            return []
        kw = {"split_special_tokens": True} if split_special else {}
        return list(self.tokenizer(text, add_special_tokens=False, **kw)["input_ids"])

    def observation_ids(self, text: str) -> list[int]:
        """The tokens appended after a model turn (ended with EOS) for a tool message ``text``."""
        return self._before_ids + self._encode(text, split_special=True) + self._after_ids

    def demonstration(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """A demonstrated trajectory (assistant and tool messages, the last an assistant's) as token
        ids and their loss mask: each assistant message is its tokens + EOS (trained on), each tool
        message its observation tokens (not trained on)."""
        ids: list[int] = []
        mask: list[int] = []
        for m in messages:
            if m["role"] == "assistant":
                turn = self._encode(m["content"]) + [self.eos_id]
                ids += turn
                mask += [1] * len(turn)
            else:
                obs = self.observation_ids(m["content"])
                ids += obs
                mask += [0] * len(obs)
        return ids, mask


def check_messages(messages) -> str:
    """'' when ``messages`` is a demonstrated trajectory, else what is wrong with it."""
    if not isinstance(messages, list) or not messages:
        return "expected a non-empty list of {role, content} messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("assistant", "tool") or not isinstance(m.get("content"), str):
            return f"message {i} must be {{'role': 'assistant' | 'tool', 'content': str}}, got {m!r}"[:300]
    if messages[-1]["role"] != "assistant":
        return "the last message must be the assistant's (the final answer)"
    return ""


def _tool_wrapping(tokenizer) -> tuple[str, str]:
    """(text before, text after) a tool message's content, as the chat template renders it after an
    assistant turn closed by EOS, through the next assistant turn's generation prompt."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise TemplateError("multi-turn rollouts render tool messages with the tokenizer's chat template, and "
                            "this tokenizer has none")
    eos = tokenizer.eos_token
    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MODEL}]
    try:
        head = tokenizer.apply_chat_template(base, tokenize=False)
        full = tokenizer.apply_chat_template(base + [{"role": "tool", "content": _TOOL}], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template may raise anything on a role it lacks
        raise TemplateError(f"the tokenizer's chat template cannot render a tool message ({type(exc).__name__}: "
                            f"{exc})") from None
    if not full.startswith(head) or _MODEL not in head:
        raise TemplateError("the tokenizer's chat template renders an assistant turn differently once a tool "
                            "message follows it, so observations cannot be appended to the sampled tokens")
    closing = head[head.index(_MODEL) + len(_MODEL):]
    if not eos or not closing.startswith(eos):
        raise TemplateError(f"the tokenizer's chat template closes an assistant turn with {closing!r}, not the "
                            f"end-of-sequence token {eos!r} the model stops its turns with")
    added = full[len(head):]
    if added.count(_TOOL) != 1:
        raise TemplateError("the tokenizer's chat template does not render a tool message (no 'tool' role)")
    before, after = added.split(_TOOL)
    return closing[len(eos):] + before, after
