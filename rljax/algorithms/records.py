"""Learning from scored records ``(prompt, response, score)``: weighted maximum likelihood.

    loss = reduce_t( −w_i · log π_θ(y_{i,t} | x_i, y_{i,<t}) )          (reduction)

The modes differ only in the per-record weight ``w_i`` (``rljax.losses.records.record_weights``:
AWR arXiv:1910.00177, RWR Peters & Schaal 2007, filtered behaviour cloning / ReST-EM
arXiv:2312.06585), computed once per split from the scores (``prepare``); they are constants of the
data. Batches are ``RecordBatch`` es.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax.numpy as jnp
import numpy as np

from rljax.algorithms import _offline
from rljax.algorithms.policy_gradient import Reduction
from rljax.algorithms.base import OfflineAlgorithm
from rljax.batches import RecordBatch
from rljax.config import check_range
from rljax.logprobs import completion_logprobs
from rljax.losses.reduce import num_valid_sequences, num_valid_tokens
from rljax.losses.records import record_weights, weighted_nll_loss


@dataclasses.dataclass(frozen=True)
class RecordsConfig(_offline.OfflineSettings):
    name: Literal["records"] = "records"
    mode: Literal["awr", "rwr", "filtered_bc"] = "awr"
    response_column: str = "response"
    score_column: str = "score"
    task_responses: int = 4  # from data.task: scored responses per prompt
    temperature: float = 1.0  # awr / rwr: weight = exp(advantage / temperature)
    max_weight: Optional[float] = 20.0  # awr / rwr: weights clipped here (AWR's w_max); null = no clip
    baseline: Literal["prompt_mean", "global_mean"] = "prompt_mean"  # awr: per-prompt mean where a prompt
    #                                               has several responses (else the mean of all scores)
    score_threshold: float = 0.5  # filtered_bc: train on responses scoring >= this
    reduction: Reduction = "token_mean"

    def validate(self) -> None:
        super().validate()
        check_range(self, "temperature", low=0, low_open=True)
        check_range(self, "max_weight", low=0, low_open=True, note="(null = no clip)")
        check_range(self, "score_threshold")
        check_range(self, "task_responses", low=2)


def prepare(data, cfg: RecordsConfig, split: str):
    """Record weights of a split (``data.values["weight"]``); the training split drops the records a
    filter rejects. Returns ``(data, counts)``."""
    weights, keep = record_weights(
        data.values.get("score", np.zeros(0)), [r["key"] for r in data.rows], mode=cfg.mode,
        temperature=cfg.temperature, max_weight=cfg.max_weight or 0.0, baseline=cfg.baseline,
        threshold=cfg.score_threshold)
    data.values["weight"] = weights
    if split != "train" or keep.all():
        return data, {}
    return data.select(np.flatnonzero(keep)), {"train_filtered_out": int((~keep).sum())}


def _loss_mask(batch: RecordBatch) -> jnp.ndarray:
    return batch.completion_mask * (batch.row_mask != 0)[:, None].astype(batch.completion_mask.dtype)


def totals(batch: RecordBatch, cfg: RecordsConfig) -> dict:
    """Global token / sequence counts of a batch (before it is split into micro-batches)."""
    mask = _loss_mask(batch)
    return {"num_rows": jnp.maximum(num_valid_sequences(mask), 1.0),
            "num_tokens": jnp.maximum(num_valid_tokens(mask), 1.0), "max_length": mask.shape[1]}


def objective(logprobs, batch: RecordBatch, cfg: RecordsConfig, *, num_rows, num_tokens, max_length):
    """``weighted_nll_loss`` of the records' token log-probs ``[B, N]``."""
    return weighted_nll_loss(logprobs, _loss_mask(batch), batch.weight, reduction=cfg.reduction,
                             num_sequences=num_rows, num_tokens=num_tokens, max_length=max_length)


def loss(model, batch: RecordBatch, cfg: RecordsConfig, **totals):
    """``(loss, metrics)`` of one micro-batch of records."""
    logprobs = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   _loss_mask(batch))["logprobs"]
    return objective(logprobs, batch, cfg, **totals)


def score(model, batch: RecordBatch):
    """Summed log-probs ``[B, 1]`` of every record (no gradient) and its length ``[B, 1]``."""
    logprobs = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                   batch.completion_mask)["logprobs"]
    summed = jnp.sum(jnp.where(batch.completion_mask != 0, logprobs, 0.0), axis=-1)
    return summed[:, None], jnp.sum(batch.completion_mask != 0, axis=-1, dtype=jnp.float32)[:, None]


def evaluate(logps, lengths, data, cfg: RecordsConfig) -> dict:
    """Held-out records: the training objective (same reduction), NLL, and whether likelihood follows
    the score (``logp_high/low/gap``: per-token log-prob of records above / at most the median score;
    ``pair_accuracy``: same-prompt pairs where the better record has the higher per-token log-prob).

    The objective is linear in each row's log-probs, so a row's summed log-prob placed on its first
    token (the others 0, the mask its length) gives every reduction's value exactly.
    """
    summed, lengths = np.asarray(logps)[:, 0], np.asarray(lengths)[:, 0]
    width = max(int(lengths.max(initial=1)), 1)
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int32)
    token_logps = np.zeros(mask.shape, np.float32)
    token_logps[:, 0] = summed
    batch = RecordBatch(prompt_ids=None, prompt_mask=None, completion_ids=None, completion_mask=jnp.asarray(mask),
                        row_mask=jnp.ones((len(data),), jnp.int32), weight=jnp.asarray(data.values["weight"]))
    value, metrics = objective(jnp.asarray(token_logps), batch, cfg, **totals(batch, cfg))
    out = {"loss": value, **{k.removeprefix("offline/"): v for k, v in metrics.items() if k != "offline/loss"}}
    per_token = summed / np.maximum(lengths, 1)
    score_ = data.values["score"]
    median = float(np.median(score_))
    high, low = score_ > median, score_ <= median
    if high.any() and low.any():
        out["logp_high"] = float(per_token[high].mean())
        out["logp_low"] = float(per_token[low].mean())
        out["logp_gap"] = out["logp_high"] - out["logp_low"]
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(data.rows):
        groups.setdefault(r["key"], []).append(i)
    right = total = 0
    for rows in groups.values():
        for a in rows:
            for b in rows:
                if score_[a] > score_[b]:
                    total += 1
                    right += per_token[a] > per_token[b]
    if total:
        out["pair_accuracy"] = right / total
    return out


ALGORITHM = OfflineAlgorithm(name="records", config=RecordsConfig, data_kind=lambda cfg: "records", loss=loss,
                             totals=totals, score=score, evaluate=evaluate, prepare=prepare)
