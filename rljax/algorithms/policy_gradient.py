"""What the online algorithms (GRPO, PPO, RLOO, REINFORCE++, REINFORCE) share, and what an online
algorithm written outside rljax builds on: the common settings, the rollout batch's totals and the
clipped policy loss wired to the model.

Wiring only: the maths is ``rljax.losses.policy`` and ``rljax.advantages``. Each online algorithm
subclasses :class:`OnlineSettings` (and :class:`ClipSettings` when it trains with the clipped
surrogate) for its config section and exports an :class:`rljax.algorithms.base.OnlineAlgorithm`::

    from rljax.algorithms import policy_gradient as pg

    def loss(model, batch, cfg, *, temperature, num_rows, num_tokens, max_length):
        out = pg.policy_logprobs(model, batch, cfg, temperature=temperature)
        return pg.clipped_loss(out, batch, cfg, num_rows=num_rows, num_tokens=num_tokens,
                               max_length=max_length, kl_in_loss=True, kl_estimator="k3")

These signatures are the public contract: an algorithm written against them keeps working.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import jax
import jax.numpy as jnp

from rljax import advantages as adv
from rljax.config import FieldError, check_range
from rljax.batches import RolloutBatch
from rljax.logprobs import completion_logprobs
from rljax.losses.off_policy import check_bounds
from rljax.losses.policy import policy_gradient_loss

Reduction = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclasses.dataclass(frozen=True)
class OnlineSettings:
    """How many completions a step samples and how they are consumed (every online algorithm)."""

    group_size: int = 4  # completions per prompt (G)
    prompts_per_step: int = 4
    num_iterations: int = 1  # mu: passes over each batch of rollouts
    mini_batches: int = 1  # optimizer steps per pass
    micro_batch_size: Optional[int] = None  # rows per forward/backward; null = the whole mini-batch
    reduction: Reduction = "seq_mean_token_mean"  # rljax.losses.reduce
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # KL to the reference (where it enters: the algorithm's docstring)
    # DAPO
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal; sample more
    max_sampling_rounds: int = 3
    mask_truncated: bool = False  # leave completions that hit max_new_tokens out of the loss
    # S, the rows a sequence-level reduction divides by (rljax.losses.reduce): "nonempty", the rows
    # with a loss token (a row masked out, e.g. by mask_truncated, changes nothing), or "all", every
    # row of the mini-batch, as TRL's GRPOTrainer divides by B (a masked row shrinks the others' weight)
    sequence_count: Literal["nonempty", "all"] = "nonempty"
    # weights on the policy-gradient term for a sampler mu that is not pi_old (rljax.losses.off_policy):
    # with a correction the trainer recomputes pi_old's log-probs (one more forward pass per step) and
    # keeps the sampler's as sampling_logprobs; "none" trains on the sampler's log-probs as pi_old
    off_policy_correction: Literal["none", "token_tis", "seq_tis", "token_mask", "seq_mask"] = "none"
    # (lo, hi); the TIS modes use hi only. tuple[float, ...] so that a wrong length is refused by name
    correction_bounds: tuple[float, ...] = (0.5, 2.0)

    @property
    def rows(self) -> int:
        return self.group_size * self.prompts_per_step

    @property
    def num_micro(self) -> int:
        """Micro-batches per mini-batch."""
        mini = self.rows // self.mini_batches
        return mini // (self.micro_batch_size or mini)

    def validate(self) -> None:
        for key in ("group_size", "prompts_per_step", "num_iterations", "mini_batches", "micro_batch_size",
                    "max_sampling_rounds"):
            check_range(self, key, low=1)
        check_range(self, "entropy_coef")  # a negative one minimises entropy (a studied objective)
        check_range(self, "kl_coef", low=0)
        _check_correction_bounds(self.correction_bounds)
        if self.rows % self.mini_batches:
            raise ValueError(f"mini_batches ({self.mini_batches}) must divide the rows per step ({self.rows})")
        mini = self.rows // self.mini_batches
        if self.micro_batch_size and mini % self.micro_batch_size:
            raise ValueError(f"micro_batch_size ({self.micro_batch_size}) must divide the mini-batch ({mini})")


def _check_correction_bounds(bounds) -> None:
    """``correction_bounds`` as ``rljax.losses.off_policy.check_bounds`` wants them, and finite."""
    if len(bounds) != 2 or not all(isinstance(b, (int, float)) and math.isfinite(b) for b in bounds):
        raise FieldError("correction_bounds", f"must be two finite numbers [lo, hi], got {list(bounds)}")
    try:
        check_bounds(bounds, name="[lo, hi]")
    except ValueError as e:
        raise FieldError("correction_bounds", str(e)) from None


@dataclasses.dataclass(frozen=True)
class ClipSettings(OnlineSettings):
    """The clipped surrogate's settings (PPO-clip, clip-higher, dual clip, GSPO's sequence ratio)."""

    ratio_level: Literal["token", "sequence"] = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # > epsilon_low: DAPO's clip-higher (0.28)
    dual_clip: Optional[float] = None  # c of the dual clip for A < 0 (e.g. 3.0); null = off

    def validate(self) -> None:
        super().validate()
        check_range(self, "epsilon_low", low=0)
        check_range(self, "epsilon_high", low=0)
        check_range(self, "dual_clip", low=1, low_open=True, note="(null = off)")


def reward_kl_estimator(cfg) -> str:
    """The KL estimator of an algorithm whose section has ``kl_estimator`` (every built-in online one)."""
    return cfg.kl_estimator


def totals(batch: RolloutBatch, cfg: OnlineSettings | None = None) -> dict:
    """Global denominators of a mini-batch (before it is split into micro-batches); ``num_rows`` is
    the rows with a loss token, or every row under ``cfg.sequence_count == "all"``."""
    mask = batch.loss_mask
    if cfg is not None and cfg.sequence_count == "all":
        num_rows = jnp.asarray(mask.shape[0], jnp.int32)
    else:
        num_rows = jnp.maximum((mask.sum(-1) > 0).sum(), 1)
    return dict(num_rows=num_rows, num_tokens=jnp.maximum(mask.sum(), 1), max_length=mask.shape[1])


def policy_logprobs(model, batch: RolloutBatch, cfg: OnlineSettings, *, temperature: float, with_values: bool = False):
    """The policy's log-probs (and entropy, values) of the batch's completion tokens, one forward pass."""
    # attend to every completion token (completion_mask): a multi-turn trajectory's environment tokens
    # are context the policy saw while sampling, though the loss (loss_mask) leaves them out
    out = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                              temperature=temperature, with_entropy=True, with_values=with_values,
                              prompt_group=batch.prompt_group)
    if not cfg.entropy_coef:
        # logged only: XLA does not drop 0 * entropy, so without this the backward pass would run
        # through the [B, N, V] entropy computation for nothing.
        out["entropy"] = jax.lax.stop_gradient(out["entropy"])
    return out


def clipped_loss(out: dict, batch: RolloutBatch, cfg: ClipSettings, *, num_rows, num_tokens, max_length,
                 kl_in_loss: bool = False, kl_estimator: str = "k3", reduction: str | None = None):
    """``policy_gradient_loss`` of the policy's ``out`` on ``batch`` with ``cfg``'s clip settings;
    the KL term enters the loss only when ``kl_in_loss`` (GRPO); ``reduction`` defaults to ``cfg``'s."""
    kl = kl_in_loss and cfg.kl_coef > 0
    return policy_gradient_loss(
        out["logprobs"], batch.old_logprobs, batch.advantages, batch.loss_mask,
        ratio_level=cfg.ratio_level, epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high,
        dual_clip=cfg.dual_clip, entropy=out["entropy"], entropy_coef=cfg.entropy_coef,
        ref_logprobs=batch.ref_logprobs if kl else None, kl_coef=cfg.kl_coef if kl else 0.0,
        kl_estimator=kl_estimator, reduction=reduction or cfg.reduction, num_sequences=num_rows, num_tokens=num_tokens,
        max_length=max_length, **correction_args(batch, cfg),
    )


