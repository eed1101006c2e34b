"""Answer correctness (0/1): extracting the answer from a completion and checking it against the gold.

The other verifiable rewards sit beside it: `rljax.rewards.formats` (output format),
`rljax.rewards.countdown` (TinyZero's countdown) and `rljax.rewards.reasoning_gym` (reasoning-gym's
scorers).

Answer checking runs a fast path first: exact match after light normalisation, then exact
rational comparison when both sides are plain numbers ("47.0" = "47", "1/2" = "0.5",
"1,000" = "1000"). Only answers that are not both plain numbers go to `math_verify`
(`parse`/`verify`: LaTeX, symbolic and numeric equivalence). math-verify bounds its own work with
`signal.alarm` (`timeout_seconds` per parse and per comparison, whole seconds), which cannot
interrupt C code: `10^{10^{10^{10}}}` against a symbolic gold answer takes ~15 s and 8.5 GB inside
one big-integer power. So the answer reward (and the reasoning-gym reward, whose scorers may run
sympy) score in worker processes with a hard per-sample time and memory bound
(`rljax.rewards.bounded`): a sample that hits a bound scores 0.0 and is counted in
`reward/<name>/timeouts`, `/memory` or `/crashes`. Extraction and the fast path stay in-process
(linear-time string work), so only answers that need math-verify cross to a worker.
`answers_match` and `answer_score` themselves run in-process (math-verify's alarm only; off the main
thread the symbolic path is skipped, with one warning). Answers longer than `max_answer_chars` are
never sent to math-verify.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections import Counter
from fractions import Fraction
from itertools import product
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.rewards.base import RewardFn, check_batch, register_reward
from rljax.rewards.bounded import BoundHit, pool_for, record_outcomes, warn_errors

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Extraction


def tag_contents(text: str, tag: str):
    """The contents of the `<tag>...</tag>` pairs of `text`, left to right: each opening tag is
    closed by the first closing tag after it, and the next pair starts after that (what
    `re.findall("<tag>(.*?)</tag>", re.DOTALL)` gives). Linear time: every search starts where the
    previous one ended, and an opening tag with no closing tag after it ends the scan (the regex
    retried the search for a closing tag from every later opening tag: quadratic on unclosed tags)."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    position = 0
    while True:
        start = text.find(opening, position)
        if start < 0:
            return
        end = text.find(closing, start + len(opening))
        if end < 0:
            return
        yield text[start + len(opening) : end]
        position = end + len(closing)


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last well-formed `<tag>...</tag>` in `text`, stripped; None if there is none."""
    last = None
    for last in tag_contents(text, tag):
        pass
    return None if last is None else last.strip()


_NUMBER_RE = re.compile(
    r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
)


def last_number(text: str) -> str | None:
    """The last number written in `text` ("-3", "1,234.5", "2/3"), or None."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `text` (braces balanced, so `\\boxed{\\frac{1}{2}}`
    gives `\\frac{1}{2}`), stripped; None if there is none or it is never closed. Linear time."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    begin = start + len("\\boxed{")
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
    return None


def extract_answer(text: str, *, tag: str = "answer", require_tag: bool = True) -> str | None:
    """The answer a completion gives: the last `<answer>...</answer>`; with `require_tag=False` and
    no tag, the contents of the last `\\boxed{...}` (LaTeX, which the answer check reads with
    math-verify: `\\boxed{\\frac{1}{2}}` is 1/2, not its last number 2), else the last number in the text."""
    answer = extract_tag(text, tag)
    if answer is None and not require_tag:
        answer = last_boxed(text)
        if answer is None:
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
    # The layers are peeled by moving two indices, [i, j), not by slicing: one copy per layer made
    # nested wrappers (`\\boxed{\\boxed{...}}` thousands deep) quadratic.
    i, j = 0, len(s)
    changed = True
    while changed:
        before = (i, j)
        while i < j and s[i].isspace():
            i += 1
        while j > i and s[j - 1].isspace():
            j -= 1
        if j - i >= 2 and s[i] == "$" and s[j - 1] == "$":
            while i < j and s[i] == "$":
                i += 1
            while j > i and s[j - 1] == "$":
                j -= 1
        i, j = _peel(s, i, j, "\\(", "\\)")
        i, j = _peel(s, i, j, "\\boxed{", "}")
        if j > i and s[j - 1] == "." and not (j - i >= 2 and s[j - 2] == "."):
            j -= 1
        changed = (i, j) != before
    s = s[i:j]
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    return re.sub(r"\s+", "", s)


def _peel(s: str, i: int, j: int, prefix: str, suffix: str) -> tuple[int, int]:
    """`s[i:j]` less `prefix` and `suffix` if it starts and ends with them (as `s[len(p):-len(q)]`)."""
    if s.startswith(prefix, i, j) and s.endswith(suffix, i, j):
        i += len(prefix)
        j = max(i, j - len(suffix))
    return i, j


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

    This runs math-verify in the calling process, bounded only by its alarm (`timeout_seconds`);
    the answer reward (`make_answer_reward`) runs it in a bounded worker.
    """
    fast = _fast_match(prediction, gold, allow_expressions=allow_expressions, use_math_verify=use_math_verify,
                       max_answer_chars=max_answer_chars)
    if fast is not None:
        return fast
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


def _fast_match(prediction: str, gold: str, *, allow_expressions: bool, use_math_verify: bool,
                max_answer_chars: int) -> bool | None:
    """`answers_match`'s decision without math-verify; None when math-verify must decide."""
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
    return None


def _math_verify_match(prediction: str, gold: str, timeout_seconds: int) -> bool:
    if timeout_seconds < 1:
        raise ValueError(f"timeout_seconds must be a whole number >= 1, got {timeout_seconds}")
    try:
        return _math_verify_verdict(prediction, gold, timeout_seconds, [])
    except Exception:  # noqa: BLE001 - as before: anything math-verify cannot settle is not a match
        return False


def _math_verify_verdict(prediction: str, gold: str, timeout_seconds: int, hits: list[str]) -> bool:
    """math-verify's `verify(parse(gold), parse(prediction))`, read the way its defaults do (an error
    or a timeout in a parse gives no parse, in a comparison gives False, and the other comparisons
    still run) but with `raise_on_error=True`, so that each timeout ("timeout") and MemoryError
    ("memory") it would have swallowed is appended to `hits`."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    gold_parsed, gold_hits = _parse_gold(gold, timeout_seconds)
    hits.extend(gold_hits)
    if not gold_parsed:
        return False
    pred_parsed = _mv_parse(prediction, timeout_seconds, hits)
    if not pred_parsed:
        return False
    for g, t in product(gold_parsed, pred_parsed):  # verify's own loop over pairs
        try:
            if verify(g, t, timeout_seconds=timeout_seconds, raise_on_error=True):
                return True
        except TimeoutException:
            hits.append("timeout")
        except MemoryError:
            hits.append("memory")
        except Exception:  # noqa: BLE001 - math-verify's default: a failed comparison is False
            pass
    return False


def _mv_parse(text: str, timeout_seconds: int, hits: list[str]) -> list[Any]:
    # An answer is usually bare math ("1+x", "\\frac{1}{2}"): read it as LaTeX math first. Plain
    # parsing of "1+x" would extract just the "1".
    if "$" in text or "\\boxed" in text:
        return _parse_once(text, timeout_seconds, hits)
    parsed = _parse_once(f"${text}$", timeout_seconds, hits)
    if not parsed:
        parsed = _parse_once(text, timeout_seconds, hits)
    return parsed


def _parse_once(text: str, timeout_seconds: int, hits: list[str]) -> list[Any]:
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(text, parsing_timeout=timeout_seconds, raise_on_error=True)
    except TimeoutException:
        hits.append("timeout")
    except MemoryError:
        hits.append("memory")
    except Exception:  # noqa: BLE001 - math-verify's default: a failed parse finds nothing
        pass
    return []


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str, timeout_seconds: int) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    # Every completion in a GRPO group shares its gold answer: parse it once (a gold that timed out
    # keeps its empty parse and its hit, as math-verify's default kept the empty parse).
    hits: list[str] = []
    return tuple(_mv_parse(gold, timeout_seconds, hits)), tuple(hits)


def _math_verify_any(prediction: str, golds: Sequence[str], timeout_seconds: int) -> bool:
    """Worker side of the answer reward: whether math-verify matches `prediction` to any of `golds`.
    With no match and a bound hit on the way, raises `BoundHit` (the sample is counted)."""
    hits: list[str] = []
    for gold in golds:
        if _math_verify_verdict(prediction, gold, timeout_seconds, hits):
            return True
    if hits:
        raise BoundHit("memory" if "memory" in hits else "timeout")
    return False


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
    """1.0 if the completion's answer equals `example["answer"]` (or any of a list of them), else 0.0.

    In-process (see `answers_match`); `make_answer_reward` gives the same scores with math-verify
    in a bounded worker."""
    golds = _gold_answers(example)
    answer = extract_answer(completion, tag=tag, require_tag=require_tag)
    if answer is None:
        return 0.0
    return float(any(
        answers_match(answer, g, allow_expressions=allow_expressions, use_math_verify=use_math_verify,
                      timeout_seconds=timeout_seconds, max_answer_chars=max_answer_chars)
        for g in golds
    ))


_MATH_VERIFY_PRELOAD = ("rljax.rewards.answers", "math_verify", "sympy")


def make_answer_reward(
    *,
    tag: str = "answer",
    require_tag: bool = True,
    allow_expressions: bool = False,
    use_math_verify: bool = True,
    timeout_seconds: int = 1,
    max_answer_chars: int = 256,
    time_limit_seconds: float = 5.0,
    memory_limit_mb: int = 1024,
    workers: int = 2,
) -> RewardFn:
    """Batch reward: 1.0 for a correct answer in the last `<answer>` tag, else 0.0 (see `answer_score`).

    Extraction and the fast path run here; answers that need math-verify are checked in a shared
    `rljax.rewards.bounded` pool of `workers` processes, each sample within `time_limit_seconds` of
    wall clock and `memory_limit_mb` of address space beyond the worker's loaded libraries
    (math-verify's own alarm, `timeout_seconds` per parse and comparison, still runs there). A sample
    that hits a bound scores 0.0 and is counted in the function's `bound_hits` (`timeout`, `memory`,
    `crash`), which the trainer logs as `reward/<name>/timeouts`, `/memory`, `/crashes`.
    """
    if isinstance(timeout_seconds, bool) or int(timeout_seconds) != timeout_seconds or timeout_seconds < 1:
        raise ValueError(f"answer reward: timeout_seconds must be a whole number >= 1 (signal.alarm), "
                         f"got {timeout_seconds!r}")
    pool = pool_for("answer", _MATH_VERIFY_PRELOAD, dict(
        time_limit_seconds=time_limit_seconds, memory_limit_mb=memory_limit_mb, workers=workers))
    fast_options = dict(allow_expressions=allow_expressions, use_math_verify=use_math_verify,
                        max_answer_chars=max_answer_chars)
    alarm = int(timeout_seconds)

    def answer(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        check_batch("answer", completions, examples)
        out = np.zeros(len(completions), dtype=np.float64)
        pending: list[tuple[int, str, tuple[str, ...]]] = []  # (sample, answer, golds math-verify decides)
        errors: list[tuple[int, str]] = []
        for i, (completion, example) in enumerate(zip(completions, examples)):
            try:
                golds = _gold_answers(example)
                prediction = extract_answer(completion, tag=tag, require_tag=require_tag)
                if prediction is None:
                    continue
                verdicts = [_fast_match(prediction, g, **fast_options) for g in golds]
            except Exception as exc:  # noqa: BLE001 - as per_sample: one bad sample is NaN, not the batch
                out[i] = np.nan
                errors.append((i, f"{type(exc).__name__}: {exc}"))
                continue
            if any(v is True for v in verdicts):
                out[i] = 1.0
            elif any(v is None for v in verdicts):
                pending.append((i, prediction.strip(), tuple(g.strip() for g, v in zip(golds, verdicts) if v is None)))
        if pending:
            outcomes = pool().map(_math_verify_any, [(p, g, alarm) for _, p, g in pending])
            record_outcomes([i for i, *_ in pending], outcomes, out, errors, answer.bound_hits)
        warn_errors("answer", errors, len(completions))
        return out

    answer.reward_name = "answer"  # type: ignore[attr-defined]
    answer.bound_hits = Counter()  # type: ignore[attr-defined]
    return answer


register_reward("answer", make_answer_reward)

__all__ = [
    "extract_tag", "extract_answer", "last_boxed", "last_number", "normalize_answer", "as_plain_number",
    "answers_match", "answer_score", "make_answer_reward",
]
