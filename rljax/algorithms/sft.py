"""Supervised fine-tuning on chat transcripts (single- or multi-turn): the NLL of the assistant's tokens.

    loss = reduce_t( −m_{i,t} · log π_θ(y_{i,t} | y_{i,<t}) ),  m = 1 on assistant tokens only

Rows are transcripts (``rljax.data.transcripts``): a ``messages`` column of ``{role, content}`` lists
(system, user, assistant, tool turns), or ``prompt`` / ``completion`` columns; with ``data.task`` the
task's prompts and gold answers (``<answer>`` tags). The chat template is rendered turn by turn to
find the assistant's tokens; system, user and tool tokens are context (no loss, no gradient).
Batches are ``TranscriptBatch`` es; the loss is ``rljax.losses.sft.sft_loss``. The warm start of
agent recipes (a few hundred demonstrations, then RL), as in the R1 (arXiv:2501.12948) and ART recipes.

Evaluation on the held-out transcripts: ``loss`` (the token-mean NLL of all held-out assistant
tokens), ``nll``, ``perplexity = exp(nll)`` and ``token_accuracy`` (share of assistant tokens that
are the model's most likely next token).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np

from rljax.algorithms import _offline
from rljax.algorithms.policy_gradient import Reduction
from rljax.algorithms.base import OfflineAlgorithm
from rljax.batches import TranscriptBatch
from rljax.logprobs import completion_logprobs
from rljax.losses.reduce import num_valid_sequences, num_valid_tokens
from rljax.losses.sft import sft_loss


@dataclasses.dataclass(frozen=True)
class SFTConfig(_offline.OfflineSettings):
    name: Literal["sft"] = "sft"
    messages_column: str = "messages"  # "" = read prompt / completion columns (data.prompt_column)
    completion_column: str = "completion"
    reduction: Reduction = "token_mean"
    # tokens from the first assistant token to the end of the last assistant turn (tool and user
    # turns in between included)
    max_completion_length: int = 256


def _loss_mask(batch: TranscriptBatch) -> jnp.ndarray:
    return batch.loss_mask * (batch.row_mask != 0)[:, None].astype(batch.loss_mask.dtype)


def totals(batch: TranscriptBatch, cfg: SFTConfig) -> dict:
    """Global assistant-token / transcript counts of a batch (before it is split into micro-batches)."""
    mask = _loss_mask(batch)
    return {"num_rows": jnp.maximum(num_valid_sequences(mask), 1.0),
            "num_tokens": jnp.maximum(num_valid_tokens(mask), 1.0), "max_length": mask.shape[1]}


def _forward(model, batch: TranscriptBatch) -> dict:
    # completion_mask (every real token) is the attention mask; the loss mask is applied afterwards
    return completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                               batch.completion_mask, with_argmax=True)


def loss(model, batch: TranscriptBatch, cfg: SFTConfig, *, num_rows, num_tokens, max_length):
    """``(loss, metrics)`` of one micro-batch: ``sft_loss`` over the assistant tokens."""
    out = _forward(model, batch)
    return sft_loss(out["logprobs"], _loss_mask(batch), correct=out["argmax"] == batch.completion_ids,
                    reduction=cfg.reduction, num_sequences=num_rows, num_tokens=num_tokens, max_length=max_length)


def score(model, batch: TranscriptBatch):
    """No gradient: ``[B, 2]`` (summed log-prob of each transcript's assistant tokens, how many of them
    are the model's most likely token) and ``[B, 2]`` (their count, twice)."""
    out = _forward(model, batch)
    mask = _loss_mask(batch) != 0
    summed = jnp.sum(jnp.where(mask, out["logprobs"], 0.0), axis=-1)
    right = jnp.sum(mask & (out["argmax"] == batch.completion_ids), axis=-1, dtype=jnp.float32)
    count = jnp.sum(mask, axis=-1, dtype=jnp.float32)
    return jnp.stack([summed, right], axis=-1), jnp.stack([count, count], axis=-1)


def evaluate(scores, lengths, data, cfg: SFTConfig) -> dict:
    """Held-out transcripts: ``loss`` and ``nll`` (token-mean NLL over every held-out assistant token),
    ``perplexity`` (``exp(nll)``), ``token_accuracy``, ``tokens``."""
    scores, lengths = np.asarray(scores, np.float64), np.asarray(lengths, np.float64)
    tokens = max(float(lengths[:, 0].sum()), 1.0)
    nll = -float(scores[:, 0].sum()) / tokens
    return {"loss": nll, "nll": nll, "perplexity": float(np.exp(min(nll, 80.0))),
            "token_accuracy": float(scores[:, 1].sum()) / tokens, "tokens": float(lengths[:, 0].sum())}


ALGORITHM = OfflineAlgorithm(name="sft", config=SFTConfig, data_kind=lambda cfg: "transcripts", loss=loss,
                             totals=totals, score=score, evaluate=evaluate)
