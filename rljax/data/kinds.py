"""The kinds of offline data an algorithm reads, each registered once with how it is loaded,
tokenised, batched and planned, so no trainer or tool branches on a kind's name.

    kind = get_kind(algorithm.data_kind(cfg))            # "pairs", "ranked", "records", "transcripts"
    rows, counts = kind.load(source, cfg, prompt_column="prompt")
    data, dropped = kind.encode(rows, tokenizer, cfg, data=cfg_data, render=..., split="train")
    batch = collate(data, indices, kind=kind.name, num_completions=2, pad_id=..., prompt_buckets=...,
                    completion_buckets=...)
    shapes = kind.abstract_batch(rows=8, prompt_width=64, completion_width=128, cfg=cfg, reference=True)

``cfg`` is the ``algorithm:`` section (its column names and completion settings); ``data`` the
``data:`` section (prompt rendering and limits). A kind defined elsewhere is added with
:func:`register_kind`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rljax.batches import PairBatch, RecordBatch, TranscriptBatch
from rljax.data.encoded import EncodedSet, collate_pairs, collate_records, collate_transcripts, encode_rows
from rljax.data.preferences import load_preference_pairs, load_ranked_lists, pairs_from_task, ranked_from_task
from rljax.data.records import load_scored_records, records_from_task
from rljax.data.transcripts import encode_transcripts, load_transcripts, transcripts_from_task


@dataclasses.dataclass(frozen=True)
class DataKind:
    """One kind of offline rows.

    Attributes:
      name: what ``OfflineAlgorithm.data_kind(cfg)`` returns.
      load: ``(source, cfg, *, prompt_column) -> (rows, counts)``: rows of a file or data set.
      from_task: ``(examples, cfg, *, seed) -> rows``: rows made from a procedural task's examples.
      encode: ``(rows, tokenizer, cfg, *, data, render, split) -> (EncodedSet, dropped counts)``:
        tokenised once (``render(prompt) -> text`` applies the prompt format).
      collate: ``(EncodedSet, indices, *, rows, pad_id, prompt_buckets, completion_buckets,
        num_completions) -> batch``: the typed batch of some rows.
      abstract_batch: ``(rows, prompt_width, completion_width, cfg, *, reference) -> batch`` of
        ``jax.ShapeDtypeStruct``: the training batch's shapes, for ``rljax plan``.
      completions: ``cfg -> K``, completions per row a planned batch holds.
    """

    name: str
    load: Callable[..., tuple[list[dict], dict]]
    from_task: Callable[..., list[dict]]
    encode: Callable[..., tuple[EncodedSet, dict]]
    collate: Callable[..., Any]
    abstract_batch: Callable[..., Any]
    completions: Callable[[Any], int] = lambda cfg: 1


KINDS: dict[str, DataKind] = {}


def register_kind(kind: DataKind) -> DataKind:
    """Adds ``kind`` under its name (a name already taken is refused)."""
    if kind.name in KINDS:
        raise ValueError(f"data kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> DataKind:
    """The kind called ``name``; a ``KeyError`` listing the known ones otherwise."""
    if name not in KINDS:
        raise KeyError(f"unknown data kind {name!r}; known: {', '.join(KINDS)}")
    return KINDS[name]


def collate(data: EncodedSet, indices, *, kind: str, num_completions: int, pad_id: int, prompt_buckets,
            completion_buckets, rows: int | None = None):
    """The batch of ``data``'s rows ``indices`` (padded with empty rows, ``row_mask`` 0, to ``rows``):
    ``kind``'s collate (``"pairs"`` / ``"ranked"``: a ``PairBatch`` with ``K = num_completions``;
    ``"records"``: a ``RecordBatch``; ``"transcripts"``: a ``TranscriptBatch``)."""
    indices = [int(i) for i in indices]
    return get_kind(kind).collate(data, indices, rows=len(indices) if rows is None else rows, pad_id=pad_id,
                                  prompt_buckets=prompt_buckets, completion_buckets=completion_buckets,
                                  num_completions=num_completions)


def _encode_rows(rows, tokenizer, cfg, *, data, render, split):
    return encode_rows(rows, tokenizer, render=render, assistant_prefix=data.assistant_prefix,
                       max_prompt_length=data.max_prompt_length, prompt_too_long=data.too_long,
                       max_completion_length=cfg.max_completion_length, completion_too_long=cfg.completion_too_long,
                       append_eos=cfg.append_eos, split=split)


def _encode_transcripts(rows, tokenizer, cfg, *, data, render, split):
    # the loss mask comes from rendering the template turn by turn, not from ``render``
    return encode_transcripts(rows, tokenizer, system_prompt=data.system_prompt, chat=data.chat,
                              append_eos=cfg.append_eos, max_prompt_length=data.max_prompt_length,
                              prompt_too_long=data.too_long, max_completion_length=cfg.max_completion_length,
                              completion_too_long=cfg.completion_too_long, split=split)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _prompt(B, P):
    return _spec((B, P), jnp.int32), _spec((B, P), jnp.int32)


def _pair_batch(B, P, N, cfg, *, reference: bool, K: int = 2) -> PairBatch:
    i32, f32 = jnp.int32, jnp.float32
    return PairBatch(*_prompt(B, P), _spec((B, K, N), i32), _spec((B, K, N), i32), _spec((B, K), i32),
                     _spec((B,), i32), margin=_spec((B,), f32) if getattr(cfg, "margin_column", None) else None,
                     ref_logps=_spec((B, K), f32) if reference else None)


def _record_batch(B, P, N, cfg, *, reference: bool) -> RecordBatch:
    i32 = jnp.int32
    return RecordBatch(*_prompt(B, P), _spec((B, N), i32), _spec((B, N), i32), _spec((B,), i32),
                       _spec((B,), jnp.float32))


def _transcript_batch(B, P, N, cfg, *, reference: bool) -> TranscriptBatch:
    i32 = jnp.int32
    return TranscriptBatch(*_prompt(B, P), _spec((B, N), i32), _spec((B, N), i32), _spec((B, N), i32),
                           _spec((B,), i32))


register_kind(DataKind(
    name="pairs",
    load=lambda source, cfg, *, prompt_column: load_preference_pairs(
        source, prompt_column=prompt_column, chosen_column=cfg.chosen_column, rejected_column=cfg.rejected_column,
        margin_column=cfg.margin_column, invalid=cfg.invalid_rows),
    from_task=lambda examples, cfg, *, seed: pairs_from_task(examples, seed=seed),
    encode=_encode_rows, collate=collate_pairs, abstract_batch=_pair_batch, completions=lambda cfg: 2))
register_kind(DataKind(
    name="ranked",
    load=lambda source, cfg, *, prompt_column: load_ranked_lists(
        source, prompt_column=prompt_column, ranked_column=cfg.ranked_column, invalid=cfg.invalid_rows),
    from_task=lambda examples, cfg, *, seed: ranked_from_task(examples, num_responses=cfg.task_responses, seed=seed),
    # planned as pairs: a batch's K is its longest list, known only once the data is read
    encode=_encode_rows, collate=collate_pairs, abstract_batch=_pair_batch, completions=lambda cfg: 2))
register_kind(DataKind(
    name="records",
    load=lambda source, cfg, *, prompt_column: load_scored_records(
        source, prompt_column=prompt_column, response_column=cfg.response_column, score_column=cfg.score_column,
        invalid=cfg.invalid_rows),
    from_task=lambda examples, cfg, *, seed: records_from_task(
        examples, responses_per_prompt=cfg.task_responses, seed=seed),
    encode=_encode_rows, collate=collate_records, abstract_batch=_record_batch))
register_kind(DataKind(
    name="transcripts",
    load=lambda source, cfg, *, prompt_column: load_transcripts(
        source, messages_column=cfg.messages_column, prompt_column=prompt_column,
        completion_column=cfg.completion_column, invalid=cfg.invalid_rows),
    from_task=lambda examples, cfg, *, seed: transcripts_from_task(examples),
    encode=_encode_transcripts, collate=collate_transcripts, abstract_batch=_transcript_batch))


__all__ = ["DataKind", "KINDS", "collate", "get_kind", "register_kind"]
