"""Policy-gradient losses: the clipped surrogate (PPO / GRPO / DAPO / GSPO) and plain REINFORCE.

Both take per-token ``[B, T]`` arrays and a ``mask``, build a per-token loss ``ℓ[i, t]`` and reduce
it once with ``reduce.reduce_tokens`` (so micro-batches with global counts sum to the whole-batch
value and gradient). Sequence-level advantages are broadcast to ``[B, T]`` by the caller
(``rljax.advantages.broadcast_to_tokens``).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rljax.losses import kl as kl_lib
from rljax.losses import off_policy as off_policy_lib
from rljax.losses import reduce as reduce_lib

RATIO_LEVELS = ("token", "sequence")


def _check_coef(name: str, coef, given) -> None:
    # Coefficients may be traced (vmapped hyperparameters), so only concrete values are checked.
    if isinstance(coef, (int, float)) and coef != 0 and given is None:
        raise ValueError(f"{name} is {coef} but the array it multiplies was not given")


def _zero_padding(x, valid):
    # Padded positions may hold anything (even -inf or NaN); zero them before any arithmetic so
    # that neither the value nor the gradient (e.g. inf * 0 in a backward pass) can pick them up.
    return None if x is None else jnp.where(valid, x, jnp.zeros_like(x))


def _check_correction(sampling_logprobs, tis_cap, off_policy_correction, correction_bounds) -> None:
    if tis_cap is not None and sampling_logprobs is None:
        raise ValueError("tis_cap given without sampling_logprobs")
    if off_policy_correction == "none":
        return
    if off_policy_correction not in off_policy_lib.OFF_POLICY_MODES:
        raise ValueError(f"off_policy_correction must be 'none' or one of {off_policy_lib.OFF_POLICY_MODES}, "
                         f"got {off_policy_correction!r}")
    if sampling_logprobs is None:
        raise ValueError(f"off_policy_correction={off_policy_correction!r} given without sampling_logprobs")
    if tis_cap is not None:
        raise ValueError(f"tis_cap and off_policy_correction={off_policy_correction!r} both given: tis_cap=c is "
                         "off_policy_correction='token_tis' with correction_bounds=(0, c); give one of them")
    off_policy_lib.check_bounds(correction_bounds, name="correction_bounds")


def _correction_weights(old, sampling_logprobs, mask, tis_cap, off_policy_correction, correction_bounds):
    """``(w, metrics)``: the off-policy weights of ``off_policy_correction`` and their metrics, or
    (``"none"`` with ``sampling_logprobs`` given) truncated IS ``min(π_old/μ, tis_cap)`` with its
    ``policy/tis_weight_*`` metrics (no cap if ``tis_cap`` is None); ``(None, {})`` without a sampler."""
    if off_policy_correction != "none":
        return off_policy_lib.off_policy_weights(old, sampling_logprobs, mask, mode=off_policy_correction,
                                                 bounds=correction_bounds)
    if sampling_logprobs is None:
        return None, {}
    hi = jnp.inf if tis_cap is None else tis_cap
    w, m = off_policy_lib.off_policy_weights(old, sampling_logprobs, mask, mode="token_tis", bounds=(0.0, hi))
    return w, {"policy/tis_weight_mean": m["off_policy/weight_mean"],
               "policy/tis_weight_max": m["off_policy/weight_max"]}


def _row_fraction_extreme(flags, valid, extreme):
    """``extreme`` (``jnp.min`` / ``jnp.max``) over rows with a valid token of each row's fraction
    of valid tokens where ``flags`` is 1; 0 when no row has one (as ``masked_min``)."""
    counts = jnp.sum(valid, axis=-1, dtype=flags.dtype)  # [B]
    fractions = jnp.sum(jnp.where(valid, flags, 0), axis=-1) / jnp.maximum(counts, 1)
    has_tokens = counts > 0
    fill = jnp.inf if extreme is jnp.min else -jnp.inf
    out = extreme(jnp.where(has_tokens, fractions, fill))
    return jnp.where(jnp.any(has_tokens), out, jnp.zeros_like(out))


def policy_gradient_loss(
    logprobs: chex.Array,
    old_logprobs: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    *,
    ratio_level: str = "token",
    epsilon_low=0.2,
    epsilon_high=0.2,
    dual_clip=None,
    sampling_logprobs: chex.Array | None = None,
    tis_cap=None,
    off_policy_correction: str = "none",
    correction_bounds=(0.5, 2.0),
    entropy: chex.Array | None = None,
    entropy_coef=0.0,
    ref_logprobs: chex.Array | None = None,
    kl_coef=0.0,
    kl_estimator: str = "k3",
    reduction: str = "seq_mean_token_mean",
    num_sequences=None,
    num_tokens=None,
    max_length=None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """Clipped surrogate policy loss (PPO, arXiv:1707.06347; GRPO, arXiv:2402.03300).

    Per token, with ``A`` the advantage and ``ρ`` the importance ratio::

        ρ        = exp(logp − old)                                     ratio_level="token"
        ρ_i      = exp(Σ_t m (logp − old) / Σ_t m)                     ratio_level="sequence" (GSPO)
        ℓ_pg     = −min(ρ A, clip(ρ, 1 − ε_low, 1 + ε_high) A)
        ℓ_pg     = min(ℓ_pg, −c A)        where A < 0                  dual clip (arXiv:1912.09729)
        ℓ_pg     = w · ℓ_pg,   w = min(exp(old − sampling), tis_cap)   truncated IS (sampler ≠ old)
        ℓ_pg     = w · ℓ_pg,   w = off_policy_weights(old, sampling)   off_policy_correction given
        ℓ        = ℓ_pg − c_H · H_t + β · k_t                           entropy bonus, KL in the loss
        loss     = reduce_tokens(ℓ, mask, mode=reduction, ...)

    * Clip-higher (DAPO, arXiv:2503.14476) is ``epsilon_high > epsilon_low`` (0.28 vs 0.2).
    * GSPO (arXiv:2507.18071) uses one ratio per sequence. It is implemented in the paper's
      GSPO-token form ``s_{i,t} = sg[s_i] · π(y_t)/sg[π(y_t)]``, whose value is ``s_i`` on every
      token and which equals GSPO's value and gradient when ``A`` is constant within a row (as in
      verl ``compute_policy_loss_gspo``). Use it with ``reduction="seq_mean_token_mean"``; a token
      sum weights each sequence by its length (TRL issue 3823).
    * Truncated importance sampling (Yao et al., "Your efficient RL framework secretly brings you
      off-policy RL training", 2025; TRL ``vllm_importance_sampling_correction``): when the
      sampler's log-probs ``sampling_logprobs`` differ from ``old_logprobs``, the policy term is
      multiplied by ``min(π_old/μ, tis_cap)`` (no cap if ``tis_cap`` is None). The weight is a
      constant; it does not multiply the entropy or KL terms.
    * Off-policy corrections: ``off_policy_correction`` (``"token_tis"``, ``"seq_tis"``,
      ``"token_mask"``, ``"seq_mask"``) with ``correction_bounds`` ``(lo, hi)`` multiplies the policy
      term by ``rljax.losses.off_policy.off_policy_weights(old, sampling_logprobs, mask, ...)``
      (truncated or masked importance weights of ``π_old/μ``, token or sequence level) and adds its
      metrics. ``tis_cap=c`` is the same as ``"token_tis"`` with bounds ``(0, c)``; giving both is
      refused.
    * KL in the loss (GRPO): ``ref_logprobs`` given adds ``kl_coef · kl_penalty(logp, ref,
      estimator=kl_estimator, old_logprobs=old)`` to every token before the single reduction
      (DeepSeekMath: k3, β = 0.04). ``"k3_unbiased"`` weights k3 by ``π_θ/π_old``
      (DeepSeek-V3.2, arXiv:2512.02556). A ``"k1"`` term in the loss has zero expected
      gradient on-policy — use k1 as a reward penalty instead (see ``rljax.losses.kl``).
    * Entropy bonus: ``entropy`` ``[B, T]`` given subtracts ``entropy_coef · H_t`` per token; the
      gradient flows through ``entropy``.

    Gradient contract and stop-gradients: ``old_logprobs``, ``advantages``, ``sampling_logprobs``
    and ``ref_logprobs`` are stopped; the gradient flows through ``logprobs`` (and ``entropy``).
    On-policy (``ρ = 1``) with ``token_mean`` the gradient is ``−A·m/N`` per token; a clipped
    token (``ρ > 1 + ε_high, A > 0`` or ``ρ < 1 − ε_low, A < 0``) gets zero gradient.

    Args:
      logprobs: ``[B, T]`` log π_θ of the sampled tokens (temperature-scaled logits).
      old_logprobs: ``[B, T]`` log π_old (the policy the ratio is taken against).
      advantages: ``[B, T]``.
      mask: ``[B, T]``, nonzero = token counts.
      ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
      epsilon_low, epsilon_high: clip range ``[1 − ε_low, 1 + ε_high]``.
      dual_clip: ``c`` (> 1, typically 3) or None.
      sampling_logprobs: ``[B, T]`` log μ of the sampler (e.g. inference engine) or None.
      tis_cap: truncation of the importance weight (e.g. 2.0) or None.
      off_policy_correction: ``"none"`` or one of ``off_policy.OFF_POLICY_MODES`` (needs
        ``sampling_logprobs``); correction_bounds: its ``(lo, hi)``.
      entropy: ``[B, T]`` per-token entropy ``H_t`` or None; entropy_coef: ``c_H``.
      ref_logprobs: ``[B, T]`` log π_ref or None; kl_coef: ``β``; kl_estimator: see ``kl.py``.
      reduction, num_sequences, num_tokens, max_length: see ``reduce.reduce_tokens``.

    Returns:
      ``(loss, metrics)``. Metrics (scalars; means over the local valid tokens):
      ``policy/loss`` (= loss), ``policy/pg_loss`` (the reduced clipped term alone),
      ``policy/clip_frac_low`` (``ρ < 1 − ε_low`` and ``A < 0``), ``policy/clip_frac_high``
      (``ρ > 1 + ε_high`` and ``A > 0``), ``policy/ratio_mean``, ``policy/ratio_min``,
      ``policy/ratio_max``, ``policy/approx_kl`` (k3 estimate of KL(π_old‖π_θ),
      ``(ρ_t − 1) − log ρ_t`` with the token ratio, as cleanrl ``ppo.py``),
      ``policy/clip_frac_low_seq_min`` / ``policy/clip_frac_high_seq_max`` (the smallest / largest
      over rows with a valid token of that row's low / high clipped fraction: TRL ``GRPOTrainer``'s
      ``clip_ratio/low_min`` / ``clip_ratio/high_max``); when enabled:
      ``policy/dual_clip_frac``, ``policy/entropy``, ``kl/mean``, ``policy/tis_weight_mean``,
      ``policy/tis_weight_max`` (``tis_cap`` / sampler without a correction), the
      ``off_policy.OFF_POLICY_METRICS`` (with ``off_policy_correction``).
    """
    arrays = [logprobs, old_logprobs, advantages, mask]
    chex.assert_rank(arrays, 2)
    chex.assert_equal_shape(arrays)
    chex.assert_type([logprobs, old_logprobs, advantages], float)
    for optional in (sampling_logprobs, entropy, ref_logprobs):
        if optional is not None:
            chex.assert_equal_shape([logprobs, optional])
            chex.assert_type(optional, float)
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if isinstance(dual_clip, (int, float)) and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3), got {dual_clip}")
    _check_correction(sampling_logprobs, tis_cap, off_policy_correction, correction_bounds)
    _check_coef("entropy_coef", entropy_coef, entropy)
    _check_coef("kl_coef", kl_coef, ref_logprobs)

    valid = mask != 0
    logprobs, entropy = _zero_padding(logprobs, valid), _zero_padding(entropy, valid)
    old = jax.lax.stop_gradient(_zero_padding(old_logprobs, valid))
    adv = jax.lax.stop_gradient(_zero_padding(advantages, valid))
    sampling_logprobs = _zero_padding(sampling_logprobs, valid)
    ref_logprobs = _zero_padding(ref_logprobs, valid)

    token_log_ratio = logprobs - old
    if ratio_level == "token":
        log_ratio = token_log_ratio
    else:
        seq_len = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True, dtype=logprobs.dtype), 1.0)
        seq_log_ratio = jnp.sum(token_log_ratio, axis=-1, keepdims=True) / seq_len  # [B, 1]
        # GSPO-token: value s_i on every token, gradient through the token's own log-prob.
        log_ratio = (logprobs - jax.lax.stop_gradient(logprobs)
                     + jax.lax.stop_gradient(seq_log_ratio))
    ratio = jnp.exp(log_ratio)

    clipped_ratio = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped_ratio
    pg = jnp.maximum(pg_unclipped, pg_clipped)
    metrics = {}
    if dual_clip is not None:
        pg_dual = -adv * dual_clip
        negative = adv < 0
        metrics["policy/dual_clip_frac"] = reduce_lib.masked_mean(
            (negative & (pg > pg_dual)).astype(logprobs.dtype), mask)
        pg = jnp.where(negative, jnp.minimum(pg, pg_dual), pg)
    w, correction_metrics = _correction_weights(old, sampling_logprobs, mask, tis_cap, off_policy_correction,
                                                correction_bounds)
    if w is not None:
        pg = pg * w
        metrics.update(correction_metrics)

    per_token = pg
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy
        metrics["policy/entropy"] = reduce_lib.masked_mean(entropy, mask)
    if ref_logprobs is not None:
        kl = kl_lib.kl_penalty(logprobs, ref_logprobs, estimator=kl_estimator, old_logprobs=old)
        per_token = per_token + kl_coef * kl
        metrics["kl/mean"] = reduce_lib.masked_mean(kl, mask)

    counts = dict(mode=reduction, num_sequences=num_sequences, num_tokens=num_tokens,
                  max_length=max_length)
    loss = reduce_lib.reduce_tokens(per_token, mask, **counts)

    f = logprobs.dtype
    low_clipped = ((ratio < 1.0 - epsilon_low) & (adv < 0)).astype(f)
    high_clipped = ((ratio > 1.0 + epsilon_high) & (adv > 0)).astype(f)
    metrics.update({
        "policy/loss": loss,
        "policy/pg_loss": reduce_lib.reduce_tokens(pg, mask, **counts),
        "policy/clip_frac_low": reduce_lib.masked_mean(low_clipped, mask),
        "policy/clip_frac_high": reduce_lib.masked_mean(high_clipped, mask),
        # TRL's clip_ratio/low_min and high_max: the extreme over rows of each row's clipped fraction
        "policy/clip_frac_low_seq_min": _row_fraction_extreme(low_clipped, valid, jnp.min),
        "policy/clip_frac_high_seq_max": _row_fraction_extreme(high_clipped, valid, jnp.max),
        "policy/ratio_mean": reduce_lib.masked_mean(ratio, mask),
        "policy/ratio_min": reduce_lib.masked_min(ratio, mask),
        "policy/ratio_max": reduce_lib.masked_max(ratio, mask),
        "policy/approx_kl": reduce_lib.masked_mean(
            jnp.expm1(token_log_ratio) - token_log_ratio, mask),
    })
    return loss, jax.lax.stop_gradient(metrics)


def reinforce_loss(
    logprobs: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    *,
    sampling_logprobs: chex.Array | None = None,
    tis_cap=None,
    off_policy_correction: str = "none",
    correction_bounds=(0.5, 2.0),
    entropy: chex.Array | None = None,
    entropy_coef=0.0,
    ref_logprobs: chex.Array | None = None,
    kl_coef=0.0,
    kl_estimator: str = "k3",
    reduction: str = "seq_mean_token_sum",
    num_sequences=None,
    num_tokens=None,
    max_length=None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """REINFORCE with a baseline, no ratio: ``ℓ = −w · A · logp (− c_H H + β k)``, then reduced.

    The form used by RLOO (Ahmadian et al., arXiv:2402.14740; Kool et al. 2019): the gradient is
    ``−A ∇log π(y)``. With the default ``reduction="seq_mean_token_sum"`` and a sequence advantage
    broadcast to every token, ``loss = −(1/S) Σ_i A_i log π(y_i)`` — the paper's estimator
    (``log π(y)`` is the sum of token log-probs). Other reductions are allowed for ablations.

    ``w = sg(min(π_θ/μ, tis_cap))`` when ``sampling_logprobs`` (the sampler μ) is given, else 1;
    with ``off_policy_correction`` ``w = off_policy_weights(sg(logp), μ, ...)``: there is no
    ``π_old`` without a ratio, so the weights are taken against the policy being trained (verl's
    "bypass" mode; it equals ``π_old`` on the one update per batch that REINFORCE allows).
    ``advantages``, ``sampling_logprobs`` and ``ref_logprobs`` are stop-gradient; the KL term
    (``ref_logprobs`` given) is as in ``policy_gradient_loss`` with ``old = μ`` (or
    ``sg(logp)`` on-policy), so ``"k3_unbiased"`` has the right on-policy gradient.

    Args:
      logprobs, advantages, mask: ``[B, T]``.
      sampling_logprobs, tis_cap, off_policy_correction, correction_bounds, entropy, entropy_coef,
      ref_logprobs, kl_coef, kl_estimator, reduction, num_sequences, num_tokens, max_length: as in
      ``policy_gradient_loss``.
    Returns:
      ``(loss, metrics)``; metrics ``policy/loss``, ``policy/pg_loss``; when enabled
      ``policy/entropy``, ``kl/mean``, ``policy/tis_weight_mean``, ``policy/tis_weight_max``, the
      ``off_policy.OFF_POLICY_METRICS``.
    """
    arrays = [logprobs, advantages, mask]
    chex.assert_rank(arrays, 2)
    chex.assert_equal_shape(arrays)
    chex.assert_type([logprobs, advantages], float)
    for optional in (sampling_logprobs, entropy, ref_logprobs):
        if optional is not None:
            chex.assert_equal_shape([logprobs, optional])
            chex.assert_type(optional, float)
    _check_correction(sampling_logprobs, tis_cap, off_policy_correction, correction_bounds)
    _check_coef("entropy_coef", entropy_coef, entropy)
    _check_coef("kl_coef", kl_coef, ref_logprobs)

    valid = mask != 0
    logprobs, entropy = _zero_padding(logprobs, valid), _zero_padding(entropy, valid)
    adv = jax.lax.stop_gradient(_zero_padding(advantages, valid))
    sampling_logprobs = _zero_padding(sampling_logprobs, valid)
    ref_logprobs = _zero_padding(ref_logprobs, valid)
    metrics = {}
    pg = -adv * logprobs
    w, correction_metrics = _correction_weights(logprobs, sampling_logprobs, mask, tis_cap, off_policy_correction,
                                                correction_bounds)
    if w is not None:
        pg = pg * w
        metrics.update(correction_metrics)
        behaviour = jax.lax.stop_gradient(sampling_logprobs)
    else:
        behaviour = jax.lax.stop_gradient(logprobs)
    per_token = pg
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy
        metrics["policy/entropy"] = reduce_lib.masked_mean(entropy, mask)
    if ref_logprobs is not None:
        kl = kl_lib.kl_penalty(logprobs, ref_logprobs, estimator=kl_estimator,
                               old_logprobs=behaviour)
        per_token = per_token + kl_coef * kl
        metrics["kl/mean"] = reduce_lib.masked_mean(kl, mask)
    counts = dict(mode=reduction, num_sequences=num_sequences, num_tokens=num_tokens,
                  max_length=max_length)
    loss = reduce_lib.reduce_tokens(per_token, mask, **counts)
    metrics["policy/loss"] = loss
    metrics["policy/pg_loss"] = reduce_lib.reduce_tokens(pg, mask, **counts)
    return loss, jax.lax.stop_gradient(metrics)
