"""Bounded verifiers: model text cannot make a reward call run without a time and memory bound.

Every test here shares one pool of two workers (the answer reward's own, `shared_pool` with the
settings below), so the module pays the worker start-up once, plus one restart per kill or crash.
The scorers sent to it are builtins (the workers cannot import this test module).
"""

import functools
import os
import random
import re
import threading

import numpy as np
import pytest

from rljax.rewards import answer_score, build_rewards, extract_tag, has_answer_tag, make_answer_reward
from rljax.rewards.bounded import BoundedPool, bound_hit_metrics, shared_pool
from rljax.rewards.answers import normalize_answer

BOUNDS = dict(time_limit_seconds=3.0, memory_limit_mb=512, workers=2)
TOWER = "10^{10^{10^{10}}}"  # sympy computes this power in C: ~15 s and 8.5 GB unbounded


@pytest.fixture(scope="module")
def pool():
    return shared_pool(**BOUNDS, preload=("rljax.rewards.answers", "math_verify", "sympy"))


@pytest.fixture(scope="module")
def reward(pool):
    return make_answer_reward(**BOUNDS)


# ---------------------------------------------------------------------------------------------
# the pool


def test_pool_returns_values_and_errors_in_order(pool):
    out = pool.map(int, [("12",), ("not a number",), ("7",)])
    assert [o.value for o in out] == [12, None, 7]
    assert [o.reason for o in out] == [None, "error", None]
    assert out[1].error.startswith("ValueError: invalid literal for int()")


def test_memory_bomb_is_stopped_and_the_worker_lives_on(pool):
    restarts = pool.restarts
    out = pool.map(bytearray, [(4 << 30,), (3,)])  # 4 GiB against a 512 MiB bound
    assert out[0].reason == "memory" and out[0].value is None
    assert out[1].reason is None and out[1].value == bytearray(3)
    assert pool.restarts == restarts  # a MemoryError needs no new worker


def test_uninterruptible_c_loop_is_killed_and_the_rest_of_the_batch_scored(pool):
    # sum(range(...)) never returns to the interpreter loop: no signal handler could stop it.
    restarts = pool.restarts
    items = [(range(5),), (range(10**13),), (range(4),), (range(3),)]
    out = pool.map(sum, items)
    assert [o.reason for o in out] == [None, "timeout", None, None]
    assert [o.value for o in out] == [10, None, 6, 3]
    assert pool.restarts == restarts + 1


def test_crashed_worker_is_replaced(pool):
    restarts = pool.restarts
    out = pool.map(os.abort, [()])
    assert out[0].reason == "crash"
    assert pool.restarts == restarts + 1
    assert pool.map(len, [("abc",)])[0].value == 3


