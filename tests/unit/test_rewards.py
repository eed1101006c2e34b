"""Reward functions: hand-made completions with known scores, the weighted sum and the registry."""

import logging
import math
import threading

import numpy as np
import pytest

from rljax.errors import UserError
from rljax.rewards import (
    RewardSet,
    answer_score,
    answers_match,
    build_rewards,
    combine,
    countdown_score,
    extract_answer,
    extract_tag,
    make_answer_reward,
    make_countdown_reward,
    make_format_reward,
    make_reasoning_gym_reward,
    make_sentiment_reward,
    per_sample,
    register_reward,
    registered_rewards,
    reward_metrics,
    soft_overlong_punishment,
    think_answer_format,
)
from rljax.rewards.base import build_reward
from rljax.rewards.shaping import make_length_reward, make_overlong_reward

EX47 = {"answer": "47", "prompt": "What is 12+35?"}


# ---------------------------------------------------------------------------------------------
# extraction


def test_extract_tag_takes_last_well_formed_tag():
    assert extract_tag("<answer> 12 </answer> then <answer>47</answer>") == "47"
    assert extract_tag("<answer>\n47\n</answer>") == "47"
    assert extract_tag("<answer>47") is None
    assert extract_tag("47</answer>") is None
    assert extract_tag("no tags") is None
    assert extract_answer("so it is 12 or maybe 47.", require_tag=False) == "47"
    assert extract_answer("so it is 47.", require_tag=True) is None
    assert extract_answer("total: -1,234.5 units", require_tag=False) == "-1,234.5"


# ---------------------------------------------------------------------------------------------
# answer reward


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>12+35 is 47</think><answer>47</answer>", 1.0),
        ("<answer>47</answer>", 1.0),
        ("<answer> 47.0 </answer>", 1.0),  # numeric equivalence, fast path
        ("<answer>$47$</answer>", 1.0),
        ("<answer>\\boxed{47}</answer>", 1.0),
        ("<answer>47.</answer>", 1.0),
        ("<answer>48</answer>", 0.0),  # wrong
        ("The answer is 47.", 0.0),  # no tag
        ("<answer>47", 0.0),  # malformed: never closed
        ("<answer>47</answer> wait, <answer>48</answer>", 0.0),  # the last tag counts
        ("<answer>48</answer> no: <answer>47</answer>", 1.0),
        ("<answer></answer>", 0.0),
        ("<answer>forty-seven</answer>", 0.0),
    ],
)
def test_answer_score_integer_gold(completion, expected):
    assert answer_score(completion, EX47) == expected


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("1/2", "0.5", True),
        ("0.5", "1/2", True),
        ("0.50", ".5", True),
        ("\\frac{1}{2}", "0.5", True),  # math-verify path
        ("1+x", "x+1", True),  # symbolic, math-verify path
        ("\\sqrt{8}", "2\\sqrt{2}", True),
        ("1,000", "1000", True),
        ("\u22123", "-3", True),  # Unicode minus
        ("2/4", "1/2", True),
        ("0.3333", "1/3", False),  # both plain numbers: exact comparison decides
        ("x+2", "x+1", False),
        ("", "1", False),
    ],
)
def test_answers_match_equivalent_forms(pred, gold, expected):
    assert answers_match(pred, gold) is expected


def test_expression_copied_from_question_does_not_earn_numeric_answer():
    # math-verify alone says "12+35" equals 47; a policy could copy the question into the tag.
    assert answer_score("<answer>12+35</answer>", EX47) == 0.0
    assert answer_score("<answer>12 + 35 = 47</answer>", EX47) == 0.0
    assert answer_score("<answer>12+35</answer>", EX47, allow_expressions=True) == 1.0
    assert answer_score("<answer>-47</answer>", {"answer": "-47"}) == 1.0  # a sign is no operator
    assert answer_score("<answer>\\frac{94}{2}</answer>", EX47) == 1.0
    assert answer_score("<answer>The answer is 47</answer>", EX47) == 1.0


