"""``code``: write a function that passes hidden unit tests, retrying after each failed attempt.

    env = CodeEnv(max_attempts=3, sandbox={"timeout_s": 5.0, "memory_mb": 256})
    messages, info = env.reset(seed=7, options={"split": "eval"})   # [system, user: the problem]
    messages, reward, terminated, truncated, info = env.step("```python\\ndef clamp(x): ...\\n```")

The problem of ``(seed, split)`` is a ``rljax.environments.code_tasks`` one (a template with random
parameters), drawn from ``seed`` until its key falls in ``split`` by ``question_split`` (task
``"code"``, ``split_seed``): the split is by question, the same as data task ``code``'s.

Each assistant message is one attempt: the code it holds (``extract_code``: the last ```python
block) runs against the hidden tests in the sandbox (``check_code``; ``sandbox`` options as
``rljax.environments.sandbox.SandboxConfig``, default 5 s and 256 MB). All pass: terminated, success.
Otherwise, while attempts remain (``max_attempts``), the observation is a user message with the first
failing test ("clamp(150) returned 150, expected 40", "... did not finish: the run was stopped
(timeout) after 5 s", "the code failed before any test: SyntaxError ...", or that the reply held no
code) and how many tests passed, and the model may retry; after the last attempt: truncated.

Reward: the fraction of the hidden tests the latest attempt passed (1.0 only when all pass), paid as
differences, ``r_t = f_t − f_{t−1}`` (``f_0 = 0``), so that the episode's return (the sum) is the
latest attempt's fraction wherever the episode stops (the rollout's turn budget included), and a
per-turn reward-to-go credits each attempt with what it changed.

``info["metrics"]`` (averaged over episodes as ``env/<name>`` by ``rljax.environments.episodes``):
``tests_passed`` (the latest attempt's fraction), ``attempts``, ``sandbox_kills`` (attempts the
sandbox stopped or refused: timeout, memory,
output, processes, ...), ``no_code`` (attempts without code).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rljax.data.tasks import question_split
from rljax.environments.base import Environment
from rljax.environments.code_tasks import DEFAULT_SANDBOX, TEMPLATES, check_code, extract_code, make_problem
from rljax.environments.sandbox import SandboxConfig, check_namespaces

__all__ = ["CodeEnv"]

INSTRUCTIONS = ("You write short, correct Python functions. Reply with the whole function in a ```python code "
                "block. If a test fails you will be told which, and you may reply with a corrected function.")
_NO_CODE = "Your reply held no ```python code block. Reply with the whole function in a ```python code block."


class CodeEnv(Environment):
    """Function-writing problems with hidden unit tests; the model may retry after a failing test."""

    def __init__(self, *, split_seed: int = 0, eval_fraction: float = 0.1, num_tests: int = 5,
                 templates: Sequence[str] | None = None, max_attempts: int = 3,
                 sandbox: Mapping[str, Any] | None = None):
        names = list(templates) if templates is not None else [t.name for t in TEMPLATES]
        by_name = {t.name: t for t in TEMPLATES}
        unknown = sorted(set(names) - set(by_name))
        if unknown or not names:
            raise ValueError(f"environment 'code': unknown template(s) {unknown or names}; known: {sorted(by_name)}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"environment 'code': max_attempts must be a positive integer, got {max_attempts!r}")
        self.templates = [by_name[n] for n in names]
        self.split_seed, self.eval_fraction, self.num_tests = split_seed, eval_fraction, num_tests
        self.max_attempts = max_attempts
        key = "environment.options.sandbox"
        self.sandbox = SandboxConfig.from_options({**DEFAULT_SANDBOX, **dict(sandbox or {})}, key=key)
        check_namespaces(self.sandbox, key=key)  # no bwrap and not allow_unsandboxed: fail when built
        self.problem_: dict[str, Any] | None = None
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.attempts, self.kills, self.no_code, self.fraction = 0, 0, 0, 0.0

    def problem(self, seed: int, split: str) -> dict[str, Any]:
        """The problem (a ``code_tasks.make_problem`` example) of episode ``seed`` in ``split``."""
        if split not in ("train", "eval"):
            raise ValueError(f"code: split must be 'train' or 'eval', got {split!r}")
        rng = np.random.default_rng([int(seed), 104729])
        for _ in range(10_000):
            t = self.templates[int(rng.integers(0, len(self.templates)))]
            params = t.params(rng)
            key = f"{t.name}:" + ",".join(f"{k}={params[k]!r}" for k in sorted(params))
            if question_split(key, task="code", seed=self.split_seed, eval_fraction=self.eval_fraction) == split:
                return make_problem(t.name, params, num_tests=self.num_tests, seed=self.split_seed)
        raise ValueError(f"code: no {split} problem found for seed {seed} (eval_fraction={self.eval_fraction})")

    def reset(self, seed=None, options=None):
        options = dict(options or {})
        self.problem_ = self.problem(0 if seed is None else seed, options.get("split", "train"))
        self._reset_counts()
        p = self.problem_
        messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": p["prompt"]}]
        return messages, {"key": p["key"], "template": p["template"]}

    def step(self, action: str):
        if self.problem_ is None:
            raise RuntimeError("code: step before reset")
        self.attempts += 1
        code = extract_code(action)
        if code is None:
            self.no_code += 1
            fraction, feedback = 0.0, _NO_CODE
        else:
            result = check_code(code, self.problem_["tests"], timeout_s=self.sandbox.timeout_s,
                                memory_mb=self.sandbox.memory_mb, sandbox=self.sandbox)
            self.kills += result.exec_result.killed_reason is not None
            fraction = result.passed / result.total
            feedback = (f"{result.passed} of {result.total} tests passed. The first failing test: "
                        f"{result.first_failure}. Reply with the corrected function in a ```python code block.")
        reward, self.fraction = fraction - self.fraction, fraction
        passed = fraction == 1.0
        info = {"success": passed, "metrics": {"tests_passed": fraction, "attempts": float(self.attempts),
                                               "sandbox_kills": float(self.kills), "no_code": float(self.no_code)}}
        if passed:
            return [], reward, True, False, info
        if self.attempts >= self.max_attempts:
            return [], reward, False, True, info
        return [{"role": "user", "content": feedback}], reward, False, False, info
