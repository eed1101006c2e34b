"""rljax.agents without a model: the join / rewrite assembly of hand-built call records, the rows and
scores of agent episodes, their metrics, and the agent configuration's checks."""

from types import SimpleNamespace

import numpy as np
import pytest

from rljax.agents import AgentEpisode, agent_metrics, agent_rollout, assemble, load_agent, score_episodes
from rljax.agents.server import encode_with_history, replayed_sequences
from rljax.config import ConfigError, from_yaml
from rljax.errors import UserError
from rljax.rewards.base import RewardOutput
from rljax.run_config import RunConfig
from rljax.serve.protocol import ChatRequest, Decoder, chat_prompt, tool_message
from tests._tiny import tiny_tokenizer

EOS = 2


def choice(ids, lps, reason="stop", text="", tool_calls=(), errors=(), content=None):
    return SimpleNamespace(token_ids=list(ids), logprobs=list(lps), finish_reason=reason, text=text,
                           content=text if content is None else content, tool_calls=list(tool_calls),
                           tool_call_errors=list(errors))


def call(prompt, *choices, version=0, messages=None):
    return SimpleNamespace(prompt_token_ids=list(prompt), choices=list(choices), policy_version=version,
                           policy_version_end=version, request={"messages": messages or []})


def test_a_call_that_extends_the_previous_one_joins_it_and_only_completions_carry_loss():
    first = call([10, 11, 12], choice([20, 21, EOS], [-0.1, -0.2, -0.3]))
    second = call([10, 11, 12, 20, 21, EOS, 30, 31], choice([22, EOS], [-0.4, -0.5]))
    [seq] = assemble([first, second], example={"prompt": "p"})
    assert seq.token_ids == [10, 11, 12, 20, 21, EOS, 30, 31, 22, EOS]
    assert seq.policy_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert seq.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert seq.prompt_length == 3 and seq.turn_spans == [(3, 6), (8, 10)] and seq.turn_finished == [True, True]
    assert seq.status == "terminated" and seq.example == {"prompt": "p"}


def test_a_rewritten_history_makes_separate_transitions_and_a_later_call_joins_the_longest_it_extends():
    first = call([10, 11], choice([20, EOS], [-0.1, -0.2]))
    rewritten = call([10, 99, 98], choice([21], [-0.3], reason="length"))  # the agent summarised its history
    third = call([10, 11, 20, EOS, 40], choice([23, EOS], [-0.6, -0.7]))  # continues the first call
    a, b = assemble([first, rewritten, third])
    assert a.token_ids == [10, 11, 20, EOS, 40, 23, EOS] and a.policy_mask == [0, 0, 1, 1, 0, 1, 1]
    assert a.status == "terminated" and a.turn_spans == [(2, 4), (5, 7)]
    assert b.token_ids == [10, 99, 98, 21] and b.policy_mask == [0, 0, 0, 1] and b.prompt_length == 3
    assert b.status == "truncated" and b.turn_finished == [False]  # ran out of max_tokens: not stopped
    # a call whose prompt equals an earlier sequence exactly continues it with no context between
    [c] = assemble([first, call([10, 11, 20, EOS], choice([5], [-1.0]))])
    assert c.token_ids == [10, 11, 20, EOS, 5] and c.policy_mask == [0, 0, 1, 1, 1]


def test_of_several_choices_the_first_continues_and_the_others_start_their_own():
    first = call([10], choice([20, EOS], [-0.1, -0.2]))
    both = call([10, 20, EOS, 7], choice([30, EOS], [-0.3, -0.4]), choice([31, EOS], [-0.5, -0.6]))
    on_second = call([10, 20, EOS, 7, 31, EOS, 8], choice([32, EOS], [-0.7, -0.8]))
    a, b = assemble([first, both, on_second])
    assert a.token_ids == [10, 20, EOS, 7, 30, EOS] and a.policy_mask == [0, 1, 1, 0, 1, 1]
    # the second choice's prompt is context only: the first call's tokens are trained once, in `a`
    assert b.token_ids == [10, 20, EOS, 7, 31, EOS, 8, 32, EOS] and b.policy_mask == [0, 0, 0, 0, 1, 1, 0, 1, 1]
    assert sum(a.policy_mask) + sum(b.policy_mask) == 2 + 2 + 2 + 2


