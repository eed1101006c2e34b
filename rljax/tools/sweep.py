"""``rljax sweep``: every combination of a grid of config values, times seeds, into one directory.

    plan = plan_sweep("configs/grpo_smollm2_arith.yaml", grid={"algorithm.reduction": ["token_mean",
                      "seq_mean_token_mean"]}, seeds=[0, 1, 2], out="runs/sweeps/grpo_smollm2_arith")
    results = run_sweep(plan)          # each run: python -m rljax train CONFIG ... in a subprocess

The sweep directory holds one run directory per (setting, seed), named for both
(``algorithm.reduction=token_mean__seed0``), and ``sweep.json``: the config (path and SHA-256),
the grid, the seeds, the shared overrides and, per run, its directory, setting, seed and status.

Resuming is re-running the same command. Each run directory is classified before anything runs:

- ``finished``: ``summary.json`` is there and its ``steps`` reach the setting's ``train.steps``.
  ``fit`` writes ``summary.json`` last, after the final checkpoint is committed
  (rljax/training/loop.py), so its presence means the run ended cleanly; comparing its step count
  with ``train.steps`` keeps a run trained to fewer steps (an earlier, shorter sweep) from counting.
  Finished runs are skipped: their files are not touched.
- ``interrupted``: a checkpoint step is there but the run is not finished (killed, preempted,
  failed after a save): it continues with ``rljax train --resume``.
- ``failed_early``: logged metrics but no checkpoint (it failed before its first save): nothing to
  resume, so it starts over with ``--overwrite``.
- ``missing``: nothing of a run there: a fresh start.

A different config (path or contents), grid or overrides for an existing sweep directory is
refused (:class:`SweepError`) unless ``overwrite``, which deletes the runs the old manifest lists
and starts over. Changing only the seeds is allowed: the sweep grows (or the listed runs shrink),
and runs of seeds no longer asked for are left on disk and kept in the manifest.

Why a subprocess per run rather than a loop in this process: a run that crashes the interpreter
(XLA abort, segfault, out of memory) or raises is recorded as ``failed`` with its exit status and
the sweep goes on; no process-wide state leaks from one run to the next (registered rewards,
signal handlers, JAX's compiled-program caches, which grow without bound over many runs); and each
run's output goes to its own ``RUN_DIR/sweep.log``. The cost, a fresh interpreter and compile per
run (seconds), is small beside a training run. Ctrl-C (or SIGTERM) reaches the run in progress,
which saves a checkpoint and exits with ``128 + signal``; the sweep records it as interrupted and
stops, and the same command continues it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from rljax.errors import UserError

MANIFEST = "sweep.json"
"""The manifest's file name in a sweep directory."""

LOG_FILE = "sweep.log"
"""A run's stdout and stderr under ``rljax sweep`` (appended to on each attempt), in its run directory."""


class SweepError(UserError):
    """A sweep cannot run as asked: a bad grid or seed list, or a sweep directory holding another sweep."""


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: its setting (grid key -> value text), seed, directory name and ``train.steps``."""

    name: str
    setting_name: str
    setting: dict[str, str]
    seed: int
    steps: int


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """What a sweep runs: built (and every setting's config validated) by :func:`plan_sweep`."""

    config: str
    grid: dict[str, list[str]]
    seeds: list[int]
    overrides: list[str]
    out: str
    runs: list[PlannedRun]
    config_sha256: str


def parse_grid(specs: Sequence[str]) -> dict[str, list[str]]:
    """``["KEY=V1,V2", ...]`` -> ``{KEY: [V1, V2]}`` in the given order. Values are split at commas
    (a value cannot hold one) and passed on as ``KEY=VALUE`` overrides, parsed as the command line's."""
    grid: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise SweepError(f"--grid {spec!r}: expected KEY=V1,V2,... (e.g. algorithm.reduction=token_mean,"
                             "seq_mean_token_mean)")
        if key in grid:
            raise SweepError(f"--grid {key} is given twice; list all its values in one --grid {key}=V1,V2")
        if key == "train.seed" or key == "train.run_dir":
            raise SweepError(f"--grid {key}: the sweep sets it (seeds with --seeds, run directories under --out)")
        items = [v.strip() for v in values.split(",")]
        if any(not v for v in items) or len(set(items)) != len(items):
            raise SweepError(f"--grid {spec!r}: values must be non-empty and distinct")
        grid[key] = items
    return grid


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]`` (distinct non-negative integers, in the given order)."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {text!r}: seeds must be distinct and >= 0")
    return seeds


def settings(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination of the grid's values (the first key varies slowest); ``[{}]`` for no grid."""
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def setting_name(setting: dict[str, str]) -> str:
    """A readable, filesystem-safe name: ``KEY=VALUE`` pairs joined by ``__`` with the key's last
    dotted part (``reduction=token_mean__epsilon_high=0.2``); ``base`` for the empty setting.
    Characters other than letters, digits and ``. _ = + -`` become ``_``."""
    if not setting:
        return "base"
    text = "__".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in setting.items())
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text)


def run_name(setting: dict[str, str], seed: int) -> str:
    """The run directory's name: ``{setting_name}__seed{seed}``."""
    return f"{setting_name(setting)}__seed{seed}"


