"""``rljax compare``: held-out metrics of a sweep's settings side by side, with paired differences.

    table = compare(["runs/sweeps/grpo_smollm2_arith"], baseline=None, metrics=None)

For each held-out metric (the ``eval/*`` keys of each run's ``metrics.jsonl``) and each setting:
the final value (the last logged one, after training) and the best one over the run's evaluations
(the minimum for a key naming a loss, the maximum otherwise), as mean ± std over seeds; and the
paired difference of the final value against a baseline setting (default: the sweep's first grid
combination), with a bootstrap confidence interval over seeds (:func:`paired_bootstrap`).

Runs are grouped into settings by the sweep's manifest (``sweep.json``); run directories given
directly are grouped by their name less a ``__seedN`` suffix, and their seed is read from their
``config.yaml`` (``train.seed``).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from rljax.errors import UserError
from rljax.metrics_log import METRICS_FILE, read_jsonl
from rljax.tools.reporting import markdown_table, mean_std, write_json


class CompareError(UserError):
    """Nothing to compare: a path that is neither a sweep nor a run directory, or an unknown metric or baseline."""


def paired_bootstrap(treatment: Sequence[float], baseline: Sequence[float], *, level: float = 0.95,
                     n_resamples: int = 10_000, seed: int = 0) -> dict:
    """The mean paired difference ``d_s = treatment_s − baseline_s`` over seeds ``s`` and its
    bootstrap percentile interval: resample the ``n`` pairs with replacement ``n_resamples`` times
    (``numpy.random.default_rng(seed)``), take each resample's mean difference, and report the
    ``(1 − level)/2`` and ``(1 + level)/2`` percentiles (Efron & Tibshirani 1993, ch. 13).

    Pairing by seed removes what two settings share at a seed (the data order, the initial
    samples). With few seeds the interval is wide and coarse (``n`` = 2 has only three resample
    means: ``d_1``, ``(d_1 + d_2)/2``, ``d_2``) and a percentile bootstrap under-covers; read it
    as a spread, not a test. Identical runs give ``[0, 0]``; a constant shift ``d`` gives ``[d, d]``.

    Returns ``{"n", "mean", "low", "high", "level", "differences"}`` (NaN mean and bounds for ``n`` = 0).
    """
    t, b = np.asarray(treatment, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if t.shape != b.shape or t.ndim != 1:
        raise ValueError(f"paired values need two equal-length 1-D sequences, got shapes {t.shape} and {b.shape}")
    d = t - b
    n = d.size
    if n == 0:
        return {"n": 0, "mean": math.nan, "low": math.nan, "high": math.nan, "level": level, "differences": []}
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, n, size=(n_resamples, n))].mean(axis=1)
    low, high = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return {"n": int(n), "mean": float(d.mean()), "low": float(low), "high": float(high), "level": level,
            "differences": d.tolist()}


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The lines of ``RUN_DIR/metrics.jsonl`` as dicts (``rljax.metrics_log.read_jsonl``: a torn line
    is skipped); none when the file is missing."""
    path = Path(run_dir) / METRICS_FILE
    return [row for row in read_jsonl(path) if isinstance(row, dict)] if path.is_file() else []


def final_and_best(rows: Sequence[dict], key: str) -> tuple[float, float] | None:
    """The last logged value of ``key`` and its best (min for a loss key, else max); None if never logged."""
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    if not values:
        return None
    best = min(values) if _lower_is_better(key) else max(values)
    return values[-1], best


def collect_runs(paths: Sequence[str]) -> tuple[list[dict], str | None]:
    """``[{"run_dir", "setting", "seed"}]`` from one sweep directory or several run directories, and
    the default baseline setting (the sweep's first grid combination, or the first run's setting)."""
    from rljax.tools.sweep import MANIFEST, read_manifest, setting_name, settings

    if len(paths) == 1 and (Path(paths[0]) / MANIFEST).is_file():
        manifest = read_manifest(paths[0])
        runs = [{"run_dir": str(Path(paths[0]) / r["run_dir"]), "setting": r["setting_name"], "seed": r["seed"],
                 "status": r.get("status")} for r in manifest["runs"]]
        for r in runs:  # what the manifest says may be stale (a run finished by hand): the directory decides
            r["status"] = "finished" if (Path(r["run_dir"]) / "summary.json").is_file() else r["status"]
        first = setting_name(settings(manifest.get("grid") or {})[0])
        return runs, first
    runs = []
    for path in paths:
        if not (Path(path) / "metrics.jsonl").is_file():
            raise CompareError(f"{path}: neither a sweep directory (no sweep.json) nor a run directory (no metrics.jsonl)")
        name = os.path.basename(os.path.normpath(path))
        runs.append({"run_dir": path, "setting": re.sub(r"__seed\d+$", "", name), "seed": _seed_of(path),
                     "status": "finished" if (Path(path) / "summary.json").is_file() else "not finished"})
    return runs, runs[0]["setting"] if runs else None


