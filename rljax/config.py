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
  children before parents, and the error is reported under the dataclass's dotted key. A rule
  about one field raises :class:`FieldError` (``check_range`` does, for numbers) and is reported
  under that field's dotted key (``optim.learning_rate``).
* Derived values are ``@property`` methods, never fields written back.
* A section that is one of several kinds is a *tagged union* of frozen dataclasses
  (``A | B`` or ``Union[A, B]``; not inside ``Optional``, ``list`` or ``dict``). Each member has a
  field ``name: Literal["<tag>"] = "<tag>"`` (tags unique) and only the settings it uses; the
  field's default picks the default member::

      @dataclass(frozen=True)
      class GRPOConfig:
          name: Literal["grpo"] = "grpo"
          clip_eps: float = 0.2

      @dataclass(frozen=True)
      class PPOConfig:
          name: Literal["ppo"] = "ppo"
          clip_eps: float = 0.2
          gamma: float = 1.0

      @dataclass(frozen=True)
      class RunConfig:
          algorithm: GRPOConfig | PPOConfig = field(default_factory=GRPOConfig)

  The member is picked by the last ``algorithm.name`` written (defaults <- YAML <- overrides),
  then every layer is checked against that member: ``algorithm.gamma=0.9`` with ``grpo`` is
  refused as an unknown key that "is a setting of ppo and does nothing for algorithm 'grpo'".
  When the tag differs from the base's (the defaults, or the config given to
  :func:`with_overrides`), the section restarts from the new member's defaults and the keys
  written in the layers are applied on top (settings of the old member are dropped, shared ones
  are not carried over). The result holds an instance of the member class
  (``isinstance(cfg.algorithm, PPOConfig)``); :func:`union_members` lists the tags.
* A tagged union whose members are known only when a config is loaded (members registered later,
  or code outside the package named by its tag) is a subclass of :class:`OpenUnion` used as the
  field's type: ``members()`` is called at every load, and ``resolve(tag)`` gives the member of a
  tag that is not among them (e.g. ``"path/to/file.py:ALGORITHM"``), or ``None``.

Every user mistake -- an unknown key, a value of the wrong type, a value outside a ``Literal``, a
missing mandatory (``???``) value, a failed ``validate()`` -- raises :class:`ConfigError` naming the
full dotted key (``model.rope_scaling.factor``, ``optimizers[0].lr``), what was expected, and the
YAML file or override it came from. A schema class may name keys it no longer holds,
``__moved_keys__ = {"save_model": "train.save_model"}``: the unknown-key error then says where the
key went.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import os
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rljax.errors import MissingFileError, UserError

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "load_config",
    "from_yaml",
    "with_overrides",
    "to_yaml",
    "save_config",
    "validate_config",
    "union_members",
    "OpenUnion",
    "FieldError",
    "check_range",
]


class ConfigError(UserError):
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


class FieldError(ValueError):
    """What a ``validate()`` method raises about one of its own fields: reported as a
    :class:`ConfigError` under the field's full dotted key (``algorithm.epsilon_low``)."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


def check_range(section: Any, field: str, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, note: str = "") -> None:
    """Raises :class:`FieldError` unless ``section.<field>`` is a finite number within the bounds.

    ``low`` / ``high`` are inclusive unless ``low_open`` / ``high_open``; ``None`` is no bound. A
    value of ``None`` passes (the schema's ``Optional`` says where null is allowed). NaN and
    infinities are refused always: a non-finite setting is never what a run meant. ``note`` is added
    to the message (``"(null = off)"``).
    """
    value = getattr(section, field)
    if value is None:
        return
    if low is not None and high is not None:
        expected = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        expected = f"{'>' if low_open else '>='} {low:g}"
    elif high is not None:
        expected = f"{'<' if high_open else '<='} {high:g}"
    else:
        expected = "finite"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise FieldError(field, f"must be {expected}{' ' + note if note else ''}, got {value!r}")


# ----------------------------------------------------------------------------- public API


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Builds a frozen ``cls`` instance: dataclass defaults <- YAML file at ``path`` <- overrides.

    Args:
      cls: the root frozen dataclass (the schema).
      path: a YAML file whose top level is a mapping, or ``None`` for the defaults only.
      overrides: ``"dotted.key=value"`` strings, applied in order; values are parsed as YAML
        (``train.steps=10``, ``model.name=qwen3-0.6b``, ``train.betas=[0.9,0.95]``,
        ``model.lora=null``; an empty value, ``data.task=``, is the empty string, so the
        shell's reading of ``data.task=""`` works). A whole list is replaced at once
        (``a.items=[1,2]``); single list elements cannot be overridden.

    Raises:
      ConfigError: unknown key, bad value, missing mandatory value or failed ``validate()``.
      FileNotFoundError: ``path`` does not exist (a ``rljax.errors.MissingFileError``).
    """
    if path is None:
        return _build(cls, None, None, None, overrides)
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"no such config file: {path}")
    return _build(cls, None, path.read_text(), str(path), overrides)


