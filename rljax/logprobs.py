"""Per-token log-probabilities and entropies from logits, shared by the sampler and the trainer;
the trainer's forward passes over prompt + completion (log-probs, values, sequence rewards).

Both sides divide the logits by the sampling temperature before the softmax, so the sampler's
log-probs and the training forward pass's log-probs of the same tokens agree to float32 precision
(that is what makes "on-policy" exactly on-policy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _scaled(logits: jax.Array, temperature: float) -> jax.Array:
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # float64 stays float64
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


def _forward_prompt_completion(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> jax.Array:
    """Hidden states ``[B, P + N, D]`` of prompt ``[B, P]`` (left-padded) followed by completion ``[B, N]``.

    The one place the trainer's forward passes join prompt and completion; ``model`` is any object
    with ``forward(ids, mask) -> (hidden, cache)`` (rljax.models.Transformer).
    """
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)
    hidden, _ = model.forward(ids, mask)
    return hidden


def _before_each_completion_token(hidden: jax.Array, prompt_length: int, completion_length: int) -> jax.Array:
    """``[B, N, D]``: the states that predict the completion tokens (position t predicts token t + 1)."""
    return hidden[:, prompt_length - 1 : prompt_length + completion_length - 1]


def chunked_logprobs(
    logits_fn,
    hidden: jax.Array,
    tokens: jax.Array,
    chunk: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    with_argmax: bool = False,
) -> dict[str, jax.Array]:
    """Log-probs (and entropies, most likely tokens) ``[B, N]`` of ``tokens`` from hidden states
    ``[B, N, D]``, ``chunk`` positions at a time, never holding more than ``[B, chunk, V]`` logits,
    forward or backward.

    The same values as ``token_logprobs(logits_fn(hidden), tokens)`` (and ``entropy``): each chunk's
    logits are computed, reduced to ``[B, chunk]`` and dropped inside a ``lax.map``, and the chunk
    body is rematerialised (``jax.checkpoint``), so the backward pass recomputes one chunk's logits
    at a time instead of keeping all ``N / chunk`` of them (the full pass holds several logits-sized
    float32 arrays; the memory figures: docs/performance.md#chunked-log-probs). At
    16 completions x 1,024 tokens x a 152k vocabulary the logits alone are 10 GB; with
    ``chunk=128``, 1.2 GB. The cost is one more vocabulary projection per chunk in the backward
    pass. ``N`` need
    not divide by ``chunk``: the last chunk is padded and its padding dropped. ``logits_fn`` maps
    ``[B, c, D]`` to float32 ``[B, c, V]`` (``Transformer.logits``).
    """
    B, N, D = hidden.shape
    pad = -N % chunk
    n = (N + pad) // chunk
    # [n, B, chunk, ...]: lax.map walks the leading axis
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
    t = jnp.pad(tokens, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(h_c, t_c):
        logits = logits_fn(h_c)
        lp = token_logprobs(logits, t_c, temperature=temperature)
        return (lp, entropy(logits, temperature=temperature) if with_entropy else None,
                jnp.argmax(logits, axis=-1) if with_argmax else None)

    lp, ent, top = jax.lax.map(lambda x: one(*x), (h, t))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(B, N + pad)[:, :N]  # noqa: E731
    out = {"logprobs": unchunk(lp)}
    if with_entropy:
        out["entropy"] = unchunk(ent)
    if with_argmax:
        out["argmax"] = unchunk(top)
    return out


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
    with_argmax: bool = False,
    prompt_group: int = 1,
) -> dict[str, jax.Array]:
    """Log-probs ``[B, N]`` of completion tokens given left-padded prompts, in one forward pass.

    prompt_ids/prompt_mask ``[B, P]`` (left-padded), completion_ids/completion_mask ``[B, N]``
    (right-padded). Returns ``{"logprobs": [B, N]}`` plus ``"entropy"`` ``[B, N]`` and ``"values"``
    ``[B, N]`` (the value head's estimate at the state *before* each completion token) and ``"argmax"``
    ``[B, N]`` (the most likely token at each completion position; token accuracy) when asked.
    Logits are computed only for the N positions that predict completion tokens; when the model's
    static ``logits_chunk`` is set (config ``model.logits_chunk``) and smaller than N, they are
    computed ``logits_chunk`` positions at a time (:func:`chunked_logprobs`), same values, less memory.
    ``prompt_group`` K > 1 says the rows come in runs of K consecutive rows with the same prompt (a
    GRPO group: ``RolloutBatch.prompt_group``); then each run is one packed row when that is less
    work (:func:`completion_states`), the same values to float32 rounding.
    """
    hidden = completion_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_group)
    out = _logprobs_from_states(model, hidden, completion_ids, temperature=temperature, with_entropy=with_entropy,
                                with_argmax=with_argmax)
    if with_values:
        out["values"] = model.values(hidden)
    return out


def completion_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_group: int = 1):
    """``[B, N, D]``: the final hidden states that predict each completion token (position t predicts
    token t + 1), from one forward pass.

    With ``prompt_group`` K > 1 (the caller's promise: rows ``k·K .. k·K + K - 1`` share one prompt,
    ids and mask) and when :func:`packing_saves` says so, each run of K rows is one packed row
    ``prompt | completion 1 | ... | completion K`` (:func:`packed_completion_states`): the prompt goes
    through the model once instead of K times. Otherwise (K = 1, B not a multiple of K, or packing
    would cost more) the rows run as they are.

    Why: GRPO's G completions of a prompt share it. Repeating it in each row runs it G times; the
    GRPO benchmark's rows (4 prompts x 4 completions, 40 prompt + 64 completion tokens) are 1,664
    token-positions unpacked and 1,184 packed, and the passes are faster by about that much (see
    docs/performance.md#prompt-packing); the log-probs are equal (tests/integration/test_logprobs_packed.py).
    """
    B, P = prompt_ids.shape
    N = completion_ids.shape[1]
    K = prompt_group
    config = getattr(model, "config", None)
    if K > 1 and B % K == 0 and config is not None and packing_saves(config, P, N, K):
        states = packed_completion_states(model, prompt_ids[::K], prompt_mask[::K],
                                          completion_ids.reshape(B // K, K, N), completion_mask.reshape(B // K, K, N))
        return states[:, :, :N].reshape(B, N, states.shape[-1])
    hidden = _forward_prompt_completion(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    return _before_each_completion_token(hidden, P, N)


def packing_saves(config, prompt_length: int, completion_length: int, group: int) -> bool:
    """Whether one packed row ``prompt | K completions`` costs fewer FLOPs than K rows ``prompt |
    completion`` (forward or backward alike), for a model of ``config`` (``ModelConfig``).

    Per layer, a token costs ``2·W`` (W: the block's matmul weights) and a (query, key) pair ``4·H·hd``
    (scores and weighted values; the passes compute every pair of a row, masked or not). Unpacked:
    ``K·(T·2W + T²·4·H·hd)`` with ``T = P + N``; packed: the same with ``T = P + K·N`` once. Packing
    saves the prompt's K - 1 repeats and pays ``K²`` more attention pairs per completion, so it wins
    for short completions after a long enough prompt and loses for long ones (P=40, N=64, K=4 on
    SmolLM2-135M: 25% fewer FLOPs; N=1024, K=16: 4.5x more). A row longer than the model's
    ``sliding_window`` is never packed (the passes support sequences within the window only).
    """
    K, P, N = group, prompt_length, completion_length
    packed_length = P + K * N
    if K < 2 or (config.sliding_window and packed_length > config.sliding_window):
        return False
    D, H, KVH, hd, F = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    weights = D * H * hd * 2 + D * KVH * hd * 2 + 3 * D * F  # q and o, k and v, gate/up/down
    cost = lambda rows, T: rows * (T * 2 * weights + T * T * 4 * H * hd)  # noqa: E731
    return cost(1, packed_length) < cost(K, P + N)


def _logprobs_from_states(model, hidden, tokens, *, temperature=1.0, with_entropy=False, with_argmax=False):
    """Log-probs (entropies, argmax) ``[B, N]`` of ``tokens`` from the states ``[B, N, D]`` that predict
    them: all N positions' logits at once, or ``model.logits_chunk`` at a time when that is smaller."""
    chunk = getattr(model, "logits_chunk", None)
    if chunk and chunk < tokens.shape[1]:
        return chunked_logprobs(model.logits, hidden, tokens, chunk, temperature=temperature,
                                with_entropy=with_entropy, with_argmax=with_argmax)
    logits = model.logits(hidden)  # [B, N, V]
    out = {"logprobs": token_logprobs(logits, tokens, temperature=temperature)}
    if with_entropy:
        out["entropy"] = entropy(logits, temperature=temperature)
    if with_argmax:
        out["argmax"] = jnp.argmax(logits, axis=-1)
    return out


def packed_completion_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> jax.Array:
    """``[B, K, N + 1, D]``: for each of the K completions of each prompt, the final hidden state after
    the prompt and the completion's first ``t`` tokens, ``t = 0 .. N`` (``t = 0``: the prompt's last
    token), from ONE forward pass over the packed row ``prompt | completion 1 | ... | completion K``.

    Prompts ``[B, P]`` left-padded; completions ``[B, K, N]`` right-padded (an all-padding completion
    is allowed). Completion ``k``'s tokens are segment ``k + 1`` of the row (``Transformer.forward``'s
    ``segments``): they attend to the prompt and to their own earlier tokens only, at the positions
    they would have after the prompt alone, so every state equals that of the unpacked pass
    ``_forward_prompt_completion(prompt, completion k)`` (to float32 rounding; tests/integration/test_logprobs_packed.py).

    Why: pairwise and ranked offline losses (DPO, reward models) score K completions of one prompt.
    Repeating the prompt in each of K rows runs it K times; packed, the pass costs ``P + K·N``
    token-positions instead of ``K·(P + N)`` (prefix sharing, Wang et al. 2024, arXiv:2410.20305).
    On the rm_vs_trl pairs (K = 2, P = 48, N = 16 after bucketing) that is 80 instead of 128.
    """
    B, P = prompt_ids.shape
    _, K, N = completion_ids.shape
    ids = jnp.concatenate([prompt_ids, completion_ids.reshape(B, K * N)], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask.reshape(B, K * N)], axis=1)
    prompt_positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=-1) - 1, 0)
    after_prompt = jnp.sum(prompt_mask != 0, axis=-1)[:, None]  # [B, 1]: the first completion token's position
    completion_positions = after_prompt + jnp.tile(jnp.arange(N), K)[None, :]  # [B, K·N]
    positions = jnp.concatenate([prompt_positions, completion_positions], axis=1).astype(jnp.int32)
    segments = jnp.broadcast_to(jnp.concatenate([jnp.zeros((P,), jnp.int32), jnp.repeat(jnp.arange(1, K + 1), N)]),
                                (B, P + K * N)).astype(jnp.int32)
    hidden, _ = model.forward(ids, mask, positions=positions, segments=segments)  # [B, P + K·N, D]
    D = hidden.shape[-1]
    last_prompt = jnp.broadcast_to(hidden[:, P - 1][:, None, None, :], (B, K, 1, D))
    return jnp.concatenate([last_prompt, hidden[:, P:].reshape(B, K, N, D)], axis=2)


def grouped_completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                                temperature: float = 1.0) -> jax.Array:
    """Log-probs ``[B, K, N]`` of K completions ``[B, K, N]`` per prompt ``[B, P]``: the values of
    :func:`completion_logprobs` on each (prompt, completion k) row, from one packed pass
    (:func:`packed_completion_states`)."""
    B, K, N = completion_ids.shape
    states = packed_completion_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    before = states[:, :, :N].reshape(B * K, N, -1)  # the state that predicts each completion token
    out = _logprobs_from_states(model, before, completion_ids.reshape(B * K, N), temperature=temperature)
    return out["logprobs"].reshape(B, K, N)


