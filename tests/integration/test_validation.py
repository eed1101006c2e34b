"""Bad data, settings and model directories are refused before step 0, with the place named
(online prompts checked row by row; ``too_long: filter`` applied before
batching, config values checked per key, tokenizers checked against the model)."""

import json
import math
import os
import shutil

import numpy as np
import pytest

from rljax.config import ConfigError, FieldError, check_range, from_yaml, load_config
from rljax.data import make_task
from rljax.errors import UserError
from rljax.models import load
from rljax.rewards.base import build_rewards
from rljax.data.prompts import PromptFormat
from rljax.run_config import FewShotExample, RunConfig
from rljax.training import OnlineTrainer
from rljax.training.data import check_prompts, online_examples
from rljax.training.run import build_run
from tests._tiny import make_tiny_model_dir, tiny_tokenizer

# ---------------------------------------------------------------------------------------------
# item 10: every clearly invalid setting is a ConfigError naming its key

INVALID = [
    # (overrides, the key named)
    (["train.steps=0"], "train.steps"),
    (["train.steps=-3"], "train.steps"),
    (["train.eval_every=-1"], "train.eval_every"),
    (["optim.learning_rate=-1e-6"], "optim.learning_rate"),
    (["optim.learning_rate=.nan"], "optim.learning_rate"),
    (["optim.learning_rate=.inf"], "optim.learning_rate"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps"),
    (["optim.grad_clip=-1.0"], "optim.grad_clip"),
    (["optim.grad_clip=.nan"], "optim.grad_clip"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    (["optim.b2=1.0"], "optim.b2"),
    (["sampling.max_new_tokens=0"], "sampling.max_new_tokens"),
    (["sampling.temperature=-0.5"], "sampling.temperature"),
    (["sampling.temperature=.nan"], "sampling.temperature"),
    (["sampling.eval_temperature=-1"], "sampling.eval_temperature"),
    (["sampling.top_p=0.0"], "sampling.top_p"),
    (["sampling.top_p=1.5"], "sampling.top_p"),
    (["sampling.top_k=-1"], "sampling.top_k"),
    (["data.max_prompt_length=0"], "data.max_prompt_length"),
    (["data.train_size=-1"], "data.train_size"),
    (["data.eval_fraction=1.0"], "data.eval_fraction"),
    (["model.lora_rank=0"], "model.lora_rank"),
    (["model.lora_alpha=0.0"], "model.lora_alpha"),
    (["rewards={answer: 0.0}"], "rewards"),
    (["rewards={answer: 0, format: {weight: 0.0, strict: true}}"], "rewards"),
    # the online algorithms' shared settings
    (["algorithm.group_size=0"], "algorithm.group_size"),
    (["algorithm.group_size=1"], "algorithm.group_size"),  # grpo needs a baseline
    (["algorithm.name=rloo", "algorithm.group_size=1"], "algorithm.group_size"),
    (["algorithm.prompts_per_step=0"], "algorithm.prompts_per_step"),
    (["algorithm.num_iterations=0"], "algorithm.num_iterations"),
    (["algorithm.mini_batches=0"], "algorithm.mini_batches"),
    (["algorithm.micro_batch_size=0"], "algorithm.micro_batch_size"),
    (["algorithm.max_sampling_rounds=0"], "algorithm.max_sampling_rounds"),
    (["algorithm.kl_coef=-0.1"], "algorithm.kl_coef"),
    (["algorithm.kl_coef=.nan"], "algorithm.kl_coef"),
    (["algorithm.entropy_coef=.nan"], "algorithm.entropy_coef"),
    (["algorithm.epsilon_low=-0.1"], "algorithm.epsilon_low"),
    (["algorithm.epsilon_high=.nan"], "algorithm.epsilon_high"),
    (["algorithm.dual_clip=1.0"], "algorithm.dual_clip"),
    (["algorithm.advantage_eps=-1e-4"], "algorithm.advantage_eps"),
    (["algorithm.name=ppo", "algorithm.gamma=1.5"], "algorithm.gamma"),
    (["algorithm.name=ppo", "algorithm.lam=-0.1"], "algorithm.lam"),
    (["algorithm.name=ppo", "algorithm.vf_coef=-1"], "algorithm.vf_coef"),
    (["algorithm.name=ppo", "algorithm.value_clip=-0.2"], "algorithm.value_clip"),
    (["algorithm.name=ppo", "algorithm.missing_eos_penalty=.inf"], "algorithm.missing_eos_penalty"),
    (["algorithm.name=ppo", "algorithm.critic=separate", "algorithm.critic_learning_rate=0.0"],
     "algorithm.critic_learning_rate"),
    (["algorithm.name=reinforce_pp", "algorithm.gamma=.nan"], "algorithm.gamma"),
    # the offline algorithms'
    (["algorithm.name=dpo", "algorithm.beta=0.0"], "algorithm.beta"),
    (["algorithm.name=dpo", "algorithm.beta=.nan"], "algorithm.beta"),
    (["algorithm.name=dpo", "algorithm.batch_size=0"], "algorithm.batch_size"),
    (["algorithm.name=dpo", "algorithm.eval_batch_size=0"], "algorithm.eval_batch_size"),
    (["algorithm.name=dpo", "algorithm.epochs=0.0"], "algorithm.epochs"),
    (["algorithm.name=dpo", "algorithm.epochs=.nan"], "algorithm.epochs"),
    (["algorithm.name=dpo", "algorithm.max_completion_length=0"], "algorithm.max_completion_length"),
    (["algorithm.name=dpo", "algorithm.margin_column=m", "algorithm.odpo_alpha=-1"], "algorithm.odpo_alpha"),
    (["algorithm.name=records", "algorithm.temperature=0.0"], "algorithm.temperature"),
    (["algorithm.name=records", "algorithm.max_weight=0.0"], "algorithm.max_weight"),
    (["algorithm.name=records", "algorithm.score_threshold=.nan"], "algorithm.score_threshold"),
    (["algorithm.name=reward_model", "algorithm.task_responses=1"], "algorithm.task_responses"),
    (["algorithm.name=reward_model", "algorithm.centering_coef=-0.01"], "algorithm.centering_coef"),
]


@pytest.mark.parametrize("overrides,key", INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_invalid_setting_is_refused_naming_its_key(overrides, key):
    if not any(o.startswith("rewards=") for o in overrides):
        overrides = overrides + ["rewards={answer: 1.0}"]
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, overrides)
    err = info.value
    assert err.key == key and str(err).startswith(f"{key}: "), str(err)
    if key != "rewards":  # the bad value itself is shown
        value = dict(o.split("=", 1) for o in overrides)[key]
        shown = {".nan": "nan", ".inf": "inf"}.get(value, value)
        assert f"got {shown}" in str(err) or f"got {float(shown)!r}" in str(err), str(err)
    else:
        assert "every reward weight is 0" in str(err)


VALID_EDGES = [
    ["optim.learning_rate=0.0", "optim.grad_clip=null"],
    ["sampling.temperature=0.0", "sampling.top_p=1.0", "sampling.top_k=0"],
    ["sampling.top_k=null", "sampling.top_p=0.01"],
    ["algorithm.entropy_coef=-0.01"],  # entropy minimisation is an objective people study
    ["algorithm.epsilon_low=0.0", "algorithm.kl_coef=0.0"],
    ["rewards={answer: 0.0, format: 0.2}"],
    ["rewards={answer: -1.0}"],
    ["train.steps=1", "train.eval_every=0", "data.eval_size=0"],
    ["algorithm.name=reinforce_pp", "algorithm.group_size=1"],
]


@pytest.mark.parametrize("overrides", VALID_EDGES, ids=[" ".join(o) for o in VALID_EDGES])
def test_edge_values_that_mean_something_are_accepted(overrides):
    if not any(o.startswith("rewards=") for o in overrides):
        overrides = overrides + ["rewards={answer: 1.0}"]
    load_config(RunConfig, None, overrides)


def test_check_range_refuses_non_finite_and_reports_under_the_field():
    class S:
        a, b, c, d = 0.5, math.nan, None, 2

    check_range(S, "a", low=0, high=1)
    check_range(S, "c", low=1)  # null passes: the schema's Optional decides
    with pytest.raises(FieldError, match=r"^b: must be finite, got nan$"):
        check_range(S, "b")
    with pytest.raises(FieldError, match=r"^d: must be in \(0, 1\] \(1 = off\), got 2$") as info:
        check_range(S, "d", low=0, high=1, low_open=True, note="(1 = off)")
    assert info.value.field == "d" and info.value.reason.startswith("must be")


# ---------------------------------------------------------------------------------------------
# item 8 / 9: online prompts checked before training, the row named; too_long: filter before batching

RAW = PromptFormat(chat=False, max_prompt_length=16, too_long="error")  # byte tokenizer: 1 token per byte


def _rows(prompts):
    return [{"prompt": p} for p in prompts]


@pytest.mark.parametrize("bad,problem", [
    (None, "the prompt is null"),
    (7, "must be a string or a list of chat messages, got int 7"),
    ("", "the prompt is empty"),
    ("   ", "the prompt is empty"),
    ([{"role": "user", "content": "hi"}], "needs data.chat: true"),
])
def test_check_prompts_names_source_row_and_column(bad, problem):
    rows = _rows(["ok"] * 19 + [bad] + ["ok"])
    with pytest.raises(ValueError) as info:
        check_prompts(rows, tiny_tokenizer(), RAW, source="data/train.jsonl (data.path)", column="question")
    assert str(info.value).startswith("data/train.jsonl (data.path) row 20, column 'question': ")
    assert problem in str(info.value)


def test_check_prompts_chat_messages_are_checked_and_rendered():
    chat = PromptFormat(chat=True, max_prompt_length=64)
    good = [{"role": "user", "content": "hi"}]
    kept, dropped = check_prompts(_rows(["hi", good]), tiny_tokenizer(), chat, source="s")
    assert len(kept) == 2 and dropped == 0
    for bad, problem in [([], "an empty list of chat messages"), ([{"role": "user"}], "chat message 0")]:
        with pytest.raises(ValueError, match=f"^s row 2, column 'prompt': .*{problem}"):
            check_prompts(_rows(["hi", bad]), tiny_tokenizer(), chat, source="s")


def test_check_prompts_too_long_errors_or_filters_as_the_sampler_counts():
    # 16 bytes fit max_prompt_length=16 exactly (encode_prompts would keep it), 17 do not
    prompts = ["a" * 16, "b" * 17, "c", "d" * 40]
    with pytest.raises(ValueError, match=r"^f row 2, column 'prompt': the prompt is 17 tokens once formatted, "
                                         r"over data.max_prompt_length=16 .*data.too_long=filter"):
        check_prompts(_rows(prompts), tiny_tokenizer(), RAW, source="f")
    kept, dropped = check_prompts(_rows(prompts), tiny_tokenizer(), PromptFormat(chat=False, max_prompt_length=16,
                                                                                  too_long="filter"), source="f")
    assert [r["prompt"] for r in kept] == ["a" * 16, "c"] and dropped == 2


def _write_jsonl(path, prompts):
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"question": p, "answer": str(i)}) + "\n")
    return str(path)


