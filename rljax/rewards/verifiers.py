"""Verifiable rewards: answer correctness, output format, countdown, reasoning-gym scorers.

Conventions: correctness and format rewards are 0/1; the countdown reward follows TinyZero
(0 no `<answer>` tag, 0.1 formatted but wrong, 1.0 correct).

Answer checking runs a fast path first: exact match after light normalisation, then exact
rational comparison when both sides are plain numbers ("47.0" = "47", "1/2" = "0.5",
"1,000" = "1000"). Only answers that are not both plain numbers go to `math_verify`
(`parse`/`verify`: LaTeX, symbolic and numeric equivalence). math-verify bounds its own work with
`signal.alarm` (`timeout_seconds` per parse and per comparison, whole seconds), which only works in
the main thread; off the main thread the symbolic path is skipped (with one warning) rather than run
without a time limit, so a reward call cannot hang on e.g. `9^{9^{9^9}}`.
Answers longer than `max_answer_chars` are never sent to math-verify either.
"""

from __future__ import annotations

import ast
import functools
import logging
import re
import threading
from collections import Counter
from fractions import Fraction
from typing import Any, Mapping

from rljax.rewards.base import RewardFn, per_sample, register_reward

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Extraction


@functools.lru_cache(maxsize=None)
def _tag_pattern(tag: str) -> re.Pattern[str]:
    t = re.escape(tag)
    return re.compile(rf"<{t}>(.*?)</{t}>", re.DOTALL)


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last well-formed `<tag>...</tag>` in `text`, stripped; None if there is none."""
    matches = _tag_pattern(tag).findall(text)
    return matches[-1].strip() if matches else None


_NUMBER_RE = re.compile(
    r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
)


def last_number(text: str) -> str | None:
    """The last number written in `text` ("-3", "1,234.5", "2/3"), or None."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str, *, tag: str = "answer", require_tag: bool = True) -> str | None:
    """The answer a completion gives: the last `<answer>...</answer>`; with `require_tag=False`,
    the last number in the text when there is no tag."""
    answer = extract_tag(text, tag)
    if answer is None and not require_tag:
        answer = last_number(text)
    return answer


# ---------------------------------------------------------------------------------------------
# Answer comparison

_PLAIN_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_PLAIN_FRACTION = re.compile(r"[+-]?\d+/\d+")
_MAX_NUMBER_CHARS = 64  # Fraction of a plain literal is cheap, but keep it bounded anyway


def normalize_answer(text: str) -> str:
    """Light, meaning-preserving normalisation used by the fast path.

    Strips whitespace, surrounding `$`/`\\(\\)`, a whole-answer `\\boxed{}`, a trailing period,
    thousands separators between digit groups, and maps the Unicode minus to '-'.
    """
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


def as_plain_number(text: str) -> Fraction | None:
    """`text` as an exact rational if it is a plain integer, decimal or `a/b`; else None."""
    if len(text) > _MAX_NUMBER_CHARS:
        return None
    if _PLAIN_DECIMAL.fullmatch(text):
        return Fraction(text)
    if _PLAIN_FRACTION.fullmatch(text):
        num, den = text.split("/")
        if int(den) == 0:
            return None
        return Fraction(int(num), int(den))
    return None


_OFF_MAIN_THREAD_WARNED = False


_OPERATOR = re.compile(r"[+*\u00d7^]|\\times|\\cdot|\\pm|(?<=[^=(\[{,])-")


