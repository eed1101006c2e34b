"""REINFORCE with a moving-average baseline (Williams 1992): the "vanilla policy gradient" of
Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740, §3.2 and Table 1. No critic, no group:
the baseline is the mean of the rewards of **earlier steps**, state the trainer carries across
steps and saves in every checkpoint (``OnlineAlgorithm.initial_state``).

    R_i = score_i − β Σ_t k(π_old, π_ref)_t                 (kl_coef β, kl_estimator k; KL in the reward)
    A_i = R_i − b,   b = the baseline before this step (the first step: this batch's mean)
    b  ← mean of every R so far (baseline_decay null, the paper's b_MA)
         or b + (1 − d)(mean_batch R − b)                   (baseline_decay d: exponential moving average)
    loss = −(1/S) Σ_i A_i log π(y_i)                        (reduction seq_mean_token_sum; one update per batch)

``rljax.advantages.moving_average_baseline_advantages`` is the maths; ``rljax.losses.policy.reinforce_loss``
the loss (as RLOO's ``loss: reinforce``). ``group_size`` defaults to 1: nothing is shared between a
prompt's completions.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from rljax import advantages as adv
from rljax.algorithms import policy_gradient as pg
from rljax.algorithms.base import OnlineAlgorithm
from rljax.batches import RolloutBatch
from rljax.config import check_range
from rljax.losses.policy import reinforce_loss


@dataclasses.dataclass(frozen=True)
class ReinforceConfig(pg.OnlineSettings):
    name: Literal["reinforce"] = "reinforce"
    group_size: int = 1
    prompts_per_step: int = 16
    reduction: pg.Reduction = "seq_mean_token_sum"  # the paper's −(1/S) Σ_i A_i log π(y_i)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # the KL in the reward (as RLOO)
    # null: the baseline is the mean of every reward so far (the paper's b_MA); d in [0, 1): an
    # exponential moving average that forgets old rewards with weight d per step
    baseline_decay: Optional[float] = None

    def validate(self) -> None:
        super().validate()
        check_range(self, "baseline_decay", low=0, high=1, high_open=True, note="(null = mean of all rewards)")
        if self.num_iterations != 1:
            raise ValueError("reinforce has no importance ratio, so num_iterations must be 1 (a second pass would "
                             "reuse the samples off-policy without correction)")


def initial_state(cfg: ReinforceConfig) -> dict[str, float]:
    """No rewards seen yet: the first step's baseline is its own batch mean."""
    return {"baseline": 0.0, "count": 0.0}


def advantages(batch: RolloutBatch, cfg: ReinforceConfig, state: dict) -> tuple[RolloutBatch, dict]:
    """Advantages against the baseline of earlier steps, broadcast to tokens; the state after this batch."""
    scores = pg.sequence_kl_scores(batch, cfg, estimator=cfg.kl_estimator)
    seq, baseline, count = adv.moving_average_baseline_advantages(
        scores, state["baseline"], state["count"], decay=cfg.baseline_decay, valid=batch.row_mask)
    return (batch.replace(advantages=adv.broadcast_to_tokens(seq, batch.loss_mask)),
            {"baseline": baseline, "count": count})


def loss(model, batch: RolloutBatch, cfg: ReinforceConfig, *, temperature, num_rows, num_tokens, max_length):
    """``(loss, metrics)`` of one micro-batch: REINFORCE over the sequence."""
    out = pg.policy_logprobs(model, batch, cfg, temperature=temperature)
    return reinforce_loss(out["logprobs"], batch.advantages, batch.loss_mask, entropy=out["entropy"],
                          entropy_coef=cfg.entropy_coef, reduction=cfg.reduction, num_sequences=num_rows,
                          num_tokens=num_tokens, max_length=max_length, **pg.correction_args(batch, cfg))


ALGORITHM = OnlineAlgorithm(name="reinforce", config=ReinforceConfig, advantages=advantages, loss=loss,
                            needs_reference=lambda cfg: cfg.kl_coef > 0, initial_state=initial_state,
                            reward_kl_estimator=pg.reward_kl_estimator)
