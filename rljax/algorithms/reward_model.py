"""Reward-model training: transformer + scalar head -> ``rljax.losses.reward_model``.

Wiring only. The reward of ``(prompt, completion)`` is the value head at the last real token of the
completion (its EOS when ``append_eos``), as in InstructGPT (arXiv:2203.02155) and TRL's
``RewardTrainer`` (``rljax.logprobs.sequence_rewards``). Losses: pairwise Bradley–Terry with an
optional margin (Llama 2, arXiv:2307.09288) and centring (arXiv:2312.09244), or InstructGPT's
K-wise ranking loss over ranked lists (``rm_loss: kwise``).

Batches are ``PairBatch`` es: ``K = 2`` (chosen first) or ``K`` ranked completions (best first,
``completion_valid`` marks the ones a short list lacks); each prompt and its K completions are
packed in one row of one forward pass (``rljax.logprobs.grouped_sequence_rewards``: the prompt runs
once, not K times). The trained model is exported as a Hugging Face directory with ``value_head.safetensors``;
the ``reward_model`` reward (``rljax.rewards.learned``) scores online rollouts with it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax.numpy as jnp

from rljax.algorithms import _offline
from rljax.algorithms.base import OfflineAlgorithm
from rljax.batches import PairBatch
from rljax.config import check_range
from rljax.logprobs import grouped_sequence_rewards
from rljax.losses.reward_model import bradley_terry_loss, kwise_ranking_loss


@dataclasses.dataclass(frozen=True)
class RewardModelConfig(_offline.OfflineSettings):
    name: Literal["reward_model"] = "reward_model"
    rm_loss: Literal["pairwise", "kwise"] = "pairwise"
    chosen_column: str = "chosen"  # pairwise
    rejected_column: str = "rejected"  # pairwise
    margin_column: Optional[str] = None  # pairwise: -log σ(r+ - r- - margin) (Llama 2)
    ranked_column: str = "responses"  # kwise: a list of completions, best first
    task_responses: int = 4  # kwise from data.task: completions per prompt
    centering_coef: float = 0.0  # c * mean((r+ + r-)^2), Eisenstein et al. 2023 (TRL suggests 0.01); pairwise

    def validate(self) -> None:
        super().validate()
        if self.rm_loss == "kwise" and (self.margin_column or self.centering_coef):
            raise ValueError("margin_column and centering_coef are settings of rm_loss: pairwise")
        check_range(self, "task_responses", low=2)
        check_range(self, "centering_coef", low=0)


def scores(model, batch: PairBatch) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Rewards ``[B, K]`` of every completion (one forward pass) and their lengths ``[B, K]``."""
    rewards = grouped_sequence_rewards(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                       batch.completion_mask)
    return rewards, _offline.lengths(batch)


def answer_mask(batch: PairBatch) -> jnp.ndarray:
    """``[B, K]``: the completion exists and its row is real."""
    return (batch.completion_valid != 0) & (batch.row_mask != 0)[:, None]


def totals(batch: PairBatch, cfg: RewardModelConfig) -> dict:
    """Global denominators: pairs (pairwise) or prompts with at least two completions (K-wise)."""
    if cfg.rm_loss == "kwise":
        count = jnp.sum(jnp.sum(answer_mask(batch), axis=-1) >= 2, dtype=jnp.float32)
    else:
        count = jnp.sum(batch.row_mask != 0, dtype=jnp.float32)
    return {"num_rows": jnp.maximum(count, 1.0)}


def rm_loss(rewards, batch: PairBatch, cfg: RewardModelConfig, *, num_rows=None):
    """The configured loss of rewards ``[B, K]``."""
    if cfg.rm_loss == "kwise":
        return kwise_ranking_loss(rewards, mask=answer_mask(batch), num_prompts=num_rows)
    margin = batch.margin if cfg.margin_column else None
    return bradley_terry_loss(rewards[:, 0], rewards[:, 1], margin=margin, centering_coef=cfg.centering_coef,
                              mask=batch.row_mask, num_pairs=num_rows)


def loss(model, batch: PairBatch, cfg: RewardModelConfig, *, num_rows):
    """``(loss, metrics)`` of one micro-batch; ``num_rows`` is the whole batch's pair / prompt count."""
    return rm_loss(scores(model, batch)[0], batch, cfg, num_rows=num_rows)


def evaluate(rewards, lengths, data, cfg: RewardModelConfig) -> dict:
    """The reward-model objective and its metrics (accuracy, margin) on a held-out split."""
    n = len(data)
    margin = data.values.get("margin")
    batch = PairBatch(prompt_ids=None, prompt_mask=None, completion_ids=None, completion_mask=None,
                      completion_valid=jnp.asarray(lengths > 0, jnp.int32), row_mask=jnp.ones((n,), jnp.int32),
                      margin=None if margin is None else jnp.asarray(margin))
    value, metrics = rm_loss(jnp.asarray(rewards), batch, cfg)
    return {"loss": value, **metrics}


ALGORITHM = OfflineAlgorithm(name="reward_model", config=RewardModelConfig,
                             data_kind=lambda cfg: "ranked" if cfg.rm_loss == "kwise" else "pairs", loss=loss,
                             totals=totals, score=scores, evaluate=evaluate, value_head=True)
