"""The GRPO train step on 8 simulated CPU devices (fsdp=4, tensor=2) equals the one-device step.

Heavy (29 s in CI): the update alone, from before any trainer ran on a mesh. tests/system/test_mesh_train.py
now runs whole GRPO, PPO and DPO runs on the same mesh (sampling, updates, evaluation, checkpoints,
export) and compares every metric and final parameter with one device, which covers this.
"""

import json
import os
import subprocess
import sys

import pytest
from tests._processes import xla_flags

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


@pytest.mark.heavy
def test_sharded_update_matches_one_device():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, os.path.join(HERE, "_sharded_train_check.py")], capture_output=True,
                            text=True, env=env, cwd=os.path.dirname(HERE), timeout=1800)  # a hang guard
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8 and report["param_dtypes"] == ["float64"]  # an algebraic equality, in float64
    assert report["wq_spec"][:3] == [None, "fsdp", "tensor"]  # the parameters really are sharded
    assert report["max_param_update"] > 1e-2  # the step (SGD, lr 1: the gradient) moved the parameters ...
    # ... identically on one device and on eight, to float64 rounding (measured 2.2e-15 of an update of 1.34)
    assert report["max_param_diff"] < 1e-12 * report["max_param_update"]
    for key, diff in report["metric_diffs"].items():
        assert diff <= 1e-12 * max(1.0, abs(report["metrics"][key])), (key, diff)
