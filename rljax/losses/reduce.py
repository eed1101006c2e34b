"""Reductions of per-token values ``[B, T]`` to a scalar, implemented once for every loss.

Libraries disagree mostly on how a per-token loss ``ℓ[i, t]`` with mask ``m[i, t]`` becomes a scalar
(TRL ``GRPOTrainer._compute_loss`` ``loss_type``, verl ``core_algos.agg_loss`` ``loss_agg_mode``).
The four modes, for a batch of ``B`` rows:

=========================== ============================================= ==========================
mode                        scalar                                        TRL ``loss_type`` / paper
=========================== ============================================= ==========================
``seq_mean_token_mean``     ``(1/S) Σ_i [Σ_t m ℓ / Σ_t m]``               ``grpo`` (arXiv:2402.03300)
``token_mean``              ``Σ_{i,t} m ℓ / N``                           ``dapo``/``bnpo`` (arXiv:2503.14476)
``seq_mean_token_sum``      ``(1/S) Σ_i Σ_t m ℓ``                         REINFORCE / RLOO on log π(y)
``seq_mean_token_sum_norm`` ``Σ_{i,t} m ℓ / (S · L_max)``                 ``dr_grpo`` (arXiv:2503.20783)
=========================== ============================================= ==========================

``S`` is the number of sequences (rows with at least one valid token), ``N`` the number of valid
tokens and ``L_max`` the Dr. GRPO constant (the maximum completion length). All three are
*global* inputs: when one batch is split into micro-batches (gradient accumulation) or
data-parallel shards, pass the totals of the whole batch and **sum** the per-part values (and
gradients); the sum equals the single-batch value exactly, for every mode. Left as ``None`` they
default to the local counts (``S``: non-empty rows, ``N``: valid tokens, ``L_max``: ``T``).

Masks are binary (bool, int or float 0/1): a position counts iff ``mask != 0``. Masked positions
are selected out with ``jnp.where`` (not multiplied by zero), so garbage or NaN there cannot leak
into the value. An empty row contributes 0 and, by default, is not counted in ``S``, so extra
fully-masked rows change nothing.

Differences from other libraries (documented, deliberate):

* verl ``seq-mean-token-sum-norm`` divides by ``L_max`` only (no row count); we divide by
  ``S · L_max``. TRL ``dr_grpo`` divides by ``B · L_max`` with ``B`` every row of the batch: the
  same when no row is empty (no row whose tokens are all masked, e.g. truncated rows under
  ``mask_truncated``), and otherwise ours is larger by ``B / S``.
* TRL ``grpo`` divides by all ``B`` rows including empty ones (``.mean()``); our default ``S``
  counts non-empty rows (identical when no row is empty).
* To divide by every row as TRL does, a caller passes ``num_sequences=B``; the online algorithms
  do so with ``algorithm.sequence_count: all`` (default ``nonempty``;
  ``rljax.algorithms.policy_gradient.totals``).
"""

from __future__ import annotations

from typing import Any

import chex
import jax.numpy as jnp

REDUCTIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")

Numeric = Any  # python scalar or jax scalar array (may be traced)


def _valid(mask: chex.Array) -> chex.Array:
    return mask != 0


def _at_least_f32(x: chex.Array) -> chex.Array:
    # Sums of bfloat16 per-token values lose digits fast: accumulate in (at least) float32.
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def num_valid_tokens(mask: chex.Array) -> chex.Array:
    """Number of valid tokens ``N = Σ m`` (float32 scalar)."""
    return jnp.sum(_valid(mask), dtype=jnp.float32)


def num_valid_sequences(mask: chex.Array) -> chex.Array:
    """Number of rows ``S`` with at least one valid token (float32 scalar). ``mask``: ``[B, T]``."""
    chex.assert_rank(mask, 2)
    return jnp.sum(jnp.any(_valid(mask), axis=-1), dtype=jnp.float32)


def masked_sum(x: chex.Array, mask: chex.Array, axis=None) -> chex.Array:
    """``Σ m·x`` over ``axis`` (all axes by default); masked entries are selected out, not multiplied."""
    chex.assert_equal_shape([x, mask])
    return jnp.sum(jnp.where(_valid(mask), x, jnp.zeros_like(x)), axis=axis)


def masked_mean(x: chex.Array, mask: chex.Array, *, denominator: Numeric | None = None) -> chex.Array:
    """Mean of ``x`` over valid entries: ``Σ m·x / D``.

    ``D`` is ``denominator`` when given (a global count, so micro-batch values sum to the
    whole-batch value) and otherwise the local ``max(Σ m, 1)`` (0 for an all-masked input).
    Used for the losses' token means and for metrics such as clip fractions.

    Args:
      x: any shape, float.
      mask: same shape as ``x``; nonzero = valid.
      denominator: optional scalar.
    Returns:
      scalar.
    """
    chex.assert_equal_shape([x, mask])
    total = masked_sum(_at_least_f32(x), mask)
    if denominator is None:
        denominator = jnp.maximum(num_valid_tokens(mask), 1.0)
    return total / jnp.asarray(denominator, dtype=total.dtype)


