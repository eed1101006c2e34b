"""Typed run configuration: frozen nested dataclasses, YAML files and command-line overrides.

A run's configuration is a tree of ``@dataclass(frozen=True)`` classes (the schema). A config is
built in three layers, each checked against the schema, and then frozen::

    dataclass defaults  <-  YAML file (configs/*.yaml)  <-  overrides ("train.learning_rate=1e-5")

    cfg = load_config(TrainConfig, "configs/grpo.yaml", ["train.learning_rate=1e-5"])
    save_config(cfg, run_dir / "config.yaml")      # the resolved config the run actually used
    assert load_config(TrainConfig, run_dir / "config.yaml") == cfg

Merging and type conversion are done by OmegaConf structured configs (a maintained config
library): ``int``/``float``/``bool``/``str``, ``Optional[...]``, ``Literal[...]``, enums, nested
dataclasses, ``list[...]``, ``tuple[...]`` and ``dict[str, ...]`` fields, and ``${a.b}``
interpolations (resolved once, at load time). ``Literal`` fields need OmegaConf >= 2.4.

Writing a schema:

* Every dataclass in the tree must be ``frozen=True`` (checked: a ``TypeError`` otherwise).
  Prefer tuples to lists for sequences: a frozen dataclass holding only hashable values is
  hashable, so it can be a static argument of ``jax.jit``.
* Restricted strings are ``Literal["token", "sequence"]`` fields; the allowed values are checked.
* Cross-field rules go in an optional ``validate(self) -> None`` method that raises ``ValueError``
  with a message naming the offending fields. It is called on every dataclass in the tree,
  children before parents, and the error is reported under the dataclass's dotted key.
* Derived values are ``@property`` methods, never fields written back.

Every user mistake -- an unknown key, a value of the wrong type, a value outside a ``Literal``, a
missing mandatory (``???``) value, a failed ``validate()`` -- raises :class:`ConfigError` naming the
full dotted key (``model.rope_scaling.factor``, ``optimizers[0].lr``), what was expected, and the
YAML file or override it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "load_config",
    "from_yaml",
    "with_overrides",
    "to_yaml",
    "save_config",
    "validate_config",
]


class ConfigError(ValueError):
    """A configuration value or key is invalid.

    Attributes:
      key: full dotted key of the offending entry (``""`` for the root), or ``None`` if unknown.
      reason: what is wrong / what was expected.
      source: where the value came from (a YAML path, ``"override 'a.b=1'"``), or ``None``.
    """

    def __init__(self, key: str | None, reason: str, source: str | None = None):
        self.key = key
        self.reason = reason
        self.source = source
        where = f"{source}: " if source else ""
        what = f"{key or '<root>'}: " if key is not None else ""
        super().__init__(f"{where}{what}{reason}")


# ----------------------------------------------------------------------------- public API


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Builds a frozen ``cls`` instance: dataclass defaults <- YAML file at ``path`` <- overrides.

    Args:
      cls: the root frozen dataclass (the schema).
      path: a YAML file whose top level is a mapping, or ``None`` for the defaults only.
      overrides: ``"dotted.key=value"`` strings, applied in order; values are parsed as YAML
        (``train.steps=10``, ``model.name=qwen3-0.6b``, ``train.betas=[0.9,0.95]``,
        ``model.lora=null``). A whole list is replaced at once (``a.items=[1,2]``); single list
        elements cannot be overridden.

    Raises:
      ConfigError: unknown key, bad value, missing mandatory value or failed ``validate()``.
      FileNotFoundError: ``path`` does not exist.
    """
    if path is None:
        return _build(cls, OmegaConf.structured(cls), None, None, overrides)
    path = Path(path)
    return _build(cls, OmegaConf.structured(cls), path.read_text(), str(path), overrides)


def from_yaml(cls: type[T], text: str, overrides: Sequence[str] = ()) -> T:
    """Like :func:`load_config`, with the YAML given as a string (e.g. a saved ``config.yaml``)."""
    return _build(cls, OmegaConf.structured(cls), text, "<yaml string>", overrides)


def with_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """Returns a copy of the config instance ``cfg`` with dotlist ``overrides`` applied and checked.

    For presets built on a loaded config, e.g. a ``--smoke`` preset:
    ``with_overrides(cfg, ["train.steps=2", "model.name=tiny"])``.
    """
    return _build(type(cfg), OmegaConf.structured(cfg), None, None, overrides)


