"""Preference data: pairs (and ranked lists) from files or procedural tasks, and pairs built from
sampled completions plus any scorer (best vs worst of N).

    pairs, counts = load_preference_pairs("prefs.jsonl", invalid="drop")
    pairs = pairs_from_task(make_task("addition", split="train", size=500, seed=0), seed=0)
    pairs, counts = best_vs_worst_pairs(examples, completions, scores, num_samples=8)

A pair is ``{"prompt": str | messages, "chosen": str, "rejected": str, "key": str}`` plus
``"margin"`` (float) when a margin column is given. A ranked list (reward-model K-wise training) is
``{"prompt", "responses": [best, ..., worst], "key"}``. ``key`` identifies the prompt (its text, or
its messages as JSON): the held-out split keeps all rows of one prompt together.

Two row forms are read:

* plain text: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``;
* chat messages (TRL's conversational form): ``chosen`` / ``rejected`` are message lists ending in
  the assistant's reply, e.g. ``{"prompt": [{"role": "user", ...}], "chosen": [{"role":
  "assistant", "content": "..."}], ...}``. Messages that ``chosen`` and ``rejected`` share before
  their last message join the prompt; with no prompt column the shared messages *are* the prompt
  (the "implicit prompt" form of Anthropic-HH-style data).

Bad rows -- a missing (or null) column, an empty response, ``chosen == rejected``, an empty
prompt, a margin that is not a number -- raise :class:`InvalidRowError` naming the row and the
problem (``invalid="error"``), or are dropped and counted under ``dropped/<reason>``
(``invalid="drop"``). A column absent from *every* row is always an error
(:class:`~rljax.data.loading.MissingColumnError`): it is a misnamed column, not a bad row.

Building a DPO set from a verifier or a reward model by sampling (``rljax pairs``) runs the
sampler, so it lives above the data layer, in ``rljax.tools.pairs``; it keeps the best and the worst
completion of each prompt with :func:`best_vs_worst_pairs`.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.data.loading import MissingColumnError, read_rows
from rljax.errors import UserError

__all__ = [
    "InvalidRowError", "load_preference_pairs", "load_ranked_lists", "prompt_key", "pairs_from_task",
    "ranked_from_task", "synthetic_responses", "best_vs_worst_pairs", "write_jsonl", "strip_prefix",
    "tokenize_response",
]

INVALID_POLICIES = ("error", "drop")


class InvalidRowError(UserError):
    """A data row is unusable (missing value, empty response, identical pair, ...)."""


def prompt_key(prompt: Any) -> str:
    """A string that identifies a prompt: the text, or the messages as canonical JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(m, Mapping) for m in value)


