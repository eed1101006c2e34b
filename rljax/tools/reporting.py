"""Reporting for experiments, reproductions and benchmarks: tables, run metadata, mean ± std.

One way to write what a run produced, shared by ``paper_repro/`` and ``experiments/``:

- ``markdown_table(headers, rows)``: a GitHub markdown table (floats to 3 significant digits).
- ``mean_std(values)``: ``"0.412 ± 0.031 (n=3)"`` (sample std, ddof=1; ``n=1`` has no ± part).
- ``environment()``: package versions and hardware facts to keep beside the numbers.
- ``save_run_metadata(run_dir, config)``: ``config.json`` and ``environment.json`` in ``run_dir``.
- ``write_json(path, obj)``: indented JSON, parent folders created.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import subprocess
from typing import Any, Sequence

import numpy as np

_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "transformers",
             "tokenizers", "datasets", "gguf", "math-verify", "reasoning-gym", "vaderSentiment",
             "omegaconf", "matplotlib", "torch", "trl", "rljax")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; floats print with 3 significant digits (whole numbers from 100 up)."""

    def fmt(v):
        if isinstance(v, (float, np.floating)):
            v = float(v)
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def mean_std(values: Sequence[float], digits: int = 3) -> str:
    """``"mean ± std (n=k)"`` with the sample standard deviation; NaNs are dropped and counted out."""
    x = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if x.size == 0:
        return "n/a"
    if x.size == 1:
        return f"{x[0]:.{digits}g} (n=1)"
    return f"{x.mean():.{digits}g} ± {x.std(ddof=1):.{digits}g} (n={x.size})"


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """Installed versions of the packages that shape the numbers, the JAX backend and the hardware."""
    import jax

    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "git_commit": _git_commit(),
        "packages": versions,
    }


def write_json(path: str, obj: Any) -> None:
    """``obj`` as indented JSON at ``path`` (dataclasses become dicts; unknown types become strings)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def default(o):
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return dataclasses.asdict(o)
        if isinstance(o, (np.integer, np.floating)):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        return str(o)

    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=default)
        f.write("\n")


def save_run_metadata(run_dir: str, config: Any) -> None:
    """Write ``run_dir/config.json`` (the settings as given) and ``run_dir/environment.json``."""
    write_json(os.path.join(run_dir, "config.json"), config)
    write_json(os.path.join(run_dir, "environment.json"), environment())
