"""Off-policy corrections: per-token loss weights for samples the trained policy did not draw.

The sampler (the inference engine, a stale copy of the weights in an asynchronous loop, another
numeric precision) draws tokens from ``μ``; the loss's ratio is taken against ``π_old``. When the
two differ, the policy-gradient estimate is biased; a weight per token built from
``π_old / μ`` corrects or bounds that. The weights are constants of the batch (no gradient), so a
loss multiplies its per-token policy-gradient term by them and nothing else changes.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp

from rljax.losses import reduce as reduce_lib

OFF_POLICY_MODES = ("token_tis", "seq_tis", "token_mask", "seq_mask")

OFF_POLICY_METRICS = ("off_policy/weight_mean", "off_policy/weight_max", "off_policy/token_masked_frac",
                      "off_policy/row_masked_frac", "off_policy/truncated_frac", "policy/logp_diff_mean",
                      "policy/logp_diff_max")


def check_bounds(bounds, *, name: str = "bounds") -> None:
    """Raises ``ValueError`` naming ``name`` unless ``bounds`` is a pair ``(lo, hi)`` with
    ``0 <= lo <= hi`` and ``hi > 0`` (``hi`` may be ``inf``: no truncation). Traced values pass
    unchecked (a vmapped hyperparameter is the caller's to check)."""
    try:
        lo, hi = bounds
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (lo, hi), got {bounds!r}") from None
    concrete = all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (lo, hi))
    if not concrete:
        return
    if math.isnan(lo) or math.isnan(hi):
        raise ValueError(f"{name} must be numbers, got {bounds!r}")
    if lo < 0:
        raise ValueError(f"{name}: lo must be >= 0 (a ratio is never negative), got lo={lo!r}")
    if hi <= 0:
        raise ValueError(f"{name}: hi must be > 0, got hi={hi!r}")
    if lo > hi:
        raise ValueError(f"{name}: lo must be <= hi, got lo={lo!r} > hi={hi!r}")


