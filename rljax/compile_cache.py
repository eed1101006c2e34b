"""JAX's persistent compilation cache for rljax's commands: a second run of the same shapes loads its
compiled programs from disk instead of compiling them again.

Why: on a CPU host most of a short run's time is XLA compiling (the rollout engine's prefill and
decode programs, one per bucket, the update, the evaluation), and a researcher reruns the same
shapes over and over (ablations, seeds, a resumed run, ``rljax generate`` on the same model). A
cached program is the same executable, so results do not change (the figures:
docs/performance.md#compilation-cache).

Where: importing rljax changes nothing; ``rljax.tools.cli.main`` calls :func:`use_compilation_cache`
before any JAX work, as may a script of your own. The directory is

- ``$JAX_COMPILATION_CACHE_DIR`` when set (JAX's own variable, which JAX then reads itself);
- else ``$RLJAX_COMPILATION_CACHE``: ``0`` (or ``off``) turns the cache off, any other value is the
  directory;
- else ``$XDG_CACHE_HOME/rljax/jax`` (``~/.cache/rljax/jax``).

Only programs that took at least :data:`MIN_COMPILE_S` to compile are written (JAX's own rule), and
the directory is kept under :data:`MAX_BYTES`, least recently used entries dropped first (JAX's
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` and ``JAX_COMPILATION_CACHE_MAX_SIZE`` override them). An entry
is keyed by the program, the compiler options and the jax / jaxlib versions and the devices, so a
stale entry is never used; a cache that cannot be written or read costs the compile, not the run.
"""

from __future__ import annotations

import os

__all__ = ["MAX_BYTES", "MIN_COMPILE_S", "cache_dir", "use_compilation_cache"]

MIN_COMPILE_S = 1.0
"""Programs that compiled faster than this are not written (JAX's default: the many small ones load
about as slowly as they compile)."""

MAX_BYTES = 4 << 30
"""The directory's size limit (JAX drops the least recently used entries beyond it)."""


def cache_dir(environ=None) -> str | None:
    """The directory :func:`use_compilation_cache` uses under ``environ`` (default ``os.environ``), or
    None when the cache is off."""
    env = os.environ if environ is None else environ
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return env["JAX_COMPILATION_CACHE_DIR"]
    chosen = env.get("RLJAX_COMPILATION_CACHE", "")
    if chosen.strip().lower() in ("0", "off", "false", "no"):
        return None
    if chosen:
        return os.path.expanduser(chosen)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rljax", "jax")


def use_compilation_cache(environ=None) -> str | None:
    """Turn JAX's persistent compilation cache on for this process (see the module docstring); returns
    its directory, or None when it is off. Call it before the first compile."""
    directory = cache_dir(environ)
    if directory is None:
        return None
    import jax

    env = os.environ if environ is None else environ
    jax.config.update("jax_compilation_cache_dir", directory)
    # JAX's own variables, where set, win (it reads them as these settings' defaults)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in env:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in env:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return directory
