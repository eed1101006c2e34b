"""The errors rljax raises for bad input: a config key, a data file or row, a command-line value.

    raise UserError("data.path: no such file: data/trian.jsonl")

``rljax`` (``rljax.tools.cli.main``) prints a :class:`UserError`'s message alone, as the last line
``rljax <command>: error: <message>``, and exits with status 2 (``RLJAX_TRACEBACK=1`` shows the
traceback too); any other exception is a bug or a fault and keeps its traceback. So the message
must say everything: the key, file, row or flag, and what was expected. Both classes subclass the
built-in exception a caller would catch (``ValueError``, ``FileNotFoundError``).
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user; the message names the key, file, row or flag and what was expected."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist."""


__all__ = ["MissingFileError", "UserError"]
