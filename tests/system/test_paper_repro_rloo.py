"""paper_repro/rloo_vs_ppo.py (Ahmadian et al., arXiv:2402.14740): the equal-samples method set, the
verdicts computed from hand-made numbers, and the --smoke preset end to end."""

import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from paper_repro import _arith_policy as ap  # noqa: E402
from paper_repro import rloo_vs_ppo as rp  # noqa: E402


def test_every_method_draws_the_same_samples_per_step_with_the_same_kl():
    p = dict(rp.PRESETS["default"])
    methods = rp.methods(p)
    assert list(methods) == [rp.PPO[lam] for lam in rp.LAMBDAS] + [rp.RLOO2, rp.RLOO4, rp.GRPO, rp.RPP, rp.MA]
    for label, overrides in methods.items():
        assert overrides[0].startswith("algorithm.name=")  # first: naming the algorithm resets its section
        kv = dict(o.split("=", 1) for o in overrides)
        assert int(kv["algorithm.group_size"]) * int(kv["algorithm.prompts_per_step"]) == p["samples"], label
        assert float(kv["algorithm.kl_coef"]) == p["kl_coef"], label
    assert dict(o.split("=", 1) for o in methods[rp.RLOO4])["algorithm.loss"] == "reinforce"
    with pytest.raises(ValueError, match="multiple of the group size 4"):
        rp.methods({**p, "samples": 6})
    # each list is a valid run config (the smoke run below builds only three of them), and the
    # settings survive: naming the algorithm after them would have reset the section to its defaults
    spec = p["spec"]
    for label, overrides in methods.items():
        cfg = ap.rl_config(spec, "unused-model-dir", "unused-prompts", "unused-run", overrides)
        a = cfg.algorithm
        assert a.name == overrides[0].split("=")[1] and a.group_size * a.prompts_per_step == p["samples"], label
        assert a.kl_coef == p["kl_coef"], label
        if a.name == "ppo":
            assert a.critic == "separate" and a.lam in rp.LAMBDAS and a.gamma == 1.0
        if a.name not in ("rloo", "reinforce"):  # the REINFORCE losses: one update per step
            assert (a.num_iterations, a.mini_batches) == (p["iterations"], p["mini_batches"]), label
        if a.name == "reinforce":
            assert (a.num_iterations, a.mini_batches, a.baseline_decay) == (1, 1, None)  # the paper's b_MA
    assert list(rp.methods(rp.PRESETS["smoke"])) == [rp.PPO[0.0], rp.PPO[1.0], rp.RLOO4, rp.MA]


def _seed(reward, kl=1.0, clip=0.01, eval_correct=0.5):
    return {"reward": reward, "kl": kl, "clip_frac_all": clip, "eval_correct": eval_correct}


def test_verdicts_follow_the_numbers():
    # λ=1 best in every seed, PPO rarely clips, RLOO k=4 above the best PPO at less KL: all yes
    per_seed = {rp.PPO[0.0]: [_seed(0.2), _seed(0.25)], rp.PPO[0.5]: [_seed(0.3), _seed(0.3)],
                rp.PPO[0.95]: [_seed(0.35), _seed(0.33)], rp.PPO[1.0]: [_seed(0.4), _seed(0.45)],
                rp.RLOO4: [_seed(0.5, kl=0.9), _seed(0.5, kl=0.9)]}
    assert rp.verdict_clipping(per_seed)[0] == "yes"
    assert rp.verdict_lambda(per_seed)[0] == "yes"
    assert rp.best_ppo(per_seed) == rp.PPO[1.0]
    answer, facts = rp.verdict_rloo(per_seed)
    assert answer == "yes" and "beats PPO λ=1" in facts
    assert rp.verdict(per_seed).startswith("**claim reproduced: yes**")
    # the same reward bought with 20 % more KL than PPO's: partly
    more_kl = {**per_seed, rp.RLOO4: [_seed(0.5, kl=1.2), _seed(0.5, kl=1.2)]}
    assert rp.verdict_rloo(more_kl)[0] == "partly"
    # RLOO below PPO in both seeds: no
    assert rp.verdict_rloo({**per_seed, rp.RLOO4: [_seed(0.3), _seed(0.35)]})[0] == "no"
    # one PPO run clipping 6 % of its tokens: partly (mean still under 5 %); all of them: no
    some = {**per_seed, rp.PPO[0.0]: [_seed(0.2, clip=0.06), _seed(0.25)]}
    assert rp.verdict_clipping(some)[0] == "partly"
    every = {m: [_seed(0.3, clip=0.2)] * 2 for m in rp.PPO.values()}
    assert rp.verdict_clipping(every)[0] == "no"
    # λ=0.95 best on average: no
    lam_no = {**per_seed, rp.PPO[0.95]: [_seed(0.5), _seed(0.5)]}
    assert rp.verdict_lambda(lam_no)[0] == "no"
    # (d): moving-average REINFORCE level with PPO λ=1 (gaps +0.01, -0.01) at equal KL: matches -> yes;
    # below it in both seeds: no, and the overall verdict is then partly
    level = {**per_seed, rp.MA: [_seed(0.41), _seed(0.44)]}
    answer, facts = rp.verdict_moving_average(level)
    assert answer == "yes" and "matches PPO λ=1" in facts and "minus RLOO k=4: -0.075" in facts
    assert "(d) REINFORCE with a moving-average baseline" in rp.verdict(level)
    below = {**per_seed, rp.MA: [_seed(0.3), _seed(0.35)]}
    assert rp.verdict_moving_average(below)[0] == "no"
    assert rp.verdict(below).startswith("**claim reproduced: partly**")


