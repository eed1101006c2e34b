"""The run directory: whether it holds a run, who is writing it, and what a resume may change.

    lock = RunDirLock(run_dir)                     # refused while another process holds it
    check_fresh(run_dir, resume=False, overwrite=False)   # refused: a previous run is there
    clear_run(run_dir)                             # --overwrite: rljax's files of the old run go
    config_differences(saved, config_dict(cfg))    # a resume refuses any listed difference

One run directory holds one run. A fresh run (no ``--resume``) into a directory that already holds
one -- a checkpoint step or a non-empty ``metrics.jsonl`` -- is refused, because it would mix the
two: the old checkpoints would sit beside (or be deleted by the retention of) the new ones, and
``metrics.jsonl`` would hold both. A ``config.yaml`` alone does not count: a run that failed before
its first logged line (a data or model error) leaves only that, and its fixed rerun must start.

A process that writes a run directory holds an exclusive ``fcntl.flock`` on ``RUN_DIR/.rljax.lock``
(with its pid, host and start time written inside for the message) from ``build_run`` until the run
ends. The kernel releases a flock when its holder dies, so the lock of a crashed run is free; the
details it left in the file show it was not released cleanly, and the next run says it takes it
over. (flock works per open file: a second ``RunDirLock`` on the same directory conflicts even in
the same process. On NFS, Linux emulates flock with POSIX byte-range locks, which NFS does lock.)

A resume continues the same run, so its config may differ from the checkpoint's only in the keys of
:data:`RESUMABLE_KEYS` (how long to train and how often to evaluate, save and log); every other
difference (learning rate, algorithm, seed, data, model ...) is refused, each listed as
``key: old -> new``.
"""

from __future__ import annotations

import datetime
import fcntl
import fnmatch
import json
import logging
import math
import os
import shutil
import socket
import weakref
from pathlib import Path
from typing import Any

import yaml

from rljax.config import to_yaml
from rljax.errors import UserError

logger = logging.getLogger(__name__)

LOCK_FILE = ".rljax.lock"
"""The lock file in a run directory (kept when the run ends, emptied; never a sign of a run)."""

RESUMABLE_KEYS = (
    "train.steps",  # train longer (a decaying learning-rate schedule is stretched to the new length)
    "train.eval_every",
    "train.save_every*",  # the step period and any time-based save setting (train.save_every_*)
    "train.samples_every",
    "train.tensorboard",
    "train.progress",
    "train.save_model",  # whether the end writes RUN_DIR/model (was algorithm.save_model: older checkpoints)
    "algorithm.save_model",
    "train.plot",
    "train.run_dir",  # the directory was moved
    "mesh.*",  # the devices: a run saved on one mesh resumes on another (checkpoints are sharded)
    "model.logits_chunk",  # how the same numbers are computed (memory, not maths)
    "model.remat",
    "model.attention_chunk",
)
"""Dotted config keys (``fnmatch`` patterns) a resume may change: they do not change what is trained."""

RUN_FILES = ("config.yaml", "config.yaml.tmp", "metrics.jsonl", "samples.jsonl", "summary.json", "eval_samples_step*.jsonl",
             "curves.png")
"""The files rljax writes in a run directory (``fnmatch`` patterns); ``--overwrite`` deletes these."""

RUN_DIRS = ("checkpoints", "tensorboard", "model", "adapter")
"""The folders rljax writes in a run directory; ``--overwrite`` deletes these."""


class RunDirError(UserError):
    """The run directory cannot be used as asked: it holds another run, another process is
    writing it, or a resume would change the run's config."""


