"""REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): no critic and no group baseline; the per-token
KL penalty in the reward, discounted returns, normalised over every valid token of the **global
batch**, trained with the clipped surrogate.

    r_t  = −β k(π_old, π_ref)_t  (+ score at the last token)
    G_t  = Σ_{k ≥ t} γ^{k−t} r_k ;   A = (G − mean_batch G) / (std_batch G + eps)
    loss = reduce( −min(ρ A, clip(ρ, 1−ε_low, 1+ε_high) A) )

(verl ``compute_reinforce_plus_plus_outcome_advantage``; ``rljax.advantages.reinforce_plus_plus_advantages``.)
``group_size`` may be 1: the normalisation is over the batch, not the group.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rljax import advantages as adv
from rljax.algorithms import policy_gradient as pg
from rljax.algorithms.base import OnlineAlgorithm
from rljax.batches import RolloutBatch
from rljax.config import check_range


@dataclasses.dataclass(frozen=True)
class ReinforcePPConfig(pg.ClipSettings):
    name: Literal["reinforce_pp"] = "reinforce_pp"
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # the KL in the reward (the paper: k1)
    gamma: float = 1.0
    reduction: pg.Reduction = "token_mean"  # the paper's (and verl's) token mean over the batch

    def validate(self) -> None:
        super().validate()
        check_range(self, "gamma", low=0, high=1)


def advantages(batch: RolloutBatch, cfg: ReinforcePPConfig) -> RolloutBatch:
    """Batch-normalised discounted returns of the KL-shaped token rewards."""
    token_rewards = pg.kl_token_rewards(batch, cfg, estimator=cfg.kl_estimator)
    mask = batch.loss_mask.astype(token_rewards.dtype)
    advantages, returns = adv.reinforce_plus_plus_advantages(token_rewards, mask, gamma=cfg.gamma)
    return batch.replace(advantages=advantages, returns=returns)


def loss(model, batch: RolloutBatch, cfg: ReinforcePPConfig, *, temperature, num_rows, num_tokens, max_length):
    """``(loss, metrics)`` of one micro-batch: the clipped surrogate, no KL term (it is in the reward)."""
    out = pg.policy_logprobs(model, batch, cfg, temperature=temperature)
    return pg.clipped_loss(out, batch, cfg, num_rows=num_rows, num_tokens=num_tokens, max_length=max_length)


ALGORITHM = OnlineAlgorithm(name="reinforce_pp", config=ReinforcePPConfig, advantages=advantages, loss=loss,
                            needs_reference=lambda cfg: cfg.kl_coef > 0,
                            reward_kl_estimator=pg.reward_kl_estimator)
