"""paper_repro/dpo_sentiment_frontier.py: the --smoke preset end to end (table, plots, metadata,
raw curves), the Best-of-N and optimal-frontier estimators by hand, and the corpus helpers."""

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

PAPER_REPRO = Path(__file__).resolve().parents[2] / "paper_repro"


def _load(name):
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(PAPER_REPRO))  # the reproduction imports its corpus module as a sibling
    spec = importlib.util.spec_from_file_location(name, PAPER_REPRO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


repro = _load("dpo_sentiment_frontier")
corpus = _load("_sentiment_corpus")


def test_smoke_run_writes_table_plots_and_curves(tmp_path, paper_repro_cache):
    # the corpus is fetched at set-up (README test command, .ci/run); without it read_snippets
    # raises FileNotFoundError naming the fetch command
    out = tmp_path / "out"
    assert repro.main(["--smoke", "--out", str(out), "--cache", paper_repro_cache]) == 0

    results = (out / "results.md").read_text()
    table_rows = [line for line in results.splitlines() if line.startswith("| ")]
    for method in repro.METHODS:
        assert any(line.startswith(f"| {method} |") for line in table_rows), (method, results)
    assert "claim reproduced: **" in results and repro.PAPER_CLAIM in results
    for name in ("frontier.png", "curves.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    assert config["preset"] == "smoke" and config["seeds"] == [0]
    assert "packages" in json.loads((out / "environment.json").read_text())
    assert not (out / "work").exists()  # trainer folders are removed

    curves = json.loads((out / "curves.json").read_text())
    (seed,) = curves["seeds"]
    assert seed["pairs"] >= 8  # enough preference pairs for one DPO batch
    # π_ref evaluated against itself: the sampler's log-probs equal the forward pass's, so KL ~ 0
    assert abs(seed["reference"]["kl"]) < 1e-3, seed["reference"]
    assert {run["method"] for run in seed["runs"].values()} == {"DPO", "PPO"}
    for run in seed["runs"].values():
        steps = [p["step"] for p in run["points"]]
        assert steps[0] == 0 and steps == sorted(steps) and len(steps) >= 2
        assert all(math.isfinite(p["kl"]) and -1.0 <= p["reward"] <= 1.0 for p in run["points"])
    # trained policies moved away from the reference
    assert all(run["points"][-1]["kl"] > 1e-3 for run in seed["runs"].values())
    assert curves["summary"]["verdict"] in ("yes", "no", "partly")


def test_best_of_n_by_hand():
    rewards = np.array([[0.0, 1.0, 0.5, 0.2], [-1.0, -0.5, 0.0, 0.5]])  # [P=2, M=4]
    curve = {q["n"]: q for q in repro.best_of_n_curve(rewards, (1, 2, 4, 8))}
    assert set(curve) == {1, 2, 4}  # N=8 needs more than 4 samples per prefix
    assert curve[1]["reward"] == pytest.approx(rewards.mean()) and curve[1]["kl"] == 0.0
    # N=2: groups (0, 1), (0.5, 0.2) -> 1, 0.5 and (-1, -0.5), (0, 0.5) -> -0.5, 0.5
    assert curve[2]["reward"] == pytest.approx((1 + 0.5 - 0.5 + 0.5) / 4)
    assert curve[4]["reward"] == pytest.approx((1 + 0.5) / 2)
    assert curve[4]["kl"] == pytest.approx(math.log(4) - 3 / 4)


def test_optimal_frontier_by_hand():
    rewards = np.array([[0.0, 1.0, 0.0, 0.0]])
    (hot, cold, mid) = repro.optimal_frontier(rewards, (1e6, 1e-3, 1.0))
    # β -> ∞: π* = π_ref (reward = mean, KL = 0); β -> 0: all mass on the best sample (KL = log M)
    assert hot["reward"] == pytest.approx(0.25) and hot["kl"] == pytest.approx(0.0, abs=1e-6)
    assert cold["reward"] == pytest.approx(1.0) and cold["kl"] == pytest.approx(math.log(4), rel=1e-6)
    # β = 1: weights (1, e, 1, 1); KL = E*[r] - log mean exp(r) computed directly from the weights
    w = np.array([1.0, math.e, 1.0, 1.0])
    q = w / w.sum()
    assert mid["reward"] == pytest.approx(q[1])
    assert mid["kl"] == pytest.approx(float(np.sum(q * np.log(q / 0.25))))


def test_best_within_budget_and_envelope():
    points = [(0.0, 0.1), (1.5, 0.4), (0.8, 0.3), (3.0, 0.2)]
    assert repro.best_within(points, 1.0) == 0.3
    assert repro.best_within(points, 2.0) == 0.4
    assert math.isnan(repro.best_within(points, -1.0))
    kl, env = repro.upper_envelope(points)
    np.testing.assert_array_equal(kl, [0.0, 0.8, 1.5, 3.0])
    np.testing.assert_array_equal(env, [0.1, 0.3, 0.4, 0.4])


def test_corpus_split_and_missing_cache_message(tmp_path, monkeypatch):
    assert corpus.split_snippet("a b c d e f g", prefix_words=3, response_words=2) == ("a b c", " d e")
    assert corpus.split_snippet("a b c d", prefix_words=3, response_words=2) is None  # needs 2 words after
    monkeypatch.setenv("RLJAX_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="_sentiment_corpus.py --fetch"):
        corpus.read_snippets()


def test_the_medium_preset_trains_longer_on_longer_completions():
    # the default's frontier did not reproduce; --medium has longer completions and more steps
    medium, default = repro.PRESETS["medium"], repro.PRESETS["default"]
    assert medium.pretrain.max_response_tokens > default.pretrain.max_response_tokens
    assert medium.dpo_epochs > default.dpo_epochs and medium.ppo_steps > default.ppo_steps
    assert len(medium.seeds) == 3