def _check_messages(messages: Sequence[Mapping[str, Any]], what: str) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise _Bad("malformed_messages", f"{what} message {i} needs 'role' and 'content' keys, has {sorted(m)}")
        if not isinstance(m["content"], str):
            raise _Bad("malformed_messages", f"{what} message {i}: content must be a string, "
                                             f"got {type(m['content']).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


class _Bad(Exception):
    """Internal: a row problem with a reason (the count key) and a message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _response_text(value: Any, what: str) -> tuple[list[dict[str, Any]], str]:
    """``(prefix messages, reply text)`` of a chosen/rejected value (string or message list)."""
    if value is None:
        raise _Bad("missing_column", f"{what} is null")
    if isinstance(value, str):
        return [], value
    if _is_messages(value):
        messages = _check_messages(value, what)
        if not messages:
            raise _Bad("empty_response", f"{what} is an empty list of messages")
        if messages[-1]["role"] != "assistant":
            raise _Bad("malformed_messages", f"{what}'s last message has role {messages[-1]['role']!r}, "
                                             "expected 'assistant' (the reply being compared)")
        return messages[:-1], messages[-1]["content"]
    raise _Bad("malformed_messages", f"{what} must be a string or a list of messages, got {type(value).__name__}")


def _join_prompt(prompt: Any, prefix: list[dict[str, Any]]) -> Any:
    if not prefix:
        return prompt
    if prompt is None:
        return prefix
    head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _check_messages(prompt, "prompt")
    if prefix[: len(head)] == head:  # the responses repeat the prompt's turns (full conversations)
        return prefix
    return head + prefix


def _check_prompt(prompt: Any) -> Any:
    if prompt is None:
        raise _Bad("missing_column", "the prompt is null or missing")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _Bad("empty_prompt", "the prompt is empty")
        return prompt
    if _is_messages(prompt):
        messages = _check_messages(prompt, "prompt")
        if not messages:
            raise _Bad("empty_prompt", "the prompt is an empty list of messages")
        return messages
    raise _Bad("malformed_messages", f"the prompt must be a string or a list of messages, got {type(prompt).__name__}")


def _check_response(text: str, what: str) -> str:
    if not isinstance(text, str):
        raise _Bad("malformed_messages", f"{what} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise _Bad("empty_response", f"{what} is empty")
    return text


def _check_policy(invalid: str) -> None:
    if invalid not in INVALID_POLICIES:
        raise ValueError(f"invalid must be one of {INVALID_POLICIES}, got {invalid!r}")


def _require_somewhere(rows: Sequence[Mapping[str, Any]], column: str, role: str, source: Any) -> None:
    if rows and not any(column in r for r in rows):
        raise MissingColumnError(
            f"{role} column {column!r} is in no row of {_describe(source)}; available columns: "
            f"{', '.join(map(repr, sorted(rows[0]))) or '(none)'}")


def _describe(source: Any) -> str:
    return repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else type(source).__name__


def _handle(bad: _Bad, index: int, invalid: str, counts: Counter, hint: str) -> None:
    if invalid == "error":
        raise InvalidRowError(f"row {index}: {bad} ({bad.reason}); {hint}") from None
    counts[f"dropped/{bad.reason}"] += 1


_DROP_HINT = "fix the data, or set offline.invalid_rows=drop to count and skip such rows"


def load_preference_pairs(
    source: Any,
    *,
    prompt_column: str = "prompt",
    chosen_column: str = "chosen",
    rejected_column: str = "rejected",
    margin_column: str | None = None,
    invalid: str = "error",
    split: str = "train",
    name: str | None = None,
    limit: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Preference pairs from a JSONL / JSON / parquet file, a datasets name or ``Dataset``, or rows.

    Returns ``(pairs, counts)``; ``counts`` has ``rows``, ``kept`` and ``dropped/<reason>`` for
    each reason seen (``missing_column``, ``empty_response``, ``identical_pair``, ``empty_prompt``,
    ``bad_margin``, ``malformed_messages``). See the module docstring for the row forms and the
    ``invalid`` policy (``"error"`` or ``"drop"``).
    """
    _check_policy(invalid)
    rows = read_rows(source, split=split, name=name)
    if limit is not None:
        rows = rows[:limit]
    _require_somewhere(rows, chosen_column, "chosen", source)
    _require_somewhere(rows, rejected_column, "rejected", source)
    if margin_column:
        _require_somewhere(rows, margin_column, "margin", source)
    implicit = bool(rows) and not any(prompt_column in r for r in rows)
    if implicit and not any(_is_messages(r.get(chosen_column)) for r in rows):
        _require_somewhere(rows, prompt_column, "prompt", source)  # raises: text pairs need a prompt
    counts: Counter = Counter(rows=len(rows))
    pairs = []
    for i, row in enumerate(rows):
        try:
            pairs.append(_pair_from_row(row, prompt_column, chosen_column, rejected_column, margin_column, implicit))
        except _Bad as bad:
            _handle(bad, i, invalid, counts, _DROP_HINT)
    counts["kept"] = len(pairs)
    return pairs, dict(counts)


def _pair_from_row(row, prompt_column, chosen_column, rejected_column, margin_column, implicit) -> dict[str, Any]:
    for column in (chosen_column, rejected_column) + ((prompt_column,) if not implicit else ()):
        if column not in row:
            raise _Bad("missing_column", f"column {column!r} is missing")
    prefix_c, chosen = _response_text(row[chosen_column], "chosen")
    prefix_r, rejected = _response_text(row[rejected_column], "rejected")
    if prefix_c != prefix_r:
        raise _Bad("malformed_messages", "chosen and rejected differ before their final assistant message")
    prompt = _check_prompt(_join_prompt(None if implicit else row[prompt_column], prefix_c))
    chosen, rejected = _check_response(chosen, "chosen"), _check_response(rejected, "rejected")
    if chosen == rejected:
        raise _Bad("identical_pair", "chosen and rejected are identical")
    pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "key": prompt_key(prompt)}
    if margin_column:
        if row.get(margin_column) is None:
            raise _Bad("missing_column", f"margin column {margin_column!r} is missing or null")
        try:
            margin = float(row[margin_column])
        except (TypeError, ValueError):
            raise _Bad("bad_margin", f"margin {row[margin_column]!r} is not a number") from None
        if not math.isfinite(margin):
            raise _Bad("bad_margin", f"margin {margin} is not finite")
        pair["margin"] = margin
    return pair


