"""Several processes, one JAX runtime (``jax.distributed.initialize``, as TPU pods and GPU clusters
run), and the host side of a batch: onto the mesh, back to host, the rows each process holds.

    initialize(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0)   # explicit
    initialize()                      # on a TPU pod or under SLURM: JAX finds the cluster itself

Every process then runs the same program: ``jax.devices()`` lists the devices of all processes,
the run's mesh (``rljax.training.run.run_mesh``) spans them, and each process holds the shards of
parameters and batches that live on its own devices. What differs between processes is only what
touches the host: only process 0 writes logs, samples, ``config.yaml``, ``summary.json`` and the
exported model; every process writes its own shards of a checkpoint (orbax); rewards are computed by
the process whose devices hold the rows (``rljax.rollout``; :func:`local_rows`).

On the CPU backend the cross-process collectives need gloo
(``jax_cpu_collectives_implementation``; without it: "Multiprocess computations aren't implemented
on the CPU backend"), set here before the backend starts. The device count per process is fixed when
jax starts: ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` in the environment.

A process that dies (killed, out of memory, its host gone) ends the others with one line and exit
status :data:`LOST_PROCESS_EXIT_CODE`, by whichever comes first: a collective that fails on the lost
connection (``rljax.training.loop`` calls :func:`exit_if_lost_process`), or a watcher thread that
asks JAX's coordination service which processes are alive (``get_live_nodes``, what
``jax.experimental.multihost_utils.live_devices`` asks) and sees one missing after
``heartbeat_timeout_s``. The watcher is needed because a collective whose peer died may as well
block (a gloo ring where this process's ranks wait on each other); the service then is the only
one that knows. The runtime is made recoverable (``jax_enable_recoverability``) so that the service
does not abort the survivors itself (a C++ ``Check failure`` with a page of stack, no resume
command) before the watcher speaks. Where the process that dies is process 0, which hosts the
service, the others lose the service too and JAX's client aborts them with its own message.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rljax.errors import UserError
from rljax.sharding import MeshAxes, Rules, active_mesh, active_rules, batch_shards, batch_sharding, put, replicated

__all__ = ["LOST_PROCESS_EXIT_CODE", "any_process", "cluster_detected", "exit_if_lost_process", "gather_rows",
           "initialize", "is_main_process", "local_rows", "lost_process_line", "place_batch", "process_index", "to_host"]

LOST_PROCESS_EXIT_CODE = 75
"""Exit status of a process whose peer died (``EX_TEMPFAIL``: restart the job with ``--resume``)."""

HEARTBEAT_TIMEOUT_S = 60
"""Seconds without a heartbeat after which JAX's coordination service counts a process as dead.
JAX's default is 100; heartbeats come from a C++ thread of their own, so neither a long compile nor
a busy Python thread delays them."""

# how a collective reports a peer that is gone: gloo on CPU ("Connection closed by peer", "Read
# timeout"), the coordination service (heartbeats), gRPC ("Socket closed"), NCCL's remote errors
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "heartbeat", "socket closed",
              "connection refused", "read timeout", "remote process exited", "unhealthy")


def cluster_detected(environ=None) -> bool:
    """Whether the environment is a multi-process job ``jax.distributed.initialize()`` can find by
    itself: a SLURM job step with more than one task, or a TPU slice with more than one host."""
    env = os.environ if environ is None else environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in env:
        return True
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> bool:
    """Join (or form) the multi-process runtime; returns whether this is a multi-process run.

    All three arguments, or none: none on a cluster :func:`cluster_detected` recognises lets JAX read
    them from the environment; none elsewhere is a single-process run (nothing is done). Must run
    before any JAX computation in the process (the backend starts with the first one).
    ``timeout_s``: how long to wait for the other processes to join; ``heartbeat_timeout_s``: how
    long a silent process counts as alive (then the others end, see the module docstring).
    """
    given = {"--coordinator-address": coordinator_address, "--num-processes": num_processes,
             "--process-id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise UserError(f"a multi-process run needs --coordinator-address, --num-processes and --process-id "
                            f"together; missing {', '.join(missing)}")
        if ":" not in coordinator_address:
            raise UserError(f"--coordinator-address must be HOST:PORT, got {coordinator_address!r}")
        if not (num_processes >= 1 and 0 <= process_id < num_processes):
            raise UserError(f"--process-id must be in [0, --num-processes={num_processes}), got {process_id}")
        _before_the_runtime()
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    elif cluster_detected():
        _before_the_runtime()
        jax.distributed.initialize(initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)
    else:
        return False
    from jax._src import distributed as jax_distributed  # the client live_devices uses; no public handle

    state = jax_distributed.global_state
    if state.num_processes < 2:
        return False
    _start_peer_watch(state.client, state.process_id, state.num_processes, heartbeat_timeout_s)
    return True


def _before_the_runtime() -> None:
    # gloo: harmless where the devices are accelerators, it only selects the CPU backend's collectives
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)


_watch_stopped = threading.Event()


def _start_peer_watch(client, me: int, n: int, heartbeat_timeout_s: int, interval_s: float = 2.0) -> None:
    """The watcher thread of the module docstring; it stops when the process exits normally (an
    ``atexit`` hook, run before JAX's own shutdown, which was registered earlier)."""
    import atexit

    if client is None or not hasattr(client, "get_live_nodes"):
        return
    _watch_stopped.clear()
    everyone = list(range(n))
    atexit.register(_leave_together, client, me, everyone)

    def watch():
        while not _watch_stopped.is_set():
            try:
                live = client.get_live_nodes(everyone)  # every live process calls it: a barrier over them
            except Exception as err:  # noqa: BLE001 - the service is gone (JAX's client usually aborts first)
                if not _watch_stopped.is_set():
                    _exit_lost(_lost_line([0], f"the coordination service it hosts stopped answering: {err}"))
                return
            if _watch_stopped.is_set() or me not in live:  # this process is shutting down
                return
            lost = [p for p in everyone if p not in live]
            if lost:
                _exit_lost(_lost_line(lost, f"no heartbeat for {heartbeat_timeout_s} s: JAX's coordination service "
                                            "counts it dead"))
            time.sleep(interval_s)

    threading.Thread(target=watch, name="rljax-peer-watch", daemon=True).start()


SHUTDOWN_TIMEOUT_S = 300
"""How long a process that ends waits at exit for the others to end too (JAX's own shutdown timeout)."""


def _leave_together(client, me: int, everyone: list[int]) -> None:
    """At a normal exit, before JAX's shutdown (``atexit`` runs this first): stop the watcher, wait
    for every process to reach its exit, and on process 0, which hosts the coordination service,
    wait until the others have disconnected. A recoverable runtime does not do this itself ("the
    default shutdown barrier will only block non-recoverable tasks"), and a process whose service
    went away while it disconnected is aborted by JAX's client."""
    _watch_stopped.set()
    try:
        client.wait_at_barrier("rljax_exit", SHUTDOWN_TIMEOUT_S * 1000)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        # a barrier over the live processes: it returns once the others disconnected (or called it)
        while me == 0 and time.monotonic() < deadline and set(client.get_live_nodes(everyone)) - {me}:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - a peer that died or timed out: JAX's shutdown reports it
        pass


def is_main_process() -> bool:
    """Process 0: the one that writes files shared by the run (logs, config, summary, exported model)."""
    return jax.process_index() == 0


def any_process(*flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over all processes (one tiny all-gather when there are several; none otherwise).

    For a decision one process can make alone but every process must act on, because acting means
    collectives: a stop signal delivered to one host, a save that one host's clock says is due. If
    one process entered a checkpoint save (or stopped) and the others went on to the next step, each
    would wait for the other in a different collective until the job is killed. Call it at the same
    point of the program on every process.
    """
    if jax.process_count() == 1:
        return tuple(bool(f) for f in flags)
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(flags, np.int32)))
    return tuple(bool(v) for v in gathered.reshape(-1, len(flags)).any(axis=0))


def process_index() -> int:
    """This process's index (0 in a one-process run)."""
    return jax.process_index()


def lost_process_line(err: BaseException, *, argv: list[str] | None = None) -> str | None:
    """The one line that says a multi-process run lost a process, which, and how to resume; None when
    ``err`` is not that (or the run has one process)."""
    n = jax.process_count()
    runtime = [e for e in _chain(err) if isinstance(e, jax.errors.JaxRuntimeError)]  # not a reward's own error
    text = str(runtime[0]) if runtime else ""
    if n < 2 or not any(marker in text.lower() for marker in _LOST_PEER):
        return None
    me = jax.process_index()
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return _lost_line([1 - me] if n == 2 else None, first, argv=argv)


def _lost_line(lost: list[int] | None, why: str, *, argv: list[str] | None = None) -> str:
    n, me = jax.process_count(), jax.process_index()
    who = "another process" if lost is None else ("process " if len(lost) == 1 else "processes ") + \
        ", ".join(map(str, lost))
    return (f"rljax: process {me} of {n} lost contact with {who} ({why[:200]}): it stopped or died, so the run "
            f"cannot go on; restart every process (each with its own --process-id) with --resume: "
            f"{_resume_command(sys.argv if argv is None else argv)}")


def exit_if_lost_process(err: BaseException) -> None:
    """Where ``err`` is a lost process (:func:`lost_process_line`): print the line and exit at once with
    :data:`LOST_PROCESS_EXIT_CODE`. ``os._exit``: a normal exit waits for the runtime's shutdown
    barrier, which the dead process never reaches, and then aborts with a page of C++ stack."""
    line = lost_process_line(err)
    if line is not None:
        _exit_lost(line)


def _exit_lost(line: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(2, (line + "\n").encode())
    finally:
        os._exit(LOST_PROCESS_EXIT_CODE)


def _chain(err: BaseException | None):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _resume_command(argv: list[str]) -> str:
    args = list(argv[1:])
    if "--resume" not in args:
        args.append("--resume")
    program = "rljax" if os.path.basename(argv[0]) in ("rljax", "cli.py", "__main__.py", "-m") else argv[0]
    return shlex.join([program, *args])


# ---------------------------------------------------------------------------------------------
# The host side of a batch


def place_batch(tree: Any, mesh: Mesh | None = None, rules: Rules | Mapping[str, MeshAxes] | None = None) -> Any:
    """Every array of a batch (host or device) on ``mesh`` (default: ``rljax.sharding.active_mesh``), rows split.

    A leaf whose leading dim (rows) is divisible by the ``batch`` rule's mesh axes is split over
    them (``rljax.sharding.batch_sharding``); any other (a last evaluation chunk of odd size, a scalar) is
    replicated: every device then computes all of its rows, which is correct, only slower. Host
    arrays must hold the *global* batch, the same on every process. Without a mesh the arrays become
    ``jax.Array`` s on the default device (``jnp.asarray``), as before meshes.
    """
    mesh = active_mesh() if mesh is None else mesh
    if mesh is None:
        return jax.tree.map(jax.numpy.asarray, tree)
    rules = active_rules() if rules is None else rules
    rows_sharding = batch_sharding(mesh, rules)
    shards = batch_shards(mesh, rules)

    def leaf(x):
        shape = np.shape(x)
        split = len(shape) >= 1 and shape[0] % shards == 0
        return put(x, rows_sharding if split else replicated(mesh))

    return jax.tree.map(leaf, tree)


def to_host(x: Any) -> np.ndarray:
    """A NumPy copy of the whole of ``x``: a jax array held only in part by this process (a batch
    split over several hosts) is all-gathered across processes first (every process must call)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def local_rows(x: Any) -> slice:
    """The rows (leading dim) of ``x`` this process's devices hold: all of them in a one-process run
    or where the rows are replicated; a contiguous block where several processes split them."""
    n = np.shape(x)[0]
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return slice(0, n)
    starts, stops = [], []
    for index in x.sharding.addressable_devices_indices_map(x.shape).values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(n)
        starts.append(start)
        stops.append(stop)
    block = slice(min(starts), max(stops))
    covered = set()
    for start, stop in zip(starts, stops):
        covered.update(range(start, stop))
    if len(covered) != block.stop - block.start:
        raise ValueError(f"this process holds rows {sorted(covered)} of {n}: not one contiguous block "
                         "(a mesh whose batch axes interleave the processes' devices)")
    return block


def gather_rows(values: Any, rows: slice, total: int) -> np.ndarray:
    """Every process's ``values`` (the host results for its :func:`local_rows` ``rows``), assembled
    into the ``total`` rows, on every process (every process must call). One process, or rows that
    were not split (``rows`` covers all): ``values`` itself."""
    values = np.asarray(values)
    if rows.start == 0 and rows.stop == total:
        return values
    from jax.experimental import multihost_utils

    # each process sends its block and where it starts: blocks are equal-sized (the batch divides)
    starts = np.asarray(multihost_utils.process_allgather(np.asarray([rows.start], np.int64), tiled=True))
    blocks = np.asarray(multihost_utils.process_allgather(values[None], tiled=True))
    out = np.empty((total,) + values.shape[1:], values.dtype)
    for start, block in zip(starts, blocks):
        out[start:start + len(block)] = block
    return out
