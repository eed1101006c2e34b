"""SFT on chat transcripts: the assistant-only mask (tiny and SmolLM2 templates), the loss by hand on
a tiny model (eager and jitted), zero gradient on context tokens, loading, a tiny run lowering the
held-out NLL, and the calculator demonstrations with their config."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.algorithms import get as get_algorithm
from rljax.algorithms.sft import SFTConfig
from rljax.config import from_yaml, load_config
from rljax.data.kinds import collate
from rljax.data.transcripts import (InvalidRowError, assistant_pieces, encode_transcripts, load_transcripts,
                                    transcript_tokens)
from rljax.losses import sft_loss
from rljax.models import load
from rljax.run_config import RunConfig
from rljax.training import OfflineTrainer
from tests._tiny import tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "experiments"))
import make_calculator_sft  # noqa: E402

MULTI_TURN = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "A1"}, {"role": "tool", "content": "T"},
              {"role": "assistant", "content": "A2"}]


def test_assistant_tokens_are_the_assistant_turns_on_a_tiny_template():
    tok = tiny_tokenizer()
    assert assistant_pieces(tok, MULTI_TURN) == [
        ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
        ("A1<|im_end|>", True),
        ("\n<|im_start|>tool\nT<|im_end|>\n<|im_start|>assistant\n", False),
        ("A2<|im_end|>", True)]
    ids, mask = transcript_tokens(tok, MULTI_TURN)
    # the byte tokenizer: one token per character, <|im_start|> / <|im_end|> one each (ids 1, 2)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "A1<|im_end|>A2<|im_end|>"
    assert tok.decode([i for i, m in zip(ids, mask) if not m]).count("T") == 1  # the tool turn is context
    assert ids == tok(tok.apply_chat_template(MULTI_TURN, tokenize=False).rstrip(), add_special_tokens=False)["input_ids"]


def test_assistant_tokens_on_smollm2s_template():
    from rljax.models.gguf_io import read_gguf_metadata, tokenizer_from_gguf_metadata
    from rljax.models.registry import resolve

    tok = tokenizer_from_gguf_metadata(read_gguf_metadata(resolve("smollm2-135m-instruct").path)[0])
    messages = make_calculator_sft.transcript(7)
    question, answer = messages[1]["content"][len("What is "):-1], messages[3]["content"]
    ids, mask = transcript_tokens(tok, messages)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == (
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{question}"}}}}</tool_call><|im_end|>'
        f"<answer>{answer}</answer><|im_end|>")
    # the pieces tokenised one by one give the whole rendering's tokens (no BPE merge crosses a boundary here)
    whole = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert whole[:len(ids)] == ids
    # no system message: SmolLM2's template adds its default one, in every rendering alike
    ids, mask = transcript_tokens(tok, messages[1:])
    assert "SmolLM" in tok.decode(ids) and tok.decode([i for i, m in zip(ids, mask) if m]).endswith("</answer><|im_end|>")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = tiny_tokenizer()
    # drops every assistant turn but the last one, as reasoning templates drop earlier thoughts
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match="not prefix-stable at assistant message 2"):
        assistant_pieces(tok, MULTI_TURN)


def test_sft_loss_by_hand_eager_and_jitted():
    logprobs = jnp.log(jnp.array([[0.5, 0.25, 0.1], [0.2, 0.8, 0.9]]))
    mask = jnp.array([[0, 1, 1], [1, 0, 0]])
    correct = jnp.array([[1, 1, 0], [0, 1, 1]])
    expected = -(np.log(0.25) + np.log(0.1) + np.log(0.2)) / 3
    for fn in (sft_loss, jax.jit(sft_loss)):
        value, metrics = fn(logprobs, mask, correct=correct)
        np.testing.assert_allclose(value, expected, rtol=1e-6)
        np.testing.assert_allclose(metrics["sft/nll"], expected, rtol=1e-6)
        np.testing.assert_allclose(metrics["sft/token_accuracy"], 1 / 3, rtol=1e-6)
    # a global token count (micro-batches): the part's sum over that count
    value, _ = sft_loss(logprobs, mask, num_tokens=6.0)
    np.testing.assert_allclose(value, expected * 3 / 6, rtol=1e-6)


def _tiny_batch(tok):
    rows = [{"messages": MULTI_TURN, "key": "a"},
            {"messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Yo"}],
             "key": "b"}]
    data, _ = encode_transcripts(rows, tok, max_prompt_length=64, prompt_too_long="error", max_completion_length=64,
                                 completion_too_long="error", split="train")
    batch = collate(data, [0, 1], kind="transcripts", num_completions=1, pad_id=2, prompt_buckets=[64],
                    completion_buckets=[32], rows=3)  # a padding row too
    return data, jax.tree.map(jnp.asarray, batch)


@jax.jit
def _full_logprobs(model, ids):
    """``[1, L, V]`` log-softmax of one unpadded sequence's next-token logits (the plain forward pass)."""
    hidden, _ = model.forward(ids, jnp.ones(ids.shape, jnp.int32))
    return jax.nn.log_softmax(model.logits(hidden).astype(jnp.float32), axis=-1)


