"""``calculator``: multiply a 3-digit by a 2-digit number with a calculator tool.

    env = CalculatorEnv(split_seed=0)
    messages, info = env.reset(seed=7, options={"split": "eval"})   # info["question"] = "417*38"

The user asks "What is 417*38?"; the model may call ``calculator`` (the Hermes call
``<tool_call>{"name": "calculator", "arguments": {"expression": "417*38"}}</tool_call>``, whose
result comes back as a ``"tool"`` message, e.g. ``"15846"``) and ends with ``<answer>15846</answer>``:
reward 1 for the right number, 0 otherwise (success = reward 1). Held-out split by seed: the
problem of ``(seed, split)`` is drawn from ``seed`` until ``rljax.data.tasks.question_split`` of
its key (``"417*38"``, with ``split_seed``) falls in ``split``, so no train seed shows an eval
question.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any, Mapping

import numpy as np

from rljax.data.tasks import question_split
from rljax.environments.tools import Tool, ToolEnvironment, ToolError

__all__ = ["CalculatorEnv", "calculator", "calculator_opening", "demonstration", "evaluate_expression"]

INSTRUCTIONS = ("You are a careful assistant. Use the calculator tool for arithmetic, then give the final answer "
                "as <answer>N</answer>.")
ANSWER_PATTERN = re.compile(r"<answer>\s*(-?[\d,]+)\s*</answer>")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, ``+ - * / // %``, unary minus and parentheses
    (parsed with ``ast``, never ``eval``); :class:`ToolError` for anything else."""
    if len(expression) > 200:
        raise ToolError("expression too long (200 characters at most)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"could not parse the expression {expression!r}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            try:
                return _OPS[type(node.op)](ev(node.left), ev(node.right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
        raise ToolError(f"unsupported expression {expression!r}: use numbers, + - * / // % and parentheses")

    return ev(tree)


def _calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    expression: numbers, + - * / ( ) and spaces, e.g. "123*45".
    """
    value = evaluate_expression(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


calculator = Tool(_calculator, name="calculator")


def calculator_opening(a: int, b: int) -> tuple[str, str]:
    """``(system instructions, user text)`` of the problem ``a × b`` (the SFT demonstrations use these too)."""
    return INSTRUCTIONS, f"What is {a}*{b}?"


def demonstration(env: "CalculatorEnv", seed: int, split: str = "train") -> list[dict]:
    """A correct transcript of episode ``seed``, the messages an SFT warm start trains on: the
    environment's opening (system with the tool schemas, user), the assistant's Hermes call, the
    tool's result, the assistant's ``<answer>N</answer>``; exactly what ``env`` shows and returns."""
    messages, info = env.reset(seed=seed, options={"split": split})
    call = json.dumps({"name": "calculator", "arguments": {"expression": info["question"]}})
    action = f"<tool_call>{call}</tool_call>"
    replies, *_ = env.step(action)
    answer = f"<answer>{replies[0]['content']}</answer>"
    return messages + [{"role": "assistant", "content": action}] + replies + [{"role": "assistant", "content": answer}]


class CalculatorEnv(ToolEnvironment):
    """3-digit × 2-digit multiplication with a ``calculator`` tool; reward 1 for the right ``<answer>``."""

    def __init__(self, *, split_seed: int = 0, eval_fraction: float = 0.1, native_tools: bool = False):
        super().__init__([calculator], native_tools=native_tools)
        self.split_seed, self.eval_fraction = split_seed, eval_fraction
        self.product: int | None = None

    def problem(self, seed: int, split: str) -> tuple[int, int]:
        """The ``(a, b)`` of episode ``seed`` in ``split`` ("train" or "eval")."""
        if split not in ("train", "eval"):
            raise ValueError(f"calculator: split must be 'train' or 'eval', got {split!r}")
        rng = np.random.default_rng([int(seed), 7919])
        while True:
            a, b = int(rng.integers(100, 1000)), int(rng.integers(10, 100))
            if question_split(f"{a}*{b}", task="calculator", seed=self.split_seed,
                              eval_fraction=self.eval_fraction) == split:
                return a, b

    def opening(self, seed, options: Mapping[str, Any]):
        a, b = self.problem(0 if seed is None else seed, options.get("split", "train"))
        self.product = a * b
        instructions, user = calculator_opening(a, b)
        return instructions, user, {"question": f"{a}*{b}", "answer": str(a * b)}

    def score(self, answer: str):
        m = ANSWER_PATTERN.search(answer)
        right = m is not None and int(m.group(1).replace(",", "")) == self.product
        return float(right), right
