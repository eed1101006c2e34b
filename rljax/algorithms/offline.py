"""Learning from scored records ``(prompt, response, score)``: weighted maximum likelihood.

Every mode maximises a weighted log-likelihood of the logged responses,

    loss = reduce_t( −w_i · log π_θ(y_{i,t} | x_i, y_{i,<t}) )        (reduction: offline.reduction)

and differs only in the per-record weight ``w_i``, computed once over the training split from the
scores (``record_weights``; the evaluation split gets its own, by the same rule):

============== ============================================================ =========================
mode           weight                                                       paper
============== ============================================================ =========================
``awr``        ``min(exp((s_i − b(x_i)) / T), w_max)``; ``b(x)`` the mean     AWR, Peng et al. 2019,
               score of the responses to prompt ``x`` when it has several,  arXiv:1910.00177 (eq. 8
               else the mean of all scores (``baseline: global_mean``:     and §5: exp(A/β) clipped
               always the latter)                                           at w_max = 20)
``rwr``        ``min(exp(s_i / T) / mean_j exp(s_j / T), w_max)`` (mean     RWR, Peters & Schaal,
               weight 1, so the learning rate keeps its meaning)            ICML 2007
``filtered_bc`` ``1`` if ``s_i ≥ threshold``, else the record is dropped     filtered behaviour cloning
                                                                            (%BC, arXiv:2106.01345);
                                                                            ReST-EM arXiv:2312.06585,
                                                                            RAFT arXiv:2304.06767
============== ============================================================ =========================

The weights are constants of the data (no gradient flows through them). A batch holds
``prompt_ids``/``prompt_mask`` ``[B, P]``, ``response_ids``/``response_mask`` ``[B, 1, N]``,
``weight`` ``[B]`` and ``row_mask`` ``[B]``.
"""

from __future__ import annotations

from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rljax.logprobs import completion_logprobs
from rljax.losses.reduce import masked_mean, num_valid_sequences, num_valid_tokens, reduce_tokens
from rljax.run_config import OfflineSection


def record_weights(
    scores: Sequence[float],
    prompt_keys: Sequence[str],
    *,
    mode: str,
    temperature: float = 1.0,
    max_weight: float = 20.0,
    baseline: str = "prompt_mean",
    threshold: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-record weights ``[n]`` (float32) and which records are kept ``[n]`` (bool).

    See the module table. ``max_weight`` 0 disables clipping. ``awr`` and ``rwr`` keep every
    record; ``filtered_bc`` keeps those with ``score >= threshold`` (weight 1).
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or len(prompt_keys) != len(s):
        raise ValueError(f"scores {s.shape} and prompt_keys ({len(prompt_keys)}) must be [n] and n")
    if len(s) == 0:
        return np.zeros(0, np.float32), np.zeros(0, bool)
    if mode == "filtered_bc":
        keep = s >= threshold
        return keep.astype(np.float32), keep
    if mode == "awr":
        advantages = s - prompt_baselines(s, prompt_keys, baseline=baseline)
        log_w = advantages / temperature
    elif mode == "rwr":
        z = s / temperature
        log_w = z - (np.log(np.mean(np.exp(z - z.max()))) + z.max())  # exp(z) / mean(exp(z)), stably
    else:
        raise ValueError(f"mode must be 'awr', 'rwr' or 'filtered_bc', got {mode!r}")
    if max_weight:
        log_w = np.minimum(log_w, np.log(max_weight))
    return np.exp(log_w).astype(np.float32), np.ones(len(s), bool)


def prompt_baselines(scores: np.ndarray, prompt_keys: Sequence[str], *, baseline: str = "prompt_mean") -> np.ndarray:
    """``b(x_i)`` ``[n]``: the mean score of prompt ``x_i``'s records when it has two or more,
    else (and always for ``baseline="global_mean"``) the mean of all scores."""
    scores = np.asarray(scores, dtype=np.float64)
    out = np.full(len(scores), scores.mean() if len(scores) else 0.0)
    if baseline == "global_mean":
        return out
    if baseline != "prompt_mean":
        raise ValueError(f"baseline must be 'prompt_mean' or 'global_mean', got {baseline!r}")
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(prompt_keys):
        groups.setdefault(key, []).append(i)
    for rows in groups.values():
        if len(rows) > 1:
            out[rows] = scores[rows].mean()
    return out


def weighted_nll_loss(
    logprobs: chex.Array,
    mask: chex.Array,
    weights: chex.Array,
    *,
    reduction: str = "token_mean",
    num_sequences=None,
    num_tokens=None,
    max_length=None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """Weighted negative log-likelihood ``reduce(−w_i · logπ[i, t])``.

    Args:
      logprobs: ``[B, T]`` log π of the logged tokens.
      mask: ``[B, T]``, nonzero = the token counts.
      weights: ``[B]`` per-sequence weights (no gradient).
      reduction: a mode of ``rljax.losses.reduce.reduce_tokens``; global counts as there.
    Returns:
      ``(loss, metrics)``: ``offline/loss``, ``offline/nll`` (unweighted token-mean NLL, local),
      ``offline/weight_mean`` (over sequences with tokens, local).
    """
    chex.assert_rank([logprobs, mask], 2)
    chex.assert_rank(weights, 1)
    chex.assert_equal_shape([logprobs, mask])
    weights = jax.lax.stop_gradient(weights.astype(logprobs.dtype))
    per_token = -weights[:, None] * logprobs
    value = reduce_tokens(per_token, mask, mode=reduction, num_sequences=num_sequences, num_tokens=num_tokens,
                          max_length=max_length)
    has_tokens = jnp.any(mask != 0, axis=-1)
    metrics = {
        "offline/loss": value,
        "offline/nll": masked_mean(-logprobs, mask),
        "offline/weight_mean": jnp.sum(jnp.where(has_tokens, weights, 0.0)) / jnp.maximum(jnp.sum(has_tokens), 1),
    }
    return value, jax.lax.stop_gradient(metrics)


def _loss_mask(batch: dict) -> jnp.ndarray:
    return batch["response_mask"][:, 0] * (batch["row_mask"] != 0)[:, None].astype(batch["response_mask"].dtype)


def batch_totals(batch: dict, cfg: OfflineSection) -> dict:
    """Global token / sequence counts of a batch (before it is split into micro-batches)."""
    mask = _loss_mask(batch)
    return {"num_sequences": jnp.maximum(num_valid_sequences(mask), 1.0),
            "num_tokens": jnp.maximum(num_valid_tokens(mask), 1.0), "max_length": mask.shape[1]}


def loss(model, batch: dict, cfg: OfflineSection, *, num_sequences, num_tokens, max_length):
    """``(loss, metrics)`` of one micro-batch of records."""
    mask = _loss_mask(batch)
    logprobs = completion_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"][:, 0],
                                   mask)["logprobs"]
    return weighted_nll_loss(logprobs, mask, batch["weight"], reduction=cfg.reduction, num_sequences=num_sequences,
                             num_tokens=num_tokens, max_length=max_length)