def masked_max(x: chex.Array, mask: chex.Array) -> chex.Array:
    """Largest valid entry of ``x`` (0 if nothing is valid). For metrics."""
    chex.assert_equal_shape([x, mask])
    valid = _valid(mask)
    out = jnp.max(jnp.where(valid, x, -jnp.inf))
    return jnp.where(jnp.any(valid), out, jnp.zeros_like(out))


def masked_min(x: chex.Array, mask: chex.Array) -> chex.Array:
    """Smallest valid entry of ``x`` (0 if nothing is valid). For metrics."""
    chex.assert_equal_shape([x, mask])
    valid = _valid(mask)
    out = jnp.min(jnp.where(valid, x, jnp.inf))
    return jnp.where(jnp.any(valid), out, jnp.zeros_like(out))


def masked_var(x: chex.Array, mask: chex.Array, *, bessel: bool = True) -> chex.Array:
    """Variance of the valid entries of ``x``; Bessel-corrected (``n − 1``) by default.

    Matches verl ``torch_functional.masked_var(unbiased=True)``; with fewer than two valid
    entries the Bessel variance is undefined and 0 is returned instead of NaN.
    """
    chex.assert_equal_shape([x, mask])
    n = num_valid_tokens(mask).astype(x.dtype)
    mean = masked_sum(x, mask) / jnp.maximum(n, 1.0)
    sq = masked_sum(jnp.square(x - mean), mask)
    dof = n - 1.0 if bessel else n
    return jnp.where(dof > 0, sq / jnp.maximum(dof, 1.0), jnp.zeros_like(sq))


def reduce_tokens(
    per_token: chex.Array,
    mask: chex.Array,
    *,
    mode: str,
    num_sequences: Numeric | None = None,
    num_tokens: Numeric | None = None,
    max_length: Numeric | None = None,
) -> chex.Array:
    """Reduce a per-token quantity ``ℓ`` ``[B, T]`` to a scalar (see the module table).

    * ``seq_mean_token_mean``: ``(1/S) Σ_i Σ_t m ℓ / max(Σ_t m, 1)`` — GRPO, arXiv:2402.03300.
    * ``token_mean``: ``Σ m ℓ / N`` — DAPO, arXiv:2503.14476.
    * ``seq_mean_token_sum``: ``(1/S) Σ_i Σ_t m ℓ``.
    * ``seq_mean_token_sum_norm``: ``Σ m ℓ / (S · L_max)`` — Dr. GRPO, arXiv:2503.20783.

    Args:
      per_token: ``[B, T]`` float.
      mask: ``[B, T]``, nonzero = the token counts.
      mode: one of ``REDUCTIONS``.
      num_sequences: global ``S`` (default: local count of non-empty rows, at least 1).
      num_tokens: global ``N`` (default: local ``max(Σ m, 1)``); only ``token_mean`` uses it.
      max_length: ``L_max`` (default ``T``); only ``seq_mean_token_sum_norm`` uses it.
    Returns:
      scalar, float32 (or float64) even for bfloat16 input. For micro-batches with global
      counts, ``Σ_parts reduce(part) == reduce(whole)``.
    """
    chex.assert_rank([per_token, mask], 2)
    chex.assert_equal_shape([per_token, mask])
    chex.assert_type(per_token, float)
    if mode not in REDUCTIONS:
        raise ValueError(f"reduce_tokens: mode must be one of {REDUCTIONS}, got {mode!r}")
    per_token = _at_least_f32(per_token)
    dtype = per_token.dtype

    def _count(given, local):
        if given is None:
            return jnp.maximum(local, 1.0).astype(dtype)
        return jnp.asarray(given, dtype=dtype)

    if mode == "token_mean":
        return masked_sum(per_token, mask) / _count(num_tokens, num_valid_tokens(mask))
    if mode == "seq_mean_token_mean":
        row_sum = masked_sum(per_token, mask, axis=-1)  # [B]
        row_len = jnp.sum(_valid(mask), axis=-1, dtype=dtype)  # [B]
        row_mean = row_sum / jnp.maximum(row_len, 1.0)
        return jnp.sum(row_mean) / _count(num_sequences, num_valid_sequences(mask))
    if mode == "seq_mean_token_sum":
        return masked_sum(per_token, mask) / _count(num_sequences, num_valid_sequences(mask))
    # seq_mean_token_sum_norm
    length = per_token.shape[-1] if max_length is None else max_length
    denom = _count(num_sequences, num_valid_sequences(mask)) * jnp.asarray(length, dtype=dtype)
    return masked_sum(per_token, mask) / denom