def default_out(config: str) -> str:
    """``runs/sweeps/<config file stem>``."""
    return os.path.join("runs", "sweeps", Path(config).stem)


def plan_sweep(config: str, *, grid: dict[str, list[str]], seeds: Sequence[int], overrides: Sequence[str] = (),
               out: str | None = None) -> SweepPlan:
    """Check the sweep and return its plan: every setting's config is loaded with its overrides (so a
    bad key or value fails here, naming it, before anything trains) and the run names are unique."""
    from rljax.config import load_config
    from rljax.run_config import RunConfig

    if not os.path.isfile(config):
        raise SweepError(f"config {config}: no such file")
    if not seeds:
        raise SweepError("--seeds: give at least one seed")
    short = [k.rsplit(".", 1)[-1] for k in grid]
    if len(set(short)) != len(short):
        # names use a key's last part; two keys sharing it would make names that hide which is which
        raise SweepError(f"--grid keys {list(grid)} share a last part; run directory names would be ambiguous")
    runs, seen = [], {}
    for setting in settings(grid):
        cfg = load_config(RunConfig, config, [*overrides, *(f"{k}={v}" for k, v in setting.items())])
        for seed in seeds:
            name = run_name(setting, seed)
            if name in seen:
                raise SweepError(f"settings {seen[name]} and {setting} give the same run directory name {name}")
            seen[name] = setting
            runs.append(PlannedRun(name=name, setting_name=setting_name(setting), setting=dict(setting),
                                   seed=int(seed), steps=int(cfg.train.steps)))
    with open(config, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return SweepPlan(config=config, grid={k: list(v) for k, v in grid.items()}, seeds=[int(s) for s in seeds],
                     overrides=list(overrides), out=out or default_out(config), runs=runs, config_sha256=digest)


def run_status(run_dir: str | os.PathLike, steps: int) -> str:
    """``finished`` | ``interrupted`` | ``failed_early`` | ``missing`` (module docstring)."""
    from rljax.training.run_dir import existing_run

    run_dir = Path(run_dir)
    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            with open(summary) as f:
                done = int(json.load(f).get("steps", -1))
        except (ValueError, OSError, TypeError, AttributeError):
            done = -1
        if done >= steps:
            return "finished"
    found = existing_run(run_dir) if run_dir.is_dir() else []
    if any(item.startswith("checkpoints") for item in found):
        return "interrupted"
    return "failed_early" if found else "missing"


def train_argv(plan: SweepPlan, run: PlannedRun, status: str) -> list[str]:
    """The ``rljax train`` arguments of one run (after ``rljax``): shared overrides, the setting, the
    seed and run directory; ``--resume`` for an interrupted run, ``--overwrite`` after an early failure."""
    run_dir = os.path.join(plan.out, run.name)
    argv = ["train", plan.config, *plan.overrides, *(f"{k}={v}" for k, v in run.setting.items()),
            f"train.seed={run.seed}", f"train.run_dir={run_dir}", "train.progress=false"]
    if status == "interrupted":
        argv.append("--resume")
    elif status == "failed_early":
        argv.append("--overwrite")
    return argv


def subprocess_runner(argv: list[str], log_path: str) -> int:
    """Run ``python -m rljax *argv`` with this process's interpreter and rljax, its output
    appended to ``log_path``; returns the exit status. Waits for the child on Ctrl-C (the child got
    the signal too and is saving a checkpoint) and returns its status."""
    import rljax

    env = dict(os.environ)
    root = str(Path(rljax.__file__).resolve().parent.parent)  # the same rljax as this process's
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    stopped: list[int] = []
    with open(log_path, "a") as log:
        log.write(f"\n# {time.strftime('%Y-%m-%d %H:%M:%S')} rljax {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", "rljax", *argv], stdout=log, stderr=subprocess.STDOUT,
                                env=env)

        def forward(signum, frame):  # SIGTERM (a scheduler) or SIGHUP (a closed terminal) to the sweep:
            stopped.append(signum)   # the run saves and stops too
            proc.send_signal(signum)

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(s) is not signal.SIG_IGN:  # nohup: SIGHUP stays ignored
                    previous[s] = signal.signal(s, forward)
        try:
            while True:
                try:
                    code = proc.wait()
                    break
                except KeyboardInterrupt:  # Ctrl-C reached the child too: it saves and exits with 130
                    stopped.append(signal.SIGINT)
        finally:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
    # a stop asked of the sweep stops the sweep, however the run ended (a second Ctrl-C ends it unsaved)
    return 128 + int(stopped[0]) if stopped and code != 0 else code


Runner = Callable[[list[str], str], int]


