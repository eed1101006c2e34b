"""PPO value-head loss (clipped) and the explained-variance diagnostic."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rljax.losses import reduce as reduce_lib


def explained_variance(values: chex.Array, returns: chex.Array, mask: chex.Array) -> chex.Array:
    """``1 − Var[R − V] / Var[R]`` over the valid tokens; NaN when ``Var[R] = 0``.

    1 = perfect prediction, 0 = no better than a constant, < 0 = worse than a constant
    (cleanrl ``ppo.py``: ``np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y``).
    The population variance is used; the Bessel factor would cancel in the ratio.

    Args:
      values, returns, mask: same shape (``[B, T]`` or ``[B]``).
    Returns:
      scalar.
    """
    chex.assert_equal_shape([values, returns, mask])
    chex.assert_type([values, returns], float)
    var_returns = reduce_lib.masked_var(returns, mask, bessel=False)
    var_error = reduce_lib.masked_var(returns - values, mask, bessel=False)
    safe = jnp.where(var_returns > 0, var_returns, jnp.ones_like(var_returns))
    return jnp.where(var_returns > 0, 1.0 - var_error / safe, jnp.full_like(var_returns, jnp.nan))


def value_loss(
    values: chex.Array,
    old_values: chex.Array,
    returns: chex.Array,
    mask: chex.Array,
    *,
    clip_range=0.2,
    reduction: str = "token_mean",
    num_sequences=None,
    num_tokens=None,
    max_length=None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """Clipped value loss of PPO (arXiv:1707.06347; as in the RLHF PPO of arXiv:2203.02155)::

        V_clip = V_old + clip(V − V_old, −c_v, c_v)
        ℓ_t    = ½ · max((V − R)², (V_clip − R)²)          (½ (V − R)² when clip_range is None)
        loss   = reduce_tokens(ℓ, mask, mode=reduction)     default: mean over valid tokens

    Matches verl ``core_algos.compute_value_loss`` and TRL ``PPOTrainer`` (``vf_loss``). The total
    PPO loss is ``L_π + c_vf · L_V``; multiply by ``c_vf`` yourself.

    Stop-gradients: ``old_values`` and ``returns``; the gradient flows through ``values``.

    Args:
      values: ``[B, T]`` current value-head predictions.
      old_values: ``[B, T]`` predictions at sampling time.
      returns: ``[B, T]`` targets (GAE returns).
      mask: ``[B, T]``.
      clip_range: ``c_v`` or None (no clipping).
      reduction, num_sequences, num_tokens, max_length: see ``reduce.reduce_tokens``.
    Returns:
      ``(loss, metrics)``; metrics ``value/loss``, ``value/clip_frac`` (fraction of valid tokens
      where the clipped term is the larger), ``value/explained_variance``, ``value/mean``,
      ``value/returns_mean``.
    """
    arrays = [values, old_values, returns, mask]
    chex.assert_rank(arrays, 2)
    chex.assert_equal_shape(arrays)
    chex.assert_type([values, old_values, returns], float)
    valid = mask != 0
    values = jnp.where(valid, values, jnp.zeros_like(values))
    old_values = jax.lax.stop_gradient(jnp.where(valid, old_values, jnp.zeros_like(old_values)))
    returns = jax.lax.stop_gradient(jnp.where(valid, returns, jnp.zeros_like(returns)))

    unclipped = jnp.square(values - returns)
    if clip_range is None:
        per_token = 0.5 * unclipped
        clip_frac = jnp.zeros((), values.dtype)
    else:
        values_clipped = old_values + jnp.clip(values - old_values, -clip_range, clip_range)
        clipped = jnp.square(values_clipped - returns)
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        clip_frac = reduce_lib.masked_mean((clipped > unclipped).astype(values.dtype), mask)
    loss = reduce_lib.reduce_tokens(per_token, mask, mode=reduction, num_sequences=num_sequences,
                                    num_tokens=num_tokens, max_length=max_length)
    metrics = {
        "value/loss": loss,
        "value/clip_frac": clip_frac,
        "value/explained_variance": explained_variance(values, returns, mask),
        "value/mean": reduce_lib.masked_mean(values, mask),
        "value/returns_mean": reduce_lib.masked_mean(returns, mask),
    }
    return loss, jax.lax.stop_gradient(metrics)
