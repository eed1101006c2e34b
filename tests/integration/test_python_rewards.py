"""Bring-your-own reward functions (`type: python`): TRL's calling convention, loading from YAML,
errors that name the config key, and rewards in the shape of TRL's GRPO tutorial in a tiny `rljax train`
run."""

import json
import math
import os

import numpy as np
import pytest

import rljax.tools.cli
from rljax.errors import MissingFileError, UserError
from rljax.rewards import build_rewards, make_python_reward, trl_reward_kwargs
from tests._tiny import make_tiny_model_dir

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
TUTORIAL_FILE = os.path.join(HERE, "_trl_tutorial_rewards.py")

CHAT_PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def _row(prompt, **columns):
    # what rljax.rollout hands a reward: the dataset row plus rljax's own per-row keys
    return dict(prompt=prompt, key="k", completion_length=3, completion_ids=[5, 6, 2], **columns)


def test_conversational_rows_get_message_lists_and_every_dataset_column():
    rows = [_row(CHAT_PROMPT, solution="$7$", level=1), _row(CHAT_PROMPT, solution="$8$", level=2)]
    kwargs = trl_reward_kwargs(["<answer>7</answer>", "8"], rows)
    assert kwargs == {
        "prompts": [CHAT_PROMPT, CHAT_PROMPT],
        "completions": [[{"role": "assistant", "content": "<answer>7</answer>"}],
                        [{"role": "assistant", "content": "8"}]],
        "completion_ids": [[5, 6, 2], [5, 6, 2]],
        "solution": ["$7$", "$8$"],
        "level": [1, 2],
    }


def test_plain_prompts_get_plain_completions():
    kwargs = trl_reward_kwargs(["a", "b"], [_row("The sky is", answer="blue"), _row("Grass is", answer="green")])
    assert kwargs["prompts"] == ["The sky is", "Grass is"]
    assert kwargs["completions"] == ["a", "b"]
    assert kwargs["answer"] == ["blue", "green"]
    assert set(kwargs) == {"prompts", "completions", "completion_ids", "answer"}


