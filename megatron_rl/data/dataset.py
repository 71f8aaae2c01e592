"""Prompt datasets: read jsonl / json / parquet rows (verl's format as is), template, tokenize, filter.

A verl row::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

A malformed row raises :class:`DataError` naming the file and the row (1-based), or is skipped and
counted with ``on_bad_row: skip``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from megatron_rl.common.errors import InputError
from megatron_rl.data.config import DataConfig

log = logging.getLogger("megatron_rl")

_MISSING = object()


class DataError(InputError, ValueError):
    """A dataset file or one of its rows is malformed."""


@dataclass
class PromptRecord:
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: Any
    style: str
    data_source: str
    extra: dict = field(default_factory=dict)
    uid: str = ""
    # 1-based row number in the source file (the annotated copy is matched by it).
    row: int = 0
    # The environment the row names (data.env_key; "": none): a multi-turn prompt (megatron_rl.envs).
    env: str = ""


def read_rows(path: str | Path, max_rows: int = 0) -> Iterator[tuple[int, Any]]:
    """``(row_number, row)`` for every row (1-based). A row that cannot be read (not UTF-8, not
    JSON) comes as a :class:`DataError` in place of the row, so the caller can skip and count it; a
    file that cannot be read at all raises DataError naming it."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            yield from _jsonl_rows(path, max_rows)
        elif suffix == ".json":
            yield from list(enumerate(_json_rows(path), 1))[: max_rows or None]
        elif suffix == ".parquet":
            yield from _parquet_rows(path, max_rows)
        else:
            raise DataError(f"{path}: unknown dataset format {suffix!r} (use .jsonl, .json or .parquet)")
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _jsonl_rows(path: Path, max_rows: int) -> Iterator[tuple[int, Any]]:
    n = 0
    with path.open("rb") as f:  # decoded line by line: a bad byte is that row's fault only
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield lineno, DataError(f"{path}: row {lineno}: not UTF-8 text (byte {exc.start} of "
                                        f"the line: {raw[exc.start:exc.start + 4]!r})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield lineno, DataError(f"{path}: row {lineno}: invalid JSON ({exc})")
                continue
            yield lineno, row
            n += 1
            if max_rows and n >= max_rows:
                return


def _json_rows(path: Path) -> list:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: not UTF-8 text (byte {exc.start} of the file)") from None
    if not text.strip():
        raise DataError(f"{path}: empty file")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a .json dataset must hold a list of rows")
    return rows


def _parquet_rows(path: Path, max_rows: int) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    rowno = 0
    for group in range(pf.num_row_groups):
        first = rowno + 1
        try:
            rows = pf.read_row_group(group).to_pylist()
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
            last = first + pf.metadata.row_group(group).num_rows - 1
            raise DataError(f"{path}: rows {first}-{last} (row group {group}) cannot be read "
                            f"({exc})") from None
        for row in rows:
            rowno += 1
            yield rowno, row
            if max_rows and rowno >= max_rows:
                return


def get_path(row: dict, dotted: str, default: Any = _MISSING) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; ``default`` (or KeyError) when a part is missing."""
    cur: Any = row
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            if default is _MISSING:
                raise KeyError(dotted)
            return default
    return cur


def _messages(prompt: Any, system_prompt: str) -> list[dict]:
    if isinstance(prompt, str):
        msgs = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        msgs = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError("prompt must be a string or a non-empty list of {role, content} messages")
    if system_prompt and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def _use_template(tokenizer, mode: str) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "always" and not has:
        raise DataError("data.chat_template is 'always' but the tokenizer has no chat template")
    return has and mode != "never"


def render_prompt(messages: list[dict], tokenizer, use_template: bool) -> str:
    if use_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


def difficulty_passes(extra: dict, cfg: DataConfig) -> str | None:
    """``None`` when the row passes the difficulty filter, else the stats key it is counted under."""
    ann = extra.get("difficulty") if isinstance(extra, dict) else None
    if not isinstance(ann, dict):
        return "filtered_unannotated"
    if cfg.keep_labels and ann.get("label") not in cfg.keep_labels:
        return "filtered_label"
    rate = ann.get("pass_rate")
    if not isinstance(rate, (int, float)) or not cfg.pass_rate_min <= rate <= cfg.pass_rate_max:
        return "filtered_pass_rate"
    return None


def load_prompts(path: str | Path, tokenizer, cfg: DataConfig | None = None,
                 max_prompt_len: int | None = None) -> tuple[list[PromptRecord], dict]:
    """Read, template, tokenize and filter a prompt dataset.

    ``max_prompt_len`` overrides ``cfg.max_prompt_len`` (0 = no limit). Returns the records and
    counts: rows, loaded, dropped (= rows - loaded: too_long + bad_rows + filtered_*), too_long,
    bad_rows (skipped), filtered_* (difficulty filter), prompt_len_max / prompt_len_mean of the
    loaded prompts. Any drop is a warning naming the file and the counts by reason; a file that
    leaves no prompt (empty, every prompt too long, every row skipped or filtered) is a
    :class:`DataError` saying why.
    """
    cfg = cfg or DataConfig()
    cfg.validate()
    limit = cfg.max_prompt_len if max_prompt_len is None else max_prompt_len
    use_template = _use_template(tokenizer, cfg.chat_template)
    stats = {"rows": 0, "loaded": 0, "too_long": 0, "bad_rows": 0, "filtered_label": 0,
             "filtered_pass_rate": 0, "filtered_unannotated": 0}
    pending: list[tuple[str, dict]] = []
    name = Path(path).name
    for rowno, row in read_rows(path, cfg.max_rows):
        stats["rows"] += 1
        try:
            if isinstance(row, DataError):
                raise row
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {rowno}: expected an object, got {type(row).__name__}")
            try:
                msgs = _messages(get_path(row, cfg.prompt_key), cfg.system_prompt)
                gt = get_path(row, cfg.ground_truth_key)
            except KeyError as exc:
                raise DataError(f"{path}: row {rowno}: missing field {exc.args[0]!r}") from None
            except ValueError as exc:
                raise DataError(f"{path}: row {rowno}: field {cfg.prompt_key!r}: {exc}") from None
            if gt is None:
                raise DataError(f"{path}: row {rowno}: {cfg.ground_truth_key!r} is null")
            style = get_path(row, cfg.style_key, "") or ""
            source = get_path(row, cfg.data_source_key, "") or ""
            extra = get_path(row, cfg.extra_key, None) or {}
            env = (get_path(row, cfg.env_key, "") or "") if cfg.env_key else ""
            if not isinstance(style, str) or not isinstance(source, str) or not isinstance(extra, dict):
                raise DataError(f"{path}: row {rowno}: style and data_source must be strings and "
                                f"{cfg.extra_key!r} an object")
            if not isinstance(env, str):
                raise DataError(f"{path}: row {rowno}: {cfg.env_key!r} (the environment) must be a string, "
                                f"got {type(env).__name__}")
            try:
                text = render_prompt(msgs, tokenizer, use_template)
            except Exception as exc:  # noqa: BLE001 - a template may raise anything on odd messages
                raise DataError(f"{path}: row {rowno}: the chat template cannot render this prompt "
                                f"({type(exc).__name__}: {exc})") from None
        except DataError:
            if cfg.on_bad_row == "raise":
                raise
            stats["bad_rows"] += 1
            continue
        if cfg.filters_difficulty:
            reason = difficulty_passes(extra, cfg)
            if reason is not None:
                stats[reason] += 1
                continue
        uid = str(extra.get("uid", f"{name}:{rowno}"))
        rec = PromptRecord([], text, gt, style, source, extra, uid, rowno, env)
        pending.append((text, rec))
    records = _tokenize(pending, tokenizer, use_template)
    kept = []
    for rec in records:
        if limit and len(rec.prompt_ids) > limit:
            stats["too_long"] += 1
        else:
            kept.append(rec)
    stats["loaded"] = len(kept)
    stats["dropped"] = stats["rows"] - len(kept)
    if not kept:
        raise DataError(f"{path}: no usable prompt: {_why_dropped(stats, limit)}")
    if stats["dropped"]:  # every drop is counted (the stats) and said, whichever file it is
        log.warning("%s: %d of %d rows dropped: %s", path, stats["dropped"], stats["rows"],
                    _why_dropped(stats, limit, read=False))
    lens = [len(r.prompt_ids) for r in kept]
    stats["prompt_len_max"] = max(lens, default=0)
    stats["prompt_len_mean"] = sum(lens) / len(lens) if lens else 0.0
    return kept, stats


def _why_dropped(stats: dict, limit: int, read: bool = True) -> str:
    if not stats["rows"]:
        return "the file holds no rows"
    parts = [f"{stats['rows']} rows read"] if read else []
    if stats["too_long"]:
        parts.append(f"{stats['too_long']} longer than the {limit}-token prompt limit "
                     f"(rollout.max_prompt_len / data.max_prompt_len)")
    if stats["bad_rows"]:
        parts.append(f"{stats['bad_rows']} malformed and skipped (data.on_bad_row=skip)")
    filtered = sum(v for k, v in stats.items() if k.startswith("filtered_"))
    if filtered:
        parts.append(f"{filtered} dropped by the difficulty filter (data.keep_labels / "
                     f"data.pass_rate_min / data.pass_rate_max)")
    return ", ".join(parts)


def _tokenize(pending: list[tuple[str, PromptRecord]], tokenizer, use_template: bool,
              chunk: int = 1024) -> list[PromptRecord]:
    # A chat template already writes the special tokens it wants (BOS included).
    for start in range(0, len(pending), chunk):
        part = pending[start: start + chunk]
        enc = tokenizer([t for t, _ in part], add_special_tokens=not use_template)["input_ids"]
        for (_, rec), ids in zip(part, enc):
            rec.prompt_ids = list(ids)
    return [rec for _, rec in pending]
