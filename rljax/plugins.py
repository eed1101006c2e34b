"""Code written outside rljax, named from YAML: ``module:name`` or ``path/to/file.py:name``.

    fn = load_object("rewards/format.py:format_reward", where="rewards.format")      # type: python rewards
    algo = load_object("my_algos.py:ALGORITHM", where="algorithm.name", what="algorithm")

``module:name`` imports a module from ``sys.path`` (the current directory is put on it);
``path/to/file.py:name`` loads that file (relative to the current directory), once per process.
``name`` may be dotted (``module:Class.method``). One loader for every extension point, so they
all read and fail the same way.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any

from rljax.errors import MissingFileError, UserError


def is_spec(text: Any) -> bool:
    """Whether ``text`` has the ``source:name`` shape of a reference to outside code."""
    if not isinstance(text, str) or ":" not in text:
        return False
    source, _, attr = text.rpartition(":")
    return bool(source) and bool(attr)


def load_object(spec: str, *, where: str, what: str = "function") -> Any:
    """The object ``spec`` names: ``module:name`` or ``path/to/file.py:name`` (see the module doc).

    ``where`` starts every error message (e.g. ``"rewards.accuracy"``) and ``what`` names the kind of
    object expected (``"function"``, ``"algorithm"``). Raises ``UserError`` (a ``MissingFileError``
    for a missing file) naming ``spec`` and what is wrong.
    """
    if not is_spec(spec):
        raise UserError(f"{where}: {what} must be 'module:name' or 'path/to/file.py:name', got {spec!r}")
    source, _, attr = spec.rpartition(":")
    if source.endswith(".py") or "/" in source or os.sep in source:
        module = _module_from_file(source, where=where, spec=spec, what=what)
    else:
        module = _import_module(source, where=where, spec=spec, what=what)
    obj = module
    for part in attr.split("."):  # "module:Class.method" works too
        try:
            obj = getattr(obj, part)
        except AttributeError:
            names = sorted(n for n in vars(module) if not n.startswith("_"))
            raise UserError(f"{where}: {what} {spec!r}: {source!r} has no attribute {attr!r}; it defines "
                            f"{', '.join(names[:20]) or '(nothing public)'}") from None
    return obj


def _import_module(name: str, *, where: str, spec: str, what: str):
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # `rljax train` (a console script) has the script's dir instead
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise UserError(f"{where}: {what} {spec!r}: no module named {exc.name!r} on the Python path "
                            f"(the current directory {cwd} is on it; a file is given as 'path/to/file.py:name')"
                            ) from None
        raise UserError(f"{where}: {what} {spec!r}: importing {name!r} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # the user's module raised at import: say so (RLJAX_TRACEBACK=1 shows where)
        raise UserError(f"{where}: {what} {spec!r}: importing {name!r} failed: {type(exc).__name__}: {exc}") from exc


def _module_from_file(path: str, *, where: str, spec: str, what: str):
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise MissingFileError(f"{where}: {what} {spec!r}: no such file: {path} (relative paths start at the "
                               f"current directory, {os.getcwd()})")
    # One module per file, under a name no import of the user's can clash with; registered in
    # sys.modules before it runs, as an import would be (dataclasses and pickle look it up there).
    stem = os.path.splitext(os.path.basename(full))[0]
    name = f"rljax_user_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, full)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"{where}: {what} {spec!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UserError(f"{where}: {what} {spec!r}: loading {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


__all__ = ["is_spec", "load_object"]