def from_yaml(cls: type[T], text: str, overrides: Sequence[str] = ()) -> T:
    """Like :func:`load_config`, with the YAML given as a string (e.g. a saved ``config.yaml``)."""
    return _build(cls, None, text, "<yaml string>", overrides)


def with_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """Returns a copy of the config instance ``cfg`` with dotlist ``overrides`` applied and checked.

    For presets built on a loaded config, e.g. a ``--smoke`` preset:
    ``with_overrides(cfg, ["train.steps=2", "model.name=tiny"])``. An override that changes a
    tagged union's ``name`` restarts that section from the new member's defaults.
    """
    return _build(type(cfg), cfg, None, None, overrides)


def to_yaml(cfg: Any) -> str:
    """The YAML text of a config instance (enums by name, tuples as lists, ``None`` as null).

    ``from_yaml(type(cfg), to_yaml(cfg)) == cfg``.
    """
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_yaml expects a dataclass instance, got {type(cfg).__name__}")
    # OmegaConf cannot hold a Union of dataclasses: give it the members this config holds.
    choice = _choose(type(cfg), cfg, [], "") if _has_union(type(cfg)) else ()
    return OmegaConf.to_yaml(OmegaConf.structured(_to_concrete(cfg, choice)))


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


class OpenUnion:
    """The type of a tagged union field whose members are looked up when a config is loaded.

    Subclass it and give ``members() -> {tag: member}`` (the members known now) and, optionally,
    ``resolve(tag) -> member | None`` for a tag outside them; a resolved member must be listed by
    ``members()`` from then on (so a saved config loads again and validation accepts it).
    """

    @classmethod
    def members(cls) -> dict[str, type]:
        raise NotImplementedError

    @classmethod
    def resolve(cls, tag: str) -> type | None:
        return None


def _is_open_union(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, OpenUnion) and tp is not OpenUnion


def union_members(tp: Any) -> dict[str, type]:
    """The members of a tagged union type, ``{tag: class}`` in declaration order.

    ``union_members(GRPOConfig | PPOConfig) == {"grpo": GRPOConfig, "ppo": PPOConfig}``; lists the
    choices of a section, e.g. the algorithms a run config accepts and (with
    ``dataclasses.fields``) their settings.

    Raises:
      TypeError: ``tp`` is not a union of two or more dataclasses, or a member lacks a
        ``name: Literal["<tag>"] = "<tag>"`` field, or two members share a tag.
    """
    members = _tagged_union(tp)
    if members is None:
        raise TypeError(f"expected a Union of two or more dataclasses, got {tp!r}")
    return dict(members)


# ----------------------------------------------------------------------------- building


def _build(
    cls: type[T],
    base: Any,
    yaml_text: str | None,
    yaml_source: str | None,
    overrides: Sequence[str],
) -> T:
    """Merges the layers onto ``base`` (a ``cls`` instance, or ``None`` for the defaults)."""
    _check_frozen_schema(cls)
    layers: Iterable[tuple[DictConfig, str | None, str | None]] = _parse_layers(
        yaml_text, yaml_source, overrides
    )
    choice: _Choice = ()
    if _has_union(cls):
        # The members of tagged unions are picked from the last tag written in any layer, so all
        # layers are read before the first is merged.
        layers = list(layers)
        raw = [(OmegaConf.to_container(layer, resolve=False), src) for layer, src, _ in layers]
        choice = _choose(cls, base, raw, "")
        for path, _ in _union_paths(choice, ""):
            for layer, _, _ in layers:
                _drop_tag(layer, path)  # the base already holds the final tag
    chosen = dict(_union_paths(choice, ""))
    if base is None:
        merged = OmegaConf.structured(_concrete_class(cls, choice))
    else:
        merged = OmegaConf.structured(_to_concrete(base, choice))
    for layer, source, fallback_key in layers:
        merged = _merge_layer(cls, merged, layer, source, fallback_key, chosen)
    try:
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _wrap(e, None, None) from None
    obj = _to_real(obj, cls, choice)
    validate_config(obj)
    return typing.cast(T, obj)


