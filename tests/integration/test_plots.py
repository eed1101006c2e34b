"""rljax.plots.plot_runs and `rljax plot`: a PNG of a run's curves, overlays, the refusals; the
end-of-run RUN_DIR/curves.png (rljax.training.loop.write_curves) and that a plot failure warns."""

import json

import pytest

from rljax.tools import cli
from rljax.errors import UserError
from rljax.plots import plot_keys, plot_runs
from rljax.run_config import TrainSection
from rljax.training.loop import write_curves

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(path, records):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"time": 1.0, **r}) + "\n")
    return path


def _online(path, shift=0.0):
    return _run(path, [{"step": 0, "eval/reward": 0.1 + shift, "eval/acc/missing": 0.5}]
                + [{"step": s, "reward/acc/mean": shift + s / 10, "reward/total/mean": s / 20, "kl": 0.01 * s,
                    "kl/mean": 0.01 * s, "policy/entropy": 1.0, "completion/mean_length": 5, "loss": 1 / s,
                    "grad_norm": None} for s in range(1, 6)]
                + [{"step": 5, "eval/reward": 0.4 + shift}])


def _is_png(path):
    data = path.read_bytes()
    return len(data) > len(PNG_SIGNATURE) and data.startswith(PNG_SIGNATURE)


def test_panels_are_the_keys_that_exist():
    # an online run: rewards (functions, then the total), held-out metrics (not the missing
    # fractions), TRL's kl before rljax's, rljax's entropy and length where TRL's are absent; a
    # grad_norm logged only as null has no panel
    records = [{"step": 1, "reward/total/mean": 1.0, "reward/acc/mean": 1.0, "kl/mean": 0.1, "kl": 0.1,
                "policy/entropy": 1.0, "completion/mean_length": 3, "loss": 1.0, "grad_norm": None},
               {"step": 1, "eval/reward": 0.5, "eval/acc/missing": 0.5, "eval/acc/timeouts": 0.0,
                "eval/acc/memory": 0.0, "eval/acc/crashes": 0.0}]  # a bounded verifier's counters: no panel
    assert plot_keys([records]) == [
        ("reward/acc/mean", ("reward/acc/mean",)), ("reward/total/mean", ("reward/total/mean",)),
        ("eval/reward", ("eval/reward",)), ("KL to the reference", ("kl", "kl/mean")),
        ("entropy", ("entropy", "policy/entropy")),
        ("completion length (tokens)", ("completions/mean_length", "completion/mean_length")),
        ("loss", ("loss",))]
    # an offline (DPO) run: its loss, accuracy and held-out keys
    dpo = [{"step": 1, "loss": 0.7, "grad_norm": 1.0, "rewards/accuracy": 0.5, "rewards/margin": 0.1},
           {"step": 1, "eval/loss": 0.6, "eval/rewards/accuracy": 0.6}]
    assert [title for title, _ in plot_keys([dpo])] == ["eval/loss", "eval/rewards/accuracy", "loss", "grad norm",
                                                          "rewards/accuracy", "rewards/margin"]


def test_an_overlay_of_two_runs_is_a_png(tmp_path):
    # (one run's PNG: test_the_command and test_end_of_run_curves_and_a_failure_only_warns)
    a, b = _online(tmp_path / "a"), _online(tmp_path / "b", shift=0.3)
    both = plot_runs([str(a), b], tmp_path / "sub" / "both.png", labels=["base", "kl"], title="two runs")
    assert both == tmp_path / "sub" / "both.png" and _is_png(both)


def test_bad_run_directories_name_the_path(tmp_path):
    good = _online(tmp_path / "good")
    (tmp_path / "not_a_run").mkdir()
    _run(tmp_path / "empty", [])
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "metrics.jsonl").write_text('{"step": 1, "lo')
    cases = {tmp_path / "missing": "no such directory", tmp_path / "not_a_run": "no metrics.jsonl in it",
             tmp_path / "empty": "has no metrics record", tmp_path / "torn": "has no metrics record"}
    for path, why in cases.items():
        with pytest.raises(UserError, match=why) as err:
            plot_runs([good, path], tmp_path / "x.png")
        assert str(path) in str(err.value)
    _run(tmp_path / "no_curves", [{"step": 1, "time/step_s": 0.1}])
    with pytest.raises(UserError, match="nothing to plot in .*no_curves"):
        plot_runs([tmp_path / "no_curves"], tmp_path / "x.png")
    with pytest.raises(UserError, match="1 labels for 2 run directories"):
        plot_runs([good, good], tmp_path / "x.png", labels=["one"])
    assert not (tmp_path / "x.png").exists()


def test_the_command(tmp_path, capsys):
    a, b = _online(tmp_path / "a"), _online(tmp_path / "b")
    assert cli.main(["plot", str(a)]) == 0
    assert _is_png(a / "curves.png") and capsys.readouterr().out.strip() == str(a / "curves.png")
    assert cli.main(["plot", str(a), str(b)]) == 2
    assert "rljax plot: error: --out PNG is required with several run directories" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "nope")]) == 2
    assert f"rljax plot: error: plot: {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    assert cli.main(["plot", str(a), str(b), "--out", str(tmp_path / "ab.png"), "--label", "x"]) == 2
    assert "1 labels for 2 run directories" in capsys.readouterr().err


def test_end_of_run_curves_and_a_failure_only_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("RLJAX_PLOT", "1")
    run = _online(tmp_path / "run")
    write_curves(TrainSection(run_dir=str(run)))
    assert _is_png(run / "curves.png")
    (run / "curves.png").unlink()
    write_curves(TrainSection(run_dir=str(run), plot=False))
    write_curves(TrainSection(run_dir=str(run)), active=False)  # not process 0
    assert not (run / "curves.png").exists()
    (run / "metrics.jsonl").write_text("")  # a run that logged nothing: plotting fails, the run does not
    with pytest.warns(RuntimeWarning, match=r"could not write .*curves.png: UserError: .*has no metrics record"):
        write_curves(TrainSection(run_dir=str(run)))
