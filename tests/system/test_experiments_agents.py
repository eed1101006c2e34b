"""experiments/agents/openai_calculator.py: its --smoke preset serves a tiny random model, runs both
openai-client agents on it and writes the table."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module():
    spec = importlib.util.spec_from_file_location(
        "openai_calculator", os.path.join(REPO, "experiments", "agents", "openai_calculator.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tools_and_the_score_of_the_calculator_agents():
    m = _module()
    assert m._tool("multiply", '{"a": 12, "b": 34}') == "408" and m._tool("add", '{"a": 408, "b": 5}') == "413"
    assert m._tool("add", '{"a": 1}').startswith("error: KeyError") and "no tool" in m._tool("pow", '{"a": 1, "b": 2}')
    task = {"answer": 413}
    assert m._score("so <answer>413</answer>", task) == 1.0 and m._score("it is 413", task) == 1.0
    assert m._score("<answer>413</answer> not 5", task) == 1.0 and m._score("<answer>412</answer> 413", task) == 0.0
    assert m._score(None, task) == 0.0
    train, held_out = m.tasks(64, "train"), m.tasks(64, "eval")
    assert not {t["prompt"] for t in train} & {t["prompt"] for t in held_out}


def test_smoke_preset_writes_its_table(capsys):
    _module().main(["--smoke"])
    out = capsys.readouterr().out
    assert "| run (appends) |" in out and "| run_rewriting (own notes) |" in out
