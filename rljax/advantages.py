"""Advantage estimators and reward shaping: pure functions of arrays, no gradients needed.

Sequence-level estimators take rewards ``[B]`` laid out group-contiguously (the ``G`` completions
of one prompt are adjacent: rows ``g·G … g·G + G − 1``, as TRL ``rewards.view(-1, G)``) and return
``[B]``; broadcast to tokens with ``broadcast_to_tokens``. Token-level ones take ``[B, T]`` with a
``mask`` (nonzero = token counts). Everything here is wrapped in ``stop_gradient``: advantages
and shaped rewards are constants to the loss.

Missing rewards (a reward function that raised on one sample) are marked ``valid[i] = False``:
they are left out of every statistic and get advantage 0, as TRL does with its NaN rewards
(``GRPOTrainer``/``RLOOTrainer`` "unscorable" completions).

Two numerical guarantees hold for every estimator here:

* A flat set of values (a group whose valid rewards are all equal; a whitened batch whose valid
  entries are all equal) gives advantages of exactly 0.0. The float32 mean ``Σ R / n`` of equal
  non-dyadic rewards is inexact, so ``R − mean`` is ±1 ulp instead of 0, and dividing by
  ``std + eps`` (std ≈ 1 ulp too) inflates it: eight rewards of 0.1 or 0.3 gave advantages up to
  7e-5 / 3e-4 with ``eps = 1e-4``, 0.007 / 0.03 with ``1e-6`` and 0.83 / 0.91 with ``1e-9``, and
  three rewards of 1e6 + 0.1 gave 0.82 with any eps. A group with no learning signal must not push
  the policy, so flat sets are detected (``max == min`` over the valid entries) and set to 0 with
  ``jnp.where``. Making ``R − mean`` exact instead is not possible in general (the rounded mean of
  equal values need not equal them), and a detection is one reduction the size of the rewards.
* Means and variances are computed on the values divided by a power of two near their largest
  magnitude (``_pow2_scale``), so squares cannot overflow float32: rewards differing by 1e19 used
  to overflow the variance (``Σ (R − mean)² ≈ 1e38·G``) and give advantages 0. Dividing by a power
  of two is exact, so the results are bitwise those of the plain formula whenever it does not
  overflow (or underflow into subnormals).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rljax.losses import kl as kl_lib

GROUP_SCALES = ("group", "batch", "none")


def _grouped(rewards, valid, group_size):
    chex.assert_rank(rewards, 1)
    chex.assert_type(rewards, float)
    (batch,) = rewards.shape
    if group_size < 1 or batch % group_size:
        raise ValueError(f"batch size {batch} is not a multiple of group_size {group_size}")
    if valid is None:
        valid = jnp.ones(rewards.shape, dtype=bool)
    chex.assert_equal_shape([rewards, valid])
    valid = valid.astype(bool)
    r = jnp.where(valid, rewards, jnp.zeros_like(rewards))  # missing rewards may be NaN
    return r.reshape(-1, group_size), valid.reshape(-1, group_size)


def _pow2_scale(x, valid, axis=None):
    """A power of two ``s`` with ``s ≤ max |x| < 2s`` over the valid entries (1 where there are none,
    or all are 0), reduced over ``axis`` with dims kept: ``x / s`` is exact and lies in (−2, 2)."""
    biggest = jnp.max(jnp.where(valid, jnp.abs(x), jnp.zeros_like(x)), axis=axis, keepdims=True)
    _, exponent = jnp.frexp(biggest)  # biggest = f · 2^exponent, f in [0.5, 1)
    # 2^(exponent − 1), not 2^exponent: the latter overflows to inf for values above 2^127
    return jnp.where(biggest > 0, jnp.ldexp(jnp.ones_like(biggest), exponent - 1), jnp.ones_like(biggest))


def _flat(x, valid, axis=None):
    """True where the valid entries of ``x`` (over ``axis``, dims kept) are all equal, or absent."""
    hi = jnp.max(jnp.where(valid, x, -jnp.inf), axis=axis, keepdims=True)
    lo = jnp.min(jnp.where(valid, x, jnp.inf), axis=axis, keepdims=True)
    return ~(hi > lo)


def _scaled_mean_var(x, valid, *, axis, bessel: bool):
    """``(mean, var / s², s)`` of the valid entries of ``x`` over ``axis`` (dims kept), ``s`` from
    ``_pow2_scale``; the variance is returned in units of ``s²`` (``std = s · sqrt(var)``), so it
    cannot overflow. Bitwise the plain mean and variance whenever those do not overflow."""
    s = _pow2_scale(x, valid, axis)
    xs = jnp.where(valid, x / s, jnp.zeros_like(x))
    n = jnp.sum(valid, axis=axis, keepdims=True, dtype=x.dtype)
    mean_s = jnp.sum(xs, axis=axis, keepdims=True) / jnp.maximum(n, 1.0)
    sq = jnp.sum(jnp.square(jnp.where(valid, xs - mean_s, jnp.zeros_like(xs))), axis=axis, keepdims=True)
    dof = n - 1.0 if bessel else n
    var_s = jnp.where(dof > 0, sq / jnp.maximum(dof, 1.0), jnp.zeros_like(sq))
    return mean_s * s, var_s, s


def broadcast_to_tokens(sequence_values: chex.Array, mask: chex.Array) -> chex.Array:
    """``[B]`` per-sequence values → ``[B, T]``: the value on every valid token, 0 elsewhere."""
    chex.assert_rank([sequence_values, mask], [1, 2])
    chex.assert_equal_shape_prefix([sequence_values, mask], 1)
    values = jnp.broadcast_to(sequence_values[:, None], mask.shape)
    return jnp.where(mask != 0, values, jnp.zeros_like(values))


def group_advantages(
    rewards: chex.Array,
    *,
    group_size: int,
    scale: str = "group",
    bessel: bool = True,
    eps=1e-4,
    valid: chex.Array | None = None,
) -> chex.Array:
    """Group-normalised outcome advantages of GRPO (DeepSeekMath, arXiv:2402.03300)::

        A_i = (R_i − mean_g R) / (std R + eps)       scale="group": std over the group
                                                     scale="batch": std over the whole batch
        A_i =  R_i − mean_g R                        scale="none"   (Dr. GRPO, arXiv:2503.20783)

    Defaults follow TRL ``GRPOTrainer`` (``scale_rewards``, Bessel-corrected ``nanstd``,
    ``eps = 1e-4``); verl ``compute_grpo_outcome_advantage`` uses ``torch.std`` (also Bessel) and
    ``eps = 1e-6``. ``bessel=False`` uses the population std. Means and stds are over the valid
    members only; a group with one valid member has ``R − mean = 0`` so advantage 0 (TRL; verl
    instead uses mean 0, std 1 for a singleton group). Missing rewards get 0. A group whose valid
    rewards are all equal gets exactly 0 for every ``scale`` (see the module docstring), and the
    statistics do not overflow for large rewards.

    Args:
      rewards: ``[B]`` scalar rewards, group-contiguous, ``B = num_prompts · group_size``.
      group_size: ``G``.
      scale: ``"group"``, ``"batch"`` or ``"none"``.
      bessel: divide the variance by ``n − 1`` (True) or ``n``.
      eps: added to the std.
      valid: optional ``[B]`` bool, False = reward missing.
    Returns:
      ``[B]`` advantages.
    """
    if scale not in GROUP_SCALES:
        raise ValueError(f"group_advantages: scale must be one of {GROUP_SCALES}, got {scale!r}")
    r, v = _grouped(rewards, valid, group_size)  # [P, G]
    mean, _, _ = _scaled_mean_var(r, v, axis=1, bessel=bessel)  # [P, 1]
    centred = jnp.where(v, r - mean, jnp.zeros_like(r))
    if scale == "none":
        adv = centred
    else:
        if scale == "group":
            _, var_s, s = _scaled_mean_var(r, v, axis=1, bessel=bessel)  # [P, 1]
        else:  # batch: variance of all valid rewards around the batch mean (TRL scale_rewards="batch")
            _, var_s, s = _scaled_mean_var(r, v, axis=None, bessel=bessel)
        adv = centred / (s * jnp.sqrt(var_s) + eps)
    # flat group -> exactly 0 (module docstring: ±1-ulp centred values divided by a ~1-ulp std)
    adv = jnp.where(_flat(r, v, axis=1), jnp.zeros_like(adv), adv)
    return jax.lax.stop_gradient(adv.reshape(-1))


def rloo_advantages(
    rewards: chex.Array, *, group_size: int, valid: chex.Array | None = None
) -> chex.Array:
    """REINFORCE leave-one-out advantages (Ahmadian et al., arXiv:2402.14740; Kool et al. 2019)::

        A_i = R_i − (Σ_{j ∈ g, j ≠ i} R_j) / (n_g − 1)

    over the ``n_g`` valid members of the group (TRL ``RLOOTrainer``: nansum over scorable
    siblings, divisor ``count − 1``); ``A_i = 0`` for missing rewards and for groups with fewer
    than two valid members, and exactly 0 for a group whose valid rewards are all equal.
    Equivalently ``A_i = n/(n−1) · (R_i − mean_g R)`` (verl
    ``compute_rloo_outcome_advantage``).

    Args:
      rewards: ``[B]`` group-contiguous; group_size: ``G``; valid: optional ``[B]`` bool.
    Returns:
      ``[B]`` advantages.
    """
    r, v = _grouped(rewards, valid, group_size)
    n = jnp.sum(v, axis=1, keepdims=True, dtype=r.dtype)
    s = _pow2_scale(r, v, axis=1)  # the sum in units of s cannot overflow; exact scaling
    rs = r / s
    baseline = (jnp.sum(rs, axis=1, keepdims=True) - rs) / jnp.maximum(n - 1.0, 1.0)
    keep = v & (n > 1) & ~_flat(r, v, axis=1)  # flat group -> exactly 0 (module docstring)
    adv = jnp.where(keep, (rs - baseline) * s, jnp.zeros_like(r))
    return jax.lax.stop_gradient(adv.reshape(-1))


def moving_average_baseline_advantages(
    rewards: chex.Array, mean: chex.Array, count: chex.Array, *, decay=None, valid: chex.Array | None = None
) -> tuple[chex.Array, chex.Array, chex.Array]:
    """REINFORCE with a moving-average baseline (Williams 1992; the "vanilla policy gradient" of
    Ahmadian et al., arXiv:2402.14740, §3.2, Table 1): the baseline is carried **across steps**, so
    a sample's advantage does not depend on the other samples of its batch::

        b     = m                        (m: the baseline after the previous steps)
              = mean_batch R             on the first step (count = 0: no history yet)
        A_i   = R_i − b                  (valid rows; 0 for missing rewards)
        m'    = b + w · (mean_batch R − b)
        w     = n_batch / (count + n_batch)     decay None: the mean of every reward so far (the paper's b_MA)
              = 1 − decay                        decay in [0, 1): an exponential moving average
        count' = count + n_batch

    The update comes after the advantages, so ``b`` is a constant with respect to this batch's
    samples (an unbiased gradient from the second step on; the first step's batch-mean baseline
    is the usual small bias of a batch baseline). A batch with no valid reward leaves ``(m, count)``
    unchanged. The trainer keeps ``(m, count)`` between steps and in every checkpoint
    (``rljax.algorithms.reinforce``), so a resumed run continues bitwise.

    Args:
      rewards: ``[B]`` float; mean, count: scalars, the state (``count = 0``: none yet);
      decay: ``None`` (running mean of all rewards) or in ``[0, 1)``; valid: optional ``[B]`` bool.
    Returns:
      ``(advantages [B], mean', count')``.
    """
    chex.assert_rank(rewards, 1)
    chex.assert_type(rewards, float)
    if decay is not None and not 0 <= decay < 1:
        raise ValueError(f"decay must be None or in [0, 1), got {decay}")
    if valid is None:
        valid = jnp.ones(rewards.shape, dtype=bool)
    valid = valid.astype(bool)
    r = jnp.where(valid, rewards, jnp.zeros_like(rewards))  # missing rewards may be NaN
    mean = jnp.asarray(mean, r.dtype)
    count = jnp.asarray(count, r.dtype)
    n = jnp.sum(valid, dtype=r.dtype)
    batch_mean = jnp.sum(r) / jnp.maximum(n, 1.0)
    b = jnp.where(count > 0, mean, batch_mean)
    adv = jnp.where(valid, r - b, jnp.zeros_like(r))
    w = n / jnp.maximum(count + n, 1.0) if decay is None else jnp.where(count > 0, 1.0 - decay, 1.0)
    new_mean = jnp.where(n > 0, b + w * (batch_mean - b), mean)
    return jax.lax.stop_gradient(adv), jax.lax.stop_gradient(new_mean), count + n


def whiten(
    x: chex.Array, mask: chex.Array, *, shift_mean: bool = True, eps=1e-8, bessel: bool = True
) -> chex.Array:
    """Whiten over the valid entries: ``(x − mean) / (std + eps)``; ``shift_mean=False`` adds the
    mean back (``(x − mean)/(std + eps) + mean``: rescale only, as for PPO reward whitening).

    PPO-RLHF whitens GAE advantages over all valid tokens of the batch (TRL ``masked_whiten``,
    verl ``torch_functional.masked_whiten``, both Bessel-corrected). Those compute
    ``(x − mean) · rsqrt(var + eps)``; we use ``std + eps`` as TRL's GRPO does — identical in
    float32 whenever ``std ≫ 1e-4``, and exactly 0 for constant input (``x`` with
    ``shift_mean=False``). Masked entries are 0.

    Args:
      x: any shape, float; mask: same shape; shift_mean, eps, bessel: see above.
    Returns:
      same shape as ``x``.
    """
    chex.assert_equal_shape([x, mask])
    chex.assert_type(x, float)
    valid = mask != 0
    mean, var_s, s = _scaled_mean_var(x, valid, axis=None, bessel=bessel)  # no overflow for large x
    out = (x - mean) / (s * jnp.sqrt(var_s) + eps)
    # all valid entries equal -> exactly 0 (x itself with shift_mean=False); see the module docstring
    out = jnp.where(_flat(x, valid), jnp.zeros_like(out), out)
    if not shift_mean:
        out = jnp.where(_flat(x, valid), x, out + mean)
    return jax.lax.stop_gradient(jnp.where(valid, out, jnp.zeros_like(out)))


def gae(
    rewards: chex.Array, values: chex.Array, mask: chex.Array, *, gamma=1.0, lam=0.95
) -> tuple[chex.Array, chex.Array]:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438) over masked tokens::

        δ_t = r_t + γ V_{t'} − V_t              t' = next valid token after t (V = 0 past the end)
        A_t = δ_t + γ λ A_{t'}
        returns_t = A_t + V_t

    The recursion runs backwards in a ``lax.scan`` and skips masked positions: a masked token
    neither bootstraps nor breaks the chain (verl ``compute_gae_advantage_return``, which skips
    observation tokens the same way; for right-padded completions this is the TRL ``PPOTrainer``
    loop). Outputs are 0 at masked positions (verl leaves the carried value there).
    Advantages are *not* whitened here: PPO then calls ``whiten(advantages, mask)``.
    RLHF defaults: ``γ = 1``, ``λ = 0.95``.

    Args:
      rewards: ``[B, T]`` per-token rewards (e.g. ``kl_shaped_rewards``).
      values: ``[B, T]`` value-head predictions at sampling time.
      mask: ``[B, T]``.
    Returns:
      ``(advantages [B, T], returns [B, T])``.
    """
    chex.assert_rank([rewards, values, mask], 2)
    chex.assert_equal_shape([rewards, values, mask])
    chex.assert_type([rewards, values], float)
    valid = mask != 0
    zeros = jnp.zeros_like(rewards)
    rewards = jnp.where(valid, rewards, zeros)
    values = jnp.where(valid, values, zeros)

    def step(carry, inputs):
        next_value, next_adv = carry  # [B], [B]
        r_t, v_t, m_t = inputs
        delta = r_t + gamma * next_value - v_t
        adv_t = delta + gamma * lam * next_adv
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv_t, next_adv))
        return carry, jnp.where(m_t, adv_t, jnp.zeros_like(adv_t))

    init = (jnp.zeros_like(rewards[:, 0]), jnp.zeros_like(rewards[:, 0]))
    _, adv_time_major = jax.lax.scan(step, init, (rewards.T, values.T, valid.T), reverse=True)
    advantages = adv_time_major.T
    returns = jnp.where(valid, advantages + values, zeros)
    return jax.lax.stop_gradient(advantages), jax.lax.stop_gradient(returns)