def existing_run(run_dir: str | os.PathLike) -> list[str]:
    """What of a previous run ``run_dir`` holds, described for a message; empty if it holds none.

    A run is there when ``checkpoints/`` holds a step or ``metrics.jsonl`` is not empty
    (``config.yaml`` alone is not a run: see the module docstring).
    """
    run_dir = Path(run_dir)
    found = []
    steps = _checkpoint_steps(run_dir / "checkpoints")
    if steps:
        found.append(f"checkpoints at steps {steps}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        with open(metrics, encoding="utf-8", errors="replace") as f:
            lines = sum(1 for line in f if line.strip())
        found.append(f"metrics.jsonl with {lines} line(s)")
    if found and (run_dir / "config.yaml").is_file():
        found.append("config.yaml")
    return found


def check_fresh(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
    """Refuse a fresh run into a directory that holds one (``RunDirError`` naming the directory,
    what is there, and ``--resume`` / ``--overwrite``); ``resume`` and ``overwrite`` exclude each other."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other: --resume continues the run in "
                          f"{run_dir}, --overwrite deletes it and starts over")
    if resume or overwrite:
        return
    found = existing_run(run_dir)
    if found:
        raise RunDirError(f"run_dir {run_dir} already holds a run ({', '.join(found)}); pass --resume (resume=True) "
                          "to continue it, or --overwrite (overwrite=True) to delete it and start over, or set "
                          "train.run_dir to a new directory")


def clear_run(run_dir: str | os.PathLike) -> list[str]:
    """Delete what rljax writes in ``run_dir`` (:data:`RUN_FILES`, :data:`RUN_DIRS`); other files are
    left alone, logged and returned (their names, sorted). The lock file stays."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    left = []
    for entry in sorted(run_dir.iterdir()):
        name = entry.name
        if name == LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink() and name in RUN_DIRS:
            shutil.rmtree(entry)
        elif not entry.is_dir() and any(fnmatch.fnmatchcase(name, p) for p in RUN_FILES):
            entry.unlink()
        else:
            left.append(name)
    if left:
        logger.warning("--overwrite: left in %s what rljax did not write: %s", run_dir, ", ".join(left))
    return left


class RunDirLock:
    """An exclusive, non-blocking ``flock`` on ``RUN_DIR/.rljax.lock``, held until :meth:`release`,
    until the object is collected, or until the process ends (the kernel releases it then, even on
    SIGKILL, but leaves the details in the file: the next holder reports the take-over).

    Raises ``RunDirError`` ("run_dir X is in use by pid N on host H since T") when another process
    (or another ``RunDirLock`` in this one) holds it. A lock file left non-empty by a holder that
    died is taken over, with a log line naming that holder.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.run_dir.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+", encoding="utf-8")  # never truncates what a holder wrote
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = _describe(file.read())
            file.close()
            raise RunDirError(f"run_dir {self.run_dir} is in use by {holder}; wait for that run to end or stop it "
                              "(or set train.run_dir to another directory)") from None
        file.seek(0)
        previous = file.read().strip()
        if previous:
            logger.warning("run_dir %s: taking over the lock left by %s, which ended without releasing it",
                           self.run_dir, _describe(previous))
        file.seek(0)
        file.truncate()
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": started}) + "\n")
        file.flush()
        # released cleanly also when this object is collected or the interpreter exits without
        # release() (a trainer driven by step_once, never fit): only a killed process leaves details
        self._release = weakref.finalize(self, _release_file, file)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._release.alive

    def release(self) -> None:
        """Empty the lock file (a clean end) and unlock it; idempotent."""
        self._release()

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _release_file(file) -> None:
    try:
        file.seek(0)
        file.truncate()
        file.flush()
    finally:
        fcntl.flock(file.fileno(), fcntl.LOCK_UN)
        file.close()


def config_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as a plain, strictly JSON-serialisable dict (what a checkpoint stores):
    ``to_yaml``'s values, with a non-finite float written as the string ``"nan"``, ``"inf"`` or ``"-inf"``."""
    return _json_safe(yaml.safe_load(to_yaml(cfg)))


def config_differences(saved: dict[str, Any], new: dict[str, Any],
                       allowed: tuple[str, ...] = RESUMABLE_KEYS, *, defaults: dict[str, Any] | None = None) -> list[str]:
    """The differences between two :func:`config_dict` s outside ``allowed``, one ``key: old -> new``
    string each (dotted keys, sorted; a key one side lacks shows ``(absent)``).

    ``defaults`` (the :func:`config_dict` of the schema's defaults): a key the saved config lacks and
    the new one holds at its default is no difference: the setting is newer than the checkpoint, and
    its default is what the checkpoint was trained with (``model.param_dtype: null``, ``environment``)."""
    old_flat, new_flat = _flatten(saved), _flatten(new)
    default_flat = _flatten(defaults or {})
    lines = []
    for key in sorted(old_flat.keys() | new_flat.keys()):
        old, now = old_flat.get(key, _ABSENT), new_flat.get(key, _ABSENT)
        if old == now or any(fnmatch.fnmatchcase(key, pattern) for pattern in allowed):
            continue
        if old is _ABSENT and key in default_flat and now == default_flat[key]:
            continue
        lines.append(f"{key}: {_show(old)} -> {_show(now)}")
    return lines


_ABSENT = object()


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf'
    return value


def _checkpoint_steps(directory: Path) -> list[int]:
    """Step folders (orbax names them by their step) in a checkpoint directory, ascending."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def _describe(text: str) -> str:
    """'pid N on host H since T' from a lock file's contents."""
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']} since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "another process (it has not written its details yet)"


__all__ = ["LOCK_FILE", "RESUMABLE_KEYS", "RUN_DIRS", "RUN_FILES", "RunDirError", "RunDirLock", "check_fresh",
           "clear_run", "config_dict", "config_differences", "existing_run"]
