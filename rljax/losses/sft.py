"""Supervised fine-tuning: the negative log-likelihood of the assistant's tokens of a transcript.

    loss = reduce_t( −m_{i,t} · log π_θ(y_{i,t} | y_{i,<t}) )            (``token_mean`` by default)

``m`` is 1 on tokens the assistant wrote (``rljax.data.transcripts``: system, user and tool tokens
are context, with mask 0 and so zero gradient). It is ``rljax.losses.records.weighted_nll_loss``
with every weight 1 (behaviour cloning of the demonstrations: the SFT stage of InstructGPT,
arXiv:2203.02155, and of the R1 recipe, arXiv:2501.12948). With the default ``token_mean`` and the
global token count as ``num_tokens`` a batch split into micro-batches gives the whole batch's
token-mean NLL.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from rljax.losses.records import weighted_nll_loss
from rljax.losses.reduce import masked_mean


def sft_loss(
    logprobs: chex.Array,
    mask: chex.Array,
    *,
    correct: chex.Array | None = None,
    reduction: str = "token_mean",
    num_sequences=None,
    num_tokens=None,
    max_length=None,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """NLL of the masked tokens, ``reduce(−log π[i, t])`` over ``mask`` (module docstring).

    Args:
      logprobs: ``[B, T]`` log π of the transcript's tokens.
      mask: ``[B, T]``, nonzero = an assistant token (the loss's tokens).
      correct: optional ``[B, T]`` bool/int, the model's most likely token is the target
        (for ``sft/token_accuracy``; no gradient).
      reduction, num_sequences, num_tokens, max_length: as ``rljax.losses.reduce.reduce_tokens``
        (global counts, so micro-batch parts sum to the whole-batch loss).
    Returns:
      ``(loss, metrics)``: ``sft/loss``; ``sft/nll`` (token-mean NLL of this batch) and with
      ``correct`` ``sft/token_accuracy`` (local, stop-gradient).
    """
    chex.assert_rank([logprobs, mask], 2)
    chex.assert_equal_shape([logprobs, mask])
    weights = jnp.ones(logprobs.shape[:1], logprobs.dtype)
    value, nll_metrics = weighted_nll_loss(logprobs, mask, weights, reduction=reduction, num_sequences=num_sequences,
                                           num_tokens=num_tokens, max_length=max_length)
    metrics = {"sft/loss": value, "sft/nll": nll_metrics["offline/nll"]}
    if correct is not None:
        chex.assert_equal_shape([correct, mask])
        metrics["sft/token_accuracy"] = masked_mean(correct.astype(jnp.float32), mask)
    return value, jax.lax.stop_gradient(metrics)
