"""The GRPO-family reproductions (paper_repro/dr_grpo_length_bias.py, dapo_clip_higher.py): the task's
answers, and each file's --smoke preset end to end (table, plots, metadata written)."""

import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from paper_repro import _arith_policy as ap  # noqa: E402
from paper_repro import dapo_clip_higher, dr_grpo_length_bias  # noqa: E402


@pytest.mark.parametrize("a,b", [(47, 85), (10, 10), (99, 99), (5, 8), (123, 989)])
def test_scratchpads_state_the_sum_in_every_style(a, b):
    direct, answer = ap.response(a, b, style="direct")
    assert direct == str(a + b) and answer == a + b
    lengths = []
    for verbose in [(), (True,) * 4, (True, False, True, False), (False, True)]:
        text, answer = ap.response(a, b, style="scratch", verbose_lines=verbose)
        assert answer == a + b
        assert ap.style_of(text) == ("verbose" if any(verbose[: len(str(max(a, b))) + 1]) else "terse")
        # the reward's reading: the last number of the completion
        from rljax.rewards.answers import last_number
        assert last_number(text) == str(a + b), text
        lengths.append(len(text))
    assert max(lengths) > 1.5 * min(lengths)  # words make the same scratchpad longer


def test_a_slip_gives_a_consistent_wrong_answer():
    text, answer = ap.response(47, 85, style="scratch", verbose_lines=(False, False, False), slip=1, slip_delta=1)
    assert text == "7+5=12;4+8+1=14;=142" and answer == 142
    assert ap.response(47, 85, style="direct", slip=0, slip_delta=-1) == ("122", 122)


def test_questions_hold_out_an_eval_split_and_records_are_sft():
    spec = ap.PolicySpec.smoke()
    train, evals = ap.questions(spec)
    assert len(evals) == spec.eval_size and not set(train) & set(evals)
    records = ap.sft_records(spec)
    assert len(records) == spec.sft_size and all(r["score"] == 1.0 for r in records)
    held = {f"{a}+{b}=" for a, b in evals}
    assert not {r["prompt"] for r in records} & held
    rows = ap.prompt_rows(spec)
    assert [r["prompt"] for r in rows[: spec.eval_size]] == [f"{a}+{b}=" for a, b in evals]


@pytest.fixture(scope="module")
def cache(paper_repro_cache):
    return paper_repro_cache  # one pretrained smoke policy for the whole test run (tests/conftest.py)


def _check_outputs(out, methods, plot):
    for name in ("results.md", "config.json", "environment.json", "curves.json", plot):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, plot), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    text = open(os.path.join(out, "results.md")).read()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(methods)  # header + one row per method
    for method in methods:
        assert any(line.startswith(f"| {method} |") for line in table), method
    assert "claim reproduced:" in text
    curves = json.load(open(os.path.join(out, "curves.json")))["curves"]
    assert set(curves) == set(methods)
    env = json.load(open(os.path.join(out, "environment.json")))
    assert "jax" in env["packages"]
    return curves


def test_dr_grpo_smoke(tmp_path, cache):
    out = str(tmp_path / "dr_grpo")
    result = dr_grpo_length_bias.main(["--smoke", "--out", out, "--cache", cache])
    curves = _check_outputs(out, list(dr_grpo_length_bias.METHODS), "length_bias.png")
    for runs in curves.values():
        (rows,) = runs  # one seed
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert 0.0 <= r["reward"] <= 1.0
            assert 1 <= r["len_all"] <= ap.PolicySpec.smoke().max_new_tokens
            # the mean length is the correct and incorrect lengths weighted by their counts
            parts = [(r["len_correct"], r["reward"]), (r["len_incorrect"], 1 - r["reward"])]
            assert sum(l * w for l, w in parts if w > 0) == pytest.approx(r["len_all"])
    assert set(result["per_seed"]) == set(dr_grpo_length_bias.METHODS)


def test_dapo_smoke(tmp_path, cache):
    out = str(tmp_path / "dapo")
    dapo_clip_higher.main(["--smoke", "--out", out, "--cache", cache])
    curves = _check_outputs(out, list(dapo_clip_higher.METHODS), "clip_higher.png")
    for method, runs in curves.items():
        for r in runs[0]:
            assert np.isfinite(r["policy/entropy"]) and r["policy/entropy"] >= 0
            assert 0.0 <= r["zero_variance_trained"] <= 1.0
            assert r["sampling/rounds"] >= 1
            if "dyn. sampling" not in method:
                assert r["sampling/rounds"] == 1
                # without dynamic sampling the trained groups are the sampled ones
                assert r["zero_variance_trained"] == pytest.approx(r["sampling/zero_variance_groups"])


def test_a_verdict_needs_more_than_noise():
    assert ap.clearly_positive([0.1, 0.2, 0.05]) == "yes"
    # mean 0.0215 > standard error 0.0105 (std 0.0210 / sqrt 4): a finding, but not in every pair
    assert ap.clearly_positive([0.015, 0.045, -0.004, 0.03]) == "partly"
    # mean 0.002 against a standard error of 0.0054: noise
    assert ap.clearly_positive([0.02, -0.015, 0.001, 0.012, -0.01, 0.004]) == "no"
    assert ap.clearly_positive([float("nan")]) == "no" and ap.clearly_positive([-1.0]) == "no"


def test_medium_is_offered_only_by_reproductions_that_define_it(tmp_path):
    # dr_grpo_length_bias has a --medium preset: it parses to that preset and its folder;
    # dapo_clip_higher has none, so the flag is an error there rather than a silent default run
    args = ap.parse_args("dr_grpo_length_bias", "", ["--medium", "--out", str(tmp_path / "m")],
                         presets=tuple(dr_grpo_length_bias.PRESETS))
    assert args.preset == "medium" and args.out == str(tmp_path / "m")
    medium, default = dr_grpo_length_bias.PRESETS["medium"], dr_grpo_length_bias.PRESETS["default"]
    assert medium["spec"].max_new_tokens > default["spec"].max_new_tokens and medium["steps"] > default["steps"]
    assert len(medium["seeds"]) == 3
    assert "medium" not in dapo_clip_higher.PRESETS
    with pytest.raises(SystemExit):
        ap.parse_args("dapo_clip_higher", "", ["--medium"], presets=tuple(dapo_clip_higher.PRESETS))