def test_answer_reward_fallback_to_last_number_and_list_of_golds():
    strict = make_answer_reward()
    loose = make_answer_reward(require_tag=False)
    completions = ["12+35 = 47", "<answer>46</answer> I mean 47", "<answer>0.5</answer>"]
    examples = [EX47, EX47, {"answer": ["1/2", "half"]}]
    np.testing.assert_array_equal(strict(completions, examples), [0.0, 0.0, 1.0])
    # with a tag present the tag wins even when require_tag=False
    np.testing.assert_array_equal(loose(completions, examples), [1.0, 0.0, 1.0])


def test_a_boxed_latex_answer_without_tags_is_checked_by_math_verify_not_its_last_number():
    # before: "\\boxed{\\frac{1}{2}}" scored by its last number, "2" (right against "2", wrong against "1/2")
    boxed = "So the answer is \\boxed{\\frac{1}{2}}."
    assert extract_answer(boxed, require_tag=False) == "\\frac{1}{2}"
    assert extract_answer("\\boxed{x^{2}} and \\boxed{\\sqrt{4}} is 2", require_tag=False) == "\\sqrt{4}"
    assert extract_answer("unclosed \\boxed{\\frac{1}{2} so 3", require_tag=False) == "3"  # falls back
    assert extract_answer(boxed, require_tag=True) is None  # a required tag stays required
    golds = [{"answer": "1/2"}, {"answer": "0.5"}, {"answer": "2"}]
    assert [answer_score(boxed, g, require_tag=False) for g in golds] == [1.0, 1.0, 0.0]
    loose = make_answer_reward(require_tag=False)  # the bounded path: math-verify in a worker
    np.testing.assert_array_equal(loose([boxed] * 3, golds), [1.0, 1.0, 0.0])
    # plain numbers are unchanged: the last number, compared exactly
    np.testing.assert_array_equal(loose(["12+35 = 47", "it is 0.50", "2 then 3"], [EX47, golds[0], golds[2]]),
                                  [1.0, 1.0, 0.0])


def test_answer_reward_rejects_fractional_timeout():
    with pytest.raises(ValueError, match="timeout_seconds"):
        make_answer_reward(timeout_seconds=0.5)


def test_math_verify_power_tower_is_no_match():
    # the time bound itself is the bounded pool's (tests/system/test_bounded_verifiers.py); no wall clock here
    assert answers_match("9^{9^{9^9}}", "5", timeout_seconds=1) is False


def test_answers_match_off_main_thread_keeps_fast_path():
    results = {}

    def work():
        results["numeric"] = answers_match("47.0", "47")
        results["symbolic"] = answers_match("1+x", "x+1")  # skipped off the main thread

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=600)  # a hang guard
    assert results == {"numeric": True, "symbolic": False}


# ---------------------------------------------------------------------------------------------
# format rewards


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>reasoning</think><answer>47</answer>", True),
        ("  <think>\nreasoning\n</think>\n\n<answer>\n47\n</answer>\n", True),
        ("<think>reasoning</think>", False),
        ("<answer>47</answer>", False),
        ("<think>a</think><answer>47</answer> trailing text", False),
        ("preamble <think>a</think><answer>47</answer>", False),
        ("<think>a</think><answer>1</answer><answer>2</answer>", False),  # two answers
        ("<think>a<think>b</think><answer>47</answer>", False),  # nested think
        ("<think>a</think><answer> </answer>", False),  # empty answer
        ("<answer>47</answer><think>a</think>", False),  # wrong order
        ("<think>a</think><answer>47", False),
    ],
)
def test_think_answer_format(completion, expected):
    assert think_answer_format(completion) is expected


def test_format_reward_batch_and_prefilled_think():
    fn = make_format_reward()
    prefilled = make_format_reward(think_prefilled=True)
    completions = ["<think>x</think><answer>1</answer>", "x</think><answer>1</answer>"]
    np.testing.assert_array_equal(fn(completions, [{}, {}]), [1.0, 0.0])
    np.testing.assert_array_equal(prefilled(completions, [{}, {}]), [0.0, 1.0])


