"""Typed batches (pytree dataclasses) and the one padding helper.

Every array a loss reads is a field of one of three batch types, documented here once. They are
``flax.struct`` dataclasses: pytrees (``jax.tree.map``, ``jit``, slicing by rows all work) whose
optional fields are ``None`` when an algorithm does not use them. One vocabulary everywhere:
``prompt_*`` (left-padded) and ``completion_*`` (right-padded) tokens; ``completion_mask`` = the
token exists; ``loss_mask`` = the token counts in the loss; ``row_mask`` = the row counts (a real
row whose rewards were scored); totals are ``num_rows``, ``num_tokens``, ``max_length``.

==================  ======================================================================
``RolloutBatch``    online RL (GRPO, PPO, RLOO, REINFORCE++): ``R = prompts × G`` sampled rows
``PairBatch``       preference pairs / ranked lists (DPO, reward models): ``B`` prompts × ``K``
``RecordBatch``     scored records (AWR, RWR, filtered BC): ``B`` prompt, response, weight
==================  ======================================================================

    ids, mask = pad_sequences([[5, 6, 7], [8]], side="left", pad_id=0)          # [2, 3]
    ids, mask = pad_sequences(rows, side="right", pad_id=0, buckets=(16, 24, 32))  # width bucketed

Prompts are padded on the left (every row's last prompt token in the last column, so generation
continues at one position for the whole batch); completions on the right (token ``t`` of every
row in column ``t``). Every place that turns token lists into arrays (prompt batches, offline
batches, the reward model's scoring, ``rljax generate``) goes through :func:`pad_sequences`.
"""

from __future__ import annotations

from typing import Literal, Sequence

import flax.struct
import jax
import numpy as np

Array = jax.Array | np.ndarray


@flax.struct.dataclass
class RolloutBatch:
    """``R`` sampled completions, example-major (row ``i`` belongs to group ``i // G``).

    prompt_ids, prompt_mask     ``[R, P]`` int32, left-padded
    completion_ids              ``[R, N]`` int32, right-padded
    completion_mask             ``[R, N]`` int32, 1 up to and including the stop token
    loss_mask                   ``[R, N]`` int32, completion_mask less rows left out of the loss
                                (failed rewards; truncated rows with ``mask_truncated``)
    old_logprobs                ``[R, N]`` float32, log π_old: the sampler's log-probs, or, with an
                                off-policy correction, the trainer's own forward pass before the update
    sampling_logprobs           ``[R, N]`` float32, the sampler's log-probs μ when an off-policy
                                correction is on (``old_logprobs`` then recomputed), else None
    scores                      ``[R]`` float32, the weighted reward total (0 where it failed)
    row_mask                    ``[R]`` bool, False where a reward function failed
    finished                    ``[R]`` bool, the row emitted a stop token
    ref_logprobs                ``[R, N]`` reference log-probs (when KL enters), else None
    old_values                  ``[R, N]`` value estimates before the update (PPO), else None
    advantages                  ``[R, N]`` (filled by the algorithm's ``advantages``)
    returns                     ``[R, N]`` value targets (PPO), else None
    versions                    ``[R, N]`` int32, the policy version (optimizer steps taken) that sampled
                                each token, in the asynchronous loop (``train.max_staleness >= 1``); else None
    prompt_group                static: K > 1 when every run of K consecutive rows shares its prompt
                                (ids and mask), so the passes may run each prompt once
                                (``rljax.logprobs.completion_states``); 1 claims nothing
    """

    prompt_ids: Array
    prompt_mask: Array
    completion_ids: Array
    completion_mask: Array
    loss_mask: Array
    old_logprobs: Array
    scores: Array
    row_mask: Array
    finished: Array
    ref_logprobs: Array | None = None
    old_values: Array | None = None
    advantages: Array | None = None
    returns: Array | None = None
    sampling_logprobs: Array | None = None
    versions: Array | None = None
    prompt_group: int = flax.struct.field(pytree_node=False, default=1)

    @property
    def num_rows(self) -> int:
        return self.prompt_ids.shape[0]


