"""The engine's device programs: a forward pass over paged keys and values, and per-request sampling.

Two jitted programs, both with the weights as arguments (new parameters after an update run without
a recompile) and the page pools donated (updated in place):

- :func:`prefill`: ``R`` rows of up to ``T`` new tokens each (a chunk of a prompt, or of a turn that
  extends a conversation already in pages); returns the logits of each row's last new token.
- :func:`decode`: one token for each of the engine's slots, then the next token of each row sampled
  with that row's own settings and key (:func:`sample_rows`).

A row is a sequence: its tokens' positions are ``start .. start + length - 1`` and its keys and
values live in the pages its page-table row lists. The layers run unrolled over the out-major
weights of :meth:`rljax.models.Transformer.decode_weights` (built once per set of weights, see
:func:`decode_weights`), with the transformer's own block (``_block(attend=...)``): only the cache
write and the attention differ from the static sampler's step, so the log-probs are the trainer's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from rljax.inference.attention import POOL_AXES, pool_shapes, ragged_paged_attention, write_kv
from rljax.models.transformer import rms_norm, rope_inverse_frequencies, rope_tables
from rljax.sampling import categorical_from_uniform
from rljax.sharding import active_mesh, active_rules, logical_to_spec

# Programs traced so far, by name (tests check that new weights or new requests do not recompile).
TRACES = {"prefill": 0, "decode": 0, "sample": 0, "weights": 0}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def decode_weights(graphdef, states) -> dict:
    """:meth:`Transformer.decode_weights` of the split model ``(graphdef, *states)``."""
    TRACES["weights"] += 1
    return nnx.merge(graphdef, *states).decode_weights()


def empty_pages(config, num_pages: int, page_size: int, dtype) -> tuple[tuple, tuple]:
    """Keys and values: one zeroed pool per layer each (:func:`rljax.inference.attention.pool_shapes`);
    under a mesh (``rljax.sharding.use_mesh``) split over it as the model's KV heads are."""
    mesh = active_mesh()

    def zeros(shape):
        sharding = None if mesh is None else NamedSharding(mesh, logical_to_spec(POOL_AXES, shape, mesh, active_rules()))
        return _zeros_program(shape, jnp.dtype(dtype), sharding)

    k_shape, v_shape = pool_shapes(num_pages, page_size, config.num_kv_heads, config.head_dim)
    k_zeros, v_zeros = zeros(k_shape), zeros(v_shape)
    return tuple(k_zeros() for _ in range(config.num_layers)), tuple(v_zeros() for _ in range(config.num_layers))