def load_ranked_lists(
    source: Any,
    *,
    prompt_column: str = "prompt",
    ranked_column: str = "responses",
    invalid: str = "error",
    split: str = "train",
    name: str | None = None,
    limit: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Ranked lists ``{"prompt", "responses": [best, ..., worst], "key"}`` for K-wise reward models.

    Each row's ``ranked_column`` is a list of two or more distinct, non-empty responses (strings or
    single assistant messages), best first. Counts and the ``invalid`` policy as for pairs
    (reasons ``too_few_responses``, ``identical_pair`` for a repeated response, ...).
    """
    _check_policy(invalid)
    rows = read_rows(source, split=split, name=name)
    if limit is not None:
        rows = rows[:limit]
    _require_somewhere(rows, prompt_column, "prompt", source)
    _require_somewhere(rows, ranked_column, "ranked responses", source)
    counts: Counter = Counter(rows=len(rows))
    lists = []
    for i, row in enumerate(rows):
        try:
            if prompt_column not in row or ranked_column not in row:
                raise _Bad("missing_column", f"column {prompt_column if prompt_column not in row else ranked_column!r} "
                                             "is missing")
            prompt = _check_prompt(row[prompt_column])
            values = row[ranked_column]
            if not isinstance(values, (list, tuple)) or len(values) < 2:
                raise _Bad("too_few_responses", f"{ranked_column!r} must be a list of at least two responses")
            responses = []
            for k, value in enumerate(values):
                if _is_messages(value) and len(value) == 1:
                    value = value[0]
                if isinstance(value, Mapping):
                    value = _check_messages([value], f"response {k}")[0]["content"]
                responses.append(_check_response(value, f"response {k}"))
            if len(set(responses)) != len(responses):
                raise _Bad("identical_pair", "a response appears twice in the ranking")
            lists.append({"prompt": prompt, "responses": responses, "key": prompt_key(prompt)})
        except _Bad as bad:
            _handle(bad, i, invalid, counts, _DROP_HINT)
    counts["kept"] = len(lists)
    return lists, dict(counts)


# ---------------------------------------------------------------------------------------------
# Synthetic pairs from a procedural task (no downloads): right vs wrong answers.


def _wrong_answer(answer: str, rng: np.random.Generator, pool: Sequence[str]) -> str:
    try:
        value = int(answer)
    except ValueError:
        others = [a for a in pool if a != answer]
        if not others:
            raise ValueError(f"cannot make a wrong answer for {answer!r}: every answer in the task is the same")
        return str(others[int(rng.integers(len(others)))])
    offset = int(rng.integers(1, 11)) * (1 if rng.random() < 0.5 else -1)
    return str(value + offset)


_RESPONSE_KINDS = (  # (template, correct, tagged), best first; score = correct + 0.5 * tagged
    ("The answer is <answer>{}</answer>.", True, True),
    ("The answer is {}.", True, False),
    ("The answer is <answer>{}</answer>.", False, True),
    ("The answer is {}.", False, False),
)


def synthetic_responses(example: Mapping[str, Any], count: int, rng: np.random.Generator,
                        pool: Sequence[str]) -> list[tuple[str, float]]:
    """``count`` ``(response, score)`` for a task example: right/wrong answers, in tags or not.

    Kinds cycle best first -- right in ``<answer>`` tags (score 1.5), right in plain text (1.0),
    wrong in tags (0.5), wrong in plain text (0.0) -- with a fresh wrong answer each time.
    """
    answer = str(example["answer"])
    out = []
    for k in range(count):
        template, correct, tagged = _RESPONSE_KINDS[k % len(_RESPONSE_KINDS)]
        value = answer if correct else _wrong_answer(answer, rng, pool)
        out.append((template.format(value), float(correct) + 0.5 * float(tagged)))
    return out


def pairs_from_task(examples: Sequence[Mapping[str, Any]], *, seed: int) -> list[dict[str, Any]]:
    """One pair per task example: chosen states the right answer in ``<answer>`` tags, rejected a
    wrong one (the answer ± 1..10 for numbers, another example's answer otherwise)."""
    rng = np.random.default_rng([seed, 17])
    pool = [str(ex["answer"]) for ex in examples]
    pairs = []
    for ex in examples:
        template = _RESPONSE_KINDS[0][0]
        pairs.append({"prompt": ex["prompt"], "chosen": template.format(ex["answer"]),
                      "rejected": template.format(_wrong_answer(str(ex["answer"]), rng, pool)),
                      "key": prompt_key(ex["prompt"]), "answer": str(ex["answer"])})
    return pairs


def ranked_from_task(examples: Sequence[Mapping[str, Any]], *, num_responses: int, seed: int) -> list[dict[str, Any]]:
    """One ranked list per example from :func:`synthetic_responses` (at most 4: the scores are distinct)."""
    rng = np.random.default_rng([seed, 19])
    pool = [str(ex["answer"]) for ex in examples]
    k = min(num_responses, len(_RESPONSE_KINDS))
    return [{"prompt": ex["prompt"], "responses": [r for r, _ in synthetic_responses(ex, k, rng, pool)],
             "key": prompt_key(ex["prompt"]), "answer": str(ex["answer"])} for ex in examples]


# ---------------------------------------------------------------------------------------------
# Best vs worst of N


def best_vs_worst_pairs(
    examples: Sequence[Mapping[str, Any]],
    completions: Sequence[str],
    scores: Sequence[float],
    *,
    num_samples: int,
    min_gap: float = 0.0,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One pair per prompt from ``num_samples`` scored completions each: best vs worst.

    ``completions`` and ``scores`` are example-major (``num_samples`` consecutive entries per
    example). NaN scores (a scorer that could not score) and empty completions are ignored. A
    prompt yields no pair when fewer than two completions remain (``skipped/too_few``), when the
    best and worst scores differ by ``min_gap`` or less (``skipped/tie``), or when the best and
    worst texts are equal (``skipped/identical``). Among equal scores the first sampled wins.
    Returns ``(pairs, counts)``; pairs carry ``chosen_score`` and ``rejected_score``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if len(completions) != len(examples) * num_samples or scores.shape != (len(completions),):
        raise ValueError(f"expected {len(examples)} x {num_samples} = {len(examples) * num_samples} completions and "
                         f"scores, got {len(completions)} and {scores.shape}")
    counts: Counter = Counter(prompts=len(examples))
    pairs = []
    for i, ex in enumerate(examples):
        rows = range(i * num_samples, (i + 1) * num_samples)
        usable = [j for j in rows if np.isfinite(scores[j]) and completions[j].strip()]
        if len(usable) < 2:
            counts["skipped/too_few"] += 1
            continue
        best = max(usable, key=lambda j: (scores[j], -j))
        worst = min(usable, key=lambda j: (scores[j], j))
        if scores[best] - scores[worst] <= min_gap:
            counts["skipped/tie"] += 1
            continue
        if completions[best] == completions[worst]:
            counts["skipped/identical"] += 1
            continue
        pair = {k: v for k, v in ex.items() if k not in ("chosen", "rejected", "completion_length")}
        pair.update(prompt=ex["prompt"], chosen=completions[best], rejected=completions[worst],
                    chosen_score=float(scores[best]), rejected_score=float(scores[worst]),
                    key=prompt_key(ex["prompt"]))
        pairs.append(pair)
    counts["pairs"] = len(pairs)
    return pairs, dict(counts)


def write_jsonl(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> None:
    """Write ``rows`` as JSON lines (parent directories created), atomically: the rows go to a
    temporary file beside ``path`` that then replaces it, so a reader (another process, a resumed
    run) sees the old file or the whole new one, never half of it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=_jsonable) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


# ---------------------------------------------------------------------------------------------
# Tokenisation of responses (shared by the offline trainer and the learned reward)


def strip_prefix(text: str, prefix: str) -> str:
    """``text`` without a leading ``prefix`` (the assistant prefix the prompt already ends with)."""
    return text[len(prefix):] if prefix and text.startswith(prefix) else text


def tokenize_response(tokenizer: Any, text: str, *, append_eos: bool) -> list[int]:
    """Token ids of a response continuing a rendered prompt (no special tokens added), plus EOS."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if append_eos:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("append_eos needs a tokenizer with an eos_token_id")
        ids.append(int(eos[0] if isinstance(eos, (list, tuple)) else eos))
    return ids


if __name__ == "__main__":  # the sampling pair builder moved above the data layer
    raise SystemExit("the pair builder is `rljax pairs CONFIG OUT.jsonl ...` (or python -m rljax.tools.pairs) now")