def test_concurrent_callers_each_get_their_own_results(pool):
    results = {}

    def call(k):
        results[k] = [o.value for o in pool.map(abs, [(-k * 10 - j,) for j in range(5)])]

    threads = [threading.Thread(target=call, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [k * 10 + j for j in range(5)] for k in range(6)}


def test_pool_settings_are_checked():
    with pytest.raises(ValueError, match="time_limit_seconds"):
        BoundedPool(time_limit_seconds=0)
    with pytest.raises(ValueError, match="memory_limit_mb"):
        BoundedPool(memory_limit_mb=1.5)
    with pytest.raises(ValueError, match="workers"):
        BoundedPool(workers=0)
    with pytest.raises(ValueError, match="answer reward: time_limit_seconds"):
        make_answer_reward(time_limit_seconds=float("nan"))
    built = build_rewards({"answer": {"time_limit_seconds": 2, "memory_limit_mb": 256, "workers": 1}})
    assert built.names == ("answer",)


def test_closed_pool_refuses_work():
    closed = BoundedPool(workers=1)
    closed.close()  # never started: nothing to stop
    with pytest.raises(RuntimeError, match="after close"):
        closed.map(len, [("a",)])


# ---------------------------------------------------------------------------------------------
# the answer reward through the pool


def test_power_tower_scores_zero_counted_and_the_next_samples_are_scored(reward):
    completions = [f"<answer>{TOWER}</answer>", "<answer>\\frac{1}{2}</answer>", "<answer>x+1</answer>"]
    examples = [{"answer": "\\frac{1}{2}+x"}, {"answer": "0.5"}, {"answer": "1+x"}]
    np.testing.assert_array_equal(reward(completions, examples), [0.0, 1.0, 1.0])
    hits = bound_hit_metrics({"answer": reward})
    assert hits["reward/answer/timeouts"] + hits["reward/answer/memory"] == 1.0
    assert hits["reward/answer/crashes"] == 0.0
    # counts are per call of bound_hit_metrics; the next batch is scored as usual
    np.testing.assert_array_equal(reward(completions[1:], examples[1:]), [1.0, 1.0])
    assert bound_hit_metrics({"answer": reward}, prefix="eval/") == {
        "eval/answer/timeouts": 0.0, "eval/answer/memory": 0.0, "eval/answer/crashes": 0.0}


ANSWERS = [  # (completion, gold, score): fast path and math-verify path, boxed LaTeX included
    ("<answer>47</answer>", "47", 1.0),
    ("<answer>\\boxed{47}</answer>", "47", 1.0),
    ("<answer>$\\boxed{\\frac{3}{4}}$</answer>", "0.75", 1.0),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{2}{4}", 1.0),
    ("<answer>\\sqrt{8}</answer>", "2\\sqrt{2}", 1.0),
    ("<answer>\\boxed{2\\sqrt{2}}</answer>", "\\sqrt{9}", 0.0),
    ("<answer>1+x</answer>", "x+1", 1.0),
    ("<answer>x+2</answer>", "x+1", 0.0),
    ("<answer>\\pi/2</answer>", "\\frac{\\pi}{2}", 1.0),
    ("<answer>12+35</answer>", "47", 0.0),  # an operator against a plain-number gold
    ("<answer>\\frac{94}{2}</answer>", "47", 1.0),
    ("<answer>\\{1, 2\\}</answer>", "\\{2, 1\\}", 1.0),
    ("<answer>0.3333</answer>", "1/3", 0.0),
    ("<answer>forty-seven</answer>", "47", 0.0),
    ("The answer is 47.", "47", 0.0),
]


def test_bounded_reward_scores_as_the_in_process_verifier(reward):
    completions = [c for c, _, _ in ANSWERS]
    examples = [{"answer": g} for _, g, _ in ANSWERS]
    expected = [s for _, _, s in ANSWERS]
    assert [answer_score(c, e) for c, e in zip(completions, examples)] == expected
    np.testing.assert_array_equal(reward(completions, examples), expected)
    assert sum(reward.bound_hits.values()) == 0


def test_bad_example_is_nan_for_that_sample_only(reward):
    out = reward(["<answer>\\sqrt{4}</answer>", "<answer>2</answer>"], [{"answer": "2"}, {"question": "?"}])
    assert out[0] == 1.0 and np.isnan(out[1])


# ---------------------------------------------------------------------------------------------
# linear-time text scanning


class _CountingStr(str):
    """A str that adds up the characters each `find` call scans."""

    scanned = 0

    def find(self, sub, start=0, end=None):
        found = str.find(self, sub, start, end)
        type(self).scanned += (len(self) if found < 0 else found + len(sub)) - start
        return found


def test_extract_tag_scans_each_character_a_bounded_number_of_times():
    # 160k characters of unclosed tags: the regex retried from every "<answer>" (17 s).
    for text, expected in [("<answer>" * 20_000 + "x" * 1000, None),
                           ("<answer>1</answer>" + "<answer>" * 20_000, "1"),
                           ("<answer>" * 20_000 + "7</answer>", "<answer>" * 19_999 + "7")]:
        _CountingStr.scanned = 0
        text = _CountingStr(text)
        assert extract_tag(text) == expected
        assert 0 < _CountingStr.scanned <= 2 * len(text) + 100


@pytest.mark.parametrize("text, expected", [
    ("<answer>1</answer><answer>2</answer>", "2"),  # the last pair
    ("<answer>1</answer> <answer>2", "1"),  # the last one is never closed
    ("<answer><answer>3</answer>", "<answer>3"),  # an opening tag runs to the first closing tag
    ("<answer>4</answer></answer>", "4"),
    ("<answer>5</answer>", "5"),
    ("</answer><answer>6</answer>", "6"),
    ("<answer></answer>", ""),
    ("<answer>\n 8 \n</answer>", "8"),
    ("<answer>8</answer", None),
    ("<think><answer>9</answer></think>", "9"),
])
def test_extract_tag_semantics(text, expected):
    assert extract_tag(text) == expected


def _normalize_reference(text):
    """normalize_answer as it was written before (one slice per layer): the plain reference."""
    s = text.strip().replace("\u2212", "-")
    changed = True
    while changed:
        before = s
        s = s.strip()
        if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
            s = s.strip("$")
        if s.startswith("\\(") and s.endswith("\\)"):
            s = s[2:-2]
        if s.startswith("\\boxed{") and s.endswith("}"):
            s = s[len("\\boxed{"):-1]
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1]
        changed = s != before
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    return re.sub(r"\s+", "", s)


