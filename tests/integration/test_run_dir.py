"""One run per run directory: refusal, --overwrite, the lock, the resume config check, convert
--overwrite, and the fall-back from a damaged latest checkpoint."""

import dataclasses
import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.tools import cli
from rljax.checkpoint import Checkpointer, CheckpointReadError
from rljax.config import from_yaml, save_config
from rljax.run_config import RunConfig
from rljax.training import trainer_for
from rljax.training.run_dir import (LOCK_FILE, RunDirError, RunDirLock, check_fresh, clear_run, config_dict,
                                    config_differences, existing_run)
from tests._tiny import tiny_run_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(tiny_dir, run_dir, *, steps=1, save_every="null", lr="1.0e-2", seed=0):
    # tests._tiny.TINY_RUN, the shapes of tests/integration/test_train.py's runs: a worker that runs both files
    # compiles them once (tests/conftest.py keeps compiled programs until a worker holds many)
    return tiny_run_config(tiny_dir, run_dir, optim=f"{{learning_rate: {lr}}}", rewards={"length": 1.0},
                           train=f"{{steps: {steps}, seed: {seed}, save_every: {save_every}, samples_every: 5}}")


def _with_train(cfg, **changes):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def _metric_steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ---------------------------------------------------------------- 1. one run per directory


def test_what_counts_as_a_run_and_what_overwrite_deletes(tmp_path):
    check_fresh(tmp_path, resume=False, overwrite=False)  # empty: fine
    (tmp_path / "config.yaml").write_text("train: {}\n")  # a run that failed before step 0: nothing to lose
    (tmp_path / "metrics.jsonl").write_text("")
    assert existing_run(tmp_path) == []
    check_fresh(tmp_path, resume=False, overwrite=False)
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "2").mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    with pytest.raises(RunDirError, match=rf"run_dir {tmp_path} already holds a run \(checkpoints at steps \[2, 4\], "
                                          r"metrics.jsonl with 2 line\(s\), config.yaml\); pass --resume .* --overwrite"):
        check_fresh(tmp_path, resume=False, overwrite=False)
    check_fresh(tmp_path, resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="--resume and --overwrite exclude each other"):
        check_fresh(tmp_path, resume=True, overwrite=True)

    for name in ("samples.jsonl", "summary.json", "eval_samples_step2.jsonl", "curves.png", "notes.txt", LOCK_FILE):
        (tmp_path / name).write_text("x")
    for folder in ("tensorboard", "model", "my_plots"):
        (tmp_path / folder).mkdir()
    assert clear_run(tmp_path) == ["my_plots", "notes.txt"]  # what rljax did not write stays, and is named
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "my_plots", "notes.txt"]


def test_a_fresh_run_into_a_used_directory_is_refused_and_overwrite_starts_over(tiny_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    trainer_for(_cfg(tiny_dir, run_dir)).fit()
    (run_dir / "notes.txt").write_text("mine")
    config = tmp_path / "again.yaml"  # the same command from the shell history, another seed
    save_config(_with_train(_cfg(tiny_dir, run_dir), seed=1), config)
    assert cli.main(["train", str(config)]) == 2  # a user error: one last line naming the cause
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(rf"rljax train: error: run_dir {run_dir} already holds a run \(checkpoints at steps \[1\]", last)
    assert "seed: 0" in (run_dir / "config.yaml").read_text()  # the refused run wrote nothing

    assert cli.main(["train", str(config), "--overwrite"]) == 0  # fit released the first run's lock
    assert _metric_steps(run_dir) == [0, 1, 1]  # one run's lines: before, step 1, after
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]
    assert "seed: 1" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit, match="--resume and --overwrite exclude each other"):
        cli.main(["train", str(config), "--resume", "--overwrite"])
    with pytest.raises(SystemExit, match="--resume-step needs --resume"):
        cli.main(["train", str(config), "--resume-step", "1"])
    with pytest.raises(SystemExit, match="--heartbeat-timeout-s must be a whole number of seconds >= 1, got 0"):
        cli.main(["train", str(config), "--resume", "--heartbeat-timeout-s", "0"])
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]  # the refused commands wrote nothing
    assert "seed: 1" in (run_dir / "config.yaml").read_text()
    with pytest.raises(RunDirError, match="exclude each other"):
        trainer_for(_cfg(tiny_dir, run_dir), resume=True, overwrite=True)


