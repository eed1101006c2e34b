"""rljax.logprobs' forward passes over prompt + completion against an unpadded, one-row-at-a-time reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.logprobs import completion_logprobs, completion_values, sequence_rewards
from rljax.models.config import ModelConfig
from tests._tiny import model_with_value_head

CFG = ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
PROMPTS = [[5, 6, 7], [1, 2, 3, 4], [9]]
COMPLETIONS = [[11, 12], [], [13, 14, 15]]  # the middle row has an empty completion


@pytest.fixture(scope="module")
def model():
    """A float64 model (used under ``x64``): padded = unpadded is an algebraic equality, checked where it
    holds to ~1e-15 on every host."""
    with jax.enable_x64(True):
        return model_with_value_head(CFG, param_dtype=jnp.float64, dtype=jnp.float64)


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _batch():
    P, N = max(map(len, PROMPTS)), max(map(len, COMPLETIONS))
    prompt_ids, prompt_mask = np.zeros((3, P), np.int32), np.zeros((3, P), np.int32)
    completion_ids, completion_mask = np.zeros((3, N), np.int32), np.zeros((3, N), np.int32)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = p, 1  # left-padded
        completion_ids[i, :len(c)], completion_mask[i, :len(c)] = c, 1  # right-padded
    return tuple(map(jnp.asarray, (prompt_ids, prompt_mask, completion_ids, completion_mask)))


def _unpadded(model, prompt, completion):
    """Hidden states ``[len(prompt + completion), D]`` of one row, with no padding anywhere."""
    ids = jnp.asarray([prompt + completion], jnp.int32)
    hidden, _ = model.forward(ids, jnp.ones_like(ids))
    return hidden[0]


@pytest.mark.parametrize("jit", [False, True])
def test_logprobs_and_values_read_the_state_before_each_completion_token(model, jit):
    batch = _batch()
    both = lambda *a: completion_logprobs(model, *a, with_values=True)
    values_only = lambda *a: completion_values(model, *a)
    if jit:
        both, values_only = jax.jit(both), jax.jit(values_only)
    out, values = both(*batch), values_only(*batch)
    np.testing.assert_array_equal(values, out["values"])  # the same positions, the same numbers
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        hidden = _unpadded(model, p, c)[len(p) - 1 : len(p) + len(c) - 1]  # state t predicts token t + 1
        logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)[jnp.arange(len(c)), jnp.asarray(c, jnp.int32)]
        assert out["logprobs"].dtype == values.dtype == jnp.float64
        np.testing.assert_allclose(out["logprobs"][i, :len(c)], logp, atol=1e-12, rtol=1e-10)
        np.testing.assert_allclose(values[i, :len(c)], model.values(hidden), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("jit", [False, True])
def test_sequence_rewards_read_the_last_real_token(model, jit):
    fn = lambda *a: sequence_rewards(model, *a)
    rewards = (jax.jit(fn) if jit else fn)(*_batch())
    assert rewards.shape == (3,)
    expected = [model.values(_unpadded(model, p, c)[-1]) for p, c in zip(PROMPTS, COMPLETIONS)]
    # row 1 (empty completion) reads its last prompt token
    assert rewards.dtype == jnp.float64
    np.testing.assert_allclose(rewards, jnp.stack(expected), atol=1e-12, rtol=1e-10)
