"""The generative judge against a small OpenAI-compatible HTTP server started on 127.0.0.1 here.

The server plays a judge that knows a table of equivalences the rules do not (it reads the
reference and the candidate answer out of the prompt it receives), so the test checks what the
manager sends, how it reads verdicts, fallback versus main mode, and timeouts.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.rewards import RewardConfig, RewardItem, RewardManager
from megatron_rl.rewards.judge import judge_messages, parse_verdict

pytestmark = pytest.mark.timeout(120)

# what this judge accepts beyond string equality: (reference, candidate)
EQUIVALENT = {("12", "twelve"), ("0.5", "1/2")}


class _Judge(BaseHTTPRequestHandler):
    requests: list[dict] = []
    behaviour = "answer"  # "answer" | "hang" | "garbage"

    def do_POST(self):  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "body": body,
                                    "auth": self.headers.get("Authorization")})
        if self.behaviour == "hang":
            time.sleep(3)
        user = body["messages"][-1]["content"]
        ref = re.search(r"Reference answer:\n(.*)\n", user).group(1).strip()
        cand = re.search(r"Candidate's final answer:\n(.*)\n", user).group(1).strip()
        ok = ref == cand or (ref, cand) in EQUIVALENT
        text = ("Looks fine. VERDICT: CORRECT" if ok else "VERDICT: INCORRECT")
        if self.behaviour == "garbage":
            text = "I think so?"
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload.encode())
        except BrokenPipeError:  # the client gave up (the timeout test)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Judge.requests = []
    _Judge.behaviour = "answer"
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _cfg(server, mode: str, timeout_s: float = 10.0) -> RewardConfig:
    cfg = RewardConfig(num_workers=1)
    cfg.judge.mode = mode
    cfg.judge.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    cfg.judge.model = "judge-model"
    cfg.judge.timeout_s = timeout_s
    cfg.judge.styles = ["exact_boxed"]
    return cfg


ITEMS = [
    RewardItem("\\boxed{12}", "12", "exact_boxed", {"question": "5+7?"}),
    RewardItem("\\boxed{twelve}", "12", "exact_boxed", {"question": "5+7?"}),
    RewardItem("\\boxed{13}", "12", "exact_boxed", {"question": "5+7?"}),
]


def test_fallback_asks_only_about_rule_failures_and_flips_equivalents(server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "k123")
    cfg = _cfg(server, "fallback")
    cfg.judge.api_key_env = "JUDGE_KEY"
    with RewardManager(cfg) as mgr:
        scores, metrics, details = mgr.score(ITEMS, return_details=True)
    assert scores == [1.0, 1.0, 0.0]
    assert metrics["reward/judge_calls"] == 2.0 and metrics["reward/judge_flips"] == 1.0
    assert details[1]["detail"] == "judge_fallback"
    assert len(_Judge.requests) == 2  # the rule-correct response was not sent
    req = _Judge.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer k123"
    assert req["body"]["model"] == "judge-model" and "5+7?" in req["body"]["messages"][-1]["content"]


def test_main_mode_and_llm_judge_style(server):
    with RewardManager(_cfg(server, "main")) as mgr:
        scores, metrics = mgr.score(ITEMS)
    assert scores == [1.0, 1.0, 0.0] and len(_Judge.requests) == 3
    _Judge.requests.clear()
    cfg = _cfg(server, "off")
    cfg.judge.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    with RewardManager(cfg) as mgr:
        items = [RewardItem("\\boxed{1/2}", "0.5", "llm_judge")]
        assert mgr.score(items)[0] == [1.0]


def test_hung_judge_times_out_to_a_counted_zero(server):
    _Judge.behaviour = "hang"
    t0 = time.monotonic()
    with RewardManager(_cfg(server, "main", timeout_s=0.5)) as mgr:
        scores, metrics, details = mgr.score(ITEMS, return_details=True)
    assert time.monotonic() - t0 < 3.0 * 3  # bounded by the request timeout, not the server
    assert scores == [0.0, 0.0, 0.0] and metrics["reward/errors"] == 3.0
    assert all("timed out" in d["detail"] or "timeout" in d["detail"].lower() for d in details)


def test_reply_without_verdict_is_an_error_and_fallback_keeps_the_rule_score(server):
    _Judge.behaviour = "garbage"
    with RewardManager(_cfg(server, "fallback")) as mgr:
        scores, metrics, details = mgr.score(ITEMS, return_details=True)
    assert scores == [1.0, 0.0, 0.0] and metrics["reward/judge_flips"] == 0.0
    assert metrics["reward/judge_errors"] == 2.0 and metrics["reward/errors"] == 0.0
    assert "judge:error" in details[1]["detail"]


def test_unreachable_judge_is_an_error():
    cfg = RewardConfig()
    cfg.judge.mode, cfg.judge.base_url, cfg.judge.timeout_s = "main", "http://127.0.0.1:9/v1", 1.0
    cfg.judge.styles = ["exact_boxed"]
    with RewardManager(cfg) as mgr:
        scores, metrics = mgr.score(ITEMS[:1])
    assert scores == [0.0] and metrics["reward/errors"] == 1.0


def test_prompt_and_verdict_parsing():
    msgs = judge_messages(RewardItem("long work... \\boxed{42}", "42", "math", {"question": "Q?"}))
    assert "Do NOT solve" in msgs[0]["content"]
    assert "Candidate's final answer:\n42\n" in msgs[1]["content"]
    assert parse_verdict("VERDICT: INCORRECT ... VERDICT: CORRECT") is True
    assert parse_verdict("verdict: incorrect") is False
    assert parse_verdict("maybe") is None