def answers_match(
    prediction: str,
    gold: str,
    *,
    allow_expressions: bool = False,
    use_math_verify: bool = True,
    timeout_seconds: int = 1,
    max_answer_chars: int = 256,
) -> bool:
    """Whether `prediction` states the same answer as `gold`.

    Fast path: equal after `normalize_answer`, or both plain numbers with the same exact value
    (then the decision is final). Otherwise `math_verify.verify(parse(gold), parse(prediction))`,
    each side read as LaTeX math (`$...$`) and, if that finds nothing, as written.

    When the gold answer is a plain number and `allow_expressions` is False, a prediction that
    still holds an arithmetic operator (`+`, `*`, `^`, a binary `-`, ...) is wrong even if it
    evaluates to the gold value: on arithmetic tasks "12+35" in the answer tag would otherwise
    earn the reward for copying the question. Fractions and LaTeX forms (`\\frac{1}{2}`) pass.
    """
    p, g = normalize_answer(prediction), normalize_answer(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    p_num, g_num = as_plain_number(p), as_plain_number(g)
    if p_num is not None and g_num is not None:
        return p_num == g_num
    if g_num is not None and not allow_expressions and _OPERATOR.search(p):
        # "12+35" would verify as 47: a policy could copy the question into the tag.
        return False
    if not use_math_verify or len(prediction) > max_answer_chars:
        return False
    if threading.current_thread() is not threading.main_thread():
        global _OFF_MAIN_THREAD_WARNED
        if not _OFF_MAIN_THREAD_WARNED:
            logger.warning(
                "answers_match called off the main thread: math-verify's timeout needs the main "
                "thread (signal.alarm), so only the exact/numeric fast path is used here"
            )
            _OFF_MAIN_THREAD_WARNED = True
        return False
    return _math_verify_match(prediction.strip(), gold.strip(), int(timeout_seconds))


def _math_verify_match(prediction: str, gold: str, timeout_seconds: int) -> bool:
    from math_verify import verify
    from math_verify.errors import TimeoutException

    if timeout_seconds < 1:
        raise ValueError(f"timeout_seconds must be a whole number >= 1, got {timeout_seconds}")
    try:
        gold_parsed = list(_parse_gold(gold, timeout_seconds))
        if not gold_parsed:
            return False
        pred_parsed = _mv_parse(prediction, timeout_seconds)
        if not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_seconds))
    except (Exception, TimeoutException):  # noqa: BLE001 - TimeoutException is a BaseException
        return False


def _mv_parse(text: str, timeout_seconds: int) -> list[Any]:
    from math_verify import parse

    # An answer is usually bare math ("1+x", "\\frac{1}{2}"): read it as LaTeX math first. Plain
    # parsing of "1+x" would extract just the "1".
    if "$" in text or "\\boxed" in text:
        return parse(text, parsing_timeout=timeout_seconds)
    parsed = parse(f"${text}$", parsing_timeout=timeout_seconds)
    if not parsed:
        parsed = parse(text, parsing_timeout=timeout_seconds)
    return parsed


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str, timeout_seconds: int) -> tuple[Any, ...]:
    # Every completion in a GRPO group shares its gold answer: parse it once.
    return tuple(_mv_parse(gold, timeout_seconds))


def _gold_answers(example: Mapping[str, Any]) -> list[str]:
    gold = example["answer"]
    if gold is None:
        raise ValueError("example has answer=None")
    if isinstance(gold, (list, tuple)):
        return [str(g) for g in gold]
    return [str(gold)]


def answer_score(
    completion: str,
    example: Mapping[str, Any],
    *,
    tag: str = "answer",
    require_tag: bool = True,
    allow_expressions: bool = False,
    use_math_verify: bool = True,
    timeout_seconds: int = 1,
    max_answer_chars: int = 256,
) -> float:
    """1.0 if the completion's answer equals `example["answer"]` (or any of a list of them), else 0.0."""
    golds = _gold_answers(example)
    answer = extract_answer(completion, tag=tag, require_tag=require_tag)
    if answer is None:
        return 0.0
    return float(any(
        answers_match(answer, g, allow_expressions=allow_expressions, use_math_verify=use_math_verify,
                      timeout_seconds=timeout_seconds, max_answer_chars=max_answer_chars)
        for g in golds
    ))


def make_answer_reward(
    *,
    tag: str = "answer",
    require_tag: bool = True,
    allow_expressions: bool = False,
    use_math_verify: bool = True,
    timeout_seconds: int = 1,
    max_answer_chars: int = 256,
) -> RewardFn:
    """Batch reward: 1.0 for a correct answer in the last `<answer>` tag, else 0.0 (see `answer_score`)."""
    if isinstance(timeout_seconds, bool) or int(timeout_seconds) != timeout_seconds or timeout_seconds < 1:
        raise ValueError(f"answer reward: timeout_seconds must be a whole number >= 1 (signal.alarm), "
                         f"got {timeout_seconds!r}")

    def answer(completion: str, example: Mapping[str, Any]) -> float:
        return answer_score(completion, example, tag=tag, require_tag=require_tag,
                            allow_expressions=allow_expressions, use_math_verify=use_math_verify,
                            timeout_seconds=int(timeout_seconds), max_answer_chars=max_answer_chars)

    return per_sample(answer, name="answer")


