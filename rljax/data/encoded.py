"""Offline data as tokens: a split tokenised once (``EncodedSet``) and its batches (``collate``).

    data, dropped = encode_rows(rows, tokenizer, fmt=..., max_prompt_length=..., ...)
    batch = rljax.data.kinds.collate(data, indices, kind="pairs", pad_id=..., prompt_buckets=..., ...)

A row is a preference pair (``chosen``, ``rejected``), a ranked list (``responses``, best first) or
a scored record (``response``, ``score``), each with ``prompt`` and ``key`` (the prompt's identity).
Prompts are rendered (chat template, system prompt, assistant prefix) and tokenised once; each
completion is tokenised with an optional EOS. Batches are ``rljax.batches.PairBatch`` (pairs and
ranked lists) or ``RecordBatch`` (records), widths bucketed so a run compiles few programs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import numpy as np

from rljax.batches import PairBatch, RecordBatch, TranscriptBatch, pad_sequences
from rljax.data.preferences import strip_prefix, tokenize_response
from rljax.errors import UserError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EncodedSet:
    """A tokenised split: per row a prompt and ``K`` completions (token lists), and per-row values."""

    rows: list[dict[str, Any]]
    prompts: list[list[int]]
    completions: list[list[list[int]]]  # [n][k] token ids
    values: dict[str, np.ndarray]  # name -> [n, ...] (margin, score, weight, ref_logps)
    # transcripts (rljax.data.transcripts): [n][k] per-token loss mask of each completion (1 = assistant)
    loss_masks: list[list[list[int]]] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, index: Sequence[int]) -> EncodedSet:
        """The rows ``index``, in that order."""
        index = [int(i) for i in index]
        return EncodedSet([self.rows[i] for i in index], [self.prompts[i] for i in index],
                          [self.completions[i] for i in index], {k: v[index] for k, v in self.values.items()},
                          None if self.loss_masks is None else [self.loss_masks[i] for i in index])


def _completions_of(row: dict) -> list[str]:
    if "responses" in row:
        return list(row["responses"])
    if "response" in row:
        return [row["response"]]
    return [row["chosen"], row["rejected"]]


def encode_rows(rows: list[dict], tokenizer, *, render: Callable[[Any], str], assistant_prefix: str,
                max_prompt_length: int, prompt_too_long: str, max_completion_length: int,
                completion_too_long: str, append_eos: bool, split: str) -> tuple[EncodedSet, dict[str, int]]:
    """Tokenise ``rows`` once; too-long prompts / completions raise, are dropped or truncated as
    configured. ``render(prompt) -> text`` applies the prompt format. Returns the set and the counts
    of dropped rows by reason.

    With ``completion_too_long="truncate"``, a pair or ranked list two of whose responses differ only
    past ``max_completion_length`` would be two identical completions after the cut: its loss could
    not move (every pairwise loss has zero gradient between equal log-probs), so the row is dropped,
    counted as ``identical_after_truncation`` (``data/<split>_dropped/identical_after_truncation`` in
    the run's first metrics and summary) and a warning names the count."""
    texts = [render(r["prompt"]) for r in rows]
    prompt_tokens = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    kept, prompts, completions = [], [], []
    dropped = {"prompt_too_long": 0, "response_too_long": 0, "identical_after_truncation": 0}
    for i, (row, p) in enumerate(zip(rows, prompt_tokens)):
        if len(p) > max_prompt_length:
            if prompt_too_long == "error":
                raise ValueError(f"{split} row {i}: the prompt is {len(p)} tokens, over data.max_prompt_length="
                                 f"{max_prompt_length} (raise it, or set data.too_long=filter to drop such rows)")
            dropped["prompt_too_long"] += 1
            continue
        if not p:
            raise ValueError(f"{split} row {i}: the prompt renders to zero tokens")
        # with an assistant prefix the prompt ends with it; a completion that repeats it (as online
        # rollouts' texts do) has it removed, so the loss covers only what the model wrote
        cs = [tokenize_response(tokenizer, strip_prefix(t, assistant_prefix), append_eos=append_eos)
              for t in _completions_of(row)]
        if any(len(c) > max_completion_length for c in cs):
            if completion_too_long == "error":
                raise UserError(f"{split} row {i}: a response is {max(map(len, cs))} tokens, over algorithm."
                                 f"max_completion_length={max_completion_length} (raise it, or set algorithm."
                                 "completion_too_long to filter or truncate)")
            if completion_too_long == "filter":
                dropped["response_too_long"] += 1
                continue
            cs = [c[:max_completion_length] for c in cs]
            if len({tuple(c) for c in cs}) < len(cs):  # nothing left to prefer: a zero-signal row
                dropped["identical_after_truncation"] += 1
                continue
        if any(not c for c in cs):
            raise ValueError(f"{split} row {i}: a response tokenises to zero tokens")
        kept.append(row)
        prompts.append(list(p))
        completions.append(cs)
    if dropped["identical_after_truncation"]:
        logger.warning("%s: %d of %d rows dropped: two of their responses are identical once cut to "
                       "algorithm.max_completion_length=%d (counted as %s_dropped/identical_after_truncation; "
                       "raise max_completion_length to keep them)", split, dropped["identical_after_truncation"],
                       len(rows), max_completion_length, split)
    values: dict[str, np.ndarray] = {}
    for name in ("margin", "score"):
        if kept and name in kept[0]:
            values[name] = np.asarray([r[name] for r in kept], np.float32)
    return EncodedSet(kept, prompts, completions, values), {k: v for k, v in dropped.items() if v}


def _prompts_and_width(data: EncodedSet, indices: list[int], rows: int, *, pad_id: int, prompt_buckets,
                       completion_buckets):
    prompt_ids, prompt_mask = pad_sequences([data.prompts[i] for i in indices], side="left", pad_id=pad_id,
                                            buckets=prompt_buckets, num_rows=rows)
    longest = max(len(c) for i in indices for c in data.completions[i])
    width = next((b for b in completion_buckets if b >= longest), longest)
    row_mask = np.zeros((rows,), np.int32)
    row_mask[:len(indices)] = 1
    return prompt_ids, prompt_mask, width, row_mask


def _values(data: EncodedSet, name: str, indices: list[int], rows: int) -> np.ndarray:
    v = data.values[name]
    out = np.zeros((rows, *v.shape[1:]), v.dtype)
    out[:len(indices)] = v[indices]
    return out


def collate_records(data: EncodedSet, indices: list[int], *, rows: int, pad_id: int, prompt_buckets,
                    completion_buckets, **_) -> RecordBatch:
    """A ``RecordBatch`` of ``data``'s rows ``indices`` (its ``weight`` from ``data.values``)."""
    prompt_ids, prompt_mask, width, row_mask = _prompts_and_width(
        data, indices, rows, pad_id=pad_id, prompt_buckets=prompt_buckets, completion_buckets=completion_buckets)
    ids, mask = pad_sequences([data.completions[i][0] for i in indices], side="right", pad_id=pad_id,
                              width=width, num_rows=rows)
    return RecordBatch(prompt_ids, prompt_mask, ids, mask, row_mask, _values(data, "weight", indices, rows))


def collate_transcripts(data: EncodedSet, indices: list[int], *, rows: int, pad_id: int, prompt_buckets,
                        completion_buckets, **_) -> TranscriptBatch:
    """A ``TranscriptBatch`` of ``data``'s rows ``indices`` (its ``loss_mask`` from ``data.loss_masks``)."""
    prompt_ids, prompt_mask, width, row_mask = _prompts_and_width(
        data, indices, rows, pad_id=pad_id, prompt_buckets=prompt_buckets, completion_buckets=completion_buckets)
    ids, mask = pad_sequences([data.completions[i][0] for i in indices], side="right", pad_id=pad_id,
                              width=width, num_rows=rows)
    loss_mask, _ = pad_sequences([data.loss_masks[i][0] for i in indices], side="right", pad_id=0,
                                 width=width, num_rows=rows)
    return TranscriptBatch(prompt_ids, prompt_mask, ids, mask, loss_mask, row_mask)


def collate_pairs(data: EncodedSet, indices: list[int], *, rows: int, pad_id: int, prompt_buckets,
                  completion_buckets, num_completions: int) -> PairBatch:
    """A ``PairBatch`` of ``data``'s rows ``indices`` with ``K = num_completions`` (pairs and ranked lists)."""
    prompt_ids, prompt_mask, width, row_mask = _prompts_and_width(
        data, indices, rows, pad_id=pad_id, prompt_buckets=prompt_buckets, completion_buckets=completion_buckets)
    K = num_completions
    flat = [data.completions[i][k] if k < len(data.completions[i]) else [] for i in indices for k in range(K)]
    ids, mask = pad_sequences(flat, side="right", pad_id=pad_id, width=width, num_rows=rows * K)
    valid = np.zeros((rows, K), np.int32)
    for b, i in enumerate(indices):
        valid[b, :len(data.completions[i])] = 1
    return PairBatch(prompt_ids, prompt_mask, ids.reshape(rows, K, width), mask.reshape(rows, K, width), valid,
                     row_mask, margin=_values(data, "margin", indices, rows) if "margin" in data.values else None,
                     ref_logps=_values(data, "ref_logps", indices, rows) if "ref_logps" in data.values else None)


__all__ = ["EncodedSet", "collate_pairs", "collate_records", "collate_transcripts", "encode_rows"]
