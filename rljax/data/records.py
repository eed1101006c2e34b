"""Scored records ``(prompt, response, score)``: logged samples for offline learning.

    records, counts = load_scored_records("logs.jsonl", score_column="reward", invalid="drop")
    records = records_from_task(make_task("addition", split="train", size=500, seed=0),
                                responses_per_prompt=4, seed=0)

A record is ``{"prompt": str | messages, "response": str, "score": float, "key": str}`` (``key``
identifies the prompt; see ``rljax.data.preferences.prompt_key``). Sources: a JSONL / JSON /
parquet file, a Hugging Face dataset name or directory, a ``datasets.Dataset``, or rows in memory
(``rljax.data.loading.read_rows``). A response may be a string or a single assistant message (or a
message list ending with the assistant's reply; earlier messages join the prompt).

Bad rows -- a missing or null value, an empty response or prompt, a score that is not a finite
number -- raise ``InvalidRowError`` (``invalid="error"``) or are dropped and counted under
``dropped/<reason>`` (``invalid="drop"``). A column absent from every row is always an error.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.data.loading import read_rows
from rljax.data.preferences import (
    _DROP_HINT,
    InvalidRowError,
    _Bad,
    _check_policy,
    _check_prompt,
    _check_response,
    _handle,
    _join_prompt,
    _require_somewhere,
    _response_text,
    prompt_key,
    synthetic_responses,
)

__all__ = ["InvalidRowError", "load_scored_records", "records_from_task", "group_by_prompt"]


def load_scored_records(
    source: Any,
    *,
    prompt_column: str = "prompt",
    response_column: str = "response",
    score_column: str = "score",
    invalid: str = "error",
    split: str = "train",
    name: str | None = None,
    limit: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Scored records from ``source``; returns ``(records, counts)`` (``rows``, ``kept``,
    ``dropped/<reason>``: ``missing_column``, ``empty_response``, ``empty_prompt``, ``bad_score``,
    ``malformed_messages``)."""
    _check_policy(invalid)
    rows = read_rows(source, split=split, name=name)
    if limit is not None:
        rows = rows[:limit]
    for column, role in ((prompt_column, "prompt"), (response_column, "response"), (score_column, "score")):
        _require_somewhere(rows, column, role, source)
    counts: Counter = Counter(rows=len(rows))
    records = []
    for i, row in enumerate(rows):
        try:
            for column in (prompt_column, response_column, score_column):
                if row.get(column) is None:
                    raise _Bad("missing_column", f"column {column!r} is missing or null")
            prefix, response = _response_text(row[response_column], "response")
            prompt = _check_prompt(_join_prompt(row[prompt_column], prefix))
            response = _check_response(response, "response")
            try:
                score = float(row[score_column])
            except (TypeError, ValueError):
                raise _Bad("bad_score", f"score {row[score_column]!r} is not a number") from None
            if not math.isfinite(score):
                raise _Bad("bad_score", f"score {score} is not finite")
            records.append({"prompt": prompt, "response": response, "score": score, "key": prompt_key(prompt)})
        except _Bad as bad:
            _handle(bad, i, invalid, counts, _DROP_HINT)
    counts["kept"] = len(records)
    return records, dict(counts)


def records_from_task(examples: Sequence[Mapping[str, Any]], *, responses_per_prompt: int,
                      seed: int) -> list[dict[str, Any]]:
    """``responses_per_prompt`` scored records per task example (no downloads): right or wrong
    answers, in ``<answer>`` tags or not, scored ``correct + 0.5 * tagged`` (see
    ``rljax.data.preferences.synthetic_responses``), in a shuffled order."""
    rng = np.random.default_rng([seed, 23])
    pool = [str(ex["answer"]) for ex in examples]
    records = []
    for ex in examples:
        responses = synthetic_responses(ex, responses_per_prompt, rng, pool)
        for j in rng.permutation(len(responses)):
            text, score = responses[int(j)]
            records.append({"prompt": ex["prompt"], "response": text, "score": score,
                            "key": prompt_key(ex["prompt"]), "answer": str(ex["answer"])})
    return records


def group_by_prompt(records: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    """Indices of the records of each prompt, by ``key``, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(r["key"], []).append(i)
    return groups
