"""The ``code`` (unit tests, retries) and ``sql`` (a database, a ``run_sql`` tool) environments, with
scripted policies."""

import json
import re

import numpy as np
import pytest

from rljax.environments import build_environment
from rljax.environments.code_env import CodeEnv
from rljax.environments.episodes import episode_examples, episode_metrics, run_episodes
from rljax.environments.sandbox import SandboxConfig
from rljax.environments.sql_env import SqlEnv
from tests._tiny import tiny_tokenizer

EOS = 2  # <|im_end|> of the tiny byte tokenizer


def _py(code):
    return f"Here it is:\n```python\n{code}\n```"


def _call(query):
    return "<tool_call>" + json.dumps({"name": "run_sql", "arguments": {"query": query}}) + "</tool_call>"


# ------------------------------------------------------------------ code


def test_a_failing_attempt_gets_the_failing_test_and_a_right_retry_terminates_with_reward_one():
    env = CodeEnv(templates=["add_offset"], max_attempts=3)
    messages, info = env.reset(seed=5)
    assert [m["role"] for m in messages] == ["system", "user"] and "add_offset" in messages[1]["content"]
    k = int(re.search(r"x \+ (\d+)", env.problem_["answer"]).group(1))
    cases = env.problem_["tests"]["cases"]
    # right only for positive x: passes exactly the cases with a positive argument
    positive = sum(c["args"][0] > 0 for c in cases)
    assert 0 < positive < len(cases), "seed 5 should give both kinds of inputs"
    reply, r1, terminated, truncated, info = env.step(_py(f"def add_offset(x):\n    return x + {k} if x > 0 else x"))
    assert (r1, terminated, truncated) == (positive / len(cases), False, False)
    first_bad = next(c for c in cases if c["args"][0] <= 0)
    assert reply[0]["role"] == "user"
    assert (f"{positive} of {len(cases)} tests passed" in reply[0]["content"]
            and f"add_offset({first_bad['args'][0]}) returned {first_bad['args'][0]}, "
                f"expected {first_bad['expected']}" in reply[0]["content"])
    assert info["success"] is False and info["metrics"]["attempts"] == 1
    reply, r2, terminated, truncated, info = env.step(_py(env.problem_["answer"]))
    # rewards are differences: the return is the latest attempt's fraction, 1.0
    assert (reply, terminated, truncated, info["success"]) == ([], True, False, True)
    assert r2 == pytest.approx(1 - positive / len(cases)) and r1 + r2 == pytest.approx(1.0)
    assert info["metrics"] == {"tests_passed": 1.0, "attempts": 2.0, "sandbox_kills": 0.0, "no_code": 0.0}


def test_an_infinite_loop_ends_its_attempt_with_a_timeout_and_the_episode_goes_on():
    env = build_environment("code", {"templates": ["poly"], "max_attempts": 2, "sandbox": {"timeout_s": 1.0}})
    env.reset(seed=0)
    reply, reward, terminated, truncated, info = env.step(_py("def poly(x):\n    while True:\n        pass"))
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert "did not finish: the run was stopped (timeout) after 1 s" in reply[0]["content"]
    assert info["metrics"]["sandbox_kills"] == 1
    # no code in the last attempt: 0, and the attempts are spent: truncated
    reply, reward, terminated, truncated, info = env.step("I give up.")
    assert (reply, reward, terminated, truncated, info["success"]) == ([], 0.0, False, True, False)
    assert info["metrics"] == {"tests_passed": 0.0, "attempts": 2.0, "sandbox_kills": 1.0, "no_code": 1.0}


def test_code_bad_replies_are_failed_attempts_with_a_message():
    env = CodeEnv(templates=["clamp"], max_attempts=5)
    env.reset(seed=1)
    reply, reward, *_ = env.step("no code here")
    assert reward == 0.0 and "held no ```python code block" in reply[0]["content"]
    reply, reward, *_ = env.step(_py("def clamp(x) return x"))
    assert reward == 0.0 and "the code failed before any test: SyntaxError" in reply[0]["content"]
    reply, reward, *_ = env.step(_py("def other(x):\n    return x"))
    assert reward == 0.0 and "no function named clamp is defined" in reply[0]["content"]
    # a partly right attempt after a worse one, then a worse one again: the return follows the latest
    _, r_good, *_ = env.step(_py(env.problem_["answer"].replace("max(", "(lambda a, b: b)(")))  # min(hi, x) only
    _, r_bad, terminated, truncated, info = env.step(_py("def clamp(x):\n    return 'x'"))
    assert r_good > 0 and r_bad == -r_good and info["metrics"]["tests_passed"] == 0.0
    assert (terminated, truncated) == (False, True)


def test_code_problems_are_fixed_by_seed_and_the_splits_are_disjoint():
    env = CodeEnv()
    train = {env.problem(s, "train")["key"] for s in range(60)}
    held_out = {env.problem(s, "eval")["key"] for s in range(30)}
    assert not train & held_out and len(held_out) > 20
    assert env.problem(7, "eval") == CodeEnv().problem(7, "eval")


def test_code_environment_options_are_checked():
    with pytest.raises(ValueError, match="unknown template\\(s\\) \\['nope'\\]"):
        build_environment("code", {"templates": ["nope"]})
    with pytest.raises(ValueError, match="environment.options.sandbox: unknown setting\\(s\\) 'timeout'"):
        build_environment("code", {"sandbox": {"timeout": 1}})
    with pytest.raises(ValueError, match="max_attempts must be a positive integer"):
        build_environment("code", {"max_attempts": 0})
    assert CodeEnv(sandbox={"memory_mb": 128}).sandbox == SandboxConfig(timeout_s=5.0, memory_mb=128)


# ------------------------------------------------------------------ sql