def _cfg(tmp_path, model="unused", **data):
    data = {"task": "", "prompt_column": "question", "max_prompt_length": 16, "eval_fraction": 0.0,
            "eval_size": 0, "chat": False, **data}
    return from_yaml(RunConfig, f"""
model: {{name: {model}}}
data: {json.dumps(data)}
sampling: {{max_new_tokens: 4}}
algorithm: {{name: grpo, group_size: 2, prompts_per_step: 4}}
train: {{steps: 2, run_dir: {tmp_path / 'run'}, progress: false, samples_every: null}}
rewards: {{answer: 1.0}}
""")


def test_online_examples_name_the_file_row_of_the_source_not_of_the_split(tmp_path):
    # rows 1-30 of which row 20 is null; held-out rows are split off after the check, so the row
    # number is the file's (the issue saw "prompt 1" for data row 20)
    prompts = [f"q{i}" for i in range(30)]
    prompts[19] = None
    path = _write_jsonl(tmp_path / "train.jsonl", prompts)
    cfg = _cfg(tmp_path, path=path, eval_fraction=0.3, eval_size=8)
    with pytest.raises(ValueError, match=f"^{path} \\(data.path\\) row 20, column 'question': the prompt is null"):
        online_examples(cfg, tiny_tokenizer())
    prompts[19] = "q19"
    _write_jsonl(tmp_path / "train.jsonl", prompts)
    evals = _write_jsonl(tmp_path / "eval.jsonl", ["fine", "x" * 17])
    with pytest.raises(ValueError, match=f"^{evals} \\(data.eval_path\\) row 2, column 'question': the prompt is 17"):
        online_examples(_cfg(tmp_path, path=path, eval_path=evals), tiny_tokenizer())


