"""Online RL algorithms (GRPO, PPO, RLOO): rollouts -> advantages -> loss. Wiring only; the maths
lives in ``rljax.advantages`` and ``rljax.losses``.

A rollout batch is a dict of arrays over ``R = prompts × G`` rows (row ``i`` belongs to group
``i // G``): ``prompt_ids/prompt_mask [R, P]``, ``completion_ids [R, N]``, ``loss_mask [R, N]``
(the completion mask less rows excluded from the loss), ``old_logprobs [R, N]`` (the sampler's),
``ref_logprobs [R, N]`` (when a KL term is on), ``old_values [R, N]`` (PPO), ``scores [R]``,
``valid [R]`` (False where a reward function failed), ``finished [R]`` (emitted EOS).

PPO's value estimate comes from a scalar head on the policy's trunk (``algorithm.critic: shared``:
``loss`` adds ``vf_coef · L_V``) or from a critic model of its own (``critic: separate``: ``loss`` is
the policy loss alone and ``critic_loss`` trains the critic; each model has its own optimizer, so
no gradient of the value loss reaches the policy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax import advantages as adv
from rljax.logprobs import completion_logprobs, completion_values
from rljax.losses.policy import policy_gradient_loss
from rljax.losses.value import value_loss
from rljax.run_config import AlgorithmSection


def compute_advantages(batch: dict, cfg: AlgorithmSection) -> dict:
    """Token-level ``advantages [R, N]`` (and PPO ``returns``) for a rollout batch."""
    mask = batch["loss_mask"].astype(jnp.float32)
    scores = jnp.where(batch["valid"], batch["scores"], 0.0)
    if cfg.name == "grpo":
        seq = adv.group_advantages(scores, group_size=cfg.group_size, scale=cfg.advantage_scale,
                                   bessel=cfg.bessel, eps=cfg.advantage_eps, valid=batch["valid"])
        return {"advantages": adv.broadcast_to_tokens(seq, mask)}
    if cfg.name == "rloo":
        # KL in the reward at sequence level: R_i = score_i - beta * sum_t k(t)   (TRL RLOOTrainer)
        if cfg.kl_coef:
            token_rewards = adv.kl_shaped_rewards(scores, batch["old_logprobs"], batch["ref_logprobs"], mask,
                                                  kl_coef=cfg.kl_coef, estimator="k1")
            scores = (token_rewards * mask).sum(axis=-1)
        seq = adv.rloo_advantages(scores, group_size=cfg.group_size, valid=batch["valid"])
        return {"advantages": adv.broadcast_to_tokens(seq, mask)}
    # PPO: per-token KL penalty, the score on the last real token, GAE over the value head.
    penalty = cfg.missing_eos_penalty if cfg.missing_eos_penalty else None
    ref = batch["ref_logprobs"] if cfg.kl_coef else batch["old_logprobs"]
    token_rewards = adv.kl_shaped_rewards(scores, batch["old_logprobs"], ref, mask, kl_coef=cfg.kl_coef,
                                          estimator="k1", eos_found=batch["finished"], missing_eos_penalty=penalty)
    advantages, returns = adv.gae(token_rewards, batch["old_values"], mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.whiten_advantages:
        advantages = adv.whiten(advantages, mask)
    return {"advantages": advantages, "returns": returns}


def batch_totals(batch: dict) -> dict:
    """Global denominators of a mini-batch (before it is split into micro-batches)."""
    mask = batch["loss_mask"]
    return dict(num_sequences=jnp.maximum((mask.sum(-1) > 0).sum(), 1), num_tokens=jnp.maximum(mask.sum(), 1),
                max_length=mask.shape[1])


def shared_value_head(cfg: AlgorithmSection) -> bool:
    """Whether the policy carries the value head (PPO with ``critic: shared``)."""
    return cfg.name == "ppo" and cfg.critic == "shared"


def critic_loss(model, batch: dict, cfg: AlgorithmSection, *, num_sequences, num_tokens, max_length: int):
    """``(vf_coef · L_V, metrics)`` of a separate critic on one micro-batch (``critic: separate``).

    The same clipped value loss and global token count as the shared head's term; the gradient
    reaches only the critic's parameters. Metrics: ``value/*`` (``rljax.losses.value.value_loss``).
    """
    mask = batch["loss_mask"]
    values = completion_values(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask)
    v_loss, metrics = value_loss(values, batch["old_values"], batch["returns"], mask, clip_range=cfg.value_clip,
                                 num_tokens=num_tokens)
    return cfg.vf_coef * v_loss, metrics


def loss(model, batch: dict, cfg: AlgorithmSection, *, temperature: float, num_sequences, num_tokens,
         max_length: int):
    """``(loss, metrics)`` of one micro-batch; totals are the mini-batch's (global denominators)."""
    mask = batch["loss_mask"]
    with_values = shared_value_head(cfg)
    out = completion_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask,
                              temperature=temperature, with_entropy=True, with_values=with_values)
    if not cfg.entropy_coef:
        # logged only: XLA does not drop 0 * entropy, so without this the backward pass would run
        # through the [B, N, V] entropy computation for nothing.
        out["entropy"] = jax.lax.stop_gradient(out["entropy"])
    kl_in_loss = cfg.name == "grpo" and cfg.kl_coef > 0
    total, metrics = policy_gradient_loss(
        out["logprobs"], batch["old_logprobs"], batch["advantages"], mask,
        ratio_level=cfg.ratio_level, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
        dual_clip=cfg.dual_clip or None, entropy=out["entropy"], entropy_coef=cfg.entropy_coef,
        ref_logprobs=batch["ref_logprobs"] if kl_in_loss else None, kl_coef=cfg.kl_coef if kl_in_loss else 0.0,
        kl_estimator=cfg.kl_estimator, reduction=cfg.reduction, num_sequences=num_sequences,
        num_tokens=num_tokens, max_length=max_length,
    )
    if with_values:
        v_loss, v_metrics = value_loss(out["values"], batch["old_values"], batch["returns"], mask,
                                       clip_range=cfg.value_clip, num_tokens=num_tokens)
        total = total + cfg.vf_coef * v_loss
        metrics = {**metrics, **v_metrics}
    return total, metrics
