"""rljax sweep / rljax compare: the grid x seeds plan, resume bookkeeping (finished runs skipped,
interrupted ones resumed, failures recorded) with a stand-in runner, the paired bootstrap by hand,
the compare table on known numbers, and (heavy) a real sweep of tiny runs in subprocesses."""

import json
import os
import sys

import numpy as np
import pytest

from rljax.tools.cli import main
from rljax.tools.compare import compare, paired_bootstrap, write_compare
from rljax.tools.sweep import (SweepError, parse_grid, parse_seeds, plan_sweep, read_manifest, run_status, run_sweep,
                         setting_name, sweep_failures)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "grpo_smollm2_arith.yaml")
GRID = {"algorithm.reduction": ["token_mean", "seq_mean_token_mean"]}


class FakeRunner:
    """Stands in for ``python -m rljax train``: writes what a finished run leaves (a checkpoint
    step, metrics.jsonl with eval/reward = 0.1 * seed (+ 0.25 for seq_mean_token_mean), summary.json),
    or exits with ``codes[run_name]`` leaving a checkpoint of step 1 only."""

    def __init__(self, codes=None):
        self.calls, self.codes = [], dict(codes or {})

    def __call__(self, argv, log_path):
        self.calls.append(argv)
        opts = dict(a.split("=", 1) for a in argv if "=" in a)
        run_dir, seed, steps = opts["train.run_dir"], int(opts["train.seed"]), int(opts.get("train.steps", 40))
        name = os.path.basename(run_dir)
        os.makedirs(os.path.join(run_dir, "checkpoints", "1"), exist_ok=True)
        shift = 0.25 if opts.get("algorithm.reduction") == "seq_mean_token_mean" else 0.0
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 0, "eval/reward": 0.5 + shift}) + "\n")  # the best, for every run
            f.write(json.dumps({"step": steps, "eval/reward": 0.1 * seed + shift, "eval/loss": 2.0 - shift}) + "\n")
        code = self.codes.get(name, 0)
        if code:
            with open(log_path, "a") as f:
                f.write("Traceback ...\nRuntimeError: injected failure\n")
            return code
        os.makedirs(os.path.join(run_dir, "checkpoints", str(steps)), exist_ok=True)
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump({"steps": steps}, f)
        return 0


def _plan(out, seeds=(0, 1), grid=GRID, overrides=("train.steps=2",)):
    return plan_sweep(CONFIG, grid=grid, seeds=list(seeds), overrides=list(overrides), out=str(out))


def test_grid_and_seeds_parse_and_name_runs():
    assert parse_grid(["algorithm.reduction=token_mean,seq_mean_token_mean", "algorithm.epsilon_high=0.2,0.28"]) == {
        "algorithm.reduction": ["token_mean", "seq_mean_token_mean"], "algorithm.epsilon_high": ["0.2", "0.28"]}
    assert parse_seeds("0,1,2") == [0, 1, 2]
    assert setting_name({"algorithm.reduction": "token_mean", "optim.learning_rate": "1e-5"}) == \
        "reduction=token_mean__learning_rate=1e-5"
    assert setting_name({"data.system_prompt": "a b/c"}) == "system_prompt=a_b_c"  # filesystem-safe
    for bad, match in [(["algorithm.reduction"], "KEY=V1,V2"), (["train.seed=0,1"], "--seeds"),
                       (["a.b=1,1"], "distinct")]:
        with pytest.raises(SweepError, match=match):
            parse_grid(bad)
    with pytest.raises(SweepError, match="integers"):
        parse_seeds("0,x")


def test_plan_validates_every_setting_before_running(tmp_path):
    plan = _plan(tmp_path / "s", grid={"algorithm.reduction": ["token_mean", "seq_mean_token_mean"],
                                       "algorithm.epsilon_high": ["0.2", "0.28"]})
    assert [r.name for r in plan.runs[:3]] == ["reduction=token_mean__epsilon_high=0.2__seed0",
                                               "reduction=token_mean__epsilon_high=0.2__seed1",
                                               "reduction=token_mean__epsilon_high=0.28__seed0"]
    assert len(plan.runs) == 8 and all(r.steps == 2 for r in plan.runs)
    with pytest.raises(Exception, match="reduction"):  # a bad value fails at plan time, naming the key
        _plan(tmp_path / "t", grid={"algorithm.reduction": ["token_mean", "nonsense"]})


