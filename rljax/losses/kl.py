"""Per-token estimators of KL(π_θ ‖ π_ref) and a KL loss.

The sampled token ``y_t`` comes from the policy (or the old / behaviour policy), so a function of
the two log-probabilities of that token estimates the KL. With ``d = logp_ref − logp`` (and
``r = exp(d) = π_ref/π_θ``), following J. Schulman, "Approximating KL divergence" (2020,
http://joschu.net/blog/kl-approx.html) and the DeepSeekMath GRPO loss (arXiv:2402.03300, eq. 4):

* ``k1 = −d = logp − logp_ref``. Unbiased value. Gradient ``∇logπ``, whose expectation
  on-policy is ``E[∇logπ] = 0``: **no** expected gradient as a loss term. Use it as a reward
  penalty (PPO, RLOO), where the score-function gradient of the summed penalty is ∇KL.
* ``k2 = d² / 2``. Biased value. Gradient ``(logπ − logπ_ref) ∇logπ``, expectation
  ``∇KL(π‖π_ref)``: the exact reverse-KL gradient on-policy.
* ``k3 = exp(d) − d − 1`` (≥ 0). Unbiased, non-negative, low-variance value (GRPO's choice,
  β = 0.04). Gradient ``(1 − r) ∇logπ``, expectation ``∇KL(π_ref‖π)``: the gradient of the
  *forward* KL, not of the KL it estimates.
* ``k3_unbiased = ρ · k3`` with ``ρ = π_θ/π_old`` **not** stopped and ``y ~ π_old``:
  ``E_old[ρ k3] = KL(π‖π_ref)`` and ``E_old[∇(ρ k3)] = ∇KL(π‖π_ref)`` exactly, on- or
  off-policy (DeepSeek-V3.2, arXiv:2512.02556, "unbiased KL estimate"; TRL
  ``use_bias_correction_kl``).

Stop-gradients: ``ref_logprobs`` and ``old_logprobs`` are always stopped; the gradient flows
through ``logprobs`` only (in ``k3_unbiased`` both through ``k3`` and through ``ρ``).

No clamping is applied (verl ``kl_penalty`` clamps ``d`` to ±20 and k3 to ±10 for "low_var_kl").
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rljax.losses import reduce as reduce_lib

KL_ESTIMATORS = ("k1", "k2", "k3", "k3_unbiased")


def kl_penalty(
    logprobs: chex.Array,
    ref_logprobs: chex.Array,
    *,
    estimator: str = "k3",
    old_logprobs: chex.Array | None = None,
    mask: chex.Array | None = None,
) -> chex.Array:
    """Per-token estimate ``k[i, t]`` of KL(π_θ ‖ π_ref) (see the module table for gradients).

    ``d = ref_logprobs − logprobs``; k1 = ``−d``; k2 = ``d²/2``; k3 = ``exp(d) − d − 1``;
    k3_unbiased = ``exp(logprobs − old_logprobs) · k3`` (DeepSeek-V3.2, arXiv:2512.02556).
    Estimators: Schulman 2020; GRPO (arXiv:2402.03300) uses k3 in the loss, PPO-RLHF
    (arXiv:1909.08593) and RLOO (arXiv:2402.14740) use k1 in the reward.

    Args:
      logprobs: ``[B, T]`` log π_θ(y_t) (gradient flows here).
      ref_logprobs: ``[B, T]`` log π_ref(y_t) (stop-gradient).
      estimator: one of ``KL_ESTIMATORS``.
      old_logprobs: ``[B, T]`` log π_old(y_t), the policy that sampled (stop-gradient); required by
        ``k3_unbiased``. For on-policy use pass ``jax.lax.stop_gradient(logprobs)``.
      mask: optional ``[B, T]``; masked positions are set to 0.
    Returns:
      ``[B, T]`` per-token estimate.
    """
    chex.assert_rank([logprobs, ref_logprobs], 2)
    chex.assert_equal_shape([logprobs, ref_logprobs])
    chex.assert_type([logprobs, ref_logprobs], float)
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty: estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if mask is not None:
        chex.assert_equal_shape([logprobs, mask])
        # Zero padded inputs first so garbage there (-inf, NaN) reaches neither value nor gradient.
        valid = mask != 0
        logprobs = jnp.where(valid, logprobs, jnp.zeros_like(logprobs))
        ref_logprobs = jnp.where(valid, ref_logprobs, jnp.zeros_like(ref_logprobs))
        if old_logprobs is not None:
            old_logprobs = jnp.where(valid, old_logprobs, jnp.zeros_like(old_logprobs))
    d = jax.lax.stop_gradient(ref_logprobs) - logprobs
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * jnp.square(d)
    else:
        # exp(d) − 1 − d, with expm1 for accuracy when d is small (the usual case).
        kl = jnp.expm1(d) - d
        if estimator == "k3_unbiased":
            if old_logprobs is None:
                raise ValueError("kl_penalty: estimator='k3_unbiased' needs old_logprobs")
            chex.assert_equal_shape([logprobs, old_logprobs])
            ratio = jnp.exp(logprobs - jax.lax.stop_gradient(old_logprobs))
            kl = ratio * kl
    return kl  # exactly 0 at masked positions: every input there was zeroed


def kl_loss(
    logprobs: chex.Array,
    ref_logprobs: chex.Array,
    mask: chex.Array,
    *,
    estimator: str = "k3",
    old_logprobs: chex.Array | None = None,
    reduction: str = "seq_mean_token_mean",
    num_sequences=None,
    num_tokens=None,
    max_length=None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """KL(π_θ ‖ π_ref) as a stand-alone loss term: ``reduce_tokens(kl_penalty(...), mask)``.

    Multiply by the coefficient yourself (``β = 0.04`` in DeepSeekMath, arXiv:2402.03300), or use
    ``policy_gradient_loss(..., ref_logprobs=..., kl_coef=β)`` which adds ``β·k`` to every token
    before the one reduction. Which estimator gives which gradient: see the module docstring.

    Args:
      logprobs, ref_logprobs, mask: ``[B, T]``.
      estimator, old_logprobs: as in ``kl_penalty``.
      reduction, num_sequences, num_tokens, max_length: as in ``reduce.reduce_tokens``.
    Returns:
      ``(loss, metrics)``; metrics ``kl/loss`` (the reduced value) and ``kl/mean`` (token mean
      over the local valid tokens).
    """
    chex.assert_rank([logprobs, ref_logprobs, mask], 2)
    chex.assert_equal_shape([logprobs, ref_logprobs, mask])
    per_token = kl_penalty(logprobs, ref_logprobs, estimator=estimator, old_logprobs=old_logprobs,
                           mask=mask)
    loss = reduce_lib.reduce_tokens(
        per_token, mask, mode=reduction, num_sequences=num_sequences, num_tokens=num_tokens,
        max_length=max_length,
    )
    metrics = {"kl/loss": loss, "kl/mean": reduce_lib.masked_mean(per_token, mask)}
    return loss, jax.lax.stop_gradient(metrics)
