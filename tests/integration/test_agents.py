"""Agents written against the real ``openai`` client, served by a tiny model in-process: a traced
two-call episode equals the same conversation through ``rljax.environments`` (tokens, log-probs, loss
mask), join vs rewrite through the server, failing agents, and GRPO runs with ``environment: {type: agent}``."""

import json
import os

import jax
import numpy as np
import openai
import pytest

from rljax.agents import AgentServer, run_agent_episodes
from rljax.config import from_yaml
from rljax.environments import build_environment
from rljax.environments.episodes import episode_examples, run_episodes, turn_sampler
from rljax.errors import UserError
from rljax.inference import Engine
from rljax.inference.batch import request_seeds
from rljax.models import load
from rljax.run_config import RunConfig
from rljax.sampling import SamplingConfig
from rljax.training import OnlineTrainer
from rljax.training.online import rollout_batch

EOS = 2
N = 8  # max_new_tokens
SYSTEM, FIRST, SECOND = "Answer in lowercase.", "Reply.", "Again."  # the toy environment's conversation


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model, tok = load(tiny_dir)[:2]
    return model, tok


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    s = AgentServer(Engine(model, max_slots=4, page_size=8), tok, stop_token_ids=(EOS,))
    yield s
    s.close()


def _toy_agent(task, client):
    """The toy environment's two turns, written against the openai client (seeds from the task)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    r = client.chat.completions.create(model="gpt-4o-mini", messages=messages, seed=task["seeds"][0], max_tokens=N)
    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": SECOND}]
    client.chat.completions.create(model="gpt-4o-mini", messages=messages, seed=task["seeds"][1], max_tokens=N)
    return 0.5


def test_a_traced_two_call_episode_equals_the_same_conversation_through_environments(tiny, server):
    model, tok = tiny
    sampling = SamplingConfig(max_new_tokens=N, temperature=1.0, stop_token_ids=(EOS,), pad_token_id=EOS)
    key = jax.random.key(3)
    episodes = run_episodes(turn_sampler(model, sampling, key, engine=Engine(model, max_slots=4, page_size=8)), tok,
                            lambda: build_environment("toy", {"turns": 2}), episode_examples("toy", "train", 3, 0),
                            max_turns=2, max_tokens=256, max_new_tokens=N, pad_id=EOS)
    # the engine seeds of rljax.environments.episodes.EngineTurns: episode i, turn t
    seeds = [[int(request_seeds(jax.random.fold_in(jax.random.fold_in(key, i), t), 1)[0]) for t in range(2)]
             for i in range(3)]
    traced = run_agent_episodes(_toy_agent, [{"seeds": s} for s in seeds], server=server, concurrency=3,
                                temperature=1.0)
    text = [tok.decode(e.token_ids[e.prompt_length:]) for e in episodes]
    # the random model's replies hold bytes of unfinished characters and special tokens the reply's text
    # leaves out: re-encoding the text sent back would not give the sampled ids, the server keeps them
    assert any("\ufffd" in t for t in text) and any("<|endoftext|>" in t for t in text), text
    for env_episode, agent_episode in zip(episodes, traced):
        assert not agent_episode.failed and [len(c.choices) for c in agent_episode.calls] == [1, 1]
        [joined] = agent_episode.transitions  # one sequence: the second call extended the first
        assert joined.token_ids == env_episode.token_ids
        assert joined.policy_mask == env_episode.policy_mask and joined.prompt_length == env_episode.prompt_length
        assert joined.turn_spans == env_episode.turn_spans
        np.testing.assert_allclose(joined.logprobs, env_episode.logprobs, rtol=0, atol=1e-5)
        # and what was recorded is what the client got back
        first = agent_episode.calls[0]
        assert first.choices[0].token_ids == env_episode.token_ids[slice(*env_episode.turn_spans[0])]


def test_an_agent_that_rewrites_its_history_gives_transitions_and_async_agents_work(server):
    async def summarising(task, client):  # an AsyncOpenAI client: a coroutine function gets one
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "plan"}], max_tokens=4)
        note = f"notes: {len(r.choices[0].model_extra['token_ids'])} tokens"  # keeps its own history
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": note}], max_tokens=4)
        return 1.0

    def continuing(task, client):
        messages = [{"role": "user", "content": "plan"}]
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "user", "content": "go on"})
        client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        return 0.0

    [rewriter] = run_agent_episodes(summarising, [{}], server=server, seed=1)
    [joiner] = run_agent_episodes(continuing, [{}], server=server, seed=1)
    assert not rewriter.failed and len(rewriter.calls) == 2 and len(rewriter.transitions) == 2
    for call, transition in zip(rewriter.calls, rewriter.transitions):  # each: its prompt as context, its reply
        n = len(call.prompt_token_ids)
        assert transition.token_ids == call.prompt_token_ids + call.choices[0].token_ids
        assert transition.policy_mask == [0] * n + [1] * len(call.choices[0].token_ids)
    assert len(joiner.transitions) == 1 and sum(joiner.transitions[0].policy_mask) == joiner.sampled_tokens
    # the first calls are the same request with the same seed (episode seed 1, call 0): the same tokens
    assert rewriter.calls[0].choices[0].token_ids == joiner.calls[0].choices[0].token_ids
    assert rewriter.calls[0].request["seed"] == joiner.calls[0].request["seed"]
    assert rewriter.calls[1].request["seed"] != rewriter.calls[0].request["seed"]
    assert all(c.request["model"] == "policy" for c in rewriter.calls + joiner.calls)  # any model name is served


def test_an_agent_that_raises_is_counted_and_dropped_and_the_others_go_on(server, tiny):
    _, tok = tiny

    def flaky(task, client):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        if task["fail"] == "raise":
            raise RuntimeError("the agent's own bug")
        if task["fail"] == "temperature":  # a training episode samples at the run's temperature only
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.3)
        if task["fail"] == "returns":
            return "great"
        return len(r.choices[0].model_extra["token_ids"]) / 3

    tasks = [{"fail": f} for f in ("", "raise", "temperature", "returns", "")]
    episodes = run_agent_episodes(flaky, tasks, server=server, concurrency=5, temperature=1.0, strict=True)
    assert [e.failed for e in episodes] == [False, True, True, True, False]
    assert "RuntimeError: the agent's own bug" == episodes[1].error
    assert "BadRequestError" in episodes[2].error and "sampling.temperature=1.0" in episodes[2].error
    assert "must return a number or None" in episodes[3].error
    assert [len(e.calls) for e in episodes] == [1, 1, 1, 1, 1]  # the refused call was not recorded
    assert episodes[0].reward == len(episodes[0].calls[0].choices[0].token_ids) / 3  # what the agent returned

    from rljax.agents import agent_metrics, agent_rollout
    roll = agent_rollout(episodes, tok, repeats=5, max_transitions=1, pad_id=EOS)
    assert roll.row_mask.tolist() == [True, False, False, False, True]
    batch = rollout_batch(roll, mask_truncated=False)
    loss_mask = np.asarray(batch.loss_mask)
    assert loss_mask[[1, 2, 3]].sum() == 0
    assert loss_mask[0].sum() == episodes[0].sampled_tokens and loss_mask[4].sum() == episodes[4].sampled_tokens
    assert agent_metrics(episodes)["agent/failed_episodes"] == 3

    # an episode's route ends with it; an unknown one is refused
    client = openai.OpenAI(base_url=server.base_url("no-such-episode"), api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no open episode"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


AGENT = '''
def run(task, client):
    """Reply to the task; the reward is the share of lowercase letters (None: left to the run's rewards
    on tasks whose prompt holds "leave")."""
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": task["prompt"]}])
    text = r.choices[0].message.content or ""
    return None if "leave" in task["prompt"] else sum(c.islower() for c in text) / max(len(text), 1)


def reply_length(prompts, completions, completion_ids, **columns):
    return [len(ids) / 10 for ids in completion_ids]
'''


def _agent_cfg(tiny_dir, tmp_path, steps, data=None, rewards=None, **environment):
    path = tmp_path / "lower_agent.py"
    path.write_text(AGENT)
    env = {"type": "agent", "function": f"{path}:run", "concurrency": 16, "max_tokens": 96, **environment}
    data = data or {"task": "addition", "train_size": 64, "eval_size": 0, "max_prompt_length": 64}
    return from_yaml(RunConfig, f"""
