"""Load prompt records from a JSONL / JSON / parquet / CSV file, a Hugging Face dataset, or memory.

    records = load_records("data/train.jsonl", prompt_column="question", answer_column="solution")
    records = load_records("openai/gsm8k", split="train", name="main",
                           prompt_column="question", answer_column="answer")

Every record is a dict holding all of the source row's columns plus `prompt` (from
`prompt_column`) and, when `answer_column` is given, `answer`. A prompt may be a string or a list
of chat messages (`[{"role": ..., "content": ...}, ...]`); `rljax.data.prompts.format_prompt`
accepts both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rljax.errors import UserError

_FILE_BUILDERS = {  # suffix -> datasets builder, for files read through `datasets`
    ".csv": "csv",
    ".tsv": "csv",
}


class MissingColumnError(UserError, KeyError):
    """A configured column is not in the data. Its message names the column and the ones available."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{line_number}: not valid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise UserError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path)  # a .json file that is really JSON lines
    if isinstance(data, Mapping):
        # {"data": [...]} or column-oriented {"col": [...], ...}
        if len(data) == 1 and isinstance(next(iter(data.values())), list) and all(
                isinstance(r, Mapping) for r in next(iter(data.values()))):
            data = next(iter(data.values()))
        elif data and all(isinstance(v, list) for v in data.values()):
            n = {len(v) for v in data.values()}
            if len(n) != 1:
                raise UserError(f"{path}: column lists have different lengths {sorted(n)}")
            data = [dict(zip(data, values)) for values in zip(*data.values())]
    if not isinstance(data, list) or not all(isinstance(r, Mapping) for r in data):
        raise UserError(f"{path}: expected a list of JSON objects")
    return [dict(r) for r in data]


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _load_hf(source: str, *, split: str, name: str | None, data_files: Any, **kwargs: Any) -> Any:
    import datasets

    suffix = Path(source).suffix.lower()
    if os.path.isfile(source) and suffix in _FILE_BUILDERS:
        return datasets.load_dataset(_FILE_BUILDERS[suffix], data_files=source, split=split,
                                     **({"delimiter": "\t"} if suffix == ".tsv" else {}), **kwargs)
    return datasets.load_dataset(source, name, split=split, data_files=data_files, **kwargs)


def read_rows(
    source: Any,
    *,
    split: str = "train",
    name: str | None = None,
    data_files: Any = None,
    **load_kwargs: Any,
) -> list[dict[str, Any]]:
    """Rows of `source` as dicts, unmapped.

    `source` is a `.jsonl`/`.json`/`.parquet` file (read directly), a `.csv`/`.tsv` file, a local
    dataset directory or a Hugging Face Hub name (through `datasets.load_dataset(source, name,
    split=split)`), a `datasets.Dataset`, or a sequence of mappings.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        suffix = path.suffix.lower()
        if path.is_file() and suffix == ".jsonl":
            return _read_jsonl(path)
        if path.is_file() and suffix == ".json":
            return _read_json(path)
        if path.is_file() and suffix == ".parquet":
            return _read_parquet(path)
        return _to_rows(_load_hf(str(source), split=split, name=name, data_files=data_files, **load_kwargs))
    return _to_rows(source)


def _to_rows(data: Any) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None and isinstance(data, datasets.DatasetDict):
        raise ValueError(f"got a DatasetDict with splits {list(data)}; pass split=... to pick one")
    if datasets is not None and isinstance(data, datasets.Dataset):
        return data.to_list()
    if isinstance(data, Mapping):
        raise TypeError("expected a sequence of rows, got a single mapping")
    if isinstance(data, Iterable):
        return [dict(r) for r in data]
    raise TypeError(f"cannot read records from {type(data).__name__}")


def _require_column(column: str, role: str, rows: Sequence[Mapping[str, Any]], source: Any) -> None:
    for i, row in enumerate(rows):
        if column not in row:
            available = sorted(rows[0]) if rows else []
            raise MissingColumnError(
                f"{role} column {column!r} not found in {_describe(source)}"
                + (f" (row {i})" if i else "")
                + f"; available columns: {', '.join(map(repr, available)) or '(none)'}"
            )


def _describe(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    return type(source).__name__


def load_records(
    source: Any,
    *,
    prompt_column: str = "prompt",
    answer_column: str | None = None,
    answer_required: bool = True,
    split: str = "train",
    name: str | None = None,
    data_files: Any = None,
    limit: int | None = None,
    **load_kwargs: Any,
) -> list[dict[str, Any]]:
    """Load rows from `source` (see `read_rows`) and map columns to `prompt` / `answer`.

    All of the row's columns are kept; `prompt` is set from `prompt_column` and, if
    `answer_column` is given, `answer` from it (as a string, or a list of strings if the column
    holds several acceptable answers). `limit` keeps the first rows. A column missing from any row
    raises `MissingColumnError` (a `KeyError`) naming it and listing the available columns; with
    `answer_required=False` an answer column missing from every row is no error (the records then
    have no `answer`), for data whose answers nothing reads.
    """
    rows = read_rows(source, split=split, name=name, data_files=data_files, **load_kwargs)
    if limit is not None:
        rows = rows[:limit]
    _require_column(prompt_column, "prompt", rows, source)
    if answer_column is not None and not answer_required and not any(answer_column in row for row in rows):
        answer_column = None
    if answer_column is not None:
        _require_column(answer_column, "answer", rows, source)
    records = []
    for row in rows:
        record = dict(row)
        record["prompt"] = row[prompt_column]
        if answer_column is not None:
            answer = row[answer_column]
            if isinstance(answer, (list, tuple)):
                answer = [str(a) for a in answer]
            elif answer is not None:
                answer = str(answer)
            record["answer"] = answer
        records.append(record)
    return records