# ---------------------------------------------------------------- 2. the lock

_HOLD = """
import sys
from rljax.training.run_dir import RunDirLock
lock = RunDirLock(sys.argv[1])
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_locked_run_dir_is_refused_with_the_holder_named_and_a_dead_holders_lock_is_taken_over(
        tiny_dir, tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=rf"run_dir {tmp_path} is in use by pid {holder.pid} on host \S+ since "):
            trainer_for(_cfg(tiny_dir, tmp_path))
        assert not (tmp_path / "config.yaml").exists()
    finally:
        holder.kill()  # SIGKILL: the holder cannot release; the kernel does
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="rljax.training.run_dir"):
        lock = RunDirLock(tmp_path)
    assert f"taking over the lock left by pid {holder.pid}" in caplog.text
    # flock is per open file: a second lock in this same process conflicts too
    with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()}"):
        RunDirLock(tmp_path)
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean release leaves nothing to take over
    RunDirLock(tmp_path)  # never released, but collected at once: released cleanly too
    assert (tmp_path / LOCK_FILE).read_text() == ""
    caplog.clear()
    with caplog.at_level(logging.WARNING), RunDirLock(tmp_path):
        pass
    assert "taking over" not in caplog.text


# ---------------------------------------------------------------- 3. resume checks the config


def test_resume_refuses_a_changed_config_and_allows_more_steps(tiny_dir, tmp_path, caplog):
    trainer_for(_cfg(tiny_dir, tmp_path, save_every=1)).fit()
    saved = (tmp_path / "config.yaml").read_text()
    changed = _cfg(tiny_dir, tmp_path, steps=2, lr="2.0e-2", seed=3)
    with pytest.raises(RunDirError, match="differs from the one checkpoint step 1") as err:
        trainer_for(changed, resume=True)
    assert "optim.learning_rate: 0.01 -> 0.02" in str(err.value)
    assert "train.seed: 0 -> 3" in str(err.value)
    assert "train.steps" not in str(err.value)
    assert (tmp_path / "config.yaml").read_text() == saved  # rewritten only once the check passes

    more = _with_train(_cfg(tiny_dir, tmp_path, save_every=1), steps=2, eval_every=1, samples_every=None)
    trainer = trainer_for(more, resume=True)
    assert trainer.step == 1
    trainer.fit()
    assert _metric_steps(tmp_path)[-1] == 2 and "steps: 2" in (tmp_path / "config.yaml").read_text()

    # a checkpoint written before configs were stored: resumed (unchecked: another learning rate
    # passes), with a warning
    meta = tmp_path / "checkpoints" / "2" / "metadata" / "metadata"
    stored = json.loads(meta.read_text())
    del stored["config"]
    meta.write_text(json.dumps(stored))
    with caplog.at_level(logging.WARNING):
        trainer = trainer_for(_cfg(tiny_dir, tmp_path, steps=3, lr="2.0e-2"), resume=True)
    assert trainer.step == 2 and "stores no config (written by an older rljax)" in caplog.text
    trainer.run.close()


def test_config_differences_list_every_key_outside_the_allowlist():
    old = {"train": {"steps": 4, "save_every": 2, "save_every_seconds": 60, "seed": 0}, "rewards": {"a": 1.0},
           "optim": {"learning_rate": float("inf")}}
    new = {"train": {"steps": 9, "save_every": 3, "save_every_seconds": 30, "seed": 1}, "rewards": {"b": 1.0},
           "optim": {"learning_rate": 0.1}}
    assert config_differences(config_dict_like(old), config_dict_like(new)) == [
        'optim.learning_rate: "inf" -> 0.1', "rewards.a: 1.0 -> (absent)", "rewards.b: (absent) -> 1.0",
        "train.seed: 0 -> 1"]


def config_dict_like(tree):
    # config_dict's JSON-safe form, from a plain dict: through the same path a checkpoint's takes
    from rljax.training.run_dir import _json_safe

    return json.loads(json.dumps(_json_safe(tree), allow_nan=False))


def test_the_checkpoint_stores_the_resolved_config(tiny_dir, tmp_path):
    cfg = _cfg(tiny_dir, tmp_path)
    trainer_for(cfg).fit()
    stored = json.loads((tmp_path / "checkpoints" / "1" / "metadata" / "metadata").read_text())
    assert stored["config"] == config_dict(cfg) and stored["config"]["optim"]["learning_rate"] == 0.01
    assert from_yaml(RunConfig, json.dumps(stored["config"])) == cfg  # the whole config, round-trips


# ---------------------------------------------------------------- 4. convert --overwrite


def test_convert_refuses_a_non_empty_output_unless_overwrite(tmp_path):
    from tests.system.test_gguf import write_tiny_gguf

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text("{}")  # another model's shard index
    (out / "README.md").write_text("notes")
    with pytest.raises(SystemExit, match=f"{out} is not empty \\(README.md, model.safetensors.index.json\\); "
                                         "pass --overwrite"):
        cli.main(["convert", str(gguf_path), str(out)])
    assert sorted(os.listdir(out)) == ["README.md", "model.safetensors.index.json"]
    assert cli.main(["convert", str(gguf_path), str(out), "--overwrite"]) == 0
    files = os.listdir(out)
    assert "model.safetensors" in files and "config.json" in files and "README.md" in files
    assert "model.safetensors.index.json" not in files  # would make transformers read the old shards
    assert cli.main(["convert", str(gguf_path), str(tmp_path / "fresh")]) == 0  # a new directory needs no flag


# ---------------------------------------------------------------- 6. a damaged latest checkpoint


def _damage(step_dir, how):
    """Truncate or flip bytes in the largest array-data file of a step's state."""
    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True) if os.path.isfile(f)]
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        for i in range(len(data) // 2, len(data) // 2 + 8):
            data[i] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


def test_resume_falls_back_from_a_damaged_latest_step(tiny_dir, tmp_path, caplog):
    clean = tmp_path / "clean"
    full = trainer_for(_cfg(tiny_dir, clean, steps=2, save_every=1))
    full.fit()
    assert sorted(os.listdir(clean / "checkpoints")) == ["1", "2"]
    final = _leaves(full.run.policy.params)

    # the reference: a resume from step 1 exactly, on an intact copy
    shutil.copytree(clean, tmp_path / "exact")
    exact = trainer_for(_cfg(tiny_dir, tmp_path / "exact", steps=2, save_every=1), resume=True, resume_step=1)
    assert exact.step == 1
    exact.fit()
    assert sorted(os.listdir(tmp_path / "exact" / "checkpoints")) == ["1", "2", "2.after-resume-step-1"]
    for a, b in zip(final, _leaves(exact.run.policy.params), strict=True):
        np.testing.assert_array_equal(a, b)  # resuming from step 1 reproduces the uninterrupted run

    for how in ("truncate", "flip"):
        run_dir = tmp_path / how
        shutil.copytree(clean, run_dir)
        _damage(run_dir / "checkpoints" / "2", how)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            trainer = trainer_for(_cfg(tiny_dir, run_dir, steps=2, save_every=1), resume=True)
        assert trainer.step == 1, how
        assert f"checkpoint step 2 in {run_dir / 'checkpoints'} cannot be read" in caplog.text, caplog.text
        assert "trying step 1" in caplog.text and "restoring checkpoint step 1" in caplog.text
        trainer.fit()
        for a, b in zip(final, _leaves(trainer.run.policy.params), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=how)
        assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2", "2.unreadable"]
        assert _metric_steps(run_dir) == [0, 1, 2, 2]  # step 2's lines logged once

    # --resume-step names exactly one step: no fall-back, and the steps that exist are listed
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 7 .*available steps: \[1, 2\]"):
        trainer_for(_cfg(tiny_dir, tmp_path / "flip", steps=2), resume=True, resume_step=7)


def _state(scale):
    # w large enough that its compressed data is the largest file, where a flipped byte reads back
    # as other finite numbers without any error from orbax: only the fingerprint sees it
    return {"w": jnp.arange(2000, dtype=jnp.float32).reshape(40, 50) * scale / 7, "key": jax.random.key(3),
            "b": jnp.ones(3, jnp.bfloat16) * scale}


def test_checkpointer_falls_back_names_every_step_and_restores_a_named_step_exactly(tmp_path, caplog):
    with Checkpointer(tmp_path, save_every=1, max_to_keep=None) as ckpt:
        ckpt.save(1, _state(1.0), {"step": 1})
        ckpt.save(2, _state(2.0), {"step": 2})
        # a non-finite state is never saved by a trainer: on disk it means damage
        ckpt.save(3, {**_state(3.0), "w": jnp.full((40, 50), jnp.nan)}, {"step": 3}, check_finite=False)
    _damage(tmp_path / "2", "flip")
    with Checkpointer(tmp_path, save_every=1, read_only=True) as ckpt, caplog.at_level(logging.WARNING):
        state, meta = ckpt.restore(abstract_state=_state(0.0))
        assert meta == {"step": 1}
        assert np.asarray(state["w"]).tobytes() == np.asarray(_state(1.0)["w"]).tobytes()
        assert [s for s, _ in ckpt.unreadable_steps] == [3, 2]
        assert "step 3" in caplog.text and "non-finite" in caplog.text
        assert "step 2" in caplog.text and "does not match the fingerprint" in caplog.text
        with pytest.raises(CheckpointReadError, match=r"checkpoint step 2 .* cannot be read: .*fingerprint.*"
                                                       r"available steps: \[1, 2, 3\]"):
            ckpt.restore(2, abstract_state=_state(0.0))
    _damage(tmp_path / "1", "truncate")
    with Checkpointer(tmp_path, save_every=1, read_only=True) as ckpt:
        with pytest.raises(CheckpointReadError, match=r"no checkpoint in .* can be read \(step 3: .*; step 2: .*; "
                                                       r"step 1: .*\)"):
            ckpt.restore(abstract_state=_state(0.0))


def test_evaluating_a_run_reads_its_checkpoints_read_only(tiny_dir, tmp_path):
    # `rljax eval --checkpoint RUN_DIR` while RUN_DIR is still training: a writable checkpointer
    # would delete the temporary directory of the save that run has in flight.
    run_dir = tmp_path / "run"
    trainer_for(_cfg(tiny_dir, run_dir)).fit()
    in_flight = run_dir / "checkpoints" / "2.orbax-checkpoint-tmp-1234"
    in_flight.mkdir()
    evaluator = trainer_for(_cfg(tiny_dir, run_dir), resume=True, write_config=False)
    assert evaluator.step == 1 and in_flight.is_dir()
    assert evaluator.run.lock is None
    with RunDirLock(run_dir):  # the directory stays free for the training run
        pass


def test_a_setting_newer_than_the_checkpoint_at_its_default_is_no_difference():
    """A checkpoint written before `model.param_dtype` existed resumes when the setting is at its
    default (what that checkpoint was trained with); another value, or another key, still differs."""
    defaults = {"model": {"param_dtype": None, "dtype": "float32"}, "environment": {"name": ""}}
    old = {"model": {"dtype": "float32"}}
    assert config_differences(old, {"model": {"param_dtype": None, "dtype": "float32"}, "environment": {"name": ""}},
                              defaults=defaults) == []
    assert config_differences(old, {"model": {"param_dtype": "bfloat16", "dtype": "float32"}},
                              defaults=defaults) == ['model.param_dtype: (absent) -> "bfloat16"']
    assert config_differences(old, {"model": {"param_dtype": None, "dtype": "float32"}}) == [
        "model.param_dtype: (absent) -> null"]  # without defaults, every new key is listed


def test_eval_of_a_checkpoint_samples_with_the_runs_sampling_settings(tiny_dir, tmp_path, capsys):
    # the run sampled 8 tokens; the config handed to `rljax eval` says 2: the run's settings are used
    # (8-token completions of a random model: the mean length is well over 2), and said so on stderr;
    # a sampling.* override on the command line still wins
    run_dir = tmp_path / "run"
    trainer_for(_cfg(tiny_dir, run_dir)).fit()
    config = tmp_path / "eval.yaml"
    save_config(dataclasses.replace(_cfg(tiny_dir, tmp_path / "other"),
                                    sampling=dataclasses.replace(_cfg(tiny_dir, run_dir).sampling, max_new_tokens=2)),
                config)
    capsys.readouterr()

    def length(*overrides):
        assert cli.main(["eval", str(config), *overrides, "--checkpoint", str(run_dir)]) == 0
        out, err = capsys.readouterr()
        return float(re.search(r"eval/mean_length\s+([\d.]+)", out).group(1)), err

    mean, err = length()
    assert mean > 2.0, mean
    assert f"# sampling: the run's ({run_dir / 'config.yaml'}); differs from the config's in max_new_tokens=8 " \
           "(config: 2)" in err
    mean, err = length("sampling.max_new_tokens=2")
    assert mean <= 2.0 and "overridden by the command line" in err and "differs" not in err
