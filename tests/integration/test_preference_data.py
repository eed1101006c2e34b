"""Preference pairs, ranked lists and scored records: loading, chat form, validation, builders."""

import json

import numpy as np
import pytest

from rljax.config import ConfigError, from_yaml
from rljax.data.loading import MissingColumnError
from rljax.data.preferences import (
    InvalidRowError,
    best_vs_worst_pairs,
    load_preference_pairs,
    load_ranked_lists,
    pairs_from_task,
    ranked_from_task,
)
from rljax.data.records import load_scored_records, records_from_task
from rljax.data.tasks import make_task
from rljax.run_config import RunConfig
from rljax.training.data import split_by_prompt


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_plain_text_pairs_with_margin(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [
        {"question": "Hi?", "good": "Hello!", "bad": "Go away.", "strength": 2},
        {"question": "2+2?", "good": "4", "bad": "5", "strength": 0.5},
    ])
    pairs, counts = load_preference_pairs(path, prompt_column="question", chosen_column="good", rejected_column="bad",
                                          margin_column="strength")
    assert counts == {"rows": 2, "kept": 2}
    assert pairs[0] == {"prompt": "Hi?", "chosen": "Hello!", "rejected": "Go away.", "key": "Hi?", "margin": 2.0}


def test_chat_pairs_explicit_and_implicit_prompt():
    user = [{"role": "user", "content": "Name a colour."}]
    rows = [
        # TRL conversational form: the prompt column holds messages, responses one assistant message
        {"prompt": user, "chosen": [{"role": "assistant", "content": "Blue."}],
         "rejected": [{"role": "assistant", "content": "Seven."}]},
        # a string prompt and responses that repeat a shared turn: it joins the prompt
        {"prompt": "Name a colour.", "chosen": [{"role": "assistant", "content": "Red?"},
                                                {"role": "user", "content": "Another."},
                                                {"role": "assistant", "content": "Green."}],
         "rejected": [{"role": "assistant", "content": "Red?"}, {"role": "user", "content": "Another."},
                      {"role": "assistant", "content": "No."}]},
    ]
    pairs, _ = load_preference_pairs(rows)
    assert pairs[0]["prompt"] == user and (pairs[0]["chosen"], pairs[0]["rejected"]) == ("Blue.", "Seven.")
    assert [m["content"] for m in pairs[1]["prompt"]] == ["Name a colour.", "Red?", "Another."]
    assert pairs[1]["chosen"] == "Green."
    # Anthropic-HH style: no prompt column; the shared conversation is the prompt
    implicit = [{"chosen": user + [{"role": "assistant", "content": "Blue."}],
                 "rejected": user + [{"role": "assistant", "content": "Seven."}]}]
    pairs, _ = load_preference_pairs(implicit)
    assert pairs[0]["prompt"] == user and pairs[0]["key"] == json.dumps(user, sort_keys=True)


def test_bad_rows_error_or_are_counted_and_dropped():
    rows = [
        {"prompt": "a", "chosen": "x", "rejected": "y"},
        {"prompt": "b", "chosen": "   ", "rejected": "y"},  # empty response
        {"prompt": "c", "chosen": "same", "rejected": "same"},  # identical pair
        {"prompt": "d", "rejected": "y"},  # missing column in this row
        {"prompt": "e", "chosen": None, "rejected": "y"},  # null
        {"prompt": "", "chosen": "x", "rejected": "y"},  # empty prompt
    ]
    with pytest.raises(InvalidRowError, match=r"row 1: chosen is empty .*invalid_rows=drop"):
        load_preference_pairs(rows)
    with pytest.raises(InvalidRowError, match="row 1: chosen and rejected are identical"):
        load_preference_pairs(rows[:1] + rows[2:])
    pairs, counts = load_preference_pairs(rows, invalid="drop")
    assert [p["prompt"] for p in pairs] == ["a"]
    assert counts == {"rows": 6, "kept": 1, "dropped/empty_response": 1, "dropped/identical_pair": 1,
                      "dropped/missing_column": 2, "dropped/empty_prompt": 1}


def test_a_column_missing_everywhere_is_always_an_error():
    rows = [{"prompt": "a", "good": "x", "rejected": "y"}]
    for invalid in ("error", "drop"):
        with pytest.raises(MissingColumnError, match=r"chosen column 'chosen' is in no row.*'good'"):
            load_preference_pairs(rows, invalid=invalid)
    with pytest.raises(MissingColumnError, match="prompt column 'question'"):
        load_preference_pairs([{"prompt": "a", "chosen": "x", "rejected": "y"}], prompt_column="question")
    with pytest.raises(MissingColumnError, match="score column 'reward'"):
        load_scored_records([{"prompt": "a", "response": "x", "score": 1}], score_column="reward")