def discounted_returns(rewards: chex.Array, mask: chex.Array, *, gamma=1.0) -> chex.Array:
    """``G_t = Σ_{k ≥ 0} γ^k r_{t_k}`` over the valid tokens from ``t`` on (``gae`` with V = 0, λ = 1)."""
    returns, _ = gae(rewards, jnp.zeros_like(rewards), mask, gamma=gamma, lam=1.0)
    return returns


def reinforce_plus_plus_advantages(
    token_rewards: chex.Array, mask: chex.Array, *, gamma=1.0, eps=1e-8
) -> tuple[chex.Array, chex.Array]:
    """REINFORCE++ (Hu et al., arXiv:2501.03262): discounted returns of the (KL-shaped) token
    rewards, whitened over every valid token of the **global batch** (no critic, no group)::

        G_t = Σ_{k ≥ t, valid} γ^{k−t} r_k ;   A = (G − mean_batch G) / (std_batch G + eps)

    verl ``compute_reinforce_plus_plus_outcome_advantage`` (its running return resets at the first
    masked token; identical for right-padded masks). The "REINFORCE++-baseline" variant is
    ``whiten(broadcast_to_tokens(group_advantages(R, scale="none"), mask), mask)``.

    Args:
      token_rewards: ``[B, T]`` (e.g. ``kl_shaped_rewards`` with ``estimator="k1"``).
      mask: ``[B, T]``; gamma: discount; eps: added to the std.
    Returns:
      ``(advantages [B, T], returns [B, T])``.
    """
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return whiten(returns, mask, eps=eps), returns