@functools.lru_cache(maxsize=64)
def _zeros_program(shape: tuple[int, ...], dtype, sharding):
    """One jitted zero-fill per (shape, dtype, sharding), so an engine built again with the same pool
    compiles nothing for it (a new lambda each time was a new program each time)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _forward(graphdef, states, weights, kv, tokens, start, length, page_table, live_pages):
    """Hidden states ``[R, T, D]`` of ``tokens`` at positions ``start + t``, and the updated pools."""
    model = nnx.merge(graphdef, *states)
    R, T = tokens.shape
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    x = model.embed[...].astype(model.dtype)[tokens]
    rope = rope_tables(positions, rope_inverse_frequencies(model.config), model.dtype)
    kv_len = start + length
    keys, values = [], []
    for lp, k_pages, v_pages in zip(weights["layers"], *kv):

        def attend(q, k, v, k_pages=k_pages, v_pages=v_pages):
            k_pages, v_pages = write_kv(k_pages, v_pages, k, v, page_table, start, length)
            out = ragged_paged_attention(q, k_pages, v_pages, page_table, kv_len, start, length,
                                         live_pages=live_pages)
            return out.astype(q.dtype), k_pages, v_pages

        x, k_pages, v_pages = model._block(x, lp, rope, None, None, None, None, None, out_major=True, attend=attend)
        keys.append(k_pages)
        values.append(v_pages)
    hidden = rms_norm(x, model.final_norm[...], model.config.rms_norm_eps)
    return model, hidden, (tuple(keys), tuple(values))


@functools.partial(jax.jit, static_argnames=("graphdef", "live_pages"), donate_argnames=("kv",))
def prefill(graphdef, states, weights, kv, tokens, start, length, page_table, live_pages=None):
    """Write the keys and values of ``tokens`` ``[R, T]`` (row r's first ``length[r]``) into the pages
    and return ``(kv, logits [R, V])`` of each row's last written token (float32)."""
    TRACES["prefill"] += 1
    model, hidden, kv = _forward(graphdef, states, weights, kv, tokens, start, length, page_table, live_pages)
    last = jnp.take_along_axis(hidden, jnp.maximum(length - 1, 0)[:, None, None], axis=1)[:, 0]
    return kv, model.decode_logits(last, weights)


@functools.partial(jax.jit, static_argnames=("graphdef", "live_pages", "filtered", "top"), donate_argnames=("kv",))
def decode(graphdef, states, weights, kv, tokens, start, active, page_table, sampling, live_pages=None,
           filtered=False, top=0):
    """One token per slot (``tokens`` ``[S]`` at positions ``start``; slots with ``active`` 0 write
    nothing), then the next token of every slot: ``(kv, next_tokens [S], logprobs [S], top_logprobs
    [S, top], top_ids [S, top])`` (see :func:`sample_rows`)."""
    TRACES["decode"] += 1
    model, hidden, kv = _forward(graphdef, states, weights, kv, tokens[:, None], start, active, page_table,
                                 live_pages)
    logits = model.decode_logits(hidden[:, 0], weights)
    return (kv, *_sample(logits, sampling, filtered, top))


@functools.partial(jax.jit, static_argnames=("filtered", "top"))
def sample(logits, sampling, filtered=False, top=0):
    """:func:`sample_rows` as its own program (the first token after a prefill)."""
    TRACES["sample"] += 1
    return _sample(logits, sampling, filtered, top)


def _sample(logits, sampling, filtered, top):
    return sample_rows(logits, sampling["seed"], sampling["counter"], sampling["temperature"],
                       sampling["top_k"], sampling["top_p"], filtered=filtered, top=top)


def sample_rows(logits, seeds, counters, temperature, top_k, top_p, *, filtered: bool = True, top: int = 0):
    """Per-row sampling: row ``r``'s next token and its log-prob under ``softmax(logits / T_r)``, and
    the ``top`` likeliest tokens' log-probs and ids under that same distribution (``[R, top]`` each,
    most likely first; what an OpenAI client's ``top_logprobs`` shows).

    logits ``[R, V]`` float32; seeds, counters, top_k ``[R]`` int; temperature, top_p ``[R]`` float.
    Row r draws with key ``fold_in(key(seeds[r]), counters[r])``: its tokens depend on its own seed and
    token index only, never on which rows share the batch. Temperature 0 is greedy. The log-prob is
    the one ``rljax.logprobs.token_logprobs`` gives the trainer (temperature 0 and 1 leave the logits
    unscaled); top-k and top-p (applied in that order, as :func:`rljax.sampling.filter_logits`)
    change which tokens can be drawn, not the log-probs. ``filtered=False`` promises that no row
    asks for top-k or top-p, which skips the sort.
    """
    greedy = temperature == 0
    scale = jnp.where(greedy | (temperature == 1), 1.0, temperature).astype(logits.dtype)
    scaled = logits / scale[:, None]
    drawable = filter_rows(scaled, top_k, top_p) if filtered else scaled
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds.astype(jnp.uint32), counters)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), categorical_from_uniform(u, drawable))
    logz = jax.nn.logsumexp(scaled, axis=-1)
    picked = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(scaled, top)
    return token, picked - logz, top_values - logz[:, None], top_ids.astype(jnp.int32)


def filter_rows(logits, top_k, top_p):
    """:func:`rljax.sampling.filter_logits` with a top-k ``[R]`` (0 = off) and top-p ``[R]`` (1 = off)
    per row: logits outside the row's top-k, then outside its nucleus, set to the dtype's minimum."""
    neg = jnp.finfo(logits.dtype).min
    V = logits.shape[-1]
    ordered = -jnp.sort(-logits, axis=-1)  # [R, V], descending
    kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)
    kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
    logits = jnp.where(logits < kth, neg, logits)
    ordered = jnp.where(ordered < kth, neg, ordered)  # still descending
    probs = jax.nn.softmax(ordered, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p[:, None] < 1) & (logits < threshold), neg, logits)


def copy_page(kv, source, target):
    """Copy page ``source`` onto page ``target`` in every layer (copy on write of a shared page)."""
    return _copy_page(kv, jnp.asarray(source, jnp.int32), jnp.asarray(target, jnp.int32))


@functools.partial(jax.jit, donate_argnames=("kv",))
def _copy_page(kv, source, target):
    return jax.tree.map(lambda pages: pages.at[target].set(pages[source]), kv)