def correction_args(batch: RolloutBatch, cfg: OnlineSettings) -> dict:
    """The policy loss's off-policy keyword arguments (``sampling_logprobs``, ``off_policy_correction``,
    ``correction_bounds``) for ``cfg.off_policy_correction``; none at all for ``"none"``, so the loss is
    the one it was without the setting."""
    if cfg.off_policy_correction == "none":
        return {}
    if batch.sampling_logprobs is None:
        raise ValueError(f"algorithm.off_policy_correction={cfg.off_policy_correction!r} needs the batch's "
                         "sampling_logprobs (the sampler's log-probs; the online trainer fills them, and "
                         "recomputes old_logprobs, when the setting is on)")
    return dict(sampling_logprobs=batch.sampling_logprobs, off_policy_correction=cfg.off_policy_correction,
                correction_bounds=cfg.correction_bounds)


def kl_token_rewards(batch: RolloutBatch, cfg, *, estimator: str, missing_eos_penalty=None) -> jax.Array:
    """``[R, N]`` per-token rewards with the KL in the reward (``rljax.advantages.kl_shaped_rewards``):
    ``−β k_t`` on every counted token, the score (less the EOS penalty) on the last one. Without a KL
    term (``kl_coef`` 0) the reference is the sampler itself, so the penalty is 0."""
    mask = batch.loss_mask.astype(batch.old_logprobs.dtype)
    scores = batch.scores * batch.row_mask
    ref = batch.ref_logprobs if cfg.kl_coef else batch.old_logprobs
    return adv.kl_shaped_rewards(scores, batch.old_logprobs, ref, mask, kl_coef=cfg.kl_coef, estimator=estimator,
                                 eos_found=batch.finished if missing_eos_penalty is not None else None,
                                 missing_eos_penalty=missing_eos_penalty)


def sequence_kl_scores(batch: RolloutBatch, cfg, *, estimator: str) -> jax.Array:
    """``[R]`` scores with the KL in the reward at sequence level, ``R_i = score_i − β Σ_t k_t``
    (TRL ``RLOOTrainer``); the scores alone when ``kl_coef`` is 0."""
    scores = jnp.where(batch.row_mask, batch.scores, 0.0)
    if not cfg.kl_coef:
        return scores
    mask = batch.loss_mask.astype(jnp.float32)
    token_rewards = adv.kl_shaped_rewards(scores, batch.old_logprobs, batch.ref_logprobs, mask,
                                          kl_coef=cfg.kl_coef, estimator=estimator)
    return (token_rewards * mask).sum(axis=-1)


__all__ = ["ClipSettings", "KLEstimator", "OnlineSettings", "Reduction", "clipped_loss", "correction_args",
           "kl_token_rewards", "policy_logprobs", "reward_kl_estimator", "sequence_kl_scores", "totals"]