def test_scans_agree_with_their_references_on_random_text():
    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "<answer", "answer>", "</", "<", ">", "1", "x", " ", "\n"]
    wrappers = ["$", "\\(", "\\)", "\\boxed{", "}", ".", " ", "1", ",", "000", "\u2212", "x"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        matches = re.findall("<answer>(.*?)</answer>", text, re.DOTALL)
        assert extract_tag(text) == (matches[-1].strip() if matches else None), text
        assert has_answer_tag(text) == any(m.strip() for m in matches), text
        answer = "".join(rng.choice(wrappers) for _ in range(rng.randrange(12)))
        assert normalize_answer(answer) == _normalize_reference(answer), answer


def test_has_answer_tag_on_multiple_and_unclosed_tags():
    assert has_answer_tag("<answer> </answer><answer>1</answer>")
    assert not has_answer_tag("<answer> </answer><answer>1")
    assert not has_answer_tag("<answer>" * 20_000)


def test_normalize_answer_peels_deep_nesting():
    # One copy per layer made this quadratic; the layers come off in one pass now.
    deep = "$" + "\\boxed{" * 20_000 + "\\(1,000.\\)" + "}" * 20_000 + "$"
    assert normalize_answer(deep) == "1000"
    assert normalize_answer(" \\boxed{\\boxed{ 47 }}. ") == "47"
    assert normalize_answer("$$47$$") == "47"
    assert normalize_answer("47..") == "47.."
    assert normalize_answer("\\(\\)") == ""


def test_tiny_reward_call_does_not_start_a_pool_without_math_verify_work():
    # Answers the fast path settles never cross to a worker: this reward's pool is never made.
    fn = make_answer_reward(time_limit_seconds=1.5, workers=1)
    np.testing.assert_array_equal(fn(["<answer>47.0</answer>", "none", "<answer>1,000</answer>"],
                                     [{"answer": "47"}, {"answer": "1"}, {"answer": "1000"}]), [1.0, 0.0, 1.0])
    from rljax.rewards import bounded

    assert not any(key[0] == 1.5 for key in bounded._POOLS)


def test_partial_of_module_function_runs_in_the_pool(pool):
    out = pool.map(functools.partial(int, base=2), [("101",), ("2",)])
    assert out[0].value == 5 and out[1].reason == "error"


def test_worker_runs_the_reward_package_init_only_when_asked():
    # Workers skip rljax.rewards/__init__ (it imports JAX via the learned reward model) until a
    # name is looked up on the package; then the whole package is there.
    own = BoundedPool(workers=1)
    try:
        before, after = own.map(exec, [("import sys; assert 'jax' not in sys.modules",),
                                       ("from rljax.rewards import answer_score, registered_rewards\n"
                                        "import rljax.rewards.answers as v\n"
                                        "assert answer_score is v.answer_score and 'reward_model' in registered_rewards()",)])
        assert before.reason is None and after.reason is None, (before, after)
    finally:
        own.close()



def test_unpicklable_item_leaves_no_half_batch_behind(pool):
    with pytest.raises(TypeError, match="pickle"):
        pool.map(len, [("ab",), ("abc",), ((c for c in "x"),)])  # the second worker's chunk holds a generator
    assert [o.value for o in pool.map(len, [("a",), ("bb",), ("ccc",)])] == [1, 2, 3]
    assert pool.map(memoryview, [(b"ab",)])[0].error.startswith("result not sent: TypeError")
