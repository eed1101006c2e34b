"""reasoning-gym's own scorers as a reward, run in bounded worker processes (`rljax.rewards.bounded`):
a scorer may run sympy on model text, so each sample gets a hard time and memory bound."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.rewards.answers import extract_answer
from rljax.rewards.base import RewardFn, check_batch, register_reward
from rljax.rewards.bounded import pool_for, record_outcomes, warn_errors
from rljax.rewards.countdown import countdown_score

@functools.lru_cache(maxsize=None)
def _reasoning_gym_scorer(dataset_name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset_name)


def make_reasoning_gym_reward(
    *, tag: str = "answer", require_tag: bool = True, dataset: str | None = None,
    time_limit_seconds: float = 5.0, memory_limit_mb: int = 1024, workers: int = 2,
) -> RewardFn:
    """Batch reward from reasoning-gym's `score_answer` for the example's dataset.

    The dataset is `dataset`, else `example["metadata"]["source_dataset"]`, else `example["task"]`;
    the example must carry reasoning-gym's `answer` and `metadata` (as `make_task` rows do). The
    answer passed to the scorer is the last `<answer>` tag (None without one, which the scorers
    score as their minimum). Values follow reasoning-gym (often partial credit, e.g. 0.01 for a wrong
    answer). Countdown is scored by `countdown_score` with reasoning-gym's values (1.0 / 0.05 / 0.01)
    because reasoning-gym's countdown scorer runs the model's text through sympy's `parse_expr`,
    which evaluates it with `eval`. Other reasoning-gym scorers may do the same (and run sympy): they
    run in a bounded worker as the answer reward's math-verify does (`time_limit_seconds`,
    `memory_limit_mb`, `workers`; a bound hit scores 0.0 and is counted in `bound_hits`).
    """
    pool = pool_for("reasoning_gym", ("rljax.rewards.reasoning_gym", "reasoning_gym"), dict(
        time_limit_seconds=time_limit_seconds, memory_limit_mb=memory_limit_mb, workers=workers))

    def reasoning_gym(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        check_batch("reasoning_gym", completions, examples)
        out = np.zeros(len(completions), dtype=np.float64)
        pending: list[tuple[int, str, str | None, dict]] = []  # (sample, dataset, answer, scorer's entry)
        errors: list[tuple[int, str]] = []
        for i, (completion, example) in enumerate(zip(completions, examples)):
            try:
                metadata = example.get("metadata") or {}
                name = dataset or metadata.get("source_dataset") or example.get("task")
                if not name:
                    raise KeyError("cannot tell the reasoning-gym dataset: no metadata.source_dataset or task")
                if name == "countdown":
                    out[i] = countdown_score(completion, example, score=1.0, format_score=0.05, no_answer_score=0.01)
                    continue
                answer = extract_answer(completion, tag=tag, require_tag=require_tag)
                entry = {"question": example.get("question", example.get("prompt")), "answer": example["answer"],
                         "metadata": metadata}
            except Exception as exc:  # noqa: BLE001 - as per_sample: one bad sample is NaN, not the batch
                out[i] = np.nan
                errors.append((i, f"{type(exc).__name__}: {exc}"))
                continue
            pending.append((i, name, answer, entry))
        if pending:
            outcomes = pool().map(_reasoning_gym_score, [(name, a, e) for _, name, a, e in pending])
            record_outcomes([i for i, *_ in pending], outcomes, out, errors, reasoning_gym.bound_hits)
        warn_errors("reasoning_gym", errors, len(completions))
        return out

    reasoning_gym.reward_name = "reasoning_gym"  # type: ignore[attr-defined]
    reasoning_gym.bound_hits = Counter()  # type: ignore[attr-defined]
    return reasoning_gym


def _reasoning_gym_score(dataset_name: str, answer: str | None, entry: Mapping[str, Any]) -> float:
    """Worker side of the reasoning-gym reward: the dataset's own scorer."""
    return float(_reasoning_gym_scorer(dataset_name)(answer, entry))



register_reward("reasoning_gym", make_reasoning_gym_reward)

__all__ = ["make_reasoning_gym_reward"]
