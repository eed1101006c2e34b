"""The rollout engine's per-row sampling (``rljax.inference.model_step.sample_rows``): each row draws
from ``softmax(logits / T_r)`` with its own seed and token index, and reports that distribution's
log-prob of the token it drew."""

import jax
import jax.numpy as jnp
import numpy as np

from rljax.inference.model_step import sample_rows


def _rows(logits, rows, temperature, top_k=0, top_p=1.0, seeds=None, counters=None, top=0):
    L = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (rows, len(logits)))
    seeds = jnp.arange(rows, dtype=jnp.uint32) if seeds is None else seeds
    counters = jnp.zeros(rows, jnp.int32) if counters is None else counters
    filtered = top_k > 0 or top_p < 1
    out = jax.jit(sample_rows, static_argnames=("filtered", "top"))(
        L, seeds, counters, jnp.full(rows, temperature, jnp.float32), jnp.full(rows, top_k, jnp.int32),
        jnp.full(rows, top_p, jnp.float32), filtered=filtered, top=top)
    return out if top else out[:2]


def test_draws_follow_the_tempered_softmax_over_seeds_and_over_token_indices():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 1.5, 0.2], np.float32)
    probs = np.exp(logits.astype(np.float64) / 0.7)
    probs /= probs.sum()
    n = 100_000
    by_seed, logp = _rows(logits, n, 0.7)
    by_index, _ = _rows(logits, n, 0.7, seeds=jnp.full(n, 5, jnp.uint32), counters=jnp.arange(n, dtype=jnp.int32))
    for tokens in (by_seed, by_index):
        freq = np.bincount(np.asarray(tokens), minlength=len(logits)) / n
        se = np.sqrt(probs * (1 - probs) / n)
        assert np.all(np.abs(freq - probs) <= 4.5 * se), (freq, probs)
        # not the untempered softmax: the most likely token's share differs by ~70 standard errors (0.50 vs 0.39)
        plain = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum()
        assert abs(freq[0] - plain[0]) > 10 * se[0]
    np.testing.assert_allclose(np.asarray(logp), np.log(probs)[np.asarray(by_seed)], rtol=0, atol=1e-6)


def test_top_k_and_top_p_limit_what_is_drawn_not_the_log_prob():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 1.5, 0.2], np.float32)
    tokens, logp = _rows(logits, 20_000, 1.0, top_k=2)
    assert set(np.unique(np.asarray(tokens)).tolist()) == {0, 6}  # the two largest logits
    full = jax.nn.log_softmax(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(full)[np.asarray(tokens)], atol=1e-6)
    # top-p 0.5: the smallest set holding half the mass is {0, 6} (0.39 + 0.24)
    tokens, _ = _rows(logits, 20_000, 1.0, top_p=0.5)
    assert set(np.unique(np.asarray(tokens)).tolist()) == {0, 6}


def test_greedy_rows_take_the_argmax_whatever_their_seed():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    tokens, logp = _rows(logits, 64, 0.0)
    assert np.all(np.asarray(tokens) == 1)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))[1], atol=1e-6)


def test_top_logprobs_are_the_likeliest_tokens_under_the_tempered_softmax_whatever_was_drawn():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 1.5, 0.2], np.float32)
    for temperature in (0.0, 0.7, 1.0):
        tokens, logp, top_lp, top_ids = _rows(logits, 32, temperature, top_k=3, top=4)
        scale = temperature if temperature not in (0.0, 1.0) else 1.0
        z = logits.astype(np.float64) / scale
        expected = z - np.log(np.exp(z).sum())
        assert np.asarray(top_ids).tolist() == [[0, 6, 1, 2]] * 32  # the order of the logits, not of top-k's draws
        np.testing.assert_allclose(np.asarray(top_lp), np.broadcast_to(expected[[0, 6, 1, 2]], (32, 4)), atol=1e-6)
        # the drawn token's log-prob is the same distribution's, so it equals its entry wherever it is listed
        for t, lp in zip(np.asarray(tokens), np.asarray(logp)):
            np.testing.assert_allclose(lp, expected[t], atol=1e-6)
