"""Code tasks: generated problems with hidden tests, checked in the sandbox; the "code" task and the
"code_tests" reward."""

import math

import pytest

import rljax.environments  # noqa: F401 - registers the "code" task and the "code_tests" reward
from rljax.data import make_task
from rljax.environments.code_tasks import FEEDBACK_CHARS, TEMPLATES, check_code, extract_code, make_problem
from rljax.environments.sandbox import SandboxUnavailable
from rljax.rewards import build_rewards, registered_rewards
from rljax.rewards.bounded import bound_hit_metrics

FAST = {"timeout_s": 2.0, "memory_mb": 128}


def test_problems_are_deterministic_distinct_and_split_by_question():
    train = make_task("code", split="train", size=40, seed=3)
    again = make_task("code", split="train", size=40, seed=3)
    evals = make_task("code", split="eval", size=40, seed=3)
    assert train == again
    assert len({e["key"] for e in train}) == 40
    assert not {e["key"] for e in train} & {e["key"] for e in evals}
    assert make_task("code", split="train", size=10, seed=3) == train[:10]  # a larger request extends it
    assert {e["template"] for e in train} <= {t.name for t in TEMPLATES}


def test_hidden_tests_never_all_expect_one_value():
    # else a constant function (`return True`) would pass them all
    for example in make_task("code", split="train", size=300, seed=5):
        assert len({repr(case["expected"]) for case in example["tests"]["cases"]}) > 1, example["key"]


def test_a_problem_by_hand():
    problem = make_problem("poly", {"a": 1, "b": 2, "c": 3}, num_tests=4, seed=0, instruction=None)
    shown = int(problem["prompt"].split("poly(")[2].split(")")[0])
    assert problem["prompt"] == (f"Write a Python function `poly(x: int) -> int` that returns 1*x*x + 2*x + 3. "
                                 f"For example, poly({shown}) == {shown * shown + 2 * shown + 3}.")
    cases = problem["tests"]["cases"]
    assert problem["tests"]["function"] == "poly" and len(cases) == 4
    assert all(c["expected"] == c["args"][0] ** 2 + 2 * c["args"][0] + 3 for c in cases)
    assert [shown] not in [c["args"] for c in cases]  # the worked call is not a hidden test
    assert problem["answer"] == "def poly(x):\n    return 1 * x * x + 2 * x + 3\n"
    with pytest.raises(ValueError, match="unknown template"):
        make_task("code", split="train", size=1, seed=0, templates=["sort_it"])


@pytest.mark.parametrize("reply, code", [
    ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
    ("```py\nx = 1\n```\nthen\n```\nx = 2\n```", "x = 2\n"),  # the last block
    ("```python\ndef f():\n    return", "def f():\n    return"),  # cut at the token limit
    ("<answer>\ndef g(): return 2\n</answer>", "def g(): return 2"),
    ("def f(): return 1", None),
])
def test_extract_code(reply, code):
    assert extract_code(reply) == code


def test_check_code_counts_passes_and_names_the_first_failure():
    problem = make_problem("add_offset", {"k": 5}, num_tests=6, seed=1)
    tests = problem["tests"]
    xs = [c["args"][0] for c in tests["cases"]]
    right = check_code(problem["answer"], tests, **FAST)
    assert (right.passed, right.total, right.first_failure) == (6, 6, None)

    # Right for x >= 0 only, and printing as it goes (its prints must not confuse the harness).
    half = "def add_offset(x):\n    print('called', x)\n    return x + 5 if x >= 0 else x\n"
    result = check_code(half, tests, **FAST)
    assert result.passed == sum(x >= 0 for x in xs) and result.total == 6
    first_bad = next(x for x in xs if x < 0)
    assert result.first_failure == f"add_offset({first_bad}) returned {first_bad}, expected {first_bad + 5}"
    assert "called" in result.exec_result.stderr

    raising = check_code("def add_offset(x):\n    return 1 // 0\n", tests, **FAST)
    assert raising.passed == 0
    assert raising.first_failure == f"add_offset({xs[0]}) raised ZeroDivisionError: integer division or modulo by zero"

    wrong_type = check_code("def add_offset(x):\n    return float(x + 5)\n", tests, **FAST)  # 5.0 is not 5
    assert wrong_type.passed == 0