def test_ranked_lists():
    rows = [{"prompt": "q", "responses": ["best", {"role": "assistant", "content": "mid"}, "worst"]},
            {"prompt": "r", "responses": ["only"]}, {"prompt": "s", "responses": ["a", "a"]}]
    lists, counts = load_ranked_lists(rows, invalid="drop")
    assert lists == [{"prompt": "q", "responses": ["best", "mid", "worst"], "key": "q"}]
    assert counts == {"rows": 3, "kept": 1, "dropped/too_few_responses": 1, "dropped/identical_pair": 1}


@pytest.mark.parametrize("form", ["jsonl", "parquet", "dataset"])
def test_scored_records_from_jsonl_parquet_and_datasets(tmp_path, form):
    rows = [{"prompt": "p1", "response": "r1", "score": 1.0}, {"prompt": "p1", "response": "r2", "score": 0},
            {"prompt": "p2", "response": [{"role": "assistant", "content": "r3"}], "score": "0.5"},
            {"prompt": "p3", "response": "", "score": 1.0}, {"prompt": "p4", "response": "r", "score": "high"},
            {"prompt": "p5", "response": "r", "score": float("nan")}]
    if form == "jsonl":
        source = _jsonl(tmp_path / "r.jsonl", rows)
    else:
        # parquet / datasets need one type per column: responses as strings here
        flat = [dict(r, response=r["response"] if isinstance(r["response"], str) else "r3", score=str(r["score"]))
                for r in rows]
        import datasets

        source = datasets.Dataset.from_list(flat)
        if form == "parquet":
            source.to_parquet(str(tmp_path / "r.parquet"))
            source = str(tmp_path / "r.parquet")
    records, counts = load_scored_records(source, invalid="drop")
    assert [(r["prompt"], r["response"], r["score"]) for r in records] == [("p1", "r1", 1.0), ("p1", "r2", 0.0),
                                                                          ("p2", "r3", 0.5)]
    assert counts == {"rows": 6, "kept": 3, "dropped/empty_response": 1, "dropped/bad_score": 2}
    with pytest.raises(InvalidRowError, match="row 3: response is empty"):
        load_scored_records(source)


def test_best_vs_worst_of_n():
    examples = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c"}, {"prompt": "d"}]
    completions = ["a0", "a1", "a2",  "b0", "b1", "b2",  "c0", "c1", "c2",  "d0", "", "d0"]
    scores = [0.5, 1.0, 0.0,  1.0, 1.0, 1.0,  np.nan, 2.0, np.nan,  3.0, 9.0, 1.0]
    pairs, counts = best_vs_worst_pairs(examples, completions, scores, num_samples=3)
    assert [(p["prompt"], p["chosen"], p["rejected"], p["chosen_score"], p["rejected_score"]) for p in pairs] == [
        ("a", "a1", "a2", 1.0, 0.0)]
    assert pairs[0]["answer"] == "1"  # the example's other fields are kept
    assert counts == {"prompts": 4, "pairs": 1, "skipped/tie": 1, "skipped/too_few": 1, "skipped/identical": 1}
    pairs, counts = best_vs_worst_pairs(examples[:1], completions[:3], scores[:3], num_samples=3, min_gap=1.0)
    assert pairs == [] and counts["skipped/tie"] == 1
    with pytest.raises(ValueError, match="expected 4 x 2"):
        best_vs_worst_pairs(examples, completions, scores, num_samples=2)


def test_task_pairs_lists_and_records():
    examples = make_task("addition", split="train", size=20, seed=0)
    pairs = pairs_from_task(examples, seed=0)
    for ex, p in zip(examples, pairs):
        assert p["chosen"] == f"The answer is <answer>{ex['answer']}</answer>."
        wrong = int(p["rejected"].split("<answer>")[1].split("<")[0])
        assert wrong != int(ex["answer"]) and abs(wrong - int(ex["answer"])) <= 10
    lists = ranked_from_task(examples, num_responses=4, seed=0)
    assert all(len(set(r["responses"])) == 4 and "<answer>" in r["responses"][0] for r in lists)
    records = records_from_task(examples, responses_per_prompt=4, seed=0)
    assert len(records) == 80
    assert sorted(r["score"] for r in records[:4]) == [0.0, 0.5, 1.0, 1.5]


