"""Batched generation under ``jit`` with a KV cache: prefill, then a ``lax.while_loop`` decode loop.

``generate`` takes left-padded prompts and returns, per row, the completion tokens, the per-token
log-probs of ``softmax(logits / temperature)`` (the distribution the trainer recomputes; top-k/top-p
truncation changes which tokens can be drawn but not these log-probs), the completion mask (1 up to
and including the stop token) and whether the row stopped. The same key gives the same output.

Prompt length and batch size are padded up to a few bucket sizes before the jitted call, so a long
run compiles a bounded number of programs (``trace_count()`` reports how many traces happened).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.buckets import bucket_length
from rljax.logprobs import token_logprobs
from rljax.models.transformer import LayerKVCache, Transformer

_TRACES = {"count": 0}


def trace_count() -> int:
    """How many times the generation program has been traced (= compiled) in this process."""
    return _TRACES["count"]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. ``temperature == 0`` is greedy decoding; ``top_k == 0`` and ``top_p == 1`` are off."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # never stop early (fixed-length benchmarks)
    pad_token_id: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@flax.struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B, N] int32, pad_token_id after the stop token
    logprobs: jax.Array  # [B, N] float32, 0 where mask is 0
    mask: jax.Array  # [B, N] int32, 1 for generated tokens up to and including the stop token
    finished: jax.Array  # [B] bool, True if the row emitted a stop token

    @property
    def lengths(self) -> jax.Array:
        return self.mask.sum(axis=-1)


def generate(
    model: Transformer | tuple,
    input_ids,
    attention_mask,
    key: jax.Array,
    config: SamplingConfig,
    *,
    bucket: bool = True,
    prompt_group: int = 1,
) -> SampleOutput:
    """Sample completions for a left-padded batch ``input_ids``/``attention_mask`` ``[B, P]``.

    ``model`` is a :class:`Transformer` or its split ``(graphdef, state, ...)`` (what a trainer holds,
    e.g. ``(graphdef, trainable, frozen)``).
    With ``bucket=True`` the prompt length is padded to 16, 20, 24, 28, 32, 40, ... and the batch to
    8, 10, 12, 14, 16, 20, ... (``rljax.buckets``) before the jitted call; the result is cut back to ``[B, N]``.
    ``prompt_group`` K > 1 is the caller's promise that rows ``k·K .. k·K + K - 1`` hold one prompt (a
    GRPO group): the prefill then runs each prompt once and its cache serves the K rows (when B and
    the bucketed batch are multiples of K; else every row is prefilled).
    """
    graphdef, *states = nnx.split(model) if isinstance(model, nnx.Module) else model
    input_ids = np.asarray(input_ids, np.int32) if not isinstance(input_ids, jax.Array) else input_ids
    attention_mask = np.asarray(attention_mask, np.int32) if not isinstance(attention_mask, jax.Array) else attention_mask
    B, P = input_ids.shape
    # padding rows (all the same) make whole groups when the padded batch is a multiple of K
    group = prompt_group if prompt_group > 1 and B % prompt_group == 0 else 1
    if bucket:
        P_b, B_b = bucket_length(P, 16), bucket_length(B, 8)
        group = group if B_b % group == 0 else 1
        pad = ((0, B_b - B), (P_b - P, 0))
        input_ids = jnp.pad(jnp.asarray(input_ids, jnp.int32), pad, constant_values=config.pad_token_id)
        attention_mask = jnp.pad(jnp.asarray(attention_mask, jnp.int32), pad)
    out = _generate(graphdef, tuple(states), jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32),
                    key, config, group)
    if bucket:
        out = jax.tree.map(lambda x: x[:B], out)
    return out


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. logits ``[B, V]``."""
    neg = jnp.finfo(logits.dtype).min
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        keep = (cum - jax.nn.softmax(sorted_logits, axis=-1)) < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, neg, logits)
    return logits


def sample_categorical(key: jax.Array, logits: jax.Array, block: int = 256) -> jax.Array:
    """One draw per row from ``softmax(logits)`` ``[B, V]`` by inverse CDF, from one uniform per row.

    ``jax.random.categorical`` (Gumbel-max) draws B * V random numbers; on CPU that and its argmax
    cost more than the lm_head matmul (docs/performance.md#smaller-things). Here:
    pick a block of ``block`` tokens by its probability mass, then a token inside the block, by
    cumulative sums in float32, so like Gumbel-max in float32 only tokens below about 1e-7 of the
    mass are mis-weighted. Tokens with zero probability (filtered to the dtype's minimum) are never
    drawn. Same key, same draws; different draws from ``jax.random.categorical`` for the same key.
    """
    return categorical_from_uniform(jax.random.uniform(key, (logits.shape[0],), jnp.float32), logits, block)