@flax.struct.dataclass
class PairBatch:
    """``B`` prompts with ``K`` completions each: pairs (``K = 2``, chosen first) or ranked lists
    (best first).

    prompt_ids, prompt_mask         ``[B, P]`` int32, left-padded
    completion_ids, completion_mask ``[B, K, N]`` int32, right-padded
    completion_valid                ``[B, K]`` int32, the completion exists (ranked lists may be short)
    row_mask                        ``[B]`` int32, a real row (evaluation pads its last batch)
    margin                          ``[B]`` float32 preference strength (Bradley–Terry margin, ODPO
                                    offset before scaling), else None
    ref_logps                       ``[B, K]`` float32 summed reference log-probs (DPO), else None
    """

    prompt_ids: Array
    prompt_mask: Array
    completion_ids: Array
    completion_mask: Array
    completion_valid: Array
    row_mask: Array
    margin: Array | None = None
    ref_logps: Array | None = None


@flax.struct.dataclass
class RecordBatch:
    """``B`` logged ``(prompt, completion, score)`` records and their weights.

    prompt_ids, prompt_mask         ``[B, P]`` int32, left-padded
    completion_ids, completion_mask ``[B, N]`` int32, right-padded
    row_mask                        ``[B]`` int32, a real row
    weight                          ``[B]`` float32 per-record weight (constant of the data)
    """

    prompt_ids: Array
    prompt_mask: Array
    completion_ids: Array
    completion_mask: Array
    row_mask: Array
    weight: Array


@flax.struct.dataclass
class TranscriptBatch:
    """``B`` chat transcripts for supervised fine-tuning (``rljax.data.transcripts``).

    prompt_ids, prompt_mask         ``[B, P]`` int32, left-padded: the turns before the first assistant token
    completion_ids, completion_mask ``[B, N]`` int32, right-padded: the rest (assistant, tool and user
                                    turns); ``completion_mask`` marks real tokens (attention)
    loss_mask                       ``[B, N]`` int32, 1 on the assistant tokens (the loss's tokens)
    row_mask                        ``[B]`` int32, a real row
    """

    prompt_ids: Array
    prompt_mask: Array
    completion_ids: Array
    completion_mask: Array
    loss_mask: Array
    row_mask: Array


def pad_sequences(
    rows: Sequence[Sequence[int]],
    *,
    side: Literal["left", "right"],
    pad_id: int,
    width: int | None = None,
    buckets: Sequence[int] | None = None,
    num_rows: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` ``[num_rows, W]`` int32 of token ``rows`` padded on ``side`` with ``pad_id``.

    ``W`` is ``width`` if given, else the smallest of ``buckets`` that fits the longest row (else
    the longest row). ``num_rows`` (default ``len(rows)``) appends empty rows (mask 0). A row longer
    than ``W``, or more rows than ``num_rows``, is an error naming it: cutting is the caller's choice.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    longest = max((len(r) for r in rows), default=0)
    if width is None:
        width = longest
        if buckets:
            fitting = [b for b in sorted(buckets) if b >= longest]
            if not fitting:
                raise ValueError(f"the longest row has {longest} tokens, over the largest bucket {max(buckets)}")
            width = fitting[0]
    num_rows = len(rows) if num_rows is None else num_rows
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows do not fit num_rows={num_rows}")
    ids = np.full((num_rows, width), pad_id, np.int32)
    mask = np.zeros((num_rows, width), np.int32)
    for i, row in enumerate(rows):
        n = len(row)
        if n > width:
            raise ValueError(f"row {i} has {n} tokens, over the width {width}")
        if n == 0:
            continue
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, cols], mask[i, cols] = row, 1
    return ids, mask


__all__ = ["PairBatch", "RecordBatch", "RolloutBatch", "TranscriptBatch", "pad_sequences"]
