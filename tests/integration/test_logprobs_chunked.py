"""Chunked completion log-probs (``model.logits_chunk``): the values and gradients of the full pass,
with a fraction of its memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.config import ConfigError, from_yaml
from rljax.logprobs import chunked_logprobs, completion_logprobs, entropy, token_logprobs
from rljax.models.config import ModelConfig
from rljax.models.transformer import init_model
from rljax.run_config import RunConfig
from rljax.training import build_run
from tests._tiny import make_tiny_model_dir

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _batch(B=3, P=4, N=7, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    prompt_ids = jax.random.randint(k[0], (B, P), 1, CFG.vocab_size)
    completion_ids = jax.random.randint(k[1], (B, N), 1, CFG.vocab_size)
    prompt_mask = jnp.ones((B, P), jnp.int32).at[0, :2].set(0)  # row 0 left-padded
    completion_mask = jnp.ones((B, N), jnp.int32).at[1, 5:].set(0)  # row 1 right-padded
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])  # 7 positions: a padded last chunk (3) and none (1)
def test_chunked_logprobs_equal_the_full_pass(chunk, jit):
    # an algebraic equality: checked in float64, where the two summation orders agree to ~1e-15
    with jax.enable_x64(True):
        w = jax.random.normal(jax.random.key(0), (16, 50), jnp.float64) / 4
        hidden = jax.random.normal(jax.random.key(1), (2, 7, 16), jnp.float64)
        tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, 50)
        logits_fn = lambda h: jnp.einsum("bnd,dv->bnv", h, w)  # noqa: E731
        f = lambda h, t: chunked_logprobs(logits_fn, h, t, chunk, temperature=0.7, with_entropy=True)  # noqa: E731
        out = (jax.jit(f) if jit else f)(hidden, tokens)
        logits = logits_fn(hidden)
        assert out["logprobs"].shape == out["entropy"].shape == (2, 7)
        assert out["logprobs"].dtype == out["entropy"].dtype == jnp.float64
        want = token_logprobs(logits, tokens, temperature=0.7)
        np.testing.assert_allclose(out["logprobs"], want, atol=1e-12, rtol=1e-12)
        np.testing.assert_allclose(out["entropy"], entropy(logits, temperature=0.7), atol=1e-12, rtol=1e-12)
        assert "entropy" not in chunked_logprobs(logits_fn, hidden, tokens, chunk)


@pytest.mark.parametrize("jit", [False, True])
def test_the_loss_and_its_gradient_through_the_model_equal_the_unchunked_ones(jit):
    # an algebraic equality: checked in float64, where chunked and full passes agree to ~1e-15 on
    # every host (in float32 one of 1,952 gradient entries of size ~7 differed by 1.8e-6 on one host)
    with jax.enable_x64(True):
        _check_the_loss_and_its_gradient(jit)


def _check_the_loss_and_its_gradient(jit):
    model = init_model(CFG, seed=3, param_dtype=jnp.float64, dtype=jnp.float64)
    graphdef, params = nnx.split(model)
    assert all(p.dtype == jnp.float64 for p in jax.tree.leaves(params))
    batch = _batch()
    adv = jnp.asarray([1.0, -0.5, 2.0], jnp.float64)[:, None]

    def loss(params, chunk):
        m = nnx.merge(graphdef, params)
        m.logits_chunk = chunk
        out = completion_logprobs(m, *batch, temperature=0.9, with_entropy=True)
        mask = batch[3]
        return -jnp.sum((adv * out["logprobs"] + 0.01 * out["entropy"]) * mask) / jnp.sum(mask)

    grad = jax.value_and_grad(loss)
    if jit:
        grad = jax.jit(grad, static_argnums=1)
    (full, g_full), (chunked, g_chunked) = grad(params, None), grad(params, 3)
    assert full.dtype == jnp.float64
    np.testing.assert_allclose(chunked, full, atol=1e-12, rtol=1e-12)
    flat_full, flat_chunked = jax.tree.leaves(g_full), jax.tree.leaves(g_chunked)
    assert len(flat_full) == len(flat_chunked) and any(np.abs(g).max() > 1e-3 for g in flat_full)
    scale = max(float(np.abs(g).max()) for g in flat_full)  # ~7.6
    for a, b in zip(flat_full, flat_chunked):
        np.testing.assert_allclose(b, a, atol=1e-12 * scale, rtol=1e-10)


def test_the_gradient_holds_one_chunk_of_logits_not_all_of_them():
    """XLA's compiled temporary memory of the gradient: the full pass keeps several [B, N, V]
    float32 arrays alive, the chunked one about a chunk's worth of them."""
    B, N, D, V, chunk = 4, 256, 32, 4096, 32
    w = jax.random.normal(jax.random.key(0), (D, V)) / 6
    hidden = jax.random.normal(jax.random.key(1), (B, N, D))
    tokens = jax.random.randint(jax.random.key(2), (B, N), 0, V)
    logits_fn = lambda w, h: jnp.einsum("bnd,dv->bnv", h, w)  # noqa: E731

    def full(w, h):
        logits = logits_fn(w, h)
        return jnp.sum(token_logprobs(logits, tokens) + 0.1 * entropy(logits))

    def chunked(w, h):
        out = chunked_logprobs(lambda x: logits_fn(w, x), h, tokens, chunk, with_entropy=True)
        return jnp.sum(out["logprobs"] + 0.1 * out["entropy"])

    def temp_bytes(f):
        compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(w, hidden).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = B * N * V * 4
    assert temp_bytes(full) >= 2 * logits_bytes  # measured: 4.0x (67 MB)
    assert temp_bytes(chunked) < 0.75 * logits_bytes  # measured: 0.52x (8.7 MB); one chunk's logits are 1/8


def test_build_run_puts_the_execution_settings_on_the_policy(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "model")
    cfg = from_yaml(RunConfig, f"""
model: {{name: {model_dir}, lora_rank: 2, logits_chunk: 16, remat: block}}
train: {{run_dir: {tmp_path / 'run'}, progress: false}}
rewards: {{format: 1.0}}
""")
    run = build_run(cfg, value_head=False, total_updates=1)
    try:
        model = run.policy.model()
        assert (model.logits_chunk, model.remat) == (16, "block")
    finally:
        run.close()
    with pytest.raises(ConfigError, match="model.logits_chunk"):
        from_yaml(RunConfig, "model: {logits_chunk: 0}\nrewards: {format: 1.0}")
