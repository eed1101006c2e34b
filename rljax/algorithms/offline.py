"""Learning from scored records ``(prompt, response, score)``: weighted maximum likelihood.

Every mode maximises a weighted log-likelihood of the logged responses, with a per-record weight
computed once over the training split from the scores (the evaluation split gets its own, by the
same rule). The modes (AWR, RWR, filtered BC), their formulas and the loss live in
``rljax.losses.records`` (``record_weights``, ``weighted_nll_loss``); this module is the wiring.

The weights are constants of the data (no gradient flows through them). A batch holds
``prompt_ids``/``prompt_mask`` ``[B, P]``, ``response_ids``/``response_mask`` ``[B, 1, N]``,
``weight`` ``[B]`` and ``row_mask`` ``[B]``.
"""

from __future__ import annotations

import jax.numpy as jnp

from rljax.logprobs import completion_logprobs
from rljax.losses.records import prompt_baselines, record_weights, weighted_nll_loss  # noqa: F401 (re-exported)
from rljax.losses.reduce import num_valid_sequences, num_valid_tokens
from rljax.run_config import OfflineSection


def _loss_mask(batch: dict) -> jnp.ndarray:
    return batch["response_mask"][:, 0] * (batch["row_mask"] != 0)[:, None].astype(batch["response_mask"].dtype)


def batch_totals(batch: dict, cfg: OfflineSection) -> dict:
    """Global token / sequence counts of a batch (before it is split into micro-batches)."""
    mask = _loss_mask(batch)
    return {"num_sequences": jnp.maximum(num_valid_sequences(mask), 1.0),
            "num_tokens": jnp.maximum(num_valid_tokens(mask), 1.0), "max_length": mask.shape[1]}


def loss(model, batch: dict, cfg: OfflineSection, *, num_sequences, num_tokens, max_length):
    """``(loss, metrics)`` of one micro-batch of records."""
    mask = _loss_mask(batch)
    logprobs = completion_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"][:, 0],
                                   mask)["logprobs"]
    return weighted_nll_loss(logprobs, mask, batch["weight"], reduction=cfg.reduction, num_sequences=num_sequences,
                             num_tokens=num_tokens, max_length=max_length)
