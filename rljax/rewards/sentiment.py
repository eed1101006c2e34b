"""Sentiment reward: VADER's compound score (Hutto & Gilbert, ICWSM 2014), in [-1, 1].

VADER is a lexicon-and-rules scorer shipped inside the `vaderSentiment` wheel, so it works offline
and costs about 0.1 ms per short text. The analyzer is built once per process and shared.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.rewards.base import RewardFn, register_reward

_FIELDS = ("compound", "pos", "neg", "neu")


@functools.lru_cache(maxsize=1)
def sentiment_analyzer():
    """The shared `vaderSentiment.vaderSentiment.SentimentIntensityAnalyzer` (loads its lexicon once)."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


def sentiment_scores(texts: Sequence[str], *, field: str = "compound") -> np.ndarray:
    """VADER `field` ("compound" in [-1, 1]; "pos"/"neg"/"neu" proportions in [0, 1]) per text, [N]."""
    if field not in _FIELDS:
        raise ValueError(f"sentiment field must be one of {_FIELDS}, got {field!r}")
    analyzer = sentiment_analyzer()
    return np.array([analyzer.polarity_scores(t)[field] for t in texts], dtype=np.float64)


def make_sentiment_reward(*, field: str = "compound", include_prompt: bool = False) -> RewardFn:
    """Batch reward: VADER sentiment of each completion (compound score by default).

    `include_prompt=True` scores `example["prompt"] + completion`, as in the IMDb
    "continue this review positively" setups where the prompt is the review's opening.
    """
    if field not in _FIELDS:
        raise ValueError(f"sentiment reward: field must be one of {_FIELDS}, got {field!r}")
    sentiment_analyzer()  # build the analyzer now, not on the first training step

    def sentiment(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        if len(completions) != len(examples):
            raise ValueError(f"got {len(completions)} completions but {len(examples)} examples")
        if include_prompt:
            texts = [str(ex["prompt"]) + c for c, ex in zip(completions, examples)]
        else:
            texts = list(completions)
        return sentiment_scores(texts, field=field)

    sentiment.reward_name = "sentiment"  # type: ignore[attr-defined]
    return sentiment


register_reward("sentiment", make_sentiment_reward)