def _parse_layers(
    yaml_text: str | None, yaml_source: str | None, overrides: Sequence[str]
) -> Iterator[tuple[DictConfig, str | None, str | None]]:
    """Yields ``(layer, source, fallback_key)`` for the YAML text and each override, in order."""
    if yaml_text is not None:
        try:
            layer = OmegaConf.create(yaml_text)
        except OmegaConfBaseException as e:  # YAML syntax errors
            raise ConfigError(None, f"cannot parse YAML: {_first_line(e)}", yaml_source) from None
        except Exception as e:  # yaml.YAMLError and friends
            raise ConfigError(None, f"cannot parse YAML: {e}", yaml_source) from None
        if not isinstance(layer, DictConfig):
            raise ConfigError("", "the top level of a config file must be a mapping", yaml_source)
        yield layer, yaml_source, None
    for override in overrides:
        source = f"override {override!r}"
        key, sep, value = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(None, "an override must look like 'dotted.key=value'", source)
        if any(part.isdigit() or "[" in part for part in key.split(".")):
            raise ConfigError(
                key,
                "single list elements cannot be overridden; set the whole list, e.g. key=[a,b]",
                source,
            )
        # `key=` is the empty string, as in Hydra, not YAML's null: a shell turns `key=""` into
        # `key=`. `key=null` is null.
        dotlist = f"{key}=''" if not value.strip() else override
        try:
            layer = OmegaConf.from_dotlist([dotlist])
        except OmegaConfBaseException as e:
            raise ConfigError(key, _first_line(e), source) from None
        except Exception as e:  # yaml.YAMLError: the value is not valid YAML
            raise ConfigError(key, f"the value {value!r} is not valid YAML ({_yaml_problem(e)})", source) from None
        yield layer, source, key


def _merge_layer(
    cls: type,
    base: DictConfig,
    layer: DictConfig,
    source: str | None,
    fallback_key: str | None = None,
    chosen: Mapping[str, type] | None = None,
) -> DictConfig:
    # Unknown keys are found by walking the raw layer against the schema first: OmegaConf's
    # own error names the wrong key inside lists of dataclasses and suggests nothing.
    _check_keys(cls, OmegaConf.to_container(layer, resolve=False), "", source, chosen or {})
    try:
        return typing.cast(DictConfig, OmegaConf.merge(base, layer))
    except OmegaConfBaseException as e:
        raise _wrap(e, source, fallback_key) from None
    except TypeError as e:  # e.g. a mapping given where the schema has a list
        raise ConfigError(fallback_key, f"wrong kind of value ({e})", source) from None


def _wrap(e: OmegaConfBaseException, source: str | None, fallback_key: str | None) -> ConfigError:
    key = getattr(e, "full_key", None) or fallback_key
    return ConfigError(key, _first_line(e), source)


def _yaml_problem(e: BaseException) -> str:
    # PyYAML's message spans lines and points into "<unicode string>"; keep the what, not the where.
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    return ": ".join(p for p in parts if p) or _first_line(e)


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
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, tp in _hints(cls).items():
        for sub in _dataclasses_in(tp):  # union members included
            _check_frozen_schema(sub, seen)
        if name in fields:
            _check_union_field(cls, fields[name], tp)


