"""The KV-cache sampler against a cache-free reference, and its agreement with the trainer's log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import sampling
from rljax.logprobs import completion_logprobs
from rljax.models.config import ModelConfig
from rljax.models.transformer import init_model
from rljax.sampling import SamplingConfig, generate

CFG = ModelConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=3)


def _batch():
    rows = [[5, 6, 7], [1, 2, 3, 4, 5, 9], [9]]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return rows, ids, mask


def _greedy_reference(model, row, n, width=16):
    """Greedy decoding by re-running the full, cache-free forward pass every step.

    The row is right-padded to one ``width`` and the next token read at its last real position: the
    pass is causal, so later (padding) tokens cannot change it, and one shape compiles once (the
    forward's scan compiled anew for each of the 14 lengths took most of this file's 28 s)."""
    seq = list(row)
    for _ in range(n):
        ids = jnp.asarray([seq + [0] * (width - len(seq))])
        seq.append(int(jnp.argmax(model(ids)[0, len(seq) - 1])))
    return seq[len(row):]


def test_greedy_matches_cache_free_reference(model):
    rows, ids, mask = _batch()
    out = generate(model, ids, mask, jax.random.key(0), SamplingConfig(max_new_tokens=8, temperature=0.0))
    for i, row in enumerate(rows):
        assert out.tokens[i].tolist() == _greedy_reference(model, row, 8)
    assert out.mask.tolist() == [[1] * 8] * 3
    assert not out.finished.any()


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(max_new_tokens=10, temperature=1.0),
        SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=5),
        SamplingConfig(max_new_tokens=10, temperature=1.3, top_p=0.8),
        SamplingConfig(max_new_tokens=10, temperature=0.0),
    ],
)
def test_sampler_logprobs_equal_training_forward(model, config):
    _, ids, mask = _batch()
    out = generate(model, ids, mask, jax.random.key(1), config)
    train = completion_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), out.tokens, out.mask,
                                temperature=config.temperature)["logprobs"]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(train * out.mask), atol=1e-5, rtol=0)


def test_top_k_restricts_support_and_top_k_one_is_greedy(model):
    _, ids, mask = _batch()
    greedy = generate(model, ids, mask, jax.random.key(0), SamplingConfig(max_new_tokens=6, temperature=0.0))
    top1 = generate(model, ids, mask, jax.random.key(5), SamplingConfig(max_new_tokens=6, temperature=2.0, top_k=1))
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


def test_top_p_only_draws_from_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    filtered = sampling.filter_logits(logits, 0, 0.75)  # 0.5 + 0.3 crosses 0.75: keep the first two
    assert np.isfinite(np.asarray(filtered)).tolist() == [[True, True, True, True]]
    kept = np.asarray(filtered) > np.finfo(np.float32).min
    assert kept.tolist() == [[True, True, False, False]]
    filtered = sampling.filter_logits(logits, 0, 0.5)  # the top token alone reaches 0.5
    assert (np.asarray(filtered) > np.finfo(np.float32).min).tolist() == [[True, False, False, False]]


def test_stop_tokens_end_rows_and_ignore_eos_does_not(model):
    rows, ids, mask = _batch()
    greedy = generate(model, ids, mask, jax.random.key(0), SamplingConfig(max_new_tokens=8, temperature=0.0))
    stop = int(greedy.tokens[0, 2])  # row 0 emits this token third
    cfg = SamplingConfig(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop, 100), pad_token_id=0)
    out = generate(model, ids, mask, jax.random.key(0), cfg)
    first_stop = int(np.argmax(np.asarray(greedy.tokens[0]) == stop))
    assert out.finished[0]
    assert out.mask[0].tolist() == [1] * (first_stop + 1) + [0] * (7 - first_stop)
    assert out.tokens[0, : first_stop + 1].tolist() == greedy.tokens[0, : first_stop + 1].tolist()
    assert (np.asarray(out.tokens[0, first_stop + 1 :]) == 0).all()
    assert (np.asarray(out.logprobs[0, first_stop + 1 :]) == 0).all()
    fixed = generate(model, ids, mask, jax.random.key(0), cfg.__class__(**{**cfg.__dict__, "ignore_eos": True}))
    assert fixed.mask.tolist() == [[1] * 8] * 3 and not fixed.finished.any()
    np.testing.assert_array_equal(fixed.tokens, greedy.tokens)


def test_same_key_same_output_other_key_differs(model):
    _, ids, mask = _batch()
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0)
    a = generate(model, ids, mask, jax.random.key(7), cfg)
    b = generate(model, ids, mask, jax.random.key(7), cfg)
    c = generate(model, ids, mask, jax.random.key(8), cfg)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, c.tokens)


def test_padded_row_samples_as_if_alone(model):
    rows, ids, mask = _batch()
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.0)
    batch = generate(model, ids, mask, jax.random.key(0), cfg)
    alone = generate(model, np.asarray([rows[0]]), np.ones((1, 3), np.int32), jax.random.key(0), cfg)
    np.testing.assert_array_equal(batch.tokens[0], alone.tokens[0])
    np.testing.assert_allclose(batch.logprobs[0], alone.logprobs[0], atol=1e-5)


def test_bucketing_bounds_compilations(model):
    cfg = SamplingConfig(max_new_tokens=4, temperature=1.0, top_k=3)  # a config no other test uses
    before = sampling.trace_count()
    rng = np.random.default_rng(0)
    for batch, length in [(3, 5), (5, 9), (7, 12), (8, 16), (2, 1)]:
        ids = rng.integers(1, 100, size=(batch, length)).astype(np.int32)
        generate(model, ids, np.ones_like(ids), jax.random.key(batch), cfg)
    assert sampling.trace_count() - before == 1  # all fit the (8 rows, 16 tokens) bucket
    ids = rng.integers(1, 100, size=(9, 17)).astype(np.int32)
    generate(model, ids, np.ones_like(ids), jax.random.key(0), cfg)
    assert sampling.trace_count() - before == 2  # the next bucket: (12 rows, 24 tokens)


def _draw_frequencies(logits, rows, seeds):
    tiled = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (rows, len(logits)))
    draw = jax.jit(sampling.sample_categorical)
    tokens = np.concatenate([np.asarray(draw(jax.random.key(s), tiled)) for s in range(seeds)])
    return np.bincount(tokens, minlength=len(logits)) / tokens.size, tokens.size


@pytest.mark.parametrize("case", ["spread", "last_block", "masked"])
def test_categorical_draws_follow_softmax(case):
    """The inverse-CDF draw matches softmax frequencies within 4.5 standard errors per token and never
    draws a token filtered to the dtype's minimum (V = 600 spans 3 blocks of 256, the last one padded)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=600).astype(np.float32) * 2.0
    if case == "last_block":
        logits[:512] -= 30.0  # almost all mass in the padded last block
    if case == "masked":
        logits[rng.permutation(600)[:590]] = np.finfo(np.float32).min  # 10 tokens left, spread over blocks
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits)), np.float64)
    freq, n = _draw_frequencies(logits, 8192, 16)
    se = np.sqrt(probs * (1 - probs) / n) + 1.0 / n
    assert np.all(np.abs(freq - probs) <= 4.5 * se), np.max(np.abs(freq - probs) / se)
    if case == "masked":
        assert freq[logits == np.finfo(np.float32).min].sum() == 0


