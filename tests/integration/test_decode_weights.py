"""The sampler's decode step over out-major weights (``Transformer.decode_weights``) against the full
forward pass, for every layout of the model family: tied and untied heads, biases, q/k norms, LoRA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.logprobs import completion_logprobs
from rljax.models.config import ModelConfig
from rljax.models.transformer import LayerKVCache, _out_major_matmul, init_model
from rljax.sampling import SamplingConfig, generate

BASE = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8)
VARIANTS = {
    "llama untied": (BASE, {}),
    "qwen2 tied, q/k/v biases": (dataclasses.replace(BASE, model_type="qwen2", qkv_bias=True,
                                                     tie_word_embeddings=True), {}),
    "qwen3 q/k norm, all biases": (dataclasses.replace(BASE, model_type="qwen3", qk_norm=True, qkv_bias=True,
                                                       o_bias=True), {}),
    "llama LoRA": (BASE, {"lora_rank": 4}),
}


def _model(name, **dtypes):
    config, kwargs = VARIANTS[name]
    model = init_model(config, seed=7, **kwargs, **dtypes)
    rng = np.random.RandomState(0)
    for k, p in model.layers.items():
        if k.endswith("_lora_b") or k.startswith("b"):  # zero-initialised: give them values to test
            p[...] = jnp.asarray(rng.randn(*p[...].shape) * 0.1, p[...].dtype)
    return model


def test_out_major_matmul_is_x_times_w_transposed():
    w = jnp.arange(12.0).reshape(3, 4)  # [out 3, in 4]
    x = jnp.asarray([[1.0, 0, 0, 0], [0, 1, 0, 2]])  # [M 2, in 4]
    want = [[0.0, 4, 8], [1 + 2 * 3, 5 + 2 * 7, 9 + 2 * 11]]  # row m, column o: sum_i x[m, i] w[o, i]
    for f in (_out_major_matmul, jax.jit(_out_major_matmul)):
        np.testing.assert_array_equal(np.asarray(f(w, x)), want)


@pytest.mark.parametrize("name", VARIANTS)
def test_decode_step_and_logits_equal_the_cached_forward(name):
    # an algebraic equality (the same sums over transposed weights), checked in float64
    with jax.enable_x64(True):
        _check_decode_step_equals_the_cached_forward(name)


def _check_decode_step_equals_the_cached_forward(name):
    model = _model(name, param_dtype=jnp.float64, dtype=jnp.float64)
    ids = jnp.asarray([[0, 0, 5, 6, 7], [1, 2, 3, 4, 9]], jnp.int32)
    mask = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
    positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
    cache = model.init_cache(2, 8)
    _, cache = model.forward(ids, mask, positions=positions, cache=cache)
    token, pos = jnp.asarray([[11], [12]], jnp.int32), positions[:, -1:] + 1
    ones = jnp.ones((2, 1), jnp.int32)
    want_hidden, want_cache = model.forward(token, ones, positions=pos, cache=cache)

    weights = model.decode_weights()
    # out-major: wq [D, H, hd] becomes [H, hd, D]; w_down [F, D] becomes [D, F]
    assert weights["layers"][0]["wq"].shape == (4, 8, 32) and weights["layers"][0]["w_down"].shape == (32, 48)
    assert weights["head"].shape == (97, 32)

    def step(weights, cache):
        hidden, new = model.decode_step(token, pos, LayerKVCache.from_stacked(cache), weights)
        return hidden, model.decode_logits(hidden[:, 0], weights), new

    for f in (step, jax.jit(step)):
        hidden, logits, new = f(weights, cache)
        assert logits.dtype == new.keys[0].dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(want_hidden), atol=1e-12, rtol=1e-10)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(model.logits(want_hidden[:, 0])), atol=1e-12,
                                   rtol=1e-10)
        np.testing.assert_allclose(np.asarray(jnp.stack(new.keys)), np.asarray(want_cache.keys), atol=1e-12, rtol=1e-10)
        np.testing.assert_array_equal(np.asarray(new.mask), np.asarray(want_cache.mask))


@pytest.mark.parametrize("name", VARIANTS)
def test_sampler_logprobs_equal_the_trainers_for_every_layout(name):
    model = _model(name)
    ids = jnp.asarray([[0, 0, 5, 6, 7]] * 2 + [[1, 2, 3, 4, 9]] * 2, jnp.int32)  # two groups of two rows
    mask = (ids > 0).astype(jnp.int32)
    out = generate(model, ids, mask, jax.random.key(2), SamplingConfig(max_new_tokens=6, temperature=1.0),
                   prompt_group=2)
    train = completion_logprobs(model, ids, mask, out.tokens, out.mask, temperature=1.0)
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(train["logprobs"] * out.mask), atol=1e-5, rtol=0)