def to_yaml(cfg: Any) -> str:
    """The YAML text of a config instance (enums by name, tuples as lists, ``None`` as null).

    ``from_yaml(type(cfg), to_yaml(cfg)) == cfg``.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_yaml expects a dataclass instance, got {type(cfg).__name__}")
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Writes :func:`to_yaml` of ``cfg`` to ``path`` (parent directories created), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, path)


def validate_config(cfg: Any) -> None:
    """Checks ``Literal`` fields and runs every ``validate()`` method in the tree (children first).

    :func:`load_config` calls this; call it yourself after building a config in Python
    (``dataclasses.replace``). Raises :class:`ConfigError` naming the dotted key.
    """
    _validate_tree(cfg, "")


# ----------------------------------------------------------------------------- building


def _build(
    cls: type[T],
    schema: DictConfig,
    yaml_text: str | None,
    yaml_source: str | None,
    overrides: Sequence[str],
) -> T:
    _check_frozen_schema(cls)
    merged = schema
    if yaml_text is not None:
        try:
            layer = OmegaConf.create(yaml_text)
        except OmegaConfBaseException as e:  # YAML syntax errors
            raise ConfigError(None, f"cannot parse YAML: {_first_line(e)}", yaml_source) from None
        except Exception as e:  # yaml.YAMLError and friends
            raise ConfigError(None, f"cannot parse YAML: {e}", yaml_source) from None
        if not isinstance(layer, DictConfig):
            raise ConfigError("", "the top level of a config file must be a mapping", yaml_source)
        merged = _merge_layer(cls, merged, layer, yaml_source)
    for override in overrides:
        source = f"override {override!r}"
        key, sep, _ = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(None, "an override must look like 'dotted.key=value'", source)
        if any(part.isdigit() or "[" in part for part in key.split(".")):
            raise ConfigError(
                key,
                "single list elements cannot be overridden; set the whole list, e.g. key=[a,b]",
                source,
            )
        try:
            layer = OmegaConf.from_dotlist([override])
        except OmegaConfBaseException as e:
            raise ConfigError(key, _first_line(e), source) from None
        merged = _merge_layer(cls, merged, layer, source, fallback_key=key)
    try:
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _wrap(e, None, None) from None
    validate_config(obj)
    return typing.cast(T, obj)


def _merge_layer(
    cls: type,
    base: DictConfig,
    layer: DictConfig,
    source: str | None,
    fallback_key: str | None = None,
) -> DictConfig:
    # Unknown keys are found by walking the raw layer against the schema first: OmegaConf's
    # own error names the wrong key inside lists of dataclasses and suggests nothing.
    _check_keys(cls, OmegaConf.to_container(layer, resolve=False), "", source)
    try:
        return typing.cast(DictConfig, OmegaConf.merge(base, layer))
    except OmegaConfBaseException as e:
        raise _wrap(e, source, fallback_key) from None
    except TypeError as e:  # e.g. a mapping given where the schema has a list
        raise ConfigError(fallback_key, f"wrong kind of value ({e})", source) from None


def _wrap(e: OmegaConfBaseException, source: str | None, fallback_key: str | None) -> ConfigError:
    key = getattr(e, "full_key", None) or fallback_key
    return ConfigError(key, _first_line(e), source)


def _first_line(e: BaseException) -> str:
    # OmegaConf appends "full_key: ... / object_type=..." lines; the key is reported separately.
    msg = str(getattr(e, "msg", None) or e).strip().splitlines()[0]
    # Errors raised outside a node leave OmegaConf's message template unformatted.
    return msg.replace("'$VALUE' of type '$VALUE_TYPE' ", "").replace("$VALUE", "value")


# ----------------------------------------------------------------------------- schema walks


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_frozen_schema(cls: type, _seen: set[type] | None = None) -> None:
    seen = set() if _seen is None else _seen
    if cls in seen:
        return
    seen.add(cls)
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"config schema must be a dataclass type, got {cls!r}")
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"config dataclass {cls.__qualname__} must be @dataclass(frozen=True)")
    for tp in _hints(cls).values():
        for sub in _dataclasses_in(tp):
            _check_frozen_schema(sub, seen)


def _dataclasses_in(tp: Any) -> list[type]:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    return [d for arg in typing.get_args(tp) for d in _dataclasses_in(arg)]


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_keys(tp: Any, data: Any, path: str, source: str | None) -> None:
    """Raises ConfigError for the first key in raw ``data`` that schema type ``tp`` lacks."""
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, Mapping):
            return  # a wrong kind of value; OmegaConf reports it with the expected type
        hints = _hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        for key, value in data.items():
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    _join(path, key),
                    f"unknown key for {tp.__name__} (known keys: {', '.join(names)}){hint}",
                    source,
                )
            _check_keys(hints[key], value, _join(path, key), source)
    elif origin in (list, tuple, Sequence) and isinstance(data, list):
        args = typing.get_args(tp)
        for i, value in enumerate(data):
            if origin is tuple and args and args[-1] is not Ellipsis:
                elem = args[i] if i < len(args) else Any
            else:
                elem = args[0] if args else Any
            _check_keys(elem, value, f"{path}[{i}]", source)
    elif origin in (dict, Mapping) and isinstance(data, Mapping):
        args = typing.get_args(tp)
        for key, value in data.items():
            _check_keys(args[1] if args else Any, value, _join(path, key), source)


def _validate_tree(obj: Any, path: str) -> None:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        hints = _hints(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = _join(path, f.name)
            _check_literal(hints[f.name], value, key)
            _validate_tree(value, key)
        validate = getattr(obj, "validate", None)
        if callable(validate):
            try:
                validate()
            except ValueError as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError(path, str(e)) from None
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _validate_tree(value, f"{path}[{i}]")
    elif isinstance(obj, Mapping):
        for k, value in obj.items():
            _validate_tree(value, _join(path, k))


def _check_literal(tp: Any, value: Any, key: str) -> None:
    # OmegaConf >= 2.4 already checks Literal fields while merging; this also covers configs
    # built in Python and older OmegaConf versions.
    if value is None and _unwrap_optional(tp) is not tp:
        return
    tp = _unwrap_optional(tp)
    if typing.get_origin(tp) is not Literal:
        return
    allowed = typing.get_args(tp)
    # type() identity keeps True from matching 1; enum members compare by identity anyway.
    if not any(type(value) is type(a) and value == a for a in allowed):
        shown = ", ".join(a.name if isinstance(a, enum.Enum) else repr(a) for a in allowed)
        raise ConfigError(key, f"invalid value {value!r}, expected one of [{shown}]")