def test_a_sequence_over_max_tokens_is_cut_and_counts_as_not_stopped():
    calls = [call([1, 2, 3], choice([4, 5, EOS], [-1.0] * 3)), call([1, 2, 3, 4, 5, EOS, 6], choice([7, EOS], [-2.0] * 2))]
    [seq] = assemble(calls, max_tokens=8)
    assert seq.token_ids == [1, 2, 3, 4, 5, EOS, 6, 7] and seq.policy_mask == [0, 0, 0, 1, 1, 1, 0, 1]
    assert seq.turn_spans == [(3, 6), (7, 8)] and seq.turn_finished == [True, False]
    assert (seq.status, seq.truncation) == ("truncated", "tokens")
    with pytest.raises(ValueError, match="prompt is 3 tokens"):
        assemble(calls, max_tokens=3)
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        assemble([call([1], choice([4, 5], [-1.0]))])


def _episode(task, reward, calls, error=""):
    e = AgentEpisode(task=task, reward=reward, returned=reward, error=error, calls=calls)
    if not error:
        e.transitions = assemble(calls, example=task)
    return e


def test_agent_rows_share_the_episode_reward_pad_each_episode_and_leave_failed_ones_out():
    tok = tiny_tokenizer()
    joined = [call([10, 11], choice([20, EOS], [-0.1, -0.2], text="a")),
              call([10, 11, 20, EOS, 30], choice([21, EOS], [-0.3, -0.4], text="b"))]
    split = [call([10, 11], choice([20, EOS], [-0.1, -0.2], text="c")), call([12], choice([22], [-0.5], "length", "d"))]
    episodes = [_episode({"prompt": "t"}, 1.0, joined), _episode({"prompt": "t"}, 0.25, split),
                _episode({"prompt": "t"}, None, [], error="RuntimeError: boom")]
    roll = agent_rollout(episodes, tok, repeats=3, max_transitions=2, pad_id=EOS)
    assert len(roll) == 6  # 3 episodes × 2 rows
    assert roll.row_mask.tolist() == [True, False, True, True, False, False]
    assert roll.scores.tolist() == [1.0, 0.0, 0.25, 0.25, 0.0, 0.0]
    assert roll.finished.tolist()[:4] == [True, False, True, False]
    # row 0: prompt = the first call's prompt, completion = the rest, loss on the sampled tokens only
    assert roll.prompt_ids[0][roll.prompt_mask[0] == 1].tolist() == [10, 11]
    n = int(roll.completion_mask[0].sum())
    assert roll.completion_ids[0, :n].tolist() == [20, EOS, 30, 21, EOS] and roll.policy_mask[0, :n].tolist() == [1, 1, 0, 1, 1]
    np.testing.assert_array_equal(roll.logprobs[0, :n], np.float32([-0.1, -0.2, 0.0, -0.3, -0.4]))
    assert roll.prompt_ids[3][roll.prompt_mask[3] == 1].tolist() == [12] and roll.policy_mask[3].sum() == 1
    assert np.isnan(roll.per_function["environment"][[1, 4, 5]]).all()

    m = agent_metrics(episodes, version=0)
    assert m["agent/episodes"] == 3 and m["agent/failed_episodes"] == 1
    assert m["agent/calls_per_episode"] == 4 / 3 and m["agent/tokens_per_episode"] == 7 / 3
    assert m["agent/transitions_per_episode"] == 1.5 and m["agent/rewritten"] == 0.5
    assert m["agent/return"] == 0.625 and m["agent/stale_calls"] == 0
    assert agent_metrics(episodes, version=1)["agent/stale_calls"] == 4


def test_tool_call_counts_are_per_episode():
    calls = [call([1], choice([2], [-1.0], text="x", tool_calls=[{"id": "a"}, {"id": "b"}], errors=["bad json"]))]
    m = agent_metrics([_episode({}, 1.0, calls), _episode({}, 0.0, calls)])
    assert (m["agent/tool_calls_parsed"], m["agent/tool_calls_failed"]) == (2.0, 1.0)


