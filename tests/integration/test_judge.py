"""The LLM judge reward: parsing good / bad / partial replies, retries and fallbacks counted, the
pointwise P(yes) against a softmax by hand, determinism for a seed, batched equals one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import load
from rljax.rewards import build_reward, build_rewards, judge_metrics
from rljax.rewards.judge import JudgeModel, judge_groups, parse_group_scores, pointwise_messages

GOOD = '{"scores": [{"id": 1, "score": 0.8}, {"id": 2, "score": 0.1}]}'


@pytest.mark.parametrize("reply, expected", [
    (GOOD, [0.8, 0.1]),
    ("Here you go:\n```json\n" + GOOD + "\n```\nDone.", [0.8, 0.1]),  # fenced, prose around it
    ('{"scores": [{"trajectory_id": "2", "score": 0.3}, {"trajectory_id": "1", "score": 1}]}', [1.0, 0.3]),
    ('{"scores": [0.25, 0.75]}', [0.25, 0.75]),
    ('{"scores": {"1": "0.5", "2": 0.9}}', [0.5, 0.9]),
    ('{"1": 0.6, "2": 0.4}', [0.6, 0.4]),
    ('{"scores": [{"id": 1, "score": 1.7}, {"id": 2, "score": -3}]}', [1.0, 0.0]),  # clipped to [0, 1]
    # partial: one entry, a reply cut short, a non-number, an id out of range
    ('{"scores": [{"id": 2, "score": 0.2}]}', [np.nan, 0.2]),
    ('{"scores": [{"id": 1, "score": 0.8}, {"id": 2, "sc', [0.8, np.nan]),
    ('{"scores": [{"id": 1, "score": "high"}, {"id": 7, "score": 0.5}, {"id": 2, "score": 0.4}]}', [np.nan, 0.4]),
    # bad
    ("Response 1 is better than response 2.", [np.nan, np.nan]),
    ('{"scores": [0.8, 0.1', [np.nan, np.nan]),
    ("", [np.nan, np.nan]),
])
def test_parse_group_scores(reply, expected):
    np.testing.assert_array_equal(parse_group_scores(reply, 2), np.asarray(expected))


class ScriptedJudge:
    """Replies from a script per group (keyed by the group's first response text); records calls."""

    def __init__(self, script):
        self.script = {k: list(v) for k, v in script.items()}
        self.calls = []

    def generate(self, conversations, *, max_new_tokens, temperature, key):
        self.calls.append((len(conversations), temperature))
        replies = []
        for c in conversations:
            first = c[1]["content"].split('<response id="1">\n')[1].split("\n")[0]
            replies.append(self.script[first].pop(0))
        return replies


def test_retries_and_fallbacks_are_counted():
    judge = ScriptedJudge({
        "a1": ["no json", GOOD],                                          # parsed on the first retry
        "b1": ["bad", "worse", "still bad"],                              # never: the fallback
        "c1": ['{"scores": [0.9, 0.2, 0.4]}'],                            # parsed at once
        "d1": ['{"scores": [0.9]}', "nothing", '{"scores": [0.7]}'],      # partial throughout
    })
    groups = [("A", ["a1", "a2"]), ("B", ["b1", "b2"]), ("C", ["c1", "c2", "c3"]), ("D", ["d1", "d2"])]
    scores, replies, counts = judge_groups(judge, groups, retries=2, fallback=0.25)
    np.testing.assert_array_equal(scores[0], [0.8, 0.1])
    np.testing.assert_array_equal(scores[1], [0.25, 0.25])
    np.testing.assert_array_equal(scores[2], [0.9, 0.2, 0.4])
    np.testing.assert_array_equal(scores[3], [0.9, 0.25])  # the first partial reply kept (not more scores later)
    assert counts == {"groups": 4, "parse_failures": 1 + 3 + 3, "retries": 3 + 2, "fallback_groups": 1,
                      "fallback_scores": 2 + 1}
    assert replies == [GOOD, "bad", '{"scores": [0.9, 0.2, 0.4]}', '{"scores": [0.9]}']
    # batched: one call per attempt over the groups still unparsed; greedy first, sampled retries
    assert judge.calls == [(4, 0.0), (3, 0.7), (2, 0.7)]


def test_an_examples_trajectory_is_judged_instead_of_its_completion():
    judge = ScriptedJudge({"user: go": ['{"scores": [0.2, 0.6]}']})
    fn = build_reward("judge", {"judge": judge})
    examples = [{"prompt": "X", "trajectory": "user: go\nassistant: 41"}, {"prompt": "X", "trajectory": "user: go\nassistant: 42"}]
    np.testing.assert_array_equal(fn(["41", "42"], examples), [0.2, 0.6])  # keyed by the trajectory's first line


def test_the_reward_groups_by_prompt_saves_replies_and_reports_counts():
    judge = ScriptedJudge({"x1": ['{"scores": [0.1, 0.9]}'], "y1": ["?", "?"]})
    fn = build_reward("judge", {"retries": 1, "fallback": None, "judge": judge})
    examples = [{"prompt": "X"}, {"prompt": "Y"}, {"prompt": "X"}, {"prompt": "Y"}]  # groups interleaved
    out = fn(["x1", "y1", "x2", "y2"], examples)
    np.testing.assert_array_equal(out, [0.1, np.nan, 0.9, np.nan])  # fallback null: missing
    assert fn.last_outputs == ['{"scores": [0.1, 0.9]}', "?", '{"scores": [0.1, 0.9]}', "?"]
    assert judge_metrics({"judge": fn, "other": lambda c, e: c}) == {
        "reward/judge/judge_groups": 2.0, "reward/judge/judge_parse_failures": 2.0, "reward/judge/judge_retries": 1.0,
        "reward/judge/judge_fallback_groups": 1.0, "reward/judge/judge_fallback_scores": 2.0}
    assert judge_metrics({"judge": fn})["reward/judge/judge_groups"] == 0.0  # read and reset
    with pytest.raises(ValueError, match="fallback must be in"):
        build_reward("judge", {"fallback": 2.0, "judge": judge})


@pytest.fixture(scope="module")
def tiny_judge(tiny_dir):
    model, tokenizer = load(tiny_dir)
    return model, tokenizer


# the byte-level tiny tokenizer spells no word in one token: its judge answers with a letter
YES, NO = ("Y", "y"), ("N", "n")
CONVERSATIONS = [pointwise_messages("What is 2+2?", c, question="Correct?") for c in ("4", "five", "<answer>4</answer>")]


def test_pointwise_p_yes_is_the_softmax_ratio_of_the_next_token(tiny_judge, tiny_dir):
    model, tokenizer = tiny_judge
    judge = JudgeModel(model, tokenizer, batch_size=4, max_prompt_length=128)
    p = judge.yes_probability(CONVERSATIONS, yes_words=YES, no_words=NO)
    yes = [tokenizer.convert_tokens_to_ids(t) for t in YES]
    no = [tokenizer.convert_tokens_to_ids(t) for t in NO]
    for i, conversation in enumerate(CONVERSATIONS):
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        ids = jnp.asarray(tokenizer(text, add_special_tokens=False)["input_ids"])[None]
        hidden, _ = jax.jit(model.forward)(ids, jnp.ones(ids.shape, jnp.int32))
        logits = np.asarray(model.logits(hidden)[0, -1], np.float64)
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(p[i], probs[yes].sum() / (probs[yes].sum() + probs[no].sum()), rtol=1e-5)
    assert 0 < p.min() and p.max() < 1 and np.ptp(p) > 0  # a random model: neither 0, 1 nor constant
    with pytest.raises(ValueError, match="no single-token spelling"):
        judge.yes_probability(CONVERSATIONS)  # "Yes" is three byte tokens
    # from a config: no `model` given, the run's base model (the trainer's `base_model` context) judges
    rewards = build_rewards({"judge": {"mode": "pointwise", "question": "Correct?", "yes_words": list(YES),
                                       "no_words": list(NO), "max_prompt_length": 128, "batch_size": 4}},
                            base_model=tiny_dir)
    out = rewards(["4", "five", "<answer>4</answer>"], [{"prompt": "What is 2+2?"}] * 3)
    np.testing.assert_allclose(out.total, p, rtol=1e-5)
    assert rewards.functions["judge"].last_outputs[0] == f"P(yes)={p[0]:.6f}"


def test_batched_equals_one_by_one_and_a_seed_fixes_the_output(tiny_judge):
    model, tokenizer = tiny_judge
    batched = JudgeModel(model, tokenizer, batch_size=4, max_prompt_length=128)
    single = JudgeModel(model, tokenizer, batch_size=1, max_prompt_length=128)
    np.testing.assert_allclose(batched.yes_probability(CONVERSATIONS, yes_words=YES, no_words=NO),
                               single.yes_probability(CONVERSATIONS, yes_words=YES, no_words=NO), rtol=1e-5)
    assert batched.generate(CONVERSATIONS, max_new_tokens=6) == single.generate(CONVERSATIONS, max_new_tokens=6)
    # the engine holds what a call can use: batch_size sequences of a truncated prompt + its reply, in
    # pages of 16 tokens plus the null page (not a pool of the model's 2048-token context per slot)
    for judge, slots in ((batched, 4), (single, 1)):
        engine = judge._engine
        assert (engine.max_slots, engine.max_context, engine.stats["num_pages"]) == (slots, 128 + 6, slots * 9 + 1)
    long = [pointwise_messages("What is 2+2? " * 40, "4", question="Correct?")]  # over 128 tokens: truncated
    built = batched._engine
    assert len(batched.generate(long, max_new_tokens=6)) == 1 and batched._engine is built
    batched.generate(long, max_new_tokens=40)  # a longer reply than the pool was built for: a bigger one
    assert (batched._engine.max_context, batched._engine.stats["num_pages"]) == (128 + 40, 4 * 11 + 1)
    built = batched._engine  # past the model's 2048-token context: capped there, built once
    capped = batched._engine_for(1950)
    assert capped.max_context == 2048 and capped is not built and batched._engine_for(1950) is capped
    assert batched.generate([], max_new_tokens=6) == []
    sampled = [batched.generate(CONVERSATIONS, max_new_tokens=6, temperature=1.0, key=jax.random.key(s))
               for s in (0, 0, 1)]
    assert sampled[0] == sampled[1] != sampled[2]
    # the whole group judgement: the same seed, the same scores and replies (a random model never parses)
    options = {"judge": batched, "seed": 3, "retries": 1, "max_new_tokens": 6, "retry_temperature": 1.0}
    fn = [build_reward("judge", options) for _ in range(2)]
    examples = [{"prompt": "What is 2+2?"}] * 3
    outs = [(f(["4", "five", "22"], examples), f.last_outputs) for f in fn]
    np.testing.assert_array_equal(outs[0][0], [0.0, 0.0, 0.0])  # the fallback
    assert outs[0][1] == outs[1][1]
    assert fn[0].judge_counts == {"groups": 1, "parse_failures": 2, "retries": 1, "fallback_groups": 1,
                                  "fallback_scores": 3}


def test_a_run_with_a_judge_reward_logs_its_counts_and_saves_its_replies(tiny_dir, tmp_path):
    """The trainer wiring: the judge defaults to the run's base model (``base_model``), its counters
    are logged as ``reward/<name>/judge_*`` and its raw replies are written beside the samples."""
    import json

    from rljax.config import from_yaml
    from rljax.run_config import RunConfig
    from rljax.training import OnlineTrainer

    cfg = from_yaml(RunConfig, f"""
model: {{name: {tiny_dir}}}
data: {{task: addition, train_size: 16, eval_size: 4, max_prompt_length: 64}}
sampling: {{max_new_tokens: 4}}
algorithm: {{name: grpo, group_size: 2, prompts_per_step: 2}}
train: {{steps: 1, run_dir: {tmp_path}, progress: false, samples_every: 1, plot: false, save_model: false}}
rewards: {{judge: {{mode: pointwise, yes_words: [Y, y], no_words: [N, n]}}}}
""")
    OnlineTrainer(cfg).fit()
    with open(tmp_path / "metrics.jsonl") as f:
        step = [json.loads(line) for line in f if '"reward/judge/judge_requests"' in line]
    assert step and step[0]["reward/judge/judge_requests"] == 4.0  # 2 prompts x 2 completions
    with open(tmp_path / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    replies = [s["reward_outputs"]["judge"] for s in samples]
    assert len(replies) == 4 and all(r.startswith("P(yes)=") for r in replies)
    for s in samples:  # the reply is the score the sample got
        assert float(s["reward_outputs"]["judge"].split("=")[1]) == pytest.approx(s["reward/judge"], abs=1e-6)
    evals = [json.loads(line) for line in open(tmp_path / "eval_samples_step1.jsonl")]
    assert len(evals) == 4 and all("judge" in e["reward_outputs"] for e in evals)
