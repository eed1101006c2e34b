"""paper_repro/async_vs_sync.py: the method set, the verdict from hand-made numbers, and the --smoke
preset end to end (every method trains; the staleness each run had is the schedule's)."""

import json
import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from paper_repro import async_vs_sync as av  # noqa: E402


def test_every_staleness_runs_without_and_with_the_correction():
    m = av.methods((1, 4))
    assert list(m) == ["sync", "sync + seq_mask", "k=1", "k=1 + seq_mask", "k=4", "k=4 + seq_mask"]
    assert m["k=4 + seq_mask"] == ["train.max_staleness=4", *av.SEQ_MASK]


def test_verdict_from_hand_made_rewards():
    def seeds(*rewards, masked=0.1):
        return [{"reward": r, "masked": masked} for r in rewards]

    degraded = {"sync": seeds(0.5, 0.6), "sync + seq_mask": seeds(0.5, 0.6), "k=4": seeds(0.3, 0.4),
                "k=4 + seq_mask": seeds(0.52, 0.58)}
    text = av.verdict(degraded, (1, 4))
    assert "degrades training: **yes** — final reward, sync minus k=4, paired by seed: 0.2" in text
    assert "with seq_mask it does not: **yes**" in text
    both = {**degraded, "k=4 + seq_mask": seeds(0.3, 0.4)}
    assert "with seq_mask it does not: **no**" in av.verdict(both, (1, 4))
    flat = {**degraded, "k=4": seeds(0.5, 0.6)}
    assert "degrades training: **no**" in av.verdict(flat, (1, 4))
    assert "**not testable**" in av.verdict(flat, (1, 4))


@pytest.mark.slow
def test_async_vs_sync_smoke(tmp_path, paper_repro_cache):
    out = str(tmp_path / "async")
    result = av.main(["--smoke", "--out", out, "--cache", paper_repro_cache])
    for name in ("results.md", "config.json", "environment.json", "curves.json", "async_vs_sync.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "async_vs_sync.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    methods = av.methods(av.PRESETS["smoke"]["stalenesses"])
    text = open(os.path.join(out, "results.md")).read()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(methods)
    curves = json.load(open(os.path.join(out, "curves.json")))["curves"]
    assert set(curves) == set(methods)
    for method, runs in curves.items():
        (rows,) = runs  # one seed
        assert [r["step"] for r in rows] == [1, 2, 3]
        k = 0 if method.startswith("sync") else int(method.split()[0][2:])
        # the schedule: step s (1-based) trains on tokens min(s - 1, k) versions old
        assert [r["async/staleness_mean"] for r in rows] == [min(s, k) for s in range(3)], method
        assert math.isfinite(rows[-1]["eval_correct"]) and math.isfinite(rows[-1]["reward_sampled"])
    for claim in ("(a) large staleness", "(b) with seq_mask", "(c) wall time"):
        assert claim in text
    assert result["per_seed"]["k=2"][0]["staleness"] == 2
