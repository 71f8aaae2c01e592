"""The multi-turn rollout loop (``rollout/multi_turn.py``) with the built-in environments, against a
scripted engine (pure logic; the real engines are in tests/integration/rollout/test_multi_turn_vllm.py
and test_fleet.py).

References: the tokenizer's own chat template rendering the whole conversation (the trajectory's
tokens must be exactly what it renders, with no re-tokenization of the sampled turns); what the
engine was sent (each turn's prompt is the trajectory so far); the seeds' rule written out.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest

from megatron_rl.data.dataset import PromptRecord
from megatron_rl.demo.tiny import build_char_tokenizer
from megatron_rl.envs import Environments, EnvConfig, Environment, StepResult, register_env
from megatron_rl.envs.registry import ENVIRONMENTS
from megatron_rl.rollout import Completion, RolloutEngine, SamplingSpec
from megatron_rl.rollout.multi_turn import MultiTurnStream, generate
from megatron_rl.rollout.trajectory import turn_seed
from megatron_rl.rollout.streaming import BackgroundGenerate, GroupStream

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def _prompt(question: str) -> list[int]:
    return list(TOK.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"])


def _record(a: int, b: int, env: str = "calculator", i: int = 0) -> PromptRecord:
    q = f"{a}*{b}="
    return PromptRecord(prompt_ids=_prompt(q), prompt_text=q, ground_truth=str(a * b), style="boxed_final",
                        data_source="mult", uid=f"u{i}", row=i + 1, env=env)


def calculator_policy(prompt: str, seed, j) -> str:
    """Calls the calculator on the question, then boxes the last observation."""
    a, b = re.search(r"Q:(\d+)\*(\d+)=", prompt).groups()
    seen = re.findall(r"=(\d+)\nA:", prompt)
    return f"\\boxed{{{seen[-1]}}}" if seen else f"<<{a}*{b}>>"


class ScriptedEngine(RolloutEngine):
    """Answers each prompt with ``policy(prompt text, seed, sample)`` + EOS; records every request."""

    def __init__(self, policy=calculator_policy):
        self.policy = policy
        self.requests: list[tuple[list[int], int | None, int]] = []
        self.calls: list[int] = []
        self.weight_version = 0

    def generate(self, prompt_ids, spec):
        self.calls.append(len(prompt_ids))
        out = []
        for i, p in enumerate(prompt_ids):
            seed, room = spec.prompt_seed(i), spec.prompt_max_tokens(i)
            self.requests.append((list(p), seed, room))
            group = []
            for j in range(spec.n):
                ids = TOK(self.policy(TOK.decode(p), seed, j), add_special_tokens=False)["input_ids"] + [EOS]
                finish = "stop" if len(ids) <= room else "length"
                ids = ids[:room]
                lps = [-0.01 * (k + 1) - ((seed or 0) % 97) * 1e-4 for k in range(len(ids))]
                group.append(Completion(token_ids=ids, logprobs=lps, text=TOK.decode(ids, skip_special_tokens=True),
                                        finish_reason=finish, truncated=finish == "length",
                                        weight_version=self.weight_version, engine="scripted"))
            out.append(group)
        return out

    def reset_prefix_cache(self):
        pass


def _envs(max_turns=4, **cfg) -> Environments:
    return Environments(EnvConfig(**cfg), TOK, max_turns=max_turns, wait_s=30.0)


SPEC = SamplingSpec(n=2, temperature=1.0, max_tokens=40, seed=100)


def test_multi_turn_trajectory_is_the_chat_templates_conversation_token_for_token():
    """A calculator trajectory: the model's call, the tool's answer, the model's final answer. Its
    tokens (prompt + trajectory) equal the chat template's rendering of that whole conversation;
    every turn's request carried exactly the trajectory so far; observation tokens have loss mask 0
    and log-prob 0, the model's keep the engine's log-probs; the answer scored is the last turn."""
    engine, envs = ScriptedEngine(), _envs()
    records = [_record(12, 34, i=0), _record(7, 406, i=1)]
    try:
        groups = generate(engine, envs, records, SPEC)
    finally:
        envs.close()
    assert [len(g) for g in groups] == [2, 2]
    for rec, group in zip(records, groups):
        a, b = map(int, re.findall(r"\d+", rec.prompt_text))
        conversation = [{"role": "user", "content": rec.prompt_text},
                        {"role": "assistant", "content": f"<<{a}*{b}>>"},
                        {"role": "tool", "content": str(a * b)},
                        {"role": "assistant", "content": f"\\boxed{{{a * b}}}"}]
        want = list(TOK.apply_chat_template(conversation, tokenize=True)["input_ids"])
        for c in group:
            assert rec.prompt_ids + c.token_ids == want
            ep = c.extra["episode"]
            assert ep["turns"] == 2 and ep["tool_calls"] == 1 and ep["ended"] == "done"
            assert ep["answer"] == f"\\boxed{{{a * b}}}" and not c.truncated and c.finish_reason == "stop"
            roles = [m["role"] for m in ep["messages"]]
            assert roles == ["assistant", "tool", "assistant"] and ep["messages"][1]["text"] == str(a * b)
            first, obs = ep["messages"][0]["tokens"], ep["messages"][1]["tokens"]
            assert c.loss_mask == [1] * first + [0] * obs + [1] * (len(c.token_ids) - first - obs)
            assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
            assert all(lp < 0 for lp, m in zip(c.logprobs, c.loss_mask) if m)
            assert ep["observation_tokens"] == obs and c.model_tokens() == [bool(m) for m in c.loss_mask]
    # what the engine saw: turn 1 the prompt, turn 2 the prompt + the trajectory up to its last turn
    sent = {tuple(p) for p, _, _ in engine.requests}
    for rec, group in zip(records, groups):
        c = group[0]
        last = c.extra["episode"]["messages"][-1]["start"]
        assert tuple(rec.prompt_ids) in sent and tuple(rec.prompt_ids + c.token_ids[:last]) in sent
    # turns ready together go in one batch: 2 prompts x 2 trajectories, 2 turns -> 2 engine calls of 4
    assert engine.calls == [4, 4]


def test_multi_turn_seeds_follow_the_rule_and_a_resent_trajectory_samples_the_same():
    engine, envs = ScriptedEngine(), _envs()
    records = [_record(12, 34, i=0), _record(56, 78, i=1)]
    try:
        first = generate(engine, envs, records, SPEC)
        seeds = sorted((len(p), s) for p, s, _ in engine.requests)
        again = generate(engine, envs, records, SPEC)
    finally:
        envs.close()
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    assert [[c.logprobs for c in g] for g in first] == [[c.logprobs for c in g] for g in again]
    # turn 0 of trajectory j of prompt i: the single-turn rule (seed + i, its j-th sample + j)
    turn0 = sorted(s for p, s, _ in engine.requests[:4])
    assert turn0 == sorted(SPEC.seed + i + j for i in range(2) for j in range(2))
    later = [s for p, s, _ in engine.requests[4:8]]
    assert sorted(later) == sorted(turn_seed(SPEC.seed + i, j, 1) for i in range(2) for j in range(2))
    assert len(set(later) - set(turn0)) == 4  # later turns: a seed of their own each
    assert seeds == sorted((len(p), s) for p, s, _ in engine.requests[8:])
    assert turn_seed(None, 1, 3) is None and turn_seed(5, 2, 0) == 7


def test_multi_turn_max_turns_tool_budget_and_length_bound():
    """A model that always calls the tool: rollout.max_turns stops it (its last turn is the answer);
    past envs.max_tool_calls a call is refused (the model is told) and counted; the trajectory never
    exceeds the stage's max_response_len, model and observation tokens together."""
    always = lambda prompt, seed, j: "<<2*3>>"  # noqa: E731
    engine = ScriptedEngine(always)
    envs = _envs(max_turns=3, max_tool_calls=1)
    try:
        (group,) = generate(engine, envs, [_record(2, 3)], SamplingSpec(n=1, temperature=1.0, max_tokens=200, seed=1))
    finally:
        envs.close()
    c = group[0]
    ep = c.extra["episode"]
    assert ep["turns"] == 3 and ep["ended"] == "max_turns" and ep["tool_calls"] == 1 and ep["budget_refused"] == 1
    assert [m["role"] for m in ep["messages"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert ep["messages"][1]["text"] == "6" and "budget" in ep["messages"][3]["text"]
    assert ep["answer"] == "<<2*3>>" and not c.truncated
    # the length bound: every room asked for is what is left, and the whole trajectory fits
    for budget in (9, 12, 17, 22, 26):
        engine = ScriptedEngine(always)
        envs = _envs(max_turns=10, max_tool_calls=10)
        try:
            (group,) = generate(engine, envs, [_record(2, 3)], SamplingSpec(n=1, temperature=1.0, max_tokens=budget,
                                                                              seed=1))
        finally:
            envs.close()
        c = group[0]
        assert len(c.token_ids) <= budget and c.truncated and c.finish_reason == "length"
        prompt = len(_record(2, 3).prompt_ids)
        for p, _, room in engine.requests:
            assert room == budget - (len(p) - prompt) and room >= 1


def test_multi_turn_tool_faults_are_counted_messages_and_the_episode_goes_on():
    """A failing call (an expression that does not parse), one that floods (a huge number: cut), one that hangs (past
    envs.tool_timeout_s), and an environment that raises: each is counted, the model reads an error
    message (or, for the broken environment, its episode ends cleanly), no rollout dies."""

    @register_env("test_faulty_tool")
    class Faulty(Environment):
        def step(self, turn):
            if turn == "00":  # (the tiny alphabet: digits)
                return self.use_tool("sleepy", lambda: self.tools.call(time.sleep, 2.0))
            if turn == "11":
                raise RuntimeError("environment bug")
            return StepResult(done=True)

    try:
        script = {0: "<<1**>>", 1: "<<9**999>>", 2: "done"}  # (the tiny alphabet has no "/")
        policy = lambda prompt, seed, j: script[prompt.count("A:") - 1]  # noqa: E731
        engine, envs = ScriptedEngine(policy), _envs(max_observation_chars=64)
        try:
            (group,) = generate(engine, envs, [_record(1, 2)], SamplingSpec(n=1, temperature=1.0, max_tokens=300))
        finally:
            envs.close()
        ep = group[0].extra["episode"]
        texts = [m["text"] for m in ep["messages"] if m["role"] == "tool"]
        assert texts[0] == "error: cannot parse '1**'"
        assert len(texts[1]) == 64 and "cut" in texts[1] and texts[1][:10].isdigit()
        assert ep["tool_errors"] == 1 and ep["observations_cut"] == 1 and ep["tool_calls"] == 2
        assert ep["ended"] == "done" and ep["turns"] == 3

        script = {0: "00", 1: "11", 2: "22"}  # hang, raise, (never reached)
        engine = ScriptedEngine(policy)
        envs = _envs(tool_timeout_s=0.2)
        try:
            t0 = time.monotonic()
            (group,) = generate(engine, envs, [_record(1, 2, env="test_faulty_tool")],
                                SamplingSpec(n=1, temperature=1.0, max_tokens=300))
            took = time.monotonic() - t0
        finally:
            envs.close()
        ep = group[0].extra["episode"]
        assert took < 1.5, took  # the hung call was not waited for
        assert ep["tool_timeouts"] == 1 and ep["messages"][1]["text"].startswith("error: the tool did not answer")
        assert ep["tool_errors"] == 2 and ep["ended"] == "done" and ep["turns"] == 2  # the raise ended it
    finally:
        ENVIRONMENTS.unregister("test_faulty_tool")


def test_multi_turn_passes_prompts_without_an_environment_through_unchanged():
    engine = ScriptedEngine(lambda prompt, seed, j: f"\\boxed{{{seed}{j}}}")
    envs = _envs()
    plain = [_record(3, 4, env="", i=0), _record(5, 6, env="", i=1)]
    mixed = [plain[0], _record(12, 34, i=2), plain[1]]
    try:
        want = engine.generate([r.prompt_ids for r in plain], SPEC)
        got = generate(engine, envs, mixed, SPEC)
    finally:
        envs.close()
    # the plain prompts keep their seeds (prompt i of the batch), single-turn samples, no episode
    spec0, spec2 = SPEC.for_prompt(0), SPEC.for_prompt(2)
    direct = engine.generate([plain[0].prompt_ids], spec0)[0] + engine.generate([plain[1].prompt_ids], spec2)[0]
    for c, d in zip(got[0] + got[2], direct):
        assert c.token_ids == d.token_ids and c.logprobs == d.logprobs and "episode" not in c.extra
        assert not c.loss_mask
    assert [c.token_ids for c in got[0]] == [c.token_ids for c in want[0]]
    ep = got[1][0].extra["episode"]  # the prompt with an environment: a trajectory (answered at once)
    assert ep["turns"] == 1 and ep["tool_calls"] == 0 and ep["ended"] == "done"


def test_multi_turn_stream_aborts_and_fails_whole_groups():
    """abort(tag) stops a group's trajectories (nothing delivered for it); an engine failure on
    one trajectory's turn is delivered as the group's error."""
    gate = threading.Event()

    class Gated(ScriptedEngine):
        def generate(self, prompt_ids, spec):
            if any(TOK.decode(p).count("A:") > 1 for p in prompt_ids):
                gate.wait(5)
                if any("99*" in TOK.decode(p) for p in prompt_ids):
                    raise RuntimeError("engine died")
            return super().generate(prompt_ids, spec)

    engine, envs = Gated(), _envs()
    inner = BackgroundGenerate(engine)
    stream = MultiTurnStream(inner, envs)
    got: list = []
    try:
        stream.submit_records([_record(12, 34, i=0)], SPEC, ["a"], got.extend)
        time.sleep(0.2)
        assert stream.in_flight() == 1
        stream.abort(["a"])
        assert stream.in_flight() == 0
        stream.submit_records([_record(99, 2, i=1)], SPEC, ["b"], got.extend)
        gate.set()
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
    finally:
        stream.close()
        inner.close()
        envs.close()
    assert [t for t, _ in got] == ["b"] and isinstance(got[0][1], RuntimeError)


def test_environment_resolution_and_config_checks():
    from megatron_rl.config.base import ConfigError
    from megatron_rl.envs.episodes import EnvDataError

    envs = _envs(env_map={"mult": "calculator", "py": "python_tool"}, default_env="")
    try:
        assert envs.name(_record(1, 2, env="calculator")) == "calculator"
        assert envs.name(_record(1, 2, env="")) == "calculator"  # data_source "mult" mapped
        r = _record(1, 2, env="py")
        r.data_source = "other"
        assert envs.name(r) == "python_tool"  # the data's own name, mapped
        r.env = "nope"
        with pytest.raises(EnvDataError, match="row 1: environment 'nope'"):
            envs.check([r], "x.jsonl")
        r.env, r.data_source = "", "other"
        assert envs.name(r) is None
    finally:
        envs.close()
    with pytest.raises(ConfigError, match="envs|default_env"):
        EnvConfig(default_env="nope").validate()
    with pytest.raises(ConfigError, match="env_map"):
        EnvConfig(env_map={"a": "nope"}).validate()


def test_python_tool_prompts_need_the_code_sandbox_at_start_up(monkeypatch):
    """A run whose data has python_tool prompts on a machine where the sandbox cannot start (no
    bubblewrap, require_isolation on) is refused before anything is built, naming file, count and the
    fix, rather than answering every tool call with an error; the calculator needs no sandbox, and
    require_isolation: false is the explicit opt-in."""
    from megatron_rl.envs import EnvSandboxError
    from megatron_rl.rewards import sandbox
    from megatron_rl.rewards.config import SandboxConfig

    monkeypatch.setattr(sandbox, "_probe_bwrap", lambda python, cfg: "bwrap not found (planted)")
    sandbox._isolation.cache_clear()
    records = [_record(1, 2, env="calculator", i=0), _record(3, 4, env="python_tool", i=1)]
    try:
        for require in (True, False):
            envs = Environments(EnvConfig(), TOK, max_turns=2, sandbox=SandboxConfig(require_isolation=require))
            try:
                assert envs.check(records[:1], "x.jsonl") == {"calculator": 1}
                if require:
                    with pytest.raises(EnvSandboxError, match=r"x.jsonl: 1 prompts use environment python_tool, "
                                                              r".*bwrap not found \(planted\).*require_isolation"):
                        envs.check(records, "x.jsonl")
                else:
                    assert envs.check(records, "x.jsonl") == {"calculator": 1, "python_tool": 1}
            finally:
                envs.close()
    finally:
        sandbox._isolation.cache_clear()


def test_multi_turn_episode_metrics_count_every_tool_fault_and_log_them(caplog):
    """env/* from the episode records, against the sums written out by hand: a single-turn sample
    in the batch is not a trajectory; tool errors and timeouts are counted and logged."""
    import logging

    from megatron_rl.envs import episode_metrics

    def sample(tokens, obs, **episode):
        ep = dict(env="calculator", turns=1, ended="done", answer="", tool_calls=0, tool_errors=0, tool_timeouts=0,
                  budget_refused=0, observations_cut=0, observation_tokens=obs, messages=[])
        return Completion(token_ids=[5] * tokens, logprobs=[0.0] * tokens, text="", finish_reason="stop",
                          truncated=False, extra={"episode": {**ep, **episode}} if episode or obs else {})

    batch = [sample(10, 4, turns=2, tool_calls=1),
             sample(20, 8, turns=3, tool_calls=2, tool_errors=2, tool_timeouts=1, observations_cut=1),
             sample(5, 0, turns=1),
             sample(30, 12, turns=4, tool_calls=3, tool_errors=1, budget_refused=1, ended="max_turns"),
             sample(7, 0)]  # single-turn: no episode
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        m = episode_metrics(batch, [True, False, True, False, True])
    assert m == {"env/trajectories": 4.0, "env/turns_mean": 10 / 4, "env/turns_max": 4.0, "env/tool_calls": 6.0,
                 "env/tool_calls_mean": 1.5, "env/tool_use_rate": 0.75, "env/tool_errors": 3.0,
                 "env/tool_timeouts": 1.0, "env/tool_budget_exhausted": 1.0, "env/observations_cut": 1.0,
                 "env/max_turns_reached": 1.0, "env/observation_token_share": 24 / 65,
                 "env/accuracy_with_tool": 1 / 3, "env/accuracy_without_tool": 1.0}
    assert "tools: 3 errors (1 timeouts) in 6 calls of 4 trajectories" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        assert episode_metrics(batch[:1] + batch[4:], [True, True])["env/tool_errors"] == 0
        assert episode_metrics(batch[4:], [True]) == {}
    assert "tools:" not in caplog.text


def test_malformed_tool_calls_are_counted_error_messages_in_every_tool():
    """Each built-in tool's malformed calls (unclosed, too long, not JSON of the call's form, another
    tool's name, no code) are error messages to the model, flagged as failed calls and counted
    against the budget, never a final answer nor a crash; well-formed calls parse."""
    from megatron_rl.envs.calculator import Calculator
    from megatron_rl.envs.python_tool import PythonTool, tool_call_code
    from megatron_rl.envs.tools import ERROR, ToolRunner

    runner = ToolRunner(1.0, 1)
    calc, py = Calculator(EnvConfig(max_tool_calls=20), runner), PythonTool(EnvConfig(max_tool_calls=20), runner)
    call = '<tool_call>{"name": "python", "arguments": %s}</tool_call>'
    try:
        for env, turn, why in (
                (calc, "<<12*3", "closed by >>"), (calc, "<<" + "1+" * 150 + "1>>", "at most 200"),
                (calc, "<<1**>>", "cannot parse"), (calc, "<<__import__('os')>>", "only numbers"),
                (py, "<tool_call>{name: python}</tool_call>", "not JSON"), (py, "<tool_call>null</tool_call>", "not JSON"),
                (py, call % '"print(1)"', "not JSON"), (py, call % "[1]", "not JSON"),
                (py, '<tool_call>{"name": "bash", "arguments": {"code": "ls"}}</tool_call>', "unknown tool 'bash'"),
                (py, call % '{"code": 5}', "no code"), (py, call[:-12] % '{"code": "print(1)"}', "not closed")):
            res = env.step(turn)
            assert res.error == ERROR and res.tool and not res.done, (turn, res)
            assert res.observation.startswith("error: ") and why in res.observation, (turn, res)
        assert calc.calls == 4 and py.calls == 7  # each one counted against the budget
        assert tool_call_code(call % '"{\\"code\\": \\"x=1\\"}"') == ("x=1", "")  # arguments as a JSON string
        assert tool_call_code(call % '{"code": "a"}' + call % '{"code": "b"}') == ("b", "")  # the last call
        assert tool_call_code("Run:\n```python\nprint(2)\n```") == ("print(2)\n", "")
        assert calc.step("\\boxed{3}").done and py.step("\\boxed{3}").done
    finally:
        runner.close()


def test_python_tool_pool_faults_are_error_messages_never_a_dead_rollout(monkeypatch):
    """The sandboxed tool's process-pool paths, at the pool's boundary (the real pool and sandbox run
    in tests/integration/envs/test_python_tool.py): a worker that died, one killed past its hard
    timeout, a pool that cannot start, a pool that does not answer within the wait bound, a closed
    runner: each an error message flagged error / timeout; the call neither raises nor hangs."""
    from megatron_rl.envs.python_tool import PythonTool
    from megatron_rl.envs.tools import ERROR, TIMEOUT, ToolRunner
    from megatron_rl.rewards import pool

    how = {}

    class FakePool:
        def __init__(self, n, preload=(), **kw):
            if how["run"] == "start":
                raise OSError("cannot spawn a worker")

        def run(self, tasks):
            if how["run"] == "hang":
                time.sleep(0.4)  # past the runner's wait bound (0.2 s)
            return [{"ok": pool.TaskResult("ok", (0, "42\n", "", False)),
                     "died": pool.TaskResult("error", error="worker died (exit -9)"),
                     "killed": pool.TaskResult("timeout")}.get(how["run"], pool.TaskResult("ok", (0, "", "", False)))
                    for _ in tasks]

        def close(self):
            pass

    monkeypatch.setattr(pool, "HardTimeoutPool", FakePool)
    for run, error, text in (("ok", "", "42\n"), ("died", ERROR, "error: the tool failed: worker died (exit -9)"),
                             ("killed", TIMEOUT, "error: the program did not finish within 0.5 s (killed)"),
                             ("hang", TIMEOUT, "error: no tool worker answered within 0.2 s"),
                             ("start", ERROR, "error: the tool failed: cannot spawn a worker")):
        how["run"] = run
        runner = ToolRunner(0.5, 1, wait_s=0.2)
        try:
            out = runner.run_python("print(42)")
        finally:
            runner.close()
        assert (out.error, out.text) == (error, text), run
    res = PythonTool(EnvConfig(), runner).step("```python\nprint(1)\n```")  # the runner is closed
    assert res.error == ERROR and "the tool runner is closed" in res.observation and not res.done


def test_calculator_is_exact_and_bounded():
    from megatron_rl.envs.calculator import calculate

    assert calculate("123*456") == "56088" and calculate("7/2") == "3.5" and calculate("2**10") == "1024"
    assert calculate("-(3+4)*2") == "-14" and calculate("10//3") == "3" and calculate("8/4") == "2"
    for bad, why in (("1/0", "division"), ("9**9**9", "too large"), ("__import__('os')", "only numbers"),
                     ("2" * 300, "longer"), ("(1", "parse"), ("", "empty")):
        with pytest.raises(ValueError, match=why):
            calculate(bad)
    t0 = time.monotonic()
    with pytest.raises(ValueError):
        calculate("(" * 150 + "1" + ")" * 49)
    assert time.monotonic() - t0 < 0.1


def test_multi_turn_reward_scores_the_final_answer_never_a_tools_output():
    """A tool that prints the right boxed answer cannot earn the reward: the reward scores the
    model's final turn (the episode's answer), not the trajectory's text."""
    import torch

    from megatron_rl.rewards import RewardManager
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.trainer import phases

    @register_env("test_boxing_tool")
    class Boxing(Environment):
        def step(self, turn):
            if self.calls:
                return StepResult(done=True)
            return self.use_tool("boxing", lambda: self.tools.call(lambda: f"\\boxed{{{self.record.ground_truth}}}"))

    try:
        script = {0: "<<1>>", 1: "0"}  # a call, then a final answer without any boxed value
        engine = ScriptedEngine(lambda prompt, seed, j: script[prompt.count("A:") - 1])
        envs = _envs()
        rec = _record(12, 34, env="test_boxing_tool")
        rec.style = "exact_boxed"
        try:
            (group,) = generate(engine, envs, [rec], SamplingSpec(n=1, temperature=1.0, max_tokens=60))
        finally:
            envs.close()
        (c,) = group
        assert "\\boxed{408}" in c.text and c.extra["episode"]["answer"] == "0"
        ro = phases.Rollout(records=[rec], completions=[c], group_ids=torch.tensor([0]))
        with RewardManager(RewardConfig()) as mgr:
            phases.score(mgr, ro)
        assert ro.rewards.tolist() == [0.0] and ro.outcomes[0]["status"] == "unparsable"
    finally:
        ENVIRONMENTS.unregister("test_boxing_tool")


def test_multi_turn_turns_across_a_weight_update_carry_per_token_versions():
    """Partial rollouts per trajectory: a streaming engine that holds every first turn until a
    weight update. The trajectory's first turn is the old version's, the observation after it
    carries that version (it is never trained on; its version only orders the trajectory), the
    next turn the new version's; the trajectory's version (its oldest token's) is the old one and
    its spans say where each version starts."""
    from megatron_rl.rollout.streaming import GroupStream

    class Held(GroupStream):
        keeps_in_flight = True
        can_abort = True

        def __init__(self):
            self.engine = ScriptedEngine()
            self.held, self.version = [], 7

        def submit(self, prompt_ids, sampling, tags, on_done):
            self.engine.weight_version = self.version
            out = list(zip(tags, self.engine.generate(prompt_ids, sampling)))
            first = [o for o, p in zip(out, prompt_ids) if TOK.decode(p).count("A:") == 1]
            self.held += [(o, on_done) for o in first]
            rest = [o for o in out if o not in first]
            if rest:
                on_done(rest)

        def update(self, version):
            self.version = version
            held, self.held = self.held, []
            for (tag, group), on_done in held:
                on_done([(tag, group)])

        def abort(self, tags):
            pass

        def busy_seconds(self):
            return 0.0

        def in_flight(self):
            return len(self.held)

    inner, envs = Held(), _envs()
    stream = MultiTurnStream(inner, envs)
    got: dict = {}
    try:
        stream.submit_records([_record(12, 34, i=0), _record(5, 6, i=1)], SPEC, ["a", "b"], got.update)
        deadline = time.monotonic() + 5
        while len(inner.held) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        inner.update(8)  # the first turns finish after the update (their tokens: version 7)
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        stream.close()
        envs.close()
    for c in got["a"] + got["b"]:
        ep = c.extra["episode"]
        first, obs, last = ep["messages"]
        versions = c.token_versions()
        assert versions == [7] * (first["tokens"] + obs["tokens"]) + [8] * last["tokens"]
        assert c.weight_version == 7 and c.newest_version == 8 and c.partial
        assert c.version_spans == [(7, 0, last["start"]), (8, last["start"], len(c.token_ids))]


def test_multi_turn_tool_output_cannot_forge_a_turn_boundary():
    """A tool printing the end-of-turn token's text (``</s>``, ChatML's ``<|im_end|>``) gets it as plain
    text: its special-token strings are split (byte-level tokenizer), so no observation carries the
    EOS id; the template's own wrapping still does where it has one."""
    from megatron_rl.demo.tiny import build_bpe_tokenizer
    from megatron_rl.envs.render import TurnRenderer

    tok = build_bpe_tokenizer()
    r = TurnRenderer(tok)
    assert tok(f"a{tok.eos_token}b", add_special_tokens=False)["input_ids"].count(tok.eos_token_id) == 1
    obs = r.observation_ids(f"a{tok.eos_token}b{tok.eos_token}")
    assert tok.eos_token_id not in obs and tok.decode(obs) == f"=a{tok.eos_token}b{tok.eos_token}\nA:"


class _Late(GroupStream):
    """The scripted engine's turns, each answered ``delay`` s after it was sent (a fleet re-sending a
    request whose engine timed out, or waiting for restarts); ``progress``: it reports its progress as
    now (it is working on it), else none (``GroupStream``'s default)."""

    keeps_in_flight = False
    can_abort = False

    def __init__(self, delay: float, progress: bool):
        self.engine, self.delay, self.progress = ScriptedEngine(), delay, progress
        self.timers: list[threading.Timer] = []

    def submit(self, prompt_ids, sampling, tags, on_done):
        groups = list(zip(tags, self.engine.generate(prompt_ids, sampling)))
        timer = threading.Timer(self.delay, on_done, args=(groups,))
        self.timers.append(timer)
        timer.start()

    def last_progress(self):
        return time.monotonic() if self.progress else None

    def abort(self, tags):
        pass

    def busy_seconds(self):
        return 0.0

    def in_flight(self):
        return sum(t.is_alive() for t in self.timers)


def test_multi_turn_watchdog_counts_from_the_inner_streams_progress_and_a_running_tool():
    """The trainer's watchdog (rollout.timeout_s after the stream's last progress) through the
    multi-turn wrapper. (1) The scheduler waits for a wave of calculator trajectories whose two turns
    take 1.2 s, past the multi-turn window (2 x max_turns x rollout.timeout_s = 1.0 s), while the inner
    stream reports progress: the wrapper passes it on. (2) A tool running within its own timeout is
    progress though nothing is in flight on the engine (its stream reports none)."""
    from megatron_rl.algo.config import AlgoConfig
    from megatron_rl.data.loader import PromptLoader
    from megatron_rl.rewards import RewardManager
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rollout.config import AsyncConfig, RolloutConfig
    from megatron_rl.trainer.async_rollout import RolloutScheduler

    r = RolloutConfig(rollout_batch_size=2, group_size=2, temperature=1.0, timeout_s=0.25,
                      async_=AsyncConfig(max_staleness=1))
    envs = Environments(EnvConfig(), TOK, max_turns=2, wait_s=0.25)
    inner = _Late(delay=0.6, progress=True)
    loader = PromptLoader([_record(12 + i, 34, i=i) for i in range(4)], 2, seed=5)
    sched = RolloutScheduler(inner, loader, RewardManager(RewardConfig()), r, AlgoConfig(), run_seed=11,
                             max_response_len=40, envs=envs)
    try:
        assert sched.group_timeout_s == 1.0
        t0 = time.monotonic()
        ro, _ = sched.next_rollout(0, 100, 0, lambda name: contextlib.nullcontext())
        assert time.monotonic() - t0 > 1.0
    finally:
        sched.close()
        envs.close()
    assert len(ro.completions) == 4 and ro.rewards.tolist() == [1.0] * 4
    assert all(c.extra["episode"]["tool_calls"] == 1 for c in ro.completions)

    started, release = threading.Event(), threading.Event()

    @register_env("test_slow_tool")
    class Slow(Environment):
        def step(self, turn):
            if "<<" in turn:  # the calculator's answer, after a wait
                started.set()
                return self.use_tool("slow", lambda: self.tools.call(lambda: release.wait(5.0) and "408"))
            return StepResult(done=True)

    envs = _envs(tool_timeout_s=10.0)
    inner = _Late(delay=0.0, progress=False)
    stream = MultiTurnStream(inner, envs)
    got: list = []
    try:
        stream.submit_records([_record(12, 34, env="test_slow_tool")], SPEC, ["a"], got.extend)
        assert started.wait(5)
        time.sleep(0.3)  # the tool has run 0.3 s; the engine's last answer is older
        lag = time.monotonic() - stream.last_progress()
        release.set()
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stream.close()
        envs.close()
        ENVIRONMENTS.unregister("test_slow_tool")
    assert lag < 0.05, lag
    assert [t for t, _ in got] == ["a"] and got[0][1][0].extra["episode"]["tool_calls"] == 1


class _RoutingEngine(ScriptedEngine):
    """The scripted engine returning MoE routes as an engine started with ``return_routes`` does:
    ``len(prompt) + len(response) - 1`` rows, each marking the request that computed it (column 0:
    the request's prompt length, i.e. which turn of a trajectory; column 1: the position);
    ``no_routes_after``: requests whose prompt is longer come back without routes (an aborted turn)."""

    def __init__(self, no_routes_after: int | None = None):
        super().__init__()
        self.no_routes_after = no_routes_after

    def generate(self, prompt_ids, spec):
        import numpy as np

        out = super().generate(prompt_ids, spec)
        for p, group in zip(prompt_ids, out):
            for c in group:
                if self.no_routes_after is not None and len(p) > self.no_routes_after:
                    continue
                n = len(p) + len(c.token_ids) - 1
                c.routes = np.stack([np.full(n, len(p)), np.arange(n)], -1)[:, None, :].repeat(3, 1)
        return out


def test_multi_turn_routing_replay_rows_come_from_the_turn_that_computed_them():
    """MoE routes of a trajectory (calculator: call, observation, answer): one row per position of
    prompt + trajectory but the last; the prompt's and turn 1's tokens' rows from turn 1's request,
    the rows of turn 1's last token, of the observation and of turn 2's tokens from turn 2's request
    (whose prompt is the history). A turn without routes leaves the trajectory without them; a
    trajectory with no token of the model's gets placeholder rows in the trainer's batch, and the
    routing metrics count the model's tokens only."""
    import numpy as np
    import torch

    from megatron_rl.trainer.routing_replay import engine_routes, logp_gap, router_agreement

    envs = _envs()
    record = _record(12, 34, i=0)
    try:
        (group,) = generate(_RoutingEngine(), envs, [record], SPEC)
        (lost,) = generate(_RoutingEngine(no_routes_after=len(record.prompt_ids)), envs, [record], SPEC)
    finally:
        envs.close()
    P = len(record.prompt_ids)
    for c in group:
        first, obs, last = c.extra["episode"]["messages"]
        assert c.routes.shape == (P + len(c.token_ids) - 1, 3, 2)
        assert (c.routes[:, :, 1] == np.arange(len(c.routes))[:, None]).all()  # row p is position p
        # which request computed each row: turn 1's (prompt length P) up to its own last token's
        # position, turn 2's (prompt: the history, P + its start) from there
        split = P + first["tokens"] - 1
        want = np.where(np.arange(len(c.routes)) < split, P, P + last["start"])
        assert (c.routes[:, :, 0] == want[:, None]).all(), c.routes[:, 0, 0]
        assert last["start"] == first["tokens"] + obs["tokens"]
    assert all(c.routes is None for c in lost)  # turn 2 returned none

    # the trainer's batch: the trajectory's rows (+ the last token's copy); placeholder rows only for
    # a trajectory with no token of the model's (no forward ran on it), never for one with
    from megatron_rl.algo import AlgoConfig
    from megatron_rl.trainer import phases
    from megatron_rl.trainer.routing_replay import ENGINE

    c = group[0]
    empty = Completion(token_ids=c.token_ids[:5], logprobs=[0.0] * 5, text="", finish_reason="length",
                       truncated=True, loss_mask=[0] * 5)
    ro = phases.Rollout(records=[record], completions=[c, empty], group_ids=torch.tensor([0, 0]),
                        rewards=torch.tensor([1.0, 0.0]), truncated=torch.tensor([False, True]))
    batch, _ = phases.make_batch(ro, AlgoConfig())
    rows, placeholder = batch.position_fields[ENGINE]
    assert torch.equal(rows[:-1], torch.from_numpy(c.routes).to(torch.int16)) and torch.equal(rows[-1], rows[-2])
    assert placeholder.shape == (P + 5, 3, 2) and (placeholder == torch.tensor([0, 1], dtype=torch.int16)).all()
    with pytest.raises(RuntimeError, match="no MoE routes"):
        phases.make_batch(phases.Rollout(records=[record], completions=[c, lost[0]], group_ids=torch.tensor([0, 0]),
                                         rewards=torch.tensor([1.0, 0.0]), truncated=torch.tensor([False, False])),
                          AlgoConfig())
    from megatron_rl.trainer.routing_replay import StepRouting

    no_routes = phases.make_batch(phases.Rollout(records=[record], completions=[lost[0]], group_ids=torch.tensor([0]),
                                                 rewards=torch.tensor([1.0]), truncated=torch.tensor([False])),
                                  AlgoConfig(filter_zero_variance_groups=False))[0]
    r3 = StepRouting(AlgoConfig(routing_replay="r3"))
    for pass_ in (r3.old_pass, r3.update_pass):  # r3, and no completion has routes: said, not a KeyError
        with pytest.raises(RuntimeError, match="none of the batch's 1 completions has MoE routes"):
            pass_(no_routes)
    # metrics over the model's tokens: positions predicting observation tokens count in neither
    engine = [torch.tensor([[[0, 1]]] * 6)]
    trainer = [torch.tensor([[[0, 1]], [[1, 0]], [[2, 3]], [[2, 3]], [[1, 0]], [[0, 1]]])]
    mask = [torch.tensor([True, True, False, False, True])]  # response tokens 1-5 (prompt 1)
    assert router_agreement(trainer, engine, [1], [6]) == pytest.approx(3 / 5)
    assert router_agreement(trainer, engine, [1], [6], mask) == pytest.approx(1.0)
    logp, rollout = [torch.tensor([-1.0, -2.0, -3.0, -1.5, -1.0])], [torch.tensor([-1.0, -2.5, 0.0, 0.0, -1.0])]
    assert logp_gap(logp, rollout, mask) == pytest.approx(0.5 / 3)
    assert logp_gap(logp, rollout) == pytest.approx(5.0 / 5)