def grouped_sequence_rewards(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> jax.Array:
    """Scalar rewards ``[B, K]`` of K completions per prompt: :func:`sequence_rewards` of each (prompt,
    completion k) row (the value head at its last real token), from one packed pass."""
    states = packed_completion_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    count = jnp.sum(completion_mask != 0, axis=-1).astype(jnp.int32)  # [B, K]; 0 reads the prompt's last token
    at_last = jnp.take_along_axis(states, count[:, :, None, None], axis=2)[:, :, 0]  # [B, K, D]
    return model.values(at_last)


def completion_values(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> jax.Array:
    """Value-head estimates ``[B, N]`` at the state before each completion token (no logits).

    Prompts ``[B, P]`` left-padded, completions ``[B, N]`` right-padded; the same positions as
    ``completion_logprobs(..., with_values=True)["values"]``.
    """
    hidden = _forward_prompt_completion(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    return model.values(_before_each_completion_token(hidden, prompt_ids.shape[1], completion_ids.shape[1]))


def sequence_rewards(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> jax.Array:
    """Scalar reward ``[B]``: the value head at the last real token of prompt + completion.

    Prompts ``[B, P]`` left-padded, completions ``[B, N]`` right-padded, so the last real token sits
    at ``P - 1 + (number of completion tokens)``; an empty completion reads the last prompt token.
    """
    hidden = _forward_prompt_completion(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    last = prompt_ids.shape[1] - 1 + jnp.sum(completion_mask != 0, axis=-1)  # [B]
    at_last = jnp.take_along_axis(hidden, last[:, None, None].astype(jnp.int32), axis=1)[:, 0]  # [B, D]
    return model.values(at_last)
