"""Prefix-shared packing (``rljax.logprobs.packed_completion_states``): K completions of one prompt in
one row give each completion exactly the log-probs, rewards and gradients of its own (prompt,
completion) row, with the prompt run once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.logprobs import (completion_logprobs, grouped_completion_logprobs, grouped_sequence_rewards,
                            sequence_rewards)
from rljax.models.config import ModelConfig
from tests._tiny import model_with_value_head

CFG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 8]]
# K = 3 completions per prompt, of different lengths; prompt 1's second completion is empty
COMPLETIONS = [[[11, 12], [13, 14, 15, 16], [17]],
               [[18, 19, 20], [], [21, 22]]]


@pytest.fixture(scope="module")
def model():
    """A float64 model (used under ``x64``): packed = unpacked is an algebraic equality, checked where
    it holds to ~1e-15 on every host."""
    with jax.enable_x64(True):
        return model_with_value_head(CFG, param_dtype=jnp.float64, dtype=jnp.float64)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


pytestmark = pytest.mark.usefixtures("x64")


def _grouped():
    """Prompts ``[B, P]`` left-padded, completions ``[B, K, N]`` right-padded."""
    B, K = len(PROMPTS), len(COMPLETIONS[0])
    P, N = max(map(len, PROMPTS)), max(len(c) for cs in COMPLETIONS for c in cs)
    prompt_ids, prompt_mask = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
    ids, mask = np.zeros((B, K, N), np.int32), np.zeros((B, K, N), np.int32)
    for b, p in enumerate(PROMPTS):
        prompt_ids[b, P - len(p):], prompt_mask[b, P - len(p):] = p, 1
        for k, c in enumerate(COMPLETIONS[b]):
            ids[b, k, :len(c)], mask[b, k, :len(c)] = c, 1
    return tuple(map(jnp.asarray, (prompt_ids, prompt_mask, ids, mask)))


def _flat(prompt_ids, prompt_mask, ids, mask):
    """The same data as ``B·K`` rows, the prompt repeated in each (the unpacked layout)."""
    B, K, N = ids.shape
    return (jnp.repeat(prompt_ids, K, axis=0), jnp.repeat(prompt_mask, K, axis=0), ids.reshape(B * K, N),
            mask.reshape(B * K, N))


@pytest.mark.parametrize("jit", [False, True])
def test_packed_logprobs_and_rewards_equal_each_completions_own_row(model, jit):
    batch = _grouped()
    B, K, N = batch[2].shape
    logps_fn = lambda *a: grouped_completion_logprobs(model, *a)  # noqa: E731
    rewards_fn = lambda *a: grouped_sequence_rewards(model, *a)  # noqa: E731
    if jit:
        logps_fn, rewards_fn = jax.jit(logps_fn), jax.jit(rewards_fn)
    logps, rewards = logps_fn(*batch), rewards_fn(*batch)
    assert logps.shape == (B, K, N) and rewards.shape == (B, K)
    flat = _flat(*batch)
    unpacked = completion_logprobs(model, *flat)["logprobs"].reshape(B, K, N)
    mask = np.asarray(batch[3], bool)
    assert np.abs(np.asarray(unpacked)[mask]).max() > 1.0  # log-probs of a 53-token vocabulary: far from 0
    assert logps.dtype == rewards.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(logps)[mask], np.asarray(unpacked)[mask], atol=1e-12, rtol=1e-10)
    # the empty completion (prompt 1, k 1) reads the prompt's last token, as the unpacked row does
    np.testing.assert_allclose(rewards, sequence_rewards(model, *flat).reshape(B, K), atol=1e-12, rtol=1e-10)
    assert len({round(float(r), 4) for r in np.asarray(rewards).ravel()}) == B * K  # every completion differs


def test_a_completion_never_sees_its_siblings(model):
    """Changing completion 0's tokens leaves completions 1 and 2 untouched (segment masking), and
    changes completion 0 itself (so the comparison could fail)."""
    prompt_ids, prompt_mask, ids, mask = _grouped()
    other = ids.at[:, 0, :].set(jnp.where(mask[:, 0] != 0, 30, 0))
    before = grouped_completion_logprobs(model, prompt_ids, prompt_mask, ids, mask)
    after = grouped_completion_logprobs(model, prompt_ids, prompt_mask, other, mask)
    np.testing.assert_array_equal(np.asarray(after)[:, 1:], np.asarray(before)[:, 1:])
    assert np.abs(np.asarray(after)[:, 0] - np.asarray(before)[:, 0]).max() > 0.1


def test_packed_gradient_equals_the_unpacked_gradient(model):
    """d/dθ of a loss over every completion's log-probs and reward: one packed pass vs B·K rows."""
    graphdef, params = nnx.split(model)
    batch = _grouped()
    B, K, N = batch[2].shape
    weights = jax.random.normal(jax.random.key(3), (B, K, N)) * batch[3]
    weights_r = jnp.asarray([[1.0, -2.0, 0.5], [0.3, 1.5, -1.0]])

    def packed(p):
        m = nnx.merge(graphdef, p)
        return (jnp.sum(weights * grouped_completion_logprobs(m, *batch))
                + jnp.sum(weights_r * grouped_sequence_rewards(m, *batch)))

    def unpacked(p):
        m, flat = nnx.merge(graphdef, p), _flat(*batch)
        logps = completion_logprobs(m, *flat)["logprobs"].reshape(B, K, N)
        return jnp.sum(weights * logps) + jnp.sum(weights_r * sequence_rewards(m, *flat).reshape(B, K))

    (v1, g1), (v2, g2) = jax.jit(jax.value_and_grad(packed))(params), jax.jit(jax.value_and_grad(unpacked))(params)
    assert v1.dtype == jnp.float64
    np.testing.assert_allclose(v1, v2, rtol=1e-12)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g1), jax.tree.leaves(g2)):
        scale = max(float(np.abs(np.asarray(b)).max()), 1e-6)
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=1e-12, err_msg=str(path[0]))


@pytest.mark.parametrize("chunk", [2, 5])
def test_query_chunked_attention_keeps_the_segments(model, chunk):
    """``model.attention_chunk`` on a packed row: the dense packed numbers."""
    graphdef, params = nnx.split(model)
    batch = _grouped()
    dense = grouped_completion_logprobs(model, *batch)
    chunked_model = nnx.merge(graphdef, params)
    chunked_model.attention_chunk = chunk
    chunked = jax.jit(lambda *a: grouped_completion_logprobs(chunked_model, *a))(*batch)
    mask = np.asarray(batch[3], bool)
    np.testing.assert_allclose(np.asarray(chunked)[mask], np.asarray(dense)[mask], atol=1e-12, rtol=1e-10)


def test_segments_are_refused_with_a_kv_cache(model):
    cache = model.init_cache(1, 4)
    ids = jnp.ones((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="segments"):
        model.forward(ids, positions=jnp.zeros((1, 2), jnp.int32), cache=cache, segments=jnp.zeros((1, 2), jnp.int32))