@pytest.mark.slow
def test_rloo_vs_ppo_smoke(tmp_path, paper_repro_cache):
    out = str(tmp_path / "rloo")
    result = rp.main(["--smoke", "--out", out, "--cache", paper_repro_cache])
    methods = list(rp.methods(rp.PRESETS["smoke"]))
    for name in ("results.md", "config.json", "environment.json", "curves.json", "rloo_vs_ppo.png",
                 "reward_vs_kl.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    for name in ("rloo_vs_ppo.png", "reward_vs_kl.png"):
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    text = open(os.path.join(out, "results.md")).read()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(methods)
    for method in methods:
        assert any(line.startswith(f"| {method} |") for line in table), method
    for claim in ("(a) PPO's clipping", "(b) GAE λ = 1", "(c) RLOO k=4", "(d) REINFORCE with a moving-average"):
        assert claim in text
    curves = json.load(open(os.path.join(out, "curves.json")))["curves"]
    assert set(curves) == set(methods)
    for method, runs in curves.items():
        (rows,) = runs  # one seed, one step
        (row,) = rows
        for key in ("reward", "kl", "step_s", "eval_correct", "state_mb"):
            assert math.isfinite(row[key]), (method, key)
        assert 0.0 <= row["eval_correct"] <= 1.0 and row["step_s"] > 0
        # the first update of a step has ratio 1, so a clip fraction exists (>= 0) for the clipped methods
        assert math.isfinite(row["clip_frac"]) == (not method.startswith(("RLOO", "REINFORCE,"))), method
    # PPO's separate critic: a second model and its optimizer state, so more memory than RLOO's
    summary = result["per_seed"]
    assert summary[rp.PPO[1.0]][0]["state_mb"] > 1.3 * summary[rp.RLOO4][0]["state_mb"]


def test_reward_at_kl_reads_the_first_step_that_reaches_the_kl():
    rows = [{"kl": k, "reward": r} for k, r in [(0.0, 0.1), (0.5, 0.2), (1.0, 0.3), (1.5, 0.4)]]
    assert rp.reward_at_kl(rows, 0.9, 1) == pytest.approx(0.3)  # first KL >= 0.9: step 3
    # 2-step means: KL 0, 0.25, 0.75, 1.25 -> first >= 0.7 is step 3, reward (0.2 + 0.3) / 2
    assert rp.reward_at_kl(rows, 0.7, 2) == pytest.approx(0.25)
    assert math.isnan(rp.reward_at_kl(rows, 2.0, 1))  # never reached
    # RLOO ends at KL 0.5 with reward 0.35: PPO had reward 0.2 at KL 0.5, so the gap is 0.15
    rloo = [{"kl": 0.2, "reward": 0.1}, {"kl": 0.5, "reward": 0.35}]
    gaps = rp.equal_kl_gaps({rp.RLOO4: [rloo], rp.PPO[1.0]: [rows]}, rp.RLOO4, rp.PPO[1.0], 1)
    assert gaps.tolist() == pytest.approx([0.15])
