"""Learning from scored records on a tiny random model: AWR / RWR / filtered BC move likelihood
toward high-score responses on held-out prompts; resume. (The weights and the loss by hand:
tests/unit/test_losses_records.py.)"""

import dataclasses
import json
import os
import random

import pytest

from rljax.config import from_yaml
from rljax.run_config import RunConfig
from rljax.training import OfflineTrainer

LOWER, DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"


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
data: {{task: "", path: {records_path}, eval_size: 48, max_prompt_length: 64, eval_fraction: 0.2}}
algorithm: {{name: records, batch_size: 16, max_completion_length: 16, score_column: reward,
            temperature: 0.2, score_threshold: 0.5 {offline}}}
optim: {{learning_rate: 3.0e-3}}
train: {{steps: {steps}, run_dir: {run_dir}, progress: false, save_model: false}}
""")


@pytest.mark.parametrize("mode", ["awr", "rwr", "filtered_bc"])
def test_record_training_moves_likelihood_toward_high_scores(tiny_dir, records_path, tmp_path, mode):
    trainer = OfflineTrainer(_cfg(tiny_dir, records_path, tmp_path, offline=f", mode: {mode}"))
    if mode == "filtered_bc":
        assert trainer.data_counts["train_filtered_out"] == len(trainer.train_set)  # half the records
    summary = trainer.fit()
    before, after = summary["before"], summary["after"]
    assert abs(before["eval/logp_gap"]) < 0.2, before  # a random model does not prefer either
    # per-token log-likelihood of the better half of each held-out prompt's responses vs the worse
    assert after["eval/logp_gap"] > before["eval/logp_gap"] + 0.5, (before, after)
    assert after["eval/pair_accuracy"] >= 0.9, after
    assert after["eval/nll"] < before["eval/nll"]  # it also learned the responses' format


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
