"""A TRL-style data file (prompt + solution, no answer) loads when no configured reward reads the
answer column; a reward that reads it still gets a clear error naming the column and the reward."""

import json

import pytest

from rljax.config import from_yaml
from rljax.data.loading import MissingColumnError, load_records
from rljax.run_config import RunConfig
from rljax.training.data import answer_readers, online_examples


def _data(tmp_path):
    path = tmp_path / "math.jsonl"
    with open(path, "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": f"What is {i} + 4?", "solution": f"${i + 4}$"}) + "\n")
    return path


def _cfg(path, rewards, answer_column=None):
    column = "" if answer_column is None else f", answer_column: {answer_column!r}"
    return from_yaml(RunConfig, f"""
data: {{task: "", path: {path}, eval_fraction: 0.0, eval_size: 0{column}}}
algorithm: {{name: grpo}}
rewards: {rewards}
""")


def test_trl_style_file_with_python_rewards_needs_no_answer_column(tmp_path):
    path = _data(tmp_path)
    cfg = _cfg(path, '{accuracy: {type: python, function: "tests._trl_tutorial_rewards:accuracy_reward"}}')
    assert answer_readers(cfg.rewards) == []
    train, evals, counts = online_examples(cfg)
    assert len(train) == 6 and not evals and counts == {"rows": 6}
    assert train[0]["solution"] == "$4$" and "answer" not in train[0]


def test_a_reward_that_reads_the_answer_still_requires_the_column(tmp_path):
    path = _data(tmp_path)
    cfg = _cfg(path, '{acc: {type: answer}, fmt: {type: format, weight: 0.1}}')
    assert answer_readers(cfg.rewards) == ["rewards.acc"]
    with pytest.raises(MissingColumnError, match=r"answer column 'answer' not found .* read by rewards.acc"):
        online_examples(cfg)
    train, _, _ = online_examples(_cfg(path, "{answer: 1.0}", answer_column="solution"))
    assert train[0]["answer"] == "$4$"


def test_load_records_answer_optional_only_when_absent_from_every_row(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(MissingColumnError, match=r"answer column 'answer' not found .* \(row 1\)"):
        load_records(path, answer_column="answer", answer_required=False)
    assert "answer" not in load_records(_data(tmp_path), answer_column="answer", answer_required=False)[0]
