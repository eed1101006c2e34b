"""What the offline algorithms (DPO, reward models, scored records) share: batching settings and
the no-gradient scoring of every completion of a ``PairBatch``.

Wiring only; each algorithm module subclasses :class:`OfflineSettings` for its config section.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax.numpy as jnp

from rljax.batches import PairBatch
from rljax.config import check_range
from rljax.logprobs import grouped_completion_logprobs


@dataclasses.dataclass(frozen=True)
class OfflineSettings:
    """Batches, passes and completion handling of every offline algorithm."""

    # keys that moved out of this section (rljax/config.py names the new place in the error)
    __moved_keys__ = {"save_model": "train.save_model"}

    batch_size: int = 8  # pairs / ranked lists / records per optimizer step
    micro_batch_size: Optional[int] = None  # rows per forward/backward; null = the whole batch
    epochs: Optional[float] = None  # train this many passes over the train split (null: train.steps)
    eval_batch_size: int = 16
    max_completion_length: int = 128  # tokens, EOS included
    # truncate: a pair / ranked list whose responses are identical once cut is dropped and counted
    # (data/train_dropped/identical_after_truncation)
    completion_too_long: Literal["error", "filter", "truncate"] = "truncate"
    append_eos: bool = True  # end each completion with the tokenizer's EOS (the model learns to stop)
    # a row that lacks a column, has an empty completion or chosen == rejected
    invalid_rows: Literal["error", "drop"] = "error"  # drop: counted (data/dropped_*) and skipped

    @property
    def num_micro(self) -> int:
        return self.batch_size // (self.micro_batch_size or self.batch_size)

    def validate(self) -> None:
        for key in ("batch_size", "eval_batch_size", "micro_batch_size", "max_completion_length"):
            check_range(self, key, low=1)
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide batch_size ({self.batch_size})")
        check_range(self, "epochs", low=0, low_open=True, note="(null = train.steps)")


def lengths(batch: PairBatch) -> jnp.ndarray:
    """``[B, K]`` float32 token counts of every completion."""
    return jnp.sum(batch.completion_mask != 0, axis=-1).astype(jnp.float32)


def sequence_logps(model, batch: PairBatch) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Summed log-probs ``[B, K]`` of each completion and its token count ``[B, K]``: one forward pass
    over each prompt and its K completions packed in one row (``rljax.logprobs.grouped_completion_logprobs``)."""
    mask = batch.completion_mask
    logprobs = grouped_completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, mask)
    return jnp.sum(jnp.where(mask != 0, logprobs, jnp.zeros_like(logprobs)), axis=-1), lengths(batch)
