"""Learning from scored records ``(prompt, response, score)``: weighted maximum likelihood.

Every mode maximises a weighted log-likelihood of the logged responses,

    loss = reduce_t( −w_i · log π_θ(y_{i,t} | x_i, y_{i,<t}) )        (``weighted_nll_loss``)

and differs only in the per-record weight ``w_i``, computed once over a data split from the
scores (``record_weights``):

============== ============================================================ =========================
mode           weight                                                       paper
============== ============================================================ =========================
``awr``        ``min(exp((s_i − b(x_i)) / T), w_max)``; ``b(x)`` the mean     AWR, Peng et al. 2019,
               score of the responses to prompt ``x`` when it has several,  arXiv:1910.00177 (eq. 8
               else the mean of all scores (``baseline="global_mean"``:    and §5: exp(A/β) clipped
               always the latter)                                           at w_max = 20)
``rwr``        ``min(exp(s_i / T) / mean_j exp(s_j / T), w_max)`` (mean     RWR, Peters & Schaal,
               weight 1, so the learning rate keeps its meaning)            ICML 2007
``filtered_bc`` ``1`` if ``s_i ≥ threshold``, else the record is dropped     filtered behaviour cloning
                                                                            (%BC, arXiv:2106.01345);
                                                                            ReST-EM arXiv:2312.06585,
                                                                            RAFT arXiv:2304.06767
============== ============================================================ =========================

The weights are constants of the data (no gradient flows through them). ``record_weights`` and
``prompt_baselines`` run once on the host over a whole split (numpy, float64);
``weighted_nll_loss`` is the jittable per-batch loss.
"""

from __future__ import annotations

from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from rljax.losses.reduce import masked_mean, reduce_tokens

RECORD_MODES = ("awr", "rwr", "filtered_bc")
RECORD_BASELINES = ("prompt_mean", "global_mean")


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
    """Per-record weights ``w`` ``[n]`` (float32) and which records are kept ``[n]`` (bool).

    * ``awr``: ``w_i = min(exp((s_i − b(x_i)) / T), w_max)``, ``b`` from ``prompt_baselines``
      (AWR, arXiv:1910.00177).
    * ``rwr``: ``w_i = min(exp(s_i / T) / mean_j exp(s_j / T), w_max)`` (RWR, Peters & Schaal 2007).
    * ``filtered_bc``: ``w_i = 1`` and kept iff ``s_i ≥ threshold``, else ``w_i = 0`` and dropped.

    Args:
      scores: ``[n]`` one score per record.
      prompt_keys: ``[n]`` an identifier of each record's prompt (records with the same key share
        the ``awr`` per-prompt baseline).
      mode: one of ``RECORD_MODES``.
      temperature: ``T`` (``awr``, ``rwr``).
      max_weight: ``w_max``; 0 disables clipping (``awr``, ``rwr``).
      baseline: ``awr`` baseline, one of ``RECORD_BASELINES``.
      threshold: ``filtered_bc`` score threshold.
    Returns:
      ``(weights, keep)``: ``awr`` and ``rwr`` keep every record.
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
        # clip in log space: exp of a large advantage / small T would overflow before a clip
        log_w = np.minimum(log_w, np.log(max_weight))
    return np.exp(log_w).astype(np.float32), np.ones(len(s), bool)


def prompt_baselines(scores: np.ndarray, prompt_keys: Sequence[str], *, baseline: str = "prompt_mean") -> np.ndarray:
    """AWR baseline ``b(x_i)`` ``[n]`` (float64).

    ``baseline="prompt_mean"``: the mean score of prompt ``x_i``'s records when it has two or
    more, else the mean of all scores (a lone response would otherwise have advantage 0 and
    weight 1 whatever its score). ``baseline="global_mean"``: always the mean of all scores.
    """
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
    """Weighted negative log-likelihood ``reduce(−w_i · log π[i, t])`` (module table).

    Args:
      logprobs: ``[B, T]`` log π of the logged tokens.
      mask: ``[B, T]``, nonzero = the token counts.
      weights: ``[B]`` per-sequence weights (stop-gradient).
      reduction: a mode of ``rljax.losses.reduce.reduce_tokens``; ``num_sequences``,
        ``num_tokens``, ``max_length`` are its global counts (micro-batch parts then sum to the
        whole-batch loss).
    Returns:
      ``(loss, metrics)``: ``offline/loss``, ``offline/nll`` (unweighted token-mean NLL, local),
      ``offline/weight_mean`` (mean weight over sequences with at least one token, local).
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
        "offline/weight_mean": masked_mean(weights, has_tokens),
    }
    return value, jax.lax.stop_gradient(metrics)
