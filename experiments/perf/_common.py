"""Helpers shared by the side-by-side benchmarks in ``experiments/perf/``.

- ``thread_count`` / ``set_torch_threads``: the CPU thread count JAX's CPU backend uses, and the
  same count for torch, so a JAX-vs-torch comparison runs both on the same cores.
- ``time_call``: wall-clock seconds of a call, with ``jax.block_until_ready`` on its result.
- ``matmul_gflops`` / ``matmul_peaks``: achieved float32 matmul GFLOP/s of a jitted ``x @ w`` on a
  device, measured in the same run as the benchmark (the machine's peak moves with its load, so a
  number measured in another run is not a fair denominator).
- ``peak_rss_mib``: this process's peak resident memory so far.
- ``markdown_table``, ``environment``, ``write_json``: reporting, re-exported from ``rljax.tools.reporting``.

These are benchmarks, not tests: numbers on a shared machine move by tens of percent between runs,
so compare numbers taken in the same run, interleaved where possible.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax.tools.reporting import environment, markdown_table, write_json  # noqa: F401 (re-exported)


def thread_count() -> int:
    """CPU threads XLA's CPU backend uses: one per logical CPU (``os.cpu_count()``)."""
    return os.cpu_count() or 1


def set_torch_threads(n: int | None = None) -> int:
    """Give torch ``n`` intra-op threads (default: ``thread_count()``) and return ``n``."""
    import torch

    n = thread_count() if n is None else n
    torch.set_num_threads(n)
    return n


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` takes until its result (any pytree of arrays) is ready, and the result."""
    start = time.perf_counter()
    out = fn()
    out = jax.block_until_ready(out)
    return time.perf_counter() - start, out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def matmul_gflops(rows: int, k: int, n: int, *, device=None, dtype=jnp.float32, min_seconds: float = 0.5,
                  trials: int = 5) -> float:
    """Best achieved GFLOP/s of a jitted ``[rows, k] @ [k, n]`` over ``trials`` timed bursts.

    Each burst repeats the matmul until ``min_seconds`` have passed; the best burst is reported
    because on a shared machine the slower ones measure the neighbours, not the hardware.
    """
    device = device or jax.devices()[0]
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, (rows, k), dtype), device)
    w = jax.device_put(jax.random.normal(kw, (k, n), dtype), device)
    # Keep the product from being hoisted out of a loop or cached: a fresh call each time.
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
    jax.block_until_ready(mm(x, w))
    flops = 2.0 * rows * k * n
    best = 0.0
    for _ in range(trials):
        calls, start = 0, time.perf_counter()
        while True:
            out = mm(x, w)
            calls += 1
            if calls % 4 == 0:
                jax.block_until_ready(out)
                elapsed = time.perf_counter() - start
                if elapsed >= min_seconds:
                    break
        best = max(best, flops * calls / elapsed / 1e9)
    return best


def matmul_peaks(decode_rows: Sequence[int], *, d_model: int = 576, d_ff: int = 1536, big: int = 2048,
                 device=None, min_seconds: float = 0.5) -> dict[str, float]:
    """Matmul GFLOP/s at the decode shapes ``rows x d_model x d_ff`` (one per row count) and at ``big``^3."""
    out = {f"{r}x{d_model}x{d_ff}": matmul_gflops(r, d_model, d_ff, device=device, min_seconds=min_seconds)
           for r in decode_rows}
    out[f"{big}x{big}x{big}"] = matmul_gflops(big, big, big, device=device, min_seconds=min_seconds, trials=3)
    return out


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0