def test_the_tutorial_rewards_score_hand_written_completions():
    rewards = build_rewards({
        "format": {"type": "python", "function": f"{TUTORIAL_FILE}:format_reward", "weight": 0.5},
        "accuracy": {"type": "python", "function": "tests._trl_tutorial_rewards:accuracy_reward"},
    })
    completions = [
        "<think>half of one</think>\n<answer>$\\frac{1}{2}$</answer>",  # formatted, right
        "<think>two</think><answer>$2$</answer>",  # formatted, wrong
        "The answer is $\\frac{1}{2}$",  # unformatted, right
    ]
    rows = [_row(CHAT_PROMPT, solution="$\\frac{1}{2}$")] * 3
    out = rewards(completions, rows)
    np.testing.assert_array_equal(out.per_function["format"], [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(out.per_function["accuracy"], [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(out.total, [1.5, 0.5, 1.0])  # 0.5 * format + 1.0 * accuracy


def test_none_is_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text(
        "def only_with_solution(completions, solution, **kwargs):\n"
        "    return [None if s is None else float(len(c)) for c, s in zip(completions, solution)]\n")
    rewards = build_rewards({"len": {"type": "python", "function": "my_rewards:only_with_solution"}})
    out = rewards(["abc", "de"], [_row("p", solution=None), _row("p", solution="x")])
    assert math.isnan(out.per_function["len"][0]) and out.per_function["len"][1] == 2.0
    assert out.missing.tolist() == [True, False] and out.total.tolist() == [0.0, 2.0]


def test_module_and_file_paths_resolve_from_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cwd_rewards.py").write_text("def one(completions, **kw):\n    return [1.0] * len(completions)\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.py").write_text("def two(completions, **kw):\n    return [2] * len(completions)\n")
    rewards = build_rewards({"a": {"type": "python", "function": "cwd_rewards:one"},
                             "b": {"type": "python", "function": "sub/r.py:two"}})
    assert rewards(["x"], [_row("p")]).total.tolist() == [3.0]


@pytest.mark.parametrize("source,function,error,message", [
    ("", "no_such_module_xyz:f", UserError, r"rewards\.acc: function 'no_such_module_xyz:f': no module named "
                                            r"'no_such_module_xyz'"),
    ("", "missing/file.py:f", MissingFileError, r"rewards\.acc: function 'missing/file.py:f': no such file"),
    ("def f(completions, **kw): return []\n", "bad_mod:g", UserError,
     r"rewards\.acc: function 'bad_mod:g': 'bad_mod' has no attribute 'g'; it defines f"),
    ("f = 3\n", "bad_mod:f", UserError, r"rewards\.acc: function 'bad_mod:f' is a int, not a callable"),
    ("import no_such_dependency_xyz\n", "bad_mod:f", UserError,
     r"rewards\.acc: function 'bad_mod:f': importing 'bad_mod' failed: ModuleNotFoundError"),
    ("", "just_a_name", UserError, r"rewards\.acc: function must be 'module:name'"),
])
def test_loading_errors_name_the_key_and_the_function(tmp_path, monkeypatch, source, function, error, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_mod.py").write_text(source)
    monkeypatch.delitem(__import__("sys").modules, "bad_mod", raising=False)
    with pytest.raises(error, match=message):
        build_rewards({"acc": {"type": "python", "function": function}})


@pytest.mark.parametrize("body,message", [
    ("return [1.0]", r"returned 1 values for 2 completions"),
    ("return [1.0, 'high']", r"returned 'high' \(str\) for completion 1; expected a number or None"),
    ("return 1.0", r"returned float; expected a list of 2 numbers"),
])
def test_bad_results_name_the_key_and_the_function(tmp_path, monkeypatch, body, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_out.py").write_text(f"def f(completions, **kw):\n    {body}\n")
    rewards = build_rewards({"acc": {"type": "python", "function": "bad_out.py:f"}})
    with pytest.raises(UserError, match=r"rewards\.acc: function 'bad_out.py:f' " + message):
        rewards(["a", "b"], [_row("p"), _row("p")])


def test_a_function_needing_what_rljax_does_not_pass_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "needs_state.py").write_text(
        "def f(completions, trainer_state, **kw):\n    return [float(trainer_state.global_step)] * len(completions)\n"
        "def g(completions, solution):\n    return [0.0] * len(completions)\n")
    rewards = build_rewards({"s": {"type": "python", "function": "needs_state.py:f"}})
    with pytest.raises(UserError, match=r"rewards\.s: .*rljax does not pass trainer_state"):
        rewards(["a"], [_row("p")])
    strict = make_python_reward(function="needs_state.py:g", config_key="t")
    with pytest.raises(UserError, match=r"rewards\.t: .*cannot be called with the arguments TRL passes "
                                        r"\(prompts, completions, completion_ids, solution\)"):
        strict(["a"], [_row("p", solution="1")])


def test_trl_tutorial_rewards_from_yaml_in_a_tiny_train_run(tmp_path):
    """`rljax train` with TRL's tutorial rewards named in YAML. The tiny model's text is random, so
    every completion is made to start with a known answer by `data.assistant_prefix` (rewards score
    prefix + completion) and one generated token follows: "<answer>\\boxed{7}</answer>" + 1 byte.
    By hand: format_reward's pattern starts with `^<think>`, so 0.0 for every completion; accuracy_reward
    finds \\boxed{7}: 1.0 against solution "$7$" and 0.0 against "$8$", so its mean over the two
    prompts' equally many completions is 0.5 and reward/total/mean = 0.2 * 0 + 1.0 * 0.5."""
    model = make_tiny_model_dir(tmp_path / "model")
    data = tmp_path / "math.jsonl"
    with open(data, "w") as f:
        for question, solution in (("What is 3 + 4?", "$7$"), ("What is 4 + 4?", "$8$")):
            f.write(json.dumps({"prompt": [{"role": "user", "content": question}], "solution": solution}) + "\n")
    config = tmp_path / "byo.yaml"
    config.write_text(f"""
model: {{name: {model}}}
data: {{task: "", path: {data}, answer_column: "", eval_fraction: 0.0, eval_size: 0, max_prompt_length: 64,
        assistant_prefix: "<answer>\\\\boxed{{7}}</answer>"}}
sampling: {{max_new_tokens: 1}}
algorithm: {{name: grpo, group_size: 2, prompts_per_step: 2, micro_batch_size: 4}}
train: {{steps: 1, run_dir: {tmp_path / 'run'}, progress: false}}
rewards:
  format: {{type: python, function: "{TUTORIAL_FILE}:format_reward", weight: 0.2}}
  accuracy: {{type: python, function: "tests._trl_tutorial_rewards:accuracy_reward", weight: 1.0}}
""")
    assert rljax.tools.cli.main(["train", str(config)]) == 0
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        step = [m for m in map(json.loads, f) if "reward/accuracy/mean" in m]
    assert len(step) == 1
    assert step[0]["reward/format/mean"] == 0.0
    assert step[0]["reward/accuracy/mean"] == 0.5
    assert step[0]["reward/total/mean"] == 0.5
