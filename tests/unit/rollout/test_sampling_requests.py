"""What a SamplingSpec asks of vLLM: the server's generate request and the in-process engine's
SamplingParams carry the same settings (min_tokens included)."""

from __future__ import annotations

import pytest

from megatron_rl.rollout.base import SamplingSpec
from megatron_rl.rollout.server_wire import generate_body


def test_min_tokens_reaches_the_server_request():
    spec = SamplingSpec(n=2, max_tokens=40, min_tokens=40, seed=3, stop_token_ids=(7,))
    params = generate_body([1, 2, 3], spec, request_id="r1")["sampling_params"]
    assert params["min_tokens"] == 40 and params["max_tokens"] == 40 and params["stop_token_ids"] == [7]
    assert "min_tokens" not in generate_body([1], SamplingSpec())["sampling_params"]  # vLLM's default


def test_min_tokens_reaches_the_in_process_engine():
    pytest.importorskip("vllm")
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    _, params = VLLMEngine.requests([[1, 2], [3]], SamplingSpec(max_tokens=12, min_tokens=5, seed=9))
    assert [p.min_tokens for p in params] == [5, 5] and [p.seed for p in params] == [9, 10]
    _, (plain,) = VLLMEngine.requests([[1]], SamplingSpec())
    assert plain.min_tokens == 0


def test_a_handle_with_the_tokenizer_asks_for_tokens_and_decodes_as_vllm():
    """With the policy's tokenizer the server returns tokens only (nothing detokenized there) and
    the handle decodes each sample's text the way vLLM's detokenizer does: from the prompt's last
    tokens (a SentencePiece tokenizer keeps the first output token's leading space), special tokens
    skipped, the token that stopped the sample (EOS or a stop token id) out of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_rl.rollout.server_wire import completion_text

    body = generate_body([1, 2], SamplingSpec(n=2), text=False)
    assert body["output_mode"] == "tokens" and body["sampling_params"]["detokenize"] is False
    assert generate_body([1, 2], SamplingSpec(n=2))["output_mode"] == "text"
    assert "detokenize" not in generate_body([1, 2], SamplingSpec(n=2))["sampling_params"]

    vocab = {"</s>": 0, "\u2581hello": 1, "\u2581world": 2, "\u2581again": 3, "!": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")
    assert completion_text(tok, [1], [2, 3], "length") == " world again"  # "world again" alone
    assert completion_text(tok, [1], [2, 3, 0], "stop") == " world again"  # EOS
    assert completion_text(tok, [1], [2, 4, 3], "stop") == " world!"  # a stop token id: out of the text
    assert completion_text(tok, [1], [2, 4], "abort") == " world!"  # stopped part-way: every token
    assert completion_text(tok, [], [2, 3], "length") == "world again"
    assert completion_text(tok, [1], [0], "stop") == ""