def test_answer_tag_format_reward():
    fn = build_reward("answer_tag_format")
    completions = ["blah <answer>47</answer> blah", "<answer></answer>", "<answer>47", "none"]
    np.testing.assert_array_equal(fn(completions, [{}] * 4), [1.0, 0.0, 0.0, 0.0])


# ---------------------------------------------------------------------------------------------
# countdown

RG_COUNTDOWN = {"answer": "94*4 - 61 - 6", "metadata": {"numbers": [6, 61, 94, 4], "target": 309}}
TINYZERO_COUNTDOWN = {"nums": [3, 5, 7], "target": 22}


@pytest.mark.parametrize(
    "completion, example, expected",
    [
        ("<answer>94*4 - 61 - 6</answer>", RG_COUNTDOWN, 1.0),
        ("<think>try</think><answer>(94*4) - (61 + 6)</answer>", RG_COUNTDOWN, 1.0),
        ("<answer>94*4 - 61 + 6</answer>", RG_COUNTDOWN, 0.1),  # wrong value
        ("<answer>94*4 - 67</answer>", RG_COUNTDOWN, 0.1),  # wrong numbers
        ("<answer>94*4 - 61 - 6 + 4 - 4</answer>", RG_COUNTDOWN, 0.1),  # reuses 4
        ("<answer>94*4 - 61 - 6 = 309</answer>", RG_COUNTDOWN, 0.1),  # '=' is not allowed
        ("<answer>__import__('os').getcwd()</answer>", RG_COUNTDOWN, 0.1),  # never evaluated
        ("<answer>6/(61-61) + 94 + 4</answer>", RG_COUNTDOWN, 0.1),  # division by zero
        ("94*4 - 61 - 6", RG_COUNTDOWN, 0.0),  # no tag
        ("<answer>3*5 + 7</answer>", TINYZERO_COUNTDOWN, 1.0),
        ("<answer>(7*3 + 5) - 5 + 1</answer>", TINYZERO_COUNTDOWN, 0.1),
        ("<answer>7 / 7 * 22</answer>", TINYZERO_COUNTDOWN, 0.1),
    ],
)
def test_countdown_score_tinyzero_values(completion, example, expected):
    assert countdown_score(completion, example) == expected


def test_countdown_exact_division_and_subset_option():
    example = {"numbers": [2, 3, 9], "target": 6}
    assert countdown_score("<answer>9 / 3 * 2</answer>", example) == 1.0
    assert countdown_score("<answer>3 * 2</answer>", example) == 0.1
    assert countdown_score("<answer>3 * 2</answer>", example, require_all_numbers=False) == 1.0
    fn = make_countdown_reward()
    out = fn(["<answer>3*5+7</answer>", "<answer>3*5+7</answer>"], [TINYZERO_COUNTDOWN, {"answer": "1"}])
    assert out[0] == 1.0 and math.isnan(out[1])  # the second example has no numbers/target


def test_reasoning_gym_reward_uses_its_scorers():
    from rljax.data import make_task

    fn = make_reasoning_gym_reward(workers=1)  # scored in a bounded worker: one is enough here
    chain = make_task("chain_sum", split="eval", size=2, seed=0)
    countdown = make_task("countdown", split="eval", size=1, seed=0)
    completions = [f"<answer>{chain[0]['answer']}</answer>", "<answer>99999</answer>",
                   f"<answer>{countdown[0]['answer']}</answer>", "no answer"]
    examples = [chain[0], chain[1], countdown[0], countdown[0]]
    np.testing.assert_allclose(fn(completions, examples), [1.0, 0.0, 1.0, 0.01])


# ---------------------------------------------------------------------------------------------
# per_sample, combine, metrics


