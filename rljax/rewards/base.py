"""Reward-function interface, the per-sample wrapper, the weighted sum and the name registry.

A reward function scores a batch of completions:

    fn(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray  # [N] float64

`examples[i]` is the dataset row that completion `i` answers (it holds e.g. `answer`, `metadata`,
and `completion_length`, the completion's token count, which the trainer fills in). NaN (or None
in a returned list) means "missing": the function could not score that sample, or does not apply
to it (TRL's convention for `None`). Other non-finite values (±inf) are errors: `call_reward`
raises a `ValueError` naming the function and the sample. Most rewards are written per sample and
wrapped with `per_sample`, which turns an exception on one sample (or a `None`) into a NaN for
that sample only.

`RewardSet` (built by `combine` or, from a config mapping, by `build_rewards`) is the weighted sum
`total = Σ_k w_k · r_k` in which a missing value counts 0 (TRL `GRPOTrainer`:
`(rewards_per_func * weights).nansum(dim=1)`). A sample is *missing* when any function returned
NaN for it; the online trainer leaves such rows out of the update (advantage 0, out of the group
statistics: `rljax.advantages`), where TRL would train on the partial sum.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from rljax.errors import UserError

logger = logging.getLogger(__name__)

RewardFn = Callable[[Sequence[str], Sequence[Mapping[str, Any]]], np.ndarray]
SampleRewardFn = Callable[[str, Mapping[str, Any]], float]


def reward_name(fn: Callable[..., Any]) -> str:
    """The name a reward function reports in warnings and errors."""
    name = getattr(fn, "reward_name", None) or getattr(fn, "__name__", None)
    return name if name else type(fn).__name__


def per_sample(fn: SampleRewardFn | None = None, *, name: str | None = None):
    """Turn `f(completion, example) -> float` into a batch reward function.

    An exception on one sample scores that sample NaN and is reported by one `logging` warning per
    call (naming the function, how many samples failed and the first exception), not one per sample.
    Returning `None` marks the sample missing (NaN) without a warning (TRL's convention).
    Usable as `@per_sample`, `@per_sample(name="answer")` or `per_sample(f, name=...)`.
    """

    def wrap(f: SampleRewardFn) -> RewardFn:
        label = name or reward_name(f)

        @functools.wraps(f)
        def batch_fn(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
            check_batch(label, completions, examples)
            out = np.empty(len(completions), dtype=np.float64)
            failures = 0
            first: tuple[int, BaseException] | None = None
            for i, (completion, example) in enumerate(zip(completions, examples)):
                try:
                    value = f(completion, example)
                    out[i] = np.nan if value is None else float(value)  # None: missing, not a failure
                except Exception as exc:  # noqa: BLE001 - one bad sample must not kill the batch
                    out[i] = np.nan
                    failures += 1
                    if first is None:
                        first = (i, exc)
            if first is not None:
                index, exc = first
                logger.warning(
                    "reward %r raised on %d of %d samples (scored NaN); first at sample %d: %s: %s",
                    label, failures, len(completions), index, type(exc).__name__, exc,
                )
            return out

        batch_fn.reward_name = label  # type: ignore[attr-defined]
        batch_fn.sample_fn = f  # type: ignore[attr-defined]  # the unwrapped scorer, for direct use
        return batch_fn

    return wrap(fn) if fn is not None else wrap


def check_batch(label: str, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> None:
    """Raises ``TypeError`` / ``ValueError`` naming reward ``label`` unless ``completions`` is a
    sequence of strings with one ``examples`` row each (what every reward function is called with)."""
    if isinstance(completions, str):
        raise TypeError(f"reward {label!r}: completions must be a sequence of strings, got one str")
    if len(completions) != len(examples):
        raise ValueError(
            f"reward {label!r}: got {len(completions)} completions but {len(examples)} examples"
        )


def call_reward(name: str, fn: RewardFn, completions: Sequence[str],
                examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Call one reward function and check its output: float64 `[N]`, or a clear error naming it."""
    try:
        values = fn(completions, examples)
    except UserError:  # bad input the function itself named (e.g. a `python` reward's config): say it as is
        raise
    except Exception as exc:
        raise RuntimeError(
            f"reward function {name!r} failed for the whole batch of {len(completions)}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    try:
        values = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"reward function {name!r} returned {type(values).__name__}, not numbers: {exc}"
        ) from exc
    if values.shape != (len(completions),):
        raise ValueError(
            f"reward function {name!r} returned shape {values.shape}; "
            f"expected ({len(completions)},), one value per completion"
        )
    infinite = np.flatnonzero(np.isinf(values))
    if infinite.size:  # NaN is "missing"; an infinite reward would reach the loss as NaN
        i = int(infinite[0])
        raise UserError(
            f"reward function {name!r} returned {values[i]} for sample {i} of {len(completions)} "
            f"({infinite.size} infinite in all), completion {_start(completions[i])}; rewards must be "
            "finite (None or NaN marks a sample the function cannot score)"
        )
    return values


def _start(text: Any, limit: int = 80) -> str:
    """The start of a completion for an error message."""
    text = str(text)
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


class RewardOutput(NamedTuple):
    """What a `RewardSet` returns. Unpacks as `total, per_function, missing = reward_set(...)`."""

    total: np.ndarray  # [N] float64 Σ_k w_k r_k, a missing value counting 0 (TRL nansum)
    per_function: dict[str, np.ndarray]  # name -> [N] float64, unweighted, NaN where missing
    missing: np.ndarray  # [N] bool, True where any function returned NaN


class RewardSet:
    """A weighted sum of named reward functions: `{name: (weight, fn)}`.

    `reward_set(completions, examples)` returns a `RewardOutput(total, per_function, missing)`;
    `per_function` holds the unweighted values. A weight of 0 still computes (and logs) the function.
    A function that scores no sample of a batch (all None/NaN) is reported by one `logging`
    warning, the first time only (its `reward/<name>/missing` metric is then 1). A total that is
    not finite in float32 (the trainer's dtype) raises a `UserError` naming the sample.
    """

    def __init__(self, spec: Mapping[str, tuple[float, RewardFn]]):
        if not spec:
            raise ValueError("a RewardSet needs at least one reward function")
        self.weights: dict[str, float] = {}
        self.functions: dict[str, RewardFn] = {}
        for name, entry in spec.items():
            try:
                weight, fn = entry
            except (TypeError, ValueError):
                raise TypeError(f"reward {name!r}: expected a (weight, fn) pair, got {entry!r}") from None
            self.weights[name] = _check_weight(name, weight)
            if not callable(fn):
                raise TypeError(f"reward {name!r}: {fn!r} is not callable")
            self.functions[name] = fn
        self._warned_all_missing: set[str] = set()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.functions)

    def __call__(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> RewardOutput:
        check_batch("RewardSet", completions, examples)
        n = len(completions)
        per_function = {
            name: call_reward(name, fn, completions, examples) for name, fn in self.functions.items()
        }
        missing = np.zeros(n, dtype=bool)
        total = np.zeros(n, dtype=np.float64)
        for name, values in per_function.items():
            absent = np.isnan(values)
            missing |= absent
            total += self.weights[name] * np.where(absent, 0.0, values)
            if n and absent.all() and name not in self._warned_all_missing:
                self._warned_all_missing.add(name)
                logger.warning(
                    "reward %r scored none of the %d samples of this batch (all None/NaN): every row is "
                    "left out of the update and reward/%s/mean is NaN; check the function and the data "
                    "it needs (warned once; reward/%s/missing tracks it)", name, n, name, name)
        _check_total(total, per_function, self.weights, completions)
        return RewardOutput(total, per_function, missing)

    def metrics(self, output: RewardOutput) -> dict[str, float]:
        """Scalar metrics for `output`; see `reward_metrics`."""
        return reward_metrics(output)

    def __repr__(self) -> str:
        terms = ", ".join(f"{name}: {w:g}" for name, w in self.weights.items())
        return f"RewardSet({{{terms}}})"


def combine(spec: Mapping[str, tuple[float, RewardFn]]) -> RewardSet:
    """The weighted sum `{name: (weight, fn)}` as a `RewardSet`."""
    return RewardSet(spec)


def reward_metrics(output: RewardOutput) -> dict[str, float]:
    """Flat scalar metrics for logging, as TRL `GRPOTrainer` logs them.

    Keys: `reward/<name>/mean`, the mean of that function over the samples it scored (TRL's
    `nanmean`; NaN if it scored none), with `reward/<name>/missing`, the fraction of samples it did
    not score, present only when that fraction is above 0; `reward/total/mean` and
    `reward/total/std` over every sample of the weighted total in which a missing value counts 0
    (TRL's `nansum` reward), so `total/mean = Σ_k w_k · (1 − <name>/missing) · <name>/mean`; and
    `reward/missing_count`, the samples where any function returned NaN (the rows left out of the
    update).
    """
    metrics: dict[str, float] = {}
    n = len(output.total)
    for name, values in output.per_function.items():
        metrics[f"reward/{name}/mean"] = _nanmean(values)
        absent = int(np.count_nonzero(np.isnan(values)))
        if absent:
            metrics[f"reward/{name}/missing"] = absent / n
    total = np.asarray(output.total, np.float64)
    metrics["reward/total/mean"] = float(total.mean()) if n else math.nan
    metrics["reward/total/std"] = float(total.std()) if n else math.nan
    metrics["reward/missing_count"] = float(np.count_nonzero(output.missing))
    return metrics


def _check_total(total: np.ndarray, per_function: Mapping[str, np.ndarray], weights: Mapping[str, float],
                 completions: Sequence[str]) -> None:
    """A finite weighted total can still overflow the float32 the trainer uses (or float64 itself)."""
    bad = np.flatnonzero(~(np.abs(total) <= np.finfo(np.float32).max))
    if bad.size:
        i = int(bad[0])
        terms = ", ".join(f"{name}={values[i]:g} (weight {weights[name]:g})" for name, values in per_function.items())
        raise UserError(
            f"the weighted reward total of sample {i} is {total[i]:g}, beyond float32 "
            f"({bad.size} such samples): {terms}; completion {_start(completions[i])}")


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else math.nan


class WeightError(UserError, TypeError):
    """A reward's weight in the config is not a finite number."""


def _check_weight(name: str, weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating, np.integer)):
        raise WeightError(f"rewards.{name}: the weight must be a number, got {weight!r}")
    if not math.isfinite(float(weight)):
        raise WeightError(f"rewards.{name}: the weight must be finite, got {weight!r}")
    return float(weight)


