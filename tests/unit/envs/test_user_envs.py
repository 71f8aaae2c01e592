"""User environments (``envs.classes``): the start-up checks (one line naming the key, the file and the
fault), registration beside the built-in ones, and an episode of a class loaded from a file, stepped
as the multi-turn loop does, against the class used directly."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from megatron_rl.config.base import ConfigError
from megatron_rl.envs import API_VERSION, EnvClassError, EnvConfig, Environment, Environments, StepResult
from megatron_rl.envs.registry import ENVIRONMENTS
from megatron_rl.envs.user import class_problem

SOURCE = textwrap.dedent("""
    from megatron_rl.envs import Environment, StepResult, ToolOutput

    class Reverse(Environment):
        api_version = 1
        def step(self, turn):
            if self.calls:
                return StepResult(done=True, answer=turn.upper())
            return self.use_tool("reverse", lambda: ToolOutput(turn[::-1] + str(self.record.ground_truth)))

    class NoStep(Environment):
        pass

    class Old(Reverse):
        api_version = 0

    class NeedsMore(Reverse):
        def __init__(self, cfg, tools, extra):
            super().__init__(cfg, tools)

    class NotAnEnv:
        def step(self, turn):
            return None

    def function(turn):
        return turn
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(SOURCE)
    yield path
    for name in [n for n in ENVIRONMENTS if n.startswith("u_")]:
        ENVIRONMENTS.unregister(name)


def _envs(classes: dict, **kw) -> Environments:
    return Environments(EnvConfig.from_dict({"classes": classes, **kw}), None, max_turns=3)


@pytest.mark.parametrize("name,why", [
    ("NoStep", "NoStep does not implement step"),
    ("Old", f"Old is written for environment API version 0; this trainer's is {API_VERSION}"),
    ("NeedsMore", "NeedsMore(cfg, tools) cannot be constructed as the trainer does"),
    ("NotAnEnv", "NotAnEnv is not a subclass of megatron_rl.envs.Environment"),
    ("function", "it is a function, not a class"),
    ("Missing", "it has no 'Missing'"),
])
def test_a_class_that_does_not_fit_is_refused_with_one_line(user_file, name, why):
    with pytest.raises(EnvClassError) as exc:
        _envs({"u_env": f"{user_file}:{name}"})
    assert str(exc.value) == f"envs.classes.u_env: {user_file}:{name}: {why}" or \
        str(exc.value).startswith(f"envs.classes.u_env: {user_file}:{name}: {why}"), str(exc.value)
    assert "u_env" not in ENVIRONMENTS


def test_import_failures_and_names(tmp_path, user_file):
    (tmp_path / "broken.py").write_text("import no_such_env_lib\n")
    with pytest.raises(EnvClassError, match=r"envs.classes.u_b: .*broken.py:Env: importing it raised "
                                             r"ModuleNotFoundError: No module named 'no_such_env_lib'"):
        _envs({"u_b": f"{tmp_path / 'broken.py'}:Env"})
    with pytest.raises(EnvClassError, match="no such file"):
        _envs({"u_c": f"{tmp_path / 'nope.py'}:Env"})
    with pytest.raises(ConfigError, match="'calculator' is a built-in environment's name"):
        EnvConfig.from_dict({"classes": {"calculator": f"{user_file}:Reverse"}}).validate()
    with pytest.raises(ConfigError, match="default_env.*unknown environment 'u_other'.*envs.classes / envs.services"):
        EnvConfig.from_dict({"classes": {"u_r": f"{user_file}:Reverse"}, "default_env": "u_other"}).validate()
    assert all(class_problem(c) == "" for c in (ENVIRONMENTS["calculator"], ENVIRONMENTS["python_tool"]))


def test_an_episode_of_a_class_from_a_file(user_file):
    """Resolved by the data source, opened fresh per trajectory, stepped: what the class itself says."""
    envs = _envs({"u_rev": f"{user_file}:Reverse"}, env_map={"src": "u_rev"})
    try:
        record = SimpleNamespace(env="", data_source="src", row=1, prompt_ids=[5, 6], ground_truth=42)
        assert envs.name(record) == "u_rev"
        env, other = envs.open(record), envs.open(record)
        assert isinstance(env, Environment) and env is not other and type(env).__name__ == "Reverse"
        assert env.reset(record) == [5, 6]
        first = env.step("abc")
        assert (first.observation, first.tool, first.done, first.error) == ("cba42", "reverse", False, "")
        assert env.step("final") == StepResult(done=True, answer="FINAL")
    finally:
        envs.close()
