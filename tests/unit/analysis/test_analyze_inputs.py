"""`megatron-rl analyze` on run directories it cannot fully use: each problem is one line naming the
file (and line), exit status 2, no traceback; what can be used still makes the report, which lists
what it left out. Checked against the report made from the undamaged run (the same figures' data)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_rl.analysis.run_data import check_planted, check_summary, check_wrong_labels, load_run
from megatron_rl.cli import main
from tests.unit.analysis.synthetic_run import make_run


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs") / "run"
    make_run(root, prompts=40, batch=10, group=4, planted=2, hard=2, sft_steps=2)
    return root


@pytest.fixture
def run(base, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(base, root)
    return root


def _analyze(capsys, root, *extra):
    code = main(["analyze", str(root), *extra])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, [line for line in err.splitlines() if line.strip()]


def _one_line(capsys, root, *says, extra=()):
    code, out, err = _analyze(capsys, root, *extra)
    assert code == 2 and len(err) == 1 and err[0].startswith("megatron-rl: "), (code, err)
    for text in says:
        assert text in err[0], err[0]
    return out, err[0]


def _dumps(root: Path) -> list[Path]:
    return sorted((root / "rollouts").glob("step_*.parquet"))


def test_analyze_damaged_dumps_are_named_and_left_out(capsys, run):
    """Six dumps damaged six ways in one run: each is named, the report is made from the others."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    full = load_run(run)
    files = _dumps(run)
    damaged = dict(zip(("random bytes", "truncated", "empty", "another table", "wrong types", "a directory"),
                       files[2::3]))
    lost = sum(int((full.rollouts["global_step"] == pq.read_table(f)["global_step"][0].as_py()).sum())
               for f in damaged.values())
    for how, f in damaged.items():
        if how == "random bytes":
            f.write_bytes(os.urandom(4096))
        elif how == "truncated":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        elif how == "empty":
            f.write_bytes(b"")
        elif how == "another table":
            pq.write_table(pa.table({"x": [1, 2, 3]}), f)
        elif how == "wrong types":
            t = pq.read_table(f)
            pq.write_table(t.set_column(t.column_names.index("reward"), "reward",
                                        pa.array(["<b>lots</b>"] * t.num_rows)), f)
        else:
            f.unlink()
            f.mkdir()
    out, line = _one_line(capsys, run, str(damaged["random bytes"]), "and 5 more", "the report was made from the rest")
    facts = json.loads(out.strip().splitlines()[-1])
    assert [next(str(f) for f in damaged.values() if str(f) in s) for s in facts["skipped"]] == \
        [str(f) for f in damaged.values()], facts["skipped"]
    assert "not a rollout dump (no column grpo_step" in facts["skipped"][3]
    assert "wrong type" in facts["skipped"][4] and "not a readable parquet file" in facts["skipped"][1]
    page = (run / "report" / "index.html").read_text()
    assert 'id="skipped"' in page and all(f.name in page for f in damaged.values())
    data = load_run(run)  # the rest: every other step's samples, unchanged
    assert len(data.rollouts) == len(full.rollouts) - lost and lost > 0


