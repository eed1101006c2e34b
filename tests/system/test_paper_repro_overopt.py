"""paper_repro/rm_overoptimization.py: the --smoke preset end to end (table, plot, metadata, raw
curves), and by hand: the best-of-n estimator, its KL, the least-squares fits of the paper's forms,
and the verdict rules on synthetic curves."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

PAPER_REPRO = Path(__file__).resolve().parents[2] / "paper_repro"


def _load(name):
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(PAPER_REPRO))  # the reproduction imports its sibling modules
    spec = importlib.util.spec_from_file_location(name, PAPER_REPRO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


repro = _load("rm_overoptimization")


def test_smoke_run_writes_table_plot_and_curves(tmp_path, paper_repro_cache):
    # the corpus is fetched at set-up (README test command, .ci/run)
    out = tmp_path / "out"
    assert repro.main(["--smoke", "--out", str(out), "--cache", paper_repro_cache]) == 0
    preset = repro.PRESETS["smoke"]

    results = (out / "results.md").read_text()
    rows = [line for line in results.splitlines() if line.startswith("| ")]
    for method in repro.METHODS:
        for size in preset.rm_sizes:
            assert any(line.startswith(f"| {method} | {size} |") for line in rows), (method, size, results)
    assert results.count("claim reproduced: **") == 3
    for claim in repro.CLAIMS.values():
        assert claim in results
    assert (out / "overoptimization.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    assert config["preset"] == "smoke" and config["seeds"] == [0]
    assert "packages" in json.loads((out / "environment.json").read_text())
    assert not (out / "work").exists()  # pairs, RMs and trainer folders are removed

    curves = json.loads((out / "curves.json").read_text())
    (seed,) = curves["seeds"]
    assert seed["pairs"] >= max(preset.rm_sizes)
    for size in preset.rm_sizes:
        rm = seed["rm"][str(size)]
        assert rm["pairs"] == size and 0.0 <= rm["eval_accuracy"] <= 1.0
        bon = seed["best_of_n"][str(size)]
        assert [q["n"] for q in bon] == list(preset.best_of_n)
        # n = 1 is π_ref itself: both scores are measured from π_ref's, so exactly 0
        assert bon[0]["d"] == 0.0 and bon[0]["gold"] == pytest.approx(0.0, abs=1e-12)
        assert bon[0]["proxy"] == pytest.approx(0.0, abs=1e-9)
        assert all(math.isfinite(q["gold"]) and math.isfinite(q["proxy"]) for q in bon)
        rl = seed["rl"][str(size)]
        assert [q["step"] for q in rl] == list(range(preset.rl_steps + 1))
        # step 0 is π_ref evaluated against itself: sampler and forward log-probs agree, so KL ~ 0
        assert abs(rl[0]["kl"]) < 1e-3
        assert all(math.isfinite(q["kl"]) and math.isfinite(q["gold"]) and math.isfinite(q["proxy"]) for q in rl)
    for verdict in curves["summary"]["verdicts"].values():
        assert verdict["answer"] in ("yes", "partly", "no")

    # --report-only rebuilds the same table and verdicts from curves.json, without training
    (out / "results.md").unlink()
    assert repro.main(["--smoke", "--out", str(out), "--report-only"]) == 0
    again = (out / "results.md").read_text().splitlines()
    assert [x for x in again if x.startswith(("| ", "1. ", "2. ", "3. "))] == \
        [x for x in results.splitlines() if x.startswith(("| ", "1. ", "2. ", "3. "))]


def test_best_of_n_expectation_by_hand():
    proxy = np.array([[0.1, 0.3, 0.2]])  # [P=1, M=3]
    gold = np.array([[1.0, 2.0, 4.0]])
    assert repro.best_of_n_expectation(proxy, gold, 1) == pytest.approx((7 / 3, 0.2))
    # the 3 pairs {0,1} {0,2} {1,2}: the proxy picks sample 1, 2, 1 -> gold 2, 4, 2
    assert repro.best_of_n_expectation(proxy, gold, 2) == pytest.approx((8 / 3, (0.3 + 0.2 + 0.3) / 3))
    assert repro.best_of_n_expectation(proxy, gold, 3) == pytest.approx((2.0, 0.3))
    # two prefixes average; the second's proxy ranks the samples the other way round
    two = repro.best_of_n_expectation(np.array([[0.1, 0.3, 0.2], [3.0, 2.0, 1.0]]),
                                      np.array([[1.0, 2.0, 4.0], [5.0, 0.0, 0.0]]), 3)
    assert two == pytest.approx(((2.0 + 5.0) / 2, (0.3 + 3.0) / 2))
    with pytest.raises(ValueError, match="best-of-4 needs"):
        repro.best_of_n_expectation(proxy, gold, 4)


def test_bon_kl_formula():
    assert repro.bon_kl(1) == 0.0
    assert repro.bon_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert repro.bon_kl(4) == pytest.approx(1.3862943611198906 - 0.75)


def test_fits_by_hand():
    # three points, best-of-n form R = αd − βd²: normal equations [[14, -36], [-36, 98]] (α, β) = (5, -13)
    fit = repro.fit_form("best-of-n", [1.0, 2.0, 3.0], [0.0, 1.0, 1.0])
    assert fit["alpha"] == pytest.approx(11 / 38) and fit["beta"] == pytest.approx(-1 / 38)
    # residuals (-12, 12, -4)/38: SS_res = 4/19, SS_tot = 2/3
    assert fit["r2"] == pytest.approx(13 / 19)
    assert fit["d_peak_fit"] == float("inf")  # β < 0: never turns down
    # two points: α − β = −1, 2α − 4β = −4 -> α = 0, β = 1: only falls, the peak is d = 0
    falls = repro.fit_form("best-of-n", [1.0, 2.0], [-1.0, -4.0])
    assert (falls["alpha"], falls["beta"], falls["d_peak_fit"]) == pytest.approx((0.0, 1.0, 0.0), abs=1e-9)
    # exact data recovers the coefficients, R² = 1, and the peaks α/(2β) and exp(α/β − 1)
    d = np.array([0.0, 0.5, 1.0, 2.0, 3.0])
    bon = repro.fit_form("best-of-n", d, d * (1.0 - 0.5 * d))
    assert (bon["alpha"], bon["beta"], bon["r2"], bon["d_peak_fit"]) == pytest.approx((1.0, 0.5, 1.0, 1.0))
    log_d = np.log(np.where(d > 0, d, 1.0))
    rl = repro.fit_form("RL", d, d * (0.8 - 0.4 * log_d))
    assert (rl["alpha"], rl["beta"], rl["r2"], rl["d_peak_fit"]) == pytest.approx((0.8, 0.4, 1.0, math.e))
    np.testing.assert_allclose(repro.form_curve("RL", rl, d), d * (0.8 - 0.4 * log_d), atol=1e-12)


def test_trend():
    assert repro.trend([0.5, 1.0, 2.0]) == "yes"
    assert repro.trend([0.5, 0.5, 2.0]) == "partly"
    assert repro.trend([0.5, 0.5, 0.5]) == "no"
    assert repro.trend([1.0, 0.5, 2.0]) == "no"
    assert repro.trend([0.5, float("inf"), 2.0]) == "no"  # a peak beyond the range, then one inside it
    assert repro.trend([0.5, float("inf"), float("inf")]) == "partly"
    assert repro.trend([0.5, float("nan"), 2.0]) == "no"


def _synthetic(peaks, *, falls=True):
    """Three seeds of curves whose gold is d(α − βd) peaking at ``peaks[i]`` (or rising throughout),
    the proxy rising with d, a little seed noise."""
    d = np.sqrt([repro.bon_kl(n) for n in (1, 2, 4, 8, 16, 32, 64)])
    results = []
    for seed in range(3):
        noise = np.random.default_rng(seed).normal(0, 0.002, len(d))
        noise[0] = 0.0
        curves = {}
        for size, peak in zip((10, 20, 40), peaks):
            gold = d * (1.0 - d / (2 * peak)) if falls else d
            curves[str(size)] = [{"d": float(x), "gold": float(g + e), "proxy": float(2 * x)}
                                 for x, g, e in zip(d, gold, noise)]
        results.append({"best_of_n": curves, "rl": curves,
                        "rm": {s: {"eval_accuracy": 0.7} for s in curves}})
    return results


def test_verdicts_on_synthetic_curves():
    preset = repro.Preset(rm_sizes=(10, 20, 40))
    summary = repro.summarize(_synthetic((0.5, 0.9, 1.3)), preset)
    v = summary["verdicts"]
    assert v["overoptimization"]["answer"] == "yes"
    assert v["later_peak"]["per_method"]["best-of-n"]["measured"] == "yes"
    assert v["later_peak"]["per_method"]["best-of-n"]["fitted"] == "yes"
    assert summary["curves"]["best-of-n/10"]["fit"]["d_peak_fit"] == pytest.approx(0.5, abs=0.05)
    assert v["forms"]["r2"]["best-of-n/40"] > 0.99

    rising = repro.summarize(_synthetic((0.5, 0.9, 1.3), falls=False), preset)["verdicts"]
    assert rising["overoptimization"]["answer"] == "no"  # the gold peaks at the last point: no fall
    assert rising["later_peak"]["answer"] == "no"  # every peak is at the largest d; fits never turn down


def test_a_plateau_is_not_a_fall():
    preset = repro.Preset(rm_sizes=(10, 20, 40))
    results = _synthetic((0.5, 0.9, 1.3), falls=False)
    for r in results:  # the gold dips at the last point by 5 % of its gain (best-of-n and RL share the lists)
        for curve in r["best_of_n"].values():
            top = curve[-2]["gold"]
            curve[-1]["gold"] = top - 0.05 * top
    per_curve = repro.summarize(results, preset)["verdicts"]["overoptimization"]["per_curve"]
    # gain, fall and proxy rise in every seed, but the fall is below MIN_FALL of the gain
    assert per_curve["best-of-n/10"] == "partly"
