"""GRPO variants through the whole loop on a tiny model: DAPO dynamic sampling and overlong masking,
GSPO sequence ratios, dual clip, LoRA."""

import json
import os

import jax
import numpy as np
import pytest

from rljax.config import from_yaml
from rljax.rewards.base import per_sample, register_reward
from rljax.run_config import RunConfig
from rljax.training import OnlineTrainer as Trainer

# Binary and rare: most groups of 4 get all-zero rewards, which dynamic sampling must replace.
register_reward("starts_with_a", lambda: per_sample(lambda c, ex: float(c[:1] in "abc" and len(c) > 0)),
                overwrite=True)


def _run(tiny_dir, run_dir, algorithm, model_extra="", steps=3):
    cfg = from_yaml(RunConfig, f"""
model: {{name: {tiny_dir} {model_extra}}}
data: {{task: addition, train_size: 200, eval_size: 4, max_prompt_length: 64}}
sampling: {{max_new_tokens: 6}}
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 4, {algorithm}}}
optim: {{learning_rate: 1.0e-2}}
train: {{steps: {steps}, run_dir: {run_dir}, progress: false}}
rewards: {{starts_with_a: 1.0}}
""")
    Trainer(cfg).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


def test_dynamic_sampling_resamples_flat_groups(tiny_dir, tmp_path):
    metrics = _run(tiny_dir, tmp_path, "dynamic_sampling: true, max_sampling_rounds: 4")
    flat = [m["sampling/zero_variance_groups"] for m in metrics]
    rounds = [m["sampling/rounds"] for m in metrics]
    assert max(flat) > 0  # the first round had groups with equal rewards ...
    assert max(rounds) > 1  # ... so more prompts were sampled
    assert all(1 <= r <= 4 for r in rounds)


def test_gspo_dual_clip_and_truncation_masking_run(tiny_dir, tmp_path):
    metrics = _run(tiny_dir, tmp_path, "ratio_level: sequence, dual_clip: 3.0, mask_truncated: true, "
                                       "epsilon_high: 0.28, reduction: seq_mean_token_sum_norm, "
                                       "advantage_scale: none")
    assert len(metrics) == 3 and all(np.isfinite(m["loss"]) for m in metrics)
    # max_new_tokens=6 with a random model: almost every completion is truncated and so masked out.
    assert all(m["completion/stopped_frac"] < 1.0 for m in metrics)


def test_lora_run_trains_only_adapters(tiny_dir, tmp_path):
    cfg = from_yaml(RunConfig, f"""
model: {{name: {tiny_dir}, lora_rank: 4, lora_targets: [wq, wv]}}
data: {{task: addition, train_size: 64, eval_size: 4, max_prompt_length: 64}}
sampling: {{max_new_tokens: 6}}
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 2, kl_coef: 0.1}}
optim: {{learning_rate: 1.0e-2}}
train: {{steps: 2, run_dir: {tmp_path}, progress: false}}
rewards: {{starts_with_a: 1.0}}
""")
    trainer = Trainer(cfg)
    frozen_before = [np.asarray(x) for x in jax.tree.leaves(trainer.run.policy.frozen)]
    trainer.fit()
    trained = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(trainer.run.policy.params)]
    assert len(trained) == 4 and all("_lora_" in name for name in trained), trained
    for before, after in zip(frozen_before, jax.tree.leaves(trainer.run.policy.frozen)):
        np.testing.assert_array_equal(before, np.asarray(after))  # base weights never change
