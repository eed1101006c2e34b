"""Text environments with Gymnasium's contract, and the registry that builds them from the config.

    env = build_environment("calculator", {"split_seed": 0})
    messages, info = env.reset(seed=3, options={"split": "train"})   # [system, user]; info["tools"]
    messages, reward, terminated, truncated, info = env.step('<tool_call>{"name": ...}</tool_call>')

An observation is a list of chat messages (``{"role": ..., "content": ...}``): ``reset`` returns the
opening ones (system, user; the tool schemas are in the system message, or in ``info["tools"]``
for a chat template that renders them itself), ``step`` the environment's reply to the assistant's
message (tool results with role ``"tool"``, user turns), empty when the episode ends. ``reward`` is
the reward of that step; the episode's return is their sum. ``truncated`` is the environment's own
limit; the rollout adds the turn and token budgets (``rljax.environments.episodes``).

What the rollout reads from ``info`` (all optional): from ``reset``, ``"tools"`` (JSON schemas the
chat template renders with ``apply_chat_template(..., tools=...)``); from ``step``,
``"tool_calls"`` (the names of the tools called), ``"tool_errors"`` and ``"parse_failures"``
(counts), ``"success"`` (bool, read when the episode ends) and ``"metrics"`` (``{name: number}``,
the episode's own figures so far, e.g. tests passed; logged as ``env/<name>``, averaged over episodes). An exception from ``reset`` or
``step`` ends that episode as failed (counted, left out of the loss); the other episodes go on.

One environment object runs one episode at a time; the rollout builds one per episode of a batch
and calls them from a thread pool, so slow tools overlap.

Registry: ``register_environment(name, factory)``; built-ins ``calculator``
(``rljax.environments.calculator``), ``code`` (``rljax.environments.code_env``: unit tests, retries),
``sql`` (``rljax.environments.sql_env``: a database, a ``run_sql`` tool) and ``toy``
(``rljax.environments.toy``, for tests); a
``"module:Class"`` path works anywhere a name does.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping

__all__ = ["Environment", "build_environment", "register_environment", "registered_environments"]

Messages = list[dict[str, Any]]


class Environment:
    """The interface (Gymnasium's ``reset`` / ``step``, with chat messages for observations and the
    assistant's message text for actions). Subclasses implement both; ``close`` is optional."""

    def reset(self, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[Messages, dict]:
        """Start an episode: ``(opening messages, info)``. The same ``seed`` (and options) gives the same episode."""
        raise NotImplementedError

    def step(self, action: str) -> tuple[Messages, float, bool, bool, dict]:
        """Answer the assistant's message: ``(new messages, reward, terminated, truncated, info)``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the environment holds (processes, files); called once its episode ends."""


_BUILTIN = {
    "calculator": "rljax.environments.calculator:CalculatorEnv",
    "code": "rljax.environments.code_env:CodeEnv",
    "sql": "rljax.environments.sql_env:SqlEnv",
    "toy": "rljax.environments.toy:ToyEnv",
}
_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register_environment(name: str, factory: Callable[..., Environment], *, overwrite: bool = False) -> None:
    """Add an environment: ``factory(**options)`` returns a fresh :class:`Environment`."""
    if (name in _REGISTRY or name in _BUILTIN) and not overwrite:
        raise ValueError(f"environment {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = factory


def registered_environments() -> tuple[str, ...]:
    return tuple(sorted(set(_REGISTRY) | set(_BUILTIN)))


def _resolve(name: str) -> Callable[..., Environment]:
    if name in _REGISTRY:
        return _REGISTRY[name]
    path = _BUILTIN.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(registered_environments())} "
                         "(or a Python path 'module:Class')")
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment {name!r}: cannot import {path!r} ({exc})") from exc


def build_environment(name: str, options: Mapping[str, Any] | None = None) -> Environment:
    """A fresh environment ``name`` (registered name or ``"module:Class"``) built with ``options``."""
    factory = _resolve(name)
    try:
        env = factory(**dict(options or {}))
    except TypeError as exc:
        raise ValueError(f"environment {name!r}: bad options {sorted(options or {})}: {exc}") from exc
    if not callable(getattr(env, "reset", None)) or not callable(getattr(env, "step", None)):
        raise TypeError(f"environment {name!r} built {type(env).__name__}, which has no reset/step")
    return env


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders tool schemas (``apply_chat_template(..., tools=...)``:
    Qwen2.5, Llama 3.1, Hermes); SmolLM2's does not."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def environment_factory(name: str, options: Mapping[str, Any] | None = None, *,
                        tokenizer: Any = None) -> Callable[[], Environment]:
    """A function that builds a fresh ``name`` environment per call (checked once now, so a bad name
    or option fails at start). With ``tokenizer`` whose chat template renders tools, an environment
    that takes ``native_tools`` (``rljax.environments.tools.ToolEnvironment``) and was not given it gets
    ``native_tools=True``: the template lists the schemas in its own format."""
    options = dict(options or {})
    if tokenizer is not None and "native_tools" not in options and template_renders_tools(tokenizer):
        try:
            accepts = "native_tools" in inspect.signature(_resolve(name)).parameters
        except (TypeError, ValueError):
            accepts = False
        if accepts:
            options["native_tools"] = True
    build_environment(name, options).close()
    return lambda: build_environment(name, options)


__all__ += ["environment_factory", "template_renders_tools"]
