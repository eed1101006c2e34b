"""Prompt data: tasks, loading, chat templates, tokenisation with buckets, resumable iteration."""

import json

import numpy as np
import pytest

from rljax.data import (
    MissingColumnError,
    PromptIterator,
    default_buckets,
    format_prompt,
    format_prompts,
    load_records,
    make_task,
    question_split,
    tokenize_prompts,
)
from rljax.rewards import answer_score

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _make_tokenizer(*, pad: bool = True, chat_template: str | None = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["What is 12+35? The answer is 47.", "hello world, a tiny tokenizer for tests",
              "<think> reasoning </think> <answer> 47 </answer>"]
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    kwargs = {"pad_token": "<|endoftext|>"} if pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   chat_template=chat_template, **kwargs)


@pytest.fixture(scope="module")
def tokenizer():
    return _make_tokenizer()


# ---------------------------------------------------------------------------------------------
# tasks


def test_addition_task_answers_deterministic_and_disjoint():
    train = make_task("addition", split="train", size=5000, seed=0)
    evals = make_task("addition", split="eval", size=500, seed=0)
    assert train == make_task("addition", split="train", size=5000, seed=0)
    assert train[:100] == make_task("addition", split="train", size=100, seed=0)  # prefix-stable
    assert train != make_task("addition", split="train", size=5000, seed=1)
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in evals}
    assert len({e["prompt"] for e in train}) == 5000  # no repeats
    for example in train[:50] + evals[:50]:
        a, b = example["operands"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert example["prompt"] == f"What is {a}+{b}?"
        assert example["answer"] == str(a + b) and example["task"] == "addition"
        assert answer_score(f"<answer>{a + b}</answer>", example) == 1.0
    # The 2-digit space has 8,100 questions; eval holds ~10% of it, train cannot exceed the rest.
    n_eval = sum(question_split(f"{a}+{b}", task="addition", seed=0, eval_fraction=0.1) == "eval"
                 for a in range(10, 100) for b in range(10, 100))
    assert 600 < n_eval < 1000
    with pytest.raises(ValueError, match=rf"train split has only {8100 - n_eval} distinct questions"):
        make_task("addition", split="train", size=8100 - n_eval + 1, seed=0)
    whole_train = make_task("addition", split="train", size=8100 - n_eval, seed=0)
    whole_eval = make_task("addition", split="eval", size=n_eval, seed=0)
    assert len({e["key"] for e in whole_train} | {e["key"] for e in whole_eval}) == 8100


def test_addition_digits_option():
    three = make_task("addition", split="eval", size=20, seed=3, digits=3,
                      instruction="Answer in <answer></answer> tags.")
    for example in three:
        a, b = example["operands"]
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert example["prompt"].endswith("? Answer in <answer></answer> tags.")
    with pytest.raises(ValueError, match="digits"):
        make_task("addition", split="train", size=1, seed=0, digits=0)


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "countdown"])
def test_reasoning_gym_tasks_deterministic_and_disjoint(name):
    train = make_task(name, split="train", size=30, seed=7)
    evals = make_task(name, split="eval", size=10, seed=7)
    assert train == make_task(name, split="train", size=30, seed=7)
    assert not {e["key"] for e in train} & {e["key"] for e in evals}
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in evals}
    for example in train:
        assert isinstance(example["prompt"], str) and isinstance(example["answer"], str)
        assert example["task"] == name and example["metadata"]["source_dataset"] == name


def test_gsm_symbolic_task_works_offline():
    examples = make_task("gsm_symbolic", split="eval", size=3, seed=0)
    assert len(examples) == 3
    for example in examples:
        assert example["answer"].lstrip("-").isdigit()
        assert answer_score(f"<answer>{example['answer']}</answer>", example) == 1.0


def test_task_argument_errors():
    with pytest.raises(KeyError, match="unknown task 'adition'"):
        make_task("adition", size=1, seed=0)
    with pytest.raises(ValueError, match="split"):
        make_task("addition", split="test", size=1, seed=0)
    with pytest.raises(ValueError, match="bad option"):
        make_task("chain_sum", size=1, seed=0, no_such_option=3)


# ---------------------------------------------------------------------------------------------
# loading


ROWS = [
    {"question": "What is 1+1?", "solution": 2, "source": "a"},
    {"question": "What is 2+3?", "solution": 5, "source": "b"},
]


