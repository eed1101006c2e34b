"""Numbers a run must not get silently wrong, end to end on the tiny model:

- an update that would make the parameters non-finite (finite loss, NaN learning rate) is refused
  and the step stops with a message saying so, the parameters and optimizer state untouched;
- weights with NaN on disk are refused at load, naming the tensor;
- an infinite reward stops the step before the update with an error naming the function and the
  sample;
- rewards missing (None) on some or all samples: ``eval/<name>`` is the mean over the samples
  scored with ``eval/<name>/missing``, ``eval/reward`` counts missing values as 0 (TRL), the train
  metrics match, and a function that scores nothing is warned about once.
"""

import dataclasses
import logging
import math
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rljax.models import load
from rljax.rewards.base import per_sample, register_reward
from rljax.training import OnlineTrainer
from rljax.update import NonFiniteLossError, make_optimizer
from tests._tiny import make_tiny_model_dir, tiny_run_config


def _lower_frac(completion, example):
    return sum(c.islower() for c in completion) / max(len(completion), 1)


def _none_on_odd_first_operand(completion, example):
    # "What is 12+35?": missing (None) when the first operand is odd, else 1.0
    return None if int(example["prompt"].split()[-1].split("+")[0]) % 2 else 1.0


register_reward("numbers_lower", lambda: per_sample(_lower_frac), overwrite=True)
register_reward("numbers_half_none", lambda: per_sample(_none_on_odd_first_operand), overwrite=True)
register_reward("numbers_all_none", lambda: per_sample(lambda completion, example: None), overwrite=True)
register_reward("numbers_inf_on_third", lambda: lambda completions, examples: np.where(
    np.arange(len(completions)) == 2, np.inf, 0.5), overwrite=True)


def _cfg(tiny_dir, run_dir, *, rewards="{numbers_lower: 1.0}", steps=2):
    # tests._tiny.TINY_RUN, the shapes of tests/integration/test_train.py's runs: a worker that runs both files
    # compiles the sampler once (tests/conftest.py keeps compiled programs until a worker holds many)
    return tiny_run_config(tiny_dir, run_dir, train={"steps": steps}, rewards=rewards)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_a_nan_learning_rate_stops_the_run_with_the_parameters_untouched(tiny_dir, tmp_path):
    cfg = _cfg(tiny_dir, tmp_path)
    trainer = OnlineTrainer(cfg)
    # The optimizer a config with learning_rate: nan builds (set here, past any config check):
    # the loss and gradient stay finite, the step would write NaN into every parameter.
    trainer.run.policy.optimizer = make_optimizer(dataclasses.replace(cfg.optim, learning_rate=float("nan")), 2)
    before = _leaves(trainer.run.policy.params) + _leaves(trainer.run.policy.opt_state)
    with pytest.raises(NonFiniteLossError, match="step 0: the update would make the parameters non-finite"):
        trainer.step_once()  # (fit then saves this state and re-raises: tests/integration/test_train.py)
    assert trainer.run.step == 0
    for got, want in zip(_leaves(trainer.run.policy.params) + _leaves(trainer.run.policy.opt_state), before):
        np.testing.assert_array_equal(got, want)


def test_weights_with_nan_on_disk_are_refused_naming_the_tensor(tmp_path):
    path = make_tiny_model_dir(tmp_path / "model")
    weights_file = os.path.join(path, "model.safetensors")
    tensors = load_file(weights_file)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][3, 5] = np.nan
    save_file(tensors, weights_file)
    with pytest.raises(ValueError, match=rf"{weights_file}: tensor '{name}' .* 1 NaN and 0 inf .*\(3, 5\)"):
        load(path)


def test_an_infinite_reward_stops_the_step_before_the_update_naming_function_and_sample(tiny_dir, tmp_path):
    trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path, rewards="{numbers_lower: 1.0, numbers_inf_on_third: 0.5}"))
    before = _leaves(trainer.run.policy.params)
    with pytest.raises(ValueError, match=r"reward function 'numbers_inf_on_third' returned inf for sample 2 of 16 "
                                         r"\(1 infinite in all\), completion '"):
        trainer.step_once()
    assert trainer.run.step == 0
    for got, want in zip(_leaves(trainer.run.policy.params), before):
        np.testing.assert_array_equal(got, want)


def test_missing_rewards_in_eval_and_train_metrics_follow_trl(tiny_dir, tmp_path, caplog):
    rewards = "{numbers_lower: 1.0, numbers_half_none: 0.5, numbers_all_none: 0.25}"
    trainer = OnlineTrainer(_cfg(tiny_dir, tmp_path, rewards=rewards))
    with caplog.at_level(logging.WARNING, logger="rljax.rewards.base"):
        results = trainer.evaluate()
        metrics = trainer.step_once()
    rolls = trainer.last_eval_rollouts
    lower = np.concatenate([r.per_function["numbers_lower"] for r in rolls])
    half = np.concatenate([r.per_function["numbers_half_none"] for r in rolls])
    odd = np.array([int(ex["prompt"].split()[-1].split("+")[0]) % 2 == 1 for r in rolls for ex in r.examples])
    assert 0 < odd.sum() < len(odd)  # the held-out prompts have both kinds
    np.testing.assert_array_equal(np.isnan(half), odd)
    # per function: the mean over the samples it scored, and the fraction it missed
    assert results["eval/numbers_lower"] == pytest.approx(lower.mean())
    assert "eval/numbers_lower/missing" not in results
    assert results["eval/numbers_half_none"] == 1.0
    assert results["eval/numbers_half_none/missing"] == pytest.approx(odd.mean())
    assert math.isnan(results["eval/numbers_all_none"]) and results["eval/numbers_all_none/missing"] == 1.0
    # the combined reward counts a missing value 0 (TRL nansum): Σ_k w_k (1 − missing_k) mean_k
    want = lower.mean() + 0.5 * (1 - odd.mean()) * 1.0
    assert results["eval/reward"] == pytest.approx(want, rel=1e-6)
    # the train metrics use the same definitions
    assert metrics["reward/numbers_half_none/mean"] == 1.0 and 0 <= metrics["reward/numbers_half_none/missing"] <= 1
    assert math.isnan(metrics["reward/numbers_all_none/mean"]) and metrics["reward/numbers_all_none/missing"] == 1.0
    assert metrics["reward/missing_count"] == 16.0  # every row misses numbers_all_none: none is trained on
    assert np.isfinite(metrics["loss"])
    # one warning for the function that scored nothing, though it did so on every batch
    warned = [r.getMessage() for r in caplog.records if "scored none of the" in r.getMessage()]
    assert len(warned) == 1 and "'numbers_all_none'" in warned[0], warned