def test_a_huge_return_value_is_shown_to_the_model_cut_short():
    tests = make_problem("add_offset", {"k": 5}, num_tests=3, seed=1)["tests"]
    x = tests["cases"][0]["args"][0]
    flood = check_code("def add_offset(x):\n    return [7] * 100_000\n", tests, **FAST)  # ~300 kB of JSON
    shown = f"add_offset({x}) returned {[7] * 100_000!r}, expected {x + 5!r}"
    assert flood.passed == 0 and len(flood.first_failure) < 500
    assert flood.first_failure == (f"{shown[:FEEDBACK_CHARS]}... ({len(shown) - FEEDBACK_CHARS} more characters)")


def test_check_code_failures_before_any_test():
    tests = make_problem("clamp", {"lo": 0, "hi": 9}, num_tests=3, seed=0)["tests"]
    cases = {
        "def clamp(x) return x": "the code failed before any test: SyntaxError: expected ':' (solution.py, line 1)",
        "def clip(x):\n    return x\n": "the code failed before any test: no function named clamp is defined",
        "import sys\nsys.exit(0)\n": "the code failed before any test: SystemExit: 0",
    }
    for code, message in cases.items():
        result = check_code(code, tests, **FAST)
        assert (result.passed, result.first_failure) == (0, message)


def test_forged_results_and_a_hang_score_nothing():
    tests = make_problem("clamp", {"lo": 0, "hi": 9}, num_tests=3, seed=0)["tests"]
    first = tests["cases"][0]["args"][0]
    # Printing lines that look like results (without the nonce) and then hanging on the first call.
    code = ("import os\nfor i in range(3):\n    os.write(1, ('x {\"i\": %d, \"value\": \"0\"}\\n' % i).encode())\n"
            "def clamp(x):\n    while True:\n        pass\n")
    result = check_code(code, tests, timeout_s=1.0, memory_mb=128)
    assert result.passed == 0 and result.exec_result.timed_out
    assert result.first_failure == f"clamp({first}) did not finish: the run was stopped (timeout) after 1 s"


def test_code_tests_reward_scores_a_batch():
    assert "code_tests" in registered_rewards()
    problem = make_problem("every_nth", {"k": 2}, num_tests=4, seed=0)
    rewards = build_rewards({"code": {"type": "code_tests", "sandbox": {"timeout_s": 1.0, "memory_mb": 128}}})
    lengths = [len(c["args"][0]) for c in problem["tests"]["cases"]]
    assert lengths == [7, 5, 14, 10]  # the hidden lists of this seed
    completions = [
        "```python\ndef every_nth(xs):\n    return xs[::2]\n```",
        "```python\ndef every_nth(xs):\n    return xs[::2] if len(xs) % 2 else xs[:1]\n```",  # right for odd lengths
        "I think you should use slicing.",
        "```python\ndef every_nth(xs):\n    while True: pass\n```",
        "```python\nprint(1)\n```",
    ]
    examples = [problem] * 4 + [{"prompt": "no tests"}]
    out = rewards(completions, examples)
    values = out.per_function["code"]
    assert values[:4].tolist() == [1.0, 0.5, 0.0, 0.0] and math.isnan(values[4])
    metrics = bound_hit_metrics(rewards.functions)
    assert metrics["reward/code/timeouts"] == 1.0 and metrics["reward/code/crashes"] == 0.0


def test_code_tests_reward_checks_its_sandbox_settings_at_start():
    with pytest.raises(ValueError, match=r"rewards.code.sandbox: unknown setting\(s\) 'timeout'"):
        build_rewards({"code": {"type": "code_tests", "sandbox": {"timeout": 1}}})
    with pytest.raises(SandboxUnavailable, match=r"rewards.code.sandbox: refusing .*apt-get install bubblewrap"):
        build_rewards({"code": {"type": "code_tests", "sandbox": {"use_namespaces": False}}})
    with pytest.raises(ValueError, match=r"rewards.code.sandbox.require_namespaces is no longer .*allow_unsandboxed"):
        build_rewards({"code": {"type": "code_tests", "sandbox": {"require_namespaces": False}}})