# ---------------------------------------------------------------------------------------------
# Registry: config names -> constructors.

# The built-in rewards register themselves when their modules are imported, and
# rljax/rewards/__init__.py imports them all. Python imports that package before any of its modules
# (this one included), so the registry is complete whenever it can be reached. This module imports
# none of them: the registry sits below the rewards that fill it, with no import cycle.
_REGISTRY: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str, constructor: Callable[..., RewardFn], *, overwrite: bool = False) -> None:
    """Make `constructor(**options, **context) -> RewardFn` available to configs as `name`.

    Options come from the config entry; context (e.g. `max_length`, `tokenizer`, a reward model)
    from the caller of `build_rewards`, passed only where the constructor's signature names it
    (or takes `**kwargs`). Options win over context.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if not callable(constructor):
        raise TypeError(f"reward {name!r}: constructor {constructor!r} is not callable")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not constructor:
        raise ValueError(f"reward {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = constructor


def registered_rewards() -> tuple[str, ...]:
    """Names `build_rewards` accepts."""
    return tuple(sorted(_REGISTRY))


def build_reward(name: str, options: Mapping[str, Any] | None = None, *, config_key: str | None = None,
                 **context: Any) -> RewardFn:
    """Construct one registered reward function by name.

    `config_key`: the entry's key under `rewards` in the config; given to a constructor whose
    signature names `config_key` (only), so that its errors can name `rewards.<key>`."""
    if name not in _REGISTRY:
        raise UserError(f"unknown reward {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    constructor = _REGISTRY[name]
    options = dict(options or {})
    params = inspect.signature(constructor).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = [p for p, v in params.items()
                if v.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if not takes_kwargs:
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise UserError(
                f"reward {name!r}: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(accepted) if accepted else '(none)'}"
            )
    kwargs = {k: v for k, v in context.items() if takes_kwargs or k in accepted}
    if "config_key" in params and config_key is not None:
        kwargs["config_key"] = config_key
    kwargs.update(options)
    fn = constructor(**kwargs)
    if not callable(fn):
        raise TypeError(f"reward {name!r}: constructor returned {fn!r}, not a callable")
    return fn


def build_rewards(spec: Mapping[str, float | Mapping[str, Any]], **context: Any) -> RewardSet:
    """Build a `RewardSet` from a config mapping.

    Each entry is `name: weight`, or `name: {weight: w, <options>}`; inside the mapping,
    `type: <registered name>` lets one constructor appear twice under different names, e.g.

        rewards:
          answer: 1.0
          format: {weight: 0.2, think_prefilled: true}
          long_penalty: {type: length, weight: -0.001, unit: chars}
          accuracy: {type: python, function: "my_rewards:accuracy_reward"}  # a TRL-style function

    A mapping without `weight` gets weight 1.0. `context` is offered to every constructor
    (see `register_reward`).
    """
    if not spec:
        raise ValueError("rewards: at least one reward is required")
    entries: dict[str, tuple[float, RewardFn]] = {}
    for key, value in spec.items():
        if isinstance(value, Mapping):
            options = dict(value)
            weight = options.pop("weight", 1.0)
            kind = options.pop("type", key)
        else:
            options, weight, kind = {}, value, key
        weight = _check_weight(key, weight)
        entries[key] = (weight, build_reward(kind, options, config_key=key, **context))
    return RewardSet(entries)
