"""Runs that survive being stopped: SIGTERM / SIGINT save and stop at a step boundary, periodic saves
by time, a non-finite stop that resumes to the clean run, and tiny runs killed with SIGTERM and
SIGKILL at seeded random points that resume to the uninterrupted run's parameters and metrics, bit
for bit."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rljax.config import ConfigError, from_yaml, load_config
from rljax.run_config import RunConfig
from rljax.training import OnlineTrainer, Preempted
from rljax.update import NonFiniteLossError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a reward every process knows (the subprocesses do not import the tests' registrations): the
# completion's length in characters, which varies within a group, so every step updates
CONFIG = """
model: {{name: {model}}}
data: {{task: addition, train_size: 64, eval_size: 8, max_prompt_length: 64}}
sampling: {{max_new_tokens: 8}}
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 4, micro_batch_size: 8}}
optim: {{learning_rate: 1.0e-2}}
train: {{steps: {steps}, run_dir: {run_dir}, progress: false, samples_every: 2, save_every: {save_every}}}
rewards: {{chars: {{type: length, unit: chars, weight: 0.1}}}}
"""


def _cfg(tiny_dir, run_dir, *, steps=4, save_every="null", **train):
    cfg = from_yaml(RunConfig, CONFIG.format(model=tiny_dir, steps=steps, run_dir=run_dir, save_every=save_every))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _untimed(records):
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith("time/")} for r in records]


def _committed_steps(run_dir):
    """Steps of the committed checkpoints (orbax renames a step's directory into place when done)."""
    directory = os.path.join(run_dir, "checkpoints")
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(directory) else []


def _assert_same_leaves(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------- in process


@pytest.fixture
def outer_handlers():
    """Handlers of this process's own for SIGTERM and SIGINT while a test runs (a signal that fit
    failed to catch lands here instead of ending the test session); fit must put them back."""
    caught, previous = [], {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def outer(signum, frame):
        caught.append(signum)

    for s in previous:
        signal.signal(s, outer)
    yield outer, caught
    for s, handler in previous.items():
        signal.signal(s, handler)


def test_sigterm_saves_at_the_step_boundary_and_raises_preempted(tiny_dir, tmp_path, outer_handlers):
    outer, caught = outer_handlers
    trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path, steps=6))

    def signal_during_step_2(logger):  # after step 2's log line, inside the loop: the signal is noted only
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.on_step = signal_during_step_2
    with pytest.raises(Preempted, match="received SIGTERM at step 2: checkpoint saved") as stop:
        trainer.fit()
    assert (stop.value.signum, stop.value.step) == (signal.SIGTERM, 2)
    assert _committed_steps(tmp_path) == [2]  # save_every is null: this is the stop's save, committed
    assert [m["step"] for m in _lines(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert caught == [] and signal.getsignal(signal.SIGTERM) is outer  # fit's handler is gone
    # and it resumes from there: the data position and step of the saved checkpoint
    resumed = OnlineTrainer(_cfg(tiny_dir, tmp_path, steps=6), resume=True)
    assert resumed.step == 2 and resumed.iterator.state_dict() == trainer.iterator.state_dict()


def test_a_stop_another_process_received_stops_this_one_at_the_same_boundary(tiny_dir, tmp_path, monkeypatch,
                                                                           outer_handlers):
    """In a multi-process run the signal may reach one host only; every process acts on the OR of all
    processes' flags (``rljax.distributed.any_process``), so this process, which received nothing,
    saves and stops at step 2 as the signalled one does (else each waits in a different collective)."""
    import rljax.training.loop as loop

    trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path, steps=6))
    asked = []

    def other_process_signalled_after_step_2(*flags):
        asked.append(trainer.step)
        return (trainer.step == 2,) + tuple(bool(f) for f in flags[1:])

    monkeypatch.setattr(loop, "any_process", other_process_signalled_after_step_2)
    with pytest.raises(Preempted, match="received SIGTERM at step 2: checkpoint saved"):
        trainer.fit()
    assert asked == [0, 1, 2]  # asked at every step boundary, before the step
    assert _committed_steps(tmp_path) == [2]
    assert [m["step"] for m in _lines(tmp_path / "metrics.jsonl")] == [0, 1, 2]


def test_one_sigint_stops_with_a_checkpoint(tiny_dir, tmp_path, outer_handlers):
    outer, caught = outer_handlers
    trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path, steps=6))
    trainer.on_step = lambda logger: trainer.step == 1 and os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(Preempted) as stop:
        trainer.fit()
    assert (stop.value.signum, stop.value.step, _committed_steps(tmp_path)) == (signal.SIGINT, 1, [1])
    assert caught == [] and signal.getsignal(signal.SIGINT) is outer


