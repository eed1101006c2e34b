"""Several processes, one JAX runtime: ``jax.distributed.initialize``, as TPU pods and GPU clusters run.

    initialize(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0)   # explicit
    initialize()                      # on a TPU pod or under SLURM: JAX finds the cluster itself

Every process then runs the same program: ``jax.devices()`` lists the devices of all processes,
the run's mesh (``rljax.training.run.run_mesh``) spans them, and each process holds the shards of
parameters and batches that live on its own devices. What differs between processes is only what
touches the host: only process 0 writes logs, samples, ``config.yaml``, ``summary.json`` and the
exported model; every process writes its own shards of a checkpoint (orbax); rewards are computed by
the process whose devices hold the rows (``rljax.rollout``; ``rljax.sharding.local_rows``).

On the CPU backend the cross-process collectives need gloo
(``jax_cpu_collectives_implementation``; without it: "Multiprocess computations aren't implemented
on the CPU backend"), set here before the backend starts. The device count per process is fixed when
jax starts: ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` in the environment.
"""

from __future__ import annotations

import os
import shlex
import sys

import jax
import numpy as np

from rljax.errors import UserError

__all__ = ["LOST_PROCESS_EXIT_CODE", "any_process", "cluster_detected", "exit_if_lost_process", "initialize",
           "is_main_process", "lost_process_line", "process_index"]

LOST_PROCESS_EXIT_CODE = 75
"""Exit status of a process whose peer died (``EX_TEMPFAIL``: restart the job with ``--resume``)."""

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
               process_id: int | None = None, *, timeout_s: int = 300) -> bool:
    """Join (or form) the multi-process runtime; returns whether this is a multi-process run.

    All three arguments, or none: none on a cluster :func:`cluster_detected` recognises lets JAX read
    them from the environment; none elsewhere is a single-process run (nothing is done). Must run
    before any JAX computation in the process (the backend starts with the first one).
    ``timeout_s``: how long to wait for the other processes to join.
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
        _use_gloo_on_cpu()
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s)
        return num_processes > 1
    if cluster_detected():
        _use_gloo_on_cpu()
        jax.distributed.initialize(initialization_timeout=timeout_s)
        return jax.process_count() > 1
    return False


def _use_gloo_on_cpu() -> None:
    # harmless where the devices are accelerators: it only selects the CPU backend's collectives
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


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
    who = f"process {1 - me}" if n == 2 else "another process"
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return (f"rljax: process {me} of {n} lost contact with {who} ({first[:200]}): it stopped or died, so the run "
            f"cannot go on; restart every process (each with its own --process-id) with --resume: "
            f"{_resume_command(sys.argv if argv is None else argv)}")


def exit_if_lost_process(err: BaseException) -> None:
    """Where ``err`` is a lost process (:func:`lost_process_line`): print the line and exit at once with
    :data:`LOST_PROCESS_EXIT_CODE`. ``os._exit``: a normal exit waits for the runtime's shutdown
    barrier, which the dead process never reaches, and then aborts with a page of C++ stack."""
    line = lost_process_line(err)
    if line is None:
        return
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
    program = "rljax" if os.path.basename(argv[0]) in ("rljax", "cli.py", "-m") else argv[0]
    return shlex.join([program, *args])