def test_sft_loss_on_a_tiny_model_by_hand(tiny_dir):
    model, tok = load(tiny_dir)
    data, batch = _tiny_batch(tok)
    cfg = SFTConfig()
    algo = get_algorithm("sft")
    # by hand: each transcript alone, unpadded, through the full forward pass; log_softmax; assistant tokens
    nll, count, right = 0.0, 0, 0
    for i in range(2):
        ids = np.asarray(data.prompts[i] + data.completions[i][0])
        mask = np.asarray([0] * len(data.prompts[i]) + data.loss_masks[i][0])
        logp = np.asarray(_full_logprobs(model, jnp.asarray(ids)[None])[0], np.float64)
        for t in range(1, len(ids)):
            if mask[t]:
                nll -= logp[t - 1, ids[t]]
                right += int(np.argmax(logp[t - 1]) == ids[t])
                count += 1
    assert count == 6 + 3  # "A1<|im_end|>A2<|im_end|>" and "Yo<|im_end|>"

    def loss_of(b):
        return algo.loss(model, b, cfg, **algo.totals(b, cfg))

    value, metrics = jax.jit(loss_of)(batch)  # eager: test_sft_loss_by_hand_eager_and_jitted
    np.testing.assert_allclose(value, nll / count, rtol=1e-5)
    np.testing.assert_allclose(metrics["sft/token_accuracy"], right / count, rtol=1e-6)
    scores, lengths = algo.score(model, batch)
    out = algo.evaluate(np.asarray(scores)[:2], np.asarray(lengths)[:2], data, cfg)
    np.testing.assert_allclose(out["nll"], nll / count, rtol=1e-5)
    np.testing.assert_allclose(out["perplexity"], np.exp(nll / count), rtol=1e-5)


def test_context_tokens_carry_zero_gradient(tiny_dir):
    """d loss / d log π[t] is -1/N on the assistant tokens and exactly 0 on system, user, tool and
    padding tokens; and the model's gradient ignores what the context tokens' targets would cost."""
    model, tok = load(tiny_dir)
    data, batch = _tiny_batch(tok)
    algo, cfg = get_algorithm("sft"), SFTConfig()
    totals = algo.totals(batch, cfg)
    mask = batch.loss_mask * batch.row_mask[:, None]
    grad = jax.grad(lambda lp: sft_loss(lp, mask, num_tokens=totals["num_tokens"])[0])(
        jnp.zeros(batch.completion_ids.shape))
    expected = np.zeros(batch.completion_ids.shape)
    for i in range(2):
        expected[i, :len(data.loss_masks[i][0])] = -np.asarray(data.loss_masks[i][0]) / 9
    np.testing.assert_array_equal(np.asarray(grad) != 0, expected != 0)
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    assert (expected[0] == 0).sum() > 0  # the tool turn sits inside the completion, masked out


def test_load_transcripts_forms_and_bad_rows(tmp_path):
    path = tmp_path / "pc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Q1", "completion": "A1"},
        {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q2"}],
         "completion": [{"role": "assistant", "content": "A2"}]},
        {"prompt": "Q3", "completion": ""}]) + "\n")
    with pytest.raises(InvalidRowError, match="row 2: an assistant message is empty"):
        load_transcripts(str(path))
    rows, counts = load_transcripts(str(path), invalid="drop")
    assert counts == {"rows": 3, "kept": 2, "dropped/empty_response": 1}
    assert rows[0]["messages"] == [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]
    assert rows[1]["messages"][0] == {"role": "system", "content": "S"}
    bad = [{"messages": [{"role": "user", "content": "Q"}]},
           {"messages": [{"role": "robot", "content": "Q"}, {"role": "assistant", "content": "A"}]},
           {"messages": MULTI_TURN}]
    rows, counts = load_transcripts(bad, invalid="drop")
    assert len(rows) == 1 and counts["dropped/no_assistant_turn"] == counts["dropped/malformed_messages"] == 1
    with pytest.raises(InvalidRowError, match="role 'robot'"):
        load_transcripts(bad[1:])


def _demo_rows(n, seed):
    """Two-turn transcripts whose assistant turns repeat the user's word (learnable by a tiny model)."""
    rng = np.random.default_rng(seed)
    words = ["apple", "berry", "cherry", "melon"]
    rows = []
    for i in range(n):
        w = words[int(rng.integers(len(words)))]
        rows.append({"messages": [{"role": "user", "content": f"{i} say {w}"}, {"role": "assistant", "content": w},
                                  {"role": "tool", "content": "ok"}, {"role": "assistant", "content": f"done {w}"}]})
    return rows


