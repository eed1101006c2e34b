"""Reward-model training losses: pairwise Bradley–Terry and the K-wise ranking form.

InstructGPT (Ouyang et al., arXiv:2203.02155, eq. 1) trains a scalar reward ``r_φ(x, y)`` with
``loss = −1/C(K,2) · E[log σ(r(x, y_w) − r(x, y_l))]`` over all pairs of K ranked answers to one
prompt; with K = 2 it is the Bradley–Terry pairwise loss (Bradley & Terry 1952; TRL
``RewardTrainer.compute_loss``, which adds an optional per-pair margin (Llama 2,
arXiv:2307.09288) and reward centring (Eisenstein et al., arXiv:2312.09244)).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rljax.losses.reduce import masked_mean


def bradley_terry_loss(
    chosen_rewards: chex.Array,
    rejected_rewards: chex.Array,
    *,
    margin: chex.Array | None = None,
    centering_coef=0.0,
    mask: chex.Array | None = None,
    num_pairs=None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """Pairwise Bradley–Terry loss with optional margin and reward centring::

        loss = mean_i −log σ(r⁺_i − r⁻_i − margin_i)  +  c · mean_i (r⁺_i + r⁻_i)²

    (TRL ``RewardTrainer.compute_loss``: ``-logsigmoid(rc - rr - margin).mean()
    + center_rewards_coefficient * mean((rc + rr)**2)``.)

    Args:
      chosen_rewards, rejected_rewards: ``[B]`` scalar rewards of the preferred / other answer.
      margin: optional ``[B]`` required reward gap (e.g. from a preference strength; Llama 2).
      centering_coef: ``c`` (TRL suggests 0.01); pushes rewards towards zero mean.
      mask: optional ``[B]``, nonzero = pair counts.
      num_pairs: global number of pairs for micro-batching (default: local valid pairs); both
        terms are divided by it, so per-part losses sum to the whole-batch loss.
    Returns:
      ``(loss, metrics)``; metrics (local means over valid pairs): ``reward_model/loss``,
      ``reward_model/bt_loss``, ``reward_model/centering_loss`` (unscaled mean of
      ``(r⁺ + r⁻)²``), ``rewards/chosen``, ``rewards/rejected``, ``rewards/margin``,
      ``rewards/accuracy``.
    """
    chex.assert_rank([chosen_rewards, rejected_rewards], 1)
    chex.assert_equal_shape([chosen_rewards, rejected_rewards])
    chex.assert_type([chosen_rewards, rejected_rewards], float)
    if mask is None:
        mask = jnp.ones_like(chosen_rewards)
    chex.assert_equal_shape([chosen_rewards, mask])
    valid = mask != 0
    zeros = jnp.zeros_like(chosen_rewards)
    chosen = jnp.where(valid, chosen_rewards, zeros)
    rejected = jnp.where(valid, rejected_rewards, zeros)
    gap = chosen - rejected
    if margin is not None:
        chex.assert_equal_shape([chosen_rewards, margin])
        gap = gap - jax.lax.stop_gradient(jnp.where(valid, margin, zeros))
    bt = masked_mean(-jax.nn.log_sigmoid(gap), valid, denominator=num_pairs)
    centering = masked_mean(jnp.square(chosen + rejected), valid, denominator=num_pairs)
    loss = bt + centering_coef * centering
    metrics = {
        "reward_model/loss": loss,
        "reward_model/bt_loss": bt,
        "reward_model/centering_loss": centering,
        "rewards/chosen": masked_mean(chosen, valid),
        "rewards/rejected": masked_mean(rejected, valid),
        "rewards/margin": masked_mean(chosen - rejected, valid),
        "rewards/accuracy": masked_mean((chosen > rejected).astype(chosen.dtype), valid),
    }
    return loss, jax.lax.stop_gradient(metrics)


def kwise_ranking_loss(
    rewards: chex.Array,
    *,
    mask: chex.Array | None = None,
    num_prompts=None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """K-wise ranking loss of InstructGPT (arXiv:2203.02155, eq. 1)::

        loss_b = −1/P_b · Σ_{j<k, both valid} log σ(r_{b,j} − r_{b,k})     (P_b valid pairs)
        loss   = (1/Q) Σ_b loss_b                                          (Q prompts with P_b ≥ 1)

    Each prompt's C(K,2) comparisons are averaged (one prompt is one batch element, which is what
    keeps InstructGPT from over-fitting), then prompts are averaged. Ties are not modelled: the
    K answers are strictly ranked best-first.

    Args:
      rewards: ``[B, K]`` rewards of K answers per prompt, ranked best-first.
      mask: optional ``[B, K]``, nonzero = the answer exists (prompts with fewer than K answers
        are padded at any position). Prompts with fewer than two answers contribute nothing.
      num_prompts: global ``Q`` for micro-batching (default: local prompts with a pair).
    Returns:
      ``(loss, metrics)``; metrics ``reward_model/loss``, ``rewards/accuracy`` (fraction of valid
      pairs ranked correctly, local), ``rewards/margin`` (mean ``r_j − r_k`` over valid pairs).
    """
    chex.assert_rank(rewards, 2)
    chex.assert_type(rewards, float)
    if mask is None:
        mask = jnp.ones_like(rewards)
    chex.assert_equal_shape([rewards, mask])
    num_answers = rewards.shape[1]
    valid = mask != 0
    r = jnp.where(valid, rewards, jnp.zeros_like(rewards))
    diff = r[:, :, None] - r[:, None, :]  # [B, K, K]: r_j − r_k
    upper = jnp.triu(jnp.ones((num_answers, num_answers), dtype=bool), k=1)  # j < k
    pair_valid = valid[:, :, None] & valid[:, None, :] & upper[None, :, :]  # [B, K, K]
    pair_loss = jnp.where(pair_valid, -jax.nn.log_sigmoid(diff), jnp.zeros_like(diff))
    pairs_per_prompt = jnp.sum(pair_valid, axis=(1, 2), dtype=rewards.dtype)  # [B]
    prompt_loss = jnp.sum(pair_loss, axis=(1, 2)) / jnp.maximum(pairs_per_prompt, 1.0)
    has_pair = pairs_per_prompt > 0
    loss = masked_mean(prompt_loss, has_pair, denominator=num_prompts)
    metrics = {
        "reward_model/loss": loss,
        "rewards/accuracy": masked_mean((diff > 0).astype(rewards.dtype), pair_valid),
        "rewards/margin": masked_mean(diff, pair_valid),
    }
    return loss, jax.lax.stop_gradient(metrics)
