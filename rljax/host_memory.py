"""Keep freed host memory inside the process (glibc's malloc), so XLA:CPU stops page-faulting.

Why: XLA:CPU allocates the temporaries of every jitted call with ``malloc`` and frees them when the
call ends. glibc serves a large allocation with a fresh ``mmap`` (always above 32 MiB, and for any
size too big for a worker thread's 64 MiB arena) and gives it back with ``munmap`` on ``free``, so
the next call touches brand-new pages and the kernel zeroes and maps each of them again. With the
settings below those page faults are gone and training is markedly faster (the figures:
docs/performance.md#host-memory). All three settings are needed: either half alone left the page
faults in place.

Where it loses: a short process that compiles many small programs, so the test suite turns them off
(``tests/conftest.py``). The first calls of a new program can also be slow once, while the heap
grows to its working size (new pages are faulted in once, not on every call).

What: ``mallopt`` with one malloc arena for all threads (``M_ARENA_MAX=1``), no mmap-served
allocations (``M_MMAP_MAX=0``) and no trimming of the heap's top (``M_TRIM_THRESHOLD`` at its
maximum). Cost: memory a process has freed is kept for its next allocation instead of being
returned to the operating system, so the resident size stays at its peak.

Where: importing rljax changes nothing; the settings are process-wide, so the process's entry point
applies them. ``rljax.tools.cli.main`` calls :func:`keep_host_memory` for ``train``, ``eval`` and
``generate`` before any JAX work (``train`` and ``eval`` by :func:`keep_host_memory_for_run`:
online runs only), and so do the long-running scripts in ``experiments/perf/`` and
``paper_repro/``; a script of your own calls it first thing. Call it before JAX starts its thread
pool: threads that already have an arena keep it. ``RLJAX_KEEP_HOST_MEMORY=0`` turns it off (the
call then does nothing); it also does nothing where the C library is not glibc (macOS, musl) and on
non-Linux systems. :func:`applied` tells whether (and if) it has run in this process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

ENV_SWITCH = "RLJAX_KEEP_HOST_MEMORY"
_applied: bool | None = None


def applied() -> bool | None:
    """Whether the settings are in effect in this process: None until :func:`keep_host_memory` runs."""
    return _applied


def keep_host_memory_for_run(online: bool) -> bool:
    """The one rule for training and evaluation runs: :func:`keep_host_memory` for online runs only;
    returns whether the settings are in effect.

    Online steps run the same few programs on the same shapes, and keeping freed memory saved their
    page faults. Offline steps pad each batch to its own width bucket, and with the heap never
    trimmed nor mmap-served the process grew step after step (SFT on SmolLM2 swapped where it
    otherwise stayed within a few GB), so an offline run leaves malloc as it is.
    """
    return keep_host_memory() if online else bool(_applied)


def keep_host_memory() -> bool:
    """Apply the malloc settings once per process; returns whether they are in effect."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has no such symbol)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success. The trim threshold is a size_t: -1 becomes its maximum.
    _applied = all(mallopt(param, value) == 1
                   for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))
    return _applied


__all__ = ["ENV_SWITCH", "applied", "keep_host_memory"]