def test_per_sample_exception_gives_nan_for_that_sample_and_one_warning(caplog):
    @per_sample
    def picky(completion, example):
        if completion == "bad":
            raise ValueError("cannot score this")
        return len(completion)

    with caplog.at_level(logging.WARNING, logger="rljax.rewards.base"):
        out = picky(["ab", "bad", "abcd", "bad"], [{}] * 4)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(np.isnan(out), [False, True, False, True])
    np.testing.assert_array_equal(out[[0, 2]], [2.0, 4.0])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "picky" in message and "cannot score this" in message and "2 of 4" in message


def test_combine_weighted_sum_missing_and_metrics():
    def answer(completions, examples):
        return np.array([1.0, 0.0, 1.0, 0.0])

    def fmt(completions, examples):
        return np.array([1.0, 1.0, np.nan, 0.0])

    rewards = combine({"answer": (1.0, answer), "format": (0.2, fmt)})
    total, per_function, missing = rewards(["a", "b", "c", "d"], [{}] * 4)
    # the missing format value counts 0 in the total (TRL nansum); the row is still marked missing
    np.testing.assert_allclose(total, [1.2, 0.2, 1.0, 0.0])
    np.testing.assert_array_equal(missing, [False, False, True, False])
    np.testing.assert_array_equal(per_function["answer"], [1.0, 0.0, 1.0, 0.0])
    metrics = rewards.metrics(rewards(["a", "b", "c", "d"], [{}] * 4))
    assert metrics["reward/answer/mean"] == pytest.approx(0.5)
    assert "reward/answer/missing" not in metrics  # only for a function that missed a sample
    assert metrics["reward/format/mean"] == pytest.approx(2.0 / 3.0)  # nanmean over the 3 it scored
    assert metrics["reward/format/missing"] == 0.25
    assert metrics["reward/total/mean"] == pytest.approx((1.2 + 0.2 + 1.0 + 0.0) / 4)
    # total/mean = Σ_k w_k (1 − missing_k) mean_k
    assert metrics["reward/total/mean"] == pytest.approx(1.0 * 0.5 + 0.2 * 0.75 * (2.0 / 3.0))
    assert metrics["reward/missing_count"] == 1.0
    assert reward_metrics(rewards(["a", "b", "c", "d"], [{}] * 4)) == metrics


def test_none_marks_a_sample_missing_without_a_warning(caplog):
    @per_sample
    def only_even(completion, example):
        return None if len(completion) % 2 else 1.0

    def batch_none(completions, examples):  # a batch function returning a list with None (TRL style)
        return [None, 0.5, None, 0.25]

    with caplog.at_level(logging.WARNING, logger="rljax.rewards.base"):
        out = only_even(["ab", "abc", "abcd", "a"], [{}] * 4)
        output = combine({"even": (1.0, only_even), "batch": (2.0, batch_none)})(["ab", "abc", "abcd", "a"], [{}] * 4)
    np.testing.assert_array_equal(np.isnan(out), [False, True, False, True])
    assert not caplog.records  # None is "cannot score / does not apply", not a failure
    np.testing.assert_array_equal(output.missing, [True, True, True, True])
    np.testing.assert_allclose(output.total, [1.0, 1.0, 1.0, 0.5])  # missing values count 0
    metrics = reward_metrics(output)
    assert metrics["reward/even/mean"] == 1.0 and metrics["reward/even/missing"] == 0.5
    assert metrics["reward/batch/mean"] == pytest.approx(0.375) and metrics["reward/batch/missing"] == 0.5
    assert metrics["reward/total/mean"] == pytest.approx(3.5 / 4)


def test_a_function_that_scores_no_sample_is_warned_about_once(caplog):
    rewards = combine({"ok": (1.0, lambda c, e: np.ones(len(c))), "nothing": (1.0, lambda c, e: [None] * len(c))})
    with caplog.at_level(logging.WARNING, logger="rljax.rewards.base"):
        for _ in range(3):
            output = rewards(["a", "b"], [{}, {}])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "'nothing' scored none of the 2 samples" in warned[0], warned
    metrics = reward_metrics(output)
    assert math.isnan(metrics["reward/nothing/mean"]) and metrics["reward/nothing/missing"] == 1.0
    assert metrics["reward/total/mean"] == 1.0 and metrics["reward/missing_count"] == 2.0


