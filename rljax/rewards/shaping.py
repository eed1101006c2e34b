"""Shaping rewards that depend on the completion's length.

Token lengths come from `examples[i]["completion_length"]` (the number of completion tokens,
EOS included if sampled), which the trainer fills in before scoring.

`soft_overlong_punishment` is the NumPy twin of `rljax.advantages.soft_overlong_punishment`
(same formula; this one is the reward-function form used inside a `RewardSet`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rljax.rewards.base import RewardFn, register_reward

LENGTH_KEY = "completion_length"


def completion_lengths(examples: Sequence[Mapping[str, Any]], *, reward: str) -> np.ndarray:
    """`examples[i]["completion_length"]` as float64 [N]; a clear error if the trainer did not set it."""
    lengths = []
    for i, example in enumerate(examples):
        if LENGTH_KEY not in example or example[LENGTH_KEY] is None:
            raise KeyError(
                f"reward {reward!r} needs examples[{i}][{LENGTH_KEY!r}], the completion's token "
                f"count, which the trainer fills in before scoring; example keys: {sorted(example)}"
            )
        lengths.append(example[LENGTH_KEY])
    out = np.asarray(lengths, dtype=np.float64).reshape(len(examples))
    if np.any(out < 0):
        raise ValueError(f"reward {reward!r}: negative completion_length in {out.tolist()}")
    return out


def soft_overlong_punishment(lengths: Any, *, max_length: int, cache_length: int) -> np.ndarray:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13), float64 like `lengths`.

        R(y) = 0                                  if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                 if |y| > L_max

    Continuous: 0 at the start of the buffer, -1 at |y| = L_max. DAPO uses L_max = 20480,
    L_cache = 4096 (with the generation cap at L_max).
    """
    if cache_length <= 0 or max_length <= 0:
        raise ValueError(f"max_length and cache_length must be positive, got {max_length}, {cache_length}")
    if cache_length > max_length:
        raise ValueError(f"cache_length ({cache_length}) must not exceed max_length ({max_length})")
    lengths = np.asarray(lengths, dtype=np.float64)
    threshold = max_length - cache_length
    inside = (threshold - lengths) / cache_length
    return np.where(lengths <= threshold, 0.0, np.where(lengths <= max_length, inside, -1.0))


def make_overlong_reward(*, max_length: int, cache_length: int) -> RewardFn:
    """Batch reward: `soft_overlong_punishment` of each completion's token count.

    `max_length` is L_max (usually the generation cap, `max_new_tokens`), `cache_length` L_cache.
    """
    for name, value in (("max_length", max_length), ("cache_length", cache_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"overlong reward: {name} must be a positive integer, got {value!r}")
    if cache_length > max_length:
        raise ValueError(f"overlong reward: cache_length ({cache_length}) must not exceed "
                         f"max_length ({max_length})")

    def overlong(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        lengths = completion_lengths(examples, reward="overlong")
        return soft_overlong_punishment(lengths, max_length=max_length, cache_length=cache_length)

    overlong.reward_name = "overlong"  # type: ignore[attr-defined]
    return overlong


def length_values(lengths: Any, *, target: float | None = None, normalize: float | None = None) -> np.ndarray:
    """`|y|`, or `-| |y| - target |` with a target, divided by `normalize` if given."""
    values = np.asarray(lengths, dtype=np.float64)
    if target is not None:
        values = -np.abs(values - float(target))
    if normalize is not None:
        values = values / float(normalize)
    return values


def make_length_reward(
    *, unit: str = "tokens", target: float | None = None, normalize: float | None = None
) -> RewardFn:
    """Batch reward: the completion's length (the config weight sets sign and scale).

    `unit="tokens"` reads `examples[i]["completion_length"]`; `unit="chars"` counts characters.
    With `target`, the value is `-| |y| - target |` (a penalty for missing a target length).
    `normalize` divides the value (e.g. by the generation cap, to keep it in [0, 1]).
    A negative weight turns the plain length into a length penalty.
    """
    if unit not in ("tokens", "chars"):
        raise ValueError(f"length reward: unit must be 'tokens' or 'chars', got {unit!r}")
    if normalize is not None and not normalize > 0:
        raise ValueError(f"length reward: normalize must be positive, got {normalize!r}")

    def length(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        if unit == "tokens":
            lengths = completion_lengths(examples, reward="length")
        else:
            lengths = np.array([len(c) for c in completions], dtype=np.float64)
        return length_values(lengths, target=target, normalize=normalize)

    length.reward_name = "length"  # type: ignore[attr-defined]
    return length


register_reward("overlong", make_overlong_reward)
register_reward("length", make_length_reward)
