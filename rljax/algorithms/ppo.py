"""PPO for language models (Schulman et al. 2017, arXiv:1707.06347; Ziegler et al. 2019,
arXiv:1909.08593; InstructGPT, arXiv:2203.02155): per-token KL penalty **in the reward**, the
score on the last real token, GAE over a learned value estimate, the clipped surrogate plus a
clipped value loss.

    r_t   = −β k(π_old, π_ref)_t  (+ score − penalty·[no EOS] at the last token)
    A, G  = GAE(r, V_old; γ, λ),  A whitened over valid tokens (whiten_advantages)
    loss  = L_clip(A) + vf_coef · ½ mean max((V − G)², (V_clip − G)²)

The value estimate comes from a scalar head on the policy's trunk (``critic: shared``: one model,
one optimizer, the value term in the policy's loss) or from a critic model of its own
(``critic: separate``: a transformer with a value head, its own parameters and AdamW state,
always fully fine-tuned, minimising ``vf_coef · L_V``; no value gradient reaches the policy).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from rljax import advantages as adv
from rljax.algorithms import policy_gradient as pg
from rljax.algorithms.base import CriticSettings, OnlineAlgorithm
from rljax.batches import RolloutBatch
from rljax.config import check_range
from rljax.logprobs import completion_values
from rljax.losses.value import value_loss


@dataclasses.dataclass(frozen=True)
class PPOConfig(pg.ClipSettings):
    name: Literal["ppo"] = "ppo"
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # the KL in the reward (TRL PPOTrainer, verl: k1)
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    critic: Literal["shared", "separate"] = "shared"
    # separate critic: registered name / .gguf / HF directory (null = model.name). A directory with
    # value_head.safetensors (e.g. a trained reward model) starts the head from it. Same tokenizer.
    critic_model: Optional[str] = None
    critic_learning_rate: Optional[float] = None  # separate critic's AdamW rate (null = optim.learning_rate)
    vf_coef: float = 0.1
    value_clip: float = 0.2
    missing_eos_penalty: Optional[float] = None  # subtracted from the score of completions with no EOS

    def validate(self) -> None:
        super().validate()
        if self.critic == "shared" and (self.critic_model is not None or self.critic_learning_rate is not None):
            raise ValueError("critic_model and critic_learning_rate are settings of critic: separate")
        check_range(self, "critic_learning_rate", low=0, low_open=True, note="(null = optim.learning_rate)")
        check_range(self, "gamma", low=0, high=1)
        check_range(self, "lam", low=0, high=1)
        check_range(self, "vf_coef", low=0)
        check_range(self, "value_clip", low=0)
        check_range(self, "missing_eos_penalty")


def advantages(batch: RolloutBatch, cfg: PPOConfig) -> RolloutBatch:
    """GAE advantages and returns of the KL-shaped token rewards."""
    mask = batch.loss_mask.astype(batch.old_logprobs.dtype)
    token_rewards = pg.kl_token_rewards(batch, cfg, estimator=cfg.kl_estimator,
                                        missing_eos_penalty=cfg.missing_eos_penalty)
    advantages, returns = adv.gae(token_rewards, batch.old_values, mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.whiten_advantages:
        advantages = adv.whiten(advantages, mask)
    return batch.replace(advantages=advantages, returns=returns)


def _value_loss(values, batch: RolloutBatch, cfg: PPOConfig, num_tokens):
    return value_loss(values, batch.old_values, batch.returns, batch.loss_mask, clip_range=cfg.value_clip,
                      num_tokens=num_tokens)


def loss(model, batch: RolloutBatch, cfg: PPOConfig, *, temperature, num_rows, num_tokens, max_length):
    """``(loss, metrics)`` of one micro-batch: ``L_clip`` (+ ``vf_coef · L_V`` with a shared head)."""
    shared = cfg.critic == "shared"
    out = pg.policy_logprobs(model, batch, cfg, temperature=temperature, with_values=shared)
    total, metrics = pg.clipped_loss(out, batch, cfg, num_rows=num_rows, num_tokens=num_tokens,
                                     max_length=max_length)
    if shared:
        v_loss, v_metrics = _value_loss(out["values"], batch, cfg, num_tokens)
        total, metrics = total + cfg.vf_coef * v_loss, {**metrics, **v_metrics}
    return total, metrics


def critic_loss(model, batch: RolloutBatch, cfg: PPOConfig, *, num_rows, num_tokens, max_length):
    """``(vf_coef · L_V, metrics)`` of a separate critic on one micro-batch: the same clipped value
    loss and global token count as the shared head's term (metrics ``value/*``)."""
    # every completion token is context (multi-turn: the environment's too); the loss counts loss_mask's
    values = completion_values(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                               batch.completion_mask)
    v_loss, metrics = _value_loss(values, batch, cfg, num_tokens)
    return cfg.vf_coef * v_loss, metrics


def critic(cfg: PPOConfig) -> CriticSettings:
    """The separate critic's model and learning rate (``critic: separate``)."""
    return CriticSettings(model=cfg.critic_model, learning_rate=cfg.critic_learning_rate)


ALGORITHM = OnlineAlgorithm(name="ppo", config=PPOConfig, advantages=advantages, loss=loss,
                            needs_reference=lambda cfg: cfg.kl_coef > 0, value_head=lambda cfg: cfg.critic,
                            critic_loss=critic_loss, critic=critic, reward_kl_estimator=pg.reward_kl_estimator,
                            # a fresh head starts at zero: in short PPO runs (shared head and separate
                            # critic, 3 seeds) it fitted the returns as well or slightly better than a
                            # normal(0.02) start (experiments/results/ppo_value_head_init.md)
                            value_head_init="zeros")