def test_sweep_runs_every_combination_then_skips_finished_runs_and_resumes_the_rest(tmp_path):
    out = tmp_path / "sweep"
    first = FakeRunner(codes={"reduction=seq_mean_token_mean__seed0": 1})
    records = run_sweep(_plan(out), runner=first, echo=lambda line: None)
    assert len(first.calls) == 4
    assert [(r["run_dir"], r["status"]) for r in records] == [
        ("reduction=token_mean__seed0", "finished"), ("reduction=token_mean__seed1", "finished"),
        ("reduction=seq_mean_token_mean__seed0", "failed"), ("reduction=seq_mean_token_mean__seed1", "finished")]
    failed = sweep_failures(records)
    assert failed[0]["returncode"] == 1 and "injected failure" in failed[0]["error"]  # the log's last line
    manifest = read_manifest(out)
    assert manifest["grid"] == GRID and manifest["seeds"] == [0, 1] and manifest["overrides"] == ["train.steps=2"]
    assert manifest["runs"] == records
    assert first.calls[0][-3:] == ["train.seed=0", f"train.run_dir={out}/reduction=token_mean__seed0",
                                   "train.progress=false"]

    finished = out / "reduction=token_mean__seed0" / "metrics.jsonl"
    mtime = finished.stat().st_mtime_ns
    # the failed run left a checkpoint (step 1 of 2): the same command resumes it and nothing else
    assert run_status(out / "reduction=seq_mean_token_mean__seed0", 2) == "interrupted"
    second = FakeRunner()
    records = run_sweep(_plan(out), runner=second, echo=lambda line: None)
    assert [c[-1] for c in second.calls] == ["--resume"] and "reduction=seq_mean_token_mean__seed0" in second.calls[0][-3]
    assert not sweep_failures(records) and finished.stat().st_mtime_ns == mtime

    third = FakeRunner()
    run_sweep(_plan(out), runner=third, echo=lambda line: None)
    assert third.calls == []  # all finished: nothing re-run
    # a longer train.steps is another sweep (its overrides differ): refused, then --overwrite starts over
    with pytest.raises(SweepError, match="holds another sweep.*train.steps=2.*train.steps=3"):
        run_sweep(_plan(out, overrides=("train.steps=3",)), runner=third)
    run_sweep(_plan(out, overrides=("train.steps=3",)), runner=third, overwrite=True, echo=lambda line: None)
    assert len(third.calls) == 4 and all(c[-1] == "train.progress=false" for c in third.calls)  # fresh starts


def test_run_status_reads_summary_steps_and_checkpoints(tmp_path):
    run = tmp_path / "r"
    assert run_status(run, 2) == "missing"
    run.mkdir()
    (run / "config.yaml").write_text("x: 1\n")
    assert run_status(run, 2) == "missing"  # a config alone is no run
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    assert run_status(run, 2) == "failed_early"  # nothing to resume: started over with --overwrite
    (run / "checkpoints" / "1").mkdir(parents=True)
    assert run_status(run, 2) == "interrupted"
    (run / "summary.json").write_text('{"steps": 1}')
    assert run_status(run, 2) == "interrupted"  # finished a shorter run: not this one
    (run / "summary.json").write_text('{"steps": 2}')
    assert run_status(run, 2) == "finished"


def test_an_interrupted_run_stops_the_sweep_and_the_cli_reports_failures(tmp_path, monkeypatch, capsys):
    out = tmp_path / "sweep"
    runner = FakeRunner(codes={"reduction=token_mean__seed1": 130})  # Ctrl-C: the run saved and stopped
    records = run_sweep(_plan(out), runner=runner, echo=lambda line: None)
    assert len(runner.calls) == 2 and records[1]["status"] == "interrupted"
    assert [r["status"] for r in read_manifest(out)["runs"]] == ["finished", "interrupted", "missing", "missing"]

    import rljax.tools.sweep as sweep_module
    monkeypatch.setattr(sweep_module, "subprocess_runner", FakeRunner(codes={"reduction=token_mean__seed1": 1}))
    code = main(["sweep", CONFIG, "--grid", "algorithm.reduction=token_mean,seq_mean_token_mean", "--seeds", "0,1",
                 "--out", str(out), "train.steps=2"])
    assert code == 1
    err = capsys.readouterr().err
    assert "1 of 4 runs not finished: reduction=token_mean__seed1 (failed)" in err


def test_paired_bootstrap_by_hand():
    same = paired_bootstrap([0.3, 0.5, 0.7], [0.3, 0.5, 0.7])
    assert (same["mean"], same["low"], same["high"], same["n"]) == (0.0, 0.0, 0.0, 3)
    shifted = paired_bootstrap([0.55, 0.75, 0.95], [0.3, 0.5, 0.7])  # d = 0.25 at every seed
    np.testing.assert_allclose([shifted["mean"], shifted["low"], shifted["high"]], [0.25, 0.25, 0.25], atol=1e-12)
    # d = (0, 1): resample means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4 -> the 2.5% and 97.5%
    # percentiles of 10,000 draws are the extremes 0 and 1
    two = paired_bootstrap([1.0, 3.0], [1.0, 2.0])
    assert (two["mean"], two["low"], two["high"]) == (0.5, 0.0, 1.0)
    assert two == paired_bootstrap([1.0, 3.0], [1.0, 2.0])  # fixed rng seed: the same interval every time
    assert paired_bootstrap([], [])["n"] == 0
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1.0], [1.0, 2.0])


