"""Scorers run on model text in worker processes, each item within a hard time and memory bound.

Model text is adversarial input: `10^{10^{10^{10}}}` sends sympy into a big-integer power, in C, that
takes seconds and gigabytes and that `signal.alarm` cannot interrupt. `BoundedPool.map(fn, items)`
runs `fn(*item)` for every item in a small pool of persistent worker processes:

- time: each item gets `time_limit_seconds` of wall clock from the moment its worker can start on
  it. Past that the parent kills the worker's whole process group, the item's outcome is
  "timeout", and a fresh worker takes the rest of the batch. RLIMIT_CPU in the worker is a backstop
  should the parent stall (moved on before each item: it counts the process's whole CPU time).
- memory: RLIMIT_AS in the worker, set once its libraries are loaded to the address space it then
  has plus `memory_limit_mb` (Linux). An allocation past it raises MemoryError in the scorer
  (outcome "memory") or, in C code that cannot raise, ends the worker (outcome "crash").
- reuse: workers start once (an interpreter plus the `preload` imports, about 1-3 s) and are reused
  by every later call; only a killed or crashed worker is replaced (started at once, in the
  background). A batch is one message to each worker and the results come back one per item, so each
  item has its own deadline and one bad item costs only itself.

Workers are fresh interpreters started with `subprocess` (fork + exec), never a bare `fork` of the
multithreaded JAX parent, each in its own session: a kill reaches anything it started, and a Ctrl-C
in the terminal reaches only the parent. A worker whose parent dies reads end-of-file and exits.

A scorer that stops itself at a bound of its own (math-verify's alarm) raises `BoundHit(reason)`, so
that the item is counted like one the parent stopped.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter, deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

logger = logging.getLogger(__name__)

REASONS = ("timeout", "memory", "crash")
_START_TIMEOUT_SECONDS = 300.0  # an interpreter plus sympy on a busy host; beyond this the environment is broken


class BoundHit(Exception):
    """Raised by a scorer (in a worker) that stopped at a bound of its own; `reason` is one of `REASONS`."""

    def __init__(self, reason: str):
        if reason not in REASONS:
            raise ValueError(f"BoundHit reason must be one of {REASONS}, got {reason!r}")
        super().__init__(reason)
        self.reason = reason


class Outcome(NamedTuple):
    """One item's result from `BoundedPool.map`."""

    value: Any = None  # what fn returned (reason None)
    reason: str | None = None  # None: returned; "error": raised (see `error`); else one of REASONS
    error: str | None = None  # "TypeName: message" when reason == "error"


