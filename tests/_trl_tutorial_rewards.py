"""TRL-style reward functions for tests/integration/test_python_rewards.py, in the shape of the two rewards of
TRL's GRPO tutorial: a format reward over ``<think>…</think><answer>…</answer>`` and an accuracy
reward that parses LaTeX with math-verify against a ``solution`` column.

They are written here (this project commits no code copied from other repositories) to the
tutorial's exact contract, which is what the test is about: called as
``fn(completions, **kwargs)`` with conversational completions (``completion[0]["content"]``) and
the dataset's columns as keyword lists; a gold answer math-verify cannot parse scores 1.0 (the row
is not judged), an error while verifying scores 0.0.
"""

import re

from math_verify import LatexExtractionConfig, parse, verify

# the whole completion: a think block, optional whitespace, an answer block (no newline inside a block)
_THINK_THEN_ANSWER = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>")


def format_reward(completions, **kwargs):
    """1.0 where the completion is exactly a ``<think>`` block followed by an ``<answer>`` block."""
    texts = [completion[0]["content"] for completion in completions]
    return [1.0 if _THINK_THEN_ANSWER.fullmatch(text) else 0.0 for text in texts]


def accuracy_reward(completions, **kwargs):
    """1.0 where math-verify finds the completion's LaTeX answer equal to the ``solution`` column's."""
    extraction = [LatexExtractionConfig()]
    scores = []
    for completion, solution in zip(completions, kwargs["solution"]):
        gold = parse(solution, extraction_mode="first_match", extraction_config=extraction)
        if not gold:
            scores.append(1.0)  # nothing to check against: the row is not judged
            continue
        answer = parse(completion[0]["content"], extraction_mode="first_match", extraction_config=extraction)
        try:
            scores.append(float(verify(answer, gold)))
        except Exception:  # noqa: BLE001 - a verification error scores 0, as the tutorial's does
            scores.append(0.0)
    return scores
