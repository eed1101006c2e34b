"""rljax.rollout: stop ids, prompt encoding, the rollout path (rows, texts, determinism, log-probs,
rewards), take / concat."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from rljax.data.prompts import format_prompt
from rljax.logprobs import completion_logprobs
from rljax.models.config import ModelConfig
from rljax.models.transformer import init_model
from rljax.rewards.base import RewardSet, per_sample
from rljax.data.prompts import PromptFormat, encode_prompts
from rljax.rollout import concat_rollouts, rollout, stop_token_ids
from rljax.sampling import SamplingConfig, generate
from tests._tiny import tiny_tokenizer

RAW = PromptFormat(chat=False, max_prompt_length=32)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
                         pad_token_id=2)
    return init_model(config, seed=0)


def _sampling(n=6, temperature=1.0, **kw):
    return SamplingConfig(max_new_tokens=n, temperature=temperature, stop_token_ids=(2,), pad_token_id=2, **kw)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_stop_token_ids_is_the_sorted_union_without_none():
    cfg = types.SimpleNamespace(eos_token_ids=(7, None, 2))
    assert stop_token_ids(types.SimpleNamespace(eos_token_id=5), cfg) == (2, 5, 7)
    assert stop_token_ids(types.SimpleNamespace(eos_token_id=2), cfg) == (2, 7)
    assert stop_token_ids(types.SimpleNamespace(eos_token_id=None), cfg) == (2, 7)
    assert stop_token_ids(types.SimpleNamespace(eos_token_id=3), types.SimpleNamespace(eos_token_ids=())) == (3,)


def test_encode_prompts_formats_and_left_pads(tokenizer):
    tok = encode_prompts(tokenizer, ["ab", "hello"], dataclasses.replace(RAW, assistant_prefix="<t>"))
    assert tok.input_ids.shape == (2, 16) and tok.dropped == 0 and tok.kept.tolist() == [0, 1]
    for row, text in zip(range(2), ["ab<t>", "hello<t>"]):
        ids = _ids(tokenizer, text)
        assert tok.input_ids[row, 16 - len(ids):].tolist() == ids
        assert tok.attention_mask[row].tolist() == [0] * (16 - len(ids)) + [1] * len(ids)
        assert (tok.input_ids[row, : 16 - len(ids)] == 2).all()  # the tokenizer's pad id
    chat = PromptFormat(system_prompt="Be brief.", max_prompt_length=64)
    tok = encode_prompts(tokenizer, ["hi", [{"role": "user", "content": "yo"}]], chat)
    expected = format_prompt(tokenizer, "hi", system_prompt="Be brief.")
    assert expected.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    ids = _ids(tokenizer, expected)
    assert tok.input_ids[0, -len(ids):].tolist() == ids and tok.attention_mask[0].sum() == len(ids)


def test_encode_prompts_filters_and_counts_or_raises_naming_the_prompt(tokenizer):
    prompts = ["short", "x" * 40, "also short", "y" * 33]
    tok = encode_prompts(tokenizer, prompts, dataclasses.replace(RAW, too_long="filter"))
    assert tok.kept.tolist() == [0, 2] and tok.dropped == 2 and tok.input_ids.shape == (2, 16)
    with pytest.raises(ValueError, match=r"prompt 1 \('xxxxx.*'\) is 40 tokens long once formatted, over "
                                         r"max_prompt_length=32"):
        encode_prompts(tokenizer, prompts, RAW)


def test_encode_prompts_add_special_tokens_and_buckets(tokenizer):
    from tokenizers import processors

    with_bos = tiny_tokenizer()
    with_bos._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    plain = encode_prompts(with_bos, ["ab"], RAW)
    bos = encode_prompts(with_bos, ["ab"], dataclasses.replace(RAW, add_special_tokens=True))
    assert plain.input_ids[0, -2:].tolist() == _ids(tokenizer, "ab")
    assert bos.input_ids[0, -3:].tolist() == [1, *_ids(tokenizer, "ab")]
    assert encode_prompts(tokenizer, ["ab"], dataclasses.replace(RAW, buckets=(24,))).input_ids.shape == (1, 24)


def test_rollout_rows_are_example_major_and_texts_are_prefix_plus_decoded(model, tokenizer):
    fmt = dataclasses.replace(RAW, assistant_prefix="A:")
    examples = [{"prompt": "ab", "answer": "1"}, "hello there"]
    # half the byte vocabulary stops a row: rows end at different lengths
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, stop_token_ids=tuple(range(2, 259, 2)),
                              pad_token_id=2)
    key = jax.random.key(3)
    roll = rollout(model, tokenizer, examples, key, sampling=sampling, fmt=fmt, repeats=3)
    assert len(roll) == 6 and roll.prompt_ids.shape == (6, 16) and roll.completion_ids.shape == (6, 6)
    assert [ex["prompt"] for ex in roll.examples] == ["ab"] * 3 + ["hello there"] * 3
    assert [ex.get("answer") for ex in roll.examples] == ["1"] * 3 + [None] * 3
    tok = encode_prompts(tokenizer, ["ab", "hello there"], fmt)
    np.testing.assert_array_equal(roll.prompt_ids, np.repeat(tok.input_ids, 3, axis=0))
    np.testing.assert_array_equal(roll.prompt_mask, np.repeat(tok.attention_mask, 3, axis=0))
    # the sampler called once on the repeated prompts with the same key (Trainer.sample's numerics)
    out = generate(model, np.repeat(tok.input_ids, 3, axis=0), np.repeat(tok.attention_mask, 3, axis=0), key, sampling)
    np.testing.assert_array_equal(roll.completion_ids, np.asarray(out.tokens))
    np.testing.assert_array_equal(roll.logprobs, np.asarray(out.logprobs))
    lengths = roll.completion_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1, lengths  # the stop rule is exercised
    stops = set(sampling.stop_token_ids)
    for i in range(6):
        n = int(lengths[i])
        assert roll.completion_mask[i].tolist() == [1] * n + [0] * (6 - n)
        assert roll.examples[i]["completion_length"] == n
        assert roll.texts[i] == "A:" + tokenizer.decode(roll.completion_ids[i, :n], skip_special_tokens=True)
        assert bool(roll.finished[i]) == (int(roll.completion_ids[i, n - 1]) in stops)
        assert not stops & set(roll.completion_ids[i, : n - 1].tolist())
    assert roll.scores is None and roll.row_mask is None and roll.per_function == {} and roll.reward_metrics == {}
    again = rollout(model, tokenizer, examples, key, sampling=sampling, fmt=fmt, repeats=3)
    for name in ("prompt_ids", "completion_ids", "completion_mask", "logprobs", "finished"):
        np.testing.assert_array_equal(getattr(again, name), getattr(roll, name))
    assert again.texts == roll.texts and again.examples == roll.examples
    other = rollout(model, tokenizer, examples, jax.random.key(4), sampling=sampling, fmt=fmt, repeats=3)
    assert not np.array_equal(other.completion_ids, roll.completion_ids)


@pytest.mark.parametrize("sampling", [SamplingConfig(max_new_tokens=6, temperature=0.7, pad_token_id=2),
                                      SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=5, pad_token_id=2)])
def test_sampler_logprobs_equal_the_training_forward(model, tokenizer, sampling):
    roll = rollout(model, tokenizer, ["ab", "what is 1+2?"], jax.random.key(0), sampling=sampling, fmt=RAW, repeats=2)
    ref = completion_logprobs(model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask,
                              temperature=sampling.temperature)["logprobs"]
    np.testing.assert_allclose(np.asarray(ref) * roll.completion_mask, roll.logprobs, atol=1e-5, rtol=0)
    assert roll.logprobs.dtype == np.float32


def _rewards():
    @per_sample(name="picky")
    def picky(completion, example):
        if example["answer"] == "boom":
            raise ValueError("cannot score this one")
        return 1.0

    def chars(completions, examples):
        return np.array([len(c) for c in completions], np.float64)

    return RewardSet({"chars": (2.0, chars), "picky": (0.5, picky)})


def test_rewards_are_wired_and_a_failed_row_is_masked_with_its_partial_total(model, tokenizer):
    examples = [{"prompt": "ab", "answer": "ok"}, {"prompt": "cd", "answer": "boom"}, {"prompt": "ef", "answer": "ok"}]
    fmt = dataclasses.replace(RAW, assistant_prefix="P")
    rewards = _rewards()
    roll = rollout(model, tokenizer, examples, jax.random.key(1), sampling=_sampling(), fmt=fmt, rewards=rewards)
    assert roll.row_mask.tolist() == [True, False, True]
    lengths = np.array([len(t) for t in roll.texts], np.float64)
    np.testing.assert_array_equal(roll.per_function["chars"], lengths)
    assert roll.per_function["picky"][0] == 1.0 and np.isnan(roll.per_function["picky"][1])
    assert roll.scores.dtype == np.float32
    # the failed value counts 0 in the total (TRL nansum); row_mask keeps the row out of the update
    np.testing.assert_array_equal(roll.scores, np.float32([2 * lengths[0] + 0.5, 2 * lengths[1], 2 * lengths[2] + 0.5]))
    assert roll.reward_metrics == rewards.metrics(rewards(roll.texts, roll.examples))
    assert roll.reward_metrics["reward/missing_count"] == 1.0


def test_take_and_concat_repad_widths_and_keep_values(model, tokenizer):
    rewards = _rewards()
    a = rollout(model, tokenizer, [{"prompt": "ab", "answer": "ok"}, {"prompt": "cd", "answer": "boom"}],
                jax.random.key(0), sampling=_sampling(n=4), fmt=RAW, repeats=2, rewards=rewards)
    b = rollout(model, tokenizer, [{"prompt": "z" * 20, "answer": "ok"}, {"prompt": "q" * 40, "answer": "ok"}],
                jax.random.key(1), sampling=_sampling(n=6), fmt=dataclasses.replace(RAW, too_long="filter"),
                rewards=rewards)
    assert a.prompt_ids.shape == (4, 16) and b.prompt_ids.shape == (1, 20) and b.num_dropped == 1
    both = concat_rollouts([a, b], pad_id=7)
    assert both.prompt_ids.shape == (5, 20) and both.completion_ids.shape == (5, 6) and both.num_dropped == 1
    np.testing.assert_array_equal(both.prompt_ids[:4, 4:], a.prompt_ids)
    assert (both.prompt_ids[:4, :4] == 7).all() and (both.prompt_mask[:4, :4] == 0).all()
    np.testing.assert_array_equal(both.prompt_mask[:4, 4:], a.prompt_mask)
    np.testing.assert_array_equal(both.prompt_ids[4:], b.prompt_ids)
    np.testing.assert_array_equal(both.completion_ids[:4, :4], a.completion_ids)
    assert (both.completion_ids[:4, 4:] == 7).all() and (both.completion_mask[:4, 4:] == 0).all()
    assert (both.logprobs[:4, 4:] == 0).all()
    np.testing.assert_array_equal(both.logprobs[:4, :4], a.logprobs)
    np.testing.assert_array_equal(both.completion_ids[4:], b.completion_ids)
    np.testing.assert_array_equal(both.finished, np.concatenate([a.finished, b.finished]))
    np.testing.assert_array_equal(both.scores, np.concatenate([a.scores, b.scores]))
    assert both.row_mask.tolist() == [True, True, False, False, True]
    assert both.texts == a.texts + b.texts and both.examples == a.examples + b.examples
    for name in ("chars", "picky"):
        np.testing.assert_array_equal(both.per_function[name], np.concatenate([a.per_function[name],
                                                                               b.per_function[name]]))
    # reward metrics are recomputed for the rows held: by hand from the concatenated values
    chars = both.per_function["chars"]
    total = both.scores.astype(np.float64)  # every row, a missing value counting 0
    assert both.reward_metrics["reward/chars/mean"] == pytest.approx(chars.mean())
    assert both.reward_metrics["reward/picky/mean"] == 1.0 and both.reward_metrics["reward/picky/missing"] == 0.4
    assert both.reward_metrics["reward/total/mean"] == pytest.approx(total.mean())
    assert both.reward_metrics["reward/total/std"] == pytest.approx(total.std())
    assert both.reward_metrics["reward/missing_count"] == 2.0
    # a rollout's own metrics (RewardSet.metrics, float64 totals) agree with the recomputation
    for key, value in a.take(slice(None)).reward_metrics.items():
        assert value == pytest.approx(a.reward_metrics[key], rel=1e-6), key

    sub = both.take([4, 0])
    assert sub.prompt_ids.shape == (2, 20) and sub.completion_ids.shape == (2, 6)
    np.testing.assert_array_equal(sub.completion_ids, both.completion_ids[[4, 0]])
    assert sub.texts == [both.texts[4], both.texts[0]] and sub.examples == [both.examples[4], both.examples[0]]
    assert sub.row_mask.tolist() == [True, True] and sub.reward_metrics["reward/missing_count"] == 0.0
    assert sub.reward_metrics["reward/total/mean"] == pytest.approx(float(np.mean(both.scores[[4, 0]])))
    masked = both.take(both.row_mask)
    assert len(masked) == 3 and masked.texts == [both.texts[i] for i in (0, 1, 4)]
    with pytest.raises(ValueError, match="some rollouts have rewards"):
        concat_rollouts([a, rollout(model, tokenizer, ["ab"], jax.random.key(0), sampling=_sampling(n=4), fmt=RAW)])


def test_filtered_prompts_have_no_rows_and_too_long_errors_name_the_prompt(model, tokenizer):
    fmt = dataclasses.replace(RAW, max_prompt_length=16, too_long="filter")
    roll = rollout(model, tokenizer, ["ab", "a long prompt, over sixteen bytes"], jax.random.key(0),
                   sampling=_sampling(), fmt=fmt, repeats=2, rewards=_rewards_ok())
    assert len(roll) == 2 and roll.num_dropped == 1 and [e["prompt"] for e in roll.examples] == ["ab", "ab"]
    empty = rollout(model, tokenizer, ["a long prompt, over sixteen bytes"], jax.random.key(0), sampling=_sampling(),
                    fmt=fmt, rewards=_rewards_ok())
    assert len(empty) == 0 and empty.num_dropped == 1 and empty.completion_ids.shape == (0, 6)
    assert empty.scores.shape == (0,) and empty.per_function["one"].shape == (0,)
    with pytest.raises(ValueError, match=r"prompt 1 \('a long prompt, over sixteen bytes'\) is 33 tokens long"):
        rollout(model, tokenizer, ["ab", "a long prompt, over sixteen bytes"], jax.random.key(0), sampling=_sampling(),
                fmt=dataclasses.replace(fmt, too_long="error"))
    with pytest.raises(ValueError, match="example 0 has no 'prompt' key"):
        rollout(model, tokenizer, [{"question": "ab"}], jax.random.key(0), sampling=_sampling(), fmt=RAW)


def _rewards_ok():
    return RewardSet({"one": (1.0, lambda completions, examples: np.ones(len(completions)))})


def test_rollout_takes_a_split_policy(model, tokenizer):
    from flax import nnx

    split = nnx.split(model, nnx.Param, ...)
    one = rollout(model, tokenizer, ["ab"], jax.random.key(2), sampling=_sampling(), fmt=RAW)
    two = rollout(split, tokenizer, ["ab"], jax.random.key(2), sampling=_sampling(), fmt=RAW)
    np.testing.assert_array_equal(one.completion_ids, two.completion_ids)