class BoundedPool:
    """`workers` persistent worker processes that run `fn(*item)` within a time and memory bound.

    `preload`: modules each worker imports before its first item, so that their import time is not
    charged to an item. `map` is thread-safe (calls are served one at a time). Workers start on the
    first `map` and stop at `close()` or interpreter exit.
    """

    def __init__(self, *, time_limit_seconds: float = 5.0, memory_limit_mb: int = 1024, workers: int = 2,
                 preload: Sequence[str] = ()):
        check_bounds(time_limit_seconds, memory_limit_mb, workers)
        self.time_limit_seconds = float(time_limit_seconds)
        self.memory_limit_mb = int(memory_limit_mb)
        self.preload = tuple(preload)
        self._slots: list[_Worker | None] = [None] * int(workers)
        self._lock = threading.Lock()
        self.restarts = 0  # workers replaced after a kill or crash
        self._finalizer = weakref.finalize(self, _stop_all, self._slots)

    def map(self, fn: Callable[..., Any], items: Iterable[Sequence[Any]]) -> list[Outcome]:
        """`fn(*item)` for each item, in order; `fn` and the items must pickle (a module-level
        function or a `functools.partial` of one)."""
        items = [tuple(item) for item in items]
        outcomes: list[Outcome | None] = [None] * len(items)
        if not items:
            return []
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError("BoundedPool.map called after close()")
            # job per slot: [worker, indices still to score (in order), deadline or None while starting]
            jobs: dict[int, list] = {}
            n_slots = min(len(self._slots), len(items))
            bounds = [round(k * len(items) / n_slots) for k in range(n_slots + 1)]
            try:
                for slot in range(n_slots):
                    jobs[slot] = [self._worker(slot), deque(range(bounds[slot], bounds[slot + 1])), None]
                    self._send(jobs[slot], fn, items)
                while jobs:
                    self._advance(jobs, fn, items, outcomes)
            except BaseException:  # fn or an item would not pickle, Ctrl-C, a worker that cannot start:
                for slot in jobs:  # no worker may keep half a batch whose answers the next call would read
                    _stop_all(self._slots, [slot])
                raise
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the workers (a later `map` raises)."""
        self._finalizer()

    # ------------------------------------------------------------------ internals
    def _worker(self, slot: int) -> _Worker:
        worker = self._slots[slot]
        if worker is None or worker.proc.poll() is not None:
            if worker is not None:
                worker.stop()
            worker = self._slots[slot] = _Worker(self.time_limit_seconds, self.memory_limit_mb, self.preload)
        return worker

    def _send(self, job: list, fn, items) -> None:
        worker, queue, _ = job
        if worker.ready and queue:
            worker.send_conn.send((fn, [(i, items[i]) for i in queue]))
            job[2] = time.monotonic() + self.time_limit_seconds
        else:
            job[2] = worker.start_deadline

    def _advance(self, jobs: dict[int, list], fn, items, outcomes) -> None:
        now = time.monotonic()
        wait([job[0].recv_conn for job in jobs.values()], max(0.0, min(job[2] for job in jobs.values()) - now))
        for slot, job in list(jobs.items()):
            worker, queue, deadline = job
            if worker.recv_conn.poll(0):  # a result (or end-of-file) waiting beats a passed deadline
                try:
                    message = worker.recv_conn.recv()
                except (EOFError, OSError):
                    if not worker.ready:
                        raise _start_failed(worker) from None
                    reason = "timeout" if worker.proc.wait() == -signal.SIGXCPU else "crash"
                    self._replace(slot, job, reason, fn, items, outcomes)
                else:
                    self._receive(job, message, outcomes, fn, items)
            elif time.monotonic() >= deadline:
                if not worker.ready:
                    worker.stop()
                    raise RuntimeError(f"a bounded worker did not start within {_START_TIMEOUT_SECONDS:.0f} s")
                self._replace(slot, job, "timeout", fn, items, outcomes)
            if not job[1]:
                del jobs[slot]

    def _receive(self, job: list, message, outcomes, fn, items) -> None:
        worker, queue, _ = job
        if message[0] == "ready":
            worker.ready = True
            self._send(job, fn, items)
        elif message[0] == "batch_error":  # the worker could not read the batch (fn not importable there)
            while queue:
                outcomes[queue.popleft()] = Outcome(reason="error", error=message[1])
        else:
            index, value, reason, error = message
            if index != queue[0]:
                raise RuntimeError(f"bounded worker answered item {index}, expected {queue[0]}")
            outcomes[queue.popleft()] = Outcome(value, reason, error)
            job[2] = time.monotonic() + self.time_limit_seconds

    def _replace(self, slot: int, job: list, reason: str, fn, items, outcomes) -> None:
        worker, queue, _ = job
        worker.stop()
        outcomes[queue.popleft()] = Outcome(reason=reason)
        self.restarts += 1
        job[0] = self._worker(slot)
        self._send(job, fn, items)


def check_bounds(time_limit_seconds: Any, memory_limit_mb: Any, workers: Any) -> None:
    """Raise ValueError naming the setting unless all three are positive and finite (the last two whole)."""
    for key, value, kind in (("time_limit_seconds", time_limit_seconds, (int, float)),
                             ("memory_limit_mb", memory_limit_mb, int), ("workers", workers, int)):
        if isinstance(value, bool) or not isinstance(value, kind) or not value > 0 or value == float("inf"):
            raise ValueError(f"{key} must be a positive finite {'number' if kind != int else 'integer'}, "
                             f"got {value!r}")


def _start_failed(worker: _Worker) -> RuntimeError:
    code = worker.proc.wait()
    return RuntimeError(f"a bounded worker exited with code {code} before it was ready (its error is printed "
                        f"above, on stderr); it imports {', '.join(worker.preload) or 'nothing'}")


class _Worker:
    """One worker process and its two pipes (parent -> worker, worker -> parent)."""

    def __init__(self, time_limit_seconds: float, memory_limit_mb: int, preload: tuple[str, ...]):
        import rljax

        self.preload, self.ready = preload, False
        to_parent_r, to_parent_w = os.pipe()
        to_worker_r, to_worker_w = os.pipe()
        root = os.path.dirname(os.path.dirname(os.path.abspath(rljax.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
                   JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_ENTRY,
                 str(to_worker_r), str(to_parent_w), repr(time_limit_seconds), str(memory_limit_mb), *preload],
                pass_fds=(to_worker_r, to_parent_w), start_new_session=True, env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (to_parent_r, to_parent_w, to_worker_r, to_worker_w):
                os.close(fd)
            raise
        os.close(to_worker_r)
        os.close(to_parent_w)
        self.recv_conn = Connection(to_parent_r, writable=False)
        self.send_conn = Connection(to_worker_w, readable=False)
        self.start_deadline = time.monotonic() + _START_TIMEOUT_SECONDS

    def stop(self) -> None:
        try:  # start_new_session: the worker leads its own process group, from before exec
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.recv_conn.close()
        self.send_conn.close()


def _stop_all(slots: list, which: Iterable[int] | None = None) -> None:
    for k in range(len(slots)) if which is None else which:
        worker = slots[k]
        if worker is not None:
            worker.stop()
            slots[k] = None


# ---------------------------------------------------------------------------------------------
# Worker side


# The worker needs rljax.rewards' scorer modules, not the package's __init__, which imports every
# reward (the learned reward model, so JAX: ~1.5 s and 300 MB of address space per worker start). It
# enters with the package registered but not run; the first attribute looked up on it runs it.
_WORKER_ENTRY = """
import importlib.util, sys
spec = importlib.util.find_spec("rljax.rewards")
sys.modules["rljax.rewards"] = importlib.util.module_from_spec(spec)
from rljax.rewards.bounded import _worker_main
_worker_main(spec)
"""


def _worker_main(package_spec) -> None:
    """Entry point of a worker process (`_WORKER_ENTRY`); argv: fds, time limit, memory limit, preload."""
    package = sys.modules[package_spec.name]

    def run_package_init(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        del package.__getattr__
        package_spec.loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = run_package_init
    from_parent, to_parent = int(sys.argv[1]), int(sys.argv[2])
    time_limit, memory_limit_mb, preload = float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
    for module in preload:
        importlib.import_module(module)
    inbox, outbox = Connection(from_parent, writable=False), Connection(to_parent, readable=False)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU must not leave a core file behind
    base = _address_space_bytes()
    if base is not None:
        limit = base + (memory_limit_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    outbox.send(("ready",))
    while True:
        try:
            fn, batch = inbox.recv()
        except EOFError:
            return
        except Exception as exc:  # noqa: BLE001 - e.g. fn's module cannot be imported here
            outbox.send(("batch_error", f"{type(exc).__name__}: {exc}"))
            continue
        for index, args in batch:
            _set_cpu_backstop(time_limit)
            result = _run_one(fn, index, args)
            try:
                outbox.send(result)
            except Exception as exc:  # noqa: BLE001 - the value would not pickle (nothing was written)
                outbox.send((index, None, "error", f"result not sent: {type(exc).__name__}: {exc}"))


def _run_one(fn, index: int, args) -> tuple:
    try:
        return index, fn(*args), None, None
    except BoundHit as hit:
        return index, None, hit.reason, None
    except MemoryError:
        return index, None, "memory", None
    except Exception as exc:  # noqa: BLE001 - the parent decides what an error scores
        return index, None, "error", f"{type(exc).__name__}: {exc}"


def _set_cpu_backstop(time_limit: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + time_limit) + 2
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard == resource.RLIM_INFINITY or soft <= hard:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _address_space_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (not Linux): no address-space limit
        return None


# ---------------------------------------------------------------------------------------------
# Shared pools and metrics

_POOLS: dict[tuple, BoundedPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(*, time_limit_seconds: float = 5.0, memory_limit_mb: int = 1024, workers: int = 2,
                preload: Sequence[str] = ()) -> BoundedPool:
    """The process's one `BoundedPool` with these settings: rewards with the same bounds share its
    workers, so a run (or a test session) pays the worker start-up once."""
    check_bounds(time_limit_seconds, memory_limit_mb, workers)
    key = (float(time_limit_seconds), int(memory_limit_mb), int(workers), tuple(preload))
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None or not pool._finalizer.alive:
            pool = _POOLS[key] = BoundedPool(time_limit_seconds=time_limit_seconds, memory_limit_mb=memory_limit_mb,
                                             workers=workers, preload=preload)
        return pool


def bound_hit_metrics(functions: Mapping[str, Any], prefix: str = "reward/") -> dict[str, float]:
    """`{prefix}<name>/timeouts`, `/memory` and `/crashes`: samples each bounded reward function
    scored 0 because it hit a bound since the last call (the counts are reset). `functions` maps
    names to reward functions (`RewardSet.functions`); functions without bounds are skipped."""
    metrics: dict[str, float] = {}
    for name, fn in functions.items():
        hits = getattr(fn, "bound_hits", None)
        if not isinstance(hits, Counter):
            continue
        for reason, key in (("timeout", "timeouts"), ("memory", "memory"), ("crash", "crashes")):
            metrics[f"{prefix}{name}/{key}"] = float(hits[reason])
        hits.clear()
    return metrics


# ---------------------------------------------------------------------------------------------
# What the bounded rewards (answer, reasoning_gym) share

def record_outcomes(rows: list[int], outcomes, out: np.ndarray, errors: list, bound_hits: Counter) -> None:
    """Write a bounded pool's outcomes into ``out`` at ``rows``: the value; NaN (missing) for a scorer
    that raised, noted in ``errors``; 0.0 for a bound hit, counted in ``bound_hits`` by reason."""
    for i, outcome in zip(rows, outcomes):
        if outcome.reason is None:
            out[i] = float(outcome.value)
        elif outcome.reason == "error":
            out[i] = np.nan
            errors.append((i, outcome.error))
        else:
            bound_hits[outcome.reason] += 1  # out[i] stays 0.0


def pool_for(name: str, preload: tuple[str, ...], options: Mapping[str, Any]):
    """A function returning the shared pool for `options` (started on the first sample that needs it);
    the options are checked now."""
    try:
        check_bounds(**options)
    except ValueError as exc:
        raise ValueError(f"{name} reward: {exc}") from None
    return functools.partial(shared_pool, preload=preload, **options)


def warn_errors(name: str, errors: list[tuple[int, str]], n: int) -> None:
    if errors:
        index, message = errors[0]
        logger.warning("reward %r raised on %d of %d samples (scored NaN); first at sample %d: %s",
                       name, len(errors), n, index, message)


__all__ = ["REASONS", "BoundHit", "BoundedPool", "Outcome", "bound_hit_metrics", "check_bounds", "pool_for",
           "record_outcomes", "shared_pool", "warn_errors"]