def test_too_long_filter_drops_before_the_train_size_cut_and_counts(tmp_path):
    prompts = ["x" * 20 if i % 2 else f"q{i}" for i in range(20)]  # 10 over 16 tokens
    path = _write_jsonl(tmp_path / "train.jsonl", prompts)
    evals = _write_jsonl(tmp_path / "eval.jsonl", ["e1", "y" * 30, "e3"])
    cfg = _cfg(tmp_path, path=path, eval_path=evals, eval_size=8, too_long="filter", train_size=8)
    train, held_out, counts = online_examples(cfg, tiny_tokenizer())
    assert [r["prompt"] for r in train] == [f"q{i}" for i in range(0, 16, 2)]  # still 8: cut after the filter
    assert [r["prompt"] for r in held_out] == ["e1", "e3"]
    assert counts == {"rows": 20, "dropped/too_long": 10, "eval_rows": 3, "eval_dropped/too_long": 1}
    # without a tokenizer nothing is checked (the split alone, as before)
    assert len(online_examples(cfg, None)[0]) == 8


def test_task_prompts_are_checked_naming_the_task(tmp_path):
    cfg = from_yaml(RunConfig, "data: {task: addition, train_size: 8, eval_size: 0, max_prompt_length: 8, "
                               "chat: false}\nrewards: {answer: 1.0}")
    with pytest.raises(ValueError, match=r"^task 'addition' \(train split\) row 1, column 'prompt': the prompt is "
                                         r"1[0-9] tokens once formatted, over data.max_prompt_length=8"):
        online_examples(cfg, tiny_tokenizer())