@pytest.mark.parametrize("bad", [np.inf, -np.inf])
def test_an_infinite_reward_names_the_function_and_the_sample(bad):
    def exploding(completions, examples):
        return np.where(np.arange(len(completions)) == 1, bad, 0.0)

    long_text = "The answer is " + "9" * 200
    with pytest.raises(ValueError, match=rf"reward function 'exploding' returned {bad} for sample 1 of 3 "
                                         r"\(1 infinite in all\), completion 'The answer is 9+'\.\.\.; "
                                         "rewards must be finite"):
        combine({"exploding": (1.0, exploding)})(["a", long_text, "c"], [{}] * 3)
    # a per-sample function returning inf is refused the same way (NaN stays "missing")
    with pytest.raises(ValueError, match="'inf_at_b' returned inf for sample 1"):
        combine({"inf_at_b": (1.0, per_sample(lambda c, e: math.inf if c == "b" else 0.0, name="inf_at_b"))})(
            ["a", "b"], [{}, {}])


def test_a_weighted_total_beyond_float32_names_the_sample():
    big = lambda c, e: np.array([1.0, 3e38])  # noqa: E731 - finite, but 2 · 3e38 is beyond float32
    with pytest.raises(ValueError, match=r"weighted reward total of sample 1 is 6e\+38, beyond float32 .*"
                                         r"big=3e\+38 \(weight 2\); completion 'y'"):
        combine({"big": (2.0, big)})(["x", "y"], [{}, {}])