def test_held_out_split_keeps_prompts_together():
    rows = [{"key": f"p{i // 3}", "i": i} for i in range(300)]
    train, evals = split_by_prompt(rows, eval_fraction=0.2, eval_size=30, seed=0)
    assert len(train) + len(evals) == 300 and 0 < len(evals) <= 30 and len(evals) % 3 == 0
    assert not {r["key"] for r in train} & {r["key"] for r in evals}
    assert split_by_prompt(rows, eval_fraction=0.2, eval_size=30, seed=0) == (train, evals)
    assert split_by_prompt(rows, eval_fraction=0.0, eval_size=30, seed=0) == (rows, [])


def test_offline_config_fields_and_errors():
    cfg = from_yaml(RunConfig, "algorithm: {name: dpo, loss_type: ipo, beta: 0.5}")
    assert not cfg.is_online and cfg.algorithm.loss_type == "ipo" and cfg.rewards == {}
    with pytest.raises(ConfigError, match="algorithm.loss_type"):
        from_yaml(RunConfig, "algorithm: {name: dpo, loss_type: kto}")
    with pytest.raises(ConfigError, match="algorithm: label_smoothing must be in \\[0, 0.5\\)"):
        from_yaml(RunConfig, "algorithm: {name: dpo, loss_type: robust, label_smoothing: 0.5}")
    with pytest.raises(ConfigError, match="micro_batch_size"):
        from_yaml(RunConfig, "algorithm: {name: records, batch_size: 6, micro_batch_size: 4}")
    with pytest.raises(ConfigError, match="algorithm.records_mode: unknown key for RecordsConfig"):
        from_yaml(RunConfig, "algorithm: {name: records, records_mode: awr}")
    # settings of another algorithm, or of another mode of this one, are refused with the key named
    with pytest.raises(ConfigError, match="algorithm.beta: .*'beta' is a setting of dpo"):
        from_yaml(RunConfig, "algorithm: {name: records, beta: 0.5}")
    with pytest.raises(ConfigError, match="simpo_gamma is a setting of loss_type=simpo"):
        from_yaml(RunConfig, "algorithm: {name: dpo, simpo_gamma: 0.3}")
    with pytest.raises(ConfigError, match="odpo_alpha is used only with margin_column"):
        from_yaml(RunConfig, "algorithm: {name: dpo, odpo_alpha: 2.0}")
    with pytest.raises(ConfigError, match="data.path .* or data.task"):
        from_yaml(RunConfig, "algorithm: {name: reward_model}\ndata: {task: ''}")
    with pytest.raises(ConfigError, match="rewards"):  # online algorithms still need rewards
        from_yaml(RunConfig, "algorithm: {name: grpo}")


def test_pair_builder_samples_scores_and_keeps_best_and_worst(tmp_path):
    from rljax.tools import cli, pairs
    from tests._tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "model")
    config = tmp_path / "build.yaml"
    config.write_text(f"""
model: {{name: {model_dir}}}
data: {{task: addition, train_size: 6, max_prompt_length: 64}}
sampling: {{max_new_tokens: 8, temperature: 1.0}}
rewards: {{chars: {{type: length, unit: chars}}}}
""")
    out = tmp_path / "pairs.jsonl"
    assert pairs.main([str(config), str(out), "--num-samples", "4", "train.seed=3"]) == 0
    loaded, counts = load_preference_pairs(str(out))
    assert 0 < len(loaded) <= 6 and counts["kept"] == len(loaded)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        assert row["chosen_score"] > row["rejected_score"]
        assert row["chosen_score"] == len(row["chosen"]) and row["rejected_score"] == len(row["rejected"])
        assert row["prompt"].startswith("What is ") and "answer" in row and "completion_length" not in row
    # `rljax pairs` is the same command (overrides may follow the options), and the same seed the same pairs
    again = tmp_path / "again.jsonl"
    assert cli.main(["pairs", str(config), str(again), "--num-samples", "4", "train.seed=3"]) == 0
    assert again.read_text() == out.read_text()
    other = tmp_path / "other.jsonl"
    assert cli.main(["pairs", str(config), str(other), "train.seed=4", "--num-samples", "4"]) == 0
    assert other.read_text() != out.read_text()


def test_chat_responses_that_repeat_the_prompt_turns_are_not_doubled():
    user = [{"role": "user", "content": "Name a colour."}]
    rows = [{"prompt": user, "chosen": user + [{"role": "assistant", "content": "Blue."}],
             "rejected": user + [{"role": "assistant", "content": "Seven."}]}]
    pairs, _ = load_preference_pairs(rows)
    assert pairs[0]["prompt"] == user and pairs[0]["chosen"] == "Blue."