SMALL = dict(layers=1, hidden=16, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", **SMALL)


def test_trainer_refuses_bad_rows_before_step_0_and_writes_no_config(tiny_dir, tmp_path):
    prompts = [f"q{i}" for i in range(30)]
    prompts[19] = 12345
    path = _write_jsonl(tmp_path / "train.jsonl", prompts)
    with pytest.raises(ValueError, match="row 20, column 'question': the prompt must be a string .* got int 12345"):
        OnlineTrainer(_cfg(tmp_path, model=tiny_dir, path=path))
    assert not os.path.exists(tmp_path / "run" / "config.yaml")


def test_trainer_refuses_too_few_prompts_naming_both_numbers(tiny_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", ["q1", "q2", "x" * 20, "q4"])
    with pytest.raises(ConfigError, match=r"^algorithm.prompts_per_step: 4 prompts per step, but the training data "
                                          r"has only 3 prompts \(after data.too_long=filter dropped 1 over "
                                          r"data.max_prompt_length=16 tokens\)"):
        OnlineTrainer(_cfg(tmp_path, model=tiny_dir, path=path, too_long="filter"))
    path = _write_jsonl(tmp_path / "train.jsonl", ["x" * 20] * 5)
    with pytest.raises(ValueError, match=r"no training prompt is left: data.too_long=filter dropped 5 prompts"):
        OnlineTrainer(_cfg(tmp_path, model=tiny_dir, path=path, too_long="filter"))


def test_filtered_run_keeps_every_batch_full_and_logs_the_count(tiny_dir, tmp_path, capsys):
    # the issue: 8 rows shrank to 2 per step, no metric; a fully filtered batch crashed in max()
    prompts = [f"q{i}" for i in range(6)] + ["x" * 20] * 10
    path = _write_jsonl(tmp_path / "train.jsonl", prompts)
    cfg = _cfg(tmp_path, model=tiny_dir, path=path, too_long="filter")
    trainer = OnlineTrainer(cfg)
    assert "data.too_long=filter dropped 10 prompts over data.max_prompt_length=16 tokens" in capsys.readouterr().err
    sizes = []  # 6 prompts, 4 per step: the second step starts a new epoch
    trainer.on_step = lambda logger: sizes.append((len(trainer.last_rollouts), trainer.last_rollouts.num_dropped))
    trainer.fit()
    assert sizes == [(8, 0), (8, 0)]
    with open(os.path.join(cfg.train.run_dir, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    assert first["step"] == 0 and first["data/dropped/too_long"] == 10 and first["data/rows"] == 16


# ---------------------------------------------------------------------------------------------
# item 11: tokenizer checks at load

def _strip_tokenizer(directory):
    removed = [n for n in os.listdir(directory) if n.startswith(("tokenizer", "special_tokens", "vocab", "merges",
                                                                   "chat_template"))]
    for name in removed:
        os.remove(os.path.join(directory, name))
    assert "tokenizer.json" in removed
    return directory


def test_tokenizer_larger_than_the_vocabulary_is_refused_with_both_numbers(tmp_path):
    directory = make_tiny_model_dir(tmp_path / "m", **SMALL)
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra_1>", "<extra_2>"])
    tok.save_pretrained(directory)
    with pytest.raises(ValueError, match=r"the tokenizer has 261 tokens but the model's vocab_size is 259"):
        load(directory)


def test_weights_only_directory_names_the_missing_tokenizer_files(tmp_path):
    directory = _strip_tokenizer(make_tiny_model_dir(tmp_path / "m", **SMALL))
    with pytest.raises(FileNotFoundError) as info:
        load(directory)
    message = str(info.value)
    assert message.startswith(f"{directory} has model weights but no tokenizer") and "tokenizer.json" in message
    assert "Couldn't instantiate" not in message
    model, tokenizer = load(directory, tokenizer=tiny_tokenizer())  # a critic / reward model: the policy's
    assert len(tokenizer) == model.config.vocab_size == 259


def test_critic_directory_without_tokenizer_loads_with_the_policys(tiny_dir, tmp_path):
    critic = _strip_tokenizer(make_tiny_model_dir(tmp_path / "critic", seed=1, value_head=True, **SMALL))
    cfg = from_yaml(RunConfig, f"model: {{name: {tiny_dir}}}\nalgorithm: {{name: ppo, critic: separate, "
                               f"critic_model: {critic}}}\ntrain: {{run_dir: {tmp_path / 'run'}}}\n"
                               "rewards: {answer: 1.0}")
    run = build_run(cfg, value_head=False, total_updates=1, critic=critic, write_config=False)
    assert run.critic is not None and run.critic.model().value_head is not None


def test_reward_model_directory_without_tokenizer_scores_with_the_policys(tmp_path):
    from safetensors.numpy import save_file

    with_tok = make_tiny_model_dir(tmp_path / "rm", seed=3, value_head=True, **SMALL)
    head = {"w": np.random.default_rng(0).normal(size=16).astype(np.float32), "b": np.zeros(1, np.float32)}
    save_file(head, os.path.join(with_tok, "value_head.safetensors"))  # a zero head would score every text 0
    spec = {"rm": {"type": "reward_model", "path": with_tok, "batch_size": 2, "max_prompt_length": 16,
                   "max_completion_length": 16}}
    texts, examples = ["a good answer", "bad"], [{"prompt": "q"}, {"prompt": "q"}]
    expected = build_rewards(spec)(texts, examples).total
    without = _strip_tokenizer(shutil.copytree(with_tok, tmp_path / "rm_no_tok"))
    spec["rm"]["path"] = str(without)
    with pytest.raises(FileNotFoundError, match=f"{without} has model weights but no tokenizer"):
        build_rewards(spec)
    got = build_rewards(spec, tokenizer=tiny_tokenizer())(texts, examples).total
    np.testing.assert_array_equal(got, expected)
    assert np.all(np.isfinite(got)) and got[0] != got[1]


def test_few_shot_examples_must_not_be_held_out_questions(tmp_path):
    held_out = make_task("addition", split="eval", size=4, seed=0)[2]["prompt"]
    base = "data: {task: addition, train_size: 8, eval_size: 4, chat: false, few_shot: [{user: %s, reply: '<answer>1</answer>'}]}\n" \
           "rewards: {answer: 1.0}"
    cfg = from_yaml(RunConfig, base % json.dumps(held_out))
    assert cfg.data.few_shot == [FewShotExample(user=held_out, reply="<answer>1</answer>")]
    with pytest.raises(UserError, match=r"data.few_shot\[0\].user is a held-out prompt \('What is"):
        online_examples(cfg, None)
    train, evals, _ = online_examples(from_yaml(RunConfig, base % json.dumps("What is 1+0?")), None)
    assert len(train) == 8 and len(evals) == 4