def test_load_jsonl_with_renamed_columns(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    records = load_records(path, prompt_column="question", answer_column="solution")
    assert records == [
        {"question": "What is 1+1?", "solution": 2, "source": "a", "prompt": "What is 1+1?", "answer": "2"},
        {"question": "What is 2+3?", "solution": 5, "source": "b", "prompt": "What is 2+3?", "answer": "5"},
    ]
    assert load_records(str(path), prompt_column="question", limit=1)[0].keys() == {
        "question", "solution", "source", "prompt"}


def test_load_parquet_with_renamed_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    records = load_records(path, prompt_column="question", answer_column="solution")
    assert [r["prompt"] for r in records] == ["What is 1+1?", "What is 2+3?"]
    assert [r["answer"] for r in records] == ["2", "5"]
    assert [r["source"] for r in records] == ["a", "b"]


def test_load_through_hf_datasets(tmp_path):
    import datasets

    data_dir = tmp_path / "my_dataset"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    records = load_records(str(data_dir), split="train", prompt_column="question",
                           answer_column="solution", cache_dir=str(tmp_path / "cache"))
    assert [r["answer"] for r in records] == ["2", "5"]
    in_memory = datasets.Dataset.from_list(ROWS)
    assert load_records(in_memory, prompt_column="question")[1]["prompt"] == "What is 2+3?"
    assert load_records(ROWS, prompt_column="question")[0]["prompt"] == "What is 1+1?"


def test_missing_column_error_names_column_and_lists_available(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    with pytest.raises(KeyError) as info:
        load_records(path)  # default prompt_column="prompt"
    assert isinstance(info.value, MissingColumnError)
    message = str(info.value)
    assert "prompt column 'prompt' not found" in message
    assert "'question'" in message and "'solution'" in message and "'source'" in message
    with pytest.raises(KeyError, match="answer column 'answer' not found.*'solution'"):
        load_records(path, prompt_column="question", answer_column="answer")


# ---------------------------------------------------------------------------------------------
# prompts


def test_format_prompt_chat_template(tokenizer):
    text = format_prompt(tokenizer, "What is 12+35?")
    assert text == "<|im_start|>user\nWhat is 12+35?<|im_end|>\n<|im_start|>assistant\n"
    with_system = format_prompt(tokenizer, "What is 12+35?", system_prompt="Be brief.",
                                assistant_prefix="<think>")
    assert with_system == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12+35?"
                           "<|im_end|>\n<|im_start|>assistant\n<think>")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert format_prompt(tokenizer, messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="already starts with a system message"):
        format_prompt(tokenizer, messages, system_prompt="other")
    assert format_prompts(tokenizer, [{"prompt": "U"}], chat=False, system_prompt="S") == ["S\n\nU"]


def test_format_prompt_few_shot_turns_come_before_the_question(tokenizer):
    shot = [("What is 1+2?", "1 + 2 = 3\n<answer>3</answer>")]
    text = format_prompt(tokenizer, "What is 12+35?", system_prompt="S", few_shot=shot, assistant_prefix="<a>")
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 1+2?<|im_end|>\n"
                    "<|im_start|>assistant\n1 + 2 = 3\n<answer>3</answer><|im_end|>\n"
                    "<|im_start|>user\nWhat is 12+35?<|im_end|>\n<|im_start|>assistant\n<a>")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert format_prompt(tokenizer, messages, few_shot=[("Q", "A")]) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    assert format_prompts(tokenizer, [{"prompt": "U"}], chat=False, system_prompt="S",
                          few_shot=[("Q1", "A1"), ("Q2", "A2")]) == ["S\n\nQ1\nA1\n\nQ2\nA2\n\nU"]
    with pytest.raises(ValueError, match=r"few_shot\[0\] must be a \(user text, assistant reply\) pair"):
        format_prompt(tokenizer, "U", few_shot=["Q"])


def test_format_prompt_raw_and_errors():
    no_template = _make_tokenizer(chat_template=None)
    assert format_prompt(no_template, "What is 12+35?", chat=False) == "What is 12+35?"
    with pytest.raises(ValueError, match="no chat_template"):
        format_prompt(no_template, "What is 12+35?")
    with pytest.raises(ValueError, match="chat=False needs a string"):
        format_prompt(no_template, [{"role": "user", "content": "x"}], chat=False)


# ---------------------------------------------------------------------------------------------
# tokenisation and buckets