model: {{name: {tiny_dir}}}
data: {json.dumps(data)}
sampling: {{max_new_tokens: 6, max_slots: 16, page_size: 8}}
environment: {json.dumps(env)}
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 4}}
optim: {{learning_rate: 2.0e-2}}
train: {{steps: {steps}, run_dir: {tmp_path / 'run'}, progress: false, samples_every: null, save_model: false}}
rewards: {json.dumps(rewards or {})}
""")


def test_grpo_with_an_agent_updates_the_policy_the_server_then_serves(tiny_dir, tmp_path):
    trainer = OnlineTrainer(_agent_cfg(tiny_dir, tmp_path, steps=2))
    before = jax.tree.map(np.asarray, trainer.run.policy.params)
    m0 = trainer.step_once()
    episodes = trainer.agents.last_episodes
    assert m0["agent/episodes"] == 16 and m0["agent/failed_episodes"] == 0 and m0["agent/calls_per_episode"] == 1
    assert m0["agent/stale_calls"] == 0 and all(c.policy_version == 0 for e in episodes for c in e.calls)
    assert 0 < m0["agent/tokens_per_episode"] <= 6 and np.isfinite(m0["loss"])
    rewards = np.array([e.reward for e in episodes])
    np.testing.assert_allclose(trainer.last_rollouts.scores, rewards.astype(np.float32), rtol=0, atol=0)
    after = jax.tree.map(np.asarray, trainer.run.policy.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    # the next step's calls are served by the updated weights, as policy version 1: the engine's
    # log-probs are the new policy's (the trainer's forward pass on the same tokens agrees)
    m1 = trainer.step_once()
    episodes = trainer.agents.last_episodes
    assert m1["agent/stale_calls"] == 0 and all(c.policy_version == c.policy_version_end == 1
                                                for e in episodes for c in e.calls)
    from rljax.training.online import score_logprobs
    roll = trainer.last_rollouts
    batch = rollout_batch(roll, mask_truncated=False)
    new = np.asarray(score_logprobs(trainer.run.policy.graphdef, jax.tree.map(np.asarray, after),
                                    trainer.run.policy.frozen, batch, temperature=1.0))
    trained = np.asarray(batch.loss_mask) == 1
    np.testing.assert_allclose(new[trained], roll.logprobs[trained], rtol=0, atol=1e-5)
    trainer.agents.close()


@pytest.mark.slow
def test_grpo_with_an_agent_raises_its_reward(tiny_dir, tmp_path):
    OnlineTrainer(_agent_cfg(tiny_dir, tmp_path, steps=12)).fit()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        steps = [m for m in map(json.loads, f) if "loss" in m]
    returns = [m["agent/return"] for m in steps]
    assert np.mean(returns[-3:]) > np.mean(returns[:3]) + 0.2, returns


def test_where_the_agent_returns_none_the_runs_rewards_score_its_last_reply(tiny_dir, tmp_path):
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{'leave' if i % 2 else 'say'} {i}"}) + "\n" for i in range(8)))
    held = tmp_path / "held_out.jsonl"
    held.write_text(json.dumps({"prompt": "say 100"}) + "\n" + json.dumps({"prompt": "leave 101"}) + "\n")
    cfg = _agent_cfg(tiny_dir, tmp_path, steps=1, data={"path": str(rows), "eval_path": str(held), "train_size": 8},
                     rewards={"length": {"type": "python", "function": f"{tmp_path}/lower_agent.py:reply_length"}})
    trainer = OnlineTrainer(cfg)
    metrics = trainer.step_once()
    episodes = trainer.agents.last_episodes
    left = [e for e in episodes if "leave" in e.task["prompt"]]
    assert 0 < len(left) < len(episodes) == 16 and metrics["agent/failed_episodes"] == 0
    assert metrics["agent/scored_by_rewards"] == len(left) / 16
    for e in episodes:
        if "leave" in e.task["prompt"]:
            assert e.returned is None and e.scored_by == "rewards"
            assert e.reward == len(e.calls[-1].choices[0].token_ids) / 10
        else:
            assert e.scored_by == "agent" and e.reward == e.returned is not None
    np.testing.assert_array_equal(trainer.last_rollouts.scores, np.float32([e.reward for e in episodes]))
    # evaluation: one episode per held-out task, greedy, at the updated policy's version
    results = trainer.evaluate()
    held_out = trainer.agents.last_episodes
    assert results["eval/agent/episodes"] == 2 == len(held_out) and results["eval/agent/stale_calls"] == 0
    assert [e.task["prompt"] for e in held_out] == ["say 100", "leave 101"] and held_out[1].scored_by == "rewards"
    assert all(c.request["temperature"] == 0.0 and c.policy_version == 1 for e in held_out for c in e.calls)
    np.testing.assert_allclose(results["eval/environment"], np.mean([e.reward for e in held_out]), rtol=1e-6)
    trainer.agents.close()


def test_a_bad_agent_is_refused_before_step_0(tiny_dir, tmp_path):
    with pytest.raises(UserError, match="environment.function: .*no such file"):
        OnlineTrainer(_agent_cfg(tiny_dir, tmp_path, steps=1, function=f"{tmp_path}/nope.py:run"))
    (tmp_path / "two.py").write_text("def run(task):\n    return 1.0\n")
    with pytest.raises(UserError, match=r"environment.function: .*cannot be called as run\(task, client\)"):
        OnlineTrainer(_agent_cfg(tiny_dir, tmp_path, steps=1, function=f"{tmp_path}/two.py:run"))
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