def test_analyze_metrics_lines_that_are_no_json_objects(capsys, run):
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    full = load_run(run).metrics
    lines[5] = lines[5][: len(lines[5]) // 2]            # cut in the middle of the file
    lines[9] = "[1, 2, 3]"                               # JSON, not an object
    lines[12] = json.dumps({**json.loads(lines[12]), "step": "twelve"})  # no integer step
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe{not utf-8}\n")
    _, line = _one_line(capsys, run, str(path), "lines 6, 10, 13, ", "not a JSON object with an integer 'step'")
    assert f"line{'s'} 6, 10, 13, {len(lines) + 1}:" in line
    assert len(load_run(run).metrics) == len(full) - 3  # (the 2 SFT rows come first: 3 GRPO steps lost)


def test_analyze_a_cut_last_line_and_values_of_the_wrong_type_are_not_faults(capsys, run):
    """A last line without its newline (a crash cut the write) is noted; metric values that are no
    numbers are missing values (never markup, never a crash)."""
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows = [{**r, "rollout/accuracy": "<b>high</b>", "timing/step": None, "actor/entropy": [1]}
            if r.get("grpo_step") == 4 else r for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps(rows[-1])[:30])
    code, out, err = _analyze(capsys, run)
    assert code == 0 and err == [], err
    assert "was cut short" in (run / "report" / "index.html").read_text()
    data = load_run(run)
    x, _ = data.series("rollout/accuracy")
    assert 4 not in x and len(x) == len(data.metrics) - 1


@pytest.mark.parametrize("check,content,says", [
    (check_wrong_labels, [1, 2], "the list is a list, not a JSON object"),
    (check_wrong_labels, {"suspects": [{"uid": ["a"]}]}, "suspects[0] is not an object with a string 'uid'"),
    (check_wrong_labels, {"hard_kept_off": "x"}, "hard_kept_off is a str, not a list"),
    (check_wrong_labels, {"points": [["u", "x", "0.5", 0.1]]}, "points[0] is not [uid, label, pass rate"),
    (check_wrong_labels, {"points": [["u", "x", 0.5]]}, "points[0] is not [uid, label, pass rate"),
    (check_wrong_labels, {"sources": {"s": 3}}, "sources['s'] is a int"),
    (check_wrong_labels, {"rule": []}, "rule is a list"),
    (check_planted, {"wrong_label": "u1"}, "wrong_label is not a list of prompt ids"),
    (check_planted, {"hard": [1]}, "hard is not a list of prompt ids"),
    (check_summary, {"per_stage": {"s": 0.5}}, "per_stage['s'] is a float"),
    (check_summary, "text", "the summary is a str"),
])
def test_analyze_side_file_shapes_are_checked(check, content, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        check(content)


def test_analyze_side_files_of_another_shape_are_named_and_left_out(capsys, run):
    (run / "rollouts" / "wrong_labels.json").write_text("{not json")
    (run / "data" / "planted.json").write_text(json.dumps({"wrong_label": "u1"}))
    (run / "summary.json").write_bytes(b"\xff\xfe")
    out, line = _one_line(capsys, run, str(run / "rollouts" / "wrong_labels.json"), "and 2 more", "left out")
    skipped = json.loads(out.strip().splitlines()[-1])["skipped"]
    assert [s.split(":")[0] for s in skipped] == [str(run / p) for p in
                                                  ("rollouts/wrong_labels.json", "data/planted.json", "summary.json")]
    assert "wrong_label is not a list" in skipped[1]
    page = (run / "report" / "index.html").read_text()
    assert "No live list" in page and "planted.json" in page


@contextlib.contextmanager
def _read_only(path: Path):
    """``path`` made read-only for this process (root ignores permission bits: the immutable flag)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
        pytest.skip("cannot make a directory read-only for root here (no chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_analyze_where_the_report_cannot_be_written(capsys, run, tmp_path):
    with _read_only(run):
        _one_line(capsys, run, str(run / "report"), "cannot write the report there", "--out")
        code, out, err = _analyze(capsys, run, "--out", str(tmp_path / "elsewhere"))
        assert code == 0 and err == [] and (tmp_path / "elsewhere" / "index.html").exists()
    (tmp_path / "a_file").write_text("x")
    _one_line(capsys, run, str(tmp_path / "a_file"), "cannot write the report there",
              extra=("--out", str(tmp_path / "a_file")))


def test_analyze_a_missing_dir_or_unreadable_metrics(capsys, run, tmp_path):
    _one_line(capsys, tmp_path / "nope", "nope", "no such run directory")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    _one_line(capsys, run, str(run / "metrics.jsonl"), "cannot read it")
