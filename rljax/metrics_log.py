"""Run logging: per-step metrics and generated samples as JSON lines, TensorBoard, a progress bar.

(Named ``metrics_log`` rather than ``logging`` so it is never confused with -- or, when a file in
``rljax/`` is run as a script, imported instead of -- the standard library's ``logging``.)

A run directory gets:

* ``metrics.jsonl``: one line per :meth:`MetricsLogger.log` call,
  ``{"step": 12, "time": 1712345678.123, "loss": 0.53, "reward/mean": 0.25, ...}``
  (``time`` is Unix wall-clock seconds). This file is the record of the run; plots and tables are
  made from it (:func:`read_jsonl`).
* ``samples.jsonl``: one line per generated sample from :meth:`MetricsLogger.log_samples`,
  ``{"step": 12, "prompt": "...", "completion": "...", "reward/math": 1.0, ...}``.
* ``tensorboard/``: the same scalars as TensorBoard events, when ``tensorboard=True``.

Non-finite numbers (NaN, +inf, -inf) are written as JSON ``null``, so every line is strict JSON
(RFC 8259) that ``jq``, pandas (``pd.read_json(path, lines=True)`` reads null as NaN) and any
JSON library accept. TensorBoard receives the actual non-finite value.

Every line is flushed to the OS as it is written, so a crash loses nothing already logged. On
resume, open the same run directory (files are appended to) and call
:meth:`MetricsLogger.truncate_after` with the restored checkpoint's step: lines for steps after it
came from the lost part of the crashed run and are dropped (TensorBoard events too, via
``purge_step``), so the logs read as one uninterrupted run.

In a multi-host run only process 0 writes (``active`` defaults to ``jax.process_index() == 0``);
on the other processes every method is a no-op, so the trainer needs no ``if``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MetricsLogger", "read_jsonl", "METRICS_FILE", "SAMPLES_FILE", "TENSORBOARD_DIR"]

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED_METRIC_KEYS = ("step", "time")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a torn (unparseable) line, e.g. from a crash, is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class MetricsLogger:
    """Writes a run's metrics and samples (see module docstring).

    Args:
      run_dir: the run directory (created if missing; existing files are appended to).
      tensorboard: also write TensorBoard scalars to ``run_dir/tensorboard``.
      total_steps: the run's last step, for the progress bar's percentage and ETA.
      progress: show a tqdm progress bar (on stderr). Tests pass ``False``.
      keys_in_bar: metric keys shown next to the bar when present in a logged step.
      active: whether this process writes; default ``jax.process_index() == 0``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = False,
        total_steps: int | None = None,
        progress: bool = True,
        keys_in_bar: Sequence[str] = ("loss",),
        active: bool | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.active = jax.process_index() == 0 if active is None else active
        self._keys_in_bar = tuple(keys_in_bar)
        self._use_tensorboard = tensorboard
        self._metrics_file: IO[str] | None = None
        self._samples_file: IO[str] | None = None
        self._tb: Any = None  # opened at the first log, so a resume's purge marker goes first
        self._tb_purge_step: int | None = None
        self._tb_writers_opened = 0
        self._bar: Any = None
        self._total_steps = total_steps
        self._progress = progress
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._open_files()
        self._open_bar(initial=0)

    @property
    def progress_bar(self) -> Any:
        """The tqdm bar (``n``: the last logged step; ``total``; ``postfix``), None without one.

        There is none with ``progress=False`` or in an inactive process.
        """
        return self._bar

    # ------------------------------------------------------------------------- writing

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records scalar ``metrics`` for ``step``: one JSON line, TensorBoard, the progress bar.

        Values may be Python, NumPy or JAX scalars (fetched from device in one transfer).
        Integer values stay integers, everything else becomes float.

        Raises:
          ValueError: a value is not a scalar, or a key is reserved (``step``, ``time``).
        """
        if not self.active:
            return
        step = int(step)
        host_metrics = jax.device_get(dict(metrics))
        record: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        scalars: dict[str, float] = {}
        for key, value in host_metrics.items():
            if key in _RESERVED_METRIC_KEYS:
                raise ValueError(f"metric key {key!r} is reserved by the metrics log")
            number = _to_scalar(key, value)
            scalars[key] = float(number)
            record[key] = _json_number(number)
        assert self._metrics_file is not None
        _write_line(self._metrics_file, record)
        if self._use_tensorboard:
            if self._tb is None:
                self._open_tensorboard()
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._bar is not None:
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            shown = {k: f"{scalars[k]:.4g}" for k in self._keys_in_bar if k in scalars}
            if shown:
                self._bar.set_postfix(shown, refresh=False)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Appends one JSON line ``{"step": step, **row}`` per row to ``samples.jsonl``.

        A row holds e.g. ``prompt``, ``completion`` and each reward; values may be strings,
        numbers, NumPy/JAX arrays (written as lists) and nested lists/dicts.
        """
        if not self.active:
            return
        assert self._samples_file is not None
        for row in rows:
            if "step" in row:
                raise ValueError("a sample row may not have a 'step' key; it is added by the log")
            record = {"step": int(step), **_to_json(jax.device_get(dict(row)))}
            self._samples_file.write(json.dumps(record, ensure_ascii=False, allow_nan=False))
            self._samples_file.write("\n")
        self._samples_file.flush()

    def write(self, message: str) -> None:
        """Prints a line (e.g. evaluation results) without breaking the progress bar."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    # ------------------------------------------------------------------------- resume / close

    def truncate_after(self, step: int) -> None:
        """Drops metric and sample lines with a step greater than ``step`` (and torn lines).

        Call on resume with the restored checkpoint's step, before logging. TensorBoard events
        after ``step`` are hidden by a ``purge_step`` marker, and the progress bar restarts at
        ``step`` (so the ETA counts only the steps this process runs).
        """
        if not self.active:
            return
        self._close_files()
        for name in (METRICS_FILE, SAMPLES_FILE):
            path = self.run_dir / name
            if path.exists():
                _truncate_jsonl(path, step)
        self._open_files()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._tb_purge_step = step + 1
        if self._bar is not None:
            self._bar.close()
        self._open_bar(initial=step)

    def close(self) -> None:
        """Flushes and closes the files, the TensorBoard writer and the progress bar."""
        self._close_files()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- helpers

    def _open_files(self) -> None:
        self._metrics_file = _open_append(self.run_dir / METRICS_FILE)
        self._samples_file = _open_append(self.run_dir / SAMPLES_FILE)

    def _close_files(self) -> None:
        for f in (self._metrics_file, self._samples_file):
            if f is not None:
                f.close()
        self._metrics_file = self._samples_file = None

    def _open_bar(self, initial: int) -> None:
        if self._progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self._total_steps, initial=initial, unit="step", dynamic_ncols=True
            )

    def _open_tensorboard(self) -> None:
        SummaryWriter = _import_summary_writer()
        self._tb_writers_opened += 1
        self._tb = SummaryWriter(
            str(self.run_dir / TENSORBOARD_DIR),
            purge_step=self._tb_purge_step,
            flush_secs=30,
            # Event file names hold only a timestamp in seconds and the host name; a writer
            # reopened within the same second would overwrite the previous file.
            filename_suffix=f".{os.getpid()}.{self._tb_writers_opened}",
        )


def _import_summary_writer() -> Any:
    """``tensorboardX.SummaryWriter``, imported without importing torch.

    ``tensorboardX.writer`` runs ``try: import torch`` at import time, only to recognise torch
    tensors. With torch installed (the test and bench extras) that costs seconds and loads torch
    into a process that never uses it (rljax does not import torch), so the import is made with
    torch hidden, unless torch or tensorboardX is already loaded. Scalars never need torch.
    """
    if "torch" in sys.modules or "tensorboardX.writer" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keeps the lines (byte for byte) whose record has ``step <= step``; drops torn lines."""
    tmp = path.with_name(path.name + ".tmp")
    with open(path, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
        for line in src:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("step", -math.inf) <= step:
                dst.write(line if line.endswith("\n") else line + "\n")
    os.replace(tmp, path)


def _open_append(path: Path) -> IO[str]:
    # A crash can leave a final line without its newline; start on a fresh line so the next
    # record is not glued to the torn one.
    needs_newline = False
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            needs_newline = f.read(1) != b"\n"
    f = open(path, "a", encoding="utf-8")
    if needs_newline:
        f.write("\n")
        f.flush()
    return f


def _write_line(f: IO[str], record: Mapping[str, Any]) -> None:
    f.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
    f.flush()


def _to_scalar(key: str, value: Any) -> int | float:
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    array = np.asarray(value)
    # jnp.issubdtype also knows the ml_dtypes types (bfloat16, float8), which NumPy's does not.
    if array.ndim != 0 or not (
        jnp.issubdtype(array.dtype, jnp.floating)
        or jnp.issubdtype(array.dtype, jnp.integer)
        or array.dtype == np.bool_
    ):
        raise ValueError(
            f"metric {key!r} must be a real scalar, got {array.dtype}{list(array.shape)}"
        )
    if not jnp.issubdtype(array.dtype, jnp.floating):
        return int(array)
    return float(array)


def _json_number(x: int | float) -> int | float | None:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _to_json(value: Any) -> Any:
    """Plain JSON types for a sample row: arrays to lists, non-finite floats to None."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return _to_json(value.tolist())
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return _json_number(value)
    raise TypeError(f"cannot write a {type(value).__name__} to samples.jsonl")
