"""Disaggregated asynchronous RL (mesh.rollout_devices) on simulated CPU devices, in subprocesses
(the device count is fixed at JAX's start): 4 devices generate and 4 train, weights resharded after
every update; the run equals the same asynchronous run colocated on one 4-device mesh, bit for bit
(the same programs on other devices); bad rollout_devices are refused naming the key."""

import json
import os
import subprocess
import sys

import pytest

from tests._processes import xla_flags

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


def _check(mode: str, devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
               RLJAX_PLOT="0")
    result = subprocess.run([sys.executable, os.path.join(HERE, "_async_disaggregated_check.py"), mode],
                            capture_output=True, text=True, env=env, cwd=os.path.dirname(HERE),
                            timeout=1200)  # a hang guard
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _untimed(steps):
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith(("time/", "async/queue_batches"))}
            for m in steps]


@pytest.mark.heavy
def test_disaggregated_run_equals_the_colocated_one_and_refuses_bad_rollout_devices():
    split = _check("disaggregated", 8)
    assert split["devices"] == 8
    assert split["rollout_mesh"] == [0, 1, 2, 3] and split["train_mesh"] == [4, 5, 6, 7]
    assert split["train_devices"] == [4, 5, 6, 7] and split["sampler_devices"] == [0, 1, 2, 3]
    steps = split["steps"]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert [m["async/staleness_max"] for m in steps] == [0, 1, 1]  # v(s) = max(0, s - 1)
    assert all(m["time/weight_sync_s"] > 0 for m in steps)  # a transfer to the other devices, timed
    errors = split["errors"]
    assert errors["8"].startswith("mesh.rollout_devices: 8 rollout device(s) leave no training device")
    assert errors["3"].startswith("mesh.rollout_devices: 3 rollout device(s) leave 5 of 8 for training, which the "
                                  "training mesh (data=1, fsdp=4, tensor=1) does not divide")
    assert errors["0"].startswith("mesh.rollout_devices: must be >= 1")

    together = _check("colocated", 4)
    assert together["train_mesh"] == [0, 1, 2, 3] and together["sampler_devices"] == [0, 1, 2, 3]
    assert _untimed(steps) == _untimed(together["steps"])
    assert split["params"] == together["params"] and split["eval"] == together["eval"]