def run_sweep(plan: SweepPlan, *, overwrite: bool = False, runner: Runner | None = None,
              echo: Callable[[str], None] = print) -> list[dict]:
    """Run the plan's runs that are not finished; returns the manifest's run records (also written to
    ``OUT/sweep.json`` after each run). A run ending with ``128 + SIGINT/SIGTERM/SIGHUP`` stops the sweep
    (status ``interrupted``); any other non-zero exit is recorded as ``failed`` and the sweep goes on.
    ``runner(argv, log_path) -> exit status`` runs one ``rljax train`` (default :func:`subprocess_runner`)."""
    runner = runner or subprocess_runner
    out = Path(plan.out)
    manifest_path = out / MANIFEST
    old = _read_manifest(manifest_path)
    if old is not None:
        mismatch = _mismatch(old, plan)
        if mismatch and not overwrite:
            raise SweepError(f"{out} holds another sweep ({'; '.join(mismatch)}); pass --overwrite to delete its "
                             "runs and start over, or choose another --out")
        if overwrite:
            for record in old.get("runs", []):
                shutil.rmtree(out / record["run_dir"], ignore_errors=True)
            old = None
    elif overwrite and out.is_dir():
        for run in plan.runs:
            shutil.rmtree(out / run.name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    planned = {run.name for run in plan.runs}
    kept = [r for r in (old or {}).get("runs", []) if r["run_dir"] not in planned]  # seeds no longer asked for
    records = {run.name: _record(run, run_status(out / run.name, run.steps)) for run in plan.runs}
    previous = {r["run_dir"]: r for r in (old or {}).get("runs", [])}

    def write():
        _write_json(manifest_path, _manifest(plan, kept + list(records.values())))

    write()
    total = len(plan.runs)
    for i, run in enumerate(plan.runs, 1):
        record, status = records[run.name], records[run.name]["status"]
        label = f"[{i}/{total}] {run.name}"
        if status == "finished":
            echo(f"{label}: finished, skipped")
            continue
        before = previous.get(run.name, {}).get("status")
        action = {"interrupted": "resuming", "failed_early": "starting over"}.get(status, "starting")
        echo(f"{label}: {action}" + (f" (was {before})" if before and before != status else ""))
        (out / run.name).mkdir(parents=True, exist_ok=True)
        log = str(out / run.name / LOG_FILE)
        record.update(status="running")
        write()
        start = time.monotonic()
        code = runner(train_argv(plan, run, status), log)
        seconds = round(time.monotonic() - start, 1)
        now = run_status(out / run.name, run.steps)
        if code == 0 and now == "finished":
            record.update(status="finished", returncode=0, seconds=seconds)
            echo(f"{label}: finished in {seconds:.0f} s")
        elif code in (129, 130, 143):  # 128 + SIGHUP / SIGINT / SIGTERM: the run saved a checkpoint and stopped
            record.update(status="interrupted", returncode=code, seconds=seconds)
            write()
            echo(f"{label}: interrupted (exit {code}); run the same command again to continue")
            return list(records.values())
        else:
            reason = f"exit {code}" if code else f"exit 0 but not finished ({now})"
            record.update(status="failed", returncode=code, seconds=seconds, error=_last_line(log))
            echo(f"{label}: failed ({reason}); see {log}: {record['error']}")
        write()
    return kept + list(records.values())


def sweep_failures(records: Sequence[dict]) -> list[dict]:
    """The records whose status is not ``finished``."""
    return [r for r in records if r.get("status") != "finished"]


def read_manifest(sweep_dir: str | os.PathLike) -> dict:
    """``SWEEP_DIR/sweep.json`` as a dict (``SweepError`` if there is none)."""
    manifest = _read_manifest(Path(sweep_dir) / MANIFEST)
    if manifest is None:
        raise SweepError(f"{sweep_dir}: no {MANIFEST} (not a sweep directory)")
    return manifest


def _record(run: PlannedRun, status: str) -> dict:
    return {"run_dir": run.name, "setting_name": run.setting_name, "setting": run.setting, "seed": run.seed,
            "steps": run.steps, "status": status}


def _manifest(plan: SweepPlan, records: list[dict]) -> dict:
    return {"config": plan.config, "config_sha256": plan.config_sha256, "grid": plan.grid, "seeds": plan.seeds,
            "overrides": plan.overrides, "runs": records}


def _mismatch(old: dict, plan: SweepPlan) -> list[str]:
    found = []
    if os.path.abspath(old.get("config", "")) != os.path.abspath(plan.config):
        found.append(f"config {old.get('config')} -> {plan.config}")
    elif old.get("config_sha256") != plan.config_sha256:
        found.append(f"{plan.config} has changed since the sweep started")
    if old.get("grid") != plan.grid:
        found.append(f"grid {json.dumps(old.get('grid'))} -> {json.dumps(plan.grid)}")
    if old.get("overrides") != plan.overrides:
        found.append(f"overrides {old.get('overrides')} -> {plan.overrides}")
    return found


def _read_manifest(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as err:
        raise SweepError(f"{path}: not readable JSON ({err}); delete it or pass --overwrite") from None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")  # a sweep killed mid-write leaves the previous manifest whole
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _last_line(log_path: str) -> str:
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


__all__ = ["LOG_FILE", "MANIFEST", "PlannedRun", "SweepError", "SweepPlan", "default_out", "parse_grid",
           "parse_seeds", "plan_sweep", "read_manifest", "run_name", "run_status", "run_sweep", "setting_name",
           "settings", "subprocess_runner", "sweep_failures", "train_argv"]
