"""Every subcommand prints an input error as one line, ``megatron-rl: ...``, exit status 2, no
traceback; a bug keeps its traceback. (In process: none of these get as far as building a model.)"""

from __future__ import annotations

import pytest
import yaml

from megatron_rl.cli import main

MIN = {"model": {"tiny": {}}, "data": {"train_path": "x.jsonl"},
       "stages": [{"name": "s1", "max_response_len": 8, "max_steps": 1}]}


def _one_line(capsys, argv, *expected):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "megatron-rl:" not in out, out  # errors go to stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("megatron-rl: "), err
    assert "Traceback" not in err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(MIN))
    return p


def test_train_bad_override(capsys, cfg_file):
    _one_line(capsys, ["train", "--config", str(cfg_file), "rollout.temprature=1"],
              "rollout.temprature", "on the command line")


def test_train_missing_config_file(capsys, tmp_path):
    _one_line(capsys, ["train", "--config", str(tmp_path / "nope.yaml")], "nope.yaml")


def test_train_unknown_stage(capsys, cfg_file):
    _one_line(capsys, ["train", "--config", str(cfg_file), "--stage", "s9"], "s9")


def test_train_empty_run_dir(capsys, cfg_file):
    _one_line(capsys, ["train", "--config", str(cfg_file), "--run-dir", ""], "trainer.run_dir")


def test_demo_bad_override(capsys, tmp_path):
    _one_line(capsys, ["demo", "--run-dir", str(tmp_path), "stages.5.max_steps=1"],
              "stages.5.max_steps", "on the command line")


def test_validate_bad_file(capsys, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({**MIN, "defaults": {"a": 1}}))
    _one_line(capsys, ["validate", str(p)], "defaults", str(p))


def test_data_difficulty_errors(capsys, tmp_path, tiny_llama):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n\xff\xfe\n')
    out = str(tmp_path / "o.jsonl")
    base = ["data", "difficulty", "--model", tiny_llama, "--out", out]
    _one_line(capsys, [*base, "--data", str(tmp_path / "missing.jsonl")], "missing.jsonl")
    _one_line(capsys, [*base, "--data", str(data), "k=0"], "'k'", "on the command line")
    _one_line(capsys, [*base, "--data", str(data)], str(data), "row 2", "UTF-8")
    _one_line(capsys, ["data", "difficulty", "--model", tiny_llama, "--out", str(tmp_path / "o.csv"),
                       "--data", str(data)], "o.csv")
    # where the output cannot be written: said before the engine runs, not after (issue 27)
    (tmp_path / "a_file").write_text("")
    good = tmp_path / "g.jsonl"
    good.write_text('{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n')
    (tmp_path / "dir.jsonl").mkdir()
    for target, says in (("a_file/o.jsonl", ("a_file/o.jsonl (--out)", "cannot create its directory")),
                         ("dir.jsonl", ("dir.jsonl (--out)", "is a directory"))):
        _one_line(capsys, ["data", "difficulty", "--model", tiny_llama, "--data", str(good), "--out",
                           str(tmp_path / target)], *says)
    _one_line(capsys, ["data", "difficulty", "--model", tiny_llama, "--data", str(good), "--out", out,
                       "--summary", str(tmp_path / "a_file" / "s.json")], "s.json (--summary)", "cannot create")


def test_analyze_not_a_run_dir(capsys, tmp_path):
    _one_line(capsys, ["analyze", str(tmp_path / "nope")], "nope", "no such run directory")
    (tmp_path / "file").write_text("x")
    _one_line(capsys, ["analyze", str(tmp_path / "file")], "file", "no such run directory")
    (tmp_path / "empty").mkdir()
    _one_line(capsys, ["analyze", str(tmp_path / "empty")], "empty", "not a run directory")


def test_engines_without_servers_to_launch(capsys, cfg_file):
    _one_line(capsys, ["engines", "--config", str(cfg_file)], "engines:", "rollout.engine='vllm'",
              "nothing to launch")


@pytest.mark.parametrize("argv,says", [
    ([], "COMMAND"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["train"], "train: the following arguments are required: --config"),
    (["train", "--config", "c.yaml", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--run-dir"], "demo: argument --run-dir: expected one argument"),
    (["engines", "--config", "c.yaml", "--count", "x"], "engines: argument --count: invalid int"),
    (["analyze"], "analyze: the following arguments are required: run_dir"),
    (["validate"], "validate: the following arguments are required: configs"),
    (["data"], "data: the following arguments are required: TOOL"),
    (["data", "bogus"], "data: argument TOOL: invalid choice: 'bogus'"),
    (["data", "difficulty", "--data", "d.jsonl"], "data difficulty: the following arguments are "
                                                  "required: --model, --out"),
])
def test_every_subcommand_reports_a_bad_command_line_in_one_line(capsys, argv, says):
    assert "--help" in _one_line(capsys, argv, says)  # one line: no usage block


def test_a_bug_keeps_its_traceback(monkeypatch, cfg_file):
    import megatron_rl.trainer.schema as schema

    def broken(*a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr(schema, "load_run_config", broken)
    with pytest.raises(KeyError):
        main(["validate", str(cfg_file)])


def test_non_zero_ranks_say_which_rank(capsys, monkeypatch, cfg_file):
    monkeypatch.setenv("RANK", "3")
    line = _one_line(capsys, ["validate", str(cfg_file) + ".missing"])
    assert line.startswith("megatron-rl: (rank 3) ")
