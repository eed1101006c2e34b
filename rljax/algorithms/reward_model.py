"""Reward-model training: transformer + scalar head -> ``rljax.losses.reward_model``.

Wiring only. The reward of ``(prompt, response)`` is the value head at the last real token of
the response (its EOS when ``offline.append_eos``), as in InstructGPT (arXiv:2203.02155) and TRL's
``RewardTrainer``. Losses: pairwise Bradley–Terry with optional margin (Llama 2, arXiv:2307.09288)
and centring (arXiv:2312.09244), or InstructGPT's K-wise ranking loss over ranked lists
(``offline.rm_loss``).

A batch holds ``B`` prompts with ``K`` responses each (pairwise: ``K = 2``, chosen first; K-wise:
ranked best first): ``prompt_ids``/``prompt_mask`` ``[B, P]``, ``response_ids``/``response_mask``
``[B, K, N]``, ``response_valid`` ``[B, K]`` (K-wise lists shorter than K are padded), ``row_mask``
``[B]`` and, with a margin column, ``margin`` ``[B]``. All ``B·K`` responses share one forward pass.

The trained model is saved as a Hugging Face directory with ``value_head.safetensors``; the
``reward_model`` reward (``rljax.rewards.learned``) scores online rollouts with it.
"""

from __future__ import annotations

import jax.numpy as jnp

from rljax.algorithms.dpo import flatten_responses
from rljax.logprobs import sequence_rewards
from rljax.losses.reward_model import bradley_terry_loss, kwise_ranking_loss
from rljax.run_config import OfflineSection


def response_rewards(model, batch: dict) -> jnp.ndarray:
    """Rewards ``[B, K]`` of every response in the batch, in one forward pass."""
    B, K, _ = batch["response_ids"].shape
    return sequence_rewards(model, *flatten_responses(batch)).reshape(B, K)


def answer_mask(batch: dict) -> jnp.ndarray:
    """``[B, K]``: the response exists and its row is real."""
    return (batch["response_valid"] != 0) & (batch["row_mask"] != 0)[:, None]


def batch_totals(batch: dict, cfg: OfflineSection) -> dict:
    """Global denominators: pairs (pairwise) or prompts with at least one pair (K-wise)."""
    if cfg.rm_loss == "kwise":
        count = jnp.sum(jnp.sum(answer_mask(batch), axis=-1) >= 2, dtype=jnp.float32)
    else:
        count = jnp.sum(batch["row_mask"] != 0, dtype=jnp.float32)
    return {"count": jnp.maximum(count, 1.0)}


def rm_loss(rewards, batch: dict, cfg: OfflineSection, *, count=None):
    """The configured loss of rewards ``[B, K]``."""
    if cfg.rm_loss == "kwise":
        return kwise_ranking_loss(rewards, mask=answer_mask(batch), num_prompts=count)
    margin = batch.get("margin") if cfg.margin_column else None
    return bradley_terry_loss(rewards[:, 0], rewards[:, 1], margin=margin, centering_coef=cfg.centering_coef,
                              mask=batch["row_mask"], num_pairs=count)


def loss(model, batch: dict, cfg: OfflineSection, *, count):
    """``(loss, metrics)`` of one micro-batch; ``count`` is the whole batch's pair / prompt count."""
    return rm_loss(response_rewards(model, batch), batch, cfg, count=count)