def test_a_tiny_sft_run_lowers_held_out_nll(tiny_dir, tmp_path):
    for name, n, seed in (("train", 64, 0), ("eval", 16, 1)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in _demo_rows(n, seed))
    cfg = from_yaml(RunConfig, f"""
model: {{name: {tiny_dir}}}
data: {{task: "", path: {tmp_path}/train.jsonl, eval_path: {tmp_path}/eval.jsonl, max_prompt_length: 64}}
algorithm: {{name: sft, batch_size: 16, max_completion_length: 64}}
optim: {{learning_rate: 3.0e-3}}
train: {{steps: 8, run_dir: {tmp_path}/run, progress: false, save_model: false}}
""")
    summary = OfflineTrainer(cfg).fit()
    before, after = summary["before"], summary["after"]
    assert before["eval/tokens"] == after["eval/tokens"] > 16 * 8
    assert after["eval/nll"] < before["eval/nll"] - 1.0, (before, after)
    assert after["eval/token_accuracy"] > before["eval/token_accuracy"] + 0.2, (before, after)
    np.testing.assert_allclose(after["eval/perplexity"], np.exp(after["eval/nll"]), rtol=1e-5)


def test_calculator_demonstrations_are_the_environment_s_episodes_and_split_held_out(tmp_path):
    from rljax.environments.calculator import CalculatorEnv

    env = CalculatorEnv()
    messages = make_calculator_sft.transcript(7, "train", env)
    opening, info = env.reset(seed=7, options={"split": "train"})
    a, b = (int(x) for x in info["question"].split("*"))
    assert messages[:2] == opening and opening[1]["content"] == f"What is {a}*{b}?"  # what RL shows
    assert "<tools>" in opening[0]["content"] and '"name": "calculator"' in opening[0]["content"]
    assert messages[2:] == [
        {"role": "assistant",
         "content": f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"<answer>{a * b}</answer>"}]
    subprocess.run([sys.executable, os.path.join(REPO, "experiments", "make_calculator_sft.py"), "--n", "40",
                    "--eval-n", "12", "--out", str(tmp_path / "data")], check=True, capture_output=True)
    train, held_out = (load_transcripts(str(tmp_path / "data" / f"{s}.jsonl"))[0] for s in ("train", "eval"))
    assert len(train) == 40 and len(held_out) == 12
    problems = lambda rows: {r["messages"][1]["content"] for r in rows}  # noqa: E731
    assert not problems(train) & problems(held_out)
    for r in train + held_out:
        a, b = (int(x) for x in r["messages"][1]["content"][len("What is "):-1].split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and r["messages"][3]["content"] == str(a * b)


@pytest.mark.slow
def test_the_calculator_sft_config_runs_a_step(tiny_dir, tmp_path):
    """The config (excluded from tests/integration/test_train.py's every-config smoke: it reads the generator's
    files) with its own settings on short transcripts (the byte-level tiny tokenizer would make the
    calculator's system prompt ~500 tokens: a slow compile for nothing)."""
    for name, n in (("train", 16), ("eval", 4)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in _demo_rows(n, seed=len(name)))
    cfg = load_config(RunConfig, os.path.join(REPO, "configs", "sft_calculator_smollm2.yaml"), [
        f"model.name={tiny_dir}", f"train.run_dir={tmp_path}/run", "train.progress=false", "train.save_model=false",
        f"data.path={tmp_path}/train.jsonl", f"data.eval_path={tmp_path}/eval.jsonl"])
    assert cfg.algorithm.name == "sft" and cfg.model.lora_rank == 16
    summary = OfflineTrainer(cfg).fit()
    assert summary["steps"] == 16 // cfg.algorithm.batch_size  # epochs: 1
    assert summary["data"]["train_rows"] == 16 and "eval/nll" in summary["after"]


def test_chunked_argmax_equals_the_full_logits_argmax():
    from rljax.logprobs import chunked_logprobs

    hidden = jax.random.normal(jax.random.key(0), (2, 7, 4))
    proj = jax.random.normal(jax.random.key(1), (4, 11))
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, 11)
    out = chunked_logprobs(lambda h: h @ proj, hidden, tokens, 3, with_argmax=True)
    np.testing.assert_array_equal(out["argmax"], jnp.argmax(hidden @ proj, axis=-1))


def test_without_a_chat_template_one_exchange_is_raw_text_and_the_reply_ends_with_eos():
    tok = tiny_tokenizer()
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "AB"}]
    ids, mask = transcript_tokens(tok, messages, chat=False)
    assert tok.decode(ids) == "S\n\nQAB<|im_end|>" and mask == [0, 0, 0, 0, 1, 1, 1]
    ids, mask = transcript_tokens(tok, messages, chat=False, append_eos=False)
    assert mask == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="one \\[system,\\] user, assistant exchange"):
        transcript_tokens(tok, MULTI_TURN, chat=False)
