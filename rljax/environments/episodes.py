"""Multi-turn rollouts: episodes of a batch step together, and their trajectories become rollout rows.

    episodes = run_episodes(turn_sampler(policy, sampling, key), tokenizer, make_env, examples,
                            repeats=G, max_turns=4, max_tokens=512)
    roll = episodes_rollout(episodes, repeats=G, credit="trajectory", pad_id=pad)   # rljax.rollout.Rollout
    episode_metrics(episodes)                                                        # env/* metrics

Each episode's context (its token sequence so far) is sampled for the next assistant turn, the
environment answers the turn's message (``step``, in a thread pool, so slow tools overlap), and the
answer is appended; until the episode is terminated, truncated (``max_turns`` assistant turns, or no
room for another turn of ``max_new_tokens`` within ``max_tokens``) or failed (its environment raised;
counted, the others go on). On the rollout engine (:class:`EngineTurns`) each episode advances on its
own: its next turn is queued as soon as its environment answered, so an episode waiting on a slow tool
holds no other, and the turn prefills only its new tokens. With a batch sampler (``rljax.sampling.generate``)
the unfinished episodes' contexts are left-padded into one batch per turn, all stepping together.
A trajectory never grows past ``max_tokens``: an environment reply that would leave no room for the
next turn ends its episode (truncated for tokens) without being appended.

A trajectory is one token sequence: the opening prompt, then assistant turns and the environment's
messages in order. The assistant tokens are exactly the sampled ids (never decoded and tokenised
again), with the sampler's log-probs; only the environment's messages and the chat template's glue
between turns are tokenised. That glue is the difference between the chat template's rendering of
the conversation before and after the new messages (so the template must render a conversation's
prefix as a prefix of the whole, which ChatML, Llama 3 and Qwen2.5 templates do): after a sampled
stop token (``<|im_end|>``) only the rest of the template's end of turn (``"\n"``) and the new
messages' rendering with the next assistant header follow.

Credit (``episodes_rollout``): ``"trajectory"``: one row per episode, prompt = the opening, completion
= everything after it, ``policy_mask`` = the sampled tokens only (what the loss trains on; the
environment's tokens are attended to as context), score = the episode's return (GRPO / RLOO
groups of ``repeats`` trajectories of one task; PPO's GAE skips the masked tokens). ``"turn"``
(agent-lightning, arXiv:2508.03680): one row per assistant turn, prompt = the context before it,
completion = the turn, score = the episode's return (``turn_reward="return"``) or the discounted
reward-to-go of that turn, ``Σ_{k≥t} γ^{k−t} r_k`` (``"reward_to_go"``); a group holds the turns of
its ``repeats`` episodes, padded with empty rows (``row_mask`` False) to ``repeats × max_turns`` rows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rljax.batches import pad_sequences
from rljax.buckets import bucket_length
from rljax.distributed import place_batch, to_host
from rljax.environments.base import Environment
from rljax.rewards.base import RewardOutput, reward_metrics
from rljax.rollout import Rollout, policy_states
from rljax.sampling import SamplingConfig, generate

__all__ = ["EngineTurns", "Episode", "episode_examples", "episode_metrics", "episodes_rollout", "run_episodes", "turn_sampler"]

# the sampler's output for one turn: tokens, mask, log-probs [B, N] and finished [B] (numpy)
TurnSampler = Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]


@dataclasses.dataclass
class Episode:
    """One episode's trajectory and what happened in it."""

    example: dict
    token_ids: list[int] = dataclasses.field(default_factory=list)  # opening prompt, then every turn
    policy_mask: list[int] = dataclasses.field(default_factory=list)  # 1 = sampled by the policy
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampler log-probs (0 elsewhere)
    prompt_length: int = 0  # tokens of the opening prompt
    turn_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # [start, end) of each turn
    turn_finished: list[bool] = dataclasses.field(default_factory=list)  # the turn ended with a stop token
    rewards: list[float] = dataclasses.field(default_factory=list)  # reward of each step (turn)
    messages: list[dict] = dataclasses.field(default_factory=list)  # the conversation
    status: str = "running"  # running | terminated | truncated | failed
    truncation: str = ""  # env | turns | tokens
    error: str = ""
    success: bool = False
    tool_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tool_errors: int = 0
    parse_failures: int = 0
    env_time_s: float = 0.0
    tools: list | None = None  # schemas the chat template renders (reset's info["tools"])
    env_metrics: dict = dataclasses.field(default_factory=dict)  # the latest step's info["metrics"]

    @property
    def total_return(self) -> float:
        return float(sum(self.rewards))

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)


