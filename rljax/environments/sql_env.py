"""``sql``: answer a question about a fresh SQLite database, optionally exploring it with a tool first.

    env = SqlEnv(explore=True, timeout_s=1.0)
    messages, info = env.reset(seed=3, options={"split": "eval"})  # system (the run_sql tool), user (schema, question)
    env.step('<tool_call>{"name": "run_sql", "arguments": {"query": "SELECT * FROM employees LIMIT 3"}}</tool_call>')
    env.step("```sql\\nSELECT COUNT(*) FROM employees WHERE department = 'Sales'\\n```")  # reward 1.0, terminated

The episode of ``(seed, split)`` is a ``rljax.environments.sql_tasks`` question (``make_sql_problem``)
on a database of its own (10-20 generated rows), drawn from ``seed`` until its key falls in ``split``
by ``question_split`` (task ``"sql"``, ``split_seed``): the split is by question, as data task ``sql``'s.

With ``explore`` (default True) the model may call ``run_sql(query)`` (the Hermes ``<tool_call>``
format, ``rljax.environments.tools``): the query runs read-only with a time limit (``run_sql``: the
authorizer denies every write, ``timeout_s``) on the episode's database, and the tool's reply is the
column names and at most ``max_rows_shown`` rows ("... N rows in all" past that), each value at most
80 characters; a failing query is a tool error the model sees ("error: OperationalError: ...").
A message without a tool call is the final answer: its SQL (``extract_sql``: the last ```sql block,
else ``<answer>``) is checked with ``check_sql``: reward 1.0 when its result set equals the gold
query's (order-insensitive unless the question asks for an order) on every database of the
question's test suite (the episode's and ``test_setups``, which the tool never shows), else 0.0 (no
SQL, an error, a write, a different result); terminated either way.

``info["metrics"]`` of the final step (``env/<name>``): ``answered`` (the reply held SQL) and
``executes`` (it ran without error).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rljax.data.tasks import question_split
from rljax.environments.sql_tasks import QUESTION_NAMES, check_sql, extract_sql, make_sql_problem, run_sql
from rljax.environments.tools import Tool, ToolEnvironment, ToolError

__all__ = ["SqlEnv"]

INSTRUCTIONS = "Answer the question about the SQLite database with one query in a ```sql code block."
EXPLORE = "You may first look at the data with the run_sql tool; the final reply has no tool call."
_CELL = 80  # characters of one value shown by the tool


class SqlEnv(ToolEnvironment):
    """A question about a fresh database; reward 1 when the final query returns the gold result set
    on each of the question's test-suite databases."""

    def __init__(self, *, split_seed: int = 0, eval_fraction: float = 0.1, questions: Sequence[str] | None = None,
                 explore: bool = True, timeout_s: float = 1.0, max_rows_shown: int = 20,
                 native_tools: bool = False):
        names = list(questions) if questions is not None else list(QUESTION_NAMES)
        unknown = sorted(set(names) - set(QUESTION_NAMES))
        if unknown or not names:
            raise ValueError(f"environment 'sql': unknown question(s) {unknown or names}; known: {list(QUESTION_NAMES)}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"environment 'sql': timeout_s must be a positive number, got {timeout_s!r}")
        tools = [Tool(self._run_sql, name="run_sql")] if explore else []
        super().__init__(tools, native_tools=native_tools)
        self.questions, self.split_seed, self.eval_fraction = names, split_seed, eval_fraction
        self.explore, self.timeout_s, self.max_rows_shown = explore, float(timeout_s), max_rows_shown
        self.example: dict[str, Any] | None = None

    def problem(self, seed: int, split: str) -> dict[str, Any]:
        """The example (``make_sql_problem``) of episode ``seed`` in ``split``."""
        if split not in ("train", "eval"):
            raise ValueError(f"sql: split must be 'train' or 'eval', got {split!r}")
        rng = np.random.default_rng([int(seed), 130363])
        for _ in range(10_000):
            name = self.questions[int(rng.integers(0, len(self.questions)))]
            db_seed = int(rng.integers(0, 2**31 - 1))
            key = make_sql_problem(name, db_seed, instruction=None, test_suite=False)["key"]
            if question_split(key, task="sql", seed=self.split_seed, eval_fraction=self.eval_fraction) == split:
                return make_sql_problem(name, db_seed, instruction=None)
        raise ValueError(f"sql: no {split} question found for seed {seed} (eval_fraction={self.eval_fraction})")

    def opening(self, seed, options: Mapping[str, Any]):
        self.example = self.problem(0 if seed is None else seed, options.get("split", "train"))
        instructions = INSTRUCTIONS + (" " + EXPLORE if self.explore else "")
        return instructions, self.example["prompt"], {"key": self.example["key"], "question": self.example["question"]}

    def reset(self, seed=None, options=None):
        messages, info = super().reset(seed, options)
        if not self.tools:  # no tool listing for a model that has none
            messages[0]["content"] = INSTRUCTIONS
        return messages, info

    def _run_sql(self, query: str) -> str:
        """Run a read-only SQLite query; returns its columns and rows.

        query: one SELECT statement.
        """
        if self.example is None:
            raise ToolError("no database: the episode has not started")
        if not isinstance(query, str) or not query.strip():
            raise ToolError("query must be a non-empty SQL string")
        result = run_sql(self.example["setup"], query, timeout_s=self.timeout_s)
        if result.error is not None:
            raise ToolError(result.error)
        lines = [" | ".join(result.columns)]
        for row in result.rows[:self.max_rows_shown]:
            lines.append(" | ".join(_cell(v) for v in row))
        if len(result.rows) > self.max_rows_shown:
            lines.append(f"... {len(result.rows)} rows in all")
        elif not result.rows:
            lines.append("(no rows)")
        return "\n".join(lines)

    def score(self, answer: str):
        return 0.0, False  # (step scores the final answer itself, with its metrics)

    def step(self, action: str):
        if self.example is None:
            raise RuntimeError("sql: step before reset")
        messages, reward, terminated, truncated, info = super().step(action) if self.tools else ([], 0.0, True, False, {})
        if not terminated:
            return messages, reward, terminated, truncated, info
        query = extract_sql(action)
        check = check_sql(query, self.example, timeout_s=self.timeout_s) if query is not None else None
        correct = check is not None and check.correct
        metrics = {"answered": float(query is not None),
                   "executes": float(check is not None and check.result.error is None)}
        return [], float(correct), True, False, {"success": correct, "metrics": metrics}


def _cell(value: Any) -> str:
    text = "NULL" if value is None else str(value)
    return text if len(text) <= _CELL else text[:_CELL] + "..."
