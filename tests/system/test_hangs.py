"""Multi-process runs never hang: a killed process, the watchdog on an injected hang
(``rljax.training.watchdog``) and SIGTERM during one. (A two-process run under a CPU burner:
tests/system/test_mesh_train.py's two-process run, which must also equal the one-device run.)

Every run here is a `python -m rljax train` subprocess of the tiny model; each wait is bounded
(a hang guard whose expiry fails the test with the processes' stacks, tests/_processes.py).
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from experiments.reliability.hang_stress import GRPO, LENGTH
from tests._processes import abort_unfinished, start_joined, xla_flags
from tests._tiny import make_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a reward that blocks for ever from its `block_at`-th call on, after touching `marker`: a step that hangs
HANGING_REWARD = '''
import os, time
calls = []
def reward(completions, **kwargs):
    calls.append(1)
    if len(calls) >= {block_at}:
        open({marker!r}, "w").close()
        while True:
            time.sleep(1)
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def _env(devices):
    return dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
                PYTHONPATH=REPO, RLJAX_PLOT="0", PYTHONFAULTHANDLER="1")


def _config(tmp_path, model_dir, *, steps=2, rewards=LENGTH):
    config = tmp_path / "run.yaml"
    config.write_text(GRPO.format(model=model_dir, steps=steps, rewards=rewards))
    return config


def _two_process_argv(config, run_dir, port, *args):
    return [[sys.executable, "-m", "rljax", "train", str(config), f"train.run_dir={run_dir}", "mesh.fsdp=4",
             "mesh.tensor=2", *args, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i)] for i in range(2)]


def _hanging_config(tmp_path, model_dir, *, block_at):
    marker = tmp_path / "blocked"
    (tmp_path / "hang_reward.py").write_text(HANGING_REWARD.format(block_at=block_at, marker=str(marker)))
    rewards = "{stuck: {type: python, function: '%s:reward'}}" % (tmp_path / "hang_reward.py")
    return _config(tmp_path, model_dir, steps=5, rewards=rewards), marker


def _last_line(text):
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_a_killed_process_ends_the_survivor_within_two_minutes_with_one_line(model_dir, tmp_path):
    config = _config(tmp_path, model_dir, steps=500)
    run_dir = tmp_path / "run"
    # a 15 s heartbeat instead of the default 60: the survivor's watcher speaks ~15-20 s after the death
    # (JAX's coordination service, rljax.distributed), where the default had the test wait 60 s idle
    procs, paths = start_joined(lambda port: _two_process_argv(config, run_dir, port, "--heartbeat-timeout-s", "15"),
                                str(tmp_path), env=_env(4), cwd=REPO)
    logs = [tmp_path / os.path.basename(path) for path in paths]
    try:
        deadline = time.monotonic() + 900
        metrics = run_dir / "metrics.jsonl"
        # wait for two training steps (step 0 is the first evaluation)
        while not (metrics.exists() and metrics.read_text().count('"step"') >= 3):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [path.read_text()[-3000:] for path in logs]
            time.sleep(0.5)
        procs[1].kill()
        killed = time.monotonic()
        procs[0].wait(timeout=180)
        took = time.monotonic() - killed
    finally:
        abort_unfinished(procs)
    out = logs[0].read_text()
    assert took < 120, (took, out[-3000:])
    assert procs[0].returncode == 75, out[-3000:]
    line = _last_line(out)
    assert line.startswith("rljax: process 0 of 2 lost contact with process 1 ("), out[-3000:]
    # whichever told it first: a failed collective (at once) or the watcher, after the 15 s given
    assert "no heartbeat for" not in line or "(no heartbeat for 15 s: " in line, line
    assert "--resume" in line and f"train.run_dir={run_dir}" in line, line
    assert "Traceback" not in out and "Check failure" not in out, out[-3000:]


def test_the_watchdog_ends_a_hung_step_with_every_thread_stack(model_dir, tmp_path):
    # reward calls: the first evaluation, step 1, step 2. It hangs in step 2, whose programs step 1
    # compiled, so the deadline needs to stay above a tiny step's run time only, not above compiles
    # (a hang in the first evaluation needed 90 s for its compiles on a loaded host, idle time of the suite)
    config, marker = _hanging_config(tmp_path, model_dir, block_at=3)
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "rljax", "train", str(config), f"train.run_dir={run_dir}",
                             "train.hang_timeout_s=30"], capture_output=True, text=True, env=_env(1), cwd=REPO,
                            timeout=900)
    assert marker.exists(), result.stderr[-3000:]  # it hung where the test made it hang
    assert result.returncode == 75, result.stderr[-3000:]
    line = _last_line(result.stderr)
    stacks = run_dir / "hang_stacks.process0.txt"
    assert line.startswith("rljax: no progress for 30 s (train.hang_timeout_s) during step 2; every "
                           "thread's "
                           f"stack is in {stacks}"), line
    text = stacks.read_text()
    assert "hang_reward.py" in text and "in reward" in text, text  # the hung frame
    assert "rljax-watchdog" in text or "Thread 0x" in text  # every thread, not the main one only
    assert time.monotonic() - start < 900


def test_sigterm_during_a_hung_step_exits_within_the_stop_timeout(model_dir, tmp_path):
    config, marker = _hanging_config(tmp_path, model_dir, block_at=2)
    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "rljax", "train", str(config),
                                 f"train.run_dir={run_dir}", "train.stop_timeout_s=10"],
                                stdout=f, stderr=subprocess.STDOUT, env=_env(1), cwd=REPO)
    try:
        deadline = time.monotonic() + 900
        while not marker.exists():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert 10 <= took < 20, (took, out[-3000:])
    line = _last_line(out)
    assert line.startswith("rljax: SIGTERM 10 s ago and no step boundary since (train.stop_timeout_s) during "
                           "step 1; every thread's stack is in"), line
    assert "in reward" in (run_dir / "hang_stacks.process0.txt").read_text()