def categorical_from_uniform(u: jax.Array, logits: jax.Array, block: int = 256) -> jax.Array:
    """:func:`sample_categorical`'s draw from given uniforms ``u`` ``[B]`` in [0, 1) (one per row, so a
    caller can give each row its own key)."""
    B, V = logits.shape
    nb = -(-V // block)
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # unnormalised, [B, V]
    probs = jnp.pad(probs, ((0, 0), (0, nb * block - V))).reshape(B, nb, block)
    mass = probs.sum(axis=-1)  # [B, nb]
    cdf = jnp.cumsum(mass, axis=-1)
    u = u[:, None].astype(cdf.dtype) * cdf[:, -1:]
    # first block whose cumulative mass exceeds u; never past the last block with mass (u can round up
    # to the total)
    blk = jnp.minimum(jnp.sum(cdf <= u, axis=-1), nb - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1))
    rest = u[:, 0] - jnp.take_along_axis(cdf - mass, blk[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(probs, blk[:, None, None], axis=1)[:, 0]  # [B, block]
    idx = jnp.sum(jnp.cumsum(inner, axis=-1) <= rest[:, None], axis=-1)
    idx = jnp.minimum(idx, block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1))
    return (blk * block + idx).astype(jnp.int32)


def _pick(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Next token ``[B]`` and its log-prob under ``softmax(logits / temperature)``."""
    if config.temperature == 0.0:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        scaled = logits / config.temperature
        filtered = filter_logits(scaled, config.top_k, config.top_p)
        token = sample_categorical(key, filtered)
    return token, token_logprobs(logits, token, temperature=config.temperature)


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "prompt_group"))
def _generate(graphdef, states, input_ids, attention_mask, key, config: SamplingConfig,
              prompt_group: int = 1) -> SampleOutput:
    _TRACES["count"] += 1
    model = nnx.merge(graphdef, *states)
    B, P = input_ids.shape
    N = config.max_new_tokens
    stop_ids = jnp.asarray(config.stop_token_ids or (-1,), jnp.int32)
    use_stop = bool(config.stop_token_ids) and not config.ignore_eos

    positions = jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)
    K = prompt_group
    # One prefill per distinct prompt, its cache and last state repeated for the K rows of its group
    # (the rows then differ from their first sampled token on). GRPO benchmark (16 rows = 4 prompts x 4,
    # 40-token prompts, SmolLM2-135M): the prefill is 1/4 of the work.
    cache = model.init_cache(B // K, P + N)
    hidden, cache = model.forward(input_ids[::K], attention_mask[::K], positions=positions[::K], cache=cache)
    if K > 1:
        cache = cache.replace(keys=jnp.repeat(cache.keys, K, axis=1), values=jnp.repeat(cache.values, K, axis=1),
                              mask=jnp.repeat(cache.mask, K, axis=0))
        hidden = jnp.repeat(hidden[:, -1:], K, axis=0)
    weights = model.decode_weights()  # see the decode loop's comment
    logits = model.decode_logits(hidden[:, -1], weights)  # [B, V]
    next_position = attention_mask.sum(axis=-1).astype(jnp.int32)  # [B]

    token, logp = _pick(logits, jax.random.fold_in(key, 0), config)
    done = jnp.isin(token, stop_ids) if use_stop else jnp.zeros((B,), bool)
    tokens = jnp.full((B, N), config.pad_token_id, jnp.int32).at[:, 0].set(token)
    # log-probs are kept in float32 whatever the model's dtype (a float64 model's rounded here, explicitly:
    # an implicit float64 -> float32 scatter is deprecated in JAX)
    logprobs = jnp.zeros((B, N), jnp.float32).at[:, 0].set(logp.astype(jnp.float32))
    mask = jnp.zeros((B, N), jnp.int32).at[:, 0].set(1)

    def cond(carry):
        i, _, _, _, _, _, done = carry
        return (i < N) & ~jnp.all(done)

    # The decode loop runs the layers unrolled over weights sliced (and laid out out-major) once, above,
    # and a cache held as one array per layer: a layer scan inside the loop would copy each layer's
    # weights and cache out of the stacked arrays on every step (on CPU, about half of the step's
    # time). The price: during a generate call the sliced weights are a second copy of the layer
    # weights and of an untied lm_head (of each device's shard under FSDP), and the decode body
    # compiles once per layer (compile time grows with depth).
    cache = LayerKVCache.from_stacked(cache)

    def body(carry):
        i, cache, token, tokens, logprobs, mask, done = carry
        pos = (next_position + i - 1)[:, None]
        hidden, cache = model.decode_step(token[:, None], pos, cache, weights)
        new_token, new_logp = _pick(model.decode_logits(hidden[:, 0], weights), jax.random.fold_in(key, i), config)
        alive = ~done
        new_token = jnp.where(alive, new_token, config.pad_token_id)
        tokens = tokens.at[:, i].set(new_token)
        logprobs = logprobs.at[:, i].set(jnp.where(alive, new_logp, 0.0).astype(jnp.float32))
        mask = mask.at[:, i].set(alive.astype(jnp.int32))
        if use_stop:
            done = done | (alive & jnp.isin(new_token, stop_ids))
        return i + 1, cache, new_token, tokens, logprobs, mask, done

    init = (jnp.asarray(1, jnp.int32), cache, token, tokens, logprobs, mask, done)
    _, _, _, tokens, logprobs, mask, done = jax.lax.while_loop(cond, body, init)
    return SampleOutput(tokens=tokens, logprobs=logprobs, mask=mask, finished=done)