def test_combine_errors_name_the_function():
    ok = lambda c, e: np.zeros(len(c))  # noqa: E731

    def wrong_shape(completions, examples):
        return np.zeros((len(completions), 1))

    def broken(completions, examples):
        raise RuntimeError("model server down")

    with pytest.raises(ValueError, match=r"'wrong_shape'.*\(2, 1\).*\(2,\)"):
        combine({"ok": (1.0, ok), "wrong_shape": (1.0, wrong_shape)})(["a", "b"], [{}, {}])
    with pytest.raises(RuntimeError, match="'broken'.*model server down"):
        combine({"broken": (1.0, broken)})(["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        combine({"ok": (1.0, ok)})(["a", "b"], [{}])
    with pytest.raises(UserError, match="rewards.ok: the weight must be a number, got 'high'"):
        combine({"ok": ("high", ok)})


# ---------------------------------------------------------------------------------------------
# registry


def test_registered_names():
    assert {"answer", "format", "answer_tag_format", "sentiment", "length", "overlong",
            "countdown", "reasoning_gym", "python"} <= set(registered_rewards())


def test_build_rewards_from_config_mapping():
    rewards = build_rewards(
        {
            "answer": 1.0,
            "format": 0.2,
            "overlong": {"weight": 0.5, "cache_length": 4},
            "chars": {"type": "length", "weight": -0.01, "unit": "chars"},
        },
        max_length=10,  # context: offered to constructors that take it (overlong)
    )
    assert isinstance(rewards, RewardSet)
    assert rewards.names == ("answer", "format", "overlong", "chars")
    completions = ["<think>t</think><answer>47</answer>", "<answer>46</answer>"]
    examples = [dict(EX47, completion_length=6), dict(EX47, completion_length=9)]
    total, per_function, missing = rewards(completions, examples)
    np.testing.assert_allclose(per_function["overlong"], [0.0, -0.75])
    np.testing.assert_allclose(per_function["chars"], [len(completions[0]), len(completions[1])])
    expected = [1.0 + 0.2 + 0.0 - 0.01 * len(completions[0]),
                0.0 + 0.0 + 0.5 * -0.75 - 0.01 * len(completions[1])]
    np.testing.assert_allclose(total, expected)
    assert not missing.any()


def test_build_rewards_errors():
    with pytest.raises(UserError, match="unknown reward 'acuracy'"):
        build_rewards({"acuracy": 1.0})
    with pytest.raises(ValueError, match=r"'format'.*'strict'.*accepted: think_prefilled"):
        build_rewards({"format": {"weight": 1.0, "strict": True}})
    with pytest.raises(TypeError, match="max_length"):
        build_rewards({"overlong": {"cache_length": 4}})  # no max_length option nor context


def test_register_reward_custom_constructor_with_context():
    def make_constant(*, value=1.0, scale=1.0):
        return lambda completions, examples: np.full(len(completions), value * scale)

    register_reward("test_constant", make_constant, overwrite=True)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_constant", lambda: None)
    rewards = build_rewards({"test_constant": {"weight": 2.0, "value": 3.0}}, scale=0.5, unrelated=1)
    total, _, _ = rewards(["a"], [{}])
    np.testing.assert_allclose(total, [3.0])


# ---------------------------------------------------------------------------------------------
# sentiment


def test_vader_sentiment_orders_positive_above_negative():
    fn = make_sentiment_reward()
    texts = ["This movie was wonderful, I loved it!", "The table is brown.",
             "This movie was terrible and boring, I hated it."]
    scores = fn(texts, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == np.float64
    assert scores[0] > 0.5 and scores[2] < -0.5 and abs(scores[1]) < 0.1
    assert np.all(np.abs(scores) <= 1.0)
    with_prompt = make_sentiment_reward(include_prompt=True)
    assert with_prompt(["it."], [{"prompt": "I loved "}])[0] > 0.3


# ---------------------------------------------------------------------------------------------
# shaping


def test_soft_overlong_punishment_hand_values():
    # L_max = 10, L_cache = 4: buffer is (6, 10]
    lengths = [0, 5, 6, 7, 8, 9, 10, 11, 50]
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    np.testing.assert_allclose(soft_overlong_punishment(lengths, max_length=10, cache_length=4), expected)
    # DAPO's setting: 20480 / 4096
    np.testing.assert_allclose(
        soft_overlong_punishment(np.array([16384, 16385, 18432, 20480, 20481]), max_length=20480,
                                 cache_length=4096),
        [0.0, -1.0 / 4096, -0.5, -1.0, -1.0],
    )
    with pytest.raises(ValueError, match="cache_length"):
        soft_overlong_punishment([1], max_length=4, cache_length=8)


def test_overlong_and_length_rewards_read_completion_length():
    overlong = make_overlong_reward(max_length=10, cache_length=4)
    examples = [{"completion_length": n} for n in (6, 8, 12)]
    np.testing.assert_allclose(overlong(["", "", ""], examples), [0.0, -0.5, -1.0])
    with pytest.raises(KeyError, match="completion_length"):
        overlong(["x"], [{"answer": "1"}])
    tokens = make_length_reward()
    np.testing.assert_allclose(tokens(["", "", ""], examples), [6, 8, 12])
    target = make_length_reward(target=8, normalize=4)
    np.testing.assert_allclose(target(["", "", ""], examples), [-0.5, 0.0, -1.0])
    chars = make_length_reward(unit="chars")
    np.testing.assert_allclose(chars(["abc", ""], [{}, {}]), [3, 0])


def test_overlong_matches_the_jax_advantage_version():
    advantages = pytest.importorskip("rljax.advantages")
    if not hasattr(advantages, "soft_overlong_punishment"):
        pytest.skip("rljax.advantages.soft_overlong_punishment not available")
    lengths = np.array([0, 5, 6, 7, 8, 9, 10, 11, 50], dtype=np.int32)
    jax_values = np.asarray(advantages.soft_overlong_punishment(lengths, max_length=10, cache_length=4))
    np.testing.assert_allclose(
        jax_values, soft_overlong_punishment(lengths, max_length=10, cache_length=4), rtol=1e-6)
