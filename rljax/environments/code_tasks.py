"""Code tasks: procedurally generated function-writing problems, checked by hidden unit tests run in
the sandbox.

    examples = make_task("code", split="train", size=100, seed=0)   # registered data task "code"
    result = check_code(extract_code(completion), examples[0]["tests"], timeout_s=5.0, memory_mb=256)
    reward = result.passed / result.total                              # registered reward "code_tests"

A problem comes from a bank of templates (`TEMPLATES`: add an offset, scale a list, count multiples,
clamp, a polynomial, Caesar shift, Fibonacci modulo m, a sliding-window maximum, ...) with random
parameters: "Write a Python function `clamp(x: int) -> int` that returns x limited to the range
[-12, 40] ...". Its key is the template and its parameters, so the train / eval split is by
question (`rljax.data.tasks.question_split`, one seed). Each example holds:

- `prompt`: the problem, one worked call, and how to reply (the code in a ```python block);
- `tests`: `{"function": name, "cases": [{"args": [...], "expected": value}, ...]}`, the hidden unit
  tests (`num_tests` random inputs per problem, none of them the worked call), JSON values;
- `answer`: a reference solution (the source the expected values were computed with), e.g. for SFT
  demonstrations; `template`, `key`, `task`.

How a reply is checked (`check_code`): the code runs in `rljax.environments.sandbox.run_python`
inside a small harness that loads it, then calls the function on each case's arguments and prints
the JSON of what it returned (or the exception it raised), one line per case, tagged with a random
nonce the program does not know. The expected values never enter the sandbox: the parent compares.
The arguments arrive on stdin (a pipe), not in a file. The program's own prints go to stderr. A case
passes when the JSON of the returned value equals the JSON of the expected one (so `True` is not
`1` and `2.0` is not `2`). A case with no line (the run timed out or was killed before it) fails.
What the harness cannot stop: code that walks the interpreter's frames to find the nonce can forge
lines, but not the expected values, which it never sees.

Code extraction (`extract_code`): the last ```python (or ```py, or bare ```) fenced block; an opening
fence never closed (a reply cut at the token limit) counts to the end of the text; otherwise the
last <answer>...</answer>; otherwise None (reward 0: no code is a failed attempt, not a missing score).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from rljax.data.tasks import question_split, register_task
from rljax.environments.sandbox import ExecResult, SandboxConfig, check_namespaces, run_python
from rljax.rewards.base import check_batch, register_reward

DEFAULT_INSTRUCTION = "Reply with only the function in a ```python code block."
DEFAULT_SANDBOX = {"timeout_s": 5.0, "memory_mb": 256}


# ---------------------------------------------------------------------------------------------
# Templates


@dataclass(frozen=True)
class _Template:
    name: str  # the function's name
    signature: str  # "(x: int) -> int"
    params: Callable[[np.random.Generator], dict]  # random parameters of one problem
    describe: str  # what the function does, formatted with the parameters
    source: str  # the reference solution, formatted with the parameters
    inputs: Callable[[np.random.Generator, dict], list]  # one random argument list


def _derived_seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & 0x7FFF_FFFF


def _ints(rng, low, high, n):
    return [int(v) for v in rng.integers(low, high + 1, size=n)]


def _sprinkle(rng, word: str, char: str) -> str:
    """`word` with 0-4 copies of `char` inserted at random places (so a count is rarely 0)."""
    for _ in range(int(rng.integers(0, 5))):
        at = int(rng.integers(0, len(word) + 1))
        word = word[:at] + char + word[at:]
    return word


def _divisible_input(rng, a: int, b: int) -> int:
    """A multiple of both, of one of them, or any number, a third of the time each."""
    kind = int(rng.integers(0, 3))
    base = a * b // math.gcd(a, b) if kind == 0 else (a, b)[int(rng.integers(0, 2))] if kind == 1 else 1
    return int(rng.integers(0, 60 if kind < 2 else 500)) * base


def _word(rng, low=1, high=12):
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "".join(letters[int(i)] for i in rng.integers(0, 26, size=int(rng.integers(low, high + 1))))


TEMPLATES: tuple[_Template, ...] = (
    _Template("add_offset", "(x: int) -> int", lambda r: {"k": int(r.integers(2, 1000))},
              "returns x plus {k}", "def add_offset(x):\n    return x + {k}\n",
              lambda r, p: _ints(r, -1000, 1000, 1)),
    _Template("scale_list", "(xs: list[int]) -> list[int]", lambda r: {"k": int(r.integers(-20, 21))},
              "returns a new list with every element of xs multiplied by {k}",
              "def scale_list(xs):\n    return [x * {k} for x in xs]\n",
              lambda r, p: [_ints(r, -50, 50, int(r.integers(0, 8)))]),
    _Template("count_multiples", "(xs: list[int]) -> int", lambda r: {"k": int(r.integers(2, 30))},
              "returns how many elements of xs are divisible by {k}",
              "def count_multiples(xs):\n    return sum(1 for x in xs if x % {k} == 0)\n",
              lambda r, p: [_ints(r, -100, 100, int(r.integers(0, 12)))]),
    _Template("clamp", "(x: int) -> int",
              lambda r: dict(zip(("lo", "hi"), sorted(_ints(r, -100, 100, 1) + _ints(r, -100, 100, 1)))),
              "returns x limited to the range [{lo}, {hi}] (values below {lo} become {lo}, above {hi} become {hi})",
              "def clamp(x):\n    return max({lo}, min({hi}, x))\n",
              lambda r, p: _ints(r, -150, 150, 1)),
    _Template("poly", "(x: int) -> int",
              lambda r: {"a": int(r.integers(-9, 10)), "b": int(r.integers(-9, 10)), "c": int(r.integers(-9, 10))},
              "returns {a}*x*x + {b}*x + {c}", "def poly(x):\n    return {a} * x * x + {b} * x + {c}\n",
              lambda r, p: _ints(r, -30, 30, 1)),
    _Template("repeat_join", "(s: str) -> str",
              lambda r: {"k": int(r.integers(2, 6)), "sep": "-_,;:|/+"[int(r.integers(0, 8))]},
              "returns s repeated {k} times, joined by {sep!r}",
              "def repeat_join(s):\n    return {sep!r}.join([s] * {k})\n",
              lambda r, p: [_word(r)]),
    _Template("fib_mod", "(n: int) -> int", lambda r: {"m": int(r.integers(2, 1000))},
              "returns the n-th Fibonacci number modulo {m} (fib(0) = 0, fib(1) = 1)",
              "def fib_mod(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {m}\n"
              "    return a % {m}\n",
              lambda r, p: _ints(r, 0, 80, 1)),
    _Template("keep_greater", "(xs: list[int]) -> list[int]", lambda r: {"t": int(r.integers(-50, 51))},
              "returns the elements of xs greater than {t}, in their order",
              "def keep_greater(xs):\n    return [x for x in xs if x > {t}]\n",
              lambda r, p: [_ints(r, -100, 100, int(r.integers(0, 10)))]),
    _Template("caesar", "(s: str) -> str", lambda r: {"k": int(r.integers(1, 26))},
              "returns s with every lowercase letter shifted {k} places forward in the alphabet "
              "(wrapping from z to a); other characters stay as they are",
              "def caesar(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c"
              " for c in s)\n",
              lambda r, p: [_word(r) + " " + _word(r, 0, 5) + "!"]),
    _Template("count_char", "(s: str) -> int", lambda r: {"c": "abcdefghijklmnopqrstuvwxyz"[int(r.integers(0, 26))]},
              "returns how many times the letter {c!r} occurs in s",
              "def count_char(s):\n    return s.count({c!r})\n",
              lambda r, p: [_sprinkle(r, _word(r, 0, 20), p["c"])]),
    _Template("digit_sum", "(n: int) -> int", lambda r: {"b": int(r.integers(2, 17))},
              "returns the sum of the digits of the non-negative integer n written in base {b}",
              "def digit_sum(n):\n    total = 0\n    while n:\n        n, d = divmod(n, {b})\n        total += d\n"
              "    return total\n",
              lambda r, p: _ints(r, 0, 100000, 1)),
    _Template("max_window_sum", "(xs: list[int]) -> int", lambda r: {"k": int(r.integers(2, 6))},
              "returns the largest sum of {k} consecutive elements of xs (xs has at least {k} elements)",
              "def max_window_sum(xs):\n    return max(sum(xs[i:i + {k}]) for i in range(len(xs) - {k} + 1))\n",
              lambda r, p: [_ints(r, -50, 50, int(r.integers(p["k"], p["k"] + 8)))]),
    _Template("divisible_by_both", "(n: int) -> bool",
              lambda r: {"a": int(r.integers(2, 13)), "b": int(r.integers(2, 13))},
              "returns True when n is divisible by both {a} and {b}, else False",
              "def divisible_by_both(n):\n    return n % {a} == 0 and n % {b} == 0\n",
              lambda r, p: [_divisible_input(r, p["a"], p["b"])]),
    _Template("every_nth", "(xs: list[int]) -> list[int]", lambda r: {"k": int(r.integers(2, 6))},
              "returns every {k}-th element of xs starting with the first (indices 0, {k}, 2*{k}, ...)",
              "def every_nth(xs):\n    return xs[::{k}]\n",
              lambda r, p: [_ints(r, -20, 20, int(r.integers(0, 15)))]),
)
_BY_NAME = {t.name: t for t in TEMPLATES}


def _reference(template: _Template, params: dict) -> tuple[str, Callable]:
    source = template.source.format(**params)
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<reference {template.name}>", "exec"), namespace)  # our own template code
    return source, namespace[template.name]


def _call_text(function: str, args: Sequence) -> str:
    return f"{function}({', '.join(repr(a) for a in args)})"


def make_problem(template: str, params: Mapping[str, Any], *, num_tests: int = 5, seed: int = 0,
                 instruction: str | None = DEFAULT_INSTRUCTION) -> dict[str, Any]:
    """One problem of `template` (a name in `TEMPLATES`) with `params`: the example dict (see the
    module docstring). Test inputs are drawn from `seed` and the key, distinct, and never the worked call."""
    t = _BY_NAME[template]
    params = dict(params)
    source, fn = _reference(t, params)
    key = f"{t.name}:" + ",".join(f"{k}={params[k]!r}" for k in sorted(params))
    rng = np.random.default_rng(_derived_seed(seed, "code-tests", key))
    calls: list[list] = []
    for _ in range(50 * (num_tests + 1)):
        args = t.inputs(rng, params)
        if args not in calls:
            calls.append(args)
        if len(calls) == 4 * (num_tests + 1):
            break
    if len(calls) < 2:
        raise ValueError(f"code template {template!r}: could not draw distinct test inputs for {params}")
    shown, hidden, spare = calls[0], calls[1:num_tests + 1], calls[num_tests + 1:]
    # Hidden tests that all expect one value would pass a constant function: swap one for a spare
    # input with another answer where there is one (e.g. True and False for divisible_by_both).
    if len(hidden) > 1 and len({repr(fn(*a)) for a in hidden}) == 1:
        other = next((a for a in spare if repr(fn(*a)) != repr(fn(*hidden[0]))), None)
        if other is not None:
            hidden[-1] = other
    description = t.describe.format(**params)
    prompt = (f"Write a Python function `{t.name}{t.signature}` that {description}. "
              f"For example, {_call_text(t.name, shown)} == {fn(*shown)!r}.")
    if instruction:
        prompt += f" {instruction}"
    cases = [{"args": args, "expected": fn(*args)} for args in hidden]
    return {"prompt": prompt, "answer": source, "task": "code", "key": key, "template": t.name,
            "tests": {"function": t.name, "cases": cases}}


def _code_task(*, split: str, size: int, seed: int, eval_fraction: float, num_tests: int = 5,
               templates: Sequence[str] | None = None, instruction: str | None = DEFAULT_INSTRUCTION,
               max_draws: int | None = None) -> list[dict[str, Any]]:
    """Data task "code" (`rljax.data.tasks.register_task`): `size` distinct problems of `split`.
    Options: `num_tests` (hidden tests per problem, default 5), `templates` (names, default all),
    `instruction` (appended to each prompt), `max_draws`."""
    names = list(templates) if templates is not None else [t.name for t in TEMPLATES]
    unknown = sorted(set(names) - set(_BY_NAME))
    if unknown or not names:
        raise ValueError(f"task 'code': unknown template(s) {unknown or names}; known: {sorted(_BY_NAME)}")
    if isinstance(num_tests, bool) or not isinstance(num_tests, int) or num_tests < 1:
        raise ValueError(f"task 'code': num_tests must be a positive integer, got {num_tests!r}")
    rng = np.random.default_rng(_derived_seed(seed, "code", split))
    limit = max_draws if max_draws is not None else 50 * size + 1000
    examples, seen = [], set()
    for _ in range(limit):
        if len(examples) == size:
            break
        t = _BY_NAME[names[int(rng.integers(0, len(names)))]]
        params = t.params(rng)
        key = f"{t.name}:" + ",".join(f"{k}={params[k]!r}" for k in sorted(params))
        if key in seen or question_split(key, task="code", seed=seed, eval_fraction=eval_fraction) != split:
            continue
        seen.add(key)
        examples.append(make_problem(t.name, params, num_tests=num_tests, seed=seed, instruction=instruction))
    if len(examples) < size:
        raise ValueError(f"task 'code': found only {len(examples)} distinct {split} problems in {limit} draws "
                         f"(size={size}); use more templates or a smaller size")
    return examples


# ---------------------------------------------------------------------------------------------
# Extraction and checking

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_code(completion: str) -> str | None:
    """The code in a reply: the last ```python / ```py / ``` block (an unclosed last fence runs to
    the end), else the last <answer>...</answer>, else None."""
    blocks = _FENCE.findall(completion)
    if blocks:
        return blocks[-1]
    answers = _ANSWER.findall(completion)
    if answers:
        return answers[-1].strip("\n")
    return None


class CodeResult(NamedTuple):
    """What `check_code` returns."""

    passed: int  # hidden tests passed
    total: int  # hidden tests
    first_failure: str | None  # a message for the model about the first failing test; None when all pass
    exec_result: ExecResult  # the sandbox run (its stderr holds the program's own prints)


# Loads solution.py, sends its prints to stderr, and prints one nonce-tagged JSON line per case.
_HARNESS = r'''
import json, os, sys
def _main():
    request = json.loads(sys.stdin.readline())
    nonce, function, cases = request["nonce"], request["function"], request["cases"]
    del request
    write, dumps = os.write, json.dumps
    def report(record):
        write(1, ("\n" + nonce + " " + dumps(record) + "\n").encode())
    sys.stdout = sys.stderr
    namespace = {"__name__": "solution"}
    try:
        with open("solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
    except BaseException as exc:
        report({"load": f"{type(exc).__name__}: {exc}"[:500]})
        return
    fn = namespace.get(function)
    if not callable(fn):
        report({"load": f"no function named {function} is defined"})
        return
    for i, args in enumerate(cases):
        try:
            value = fn(*args)
            try:
                line = {"i": i, "value": dumps(value, sort_keys=True)}
            except (TypeError, ValueError):
                line = {"i": i, "other": repr(value)[:200]}
        except BaseException as exc:
            line = {"i": i, "error": f"{type(exc).__name__}: {exc}"[:300]}
        report(line)
_main()
'''


def check_code(code: str, tests: Mapping[str, Any], *, timeout_s: float = 5.0, memory_mb: int = 256,
               sandbox: SandboxConfig | Mapping | None = None) -> CodeResult:
    """Run `code` against hidden `tests` (`{"function": name, "cases": [{"args", "expected"}]}`) in the
    sandbox. `passed / total` is the fraction of cases passed; `first_failure` says, for a model that
    may retry, what went wrong first: the code did not load, the function is missing, a call returned
    the wrong value or raised, or the run was stopped (timeout, memory, ...) before a case finished.
    `sandbox`: further settings (`SandboxConfig`); `timeout_s` and `memory_mb` win over its values."""
    function, cases = tests["function"], list(tests["cases"])
    nonce = secrets.token_hex(16)
    request = json.dumps({"nonce": nonce, "function": function, "cases": [c["args"] for c in cases]})
    result = run_python(_HARNESS, stdin=request + "\n", files={"solution.py": code}, timeout_s=timeout_s,
                        memory_mb=memory_mb, config=sandbox)
    records: dict[int, dict] = {}
    load_error = None
    for line in result.stdout.splitlines():
        at = line.find(nonce + " ")
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(nonce) + 1:])
        except ValueError:
            continue
        if "load" in record and load_error is None:
            load_error = str(record["load"])
        elif isinstance(record.get("i"), int):
            records.setdefault(record["i"], record)
    passed, first_failure = 0, None
    for i, case in enumerate(cases):
        call = _call_text(function, case["args"])
        expected = json.dumps(case["expected"], sort_keys=True)
        record = records.get(i)
        if record is not None and record.get("value") == expected:
            passed += 1
            continue
        if first_failure is not None:
            continue
        if load_error is not None:
            first_failure = f"the code failed before any test: {load_error}"
        elif record is None:
            how = result.killed_reason or f"exit status {result.returncode}"
            detail = f" after {timeout_s:g} s" if result.timed_out else ""
            first_failure = f"{call} did not finish: the run was stopped ({how}){detail}"
        elif "error" in record:
            first_failure = f"{call} raised {record['error']}"
        elif "other" in record:
            first_failure = f"{call} returned {record['other']}, which is not a JSON value; expected {case['expected']!r}"
        else:
            first_failure = f"{call} returned {_show(record['value'])}, expected {case['expected']!r}"
    if first_failure is not None and len(first_failure) > FEEDBACK_CHARS:
        # the program chooses what it returns, raises and prints (up to the sandbox's 1 MiB per
        # stream): the model is shown the start of it, not a flood that fills its context
        first_failure = f"{first_failure[:FEEDBACK_CHARS]}... ({len(first_failure) - FEEDBACK_CHARS} more characters)"
    return CodeResult(passed, len(cases), first_failure, result)


FEEDBACK_CHARS = 400
"""The most characters of a failing test's message (``CodeResult.first_failure``) shown to the model."""


def _show(value_json: str) -> str:
    try:
        return repr(json.loads(value_json))
    except ValueError:
        return value_json


# ---------------------------------------------------------------------------------------------
# The reward


def make_code_tests_reward(*, sandbox: Mapping[str, Any] | None = None, config_key: str | None = None):
    """Reward "code_tests": the fraction of an example's hidden tests (`example["tests"]`) that the
    code in the completion passes (1.0 only when all pass); 0.0 when the completion holds no code;
    NaN for an example without tests. Completions of a batch run concurrently, at most
    `sandbox.max_concurrent` at once. Runs stopped at a bound are counted in `bound_hits`
    ("timeout", "memory", "crash" for any other kill), logged as `reward/<name>/timeouts` etc."""
    label = f"rewards.{config_key or 'code_tests'}.sandbox"
    cfg = SandboxConfig.from_options({**DEFAULT_SANDBOX, **dict(sandbox or {})}, key=label)
    check_namespaces(cfg, key=label)  # no bwrap and not allow_unsandboxed: fail at start

    def score(completion: str, example: Mapping[str, Any]) -> tuple[float, str | None]:
        tests = example.get("tests")
        if not tests:
            return math.nan, None
        code = extract_code(completion)
        if code is None:
            return 0.0, None
        result = check_code(code, tests, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, sandbox=cfg)
        return result.passed / result.total, _bound(result.exec_result)

    def code_tests(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        check_batch("code_tests", completions, examples)
        if not completions:
            return np.zeros(0)
        with ThreadPoolExecutor(max_workers=min(cfg.max_concurrent, len(completions))) as pool:
            outcomes = list(pool.map(score, completions, examples))
        for _, hit in outcomes:
            if hit is not None:
                code_tests.bound_hits[hit] += 1
        return np.array([value for value, _ in outcomes], dtype=np.float64)

    code_tests.bound_hits = Counter()
    code_tests.reward_name = config_key or "code_tests"
    code_tests.sandbox = cfg
    return code_tests


def _bound(result: ExecResult) -> str | None:
    """Which bounded-verifier counter a run goes to (rljax.rewards.bounded's names)."""
    if result.killed_reason in ("timeout", "cpu_time"):
        return "timeout"
    if result.killed_reason == "memory":
        return "memory"
    if result.killed_reason in ("output_limit", "sandbox_error") or (result.killed_reason or "").startswith("signal:"):
        return "crash"
    return None


register_task("code", _code_task, overwrite=True)
register_reward("code_tests", make_code_tests_reward, overwrite=True)

__all__ = ["CodeResult", "TEMPLATES", "check_code", "extract_code", "make_code_tests_reward", "make_problem"]