def episode_examples(name: str, split: str, size: int, seed: int) -> list[dict]:
    """``size`` episodes of ``split`` ("train" or "eval"): ``{"prompt", "seed", "options": {"split"}}``,
    seeds ``seed * 1_000_003 + i``; the environment keeps the splits apart by seed (``calculator``
    draws each split's problems from its own part of the question space)."""
    return [{"prompt": f"{name} {split} episode {i}", "seed": seed * 1_000_003 + i, "options": {"split": split}}
            for i in range(size)]


def turn_sampler(policy, sampling: SamplingConfig, key: jax.Array, engine=None) -> "TurnSampler | EngineTurns":
    """The sampler for :func:`run_episodes`: ``rljax.sampling.generate`` with ``policy`` (an nnx
    ``Transformer`` or its split state), key ``fold_in(key, turn)`` for turn ``turn``, every episode's
    turn together; with an ``engine`` (``rljax.inference.Engine``), :class:`EngineTurns`: each
    episode on its own."""
    if engine is not None:
        return EngineTurns(engine, policy, sampling, key)

    def sample(prompt_ids, prompt_mask, turn):
        # rows split over the active mesh (rljax.distributed.place_batch), back whole on the host
        ids, mask = place_batch((prompt_ids, prompt_mask))
        out = jax.tree.map(to_host, generate(policy, ids, mask, jax.random.fold_in(key, turn), sampling))
        return out.tokens, out.mask, out.logprobs, out.finished
    return sample


def _render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _glue_text(tokenizer, episode: Episode, content: str, stop_text: str | None, new_messages: list[dict]) -> str:
    """The text after the sampled tokens of an assistant turn: the rest of the template's end of
    turn, the new messages, the next assistant header."""
    before = _render(tokenizer, episode.messages, episode.tools, True)
    history = episode.messages + [{"role": "assistant", "content": content}]
    with_turn = _render(tokenizer, history, episode.tools, False)
    after = _render(tokenizer, history + new_messages, episode.tools, True)
    if not with_turn.startswith(before) or not after.startswith(with_turn):
        raise ValueError("the chat template does not render a conversation's start as a prefix of the whole "
                         "conversation, so turns cannot be appended token by token; use a template that does "
                         "(ChatML, Llama 3, Qwen2.5)")
    turn_text = with_turn[len(before):]
    at = turn_text.find(content)
    if at < 0:  # a template that trims the content
        content = content.strip()
        at = turn_text.find(content)
    tail = turn_text[at + len(content):] if at >= 0 else ""
    if stop_text:  # the sampled stop token already closed the turn: keep what follows it
        j = tail.find(stop_text)
        tail = tail[j + len(stop_text):] if j >= 0 else tail
    return tail + after[len(with_turn):]


def _reset(make_env: Callable[[], Environment], episode: Episode, seed, options) -> Environment | None:
    t0 = time.perf_counter()
    env = None
    try:
        env = make_env()
        messages, info = env.reset(seed=seed, options=options)
        episode.messages = [dict(m) for m in messages]
        episode.tools = (info or {}).get("tools")
    except Exception as exc:  # a broken environment ends this episode only
        episode.status, episode.error = "failed", f"reset: {type(exc).__name__}: {exc}"
        _close(env)
        env = None
    episode.env_time_s += time.perf_counter() - t0
    return env


