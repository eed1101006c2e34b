"""The unit tier stays quick: no test file in tests/unit/ starts a process, builds a model or trains one.

A static check of the sources (the names that start processes or run a trainer), so a slow test put
in the wrong folder fails here in a second; tests/durations.py checks the measured times.
"""
import os
import re

import pytest

UNIT = os.path.dirname(os.path.abspath(__file__))

# What tests/integration/ (models, trainers, the CLI in-process) and tests/system/ (processes) are for;
# compiling a model's passes is what made unit files take minutes.
FORBIDDEN = re.compile(r"\bsubprocess\b|\bPopen\b|\bmultiprocessing\b|\bsys\.executable\b|\bos\.fork\b"
                       r"|\btests\._processes\b|\b(OnlineTrainer|OfflineTrainer|trainer_for)\b|\.fit\(|\bcli\.main\("
                       r"|\b(init_model|make_tiny_model_dir|build_run)\(")


def _uses(text):
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if FORBIDDEN.search(line) and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(UNIT) if f.startswith("test_") and f.endswith(".py")
                                        and f != os.path.basename(__file__)))
def test_a_unit_test_file_starts_no_process_and_trains_nothing(name):
    with open(os.path.join(UNIT, name)) as f:
        uses = _uses(f.read())
    assert not uses, f"tests/unit/{name} belongs in tests/integration or tests/system: " + "; ".join(uses)


def test_the_check_sees_each_kind_of_use():
    for line in ["import subprocess", "proc = Popen(cmd)", "OnlineTrainer(cfg).fit()", "trainer_for(cfg)",
                 "cli.main(['train', path])", "[sys.executable, '-c', code]", "from tests._processes import run_joined",
                 "model = init_model(CFG, seed=0)", "make_tiny_model_dir(str(tmp_path))", "build_run(cfg)"]:
        assert _uses(line), line
    assert not _uses("trainer = trainers.BpeTrainer(vocab_size=300)")
    assert not _uses("# a comment may name subprocess")