def _dataclasses_in(tp: Any) -> list[type]:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    if _is_open_union(tp):
        return list(tp.members().values())
    return [d for arg in typing.get_args(tp) for d in _dataclasses_in(arg)]


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _check_keys(
    tp: Any,
    data: Any,
    path: str,
    source: str | None,
    chosen: Mapping[str, type] | None = None,
    union: Mapping[str, type] | None = None,
) -> None:
    """Raises ConfigError for the first key in raw ``data`` that schema type ``tp`` lacks.

    ``chosen`` maps the dotted key of each tagged union to its chosen member; ``union`` is the
    set of members when ``tp`` is one (to say which other member a refused key belongs to).
    """
    chosen = chosen or {}
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    members = _tagged_union(tp)
    if members is not None:
        if path in chosen:
            _check_keys(chosen[path], data, path, source, chosen, members)
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, Mapping):
            return  # a wrong kind of value; OmegaConf reports it with the expected type
        hints = _hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        for key, value in data.items():
            if key not in names:
                reason = _unknown_key(tp, names, key, path, union)
                raise ConfigError(_join(path, key), reason, source)
            _check_keys(hints[key], value, _join(path, key), source, chosen)
    elif origin in (list, tuple, Sequence) and isinstance(data, list):
        args = typing.get_args(tp)
        for i, value in enumerate(data):
            if origin is tuple and args and args[-1] is not Ellipsis:
                elem = args[i] if i < len(args) else Any
            else:
                elem = args[0] if args else Any
            _check_keys(elem, value, f"{path}[{i}]", source, chosen)
    elif origin in (dict, Mapping) and isinstance(data, Mapping):
        args = typing.get_args(tp)
        for key, value in data.items():
            _check_keys(args[1] if args else Any, value, _join(path, key), source, chosen)


def _unknown_key(
    cls: type, names: list[str], key: Any, path: str, union: Mapping[str, type] | None
) -> str:
    reason = f"unknown key for {cls.__name__} (known keys: {', '.join(names)})"
    moved = getattr(cls, "__moved_keys__", {}).get(key)
    if moved:  # a key an earlier rljax had here: name its new place rather than guess a spelling
        return f"{reason}; {key!r} moved to {moved!r}"
    owners = [
        tag
        for tag, member in (union or {}).items()
        if member is not cls and key in {f.name for f in dataclasses.fields(member)}
    ]
    if owners and union:
        # A setting of another member, e.g. a PPO-only key while GRPO is chosen: say so
        # rather than suggest a spelling.
        tag = next(t for t, member in union.items() if member is cls)
        field = path.rsplit(".", 1)[-1]
        owned_by = ", ".join(owners)
        return f"{reason}; {key!r} is a setting of {owned_by} and does nothing for {field} {tag!r}"
    close = difflib.get_close_matches(str(key), names, n=1)
    return f"{reason}; did you mean {close[0]!r}?" if close else reason