def _step(env: Environment, episode: Episode, content: str) -> list[dict] | None:
    """``env.step``; the new messages when the episode goes on, else None."""
    t0 = time.perf_counter()
    new_messages = None
    try:
        messages, reward, terminated, truncated, info = env.step(content)
        info = info or {}
        episode.rewards.append(float(reward))
        episode.tool_calls.update(info.get("tool_calls", ()))
        episode.tool_errors += int(info.get("tool_errors", 0))
        episode.parse_failures += int(info.get("parse_failures", 0))
        episode.env_metrics.update({str(k): float(v) for k, v in (info.get("metrics") or {}).items()})
        if terminated or truncated:
            episode.status = "terminated" if terminated else "truncated"
            episode.truncation = "" if terminated else "env"
            episode.success = bool(info.get("success", False))
            episode.messages.append({"role": "assistant", "content": content})
            episode.messages += [dict(m) for m in messages]
        else:
            new_messages = [dict(m) for m in messages]
    except Exception as exc:
        episode.status, episode.error = "failed", f"step {episode.num_turns}: {type(exc).__name__}: {exc}"
    episode.env_time_s += time.perf_counter() - t0
    return new_messages


def _append_reply(tokenizer, episode: Episode, content: str, stop_text: str | None, new_messages: list[dict], *,
                  room: int) -> None:
    """Append the environment's reply (and the template's glue) as context tokens, if the trajectory
    then still has ``room`` tokens at most (``max_tokens - max_new_tokens``: space for the next turn).

    Otherwise the episode ends here, truncated for tokens, without the reply's tokens: they would
    come after its last sampled token, so they change no log-prob, value or loss, and their number
    is the environment's to choose, not the budget's (a tool echoing a 1 MB program output is 300 k
    tokens; appended, one such trajectory made a code-agent update program of SmolLM2-135M ask for
    285 GB). The messages keep the reply, for the samples log.
    """
    glue = _encode(tokenizer, _glue_text(tokenizer, episode, content, stop_text, new_messages))
    episode.messages += [{"role": "assistant", "content": content}] + new_messages
    if len(episode.token_ids) + len(glue) > room:
        episode.status, episode.truncation = "truncated", "tokens"
        return
    episode.token_ids += glue
    episode.policy_mask += [0] * len(glue)
    episode.logprobs += [0.0] * len(glue)


def _close(env) -> None:
    if env is not None:
        try:
            env.close()
        except Exception:
            pass