def test_default_buckets():
    assert default_buckets(256, per_octave=2) == (16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert default_buckets(100) == (16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 100)
    assert default_buckets(16) == (16,)
    assert default_buckets(8) == (8,)


def test_tokenize_prompts_left_pads_to_smallest_bucket(tokenizer):
    texts = ["What is 12+35?", "hello", "hello world, a tiny tokenizer for tests"]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert max(lengths) <= 16
    ids, mask, kept, dropped = tokenize_prompts(tokenizer, texts, max_prompt_length=64)
    assert ids.shape == mask.shape == (3, 16) and ids.dtype == mask.dtype == np.int32
    np.testing.assert_array_equal(kept, [0, 1, 2])
    assert dropped == 0
    pad = tokenizer.pad_token_id
    for row, text in enumerate(texts):
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        n = len(expected)
        np.testing.assert_array_equal(ids[row, 16 - n:], expected)
        np.testing.assert_array_equal(ids[row, :16 - n], pad)
        np.testing.assert_array_equal(mask[row], [0] * (16 - n) + [1] * n)
    # A 25..32-token prompt moves the batch to the 32 bucket (16, 24, 32, ...); custom buckets are honoured.
    long_text = " ".join(["hello world"] * 10)
    n_long = len(tokenizer(long_text, add_special_tokens=False)["input_ids"])
    assert 24 < n_long <= 32
    assert tokenize_prompts(tokenizer, [texts[0], long_text], max_prompt_length=64).input_ids.shape == (2, 32)
    assert lengths[0] <= 8
    small = tokenize_prompts(tokenizer, [texts[0]], max_prompt_length=64, buckets=(8, 24))
    assert small.input_ids.shape == (1, 8)
    # max_prompt_length is always the last bucket
    below = n_long - 1
    assert tokenize_prompts(tokenizer, [long_text], max_prompt_length=40,
                            buckets=(below,)).input_ids.shape == (1, 40)


def test_tokenize_prompts_too_long(tokenizer):
    long_text = " ".join(["hello world"] * 8)
    n_long = len(tokenizer(long_text, add_special_tokens=False)["input_ids"])
    texts = ["hello", long_text, "What is 12+35?"]
    with pytest.raises(ValueError, match=rf"prompt 1 is {n_long} tokens long, over max_prompt_length=16"):
        tokenize_prompts(tokenizer, texts, max_prompt_length=16)
    ids, mask, kept, dropped = tokenize_prompts(tokenizer, texts, max_prompt_length=16, too_long="filter")
    assert ids.shape == (2, 16) and dropped == 1
    np.testing.assert_array_equal(kept, [0, 2])
    empty = tokenize_prompts(tokenizer, [long_text], max_prompt_length=16, too_long="filter")
    assert empty.input_ids.shape == (0, 16) and empty.dropped == 1


def test_pad_token_falls_back_to_eos():
    no_pad = _make_tokenizer(pad=False)
    assert no_pad.pad_token_id is None
    ids, mask, _, _ = tokenize_prompts(no_pad, ["hello", "What is 12+35?"], max_prompt_length=32)
    assert ids[0, 0] == no_pad.eos_token_id and mask[0, 0] == 0


def test_prompt_iterator_resume_gives_identical_continuation():
    examples = [{"prompt": str(i)} for i in range(10)]
    reference = PromptIterator(examples, 3, seed=5)
    expected = [[e["prompt"] for e in next(reference)] for _ in range(12)]

    first = PromptIterator(examples, 3, seed=5)
    got = [[e["prompt"] for e in next(first)] for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))  # must survive a checkpoint round trip
    resumed = PromptIterator(examples, 3, seed=5)
    resumed.load_state_dict(state)
    got += [[e["prompt"] for e in next(resumed)] for _ in range(7)]
    assert got == expected


def test_prompt_iterator_epochs_shuffle_and_cover():
    examples = [{"prompt": str(i)} for i in range(10)]
    it = PromptIterator(examples, 3, seed=0)
    assert len(it) == 3
    epoch0 = [e["prompt"] for _ in range(3) for e in next(it)]  # 9 of 10: drop_last
    epoch1 = [e["prompt"] for _ in range(3) for e in next(it)]
    assert it.state_dict()["epoch"] == 1
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9 and epoch0 != epoch1

    full = PromptIterator(examples, 4, seed=0, drop_last=False, num_epochs=2)
    batches = list(full)
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    assert sorted(e["prompt"] for b in batches[:3] for e in b) == sorted(e["prompt"] for e in examples)
    ordered = PromptIterator(examples, 5, seed=0, shuffle=False)
    assert [e["prompt"] for e in next(ordered)] == ["0", "1", "2", "3", "4"]


def test_prompt_iterator_rejects_state_from_other_data():
    it = PromptIterator([{"prompt": "a"}] * 4, 2, seed=1)
    with pytest.raises(ValueError, match="num_examples"):
        it.load_state_dict({"epoch": 0, "index": 2, "seed": 1, "num_examples": 5})
    with pytest.raises(ValueError, match="seed"):
        it.load_state_dict({"epoch": 0, "index": 2, "seed": 2, "num_examples": 4})
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator([{"prompt": "a"}], 2, seed=0)
