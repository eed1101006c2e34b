"""GRPO (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300) and its variants: group-normalised outcome
advantages, the clipped surrogate, and the KL to the reference **in the loss**.

    A_i   = (R_i − mean_g R) / (std R + eps)     advantage_scale: group | batch (std over the batch)
          =  R_i − mean_g R                      advantage_scale: none (Dr. GRPO, arXiv:2503.20783)
    loss  = reduce( −min(ρ A, clip(ρ, 1−ε_low, 1+ε_high) A) − c_H H + β k(π, π_ref) )

``kl_placement: reward`` moves the KL term out of the loss into the scores before the group
normalisation, ``R_i = score_i − β Σ_t k(π_old, π_ref)_t`` (as RLOO does): the same algorithm
otherwise, so "KL in the loss vs KL in the reward" is one setting (experiments/ablate_kl_placement.py).

Variants are settings: DAPO's clip-higher, dynamic sampling and token-mean reduction
(arXiv:2503.14476), GSPO's sequence ratio (``ratio_level: sequence``, arXiv:2507.18071), dual clip.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from rljax import advantages as adv
from rljax.algorithms import policy_gradient as pg
from rljax.algorithms.base import OnlineAlgorithm
from rljax.config import FieldError, check_range
from rljax.batches import RolloutBatch


@dataclasses.dataclass(frozen=True)
class GRPOConfig(pg.ClipSettings):
    name: Literal["grpo"] = "grpo"
    kl_estimator: Literal["k1", "k2", "k3", "k3_unbiased"] = "k3"  # the KL term in the loss (DeepSeekMath: k3)
    advantage_scale: Literal["group", "batch", "none"] = "group"
    bessel: bool = True  # unbiased std (TRL, verl)
    advantage_eps: float = 1e-4
    kl_placement: Literal["loss", "reward"] = "loss"  # where the β KL term enters (module docstring)

    def validate(self) -> None:
        super().validate()
        if self.group_size < 2:
            raise FieldError("group_size", f"grpo needs group_size >= 2 (a baseline from the other completions), "
                                           f"got {self.group_size}")
        check_range(self, "advantage_eps", low=0)
        if self.kl_placement == "reward" and self.kl_estimator == "k3_unbiased":
            raise FieldError("kl_estimator", "k3_unbiased weights k3 by the ratio to the training policy, which "
                                             "the reward (fixed before the update) does not have; use k1, k2 or "
                                             "k3 with kl_placement: reward")


def advantages(batch: RolloutBatch, cfg: GRPOConfig) -> RolloutBatch:
    """Group-normalised sequence advantages broadcast to every counted token."""
    raw = batch.scores
    if cfg.kl_placement == "reward":
        raw = pg.sequence_kl_scores(batch, cfg, estimator=cfg.kl_estimator)
    scores = adv.group_advantages(raw, group_size=cfg.group_size, scale=cfg.advantage_scale,
                                  bessel=cfg.bessel, eps=cfg.advantage_eps, valid=batch.row_mask)
    return batch.replace(advantages=adv.broadcast_to_tokens(scores, batch.loss_mask))


def loss(model, batch: RolloutBatch, cfg: GRPOConfig, *, temperature, num_rows, num_tokens, max_length):
    """``(loss, metrics)`` of one micro-batch: the clipped surrogate with the KL term in the loss
    (unless ``kl_placement: reward``, where it is in the advantages)."""
    out = pg.policy_logprobs(model, batch, cfg, temperature=temperature)
    return pg.clipped_loss(out, batch, cfg, num_rows=num_rows, num_tokens=num_tokens, max_length=max_length,
                           kl_in_loss=cfg.kl_placement == "loss", kl_estimator=cfg.kl_estimator)


ALGORITHM = OnlineAlgorithm(name="grpo", config=GRPOConfig, advantages=advantages, loss=loss,
                            needs_reference=lambda cfg: cfg.kl_coef > 0,
                            # kl_placement: loss logs its own kl/mean; reward: the estimate in the scores
                            reward_kl_estimator=pg.reward_kl_estimator)