def test_episodes_that_return_none_are_scored_by_the_rewards_on_their_last_reply():
    seen, seen_ids = [], []

    def rewards(completions, examples):
        seen.append((list(completions), [e["prompt"] for e in examples]))
        seen_ids.extend(e["completion_ids"] for e in examples)
        total = np.array([len(c) / 10 for c in completions])
        return RewardOutput(total, {"judge": total}, np.array([c == "?" for c in completions]))

    def one(text, returned):
        return _episode({"prompt": "t"}, returned, [call([1], choice([3], [-1.0], text="first")),
                                                   call([2], choice([4], [-1.0], text=text))])

    episodes = [one("abcd", None), one("ab", 0.9), one("?", None), _episode({"prompt": "t"}, None, [], error="E: x")]
    score_episodes(episodes, rewards)
    assert seen == [(["abcd", "ab", "?"], ["t", "t", "t"])]  # the last replies: what answer/python rewards check
    assert seen_ids == [[4], [4], [4]]  # the last reply's ids, as a completion's  # a group judge sees every unfailed episode
    assert episodes[0].reward == 0.4 and episodes[0].scored_by == "rewards"
    assert episodes[1].reward == 0.9 and episodes[1].scored_by == "agent"  # what the agent returned wins
    assert episodes[2].failed and "did not score" in episodes[2].error
    lone = [one("abc", None)]
    score_episodes(lone, None)
    assert lone[0].failed and "returned None" in lone[0].error


