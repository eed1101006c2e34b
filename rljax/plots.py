"""A PNG of a run's main curves from its ``metrics.jsonl``; several runs overlay.

    plot_runs(["runs/grpo", "runs/grpo_kl"], "curves.png")     # rljax plot runs/grpo runs/grpo_kl --out ...

Panels, each only where some run logged its key (offline runs have their own loss and accuracy
keys; whatever exists is shown), in this order:

* the training reward of each function and the total (``reward/<name>/mean``, ``reward/total/mean``);
* every held-out metric (``eval/*``, less the ``eval/<name>/missing`` fractions and the bounded
  verifiers' ``/timeouts``, ``/memory``, ``/crashes`` counts);
* the KL to the reference (``kl``, else ``kl/mean``), the policy's entropy (``entropy``, else
  ``policy/entropy``), the completion length (``completions/mean_length``, else
  ``completion/mean_length``), ``loss``, ``grad_norm``;
* offline runs' training accuracies and margins (keys ending in ``accuracy``, ``margin`` or ``margins``).

x is the step; a run is one colour in every panel, labelled by its directory's name. Reads files
only (no training imports); matplotlib is imported when a plot is drawn, with no pyplot and so no
global backend: the figure renders with Agg whatever backend the caller uses.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from rljax.errors import MissingFileError, UserError
from rljax.metrics_log import METRICS_FILE, read_jsonl

__all__ = ["CURVES_FILE", "plot_runs", "plot_keys"]

CURVES_FILE = "curves.png"

# one panel each: the first of the keys that a run logged (TRL's name first, then rljax's)
_FIXED_PANELS = (
    ("KL to the reference", ("kl", "kl/mean")),
    ("entropy", ("entropy", "policy/entropy")),
    ("completion length (tokens)", ("completions/mean_length", "completion/mean_length")),
    ("loss", ("loss",)),
    ("grad norm", ("grad_norm",)),
)


_COUNTS = ("/missing", "/timeouts", "/memory", "/crashes")


def plot_keys(records_per_run: Sequence[Sequence[dict[str, Any]]]) -> list[tuple[str, tuple[str, ...]]]:
    """The panels ``plot_runs`` draws for these runs' records: ``(title, keys)``, a run's curve in
    a panel being the first of ``keys`` that it logged (see the module docstring)."""
    seen: dict[str, None] = {}
    for records in records_per_run:
        for record in records:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    seen.setdefault(key, None)
    keys = list(seen)
    rewards = [k for k in keys if k.startswith("reward/") and k.endswith("/mean")]
    rewards.sort(key=lambda k: k == "reward/total/mean")  # the functions, then their total
    # not the bounded verifiers' counters (eval/<name>/timeouts, /memory, /crashes: 0 in a healthy run)
    held_out = [k for k in keys if k.startswith("eval/") and not k.endswith(_COUNTS)]
    panels = [(k, (k,)) for k in rewards + held_out]
    panels += [(title, options) for title, options in _FIXED_PANELS if any(k in seen for k in options)]
    offline = [k for k in keys if not k.startswith(("eval/", "reward/")) and k.endswith(("accuracy", "margin", "margins"))]
    panels += [(k, (k,)) for k in offline]
    return panels


def plot_runs(run_dirs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
              labels: Sequence[str] | None = None, title: str | None = None) -> pathlib.Path:
    """Draw the main curves of ``run_dirs`` (their ``metrics.jsonl``) into the PNG ``out``.

    Args:
      run_dirs: run directories; several overlay, one colour each.
      out: the PNG's path (its directory is created).
      labels: one legend label per run (default: each directory's name).
      title: the figure's title (default none).

    Returns:
      ``out`` as a ``pathlib.Path``.

    Raises:
      UserError: no run given, a directory without ``metrics.jsonl`` (``MissingFileError``), a
        ``metrics.jsonl`` with no record, ``labels`` of another length, or nothing to plot; the
        message names the path.
    """
    run_dirs = [pathlib.Path(d) for d in run_dirs]
    if not run_dirs:
        raise UserError("plot: no run directory given")
    if labels is not None and len(labels) != len(run_dirs):
        raise UserError(f"plot: {len(labels)} labels for {len(run_dirs)} run directories")
    labels = [d.resolve().name or str(d) for d in run_dirs] if labels is None else list(labels)
    records_per_run = [_records(d) for d in run_dirs]
    panels = plot_keys(records_per_run)
    if not panels:
        raise UserError(f"plot: nothing to plot in {', '.join(str(d / METRICS_FILE) for d in run_dirs)} "
                        "(no reward, eval/*, loss, KL, entropy, length or grad-norm key)")
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _draw(records_per_run, labels, panels, out, title)
    return out


def _records(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        what = "no such directory" if not run_dir.exists() else f"no {METRICS_FILE} in it"
        raise MissingFileError(f"plot: {run_dir}: {what} (a run directory holds {METRICS_FILE})")
    records = [r for r in read_jsonl(path) if isinstance(r, dict) and isinstance(r.get("step"), int)]
    if not records:
        raise UserError(f"plot: {path} has no metrics record (the run logged nothing yet?)")
    return records


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _draw(records_per_run, labels, panels, out: pathlib.Path, title: str | None) -> None:
    from matplotlib.figure import Figure  # lazy: no matplotlib import for training or the CLI's start

    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    legend = len(records_per_run) > 1
    # fixed margins in inches (a constrained layout doubles the drawing time)
    top_in, bottom_in = 0.35 + (0.35 if title else 0), 0.45 + (0.35 if legend else 0)
    height = 2.9 * rows + top_in + bottom_in
    fig = Figure(figsize=(4.6 * columns, height))
    fig.subplots_adjust(left=0.55 / (4.6 * columns), right=0.98, top=1 - top_in / height, bottom=bottom_in / height,
                        hspace=0.45, wspace=0.25)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    colours = [f"C{i % 10}" for i in range(len(records_per_run))]
    for ax, (panel_title, options) in zip(axes, panels):
        for records, label, colour in zip(records_per_run, labels, colours):
            key = next((k for k in options if any(k in r for r in records)), None)
            if key is None:
                continue
            steps, values = _series(records, key)
            if steps:
                ax.plot(steps, values, color=colour, label=label, marker="o" if len(steps) <= 20 else None,
                        markersize=3, linewidth=1.2)
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if legend:  # one legend for the figure: every run with its colour
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=c, linewidth=2) for c in colours]
        fig.legend(handles, labels, loc="lower center", ncols=min(len(labels), 4), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, y=1 - 0.12 / height, va="top")
    fig.savefig(out, format="png", dpi=90)
