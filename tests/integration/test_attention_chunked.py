"""Query-chunked attention (``model.attention_chunk``): the numbers and gradients of dense
attention in training and scoring passes, with O(chunk * T) instead of O(T^2) score memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.config import ConfigError, from_yaml
from rljax.models.config import ModelConfig
from rljax.models.transformer import init_model
from rljax.run_config import RunConfig
from rljax.training import build_run
from tests._tiny import make_tiny_model_dir

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)  # grouped-query: 2 query heads per key head
F64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}  # under jax.enable_x64


def _inputs(B=3, T=7, seed=0):
    ids = jax.random.randint(jax.random.key(seed), (B, T), 1, CFG.vocab_size)
    mask = jnp.ones((B, T), jnp.int32).at[0, :3].set(0).at[2, :1].set(0)  # left padding
    return ids, mask


def _logits(params, graphdef, chunk, ids, mask):
    m = nnx.merge(graphdef, params)
    m.attention_chunk = chunk
    return m(ids, mask)


@pytest.mark.parametrize("chunk,jit", [(3, False), (3, True), (1, True), (6, True)])  # 7 queries: short last chunks (3, 6)
def test_chunked_attention_gives_the_dense_logits(chunk, jit):
    # an algebraic equality, checked in float64 (the same on every host to ~1e-15)
    with jax.enable_x64(True):
        graphdef, params = nnx.split(init_model(CFG, seed=1, **F64))
        ids, mask = _inputs()
        f = jax.jit(_logits, static_argnums=(1, 2)) if jit else _logits
        dense, chunked = f(params, graphdef, None, ids, mask), f(params, graphdef, chunk, ids, mask)
    valid = np.asarray(mask, bool)  # padded queries see no key: their outputs are not used anywhere
    assert dense.dtype == np.float64 and np.abs(np.asarray(dense)[valid]).max() > 0.1
    np.testing.assert_allclose(np.asarray(chunked)[valid], np.asarray(dense)[valid], atol=1e-12, rtol=1e-10)


def test_a_chunk_at_least_as_long_as_the_sequence_is_the_dense_pass():
    graphdef, params = nnx.split(init_model(CFG, seed=1))
    ids, mask = _inputs()
    np.testing.assert_array_equal(_logits(params, graphdef, 7, ids, mask), _logits(params, graphdef, None, ids, mask))


def test_the_gradient_equals_the_dense_one():
    # an algebraic equality, checked in float64 (the same on every host to ~1e-15)
    with jax.enable_x64(True):
        _check_the_gradient_equals_the_dense_one()


def _check_the_gradient_equals_the_dense_one():
    remat = "block"  # inside rematerialised blocks of a layer loop, as long passes run
    graphdef, params = nnx.split(init_model(CFG, seed=2, scan_layers=True, **F64))
    ids, mask = _inputs(seed=1)
    target = jax.random.randint(jax.random.key(9), ids.shape, 0, CFG.vocab_size)

    def loss(params, chunk):
        m = nnx.merge(graphdef, params)
        m.attention_chunk, m.remat = chunk, remat
        logp = jax.nn.log_softmax(m(ids, mask), axis=-1)
        picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        return -jnp.sum(picked * mask) / jnp.sum(mask)

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (dense, g_dense), (chunked, g_chunked) = grad(params, None), grad(params, 3)
    assert dense.dtype == jnp.float64
    np.testing.assert_allclose(chunked, dense, atol=1e-12, rtol=1e-12)
    leaves_dense, leaves_chunked = jax.tree.leaves(g_dense), jax.tree.leaves(g_chunked)
    assert any(np.abs(g).max() > 1e-3 for g in leaves_dense)
    # the same float64 sums in another order (the key and value gradients are summed over chunks):
    # differences of float64 rounding, scaled by each gradient's size
    for a, b in zip(leaves_dense, leaves_chunked):
        np.testing.assert_allclose(b, a, atol=1e-12 * np.abs(a).max(), rtol=1e-10)


def test_the_gradient_never_holds_every_query_s_scores():
    """XLA's compiled temporary memory of the gradient of a one-layer pass whose [B, H, T, T] float32
    scores dominate (T = 256, width 32): dense attention keeps several score-sized arrays (measured
    3.2x the scores since the head-major attention layout, 4.2x before), the chunked pass a few
    chunks' worth of them plus a fixed ~0.8x-scores rest of other activations (measured 1.04x the
    scores at chunk 32: at least two whole score arrays less than the dense pass)."""
    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    B, T, chunk = 2, 256, 32
    ids = jnp.ones((B, T), jnp.int32)
    mask = jnp.ones((B, T), jnp.int32)

    def temp_bytes(chunk):
        def loss(params):
            m = nnx.merge(graphdef, params)
            m.attention_chunk = chunk
            return jnp.sum(m(ids, mask)[..., 0])
        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    scores_bytes = B * cfg.num_heads * T * T * 4
    dense, chunked = temp_bytes(None), temp_bytes(chunk)
    assert dense >= 3 * scores_bytes, (dense, scores_bytes)
    assert chunked <= dense - 2 * scores_bytes, (chunked, dense, scores_bytes)
    assert chunked <= 1.1 * scores_bytes, (chunked, scores_bytes)


def test_build_run_puts_the_setting_on_the_policy(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model")
    cfg = from_yaml(RunConfig, f"""
model: {{name: {model_dir}, lora_rank: 2, attention_chunk: 64}}
train: {{run_dir: {tmp_path / 'run'}, progress: false}}
rewards: {{format: 1.0}}
""")
    run = build_run(cfg, value_head=False, total_updates=1)
    try:
        assert run.policy.model().attention_chunk == 64
    finally:
        run.close()
    with pytest.raises(ConfigError, match="model.attention_chunk"):
        from_yaml(RunConfig, "model: {attention_chunk: 0}\nrewards: {format: 1.0}")