def test_sql_tool_explores_the_database_read_only_and_the_final_answer_is_scored():
    env = SqlEnv(questions=["count_in_department"], max_rows_shown=3)
    messages, info = env.reset(seed=2, options={"split": "train"})
    assert "run_sql" in messages[0]["content"] and "CREATE TABLE employees" in messages[1]["content"]
    rows = env.example["setup"][1:]
    reply, reward, terminated, _, info = env.step(_call("SELECT name, salary FROM employees ORDER BY id"))
    first = re.match(r"INSERT INTO employees VALUES \(1, '(\w+)', '\w+', (\d+),", rows[0]).groups()
    lines = reply[0]["content"].splitlines()
    assert lines[0] == "name | salary" and lines[1] == " | ".join(first)
    assert lines[4] == f"... {len(rows)} rows in all" and len(lines) == 5  # truncated to 3 rows
    assert (reward, terminated, info["tool_calls"], info["tool_errors"]) == (0.0, False, ["run_sql"], 0)
    # a write and malformed SQL are tool errors the model sees; the database is unchanged
    reply, *_, info = env.step(_call("DELETE FROM employees"))
    assert reply[0]["content"].startswith("error: ") and "not authorized" in reply[0]["content"]
    assert info["tool_errors"] == 1
    reply, *_, info = env.step(_call("SELEC name FROM employees"))
    assert "syntax error" in reply[0]["content"] and info["tool_errors"] == 1
    reply, *_ = env.step(_call("SELECT COUNT(*) FROM employees"))
    assert reply[0]["content"] == f"COUNT(*)\n{len(rows)}"
    # the final answer: the gold query's result, written differently, is right
    department = re.search(r"the (\w+) department", env.example["question"]).group(1)
    answer = f"```sql\nSELECT count(id) FROM employees WHERE department = '{department}';\n```"
    reply, reward, terminated, truncated, info = env.step(answer)
    assert (reply, reward, terminated, truncated) == ([], 1.0, True, False)
    assert info == {"success": True, "metrics": {"answered": 1.0, "executes": 1.0}}


@pytest.mark.parametrize("answer, executes", [
    ("I do not know.", None),  # no SQL
    ("```sql\nSELEC COUNT(*) FROM employees\n```", 0.0),  # malformed
    ("```sql\nDROP TABLE employees\n```", 0.0),  # a write
    ("<answer>SELECT name FROM employees WHERE salary > 0 ORDER BY name DESC</answer>", 1.0),  # wrong order
])
def test_sql_wrong_final_answers_score_zero(answer, executes):
    env = SqlEnv(questions=["names_above_salary"], explore=False)
    messages, _ = env.reset(seed=4)
    assert "run_sql" not in messages[0]["content"] and "<tools>" not in messages[0]["content"]
    env.example = dict(env.example, answer="SELECT name FROM employees WHERE salary > 0 ORDER BY name")
    reply, reward, terminated, truncated, info = env.step(answer)
    assert (reply, reward, terminated, truncated, info["success"]) == ([], 0.0, True, False, False)
    assert info["metrics"] == {"answered": float(executes is not None), "executes": executes or 0.0}
    right = "```sql\nSELECT name FROM employees ORDER BY name\n```"
    assert env.step(right)[1] == 1.0  # the same query in the asked order is right


def test_sql_questions_are_fixed_by_seed_and_the_splits_are_disjoint():
    env = SqlEnv()
    train = {env.problem(s, "train")["key"] for s in range(60)}
    held_out = {env.problem(s, "eval")["key"] for s in range(30)}
    assert not train & held_out and len(held_out) == 30
    assert env.problem(3, "eval") == SqlEnv().problem(3, "eval")
    with pytest.raises(ValueError, match="unknown question\\(s\\) \\['nope'\\]"):
        build_environment("sql", {"questions": ["nope"]})


# ------------------------------------------------------------------ episodes


def _scripted(tokenizer, reply):
    """A turn sampler answering ``reply(context text, turn)`` then <|im_end|>."""
    def sample(ids, mask, turn):
        rows = [tokenizer(reply(tokenizer.decode(ids[r][mask[r] == 1]), turn), add_special_tokens=False)["input_ids"]
                + [EOS] for r in range(len(ids))]
        N = max(len(r) for r in rows)
        tokens, tmask = np.full((len(rows), N), EOS, np.int32), np.zeros((len(rows), N), np.int32)
        for r, row in enumerate(rows):
            tokens[r, :len(row)], tmask[r, :len(row)] = row, 1
        return tokens, tmask, -0.25 * tmask.astype(np.float32), np.ones(len(rows), bool)
    return sample


def test_a_code_episode_retries_after_the_failing_test_and_logs_its_metrics():
    """Scripted: a wrong function first; the retry (seeing "expected N" in the context) is right."""
    tok = tiny_tokenizer()

    def reply(context, turn):
        if turn == 0:
            return _py("def add_offset(x):\n    return x")
        m = re.findall(r"add_offset\((-?\d+)\) returned -?\d+, expected (-?\d+)", context)[-1]
        return _py(f"def add_offset(x):\n    return x + {int(m[1]) - int(m[0])}")

    episodes = run_episodes(_scripted(tok, reply), tok, lambda: CodeEnv(templates=["add_offset"]),
                            episode_examples("code", "eval", 2, 0), repeats=2, max_turns=3, max_tokens=4096,
                            max_new_tokens=64, pad_id=EOS)
    assert [(e.status, e.num_turns, e.rewards, e.success) for e in episodes] == [("terminated", 2, [0.0, 1.0], True)] * 4
    m = episode_metrics(episodes)
    assert (m["env/success_rate"], m["env/attempts"], m["env/tests_passed"], m["env/sandbox_kills"]) == (1, 2, 1, 0)
