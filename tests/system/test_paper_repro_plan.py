"""``--plan TARGET`` of the reproductions (paper_repro/_plan.py): the preset's largest run goes through
``rljax plan`` instead of training, from a model directory holding only the preset's config.json."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "paper_repro"))  # the sentiment reproductions import their siblings by name

from paper_repro import dr_grpo_length_bias  # noqa: E402


def _load(name):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "paper_repro" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_preset_plans_on_the_cpu_and_fits(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        dr_grpo_length_bias.main(["--smoke", "--plan", "cpu-1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert stop.value.code == 0, out[-3000:]
    assert "## --plan cpu-1: GRPO (smoke preset)" in out and "on cpu-1 (1 × CPU (host))" in out
    assert out.rstrip().endswith("FITS")
    # no pretraining: the model directory holds the smoke policy's shapes and nothing else
    model = tmp_path / "plan" / "model"
    assert os.listdir(model) == ["config.json"]
    config = json.loads((model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (1, 32, 259)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["dpo_sentiment_frontier", "rm_overoptimization"])
def test_sentiment_reproductions_plan_both_runs_and_pass_on_the_status(name, tmp_path, capsys):
    # an unknown target: `rljax plan`'s own error and exit status 2, for each of the two runs, with no
    # corpus read and nothing trained
    with pytest.raises(SystemExit) as stop:
        _load(name).main(["--full", "--plan", "v9-4", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert stop.value.code == 2
    assert captured.out.count("## --plan v9-4: ") == 2 and "(full preset)" in captured.out
    assert captured.err.count("'v9-4' is not a known target") == 2
    config = json.loads((tmp_path / "plan" / "model" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (6, 256, 4096)


@pytest.mark.parametrize("name", ["dapo_clip_higher", "rloo_vs_ppo", "online_vs_offline"])
def test_every_arithmetic_reproduction_plans_its_largest_run_instead_of_training(name, tmp_path, capsys):
    # an unknown target: `rljax plan`'s error and status 2, reached without pretraining or training
    # (online_vs_offline accepted --plan and then tried to train on the shapes-only model directory)
    with pytest.raises(SystemExit) as stop:
        _load(name).main(["--full", "--plan", "v9-4", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert stop.value.code == 2, captured.err[-3000:]
    assert captured.out.count("## --plan v9-4: ") == 1 and "(full preset)" in captured.out
    assert captured.err.count("'v9-4' is not a known target") == 1
    assert os.listdir(tmp_path / "plan" / "model") == ["config.json"] and not (tmp_path / "runs").exists()
