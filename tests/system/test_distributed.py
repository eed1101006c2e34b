"""rljax.distributed: finding a cluster, refusing half-given process settings, and `any_process`,
the OR over processes that keeps every process acting on the same stop / save decision (checked in
two real processes joined by jax.distributed over gloo on 127.0.0.1)."""

import os
import sys

import pytest

from rljax.distributed import any_process, cluster_detected, initialize
from rljax.errors import UserError
from tests._processes import run_joined

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    outs = run_joined(lambda port: [[sys.executable, "-c", _TWO, str(port), str(i)] for i in range(2)], str(tmp_path),
                      env=env, cwd=REPO, timeout_s=300)
    for out in outs:
        # process 0 alone raised the first flag of the first call, process 1 alone the second of the second
        assert "(True, False) (False, True) (False, False)" in out, out[-3000:]