def kl_shaped_rewards(
    scores: chex.Array,
    logprobs: chex.Array,
    ref_logprobs: chex.Array,
    mask: chex.Array,
    *,
    kl_coef,
    estimator: str = "k1",
    eos_found: chex.Array | None = None,
    missing_eos_penalty=None,
) -> chex.Array:
    """Per-token rewards with a KL penalty (Ziegler et al., arXiv:1909.08593; InstructGPT)::

        r_t = −β · k(logp_t, logp_ref_t)                 every valid token
        r_T += score − penalty · [no EOS]                T = the last valid token of the row

    ``k`` is a ``kl_penalty`` estimator (k1 = ``logp − logp_ref`` as TRL ``PPOTrainer``, verl
    ``compute_rewards`` and TRL ``RLOOTrainer``; k3 is TRL PPO's ``kl_estimator="k3"``). The
    "EOS trick" subtracts ``missing_eos_penalty`` from the score of completions with
    ``eos_found == False`` (TRL ``missing_eos_penalty``). The score goes on the last real token,
    the one that ends the completion (TRL ``PPOTrainer`` places it one position later, on the
    first padding token when there is one). Rows with no valid token get no score.

    Args:
      scores: ``[B]`` sequence scores (reward model / verifier).
      logprobs: ``[B, T]`` log-probs of the sampling policy (constants here).
      ref_logprobs: ``[B, T]`` reference log-probs.
      mask: ``[B, T]``.
      kl_coef: ``β``; estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      eos_found: optional ``[B]`` bool; missing_eos_penalty: penalty (positive number) or None.
    Returns:
      ``[B, T]`` token rewards, 0 at masked positions.
    """
    chex.assert_rank([scores, logprobs, ref_logprobs, mask], [1, 2, 2, 2])
    chex.assert_equal_shape([logprobs, ref_logprobs, mask])
    chex.assert_equal_shape_prefix([scores, logprobs], 1)
    chex.assert_type([scores, logprobs, ref_logprobs], float)
    if estimator == "k3_unbiased":
        raise ValueError("k3_unbiased is a loss-term estimator; use k1, k2 or k3 in the reward")
    if missing_eos_penalty is not None:
        if eos_found is None:
            raise ValueError("missing_eos_penalty needs eos_found")
        chex.assert_equal_shape([scores, eos_found])
        scores = jnp.where(eos_found.astype(bool), scores, scores - missing_eos_penalty)
    valid = mask != 0
    kl = kl_lib.kl_penalty(logprobs, ref_logprobs, estimator=estimator, mask=mask)
    rewards = -kl_coef * kl
    positions = jnp.arange(mask.shape[1])[None, :]
    last = jnp.max(jnp.where(valid, positions, -1), axis=1, keepdims=True)  # [B, 1]; −1: empty
    at_last = positions == last
    rewards = rewards + jnp.where(at_last, scores[:, None], jnp.zeros_like(rewards))
    return jax.lax.stop_gradient(jnp.where(valid, rewards, jnp.zeros_like(rewards)))


def soft_overlong_punishment(lengths: chex.Array, *, max_length, cache_length) -> chex.Array:
    """DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476, eq. 13)::

        R(|y|) = 0                                  |y| ≤ L_max − L_cache
               = (L_max − L_cache − |y|) / L_cache   L_max − L_cache < |y| ≤ L_max
               = −1                                 |y| > L_max

    Added to the task reward. (DAPO: ``L_max = 20480``, ``L_cache = 4096``.)

    Args:
      lengths: ``[B]`` completion lengths (int or float).
      max_length: ``L_max``; cache_length: ``L_cache`` (> 0).
    Returns:
      ``[B]`` float32 penalties in ``[−1, 0]``.
    """
    lengths = jnp.asarray(lengths)
    chex.assert_rank(lengths, 1)
    if isinstance(cache_length, (int, float)) and cache_length <= 0:
        raise ValueError(f"cache_length must be > 0, got {cache_length}")
    y = lengths.astype(jnp.float32)
    start = jnp.asarray(max_length - cache_length, jnp.float32)
    inside = (start - y) / jnp.asarray(cache_length, jnp.float32)
    out = jnp.where(y <= start, jnp.zeros_like(y), inside)
    return jnp.where(y > max_length, -jnp.ones_like(y), out)
