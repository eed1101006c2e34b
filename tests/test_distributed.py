"""rljax.distributed: finding a cluster, refusing half-given process settings, and `any_process`,
the OR over processes that keeps every process acting on the same stop / save decision (checked in
two real processes joined by jax.distributed over gloo on 127.0.0.1)."""

import os
import socket
import subprocess
import sys

import pytest

from rljax.distributed import any_process, cluster_detected, initialize
from rljax.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("environ,expected", [
    ({}, False),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}, True),
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, False),  # one task: nothing to join
    ({"SLURM_NTASKS": "4"}, False),  # an allocation, not a job step
    ({"TPU_WORKER_HOSTNAMES": "t-0,t-1"}, True),
    ({"TPU_WORKER_HOSTNAMES": "t-0"}, False),  # a single-host TPU VM
])
def test_cluster_detected(environ, expected):
    assert cluster_detected(environ) is expected


@pytest.mark.parametrize("args,message", [
    (("127.0.0.1:1234", 2, None), "missing --process-id"),
    ((None, None, 0), "missing --coordinator-address, --num-processes"),
    (("127.0.0.1", 2, 0), "--coordinator-address must be HOST:PORT, got '127.0.0.1'"),
    (("127.0.0.1:1234", 2, 2), r"--process-id must be in \[0, --num-processes=2\), got 2"),
])
def test_half_given_process_settings_are_refused_before_anything_starts(args, message):
    with pytest.raises(UserError, match=message):
        initialize(*args)


def test_any_process_in_one_process_is_the_flags_themselves():
    assert any_process(True, False) == (True, False)
    assert any_process(0, 1) == (False, True)


_TWO = """
import sys
from rljax.distributed import any_process, initialize
port, pid = sys.argv[1], int(sys.argv[2])
assert initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=120)
print(any_process(pid == 0, False), any_process(False, pid == 1), any_process(False, False), flush=True)
"""


def test_any_process_is_the_or_over_two_processes(tmp_path):
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, PYTHONFAULTHANDLER="1")
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):  # files, not pipes: an unread pipe can block a process mid-collective
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-c", _TWO, str(port), str(i)], stdout=out,
                                          stderr=subprocess.STDOUT, env=env, cwd=REPO))
    try:
        for p in procs:
            p.wait(timeout=300)  # a hang guard, not a time limit
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        out = log.read_text()
        assert p.returncode == 0, out[-3000:]
        # process 0 alone raised the first flag of the first call, process 1 alone the second of the second
        assert "(True, False) (False, True) (False, False)" in out, out[-3000:]