def run_episodes(sampler: TurnSampler, tokenizer: Any, make_env: Callable[[], Environment],
                 examples: Sequence[dict], *, repeats: int = 1, max_turns: int, max_tokens: int,
                 max_new_tokens: int, pad_id: int, workers: int = 8) -> list[Episode]:
    """Run ``repeats`` episodes of each example (``example["seed"]`` and ``example.get("options")``
    go to ``reset``), example-major; see the module docstring.

    ``sampler(prompt_ids, prompt_mask, turn)``: one assistant turn for a left-padded batch
    (:func:`turn_sampler`), generating at most ``max_new_tokens``; its stop token is the last
    sampled token of a finished turn. ``workers`` threads call the environments.
    """
    episodes = [Episode(example=dict(ex)) for ex in examples for _ in range(repeats)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        # the environments run in the pool; the tokenizer only here (a fast tokenizer is not thread-safe)
        envs = list(pool.map(lambda e: _reset(make_env, e, e.example.get("seed"), e.example.get("options")),
                             episodes))
        for e in episodes:
            if e.status == "running":
                e.token_ids = _encode(tokenizer, _render(tokenizer, e.messages, e.tools, True))
            e.prompt_length = len(e.token_ids)
            e.policy_mask, e.logprobs = [0] * e.prompt_length, [0.0] * e.prompt_length
            if e.status == "running" and e.prompt_length + max_new_tokens > max_tokens:
                raise ValueError(f"the opening prompt of episode seed={e.example.get('seed')} is {e.prompt_length} "
                                 f"tokens, leaving no room for a turn of {max_new_tokens} tokens within "
                                 f"max_tokens={max_tokens}; raise environment.max_tokens")
        if isinstance(sampler, EngineTurns):
            _run_on_engine(sampler, tokenizer, episodes, envs, pool, max_turns=max_turns, max_tokens=max_tokens,
                           max_new_tokens=max_new_tokens)
        else:
            _run_in_lock_step(sampler, tokenizer, episodes, envs, pool, max_turns=max_turns, max_tokens=max_tokens,
                              max_new_tokens=max_new_tokens, pad_id=pad_id)
    for env in envs:
        _close(env)
    return episodes


def _may_continue(e: Episode, *, max_turns: int, max_tokens: int, max_new_tokens: int) -> bool:
    """Whether a running episode gets another turn; else it is truncated (by turns or tokens)."""
    if e.num_turns >= max_turns or len(e.token_ids) + max_new_tokens > max_tokens:
        e.status, e.truncation = "truncated", "turns" if e.num_turns >= max_turns else "tokens"
        return False
    return True


def _record_turn(tokenizer, e: Episode, sampled: list[int], logprobs, finished: bool) -> tuple[str, str | None]:
    """Append a sampled turn to the trajectory; its text and the text of its stop token (if it stopped)."""
    start, n = len(e.token_ids), len(sampled)
    e.token_ids += sampled
    e.policy_mask += [1] * n
    e.logprobs += [float(x) for x in logprobs]
    e.turn_spans.append((start, start + n))
    e.turn_finished.append(bool(finished))
    stop_text = tokenizer.decode(sampled[-1:], skip_special_tokens=False) if finished and n else None
    return tokenizer.decode(sampled, skip_special_tokens=True), stop_text


def _run_in_lock_step(sampler, tokenizer, episodes, envs, pool, *, max_turns, max_tokens, max_new_tokens, pad_id):
    """One turn for the whole batch at a time (a batch sampler such as the static one)."""
    turn = 0
    while True:
        live = [i for i, e in enumerate(episodes) if e.status == "running" and
                _may_continue(e, max_turns=max_turns, max_tokens=max_tokens, max_new_tokens=max_new_tokens)]
        if not live:
            break
        ids, mask = pad_sequences([episodes[i].token_ids for i in live], side="left", pad_id=pad_id)
        tokens, tmask, logprobs, finished = sampler(ids, mask, turn)
        jobs = []
        for row, i in enumerate(live):
            e, n = episodes[i], int(tmask[row].sum())
            content, stop_text = _record_turn(tokenizer, e, [int(t) for t in tokens[row, :n]], logprobs[row, :n],
                                              finished[row])
            jobs.append((pool.submit(_step, envs[i], e, content), e, content, stop_text))
        for job, e, content, stop_text in jobs:
            new_messages = job.result()
            if new_messages is not None:
                _append_reply(tokenizer, e, content, stop_text, new_messages, room=max_tokens - max_new_tokens)
        turn += 1


class EngineTurns:
    """The turns of :func:`run_episodes` on a rollout engine (``rljax.inference.Engine``), given
    ``policy``'s weights: each episode advances on its own (its next turn is queued as soon as its
    environment answered; an episode waiting on a slow tool holds no other), and its next turn
    prefills only the new tokens (the conversation so far is in the engine's cached pages). Episode
    ``i``'s turn ``t`` samples with a seed drawn from ``fold_in(fold_in(key, i), t)``."""

    def __init__(self, engine, policy, sampling: SamplingConfig, key: jax.Array):
        self.engine, self.policy, self.sampling, self.key = engine, policy, sampling, key

    def request(self, episode: int, turn: int, prompt_ids: list[int]):
        from rljax.inference import Request
        from rljax.inference.batch import request_seeds

        s = self.sampling
        seed = int(request_seeds(jax.random.fold_in(jax.random.fold_in(self.key, episode), turn), 1)[0])
        return Request(prompt_ids=prompt_ids, max_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p, stop_token_ids=() if s.ignore_eos else tuple(s.stop_token_ids), seed=seed)


def _run_on_engine(turns: EngineTurns, tokenizer, episodes, envs, pool, *, max_turns, max_tokens, max_new_tokens):
    """Every episode's turns through the engine, each episode on its own (see :class:`EngineTurns`)."""
    engine = turns.engine
    engine.set_weights(policy_states(turns.policy))
    in_engine: dict[int, int] = {}  # request id -> episode index
    at_env: dict[concurrent.futures.Future, tuple] = {}

    def next_turn(i: int) -> None:
        e = episodes[i]
        if e.status == "running" and _may_continue(e, max_turns=max_turns, max_tokens=max_tokens,
                                                   max_new_tokens=max_new_tokens):
            in_engine[engine.submit(turns.request(i, e.num_turns, list(e.token_ids)))] = i

    for i in range(len(episodes)):
        next_turn(i)
    while in_engine or at_env:
        for out in engine.step() if in_engine else []:
            i = in_engine.pop(out.request_id)
            e = episodes[i]
            content, stop_text = _record_turn(tokenizer, e, out.token_ids, out.logprobs, out.finish_reason == "stop")
            at_env[pool.submit(_step, envs[i], e, content)] = (i, content, stop_text)
        # environments that answered (all of them, blocking, when nothing is left to decode)
        done = [f for f in at_env if f.done()] if in_engine else \
            concurrent.futures.wait(list(at_env), return_when=concurrent.futures.FIRST_COMPLETED).done
        for f in done:
            i, content, stop_text = at_env.pop(f)
            new_messages = f.result()
            if new_messages is not None:
                _append_reply(tokenizer, episodes[i], content, stop_text, new_messages, room=max_tokens - max_new_tokens)
            next_turn(i)


def episode_metrics(episodes: Sequence[Episode], *, prefix: str = "env/") -> dict[str, float]:
    """Per-step metrics: ``success_rate``, ``turns`` (assistant turns per episode), ``tool_calls``
    and ``tool_calls/<tool>`` (per episode), ``tool_errors``, ``parse_failures`` (per episode),
    ``truncated`` (fraction; ``truncated/turns``, ``/tokens``, ``/env`` by cause), ``failed`` (count of
    episodes whose environment raised), ``tokens_generated`` (per episode), ``time_s`` (environment
    time summed over episodes; threads overlap it); and each ``<name>`` of the environments'
    ``info["metrics"]`` (its latest value per episode, averaged over the episodes that report it)."""
    n = max(len(episodes), 1)
    m = {
        "success_rate": sum(e.success for e in episodes) / n,
        "return": sum(e.total_return for e in episodes) / n,
        "turns": sum(e.num_turns for e in episodes) / n,
        "tool_calls": sum(sum(e.tool_calls.values()) for e in episodes) / n,
        "tool_errors": sum(e.tool_errors for e in episodes) / n,
        "parse_failures": sum(e.parse_failures for e in episodes) / n,
        "truncated": sum(e.status == "truncated" for e in episodes) / n,
        "failed": float(sum(e.status == "failed" for e in episodes)),
        "tokens_generated": sum(sum(e.policy_mask) for e in episodes) / n,
        "time_s": sum(e.env_time_s for e in episodes),
    }
    for cause in ("turns", "tokens", "env"):
        m[f"truncated/{cause}"] = sum(e.truncation == cause for e in episodes) / n
    for name in sorted({t for e in episodes for t in e.tool_calls}):
        m[f"tool_calls/{name}"] = sum(e.tool_calls[name] for e in episodes) / n
    for name in sorted({k for e in episodes for k in e.env_metrics} - set(m)):
        values = [e.env_metrics[name] for e in episodes if name in e.env_metrics]
        m[name] = sum(values) / len(values)  # over the episodes that report it
    return {prefix + k: float(v) for k, v in m.items()}


def _summary(e: Episode) -> dict:
    return {"status": e.status, "truncation": e.truncation, "error": e.error, "turns": e.num_turns,
            "return": e.total_return, "success": e.success, "tool_calls": dict(e.tool_calls),
            "messages": e.messages}


def episodes_rollout(episodes: Sequence[Episode], tokenizer: Any, *, repeats: int, pad_id: int,
                     credit: str = "trajectory", max_turns: int | None = None, turn_reward: str = "return",
                     gamma: float = 1.0) -> Rollout:
    """The :class:`rljax.rollout.Rollout` the trainers consume (see the module docstring for
    ``credit``). ``per_function`` holds ``environment`` (the row's score) and ``success`` (0/1), NaN
    for failed episodes, which are left out of the loss (``row_mask`` False). ``finished``: the
    episode terminated (trajectory) / the turn ended with a stop token (turn). Widths are bucketed
    (``rljax.buckets``) so the update compiles a bounded number of programs."""
    if credit not in ("trajectory", "turn"):
        raise ValueError(f"credit must be 'trajectory' or 'turn', got {credit!r}")
    if turn_reward not in ("return", "reward_to_go"):
        raise ValueError(f"turn_reward must be 'return' or 'reward_to_go', got {turn_reward!r}")
    rows = []  # (prompt ids, completion ids, policy mask, logprobs, score, success, valid, finished, example, text)
    if credit == "trajectory":
        for e in episodes:
            p, c = e.prompt_length, slice(e.prompt_length, None)
            ok = e.status != "failed"
            rows.append((e.token_ids[:p], e.token_ids[c], e.policy_mask[c], e.logprobs[c], e.total_return,
                         float(e.success), ok, e.status == "terminated", e.example, e))
    else:
        if max_turns is None:
            raise ValueError("credit='turn' needs max_turns (each group is padded to repeats × max_turns rows)")
        for g in range(0, len(episodes), repeats):
            group = []
            for e in episodes[g:g + repeats]:
                ok = e.status != "failed"
                credit_t = _turn_credit(e.rewards, e.num_turns, turn_reward, gamma)
                for t, (s, end) in enumerate(e.turn_spans):
                    group.append((e.token_ids[:s], e.token_ids[s:end], e.policy_mask[s:end], e.logprobs[s:end],
                                  credit_t[t], float(e.success), ok, e.turn_finished[t], dict(e.example, turn=t), e))
            group += [([pad_id], [], [], [], 0.0, 0.0, False, False, dict(episodes[g].example, padding=True), None)
                      ] * (repeats * max_turns - len(group))
            rows += group
    # an episode whose reset failed has no tokens: one padding token keeps its row attendable
    prompts = [r[0] or [pad_id] for r in rows]
    P = bucket_length(max(len(p) for p in prompts), 16)
    N = bucket_length(max([len(r[1]) for r in rows] + [1]), 16)
    prompt_ids, prompt_mask = pad_sequences(prompts, side="left", pad_id=pad_id, width=P)
    completion_ids, completion_mask = pad_sequences([r[1] for r in rows], side="right", pad_id=pad_id, width=N)
    policy_mask, _ = pad_sequences([r[2] for r in rows], side="right", pad_id=0, width=N)
    logprobs = np.zeros((len(rows), N), np.float32)
    for i, r in enumerate(rows):
        logprobs[i, :len(r[3])] = r[3]
    valid = np.array([r[6] for r in rows], bool)
    scores = np.where(valid, np.array([r[4] for r in rows], np.float32), 0.0).astype(np.float32)
    per_function = {"environment": np.where(valid, scores, np.nan).astype(np.float64),
                    "success": np.where(valid, [r[5] for r in rows], np.nan).astype(np.float64)}
    texts = [tokenizer.decode(r[1], skip_special_tokens=False) for r in rows]
    examples = [dict(r[8], completion_length=len(r[1]), completion_ids=list(r[1]),
                     **({"episode": _summary(r[9])} if r[9] is not None else {})) for r in rows]
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                   completion_mask=completion_mask, logprobs=logprobs, finished=np.array([r[7] for r in rows], bool),
                   texts=texts, examples=examples, scores=scores, row_mask=valid, per_function=per_function,
                   reward_metrics=reward_metrics(RewardOutput(scores.astype(np.float64), per_function, ~valid)),
                   policy_mask=policy_mask)


def _turn_credit(rewards: list[float], turns: int, turn_reward: str, gamma: float) -> list[float]:
    """Each turn's score: the episode's return, or ``Σ_{k≥t} γ^{k−t} r_k``."""
    rewards = list(rewards) + [0.0] * (turns - len(rewards))  # a failed step has no reward
    if turn_reward == "return":
        return [float(sum(rewards))] * turns
    out, running = [0.0] * turns, 0.0
    for t in reversed(range(turns)):
        running = rewards[t] + gamma * running
        out[t] = running
    return out
