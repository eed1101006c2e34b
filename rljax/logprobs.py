"""Per-token log-probabilities and entropies from logits, shared by the sampler and the trainer.

Both sides divide the logits by the sampling temperature before the softmax, so the sampler's
log-probs and the training forward pass's log-probs of the same tokens agree to float32 precision
(that is what makes "on-policy" exactly on-policy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _scaled(logits: jax.Array, temperature: float) -> jax.Array:
    logits = logits.astype(jnp.float32)
    # temperature 0 means greedy decoding; its log-probs are those of the unscaled distribution.
    return logits if temperature in (0.0, 1.0) else logits / temperature


def token_logprobs(logits: jax.Array, tokens: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """``log softmax(logits / temperature)[token]``: logits ``[..., V]``, tokens ``[...]`` → ``[...]``."""
    scaled = _scaled(logits, temperature)
    picked = jnp.take_along_axis(scaled, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def entropy(logits: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """Entropy of ``softmax(logits / temperature)``: ``[..., V]`` → ``[...]``."""
    logp = jax.nn.log_softmax(_scaled(logits, temperature), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def completion_logprobs(
    model,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    completion_ids: jax.Array,
    completion_mask: jax.Array,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_values: bool = False,
) -> dict[str, jax.Array]:
    """Log-probs ``[B, N]`` of completion tokens given left-padded prompts, in one forward pass.

    prompt_ids/prompt_mask ``[B, P]`` (left-padded), completion_ids/completion_mask ``[B, N]``
    (right-padded). Returns ``{"logprobs": [B, N]}`` plus ``"entropy"`` ``[B, N]`` and ``"values"``
    ``[B, N]`` (the value head's estimate at the state *before* each completion token) when asked.
    Logits are computed only for the N positions that predict completion tokens.
    """
    P = prompt_ids.shape[1]
    N = completion_ids.shape[1]
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)
    hidden, _ = model.forward(ids, mask)
    hidden = hidden[:, P - 1 : P + N - 1]  # position t predicts token t + 1
    logits = model.logits(hidden)  # [B, N, V]
    out = {"logprobs": token_logprobs(logits, completion_ids, temperature=temperature)}
    if with_entropy:
        out["entropy"] = entropy(logits, temperature=temperature)
    if with_values:
        out["values"] = model.values(hidden)
    return out