def test_the_transcript_holds_every_turn_once_and_marks_a_rewritten_history():
    system, user = {"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2*3+4?"}
    mult = {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'}}
    first = call([1], choice([5], [-1.0], content=None, tool_calls=[mult]), messages=[system, user])
    said = {"role": "assistant", "content": None, "tool_calls": [mult]}
    second = call([1, 5, 6], choice([7], [-1.0], text="<answer>10</answer>"),
                  messages=[system, user, said, {"role": "tool", "tool_call_id": "c1", "content": "6"}])
    rewritten = call([9], choice([8], [-1.0], text="<answer>10</answer>"),
                     messages=[system, {"role": "user", "content": "What is 2*3+4?\nResults so far: 6"}])
    assert _episode({"prompt": "t"}, None, [first, second]).transcript == (
        "system: Use tools.\nuser: What is 2*3+4?\nassistant: \n  -> multiply({\"a\": 2, \"b\": 3})\n"
        "tool: 6\nassistant: <answer>10</answer>")
    text = _episode({"prompt": "t"}, None, [first, rewritten]).transcript
    assert text.endswith("[call 2: the agent rewrote its history]\nsystem: Use tools.\n"
                         "user: What is 2*3+4?\nResults so far: 6\nassistant: <answer>10</answer>")


def test_the_rewards_see_each_episodes_trajectory_and_a_task_without_a_prompt_is_grouped_by_its_json():
    examples = []

    def rewards(completions, exs):
        examples.extend(exs)
        return RewardOutput(np.ones(len(completions)), {"judge": np.ones(len(completions))}, np.zeros(len(completions), bool))

    turns = [call([1], choice([3], [-1.0], text="first"), messages=[{"role": "user", "content": "go"}]),
             call([2], choice([4], [-1.0], text="last"), messages=[{"role": "user", "content": "go"},
                                                                   {"role": "assistant", "content": "first"},
                                                                   {"role": "user", "content": "more"}])]
    episodes = [_episode({"a": 1, "b": 2}, None, turns), _episode({"b": 2, "a": 1}, None, turns)]
    score_episodes(episodes, rewards)
    assert [e["trajectory"] for e in examples] == ["user: go\nassistant: first\nuser: more\nassistant: last"] * 2
    assert examples[0]["prompt"] == examples[1]["prompt"] == '{"a": 1, "b": 2}'
    assert all(e.reward == 1.0 for e in episodes)


def test_load_agent_names_the_key_and_the_problem(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text("def run(task, client):\n    return 1.0\n\ndef lonely(task):\n    return 0\n\nNOT_A_FUNCTION = 3\n")
    assert load_agent(f"{path}:run")({}, None) == 1.0
    with pytest.raises(UserError, match="environment.function: .*no such file"):
        load_agent(f"{tmp_path}/missing.py:run")
    with pytest.raises(UserError, match="environment.function: .*has no attribute 'walk'"):
        load_agent(f"{path}:walk")
    with pytest.raises(UserError, match=r"cannot be called as run\(task, client\)"):
        load_agent(f"{path}:lonely")
    with pytest.raises(UserError, match="not a function"):
        load_agent(f"{path}:NOT_A_FUNCTION")


@pytest.mark.parametrize("text, key", [
    ("{type: agent}", "environment.function"),
    ("{type: agent, function: run}", "environment.function"),
    ("{type: agent, function: a.py:run, concurrency: 0}", "environment.concurrency"),
    ("{type: agent, function: a.py:run, max_transitions: 0}", "environment.max_transitions"),
    ("{type: agent, function: a.py:run, name: toy}", "environment.name"),
    ("{type: agent, function: a.py:run, credit: turn}", "environment.credit"),
    ("{type: robot, function: a.py:run}", "environment.type"),
    ("{function: a.py:run}", "environment.function"),
    ("{name: toy, concurrency: 4}", "environment.concurrency"),
])
def test_bad_agent_settings_are_refused_naming_the_key(text, key):
    with pytest.raises(ConfigError, match=key):
        from_yaml(RunConfig, f"environment: {text}")


def test_agent_configs_parse_and_existing_environment_configs_keep_working():
    cfg = from_yaml(RunConfig, "environment: {type: agent, function: my_agent.py:run, concurrency: 4}\n"
                               "rewards: {judge: {mode: group}}")
    assert cfg.environment.is_agent and cfg.environment.concurrency == 4 and cfg.environment.max_transitions == 1
    assert from_yaml(RunConfig, "environment: {type: agent, function: my_agent.py:run}").rewards == {}
    env = from_yaml(RunConfig, "environment: {name: toy, max_turns: 2}").environment
    assert not env.is_agent and env.type == "environment" and env.name == "toy"


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def _chat_text(tok, messages):
    return chat_prompt(tok, ChatRequest.model_validate({"model": "m", "messages": messages, "tools": TOOLS}))[0]


def test_a_reply_sent_back_keeps_its_sampled_ids_so_the_calls_join():
    tok = tiny_tokenizer()
    encode = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    messages = [{"role": "user", "content": "1+2?"}]
    first_prompt = encode(_chat_text(tok, messages))
    # the model's own layout: a space before the block, newlines inside it
    raw = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    ids = encode(raw) + [EOS]
    text = Decoder(tok, (EOS,)).text(ids)
    message, errors = tool_message(text, TOOLS)
    assert message["content"] == "Let me add." and not errors and len(message["tool_calls"]) == 1
    record = call(first_prompt, choice(ids, [-0.5] * len(ids), "tool_calls", text=text, content=message["content"],
                                       tool_calls=message["tool_calls"]))
    # the agent sends the message back as the openai client gave it, with the tool's result
    messages += [{"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
                 {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "3"}]
    second_text = _chat_text(tok, messages)
    assert not encode(second_text)[:len(first_prompt) + len(ids)] == first_prompt + ids  # re-rendered differently
    second_prompt = encode_with_history(tok, second_text, replayed_sequences(tok, (EOS,), record))
    rest = second_prompt[len(first_prompt) + len(ids):]
    assert second_prompt[:len(first_prompt) + len(ids)] == first_prompt + ids
    assert tok.decode(rest) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    [joined] = assemble([record, call(second_prompt, choice([51, EOS], [-1.0, -1.0]))])
    assert sum(joined.policy_mask) == len(ids) + 2 and joined.token_ids == second_prompt + [51, EOS]

    # a reply cut by a stop string holds tokens the text sent back does not: its ids are not replayed
    cut = call(first_prompt, choice(ids[:-1], [-0.5] * (len(ids) - 1), "stop", text="Let me add."))
    assert [t for t, _ in replayed_sequences(tok, (EOS,), cut)] == [tok.decode(first_prompt + ids[:-1])]
    assert encode_with_history(tok, "unrelated", replayed_sequences(tok, (EOS,), record)) == encode("unrelated")
