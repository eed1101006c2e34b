"""`rljax train` on a (data=1, fsdp=4, tensor=2) mesh of 8 simulated CPU devices, in one process (DPO,
PPO) or two (GRPO: jax.distributed over gloo, 127.0.0.1, under a CPU burner), and resumed from 4 devices
onto 8 (GRPO), equals the one-device run.

The one-device run is this process's (the test suite sees one CPU device); the others are
`python -m rljax train` in subprocesses with XLA_FLAGS=--xla_force_host_platform_device_count=N
(the device count is fixed when jax is imported). Same config, same seed: every metric in
metrics.jsonl and every final parameter (RUN_DIR/model) must agree. Sharded = one device is an algebraic
equality, so the runs are in float64 (``model.dtype: float64``, JAX_ENABLE_X64=1), where it holds to ~1e-12
on every host; the sampler keeps its log-probs in float32, which both runs round alike.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from rljax.config import ConfigError, load_config
from rljax.run_config import RunConfig
from rljax.training import trainer_for
from tests._processes import cpu_burner, run_joined, xla_flags
from tests._tiny import make_tiny_model_dir
from tests.integration.test_dpo import toy_pairs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EIGHT = ["mesh.fsdp=4", "mesh.tensor=2"]

# {engine}: a run over several processes samples with the static sampler (the rollout engine drives
# one host's devices), so the GRPO case, compared with a two-process run, uses it in every run
ONLINE = """
model: {{name: {model}, dtype: {dtype}}}
data: {{task: addition, train_size: 32, eval_size: 8, max_prompt_length: 64}}
sampling: {{max_new_tokens: 6, engine: {engine}}}
algorithm: {{name: {algo}, group_size: 4, prompts_per_step: 2, micro_batch_size: 4, kl_coef: 0.01 {extra}}}
optim: {{learning_rate: 1.0e-4}}
train: {{steps: 3, run_dir: {run_dir}, progress: false, plot: false}}
rewards: {{length: {{weight: 1.0, unit: chars, normalize: 20}}}}
"""
DPO = """
model: {{name: {model}, dtype: {dtype}}}
data: {{task: "", path: {pairs}, eval_size: 16, max_prompt_length: 64, eval_fraction: 0.2}}
algorithm: {{name: dpo, batch_size: 8, micro_batch_size: 4, max_completion_length: 12, beta: 0.5}}
optim: {{learning_rate: 1.0e-4}}
train: {{steps: 3, run_dir: {run_dir}, progress: false, plot: false}}
"""
# In float32, Adam moved an element whose true gradient is ~0 (an embedding row no sampled token uses)
# by +-lr on the sign of summation noise, which differs between one device and eight (1 of 16,576
# embedding elements 1.2e-5 apart at lr 1e-3); in float64 that noise is ~1e-16, far below Adam's eps.
TOLERANCE = 1e-12
CASES = {
    "grpo": (ONLINE, dict(algo="grpo", extra="", engine="static")),
    "ppo_shared": (ONLINE, dict(algo="ppo", extra="", engine="paged")),
    "ppo_separate": (ONLINE, dict(algo="ppo", extra=", critic: separate", engine="paged")),
    "dpo": (DPO, {}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _env(devices):
    return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
                PYTHONPATH=REPO, RLJAX_PLOT="0", JAX_ENABLE_X64="1")


def _train(config, run_dir, *args, devices=8):
    """`rljax train CONFIG train.run_dir=RUN_DIR ARGS` in a process that sees ``devices`` CPU devices."""
    result = subprocess.run([sys.executable, "-m", "rljax", "train", str(config), f"train.run_dir={run_dir}",
                             *args], capture_output=True, text=True, env=_env(devices), cwd=REPO,
                            timeout=1800)  # a hang guard, not a time limit
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def _train_two_processes(config, run_dir, *args):
    """The same command as 2 processes × 4 devices forming one 8-device runtime on 127.0.0.1, on a loaded
    host: a CPU burner spins beside them (tests/_processes.py), so the suite's one two-process run is also
    its one loaded try at a hang (the stress loop: experiments/reliability/hang_stress.py)."""
    os.makedirs(f"{run_dir}.logs")
    with cpu_burner():
        # run_joined's hang guard (900 s) ends a hung run with every process's stacks in the failure
        outs = run_joined(lambda port: [
            [sys.executable, "-m", "rljax", "train", str(config), f"train.run_dir={run_dir}", *args,
             "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
            for i in range(2)], f"{run_dir}.logs", env=_env(4), cwd=REPO)
    return outs[0]


def _assert_same_run(one, other, case, *, stopped_at=None):
    """Every metric of every logged step (:data:`TOLERANCE`) and every final parameter (to float32 rounding)
    of two run directories (``stopped_at``: ``other`` stopped there once, logging an evaluation the
    uninterrupted run has not)."""
    m1, m8 = _metrics(one), _metrics(other)
    m8 = [m for m in m8 if not (m["step"] == stopped_at and all(k.startswith(("eval/", "time")) or k == "step"
                                                                  for k in m))]
    assert [m["step"] for m in m1] == [m["step"] for m in m8]
    compared = 0
    for a, b in zip(m1, m8):
        assert a.keys() == b.keys(), (a["step"], a.keys() ^ b.keys())
        for key, value in a.items():
            if key.startswith("time") or not isinstance(value, (int, float)):
                continue
            if case == "dpo" and key == "rewards/accuracy" and a["step"] == 1:
                # the first update's policy is the reference: every margin is rounding noise around 0
                # (the cached reference log-probs come from other batches), so the fraction of
                # margins above 0 is noise even between two one-device runs (measured 0.125 vs 0.25)
                continue
            assert b[key] == pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE), (case, a["step"], key)
            compared += 1
    assert compared > 40
    p1 = load_file(str(one / "model" / "model.safetensors"))
    p8 = load_file(str(other / "model" / "model.safetensors"))
    # RUN_DIR/model holds the float64 parameters rounded to float32 (the exported model's dtype): parameters
    # that agree to ~1e-15 round to the same float32, or (one in the last place) to its neighbour
    assert p1.keys() == p8.keys() and {str(p.dtype) for p in p1.values()} == {"float32"}
    for key in p1:
        np.testing.assert_allclose(p8[key], p1[key], rtol=2**-23, atol=0, err_msg=key)


def _config(tmp_path, case, model_dir, dtype="float64"):
    template, fields = CASES[case]
    config = tmp_path / "run.yaml"
    config.write_text(template.format(model=model_dir, run_dir="unused", pairs=toy_pairs(tmp_path / "pairs.jsonl"),
                                      dtype=dtype, **fields))
    return config


def _one_device_run(config, run_dir, model_dir):
    with jax.enable_x64(True):  # the config's float64 (the subprocesses: JAX_ENABLE_X64=1)
        trainer_for(load_config(RunConfig, str(config), [f"train.run_dir={run_dir}"])).fit()
    start = load_file(os.path.join(model_dir, "model.safetensors"))
    trained = load_file(str(run_dir / "model" / "model.safetensors"))
    assert max(float(np.max(np.abs(trained[k] - start[k]))) for k in start if k in trained) > 1e-4  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dpo", "ppo_separate",
                                  # heavy (39 s in CI): the PPO step on the mesh is ppo_separate's, whose
                                  # critic is a second sharded model; the shared head is one more
                                  # [D] parameter of the policy (its single-device runs: test_train.py)
                                  pytest.param("ppo_shared", marks=pytest.mark.heavy)])
def test_a_run_on_eight_devices_equals_one_device(case, model_dir, tmp_path):
    config = _config(tmp_path, case, model_dir)
    _one_device_run(config, tmp_path / "one", model_dir)
    log = _train(config, tmp_path / "eight", *EIGHT)
    assert "mesh data=1 fsdp=4 tensor=2 over 8 cpu devices" in log
    _assert_same_run(tmp_path / "one", tmp_path / "eight", case)


@pytest.mark.slow
def test_grpo_on_eight_devices_in_two_processes_and_resumed_from_four(model_dir, tmp_path):
    # (eight devices in one process: the other algorithms' test above; the suite's time is kept for these)
    config = _config(tmp_path, "grpo", model_dir)
    _one_device_run(config, tmp_path / "one", model_dir)

    log = _train_two_processes(config, tmp_path / "two", *EIGHT)
    assert "mesh data=1 fsdp=4 tensor=2 over 8 cpu devices in 2 processes" in log
    _assert_same_run(tmp_path / "one", tmp_path / "two", "grpo")

    # a checkpoint written on 4 devices (fsdp=4) resumes on 8 (fsdp=4, tensor=2) into the same run
    resumed = tmp_path / "resumed"
    _train(config, resumed, "train.steps=2", "mesh.fsdp=4", devices=4)
    _train(config, resumed, *EIGHT, "--resume", devices=8)
    _assert_same_run(tmp_path / "one", resumed, "grpo", stopped_at=2)


def test_a_mesh_that_does_not_fit_the_devices_is_refused_naming_the_setting(model_dir, tmp_path):
    config = _config(tmp_path, "grpo", model_dir, dtype="float32")
    with pytest.raises(ConfigError, match=r"mesh: mesh \{'data': 1, 'fsdp': 1, 'tensor': 2\} needs 2 devices, but 1 "
                                          r"are given .*jax sees 1 device\(s\): cpu"):
        trainer_for(load_config(RunConfig, str(config), [f"train.run_dir={tmp_path / 'run'}", "mesh.fsdp=1",
                                                         "mesh.tensor=2"]))
    assert not os.path.exists(tmp_path / "run" / "config.yaml")  # nothing written


@pytest.mark.parametrize("override,message", [
    ("mesh.data=0", "mesh.data: must be a whole number >= 1, or -1"),
    ("mesh.tensor=-1", "mesh.fsdp: at most one mesh axis may be -1"),
    ("mesh.rules={heads: model}", "mesh.rules: heads: 'model' names \\['model'\\], not mesh axes"),
    ("mesh.rules={head: tensor}", "mesh.rules: 'head' is not a logical axis"),
])
def test_bad_mesh_settings_are_refused_at_load(override, message, model_dir, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, str(_config(tmp_path, "grpo", model_dir, dtype="float32")), [override])


def test_rule_overrides_reach_the_parameters(model_dir, tmp_path):
    """`mesh.rules` replaces single rules: the run's parameters are laid out by the merged table."""
    cfg = load_config(RunConfig, str(_config(tmp_path, "grpo", model_dir, dtype="float32")),
                      [f"train.run_dir={tmp_path / 'run'}", "mesh.rules={mlp: fsdp, embed: null}"])
    rules = dict(cfg.mesh.rule_table())
    assert rules["mlp"] == "fsdp" and rules["embed"] is None and rules["heads"] == "tensor"
    trainer = trainer_for(cfg)
    assert dict(trainer.run.rules) == rules
    specs = {str(path): leaf.sharding.spec for path, leaf in
             jax.tree_util.tree_leaves_with_path(trainer.run.policy.params)}
    assert any("w_up" in p and s == P(None, None, "fsdp") for p, s in specs.items()), specs
    trainer.run.close()
