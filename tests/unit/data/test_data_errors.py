"""Every data read fails as a DataError naming the file (and 1-based row where there is one), or
skips and counts the row under ``data.on_bad_row=skip``: never a bare UnicodeDecodeError,
ArrowInvalid or "PromptLoader needs at least one record"."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data import DataConfig, DataError, PromptLoader, load_prompts, read_rows


@pytest.fixture(scope="module")
def tok():
    from megatron_rl.demo import build_bpe_tokenizer

    return build_bpe_tokenizer()


def row(i: int, text: str | None = None) -> dict:
    return {"data_source": "t", "prompt": [{"role": "user", "content": text or f"what is {i} + {i}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)}}


def jsonl_bytes(rows) -> bytes:
    return b"".join((json.dumps(r) + "\n").encode() if isinstance(r, dict) else r for r in rows)


def _raises(path, tok, cfg=None, max_prompt_len=None) -> str:
    with pytest.raises(DataError) as e:
        load_prompts(path, tok, cfg or DataConfig(), max_prompt_len=max_prompt_len)
    assert str(path) in str(e.value)
    return str(e.value)


def test_non_utf8_jsonl_row_names_file_and_row_or_is_skipped(tmp_path, tok):
    p = tmp_path / "t.jsonl"
    p.write_bytes(jsonl_bytes([row(1), row(2), b'{"prompt": "caf\xe9 \xff"}\n', row(4)]))
    msg = _raises(p, tok)
    assert "row 3" in msg and "UTF-8" in msg
    recs, stats = load_prompts(p, tok, DataConfig(on_bad_row="skip"))
    assert [r.row for r in recs] == [1, 2, 4] and stats["bad_rows"] == 1


def test_utf8_bom_is_not_a_bad_row(tmp_path, tok):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + jsonl_bytes([row(1), row(2)]))
    recs, _ = load_prompts(p, tok, DataConfig())
    assert len(recs) == 2


def test_non_utf8_json_names_file_and_line(tmp_path, tok):
    p = tmp_path / "t.json"
    p.write_bytes(b'[\n {"prompt": "a"},\n {"prompt": "\xff"}\n]')
    msg = _raises(p, tok)
    assert "line 3" in msg and "UTF-8" in msg


@pytest.mark.parametrize("content", [b"", b"\n\n", b"  "])
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_empty_file(tmp_path, tok, suffix, content):
    p = tmp_path / f"t{suffix}"
    p.write_bytes(content)
    msg = _raises(p, tok)
    assert "empty" in msg or "no rows" in msg or "parquet" in msg


def test_empty_parquet_table_has_no_rows(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), p)
    assert "no rows" in _raises(p, tok)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not_parquet_magic"])
def test_corrupt_parquet(tmp_path, tok, damage):
    import pandas as pd

    p = tmp_path / "t.parquet"
    pd.DataFrame([row(i) for i in range(50)]).to_parquet(p)
    data = p.read_bytes()
    if damage == "garbage":
        data = b"PAR1" + b"\x13" * 200 + b"PAR1"
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = b"hello, not a parquet file" * 10
    p.write_bytes(data)
    msg = _raises(p, tok)
    assert "parquet" in msg
    with pytest.raises(DataError):  # the row reader too (the difficulty tool's copy)
        list(read_rows(p))


def test_corrupt_parquet_page_names_the_rows(tmp_path, tok):
    """Footer intact, a data page overwritten: the rows of that row group are named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    table = pa.Table.from_pylist([{"prompt": f"question number {i} " * 20, "answer": str(i)}
                                  for i in range(400)])
    pq.write_table(table, p, row_group_size=100, compression="NONE")
    meta = pq.ParquetFile(p).metadata
    col = meta.row_group(2).column(0)
    data = bytearray(p.read_bytes())
    start = col.data_page_offset + 8
    data[start: start + 64] = b"\xff" * 64
    p.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        list(read_rows(p))
    assert str(p) in str(e.value) and "rows 201-300" in str(e.value)


def test_every_prompt_too_long(tmp_path, tok):
    p = tmp_path / "t.jsonl"
    p.write_bytes(jsonl_bytes([row(i, "word " * 50) for i in range(4)]))
    msg = _raises(p, tok, max_prompt_len=8)
    assert "4 longer than the 8-token prompt limit" in msg


def test_every_row_skipped(tmp_path, tok):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"not json\n{\"prompt\": 3}\n")
    msg = _raises(p, tok, DataConfig(on_bad_row="skip"))
    assert "2 malformed and skipped" in msg


def test_every_row_filtered_by_difficulty(tmp_path, tok):
    p = tmp_path / "t.jsonl"
    p.write_bytes(jsonl_bytes([row(1), row(2)]))
    msg = _raises(p, tok, DataConfig(keep_labels=["hard"]))
    assert "difficulty filter" in msg


@pytest.mark.parametrize("make", ["directory", "missing", "suffix", "unreadable"])
def test_unreadable_paths(tmp_path, tok, make):
    import os

    p = tmp_path / ("t.txt" if make == "suffix" else "t.jsonl")
    if make == "directory":
        p.mkdir()
    elif make in ("suffix", "unreadable"):
        p.write_bytes(jsonl_bytes([row(1)]))
    if make == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads any file")
        p.chmod(0)
    _raises(p, tok)


def test_chat_template_failure_names_the_row(tmp_path, tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
                       "{{ raise_exception('no tools') }}{% endif %}{{ m['content'] }}{% endfor %}")
    p = tmp_path / "t.jsonl"
    p.write_bytes(jsonl_bytes([row(1), {**row(2), "prompt": [{"role": "tool", "content": "x"}]}]))
    msg = _raises(p, t)
    assert "row 2" in msg and "chat template" in msg
    recs, stats = load_prompts(p, t, DataConfig(on_bad_row="skip"))
    assert len(recs) == 1 and stats["bad_rows"] == 1


def test_prompt_loader_errors_are_data_errors():
    with pytest.raises(DataError):
        PromptLoader([], 4)
    loader = PromptLoader([1, 2, 3], 2)
    with pytest.raises(DataError, match="dataset or its settings changed"):
        PromptLoader([1, 2], 2).load_state_dict(loader.state_dict())
