"""experiments/ablate_*.py: each file's --smoke preset plans a valid sweep of the main config, runs it and
writes its table (a stand-in runner by default; heavy: the real tiny runs in subprocesses)."""

import os
import sys

import pytest

from tests.integration.test_sweep import FakeRunner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from experiments import ablate_grpo_normalisation, ablate_kl_placement, ablate_sampler_engine  # noqa: E402


@pytest.mark.parametrize("module,baseline,other", [
    (ablate_grpo_normalisation, "reduction=token_mean", "reduction=seq_mean_token_mean"),
    (ablate_kl_placement, "kl_placement=loss", "kl_placement=reward"),
    (ablate_sampler_engine, "engine=static", "engine=paged"),
])
def test_smoke_preset_writes_its_table(module, baseline, other, tmp_path):
    runner = FakeRunner()
    out = tmp_path / "sweep"
    (out / "tiny_model").mkdir(parents=True)  # the stand-in runner loads no model: skip building one
    assert module.main(["--smoke", "--out", str(out)], runner=runner) == 0
    assert len(runner.calls) == 4 and all("train.steps=2" in c for c in runner.calls)
    if module is ablate_kl_placement:
        assert all("algorithm.kl_coef=0.04" in c for c in runner.calls)
    results = (out / "results.md").read_text()
    assert module.QUESTION in results and f"| `{baseline}` | 2 |" in results and f"| `{other}` | 2 |" in results
    assert not os.path.exists(os.path.join(REPO, "experiments", "results", "smoke"))


@pytest.mark.heavy  # four tiny training runs in subprocesses
def test_smoke_preset_for_real(tmp_path):
    out = tmp_path / "sweep"
    assert ablate_kl_placement.main(["--smoke", "--out", str(out)]) == 0
    assert "| `kl_placement=reward` | 2 |" in (out / "results.md").read_text()