def off_policy_weights(
    old_logprobs: chex.Array,
    sampling_logprobs: chex.Array,
    mask: chex.Array,
    *,
    mode: str,
    bounds,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """Per-token weights ``w[i, t]`` correcting for the sampler ``μ`` differing from ``π_old``.

    With ``d_t = old_t − μ_t`` (log π_old − log μ of the sampled token), ``m`` the mask and bounds
    ``(lo, hi)``, the weight on token ``t`` of row ``i``::

        token_tis    w = min(exp(d_t), hi)                                 lo unused
        seq_tis      w = min(exp(Σ_t m_t d_t), hi)          every token of the row; lo unused
        token_mask   w = 1 if lo <= exp(d_t) <= hi else 0
        seq_mask     w = 1 if lo <= exp(Σ_t m_t d_t / Σ_t m_t) <= hi else 0   every token of the row

    * ``token_tis``: truncated importance sampling (Yao et al., "Your efficient RL framework
      secretly brings you off-policy RL training", 2025; verl ``rollout_is: token``, TRL
      ``vllm_importance_sampling_correction``).
    * ``seq_tis``: the same on the sequence's ratio ``Π_t π_old/μ`` (verl ``rollout_is: sequence``).
    * ``token_mask``: tokens whose ratio leaves ``[lo, hi]`` are dropped from the gradient
      (IcePop, Ling team, "Small leak can sink a great ship", 2025; verl ``rollout_rs: token``).
    * ``seq_mask``: a row is dropped when its geometric-mean ratio leaves ``[lo, hi]``: masked
      importance sampling (MIS; Liu, Li et al., "When speed kills stability: demystifying RL
      collapse from the training-inference mismatch", 2025; verl ``rollout_rs: geometric``,
      which suggests tight bounds such as ``(0.999, 1.001)``).

    The weights are constants: both inputs are stopped and so is ``w``. They are 0 where ``mask``
    is 0, and finite there whatever those positions hold (NaN, ±inf: masked entries are selected
    out before any arithmetic, as ``reduce``). A NaN at a valid position is a real error and
    propagates. A rejected token keeps its place in a loss's denominator (the weight multiplies
    the per-token term); verl instead removes rejected tokens from the loss mask.

    Args:
      old_logprobs: ``[B, T]`` float, log π_old (the policy the loss's ratio is taken against).
      sampling_logprobs: ``[B, T]`` float, log μ as the sampler recorded it.
      mask: ``[B, T]``, nonzero = the token counts.
      mode: one of ``OFF_POLICY_MODES``.
      bounds: ``(lo, hi)`` with ``0 <= lo <= hi``, ``hi > 0`` (``hi = inf``: no truncation).

    Returns:
      ``(weights, metrics)``: ``weights`` ``[B, T]`` in ``old_logprobs``' dtype; metrics (scalars,
      over the valid tokens): ``off_policy/weight_mean``, ``off_policy/weight_max``,
      ``off_policy/token_masked_frac`` (valid tokens with weight 0),
      ``off_policy/row_masked_frac`` (rows with a valid token whose every valid token has weight
      0, over such rows), ``off_policy/truncated_frac`` (valid tokens whose ratio exceeded ``hi``
      and was truncated; 0 for the mask modes), ``policy/logp_diff_mean`` and
      ``policy/logp_diff_max`` (``|μ_t − old_t|``: how far sampler and trainer disagree).
    """
    arrays = [old_logprobs, sampling_logprobs, mask]
    chex.assert_rank(arrays, 2)
    chex.assert_equal_shape(arrays)
    chex.assert_type([old_logprobs, sampling_logprobs], float)
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"off_policy_weights: mode must be one of {OFF_POLICY_MODES}, got {mode!r}")
    check_bounds(bounds)
    lo, hi = bounds

    valid = mask != 0
    # at least float32: a sequence's sum of log-ratios in bfloat16 loses the small differences
    dtype = jnp.promote_types(old_logprobs.dtype, jnp.float32)
    zero = jnp.zeros((), dtype)
    old = jnp.where(valid, jax.lax.stop_gradient(old_logprobs).astype(dtype), zero)
    sampled = jnp.where(valid, jax.lax.stop_gradient(sampling_logprobs).astype(dtype), zero)
    log_ratio = old - sampled  # [B, T], 0 at masked positions

    if mode.startswith("token"):
        ratio = jnp.exp(log_ratio)
    else:
        seq_log_ratio = jnp.sum(log_ratio, axis=-1, keepdims=True)  # [B, 1]
        if mode == "seq_mask":  # geometric mean of the token ratios
            seq_len = jnp.sum(valid, axis=-1, keepdims=True, dtype=dtype)
            seq_log_ratio = seq_log_ratio / jnp.maximum(seq_len, 1.0)
        ratio = jnp.broadcast_to(jnp.exp(seq_log_ratio), log_ratio.shape)

    if mode.endswith("tis"):
        weights = jnp.minimum(ratio, hi)
        truncated = (ratio > hi).astype(dtype)
    else:
        weights = ((ratio >= lo) & (ratio <= hi)).astype(dtype)
        truncated = jnp.zeros_like(weights)
    weights = jax.lax.stop_gradient(jnp.where(valid, weights, zero))

    rejected = (weights == 0).astype(dtype)
    row_len = jnp.sum(valid, axis=-1)  # [B]
    has_tokens = row_len > 0
    row_rejected = has_tokens & (jnp.sum(jnp.where(valid, rejected, zero), axis=-1) == row_len)
    num_rows = jnp.maximum(jnp.sum(has_tokens, dtype=dtype), 1.0)
    diff = jnp.abs(log_ratio)
    metrics = {
        "off_policy/weight_mean": reduce_lib.masked_mean(weights, mask),
        "off_policy/weight_max": reduce_lib.masked_max(weights, mask),
        "off_policy/token_masked_frac": reduce_lib.masked_mean(rejected, mask),
        "off_policy/row_masked_frac": jnp.sum(row_rejected, dtype=dtype) / num_rows,
        "off_policy/truncated_frac": reduce_lib.masked_mean(truncated, mask),
        "policy/logp_diff_mean": reduce_lib.masked_mean(diff, mask),
        "policy/logp_diff_max": reduce_lib.masked_max(diff, mask),
    }
    return weights.astype(old_logprobs.dtype), jax.lax.stop_gradient(metrics)


__all__ = ["OFF_POLICY_METRICS", "OFF_POLICY_MODES", "check_bounds", "off_policy_weights"]
