"""The accelerator check's CPU mode: ``gpu_check.py --cpu --smoke`` runs every part and writes numbers.

The GPU check runs only now and then, on a machine with no network; this keeps it from rotting in between.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTIONS = ["Summary", "Environment", "1a. Logits: device vs CPU", "1b. Sampler vs trainer log-probs",
            "1c. GRPO on the arithmetic policy", "2a. Speed: update and scoring, 1.5B", "3a. Plan vs measured, 1.5B",
            "2b. Generation tokens/s vs transformers, 1.5B"]
NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _table_rows(body: str) -> list[list[str]]:
    rows = [line.strip().strip("|").split("|") for line in body.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r] for r in rows[2:]]  # past the header and the |---| line


@pytest.mark.slow
def test_cpu_smoke_writes_every_section_with_numbers(tmp_path, paper_repro_cache):
    out = tmp_path / "gpu_check_cpu.md"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    # the smoke arithmetic policy the reproductions' smoke tests pretrain once per test run
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "accel", "gpu_check.py"), "--cpu",
                           "--smoke", "--out", str(out), "--cache", paper_repro_cache], capture_output=True, text=True,
                          env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sections = _sections(out.read_text())
    assert list(sections) == SECTIONS
    for name, body in sections.items():
        assert not body.startswith(("FAILED", "SKIPPED")), f"{name}: {body[:500]}"
    assert "Parts failed: none; skipped: none" in sections["Summary"]
    assert re.search(r"\| jax \| \d+\.\d+", sections["Environment"])

    logits = _table_rows(sections["1a. Logits: device vs CPU"])
    assert logits[0][0] == "highest" and float(logits[0][1]) <= 1e-4 and logits[0][3] == "PASS"
    logprobs = {(r[0], r[1]): r for r in _table_rows(sections["1b. Sampler vs trainer log-probs"])}
    assert float(logprobs["float32", "highest"][2]) <= 1e-5 and logprobs["float32", "highest"][4] == "PASS"
    assert float(logprobs["bfloat16", "highest"][2]) > 0  # reported: a real number, not a placeholder

    speed = _table_rows(sections["2a. Speed: update and scoring, 1.5B"])
    assert [r[0] for r in speed] == ["update (update_epochs)", "scoring (score_logprobs)"]
    for r in speed:
        step_s, mfu = float(r[3]), float(r[5])
        assert step_s > 0 and mfu > 0, r
    plan = {r[0]: r for r in _table_rows(sections["3a. Plan vs measured, 1.5B"])}
    assert float(plan["update: step time (s)"][1]) > 0 and float(plan["update: step time (s)"][2]) > 0
    assert re.fullmatch(NUMBER, plan["update: step time (s)"][3])
    gen = _table_rows(sections["2b. Generation tokens/s vs transformers, 1.5B"])
    assert [int(r[0]) for r in gen] == [4, 8]
    for r in gen:
        assert float(r[4]) > 0 and float(r[6]) > 0 and float(r[7]) > 0, r  # rljax and transformers tok/s
    grpo = _table_rows(sections["1c. GRPO on the arithmetic policy"])
    assert 0 <= float(grpo[0][0]) <= 1 and 0 <= float(grpo[0][1]) <= 1 and float(grpo[0][3]) > 0