def test_compare_table_by_hand(tmp_path, capsys):
    out = tmp_path / "sweep"
    run_sweep(_plan(out), runner=FakeRunner(), echo=lambda line: None)
    result = compare([str(out)], metrics=["eval/reward", "eval/loss"])
    assert result["baseline"] == "reduction=token_mean"
    reward = result["metrics"]["eval/reward"]
    base, other = reward["reduction=token_mean"], reward["reduction=seq_mean_token_mean"]
    assert base["seeds"] == [0, 1] and base["final"] == [0.0, 0.1] and base["best"] == [0.5, 0.5]
    np.testing.assert_allclose(other["final"], [0.25, 0.35])
    diff = other["diff"]  # a constant shift of 0.25 at both seeds
    np.testing.assert_allclose([diff["mean"], diff["low"], diff["high"]], [0.25, 0.25, 0.25], atol=1e-12)
    loss = result["metrics"]["eval/loss"]["reduction=seq_mean_token_mean"]
    assert loss["best"] == [1.75, 1.75]  # a loss: the minimum (logged once here)
    md = result["markdown"]
    # mean ± sample std of (0, 0.1): 0.05 ± 0.0707
    assert "| `reduction=token_mean` | 2 | 0.05 ± 0.0707 (n=2) | 0.5 ± 0 (n=2) | (baseline) |" in md
    assert "| `reduction=seq_mean_token_mean` | 2 | 0.3 ± 0.0707 (n=2) | 0.75 ± 0 (n=2) | +0.25 [+0.25, +0.25] (n=2) |" in md
    assert main(["compare", str(out), "--baseline", "reduction=seq_mean_token_mean", "--metric", "eval/reward"]) == 0
    saved = json.loads((out / "compare.json").read_text())
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # every run's curves overlaid
    assert saved["baseline"] == "reduction=seq_mean_token_mean"
    assert saved["metrics"]["eval/reward"]["reduction=token_mean"]["diff"]["mean"] == pytest.approx(-0.25)
    assert "+0.25" not in (out / "compare.md").read_text() and "-0.25" in (out / "compare.md").read_text()
    # run directories given directly: grouped by name less __seedN
    dirs = [str(out / n) for n in ("reduction=token_mean__seed0", "reduction=seq_mean_token_mean__seed0")]
    for d in dirs:
        with open(os.path.join(d, "config.yaml"), "w") as f:
            f.write("train: {seed: 0}\n")
    direct = compare(dirs, metrics=["eval/reward"])
    assert direct["metrics"]["eval/reward"]["reduction=seq_mean_token_mean"]["diff"]["mean"] == pytest.approx(0.25)
    assert main(["compare", str(out), "--metric", "eval/nothing"]) == 2
    assert "eval/nothing: not logged by these runs" in capsys.readouterr().err


@pytest.mark.heavy  # four tiny training runs in subprocesses: ~1 min each on the shared 2-core CPU
def test_a_real_sweep_of_tiny_runs_resumes_and_compares(tmp_path, capsys):
    from rljax.models.tiny import make_tiny_model_dir

    tiny = make_tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "sweep"
    argv = ["sweep", CONFIG, "--grid", "algorithm.reduction=token_mean,seq_mean_token_mean", "--seeds", "0,1",
            "--out", str(out), f"model.name={tiny}", "train.steps=2", "data.train_size=32", "data.eval_size=4",
            "sampling.max_new_tokens=4", "data.max_prompt_length=512"]
    assert main(argv) == 0
    runs = read_manifest(out)["runs"]
    assert [r["status"] for r in runs] == ["finished"] * 4
    mtimes = {r["run_dir"]: (out / r["run_dir"] / "summary.json").stat().st_mtime_ns for r in runs}
    # interrupt one by hand: drop its end marker; the rerun resumes it from its checkpoint
    os.remove(out / runs[3]["run_dir"] / "summary.json")
    assert main(argv) == 0
    log = (out / runs[3]["run_dir"] / "sweep.log").read_text()
    assert log.count("--resume") == 1
    for r in runs[:3]:
        assert (out / r["run_dir"] / "summary.json").stat().st_mtime_ns == mtimes[r["run_dir"]]
    assert main(["compare", str(out), "--metric", "eval/reward"]) == 0
    assert "| `reduction=seq_mean_token_mean` | 2 |" in capsys.readouterr().out


def test_compare_leaves_out_runs_that_did_not_finish(tmp_path):
    out = tmp_path / "sweep"
    run_sweep(_plan(out), runner=FakeRunner(codes={"reduction=seq_mean_token_mean__seed0": 1}), echo=lambda line: None)
    result = compare([str(out)], metrics=["eval/reward"])
    assert [r["run_dir"].rsplit("/", 1)[-1] for r in result["left_out"]] == ["reduction=seq_mean_token_mean__seed0"]
    other = result["metrics"]["eval/reward"]["reduction=seq_mean_token_mean"]
    assert other["seeds"] == [1] and other["diff"]["n"] == 1  # paired on the seed both settings finished
    np.testing.assert_allclose(other["diff"]["mean"], 0.25)
    assert "Left out (not finished): reduction=seq_mean_token_mean__seed0 (failed)." in result["markdown"]
