"""The routes' pure logic (routing replay): vLLM's request names, the rows a completion keeps and the
checks on them, the wire format, the choice of source, and a request's track with recomputed
positions (the first computation wins)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rl.rollout.route_capture import _Track
from megatron_rl.rollout.routes import (ROUTES_EXTENSION, RouteInfo, RoutesError, fit_rows, match_request, pack,
                                        pick_rows, request_names, resolve_source, route_dtype, select_layers,
                                        server_route_args, unpack)

INFO = RouteInfo(source="capture", layers=(0, 2), top_k=2, num_experts=8)


def test_routing_replay_request_names_follow_vllms_rule():
    # vLLM: sample j of an n > 1 request is "{j}_{external}", every admitted id gets "-<8 chars>"
    assert match_request("3_generate-tokens-a-1-0f1e2d3c", {"generate-tokens-a-1": 4}) == ("generate-tokens-a-1", 3)
    assert match_request("generate-tokens-a-1-0f1e2d3c", {"generate-tokens-a-1": 1}) == ("generate-tokens-a-1", 0)
    assert match_request("0-abcdefgh", {"0": 1}) == ("0", 0)
    assert match_request("1_0-abcdefgh", {"0": 2}) == ("0", 1)
    # another request's, an index beyond n, the one-sample reading of an n > 1 request
    assert match_request("1_0-abcdefgh", {"10": 2}) is None
    assert match_request("11-abcdefgh", {"1": 1}) is None
    assert match_request("5_0-abcdefgh", {"0": 2}) is None
    assert match_request("0-abcdefgh", {"0": 2}) is None
    assert match_request("1_0-abcdefgh", {"1_0": 1}) == ("1_0", 0)
    # ids without vLLM's random suffix (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)
    assert match_request("2_x", {"x": 3}) == ("x", 2)
    assert ("a-1", None) in request_names("a-1-0f1e2d3c")


def _routes(n, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(n)]).astype(np.uint8)


def test_routing_replay_fit_rows_keeps_prompt_plus_response_minus_one_and_checks_tokens():
    prompt, response = [5, 6, 7], [8, 9, 10, 11]
    rows = _routes(7)  # one more than needed (a token the front end dropped after a stop string)
    tokens = np.array(prompt + response, dtype=np.int64)
    out = fit_rows(rows, tokens, prompt, response, INFO, "w")
    assert out.shape == (6, 2, 2) and out.dtype == np.uint8 and (out == rows[:6]).all()
    with pytest.raises(RoutesError, match=r"5 rows of routes .* \(need 6\)"):
        fit_rows(rows[:5], tokens[:5], prompt, response, INFO, "w")
    bad = tokens.copy()
    bad[4] = 99
    with pytest.raises(RoutesError, match="row 4 was computed on token 99, but the completion has token 9"):
        fit_rows(rows, bad, prompt, response, INFO, "w")
    with pytest.raises(RoutesError, match=r"shape \(7, 3, 2\)"):
        fit_rows(np.zeros((7, 3, 2), np.uint8), tokens, prompt, response, INFO, "w")
    high = rows.copy()
    high[0, 0, 0] = 8
    with pytest.raises(RoutesError, match="outside"):
        fit_rows(high, tokens, prompt, response, INFO, "w")
    # a track recorded twice under one request id: the one computed on the completion's tokens
    wrong = {"rows": pack(_routes(6, 1)), "tokens": pack(bad)}
    right = {"rows": pack(rows), "tokens": pack(tokens)}
    assert (pick_rows([wrong, right], prompt, response, INFO, "w") == rows[:6]).all()
    with pytest.raises(RoutesError, match="recorded no routes"):
        pick_rows([], prompt, response, INFO, "w")


def test_routing_replay_native_rows_keep_the_moe_layers_and_wire_format_round_trips():
    native = np.zeros((4, 3, 2), np.int32)  # every decoder layer; layer 1 dense (zeros)
    native[:, 0], native[:, 2] = [1, 2], [3, 4]
    picked = select_layers(native, INFO)
    assert picked.shape == (4, 2, 2) and (picked[:, 1] == [3, 4]).all()
    a = _routes(5).astype(np.int16)
    assert (unpack(pack(a)) == a).all() and unpack(pack(a)).dtype == np.int16
    assert route_dtype(256) == np.uint8 and route_dtype(257) == np.int16
    assert RouteInfo.from_dict(INFO.to_dict()) == INFO


def test_routing_replay_source_choice_and_server_arguments():
    assert resolve_source("auto", cuda=True) == "native" and resolve_source("auto", cuda=False) == "capture"
    assert resolve_source("capture", cuda=True) == "capture"
    with pytest.raises(RoutesError, match="needs Model Runner V2"):
        resolve_source("native", cuda=False)
    assert server_route_args([], "capture") == ["--worker-extension-cls", ROUTES_EXTENSION]
    assert server_route_args(["--worker-extension-cls", "megatron_rl.sync.gloo.GlooWorkerExtension"],
                             "native") == ["--enable-return-routed-experts"]


def test_routing_replay_track_keeps_the_first_computation_of_a_position():
    # prompt 0..3 computed, then decode 4, 5; then the KV is dropped (a weight update) and 0..6
    # recomputed: rows 0..5 stay the first ones, row 6 is new
    first = _routes(6, 1)
    again = _routes(7, 2)
    t = _Track()
    pos = np.arange(7)
    t.chunks += [(0, 0, 4, first, pos), (4, 4, 1, first, pos), (5, 5, 1, first, pos), (0, 0, 7, again, pos)]
    rows, tokens = t.assemble(2, 2, np.uint8)
    assert (rows[:6] == first).all() and (rows[6] == again[6]).all() and (tokens == np.arange(7)).all()
    # a gap (a position never computed) ends what can be returned
    t = _Track()
    t.chunks += [(0, 0, 2, first, pos), (3, 3, 3, first, pos)]
    rows, _ = t.assemble(2, 2, np.uint8)
    assert len(rows) == 2


def test_routing_replay_an_aborted_copy_without_rows_is_not_an_error():
    # a hedged request's losing copy (or a leftover) aborted before its prompt ran: no rows
    from megatron_rl.rollout.routes import aborted_or

    assert aborted_or("abort", pick_rows, [], [1, 2], [3], INFO, "w") is None
    with pytest.raises(RoutesError, match="recorded no routes"):
        aborted_or("stop", pick_rows, [], [1, 2], [3], INFO, "w")