def _validate_tree(obj: Any, path: str) -> None:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        hints = _hints(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = _join(path, f.name)
            members = _tagged_union(hints[f.name])
            if members is not None and type(value) not in members.values():
                names = ", ".join(m.__name__ for m in members.values())
                raise ConfigError(key, f"expected one of {names}, got {type(value).__name__}")
            _check_literal(hints[f.name], value, key)
            _validate_tree(value, key)
        validate = getattr(obj, "validate", None)
        if callable(validate):
            try:
                validate()
            except FieldError as e:
                raise ConfigError(_join(path, e.field), e.reason) from None
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


# ----------------------------------------------------------------------------- tagged unions
#
# OmegaConf cannot type a field as a Union of dataclasses. So before merging, the member of each
# tagged union is chosen from the layers (a "choice": a tree of (field, member or None for a
# plain section on the way to a union, sub-choice)), a concrete schema is made by subclassing
# the dataclasses on the way with the members substituted, OmegaConf merges against it, and the
# result is converted back to instances of the real classes.

_Choice = tuple[tuple[str, "type | None", "_Choice"], ...]


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _is_dataclass_union(tp: Any) -> bool:
    """A Union of two or more non-None types, one at least a dataclass (meant as a tagged union)."""
    args = _union_args(tp)
    if args is None:
        return False
    non_none = [a for a in args if a is not type(None)]
    return len(non_none) >= 2 and any(dataclasses.is_dataclass(a) for a in non_none)


def _tagged_union(tp: Any) -> dict[str, type] | None:
    """``{tag: member}`` if ``tp`` is a Union of two or more dataclasses (or an :class:`OpenUnion`),
    else ``None``."""
    if _is_open_union(tp):
        return _tagged_union_of(tuple(tp.members().values()))
    args = _union_args(tp)
    if args is None or len(args) < 2:
        return None
    # Cached by the ordered members: Union[A, B] == Union[B, A], but the tags keep their order.
    return _tagged_union_of(args)


@functools.lru_cache(maxsize=None)
def _tagged_union_of(args: tuple[Any, ...]) -> dict[str, type] | None:
    if not all(isinstance(a, type) and dataclasses.is_dataclass(a) for a in args):
        return None
    members: dict[str, type] = {}
    for member in args:
        tag = _tag_of(member)
        if tag in members:
            raise TypeError(
                f"tagged union members {members[tag].__qualname__} and {member.__qualname__} "
                f"have the same tag {tag!r}; tags must be unique"
            )
        members[tag] = member
    return members


def _tag_of(member: type) -> str:
    field = next((f for f in dataclasses.fields(member) if f.name == "name"), None)
    hint = _hints(member).get("name")
    args = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
    if field is None or len(args) != 1 or not isinstance(args[0], str) or field.default != args[0]:
        raise TypeError(
            f"tagged union member {member.__qualname__} needs a field "
            f"`name: Literal[\"<tag>\"] = \"<tag>\"` (the tag that selects it)"
        )
    return args[0]


def _check_union_field(cls: type, field: dataclasses.Field, tp: Any) -> None:
    where = f"{cls.__qualname__}.{field.name}"
    if _is_dataclass_union(tp):
        members = _tagged_union(tp)
        if members is None:
            raise TypeError(
                f"{where}: a tagged union must be a Union of dataclasses only "
                f"(not Optional, not mixed with other types), got {tp}"
            )
        default = _field_default(field)
        if default is not dataclasses.MISSING and type(default) not in members.values():
            names = ", ".join(m.__name__ for m in members.values())
            raise TypeError(f"{where}: the default must be an instance of {names}, got {default!r}")
    elif any(_contains_dataclass_union(arg) for arg in typing.get_args(tp)):
        raise TypeError(
            f"{where}: a tagged union must be the whole type of a dataclass field, "
            f"not inside {tp}"
        )


def _contains_dataclass_union(tp: Any) -> bool:
    return _is_dataclass_union(tp) or any(_contains_dataclass_union(a) for a in typing.get_args(tp))


@functools.lru_cache(maxsize=None)
def _has_union(cls: type) -> bool:
    """Whether the schema tree under ``cls`` holds a tagged union."""
    seen: set[type] = set()

    def walk(c: type) -> bool:
        if c in seen:
            return False
        seen.add(c)
        for tp in _hints(c).values():
            if _tagged_union(tp) is not None:
                return True
            if any(walk(sub) for sub in _dataclasses_in(tp)):
                return True
        return False

    return walk(cls)


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _choose(
    cls: type, base: Any, layers: Sequence[tuple[Any, str | None]], path: str
) -> _Choice:
    """Picks the member of every tagged union under ``cls``.

    ``base`` is the ``cls`` instance the layers apply to, or ``None`` for its field defaults;
    ``layers`` are raw (unresolved) containers with their sources, in order. A union's member is
    given by the last ``name`` a layer writes, else by the base's member.
    """
    if not _has_union(cls):
        return ()
    hints = _hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        key = _join(path, field.name)
        value = getattr(base, field.name) if base is not None else _field_default(field)
        sub_layers = [
            (data[field.name], source)
            for data, source in layers
            if isinstance(data, Mapping) and field.name in data
        ]
        members = _tagged_union(tp)
        if members is not None:
            member = _choose_member(members, value, sub_layers, key, tp.resolve if _is_open_union(tp) else None)
            # Same member as the base: keep the base's values; another: restart from its defaults.
            sub_base = value if type(value) is member else None
            out.append((field.name, member, _choose(member, sub_base, sub_layers, key)))
            continue
        section = _unwrap_optional(tp)
        if isinstance(section, type) and dataclasses.is_dataclass(section) and _has_union(section):
            sub_base = value if isinstance(value, section) else None
            sub_layers = [(data, src) for data, src in sub_layers if isinstance(data, Mapping)]
            sub = _choose(section, sub_base, sub_layers, key)
            if sub:
                out.append((field.name, None, sub))
    return tuple(out)


def _choose_member(
    members: Mapping[str, type], base: Any, layers: Sequence[tuple[Any, str | None]], key: str,
    resolve: Any = None,
) -> type:
    tags = list(members)
    written = None  # (tag, source) of the last layer that names the member
    for data, source in layers:
        if not isinstance(data, Mapping):
            example = data if isinstance(data, str) and data in members else "<tag>"
            raise ConfigError(
                key,
                f"expected a mapping whose 'name' is one of [{', '.join(tags)}], got {data!r}; "
                f"to choose one, set {key}.name={example}",
                source,
            )
        if "name" in data:
            written = (data["name"], source)
    if written is None:
        if type(base) in members.values():
            return type(base)
        if base is dataclasses.MISSING or base is None or base == MISSING:
            raise ConfigError(
                _join(key, "name"), f"missing mandatory value; choose one of [{', '.join(tags)}]"
            )
        names = ", ".join(m.__name__ for m in members.values())
        raise ConfigError(key, f"expected one of {names}, got {type(base).__name__}")
    tag, source = written
    if isinstance(tag, str) and tag in members:
        return members[tag]
    if resolve is not None and isinstance(tag, str):
        member = resolve(tag)
        if member is not None:
            return member
    close = difflib.get_close_matches(str(tag), tags, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        _join(key, "name"), f"unknown tag {tag!r} (allowed: {', '.join(tags)}){hint}", source
    )


def _union_paths(choice: _Choice, path: str) -> list[tuple[str, type]]:
    """``(dotted key, chosen member)`` of every tagged union in ``choice``."""
    out = []
    for name, member, sub in choice:
        key = _join(path, name)
        if member is not None:
            out.append((key, member))
        out.extend(_union_paths(sub, key))
    return out


def _drop_tag(layer: DictConfig, path: str) -> None:
    """Deletes ``<path>.name`` from a layer: the chosen tag is already in the schema's base."""
    node: Any = layer
    for part in path.split("."):
        if (
            not isinstance(node, DictConfig)
            or part not in node.keys()
            or OmegaConf.is_interpolation(node, part)
        ):
            return
        node = node[part]
    if isinstance(node, DictConfig) and "name" in node.keys():
        del node["name"]


@functools.lru_cache(maxsize=None)
def _concrete_class(cls: type, choice: _Choice) -> type:
    """A frozen subclass of ``cls`` whose union fields are typed as the chosen members.

    Its field defaults are the base for :func:`load_config`: the field's own default if it is
    the chosen member, else the member's defaults.
    """
    if not choice:
        return cls
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    new_fields = []
    for name, member, sub in choice:
        if member is not None:
            tp: Any = _concrete_class(member, sub)
        else:
            section = _unwrap_optional(hints[name])
            tp = _concrete_class(section, sub)
            if section is not hints[name]:
                tp = typing.Optional[tp]
        factory = functools.partial(_concrete_default, fields[name], member, sub)
        # kw_only: a default here must not clash with fields without one that follow.
        new_fields.append(
            (name, tp, dataclasses.field(default_factory=factory, kw_only=True))
        )
    concrete = dataclasses.make_dataclass(cls.__name__, new_fields, bases=(cls,), frozen=True)
    concrete.__qualname__ = cls.__qualname__
    concrete.__module__ = cls.__module__
    return concrete


def _concrete_default(field: dataclasses.Field, member: type | None, sub: _Choice) -> Any:
    value = _field_default(field)
    if member is not None and type(value) is not member:
        value = member()
    if value is dataclasses.MISSING:
        return MISSING
    return _to_concrete(value, sub)


def _to_concrete(obj: Any, choice: _Choice) -> Any:
    """``obj`` (real classes) as an instance of its concrete class for ``choice``.

    A union whose value is not the chosen member restarts from the member's defaults.
    """
    if not choice or not dataclasses.is_dataclass(obj):
        return obj
    kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    for name, member, sub in choice:
        value = kwargs[name]
        if member is not None and type(value) is not member:
            value = member()
        kwargs[name] = _to_concrete(value, sub)
    return _concrete_class(type(obj), choice)(**kwargs)


def _to_real(obj: Any, cls: Any, choice: _Choice) -> Any:
    """The inverse of :func:`_to_concrete`: an instance of the real class ``cls``."""
    if not choice or obj is None or not dataclasses.is_dataclass(obj):
        return obj
    hints = _hints(cls)
    kwargs = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls) if f.init}
    for name, member, sub in choice:
        target = member if member is not None else _unwrap_optional(hints[name])
        kwargs[name] = _to_real(kwargs[name], target, sub)
    return cls(**kwargs)
