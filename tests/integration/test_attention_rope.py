"""The training/scoring attention path: rotary tables looked up per token (``rope_tables(length=)``)
and the head-major grouped-query attention (``_attention``), against plain references, eager and
jitted, values and gradients, with left padding and packed segments."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.transformer import _attention, init_model, positions_from_mask, rope_inverse_frequencies, rope_tables

CFG = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6,
                  num_kv_heads=2, head_dim=8)  # 3 query heads per key head


def _mask():
    return jnp.ones((3, 7), jnp.int32).at[0, :3].set(0).at[2, :1].set(0)  # left padding


@pytest.mark.parametrize("jit", [False, True])
def test_looked_up_rope_tables_equal_the_per_token_ones(jit):
    positions = positions_from_mask(_mask())
    inv_freq = rope_inverse_frequencies(CFG)
    def f(p, n):
        tables = lambda p: rope_tables(p, inv_freq, jnp.float32, length=n)  # noqa: E731
        return (jax.jit(tables) if jit else tables)(p)
    direct, looked_up = f(positions, None), f(positions, 7)
    for d, t in zip(direct, looked_up):
        assert d.shape == t.shape == (3, 7, 1, CFG.head_dim)
        np.testing.assert_allclose(np.asarray(t), np.asarray(d), rtol=0, atol=2e-7)
    # by hand: row 0's first real token is position 0 (cos 1, sin 0), its last (slot 6) position 3
    cos, sin = (np.asarray(a) for a in looked_up)
    np.testing.assert_allclose(cos[0, 3, 0], 1.0)
    np.testing.assert_allclose(sin[0, 3, 0], 0.0)
    angle = 3.0 * np.concatenate([inv_freq, inv_freq])
    np.testing.assert_allclose(cos[0, 6, 0], np.cos(angle), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sin[0, 6, 0], np.sin(angle), rtol=1e-6, atol=1e-7)


def _reference_attention(q, k, v, visible):
    """Every query head on its own (key/value heads repeated), softmax in float64 via numpy-style jnp."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(visible[:, None], probs, 0.0)  # fully masked (padded) queries: zero output
    return jnp.einsum("bhts,bshd->bthd", probs, v)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_head_major_attention_matches_per_head_reference(jit, packed):
    B, T, H, KVH, hd = 3, 7, 6, 2, 8
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, hd))
    k = jax.random.normal(keys[1], (B, T, KVH, hd))
    v = jax.random.normal(keys[2], (B, T, KVH, hd))
    mask = _mask()
    slots = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    segments = jnp.asarray([[0, 0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 2, 2]]) if packed else None
    visible = (mask[:, None, :] > 0) & (jnp.arange(T)[None, None, :] <= slots[:, :, None])
    if packed:
        visible = visible & ((segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None]))
    valid = np.asarray(visible.any(-1))  # queries that see at least one key (padding sees none)

    def ours(q, k, v):
        return _attention(q, k, v, mask, slots, segments, segments)

    f = jax.jit(ours) if jit else ours
    out, ref = np.asarray(f(q, k, v)), np.asarray(_reference_attention(q, k, v, visible))
    np.testing.assert_allclose(out[valid], ref[valid], rtol=1e-5, atol=2e-6)
    cot = jax.random.normal(keys[3], out.shape) * jnp.asarray(valid, jnp.float32)[:, :, None, None]
    grads = jax.vjp(f, q, k, v)[1](cot)
    ref_grads = jax.vjp(lambda *a: _reference_attention(*a, visible), q, k, v)[1](cot)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=5e-6)


def test_the_compiled_training_gradient_evaluates_cos_and_sin_once():
    """What rope_tables' lookup is for: XLA:CPU fused per-token cos/sin into every consumer (per
    head, per layer, forward and backward); looked up, each is evaluated once, for the table."""
    graphdef, params = nnx.split(init_model(CFG, seed=0))

    def loss(params, ids, mask):
        return jnp.sum(nnx.merge(graphdef, params)(ids, mask)[..., 0])

    ids = jnp.ones((3, 7), jnp.int32)
    text = jax.jit(jax.grad(loss)).lower(params, ids, _mask()).compile().as_text()
    assert len(re.findall(r"\bcosine\(", text)) == 1
    assert len(re.findall(r"\bsine\(", text)) == 1
