"""RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740; Kool et al. 2019): a
leave-one-out baseline from the other completions of the prompt, the KL **in the reward** at
sequence level.

    R_i = score_i − β Σ_t k(π_old, π_ref)_t        (kl_coef β, kl_estimator k)
    A_i = R_i − (Σ_{j∈g} R_j − R_i) / (G − 1)

``loss: reinforce`` is the paper's form: the REINFORCE loss over the whole sequence,
``−(1/S) Σ_i A_i log π(y_i)`` (``rljax.losses.policy.reinforce_loss`` with a token sum per sequence),
one update per batch of samples. ``loss: clip`` (default) is TRL ``RLOOTrainer``'s: the clipped
surrogate with the configured reduction, which allows several passes over a batch.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from rljax import advantages as adv
from rljax.algorithms import policy_gradient as pg
from rljax.algorithms.base import OnlineAlgorithm
from rljax.batches import RolloutBatch
from rljax.config import FieldError
from rljax.losses.policy import reinforce_loss

_CLIP_DEFAULTS = pg.ClipSettings()


@dataclasses.dataclass(frozen=True)
class RLOOConfig(pg.ClipSettings):
    name: Literal["rloo"] = "rloo"
    loss: Literal["clip", "reinforce"] = "clip"
    # null = the form's own: seq_mean_token_mean with clip (TRL), seq_mean_token_sum with reinforce
    # (the paper's -(1/S) sum_i A_i log pi(y_i), log pi(y) being the sum of token log-probs)
    reduction: Optional[pg.Reduction] = None
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # the KL in the reward (TRL RLOOTrainer: k1)

    def validate(self) -> None:
        super().validate()
        if self.group_size < 2:
            raise FieldError("group_size", f"rloo needs group_size >= 2 (a baseline from the other completions), "
                                           f"got {self.group_size}")
        if self.loss == "reinforce":
            for key in ("ratio_level", "epsilon_low", "epsilon_high", "dual_clip"):
                if getattr(self, key) != getattr(_CLIP_DEFAULTS, key):
                    raise ValueError(f"{key} does nothing with loss: reinforce (no ratio, no clipping); "
                                     "remove it or use loss: clip")
            if self.num_iterations != 1:
                raise ValueError("loss: reinforce has no importance ratio, so num_iterations must be 1 (a second "
                                 "pass would reuse the samples off-policy without correction)")


def token_reduction(cfg: RLOOConfig) -> str:
    """The reduction in effect (``cfg.reduction``, or the loss form's own when null)."""
    if cfg.reduction is not None:
        return cfg.reduction
    return "seq_mean_token_sum" if cfg.loss == "reinforce" else "seq_mean_token_mean"


def advantages(batch: RolloutBatch, cfg: RLOOConfig) -> RolloutBatch:
    """Leave-one-out advantages of the KL-penalised sequence rewards, broadcast to tokens."""
    scores = pg.sequence_kl_scores(batch, cfg, estimator=cfg.kl_estimator)
    seq = adv.rloo_advantages(scores, group_size=cfg.group_size, valid=batch.row_mask)
    return batch.replace(advantages=adv.broadcast_to_tokens(seq, batch.loss_mask))


def loss(model, batch: RolloutBatch, cfg: RLOOConfig, *, temperature, num_rows, num_tokens, max_length):
    """``(loss, metrics)`` of one micro-batch: REINFORCE over the sequence, or the clipped surrogate."""
    out = pg.policy_logprobs(model, batch, cfg, temperature=temperature)
    if cfg.loss == "clip":
        return pg.clipped_loss(out, batch, cfg, num_rows=num_rows, num_tokens=num_tokens, max_length=max_length,
                               reduction=token_reduction(cfg))
    return reinforce_loss(out["logprobs"], batch.advantages, batch.loss_mask, entropy=out["entropy"],
                          entropy_coef=cfg.entropy_coef, reduction=token_reduction(cfg), num_sequences=num_rows,
                          num_tokens=num_tokens, max_length=max_length, **pg.correction_args(batch, cfg))


ALGORITHM = OnlineAlgorithm(name="rloo", config=RLOOConfig, advantages=advantages, loss=loss,
                            needs_reference=lambda cfg: cfg.kl_coef > 0,
                            reward_kl_estimator=pg.reward_kl_estimator)
