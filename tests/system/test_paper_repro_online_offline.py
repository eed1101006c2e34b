"""paper_repro/online_vs_offline.py (Tajwar et al. 2024): the verdict rules by hand, the scripted
policy's samples, and the --smoke preset end to end (outputs, every method, equal label budgets)."""

import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from paper_repro import _arith_policy as ap  # noqa: E402
from paper_repro import online_vs_offline as ovo  # noqa: E402


def test_combine_is_yes_only_when_all_are_and_no_only_when_none_is():
    assert ovo.combine(["yes", "yes"]) == "yes"
    assert ovo.combine(["no", "no", "no"]) == "no"
    assert ovo.combine(["yes", "no"]) == "partly"
    assert ovo.combine(["partly", "yes"]) == "partly"
    # a comparison with no finished seed on one side (an interrupted run) does not count either way
    assert ovo.combine(["yes", "not run"]) == "yes"
    assert ovo.combine(["not run"]) == ovo.combine([]) == "not run"


def test_claim_verdict_pairs_seeds_and_judges_every_comparison():
    final = {"on": [0.40, 0.50, 0.45], "other_on": [0.30, 0.31, 0.29], "off": [0.30, 0.35, 0.30]}
    answer, parts = ovo.claim_verdict(final, ["on", "other_on"], ["off"])
    # on − off = [0.10, 0.15, 0.15]: every seed above 0 -> yes
    assert parts["on − off"][0] == "yes"
    np.testing.assert_allclose(parts["on − off"][1], [0.10, 0.15, 0.15])
    # other_on − off = [0.00, −0.04, −0.01]: mean below zero -> no; one yes and one no -> partly
    np.testing.assert_allclose(parts["other_on − off"][1], [0.0, -0.04, -0.01], atol=1e-12)
    assert parts["other_on − off"][0] == "no"
    assert answer == "partly"
    # unequal seed counts: only the seeds both have are paired
    np.testing.assert_allclose(ovo.paired_gaps({"a": [1.0, 2.0], "b": [0.5]}, "a", "b"), [0.5])
    answer, parts = ovo.claim_verdict({"on": [0.5], "off": []}, ["on"], ["off"])
    assert answer == "not run" and parts["on − off"][0] == "not run"


def test_scripted_samples_are_the_task_answers_with_some_corrupted():
    spec = ap.PolicySpec()
    prompts = [{"prompt": "47+85="}, {"prompt": "10+99="}]
    texts = ovo.scripted_samples(spec, prompts, 200, p_slip=0.5, seed=3)
    assert len(texts) == 400
    from rljax.rewards.answers import last_number

    right = np.array([last_number(t) == ("132" if i < 200 else "109") for i, t in enumerate(texts)])
    # a slip changes the stated answer (column sums move by ±1; a direct answer by ±10)
    assert 0.35 < right.mean() < 0.65
    assert ovo.scripted_samples(spec, prompts, 200, p_slip=0.0, seed=3).count("132") >= 1
    assert all(last_number(t) in ("132", "109") for t in ovo.scripted_samples(spec, prompts, 50, p_slip=0.0, seed=4))
    assert texts == ovo.scripted_samples(spec, prompts, 200, p_slip=0.5, seed=3)  # seeded


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, paper_repro_cache):
    out, cache = str(tmp_path_factory.mktemp("online_offline") / "out"), paper_repro_cache
    return out, cache, ovo.main(["--smoke", "--out", out, "--cache", cache])


@pytest.mark.slow
def test_smoke_preset_writes_every_method_at_an_equal_label_budget(smoke):
    out, cache, result = smoke
    for name in ("results.md", "config.json", "environment.json", "curves.json", "online_vs_offline.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "online_vs_offline.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    text = open(os.path.join(out, "results.md")).read()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(ovo.METHODS)
    for method in ovo.METHODS:
        assert any(line.startswith(f"| {method} |") for line in table), method
    assert "claim reproduced:" in text and "(a) on-policy" in text and "(b) negative-gradient" in text
    saved = json.load(open(os.path.join(out, "curves.json")))
    p = ovo.PRESETS["smoke"]
    budget = p["steps"] * p["prompts"] * p["samples"]
    assert saved["budget"] == result["budget"] == budget
    assert set(saved["curves"]) == set(ovo.METHODS)
    for method, runs in saved["curves"].items():
        (run,) = runs  # one seed
        # every method scored exactly the same number of completions (counted as they were scored)
        assert run["labels"] == budget, method
        points = run["points"]
        assert points[0]["labels"] == 0 and points[-1]["labels"] == budget
        assert all(np.isfinite(q["gold"]) and 0.0 <= q["gold"] <= 1.0 for q in points)
        assert all(np.isfinite(q["gold_len"]) and q["gold_len"] >= 1 for q in points)
    assert result["labels"] == {m: [budget] for m in ovo.METHODS}
    # the report can be rebuilt from curves.json alone
    again = ovo.main(["--smoke", "--out", out, "--cache", cache, "--report-only"])
    assert again["final"] == result["final"]


class _ScriptedLab(ovo.Lab):
    """The smoke policy is never right, so its rounds have no pairs: label the scripted writer's
    samples instead (mixed right and wrong), to drive the rounds' trainers."""

    def label_round(self, method, policy, r):
        examples = self.prompts_of(r)
        n = self.p["samples"]
        rows = [ex for ex in examples for _ in range(n)]
        texts = ovo.scripted_samples(self.spec, examples, n, p_slip=0.5, seed=r)
        return SimpleNamespace(examples=rows, texts=texts,
                               per_function={ap.CORRECT: self.label_texts(method, rows, texts)})


@pytest.mark.heavy  # ~14 s; the swap it drives is covered in the default suite by test_dpo's replace_train_split tests
def test_rounds_train_when_a_round_has_a_batch_of_rows(smoke, tmp_path):
    _, cache, _ = smoke
    p = dict(ovo.PRESETS["smoke"], rounds=3)
    model_dir, _ = ap.pretrain_policy(p["spec"], cache)  # cached by the smoke run
    lab = _ScriptedLab(p["spec"], model_dir, str(tmp_path), 0, p)
    for method in (ovo.DPO_ONLINE, ovo.RAFT):  # one lab (its sampler and prompts) for both
        result = ovo.run_rounds(lab, method, str(tmp_path), log=lambda msg: None)
        rounds = result["rounds"]
        assert [r["updates"] for r in rounds] == [p["updates_per_round"] if r["rows"] >= p["batch"] else 0
                                                 for r in rounds], method
        assert sum(r["updates"] for r in rounds) == result["points"][-1]["updates"] > 0, method
        assert lab.labels[method] == 3 * p["prompts"] * p["samples"] == result["points"][-1]["labels"]
