"""Countdown reward, TinyZero's scoring (0 no `<answer>` tag, 0.1 formatted but wrong, 1.0 correct),
with an exact arithmetic evaluator that never calls `eval`."""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Mapping

from rljax.rewards.answers import extract_tag
from rljax.rewards.base import RewardFn, per_sample, register_reward

_COUNTDOWN_CHARS = re.compile(r"[\d+\-*/().\s]+")
_MAX_EXPRESSION_CHARS = 512


def countdown_problem(example: Mapping[str, Any]) -> tuple[list[int], int]:
    """`(numbers, target)` of a countdown example: reasoning-gym rows keep them in `metadata`,
    TinyZero's dataset in top-level `nums`/`numbers` and `target`."""
    for source in (example.get("metadata") or {}, example):
        numbers = source.get("numbers", source.get("nums"))
        if numbers is not None and "target" in source:
            return [int(n) for n in numbers], int(source["target"])
    raise KeyError("countdown example needs 'numbers' (or 'nums') and 'target', at top level or in "
                   f"'metadata'; it has keys {sorted(example)}")


def evaluate_arithmetic(expression: str) -> tuple[Fraction, list[int]]:
    """Exactly evaluate `expression` built from integers, + - * / and parentheses.

    Returns `(value, integers used)`. Anything else (names, calls, powers, floats) raises
    ValueError; division by zero raises ZeroDivisionError. Nothing is passed to `eval`.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    tree = ast.parse(expression.strip(), mode="eval")
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            return left / right
        raise ValueError(f"unsupported syntax in arithmetic expression: {type(node).__name__}")

    return ev(tree), used


def countdown_score(
    completion: str,
    example: Mapping[str, Any],
    *,
    score: float = 1.0,
    format_score: float = 0.1,
    no_answer_score: float = 0.0,
    require_all_numbers: bool = True,
) -> float:
    """TinyZero countdown reward (github.com/Jiayi-Pan/TinyZero, `verl/utils/reward_score/countdown.py`).

    `no_answer_score` (0) without an `<answer>` tag; `format_score` (0.1) when the answer is not an
    expression over exactly the given numbers (each once; `require_all_numbers=False` allows a
    subset) or does not evaluate to the target; `score` (1.0) when it does.
    """
    numbers, target = countdown_problem(example)
    expression = extract_tag(completion, "answer")
    if expression is None:
        return no_answer_score
    if not _COUNTDOWN_CHARS.fullmatch(expression):
        return format_score
    try:
        value, used = evaluate_arithmetic(expression)
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return format_score
    used_count, available = Counter(used), Counter(numbers)
    if require_all_numbers:
        numbers_ok = used_count == available
    else:
        numbers_ok = all(available[n] >= c for n, c in used_count.items())
    if not numbers_ok:
        return format_score
    return score if value == target else format_score


def make_countdown_reward(
    *,
    score: float = 1.0,
    format_score: float = 0.1,
    no_answer_score: float = 0.0,
    require_all_numbers: bool = True,
) -> RewardFn:
    """Batch reward for countdown tasks (see `countdown_score`)."""

    def countdown(completion: str, example: Mapping[str, Any]) -> float:
        return countdown_score(completion, example, score=score, format_score=format_score,
                               no_answer_score=no_answer_score, require_all_numbers=require_all_numbers)

    return per_sample(countdown, name="countdown")



register_reward("countdown", make_countdown_reward)

__all__ = ["countdown_problem", "evaluate_arithmetic", "countdown_score", "make_countdown_reward"]
