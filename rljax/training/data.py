"""A run's data: train and held-out rows, by one rule for online and offline runs.

    train, evals, counts = online_examples(cfg, tokenizer)   # prompts (+ answers) for online RL
    train, evals, counts = offline_rows(cfg, kind)       # pairs / ranked lists / scored records

With ``data.path`` the held-out split is ``data.eval_path`` if given, else the prompts that
:func:`split_by_prompt` holds out (a hash of ``(train.seed, prompt)`` below ``data.eval_fraction``;
every row of one prompt stays in one split; at most ``data.eval_size`` held-out rows). With
``data.task`` the task's own train / eval splits are used (offline rows are then built from them).

Online prompts are checked before training (:func:`check_prompts`), every row of every source, as
the offline trainer tokenises its rows once: a bad row fails at start with its file (or task), row
and column named, instead of at the step that first samples it; ``data.too_long: filter`` drops
over-long prompts here, before batching, so every step's batch is full.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from rljax.data.kinds import get_kind
from rljax.data.loading import MissingColumnError, load_records
from rljax.data.preferences import prompt_key
from rljax.data.tasks import make_task, question_split
import rljax.environments  # noqa: F401 - registers its data tasks ("code", "sql") and their rewards
from rljax.environments.episodes import episode_examples
from rljax.errors import MissingFileError, UserError
from rljax.data.prompts import PromptFormat, render_prompt
from rljax.run_config import RunConfig


def split_by_prompt(rows: list[dict], *, eval_fraction: float, eval_size: int, seed: int) -> tuple[list, list]:
    """Train / held-out rows: a prompt is held out when a hash of (seed, its key) falls below
    ``eval_fraction``; held-out prompts beyond ``eval_size`` rows go back to train. All rows of a
    prompt (``row["key"]``) stay in one split."""
    if eval_fraction <= 0:
        return list(rows), []
    sizes: dict[str, int] = {}
    for r in rows:
        if question_split(r["key"], task="offline", seed=seed, eval_fraction=eval_fraction) == "eval":
            sizes[r["key"]] = sizes.get(r["key"], 0) + 1
    eval_keys, count = set(), 0
    for key, n in sizes.items():
        if count + n > eval_size:
            break
        eval_keys.add(key)
        count += n
    return [r for r in rows if r["key"] not in eval_keys], [r for r in rows if r["key"] in eval_keys]


# A source with one of these suffixes, or a path that a Hub name ("owner/name") cannot be, is a file.
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv")


def _looks_like_file(source: str) -> bool:
    return (os.path.splitext(source)[1].lower() in _FILE_SUFFIXES or source.startswith(("/", ".", "~"))
            or source.count("/") > 1 or os.sep != "/" and os.sep in source)


def _read_source(key: str, source: str, read):
    """``read(source)``; a missing file, or a data set name ``datasets`` cannot find, is reported
    under the config key (``datasets`` itself says "Couldn't reach 'data/trian.jsonl' on the Hub")."""
    if os.path.exists(source):
        return read(source)
    if _looks_like_file(source):
        raise MissingFileError(f"{key}: no such file: {source}")
    try:
        return read(source)
    except ConnectionError as err:  # not in the local cache, and the Hub cannot be reached
        raise UserError(f"{key} {source!r} is neither a file nor a data set available offline ({err})") from err
    except FileNotFoundError as err:  # datasets.exceptions.DatasetNotFoundError and friends
        raise UserError(f"{key} {source!r} is neither a file nor a data set: {err}") from err


def _split_path(cfg: RunConfig, read) -> tuple[list, list, dict[str, int]]:
    d = cfg.data
    rows, counts = _read_source("data.path", d.path, read)
    if d.eval_path:
        evals, eval_counts = _read_source("data.eval_path", d.eval_path, read)
        counts = {**counts, **{f"eval_{k}": v for k, v in eval_counts.items()}}
        evals = evals[: d.eval_size] if d.eval_size else evals
        train = rows
    else:
        train, evals = split_by_prompt(rows, eval_fraction=d.eval_fraction, eval_size=d.eval_size, seed=cfg.train.seed)
    return (train[: d.train_size] if d.train_size else train), evals, counts


def _task_splits(cfg: RunConfig) -> tuple[list, list]:
    d, seed = cfg.data, cfg.train.seed
    options = dict(d.task_options)
    train = make_task(d.task, split="train", size=d.train_size, seed=seed, **options)
    evals = make_task(d.task, split="eval", size=d.eval_size, seed=seed, **options) if d.eval_size else []
    return train, evals


def _prompt_problem(prompt: Any, *, chat: bool) -> str | None:
    """What is wrong with a prompt cell before it is rendered, or None."""
    if prompt is None:
        return "the prompt is null (an empty cell)"
    if isinstance(prompt, str):
        return None if prompt.strip() else f"the prompt is empty ({prompt!r})"
    if isinstance(prompt, (list, tuple)):
        if not chat:
            return "the prompt is a list of chat messages, which needs data.chat: true"
        if not prompt:
            return "the prompt is an empty list of chat messages"
        for j, m in enumerate(prompt):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return f"chat message {j} is not a {{role: <str>, content: <str>}} mapping: {m!r:.80}"
        return None
    return f"the prompt must be a string or a list of chat messages, got {type(prompt).__name__} {prompt!r:.40}"


def check_prompts(rows: list[dict], tokenizer, fmt: PromptFormat, *, source: str,
                  column: str = "prompt") -> tuple[list[dict], int]:
    """The rows of ``source`` whose ``"prompt"`` the sampler can take, and how many were dropped.

    Each prompt is rendered and tokenised as ``rljax.data.prompts.encode_prompts`` does (``fmt``). A prompt
    that is null, neither a string nor a list of chat messages, empty, fails to render or renders to
    zero tokens raises ``ValueError``; one over ``fmt.max_prompt_length`` tokens raises with
    ``fmt.too_long == "error"`` and is dropped (counted) with ``"filter"``. Errors read
    ``"<source> row <n>, column '<column>': <problem>"``, ``n`` counting the source's rows from 1.
    """
    def where(i: int) -> str:
        return f"{source} row {i + 1}, column {column!r}"

    texts = []
    for i, row in enumerate(rows):
        problem = _prompt_problem(row.get("prompt"), chat=fmt.chat)
        if problem is not None:
            raise UserError(f"{where(i)}: {problem}")
        try:
            texts.append(render_prompt(tokenizer, row["prompt"], fmt))
        except Exception as exc:  # a template error, a bad message: the row names the place
            raise UserError(f"{where(i)}: the prompt cannot be rendered: {exc}") from exc
    token_lists = tokenizer(texts, add_special_tokens=fmt.add_special_tokens)["input_ids"] if texts else []
    kept = []
    for i, (row, ids) in enumerate(zip(rows, token_lists)):
        if not ids:
            raise UserError(f"{where(i)}: the prompt renders to zero tokens; the sampler needs at least one")
        if len(ids) > fmt.max_prompt_length:
            if fmt.too_long == "error":
                raise UserError(f"{where(i)}: the prompt is {len(ids)} tokens once formatted, over "
                                 f"data.max_prompt_length={fmt.max_prompt_length} (raise it, or set "
                                 "data.too_long=filter to drop such prompts)")
            continue
        kept.append(row)
    return kept, len(rows) - len(kept)


def online_examples(cfg: RunConfig, tokenizer=None) -> tuple[list[dict], list[dict], dict[str, int]]:
    """Train and held-out examples (``prompt``, ``answer`` when known) of an online run, and counts.

    With ``tokenizer`` every source's prompts are checked (:func:`check_prompts`) before the split and
    ``data.train_size`` cut; rows dropped by ``data.too_long: filter`` are counted as
    ``dropped/too_long`` (``eval_dropped/too_long`` for ``data.eval_path`` or a task's eval split).
    """
    d = cfg.data
    if cfg.environment.name:  # episodes are reset by seed: the environment makes the prompts
        return (episode_examples(cfg.environment.name, "train", d.train_size, cfg.train.seed),
                episode_examples(cfg.environment.name, "eval", d.eval_size, cfg.train.seed), {})
    fmt = PromptFormat.from_data(d)

    def checked(rows: list[dict], source: str, column: str, counts: dict, prefix: str = "") -> list[dict]:
        if tokenizer is None:
            return rows
        rows, dropped = check_prompts(rows, tokenizer, fmt, source=source, column=column)
        if dropped:
            counts[f"{prefix}dropped/too_long"] = dropped
        return rows

    if not d.path:
        train, evals = _task_splits(cfg)
        counts: dict[str, int] = {}
        train = checked(train, f"task {d.task!r} (train split)", "prompt", counts)
        evals = checked(evals, f"task {d.task!r} (eval split)", "prompt", counts, "eval_")
        _check_few_shot_held_out(d.few_shot, evals)
        return train, evals, counts

    readers = answer_readers(cfg.rewards)

    def read(source):
        try:
            rows = load_records(source, prompt_column=d.prompt_column, answer_column=d.answer_column or None,
                                answer_required=bool(readers))
        except MissingColumnError as exc:
            if d.answer_column and f"answer column {d.answer_column!r}" in str(exc):
                raise MissingColumnError(f"{exc} (data.answer_column; read by {', '.join(readers)}: set "
                                         "data.answer_column to the column that holds the answers)") from None
            raise
        counts = {"rows": len(rows)}
        key = "data.path" if source == d.path else "data.eval_path"
        rows = checked(rows, f"{source} ({key})", d.prompt_column, counts)
        return [dict(r, key=prompt_key(r["prompt"])) for r in rows], counts

    train, evals, counts = _split_path(cfg, read)
    _check_few_shot_held_out(d.few_shot, evals)
    return train, evals, counts


# Reward types that score a completion against the row's ``answer`` (the gold answer, the gold SQL,
# the reasoning-gym entry's answer). Others (format, length, judges, reward models, ``python``
# functions, which get ``answer`` only when the data has one) do not need an answer column.
ANSWER_READING_REWARDS = frozenset({"answer", "reasoning_gym", "sql_result"})


def answer_readers(rewards: Mapping[str, Any]) -> list[str]:
    """The ``rewards.<key>`` entries whose type reads each row's ``answer`` (``ANSWER_READING_REWARDS``):
    ``data.answer_column`` must exist in the data only when there is one."""
    return [f"rewards.{key}" for key, spec in rewards.items()
            if (spec.get("type", key) if isinstance(spec, Mapping) else key) in ANSWER_READING_REWARDS]


def _check_few_shot_held_out(few_shot, evals: list[dict]) -> None:
    """A worked example shown in every prompt must not be a held-out question: the evaluation would
    show the model its own answer."""
    held_out = {r["prompt"].strip() for r in evals if isinstance(r.get("prompt"), str)}
    for i, shot in enumerate(few_shot):
        if shot.user.strip() in held_out:
            raise UserError(f"data.few_shot[{i}].user is a held-out prompt ({shot.user!r}); pick a training question")


def offline_rows(cfg: RunConfig, kind: str) -> tuple[list[dict], list[dict], dict[str, int]]:
    """Train and held-out rows of ``kind`` (a kind registered in ``rljax.data.kinds``: ``"pairs"``,
    ``"ranked"``, ``"records"``, ``"transcripts"``) and counts."""
    d, a, seed = cfg.data, cfg.algorithm, cfg.train.seed
    data_kind = get_kind(kind)
    if not d.path:
        train_ex, eval_ex = _task_splits(cfg)
        return data_kind.from_task(train_ex, a, seed=seed), data_kind.from_task(eval_ex, a, seed=seed + 1), {}
    return _split_path(cfg, lambda source: data_kind.load(source, a, prompt_column=d.prompt_column))


__all__ = ["ANSWER_READING_REWARDS", "answer_readers", "check_prompts", "offline_rows", "online_examples",
           "split_by_prompt"]