def compare(paths: Sequence[str], *, baseline: str | None = None, metrics: Sequence[str] | None = None,
            level: float = 0.95, n_resamples: int = 10_000) -> dict:
    """The comparison as a dict: ``{"baseline", "level", "n_resamples", "settings", "metrics": {key:
    {setting: {"seeds", "final", "best", "diff"}}}, "markdown"}`` (see the module docstring)."""
    listed, first = collect_runs(paths)
    # an unfinished run's last evaluation is not a final one (a failed run's may be the initial model's)
    runs = [r for r in listed if r["status"] == "finished"]
    left_out = [r for r in listed if r["status"] != "finished"]
    if not runs:
        raise CompareError(f"no finished runs to compare (left out: {', '.join(_show(r) for r in left_out)})")
    order = list(dict.fromkeys(r["setting"] for r in listed if r["setting"] in {x["setting"] for x in runs}))
    baseline = baseline or first
    if baseline not in order:
        raise CompareError(f"--baseline {baseline!r}: not one of the settings with a finished run {order}")
    rows_of = {r["run_dir"]: read_metrics(r["run_dir"]) for r in runs}
    found = sorted({k for rows in rows_of.values() for row in rows for k in row if k.startswith("eval/")})
    keys = list(metrics) if metrics else found
    unknown = [k for k in keys if k not in found]
    if unknown:
        raise CompareError(f"--metric {', '.join(unknown)}: not logged by these runs (held-out metrics: {found})")
    result: dict = {"baseline": baseline, "level": level, "n_resamples": n_resamples, "settings": order,
                    "runs": runs, "left_out": left_out, "metrics": {}}
    for key in keys:
        per_setting: dict = {}
        for setting in order:
            finals, bests = {}, {}
            for r in runs:
                got = final_and_best(rows_of[r["run_dir"]], key) if r["setting"] == setting else None
                if got is not None:
                    finals[r["seed"]], bests[r["seed"]] = got
            per_setting[setting] = {"seeds": sorted(finals), "final": [finals[s] for s in sorted(finals)],
                                    "best": [bests[s] for s in sorted(finals)]}
        base = per_setting[baseline]
        base_final = dict(zip(base["seeds"], base["final"]))
        for setting, entry in per_setting.items():
            if setting == baseline:
                continue
            seeds = [s for s in entry["seeds"] if s in base_final]
            mine = dict(zip(entry["seeds"], entry["final"]))
            entry["diff"] = paired_bootstrap([mine[s] for s in seeds], [base_final[s] for s in seeds],
                                             level=level, n_resamples=n_resamples)
        result["metrics"][key] = per_setting
    result["markdown"] = _markdown(result)
    return result


def write_compare(result: dict, out_dir: str | os.PathLike) -> tuple[Path, Path, Path]:
    """Write ``compare.md``, ``compare.json`` and ``curves.png`` (every run's curves overlaid, one
    line per run labelled ``setting seed N``: ``rljax.plots.plot_runs``) into ``out_dir``; returns
    their paths."""
    from rljax.plots import plot_runs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "compare.md", out / "compare.json"
    md.write_text(result["markdown"] + "\n")
    write_json(str(js), {k: v for k, v in result.items() if k != "markdown"})
    runs = result["runs"]
    png = plot_runs([r["run_dir"] for r in runs], out / "curves.png",
                    labels=[f"{r['setting']} seed {r['seed']}" for r in runs], title="held-out metrics")
    return md, js, png


def _markdown(result: dict) -> str:
    pct = f"{100 * result['level']:g}%"
    parts = [f"Baseline: `{result['baseline']}`. Final = the last evaluation; best = over the run's evaluations "
             f"(min for a loss, else max); mean ± sample std over seeds. Δ final = paired by seed, setting − "
             f"baseline, with a {pct} bootstrap percentile interval ({result['n_resamples']} resamples; few "
             f"seeds give wide, coarse intervals)."]
    if result["left_out"]:
        parts.append("Left out (not finished): " + ", ".join(_show(r) for r in result["left_out"]) + ".")
    for key, per_setting in result["metrics"].items():
        rows = []
        for setting, entry in per_setting.items():
            diff = entry.get("diff")
            if diff is None:
                shown = "(baseline)"
            elif diff["n"] == 0:
                shown = "n/a (no shared seeds)"
            else:
                shown = f"{diff['mean']:+.3g} [{diff['low']:+.3g}, {diff['high']:+.3g}] (n={diff['n']})"
            rows.append([f"`{setting}`", len(entry["seeds"]), mean_std(entry["final"]), mean_std(entry["best"]),
                         shown])
        parts.append(f"### {key}\n\n" + markdown_table(["setting", "seeds", "final", "best", f"Δ final [{pct} CI]"],
                                                       rows))
    return "\n\n".join(parts)


def _show(run: dict) -> str:
    return f"{os.path.basename(os.path.normpath(run['run_dir']))} ({run['status']})"


def _lower_is_better(key: str) -> bool:
    return "loss" in key.rsplit("/", 1)[-1]


def _seed_of(run_dir: str) -> int | None:
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    seed = (cfg.get("train") or {}).get("seed")
    return int(seed) if seed is not None else None


__all__ = ["CompareError", "collect_runs", "compare", "final_and_best", "paired_bootstrap", "read_metrics",
           "write_compare"]
