"""Learning from scored records on a tiny random model: AWR / RWR / filtered BC move likelihood
toward high-score responses on held-out prompts; record weights by hand; resume."""

import dataclasses
import json
import os
import random

import jax.numpy as jnp
import numpy as np
import pytest

from rljax.algorithms.offline import prompt_baselines, record_weights, weighted_nll_loss
from rljax.config import from_yaml
from rljax.run_config import RunConfig
from rljax.train_offline import OfflineTrainer
from tests._tiny import make_tiny_model_dir

LOWER, DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def records_path(tmp_path_factory):
    """Four logged responses per prompt; the score is the share of lowercase letters (1, .75, .25, 0)."""
    rng = random.Random(2)
    pick = lambda alphabet, n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
    path = tmp_path_factory.mktemp("data") / "records.jsonl"
    with open(path, "w") as f:
        for i in range(60):
            for letters in (8, 6, 2, 0):
                f.write(json.dumps({"prompt": f"Log entry {i}: write something.",
                                    "response": pick(LOWER, letters) + pick(DIGITS, 8 - letters),
                                    "reward": letters / 8}) + "\n")
    return str(path)


def _cfg(tiny_dir, records_path, run_dir, *, steps=16, offline=""):
    return from_yaml(RunConfig, f"""
model: {{name: {tiny_dir}}}
data: {{task: "", path: {records_path}, eval_size: 48, max_prompt_length: 64}}
algorithm: {{name: offline}}
offline: {{batch_size: 16, eval_fraction: 0.2, max_completion_length: 16, score_column: reward,
          temperature: 0.2, score_threshold: 0.5, save_model: false {offline}}}
optim: {{learning_rate: 3.0e-3}}
train: {{steps: {steps}, run_dir: {run_dir}, progress: false}}
""")


@pytest.mark.parametrize("mode", ["awr", "rwr", "filtered_bc"])
def test_record_training_moves_likelihood_toward_high_scores(tiny_dir, records_path, tmp_path, mode):
    trainer = OfflineTrainer(_cfg(tiny_dir, records_path, tmp_path, offline=f", records_mode: {mode}"))
    if mode == "filtered_bc":
        assert trainer.data_counts["train_filtered_out"] == len(trainer.train_set)  # half the records
    summary = trainer.fit()
    before, after = summary["before"], summary["after"]
    assert abs(before["eval/logp_gap"]) < 0.2, before  # a random model does not prefer either
    # per-token log-likelihood of the better half of each held-out prompt's responses vs the worse
    assert after["eval/logp_gap"] > before["eval/logp_gap"] + 0.5, (before, after)
    assert after["eval/pair_accuracy"] >= 0.9, after
    assert after["eval/nll"] < before["eval/nll"]  # it also learned the responses' format


def test_record_weights_by_hand():
    scores = [1.0, 0.0, 0.5, 2.0]
    keys = ["a", "a", "b", "c"]
    # per-prompt baseline for "a" (0.5); "b" and "c" have one response each: the global mean (0.875)
    np.testing.assert_allclose(prompt_baselines(np.asarray(scores), keys), [0.5, 0.5, 0.875, 0.875])
    w, keep = record_weights(scores, keys, mode="awr", temperature=0.5, max_weight=20.0)
    np.testing.assert_allclose(w, np.exp(np.array([0.5, -0.5, -0.375, 1.125]) / 0.5), rtol=1e-6)
    assert keep.all()
    w, _ = record_weights(scores, keys, mode="awr", temperature=0.1, max_weight=20.0)
    assert w.max() == pytest.approx(20.0)  # exp(11.25) clipped
    w, _ = record_weights(scores, keys, mode="awr", temperature=1.0, baseline="global_mean")
    np.testing.assert_allclose(w, np.exp(np.asarray(scores) - 0.875), rtol=1e-6)
    w, _ = record_weights(scores, keys, mode="rwr", temperature=1.0, max_weight=0.0)
    np.testing.assert_allclose(w, np.exp(scores) / np.mean(np.exp(scores)), rtol=1e-6)
    assert w.mean() == pytest.approx(1.0)
    w, keep = record_weights(scores, keys, mode="filtered_bc", threshold=1.0)
    assert keep.tolist() == [True, False, False, True] and w.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_weighted_nll_by_hand():
    logprobs = jnp.asarray([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1]])
    weights = jnp.asarray([2.0, 0.5])
    loss, metrics = weighted_nll_loss(logprobs, mask, weights, reduction="token_mean")
    assert float(loss) == pytest.approx((2 * 3 + 0.5 * 1.5) / 5)
    assert float(metrics["offline/nll"]) == pytest.approx(4.5 / 5)
    loss, _ = weighted_nll_loss(logprobs, mask, weights, reduction="seq_mean_token_sum")
    assert float(loss) == pytest.approx((6 + 0.75) / 2)


def test_resume_equals_uninterrupted(tiny_dir, records_path, tmp_path):
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("time")} for m in ms]  # noqa: E731

    def metrics(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if "loss" in json.loads(line)]

    OfflineTrainer(_cfg(tiny_dir, records_path, tmp_path / "full", steps=4)).fit()
    cfg = _cfg(tiny_dir, records_path, tmp_path / "resumed", steps=4)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, save_every=2))
    OfflineTrainer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2))).fit()
    OfflineTrainer(cfg, resume=True).fit()
    full, resumed = strip(metrics(tmp_path / "full")), strip(metrics(tmp_path / "resumed"))
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert full == resumed