def test_categorical_single_allowed_token_and_same_key_same_draw():
    logits = np.full((4, 300), np.finfo(np.float32).min, np.float32)
    logits[np.arange(4), [0, 255, 256, 299]] = 0.0  # block edges
    draw = np.asarray(sampling.sample_categorical(jax.random.key(1), jnp.asarray(logits)))
    assert draw.tolist() == [0, 255, 256, 299]
    key, x = jax.random.key(3), jax.random.normal(jax.random.key(4), (5, 300))
    np.testing.assert_array_equal(sampling.sample_categorical(key, x), sampling.sample_categorical(key, x))


def test_bad_sampling_config_is_named():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)


# a float64 model's log-probs are rounded to the float32 store explicitly: JAX deprecates an implicit
# float64 -> float32 scatter (a FutureWarning now, an error in a later release)
@pytest.mark.filterwarnings("error:scatter inputs have incompatible types:FutureWarning")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_prompt_group_prefills_each_prompt_once_with_the_same_samples(monkeypatch, temperature):
    """Rows in groups of 4 (each prompt repeated, as rollouts build them): prompt_group=4 runs the
    prefill on one row per prompt and samples what prompt_group=1 does; the trainer's log-probs agree.

    Grouped = plain is an algebraic equality, so the model is float64; the sampler keeps its log-probs in
    float32, so those (and the float64 trainer's log-probs against them) agree to float32 rounding of the
    compared values: rtol 2**-23, one unit in the last place."""
    with jax.enable_x64(True):
        _prompt_group_prefills_each_prompt_once(monkeypatch, temperature)


def _prompt_group_prefills_each_prompt_once(monkeypatch, temperature):
    model = init_model(CFG, seed=3, param_dtype=jnp.float64, dtype=jnp.float64)
    _, ids, mask = _batch()
    ids, mask = np.repeat(ids, 4, axis=0), np.repeat(mask, 4, axis=0)  # 12 rows, 3 prompts
    prefill_rows = []
    forward = type(model).forward

    def spy(self, input_ids, *args, cache=None, **kwargs):
        if cache is not None and input_ids.shape[1] > 1:  # the prefill (decode steps are one token)
            prefill_rows.append(input_ids.shape[0])
        return forward(self, input_ids, *args, cache=cache, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    config = SamplingConfig(max_new_tokens=6, temperature=temperature)
    grouped = generate(model, ids, mask, jax.random.key(4), config, prompt_group=4)
    plain = generate(model, ids, mask, jax.random.key(4), config)
    # traced once per program: 3 rows (one per prompt) for the grouped call; 12 for the plain one,
    # unless an earlier test compiled that program already
    assert prefill_rows[0] == 3 and set(prefill_rows) <= {3, 12}
    np.testing.assert_array_equal(grouped.tokens, plain.tokens)
    np.testing.assert_allclose(grouped.logprobs, plain.logprobs, rtol=2**-23, atol=0)
    if temperature:  # sampled: the 4 rows of a group differ after their shared prompt
        assert len({tuple(r) for r in np.asarray(grouped.tokens[:4])}) > 1
    out = completion_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), grouped.tokens, grouped.mask,
                              temperature=temperature)["logprobs"]
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(out) * grouped.mask, grouped.logprobs, rtol=2**-23, atol=0)


def test_a_prompt_group_that_does_not_divide_the_batch_prefills_every_row(model):
    _, ids, mask = _batch()  # 3 rows, groups of 2 do not divide them
    config = SamplingConfig(max_new_tokens=4, temperature=1.0)
    grouped = generate(model, ids, mask, jax.random.key(1), config, prompt_group=2)
    np.testing.assert_array_equal(grouped.tokens, generate(model, ids, mask, jax.random.key(1), config).tokens)
