"""Bring your own reward function: a reward written for TRL's ``GRPOTrainer``, referenced from YAML.

    rewards:
      accuracy: {type: python, function: "my_rewards:accuracy_reward", weight: 1.0}
      format: {type: python, function: "rewards/format.py:format_reward", weight: 0.2}

``function`` is ``module:name`` (a module importable from ``sys.path``; the current directory is put
on the path) or ``path/to/file.py:name`` (loaded from that file, relative to the current directory).
The function is called as TRL's ``GRPOTrainer._calculate_rewards`` calls one (TRL ``trl/trainer/
grpo_trainer.py``):

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

- ``prompts``: each row's ``prompt`` as the dataset holds it (a string, or a list of chat messages),
  before rljax adds ``data.system_prompt`` or the chat template.
- ``completions``: what the model generated, decoded without special tokens, with
  ``data.assistant_prefix`` in front (the prompt ended with it: rljax's own rewards score the same
  text). Conversational data (the first row's prompt is a list of ``{"role", ...}`` messages: TRL's
  ``is_conversational``) gets each completion as ``[{"role": "assistant", "content": text}]``, as TRL
  passes it; otherwise plain strings. A string prompt stays a string even under ``data.chat: true``
  (TRL does not template string prompts either).
- ``completion_ids``: the generated token ids, the stop token included (TRL's ``completion_ids``);
  the tokens of ``data.assistant_prefix`` belong to the prompt and are not in them.
- every other dataset column as a keyword list (e.g. ``solution``), and ``answer`` when
  ``data.answer_column`` names one. Not passed: rljax's own per-row keys (``key``,
  ``completion_length``), and TRL's ``trainer_state``, ``log_extra``, ``log_metric`` and
  ``environments``, which have no rljax equivalent here: a function that requires one of them is
  refused with a message naming it.

The function returns one value per completion: a number, or ``None`` (or NaN) for "cannot score"
(TRL's convention; rljax leaves such rows out of the update). It runs in the training process, unbounded
(as in TRL); a function that raises fails the step with its error. A missing module or file, a
missing attribute, a non-callable, a signature that cannot take these arguments, a result of the
wrong length or a value that is not a number is a :class:`rljax.errors.UserError` naming
``rewards.<key>`` and the function.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rljax.errors import UserError
from rljax.plugins import load_object
from rljax.rewards.base import RewardFn, check_batch, register_reward

# rljax's own per-row keys, not dataset columns (rljax.rollout and rljax.training.data add them).
_RLJAX_KEYS = frozenset({"prompt", "key", "completion_length", "completion_ids"})
# Keywords the adapter passes itself; a column with one of these names would collide (TRL raises there).
_PASSED = ("prompts", "completions", "completion_ids")
# What TRL passes and rljax does not: named when a function requires one.
_NOT_PASSED = ("trainer_state", "log_extra", "log_metric", "environments")


def load_function(spec: str, *, where: str = "function") -> Callable[..., Any]:
    """The callable ``spec`` names: ``module:name`` or ``path/to/file.py:name`` (see the module doc).

    ``where`` starts every error message (e.g. ``"rewards.accuracy"``). Raises ``UserError`` (a
    ``MissingFileError`` for a missing file) naming ``spec`` and what is wrong.
    """
    fn = load_object(spec, where=where, what="function")
    if not callable(fn):
        raise UserError(f"{where}: function {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


def is_conversational(prompt: Any) -> bool:
    """TRL's ``is_conversational`` for a prompt: a non-empty list whose first item is a dict with ``role``."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping) \
        and "role" in prompt[0]


def trl_reward_kwargs(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """The keyword arguments TRL's ``GRPOTrainer`` would pass a reward function for these rows:
    ``prompts``, ``completions`` (message lists for conversational prompts), ``completion_ids`` and one
    list per dataset column (see the module doc)."""
    check_batch("python", completions, examples)
    prompts = [ex.get("prompt") for ex in examples]
    if prompts and is_conversational(prompts[0]):
        shown: list = [[{"role": "assistant", "content": text}] for text in completions]
    else:
        shown = list(completions)
    kwargs: dict[str, list] = {"prompts": prompts, "completions": shown,
                               "completion_ids": [list(ex.get("completion_ids", ())) for ex in examples]}
    columns = [k for k in (examples[0] if examples else {}) if k not in _RLJAX_KEYS and k not in _PASSED]
    for column in columns:
        kwargs[column] = [ex.get(column) for ex in examples]
    return kwargs


def make_python_reward(*, function: str, config_key: str | None = None) -> RewardFn:
    """A batch reward that calls the TRL-style function ``function`` names (see the module doc).

    ``config_key``: the entry's key under ``rewards`` (``build_rewards`` passes it), named in errors.
    """
    where = f"rewards.{config_key or 'python'}"
    fn = load_function(function, where=where)
    label = f"{where}: function {function!r}"

    def python(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        kwargs = trl_reward_kwargs(completions, examples)
        _check_signature(fn, kwargs, label)
        values = fn(**kwargs)
        return _check_values(values, len(completions), label)

    python.reward_name = config_key or getattr(fn, "__name__", "python")  # type: ignore[attr-defined]
    python.function = fn  # type: ignore[attr-defined]  # the user's function, for direct use
    return python


def _check_signature(fn: Callable[..., Any], kwargs: Mapping[str, Any], label: str) -> None:
    """A function that cannot take these keywords fails here with what it was offered, not deep inside."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        required = [p.name for p in signature.parameters.values() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kwargs]
        absent = [n for n in required if n in _NOT_PASSED]
        note = (f"; rljax does not pass {', '.join(absent)} (TRL-only)" if absent
                else f"; missing: {', '.join(required)}" if required else "")
        raise UserError(f"{label} cannot be called with the arguments TRL passes ({', '.join(kwargs)}): {exc}"
                        f"{note}. Write it as fn(completions, **kwargs), reading columns from kwargs") from None


def _check_values(values: Any, n: int, label: str) -> np.ndarray:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, (Sequence, np.ndarray)):
        raise UserError(f"{label} returned {type(values).__name__}; expected a list of {n} numbers (None = missing)")
    if len(values) != n:
        raise UserError(f"{label} returned {len(values)} values for {n} completions; expected one per completion")
    out = np.empty(n, dtype=np.float64)
    for i, value in enumerate(values):
        if value is None:
            out[i] = np.nan
        elif isinstance(value, numbers.Real) or (isinstance(value, np.ndarray) and value.shape == ()
                                                 and np.issubdtype(value.dtype, np.number)):
            out[i] = float(value)
        else:
            raise UserError(f"{label} returned {value!r} ({type(value).__name__}) for completion {i}; "
                            "expected a number or None")
    return out


register_reward("python", make_python_reward)

__all__ = ["is_conversational", "load_function", "make_python_reward", "trl_reward_kwargs"]