# ---------------------------------------------------------------------------------------------
# Format

_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_answer_format(completion: str, *, think_prefilled: bool = False) -> bool:
    """DeepSeek-R1 format: the whole completion is `<think>…</think><answer>…</answer>`.

    Whitespace around and between the blocks is allowed; each tag must appear exactly once and the
    answer must not be empty. With `think_prefilled=True` the prompt already ended in `<think>`
    (as some chat templates do), so the completion starts inside the think block.
    """
    text = "<think>" + completion if think_prefilled else completion
    if any(text.count(t) != 1 for t in _FORMAT_TAGS):
        return False
    match = _THINK_ANSWER.fullmatch(text)
    return bool(match) and bool(match.group(2).strip())


def has_answer_tag(completion: str, *, tag: str = "answer") -> bool:
    """Whether the completion holds at least one non-empty `<answer>…</answer>`."""
    return any(m.strip() for m in _tag_pattern(tag).findall(completion))


def make_format_reward(*, think_prefilled: bool = False) -> RewardFn:
    """Batch reward: 1.0 if `think_answer_format(completion)`, else 0.0."""

    def format(completion: str, example: Mapping[str, Any]) -> float:  # noqa: A001
        return float(think_answer_format(completion, think_prefilled=think_prefilled))

    return per_sample(format, name="format")


def make_answer_tag_format_reward(*, tag: str = "answer") -> RewardFn:
    """Batch reward: 1.0 if the completion holds a non-empty `<answer>…</answer>`, else 0.0."""

    def answer_tag_format(completion: str, example: Mapping[str, Any]) -> float:
        return float(has_answer_tag(completion, tag=tag))

    return per_sample(answer_tag_format, name="answer_tag_format")


# ---------------------------------------------------------------------------------------------
# Countdown (TinyZero scoring, with a safe evaluator)

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


# ---------------------------------------------------------------------------------------------
# reasoning-gym's own scorers


@functools.lru_cache(maxsize=None)
def _reasoning_gym_scorer(dataset_name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset_name)


def make_reasoning_gym_reward(
    *, tag: str = "answer", require_tag: bool = True, dataset: str | None = None
) -> RewardFn:
    """Batch reward from reasoning-gym's `score_answer` for the example's dataset.

    The dataset is `dataset`, else `example["metadata"]["source_dataset"]`, else `example["task"]`;
    the example must carry reasoning-gym's `answer` and `metadata` (as `make_task` rows do). The
    answer passed to the scorer is the last `<answer>` tag (None without one, which the scorers
    score as their minimum). Values follow reasoning-gym (often partial credit, e.g. 0.01 for a wrong
    answer). Countdown is scored by `countdown_score` with reasoning-gym's values (1.0 / 0.05 / 0.01)
    because reasoning-gym's countdown scorer runs the model's text through sympy's `parse_expr`,
    which evaluates it with `eval`. Other reasoning-gym scorers may do the same; read theirs before
    using this reward on an untrusted policy.
    """

    def reasoning_gym_score(completion: str, example: Mapping[str, Any]) -> float:
        metadata = example.get("metadata") or {}
        name = dataset or metadata.get("source_dataset") or example.get("task")
        if not name:
            raise KeyError("cannot tell the reasoning-gym dataset: no metadata.source_dataset or task")
        if name == "countdown":
            return countdown_score(completion, example, score=1.0, format_score=0.05, no_answer_score=0.01)
        answer = extract_answer(completion, tag=tag, require_tag=require_tag)
        entry = {"question": example.get("question", example.get("prompt")), "answer": example["answer"],
                 "metadata": metadata}
        return float(_reasoning_gym_scorer(name)(answer, entry))

    return per_sample(reasoning_gym_score, name="reasoning_gym")


register_reward("answer", make_answer_reward)
register_reward("format", make_format_reward)
register_reward("answer_tag_format", make_answer_tag_format_reward)
register_reward("countdown", make_countdown_reward)
register_reward("reasoning_gym", make_reasoning_gym_reward)

__all__ = [
    "extract_tag", "extract_answer", "last_number", "normalize_answer", "as_plain_number",
    "answers_match", "answer_score", "make_answer_reward", "think_answer_format", "has_answer_tag",
    "make_format_reward", "make_answer_tag_format_reward", "countdown_problem", "evaluate_arithmetic",
    "countdown_score", "make_countdown_reward", "make_reasoning_gym_reward",
]

