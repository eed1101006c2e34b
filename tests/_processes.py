"""Several processes joined into one JAX runtime on 127.0.0.1, for the multi-process tests (optionally under a
CPU burner); the live processes with a marker on their command line, for the sandbox tests."""

import contextlib
import os
import signal
import socket
import subprocess
import sys


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a subprocess with ``devices`` simulated CPU devices, keeping the suite's own flags
    (``tests/conftest.py``: the backend's optimisation level) from this process's environment."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


@contextlib.contextmanager
def cpu_burner():
    """A process that spins on one core for as long as the block runs: a loaded host (a two-process
    run once hung in 1 of 11 tries under one; the ten-try loop is experiments/reliability/hang_stress.py)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def start_joined(commands, log_dir, *, env, cwd):
    """Start ``commands(port)`` (one argv per process, all given the same free coordinator port), each
    writing to ``log_dir/process{i}.log``; returns the processes and their log paths, without waiting."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(env, PYTHONFAULTHANDLER="1")
    argvs = commands(port)
    paths = [os.path.join(log_dir, f"process{i}.log") for i in range(len(argvs))]
    procs = []
    for argv, path in zip(argvs, paths):
        with open(path, "w") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd))
    return procs, paths


def abort_unfinished(procs):
    """SIGABRT to every process still running (PYTHONFAULTHANDLER=1 prints its stacks into its log)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGABRT)
            p.wait(timeout=60)


def run_joined(commands, log_dir, *, env, cwd, timeout_s=900):
    """Start ``commands(port)`` (one argv per process, all given the same free coordinator port), wait
    for all, and return each process's output; every process must exit with status 0.

    Each process writes to a file, never a pipe: a pipe nobody reads fills at 64 KiB and blocks its
    writer inside a step while its peers wait in the next collective for ever. ``timeout_s`` is a
    hang guard, not a time limit: past it every process gets SIGABRT, which under
    PYTHONFAULTHANDLER=1 (set here) prints each thread's Python stack into its log, and the
    failure shows them (a two-process run once hung in CI for 30 minutes with nothing to show why)."""
    procs, paths = start_joined(commands, log_dir, env=env, cwd=cwd)
    hung = False
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        hung = True
        abort_unfinished(procs)
    finally:
        for p in procs:
            p.kill()
    outs = []
    for path in paths:
        with open(path) as f:
            outs.append(f.read())
    shown = "\n".join(f"--- process {i} ---\n{out[-6000:]}" for i, out in enumerate(outs))
    assert not hung, f"the processes did not finish in {timeout_s} s; their stacks:\n{shown}"
    assert all(p.returncode == 0 for p in procs), shown
    return outs


def processes_with(marker):
    """Pids whose command line holds ``marker`` (zombies too: their command line reads empty, so not)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids
