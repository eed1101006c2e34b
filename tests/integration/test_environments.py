"""Environments, tools and multi-turn episodes: the tool-call format, the trajectory's tokens and
masks, failures and budgets, credit, the sampler/trainer log-prob agreement across turns, and a
multi-turn GRPO run that learns."""

import json
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.algorithms import get as get_algorithm
from rljax.config import ConfigError, from_yaml
from rljax.environments import build_environment, register_environment
from rljax.environments.base import environment_factory
from rljax.environments.calculator import CalculatorEnv, calculator, demonstration, evaluate_expression
from rljax.environments.episodes import (episode_examples, episode_metrics, episodes_rollout, run_episodes,
                                         turn_sampler)
from rljax.environments.tools import Tool, ToolCall, ToolError, parse_tool_calls, run_tool_call
from rljax.environments.toy import ToyEnv
from rljax.inference import Engine
from rljax.logprobs import completion_logprobs
from rljax.losses.policy import policy_gradient_loss
from rljax.models import load
from rljax.rollout import concat_rollouts
from rljax.run_config import RunConfig
from rljax.sampling import SamplingConfig
from rljax.training import OnlineTrainer
from rljax.training.online import rollout_batch
from tests._tiny import tiny_tokenizer

EOS = 2  # <|im_end|> of the tiny byte tokenizer


# ------------------------------------------------------------------ tools

def test_a_tools_schema_comes_from_its_signature_and_docstring():
    def lookup(city: str, days: int = 1, metric: bool = True) -> str:
        """Look up the weather.

        More words that are not the description.

        city: the city's name.
        days: how many days ahead.
        """
        return city

    assert Tool(lookup).schema == {"type": "function", "function": {
        "name": "lookup", "description": "Look up the weather.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city's name."},
            "days": {"type": "integer", "description": "how many days ahead."},
            "metric": {"type": "boolean"}}}}}
    explicit = {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}, "required": []}}
    assert Tool(lambda: "x", schema=explicit).schema == {"type": "function", "function": explicit}
    assert calculator.schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"


def test_tool_calls_parse_in_the_hermes_form_and_bad_ones_become_errors():
    calls, errors = parse_tool_calls('I will compute. <tool_call>{"name": "calculator", "arguments": '
                                     '{"expression": "123*45"}}</tool_call>')
    assert calls == [ToolCall("calculator", {"expression": "123*45"})] and errors == []
    # Llama 3.1 writes "parameters"; some models JSON-encode the arguments
    calls, _ = parse_tool_calls('<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
                                '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})]
    assert parse_tool_calls("<answer>5</answer>") == ([], [])
    for text, why in [('<tool_call>{"name": "c", "arguments": {</tool_call>', "invalid JSON"),
                      ('<tool_call>["c"]</tool_call>', 'string "name"'),
                      ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "must be an object"),
                      ('<tool_call>{"name": "c"', "no closing </tool_call>")]:
        calls, errors = parse_tool_calls(text)
        assert calls == [] and len(errors) == 1 and errors[0].startswith("could not parse tool call"), text
        assert why in errors[0], errors


def test_a_tools_failures_are_results_the_model_sees():
    def boom(x: int) -> str:
        raise KeyError("bug")

    def refuse(x: int) -> str:
        raise ToolError("x must be positive")

    tools = {t.name: t for t in (Tool(boom), Tool(refuse), calculator)}
    assert run_tool_call(ToolCall("calculator", {"expression": "123*45"}), tools) == ("5535", True)
    for call, text in [(ToolCall("nope", {}), "unknown tool 'nope'"), (ToolCall("boom", {}), "needs the arguments ['x']"),
                       (ToolCall("boom", {"x": 1}), "boom failed: KeyError"),
                       (ToolCall("refuse", {"x": 1}), "error: x must be positive"),
                       (ToolCall("refuse", {"x": 1, "y": 2}), "bad arguments for refuse"),
                       (ToolCall("calculator", {"expression": "__import__('os')"}), "unsupported expression")]:
        result, ok = run_tool_call(call, tools)
        assert not ok and text in result, (call, result)


def test_the_calculator_evaluates_arithmetic_only():
    assert evaluate_expression("(2+3)*-4 // 3") == -7
    with pytest.raises(ToolError, match="division by zero"):
        evaluate_expression("1/0")
    with pytest.raises(ToolError, match="could not parse"):
        evaluate_expression("2 +* 3")


def test_calculator_splits_are_disjoint_and_fixed_by_seed():
    env = CalculatorEnv(split_seed=0)
    train = {env.problem(s, "train") for s in range(300)}
    evals = {env.problem(s, "eval") for s in range(300)}
    assert not train & evals and len(evals) > 250
    assert all(100 <= a < 1000 and 10 <= b < 100 for a, b in train | evals)
    assert env.reset(seed=5, options={"split": "eval"}) == env.reset(seed=5, options={"split": "eval"})
    _, info = env.reset(seed=5, options={"split": "eval"})
    assert env.step(f"<answer>{info['answer']}</answer>")[1:] == (1.0, True, False, {"success": True})
    env.reset(seed=5, options={"split": "eval"})
    assert env.step("<answer>12</answer>")[1:4] == (0.0, True, False)


def test_a_demonstration_is_a_successful_episode_of_the_environment():
    env = CalculatorEnv()
    messages = demonstration(env, seed=4, split="eval")
    a, b = env.problem(4, "eval")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["content"] == (f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}'
                                      "</tool_call>")
    assert messages[3]["content"] == str(a * b) and messages[4]["content"] == f"<answer>{a * b}</answer>"
    opening, _ = env.reset(seed=4, options={"split": "eval"})
    assert messages[:2] == opening and env.step(messages[2]["content"])[0] == [messages[3]]
    assert env.step(messages[4]["content"])[1:4] == (1.0, True, False)


def test_environments_build_by_name_or_python_path():
    assert isinstance(build_environment("rljax.environments.toy:ToyEnv", {"turns": 3}), ToyEnv)
    with pytest.raises(ValueError, match="unknown environment 'nope'; registered: calculator, code, sql, toy"):
        build_environment("nope")
    with pytest.raises(ValueError, match="bad options"):
        build_environment("calculator", {"digits": 4})
    with pytest.raises(ValueError, match="already registered"):
        register_environment("calculator", CalculatorEnv)


# ------------------------------------------------------------------ episodes with a scripted policy

def _scripted(tokenizer, reply):
    """A turn sampler that answers ``reply(context text, turn)`` (then <|im_end|>), log-prob -0.25 a token."""
    def sample(ids, mask, turn):
        rows = []
        for r in range(len(ids)):
            context = tokenizer.decode(ids[r][mask[r] == 1])
            rows.append(tokenizer(reply(context, turn), add_special_tokens=False)["input_ids"] + [EOS])
        N = max(len(r) for r in rows)
        tokens, tmask = np.full((len(rows), N), EOS, np.int32), np.zeros((len(rows), N), np.int32)
        for r, row in enumerate(rows):
            tokens[r, :len(row)], tmask[r, :len(row)] = row, 1
        return tokens, tmask, -0.25 * tmask.astype(np.float32), np.ones(len(rows), bool)
    return sample


def _calculator_reply(context, turn):
    if turn == 0:
        a, b = re.findall(r"What is (\d+)\*(\d+)\?", context)[-1]
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'
    result = re.findall(r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", context)[-1]
    return f"<answer>{result}</answer>"


def _run(reply, env="calculator", options=None, n=2, repeats=2, max_turns=4, max_tokens=2048, split="train"):
    tok = tiny_tokenizer()
    make_env = lambda: build_environment(env, options)  # noqa: E731
    episodes = run_episodes(_scripted(tok, reply), tok, make_env, episode_examples(env, split, n, 0), repeats=repeats,
                            max_turns=max_turns, max_tokens=max_tokens, max_new_tokens=64, pad_id=EOS)
    return tok, episodes


def test_a_trajectory_is_the_conversations_tokens_and_trains_on_the_sampled_ones_only():
    tok, episodes = _run(_calculator_reply)
    for e in episodes:
        assert e.status == "terminated" and e.success and e.total_return == 1.0 and e.num_turns == 2
        roles = [m["role"] for m in e.messages]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        # one token sequence: the template's rendering of the whole conversation, up to the last stop token
        whole = tok(tok.apply_chat_template(e.messages, tokenize=False), add_special_tokens=False)["input_ids"]
        assert e.token_ids == whole[:-1] and e.token_ids[-1] == EOS
        # the loss counts exactly the sampled tokens: each assistant message and its <|im_end|>
        trained = [t for t, m in zip(e.token_ids, e.policy_mask) if m]
        replies = [m["content"] for m in e.messages if m["role"] == "assistant"]
        assert tok.decode(trained, skip_special_tokens=False) == "<|im_end|>".join(replies) + "<|im_end|>"
        assert [lp for lp, m in zip(e.logprobs, e.policy_mask) if m] == [-0.25] * len(trained)
        assert e.tool_calls == {"calculator": 1} and e.tool_errors == e.parse_failures == 0
    m = episode_metrics(episodes)
    assert (m["env/success_rate"], m["env/turns"], m["env/tool_calls"], m["env/tool_calls/calculator"]) == (1, 2, 1, 1)
    assert m["env/failed"] == m["env/truncated"] == m["env/parse_failures"] == 0
    assert m["env/tokens_generated"] == np.mean([sum(e.policy_mask) for e in episodes])

    roll = episodes_rollout(episodes, tok, repeats=2, pad_id=EOS)
    batch = rollout_batch(roll, mask_truncated=False)
    for i, e in enumerate(episodes):  # the prompt is the opening, the completion the rest, masks aligned
        P = e.prompt_length
        assert roll.prompt_ids[i][roll.prompt_mask[i] == 1].tolist() == e.token_ids[:P]
        n = len(e.token_ids) - P
        assert roll.completion_ids[i, :n].tolist() == e.token_ids[P:] and roll.completion_mask[i].sum() == n
        np.testing.assert_array_equal(np.asarray(batch.loss_mask[i, :n]), e.policy_mask[P:])
        assert int(batch.loss_mask[i].sum()) == sum(e.policy_mask) < n  # the tool's tokens are context
    assert roll.scores.tolist() == [1.0] * 4 and roll.per_function["success"].tolist() == [1.0] * 4

    # DAPO's dynamic sampling takes groups and joins them: the policy mask goes along
    joined = concat_rollouts([roll.take([2, 3]), roll.take([0, 1])], pad_id=EOS)
    np.testing.assert_array_equal(joined.policy_mask, roll.policy_mask[[2, 3, 0, 1]])

    # PPO's GAE runs over the assistant tokens only, across the tool's message: with γ = λ = 1 and
    # V = 0 every assistant token's return is the episode's return, and the tool's tokens get nothing
    ppo = get_algorithm("ppo")
    cfg = from_yaml(RunConfig, "algorithm: {name: ppo, gamma: 1.0, lam: 1.0, whiten_advantages: false}\n"
                               "rewards: {answer: 1.0}").algorithm
    out = ppo.advantages(batch.replace(old_values=jnp.zeros_like(batch.old_logprobs)), cfg)
    trained = np.asarray(batch.loss_mask) == 1
    np.testing.assert_allclose(np.asarray(out.returns)[trained], 1.0, rtol=0, atol=1e-6)
    assert (np.asarray(out.returns)[~trained] == 0).all() and (np.asarray(out.advantages)[~trained] == 0).all()


def test_a_malformed_or_unknown_tool_call_is_an_observation_not_a_crash():
    def reply(context, turn):
        if turn == 0:
            return '<tool_call>{"name": "calculator", "arguments": {"expression": "1*2"</tool_call>'
        if turn == 1:
            assert "error: could not parse tool call" in context  # the model sees why
            return '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>'
        assert "error: unknown tool 'abacus'; tools: calculator" in context
        return "<answer>7</answer>"

    tok, episodes = _run(reply, n=1, repeats=1)
    (e,) = episodes
    assert e.status == "terminated" and not e.success and e.num_turns == 3
    assert (e.parse_failures, e.tool_errors, dict(e.tool_calls)) == (1, 1, {"abacus": 1})
    m = episode_metrics(episodes)
    assert (m["env/parse_failures"], m["env/tool_errors"], m["env/tool_calls/abacus"]) == (1, 1, 1)


def test_an_environment_that_raises_fails_its_episode_only():
    tok, episodes = _run(lambda context, turn: "abc", env="toy", options={"turns": 2, "fail_on_seed": 1})
    assert [e.status for e in episodes] == ["terminated", "terminated", "failed", "failed"]
    assert "RuntimeError: toy environment bug on seed 1" in episodes[2].error
    assert episode_metrics(episodes)["env/failed"] == 2.0
    roll = episodes_rollout(episodes, tok, repeats=2, pad_id=EOS)
    assert roll.row_mask.tolist() == [True, True, False, False]
    assert np.isnan(roll.per_function["environment"][2:]).all() and roll.scores[2:].tolist() == [0.0, 0.0]
    assert int(rollout_batch(roll, mask_truncated=False).loss_mask[2:].sum()) == 0  # left out of the loss

    class BrokenReset(ToyEnv):
        def reset(self, seed=None, options=None):
            raise OSError("no database")

    register_environment("broken_reset", BrokenReset, overwrite=True)
    tok, episodes = _run(lambda context, turn: "abc", env="broken_reset", n=1)
    assert [e.status for e in episodes] == ["failed", "failed"] and "reset: OSError" in episodes[0].error
    roll = episodes_rollout(episodes, tok, repeats=2, pad_id=EOS)
    assert roll.row_mask.tolist() == [False, False] and roll.prompt_mask.sum() == 2  # one attendable pad each


def test_environments_step_concurrently():
    # each step waits until all four episodes' steps are in flight: serial steps would break the barrier
    barrier = threading.Barrier(4, timeout=30)

    class Meeting(ToyEnv):
        def step(self, action):
            barrier.wait()
            return super().step(action)

    register_environment("meeting", Meeting, overwrite=True)
    tok = tiny_tokenizer()
    episodes = run_episodes(_scripted(tok, lambda context, turn: "abc"), tok, lambda: build_environment("meeting"),
                            episode_examples("meeting", "train", 2, 0), repeats=2, max_turns=2, max_tokens=512,
                            max_new_tokens=64, pad_id=EOS, workers=4)
    assert [e.status for e in episodes] == ["terminated"] * 4, [e.error for e in episodes]


def test_turn_and_token_budgets_truncate():
    echo = lambda context, turn: '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'  # noqa: E731
    tok, episodes = _run(echo, env="toy", max_turns=3)
    assert all(e.status == "truncated" and e.truncation == "turns" and e.num_turns == 3 for e in episodes)
    assert all(e.tool_calls == {"echo": 3} for e in episodes)
    assert episode_metrics(episodes)["env/truncated/turns"] == 1.0
    roll = episodes_rollout(episodes, tok, repeats=2, pad_id=EOS)
    assert not roll.finished.any() and int(rollout_batch(roll, mask_truncated=True).loss_mask.sum()) == 0
    # room for the opening and one turn of 64 tokens only
    opening = episodes[0].prompt_length
    tok, episodes = _run(echo, env="toy", max_turns=3, max_tokens=opening + 100)
    assert all(e.truncation == "tokens" and e.num_turns == 1 and len(e.token_ids) <= opening + 100 for e in episodes)
    with pytest.raises(ValueError, match="leaving no room for a turn of 64 tokens within max_tokens=70"):
        _run(echo, env="toy", max_tokens=70)


def test_a_flood_of_environment_output_ends_the_episode_within_the_token_budget():
    """A reply is appended only if the next turn still fits: a tool answering 20,000 characters (as a
    program printing its output, or a failing test showing a huge return value, can) truncates the
    episode for tokens with the trajectory inside max_tokens, not 20,000 tokens past it."""
    class Flood(ToyEnv):
        def step(self, action):
            if "flood" in action:
                return [{"role": "tool", "content": "x " * 10_000}], 0.0, False, False, {}
            return super().step(action)

    register_environment("flood", Flood, overwrite=True)
    tok, episodes = _run(lambda context, turn: "flood" if turn == 1 else "abc", env="flood",
                         options={"turns": 4}, max_turns=4, max_tokens=512)
    for e in episodes:
        assert (e.status, e.truncation, e.num_turns) == ("truncated", "tokens", 2)
        assert len(e.token_ids) <= 512 - 64 and e.token_ids[-1] == EOS  # ends with the last sampled turn
        assert e.messages[-1]["content"] == "x " * 10_000  # the log keeps what the environment said
    roll = episodes_rollout(episodes, tok, repeats=2, pad_id=EOS)
    assert roll.prompt_ids.shape[1] + roll.completion_ids.shape[1] <= 512


def test_per_turn_credit_makes_one_row_per_turn():
    # toy: a plain reply earns (lowercase share) / turns; turn 0 "AB" earns 0, turn 1 "ab" 0.5
    tok, episodes = _run(lambda context, turn: "AB" if turn == 0 else "ab", env="toy", n=1)
    assert [e.rewards for e in episodes] == [[0.0, 0.5], [0.0, 0.5]]
    roll = episodes_rollout(episodes, tok, repeats=2, pad_id=EOS, credit="turn", max_turns=3, turn_reward="reward_to_go",
                            gamma=0.5)
    assert len(roll) == 6 and roll.row_mask.tolist() == [True] * 4 + [False] * 2  # padded to repeats × max_turns
    assert roll.scores.tolist() == [0.25, 0.5, 0.25, 0.5, 0.0, 0.0]  # Σ_{k≥t} γ^(k−t) r_k
    ret = episodes_rollout(episodes, tok, repeats=2, pad_id=EOS, credit="turn", max_turns=3)
    assert ret.scores.tolist() == [0.5] * 4 + [0.0, 0.0]
    e = episodes[0]
    (s0, e0), (s1, e1) = e.turn_spans
    assert roll.prompt_ids[1][roll.prompt_mask[1] == 1].tolist() == e.token_ids[:s1]  # the context before turn 1
    assert roll.completion_ids[1, :e1 - s1].tolist() == e.token_ids[s1:e1]
    assert (roll.policy_mask == roll.completion_mask).all()  # a turn's tokens are all the policy's


def test_a_template_that_renders_tools_gets_the_schemas_and_others_a_system_message():
    tok = tiny_tokenizer()
    plain = environment_factory("calculator", tokenizer=tok)()
    assert not plain.native_tools and '"name": "calculator"' in plain.reset(seed=0)[0][0]["content"]
    tok.chat_template = "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}" + tok.chat_template
    native = environment_factory("calculator", tokenizer=tok)()
    messages, info = native.reset(seed=0)
    assert native.native_tools and info["tools"] == [calculator.schema] and "<tools>" not in messages[0]["content"]
    episodes = run_episodes(_scripted(tok, _calculator_reply), tok, lambda: environment_factory("calculator", tokenizer=tok)(),
                            episode_examples("calculator", "train", 1, 0), max_turns=3, max_tokens=1024,
                            max_new_tokens=64, pad_id=EOS)
    (e,) = episodes
    assert e.success and tok.decode(e.token_ids[:e.prompt_length]).startswith('<tools>[{"type": "function"')
    assert environment_factory("calculator", {"native_tools": False}, tokenizer=tok)().native_tools is False


# ------------------------------------------------------------------ a tiny model

@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model, tok = load(tiny_dir)[:2]
    return tiny_dir, model, tok


@pytest.mark.parametrize("engine", [False, True], ids=["static", "engine"])
def test_sampler_and_trainer_log_probs_agree_across_turns_and_environment_tokens_get_no_gradient(tiny, engine):
    _, model, tok = tiny
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, stop_token_ids=(EOS,), pad_token_id=EOS)
    engine = Engine(model, max_slots=4, page_size=8) if engine else None
    episodes = run_episodes(turn_sampler(model, sampling, jax.random.key(0), engine=engine), tok,
                            lambda: build_environment("toy", {"turns": 3}), episode_examples("toy", "train", 2, 0),
                            repeats=2, max_turns=3, max_tokens=256, max_new_tokens=8, pad_id=EOS)
    assert all(e.num_turns == 3 for e in episodes)
    roll = episodes_rollout(episodes, tok, repeats=2, pad_id=EOS)
    policy = roll.policy_mask == 1
    context = (roll.completion_mask == 1) & ~policy  # the environment's messages between turns
    assert context.sum(-1).min() > 0
    out = completion_logprobs(model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    np.testing.assert_allclose(np.asarray(out["logprobs"])[policy], roll.logprobs[policy], atol=1e-5, rtol=0)
    assert (roll.logprobs[context] == 0).all()

    # the loss's gradient w.r.t. the log-probs of the environment's tokens is 0; the policy's are not
    batch = rollout_batch(roll, mask_truncated=False)
    advantages = jnp.asarray(np.random.default_rng(0).normal(size=roll.logprobs.shape), jnp.float32)
    grad = jax.grad(lambda lp: policy_gradient_loss(lp, batch.old_logprobs, advantages, batch.loss_mask)[0])(
        out["logprobs"])
    assert (np.asarray(grad)[context] == 0).all() and (np.asarray(grad)[policy] != 0).all()

    # and the training loss (GRPO) does not read them: garbage there leaves the loss and gradient unchanged
    grpo = get_algorithm("grpo")
    cfg = from_yaml(RunConfig, "algorithm: {name: grpo}\nrewards: {answer: 1.0}").algorithm
    batch = batch.replace(advantages=jnp.where(batch.loss_mask == 1, advantages, 0.0))
    noise = jnp.asarray(context, jnp.float32) * 7.0
    dirty = batch.replace(old_logprobs=batch.old_logprobs - noise, advantages=batch.advantages + noise)

    graphdef, params = nnx.split(model)
    num_tokens, max_length = int(batch.loss_mask.sum()), batch.loss_mask.shape[1]

    @jax.jit
    def loss(p, b):
        return jax.value_and_grad(lambda p: grpo.loss(nnx.merge(graphdef, p), b, cfg, temperature=1.0, num_rows=4,
                                                      num_tokens=num_tokens, max_length=max_length)[0])(p)

    (clean_value, clean_grad), (dirty_value, dirty_grad) = loss(params, batch), loss(params, dirty)
    assert clean_value == dirty_value
    for a, b in zip(jax.tree.leaves(clean_grad), jax.tree.leaves(dirty_grad)):
        np.testing.assert_array_equal(a, b)


def test_on_the_engine_an_episode_waiting_on_a_slow_tool_holds_no_other(tiny):
    _, model, tok = tiny
    others_done = threading.Event()
    finished, waited = [], []

    class Slow(ToyEnv):
        def reset(self, seed=None, options=None):
            self.slow = seed == 0
            return super().reset(seed=seed, options=options)

        def step(self, action):
            if self.slow:  # the first turn of the slow episode answers only once every other episode ended
                waited.append(others_done.wait(timeout=120))
                self.slow = False
            out = super().step(action)
            if out[2]:
                finished.append(self)
                if len(finished) == 3:
                    others_done.set()
            return out

    register_environment("slow toy", Slow, overwrite=True)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, stop_token_ids=(EOS,), pad_token_id=EOS)
    engine = Engine(model, max_slots=4, page_size=8)
    episodes = run_episodes(turn_sampler(model, sampling, jax.random.key(1), engine=engine), tok,
                            lambda: build_environment("slow toy", {"turns": 3}),
                            [{"seed": s} for s in range(4)], max_turns=3, max_tokens=256, max_new_tokens=6,
                            pad_id=EOS, workers=4)
    assert waited == [True]  # the three others ran all their turns while the slow one waited
    assert [e.status for e in episodes] == ["terminated"] * 4 and all(e.num_turns == 3 for e in episodes)
    # each later turn prefilled only its new tokens: the conversation so far came from cached pages
    assert engine.stats["page_cache_hits"] > 0
    assert engine.stats["prefill_tokens"] < sum(len(e.token_ids) for e in episodes)


def _agent_cfg(path, run_dir, steps, credit="trajectory"):
    return from_yaml(RunConfig, f"""
model: {{name: {path}}}
data: {{train_size: 64, eval_size: 0}}  # no evaluation: a greedy sampler would compile for nothing
sampling: {{max_new_tokens: 6}}
environment: {{name: toy, options: {{turns: 2}}, max_turns: 2, max_tokens: 96, credit: {credit}}}
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 4}}
optim: {{learning_rate: 2.0e-2}}
train: {{steps: {steps}, run_dir: {run_dir}, progress: false, samples_every: 4, save_model: false, plot: false}}
""")


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_multi_turn_grpo_on_the_toy_environment_raises_success(tiny, tmp_path):
    # compiling the sampler and the update is nearly all of the time: a step takes ~0.15 s after it
    OnlineTrainer(_agent_cfg(tiny[0], tmp_path, steps=16)).fit()
    steps = [m for m in _metrics(tmp_path) if "loss" in m]
    success, returns = [m["env/success_rate"] for m in steps], [m["env/return"] for m in steps]
    # measured (rollout engine): success 0 for the first 3 steps, then 0.06, 0.19, 0.69, ...
    assert max(success[:3]) == 0 and np.mean(success[-3:]) >= 0.5, success
    assert np.mean(returns[-3:]) > np.mean(returns[:3]) + 0.3, returns
    assert all(m["env/turns"] == 2 and m["env/failed"] == 0 and m["env/truncated"] == 0 for m in steps)


def test_per_turn_credit_trains_with_the_unchanged_loss(tiny, tmp_path):
    trainer = OnlineTrainer(_agent_cfg(tiny[0], tmp_path, steps=1, credit="turn"))
    metrics = trainer.step_once()
    assert len(trainer.last_rollouts) == 4 * 4 * 2  # prompts × group × max_turns rows
    assert metrics["env/turns"] == 2 and np.isfinite(metrics["loss"])


def test_an_environment_run_refuses_rewards_and_bad_settings():
    with pytest.raises(ConfigError, match="rewards: an environment run"):
        from_yaml(RunConfig, "environment: {name: toy}\nrewards: {answer: 1.0}")
    with pytest.raises(ConfigError, match="environment.credit"):
        from_yaml(RunConfig, "environment: {name: toy, credit: step}")
    with pytest.raises(ConfigError, match="environment.max_turns"):
        from_yaml(RunConfig, "environment: {name: toy, max_turns: 0}")