def test_sighup_of_a_closed_terminal_stops_with_a_checkpoint(tiny_dir, tmp_path, outer_handlers):
    outer, caught = outer_handlers
    trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path, steps=6))
    trainer.on_step = lambda logger: trainer.step == 1 and os.kill(os.getpid(), signal.SIGHUP)
    with pytest.raises(Preempted, match="received SIGHUP at step 1") as stop:
        trainer.fit()
    assert (stop.value.signum, stop.value.step, _committed_steps(tmp_path)) == (signal.SIGHUP, 1, [1])
    assert caught == [] and signal.getsignal(signal.SIGHUP) is outer


def test_an_ignored_sighup_stays_ignored(tiny_dir, tmp_path):
    """Under ``nohup`` SIGHUP is ignored: fit installs no handler for it and leaves it ignored."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path, steps=2))
        seen = []
        trainer.on_step = lambda logger: seen.append(signal.getsignal(signal.SIGHUP))
        trainer.fit()
        assert seen == [signal.SIG_IGN, signal.SIG_IGN] and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_second_sigint_stops_at_once_with_keyboard_interrupt(tiny_dir, tmp_path, outer_handlers):
    outer, caught = outer_handlers
    trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path, steps=6))
    calls = []

    def ctrl_c_twice(logger):
        calls.append(trainer.step)
        os.kill(os.getpid(), signal.SIGINT)  # noted: fit would stop after this step
        os.kill(os.getpid(), signal.SIGINT)  # the user insists: KeyboardInterrupt here

    trainer.on_step = ctrl_c_twice
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert calls == [1] and _committed_steps(tmp_path) == []  # no further step, no save
    assert caught == [] and signal.getsignal(signal.SIGINT) is outer


def test_save_every_minutes_saves_at_step_boundaries_by_time(tiny_dir, tmp_path):
    saved = {}
    for minutes in (1e-9, None):  # due at every boundary; off
        trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path / str(minutes), steps=3, save_every_minutes=minutes))
        real_save, steps = trainer.run.checkpointer.save, []

        def spy(step, *args, real_save=real_save, steps=steps, **kwargs):
            started = real_save(step, *args, **kwargs)
            if started:
                steps.append(step)
            return started

        trainer.run.checkpointer.save = spy
        trainer.fit()
        saved[minutes] = steps
    assert saved == {1e-9: [1, 2, 3], None: [3]}  # the final save: step 3 was already written (1e-9)
    assert RunConfig().train.save_every_minutes == 30.0  # on by default
    with pytest.raises(ConfigError, match=r"train.save_every_minutes: must be > 0"):
        from_yaml(RunConfig, "train: {save_every_minutes: 0}\nrewards: {answer: 1.0}")


def test_a_non_finite_stop_resumes_to_the_clean_run(tiny_dir, tmp_path):
    # The fault: step 3's update sees NaN advantages (a transient fault, e.g. a reward that was NaN
    # once); the update is refused and the run stops. step_once has already drawn step 3's prompts,
    # so the checkpoint must hold the data position before them: the resumed run (fault gone)
    # repeats step 3 with the same prompts and ends where the clean run ends, bit for bit.
    clean = OnlineTrainer(_cfg(tiny_dir, tmp_path / "clean", steps=5))
    clean.fit()

    faulty = OnlineTrainer(_cfg(tiny_dir, tmp_path / "faulty", steps=5))
    real_update = faulty.update_epochs

    def nan_at_step_3(batch):
        if faulty.step == 2:  # the third step
            batch = batch.replace(advantages=batch.advantages * jnp.nan)
        return real_update(batch)

    faulty.update_epochs = nan_at_step_3
    with pytest.raises(NonFiniteLossError, match="not finite"):
        faulty.fit()
    assert _committed_steps(tmp_path / "faulty") == [2]

    resumed = OnlineTrainer(_cfg(tiny_dir, tmp_path / "faulty", steps=5), resume=True)
    assert resumed.step == 2
    resumed.fit()
    _assert_same_leaves(resumed.run.state(), clean.run.state())
    for name in ("metrics.jsonl", "samples.jsonl"):
        assert _untimed(_lines(tmp_path / "faulty" / name)) == _untimed(_lines(tmp_path / "clean" / name)), name


def test_a_non_finite_stop_after_applied_updates_saves_nothing(tiny_dir, tmp_path, capsys):
    # Two updates a step (num_iterations: 2); the second is refused at step 2, after the first was
    # applied. That state is neither step 2's start nor its end, so no checkpoint of it can resume as
    # a clean run would: nothing is saved and the message names the last clean checkpoint (step 1).
    cfg = _cfg(tiny_dir, tmp_path / "run", steps=3, save_every=1)
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, num_iterations=2))
    trainer = OnlineTrainer(cfg)
    real_update = trainer.update_epochs

    def second_update_refused_at_step_2(batch):
        metrics = real_update(batch)
        if trainer.step == 1:
            metrics.update(nonfinite=1.0, updates_applied=1)
        return metrics

    trainer.update_epochs = second_update_refused_at_step_2
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit()
    assert err.value.updates_applied == 1
    assert _committed_steps(tmp_path / "run") == [1]
    assert "1 earlier update(s) of this step were applied, so this state is not saved; the last clean state is " \
           "checkpoint 1" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- processes


def _train_cmd(config, *extra):
    return [sys.executable, "-m", "rljax", "train", str(config), *extra]


def _env(tmp_path):
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                RLJAX_KEEP_HOST_MEMORY="0",
                # the tests' JAX settings (tests/conftest.py), so every process computes alike;
                JAX_DEFAULT_MATMUL_PRECISION="highest", JAX_NUMPY_RANK_PROMOTION="raise",
                # and one compilation cache: the processes after the first load their programs
                # (the same programs they would compile) instead of compiling them again
                JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


def _wait_for(condition, proc, log):
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before it could be stopped:\n"
                                 f"{log.read_text()[-3000:]}")
        time.sleep(0.02)


@pytest.mark.slow
def test_runs_killed_with_sigterm_and_sigkill_resume_to_the_uninterrupted_run(tiny_dir, tmp_path):
    steps = 24
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(model=tiny_dir, steps=steps, run_dir=tmp_path / "unused", save_every=1))
    env = _env(tmp_path)
    run_dir, metrics = tmp_path / "interrupted", tmp_path / "interrupted" / "metrics.jsonl"

    rng = random.Random(16)  # the points: a few steps past the last one reached, then a delay
    start_step = reached = 0
    for i, signum in enumerate([signal.SIGKILL, signal.SIGTERM, signal.SIGKILL]):
        log = tmp_path / f"process{i}.log"  # a file, not a pipe: nothing blocks the run's output
        with open(log, "w") as out:
            proc = subprocess.Popen(_train_cmd(config, f"train.run_dir={run_dir}", *(["--resume"] if i else [])),
                                    env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
        # past every step logged before, so the line is this process's; a SIGKILL also waits for a
        # checkpoint past the start, so each process leaves progress behind
        target = reached + rng.randint(1, 3)
        _wait_for(lambda: metrics.exists() and max([m["step"] for m in _lines(metrics)], default=-1) >= target
                  and (signum == signal.SIGTERM or _committed_steps(run_dir)[-1:] > [start_step]), proc, log)
        time.sleep(rng.uniform(0.0, 0.15))  # mid-step, mid-save or between
        proc.send_signal(signum)
        proc.wait()
        out = log.read_text()
        reached = max(m["step"] for m in _lines(metrics))
        if signum == signal.SIGTERM:
            assert proc.returncode == 143, out[-3000:]
            assert _committed_steps(run_dir)[-1] == reached < steps  # saved where it stopped
            last = out.strip().splitlines()[-1]
            assert f"stopped by SIGTERM at step {reached} of {steps}" in last and last.endswith("--resume"), last
        else:
            assert proc.returncode == -signal.SIGKILL
        assert _committed_steps(run_dir)[-1] > start_step
        start_step = _committed_steps(run_dir)[-1]

    done = subprocess.run(_train_cmd(config, f"train.run_dir={run_dir}", "--resume"), env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

    # the uninterrupted run, in this process (the subprocesses have its JAX settings)
    reference = OnlineTrainer(load_config(RunConfig, str(config), [f"train.run_dir={tmp_path / 'uninterrupted'}"]))
    reference.fit()
    final = ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(steps) / "state")
    _assert_same_leaves(final, reference.run.state())
    for name in ("metrics.jsonl", "samples.jsonl"):
        assert _untimed(_lines(run_dir / name)) == _untimed(_lines(tmp_path / "uninterrupted" / name)), name
    assert len(_lines(metrics)) == steps + 2  # and the evaluations before and after
