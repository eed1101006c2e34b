"""Format rewards (0/1): the DeepSeek-R1 `<think>…</think><answer>…</answer>` shape, or a non-empty
`<answer>` tag alone."""

from __future__ import annotations

import re
from typing import Any, Mapping

from rljax.rewards.answers import tag_contents
from rljax.rewards.base import RewardFn, per_sample, register_reward

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
    return any(content.strip() for content in tag_contents(completion, tag))


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



register_reward("format", make_format_reward)
register_reward("answer_tag_format", make_answer_tag_format_reward)

__all__ = ["think_answer_format", "has_answer_tag", "make_format_reward", "make_answer_tag_format_reward"]
