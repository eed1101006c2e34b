"""Running agent code for episodes and turning what it did into training rows.

    agent = load_agent("my_agent.py:run")                       # run(task, client) -> float | None (or async)
    episodes = run_agent_episodes(agent, tasks, server=server, repeats=G, concurrency=16, seed=s,
                                  temperature=1.0, max_tokens=64)
    roll = agent_rollout(episodes, tokenizer, repeats=G, max_transitions=1, pad_id=pad)   # rljax.rollout.Rollout
    agent_metrics(episodes)                                      # agent/* metrics

Each episode calls ``run(dict(task), client)`` in a thread of a pool of ``concurrency`` threads with a
client of its own (``openai.OpenAI``, or ``openai.AsyncOpenAI`` in an event loop of the thread's when
``run`` is a coroutine function) whose calls the :class:`~rljax.agents.server.AgentServer` records.
An agent that raises (or returns something other than a finite number or None) fails its episode: it
is counted and its rows are left out of the loss (``row_mask`` False), and the other episodes go on.
The episode's calls become transitions by :func:`rljax.agents.trajectory.assemble`; each carries the
episode's reward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import math
import time
from typing import Any, Callable, Sequence

import numpy as np

from rljax.agents.server import AgentServer
from rljax.agents.trajectory import assemble
from rljax.environments.episodes import Episode, episodes_rollout
from rljax.errors import UserError
from rljax.plugins import load_object
from rljax.rollout import Rollout

__all__ = ["AgentEpisode", "agent_metrics", "agent_rollout", "load_agent", "run_agent_episodes", "score_episodes"]


@dataclasses.dataclass
class AgentEpisode:
    """One run of the agent on one task: what it returned, its recorded calls and its transitions."""

    task: dict
    reward: float | None = None  # the agent's return value, or the rewards' score when it returned None
    returned: float | None = None  # what the agent returned
    error: str = ""  # why the episode failed ("" when it did not)
    calls: list = dataclasses.field(default_factory=list)  # rljax.serve.CallRecord, in the order they began
    transitions: list[Episode] = dataclasses.field(default_factory=list)
    dropped_transitions: int = 0  # beyond max_transitions (the earliest are dropped)
    seconds: float = 0.0
    scored_by: str = "agent"  # agent | rewards

    @property
    def failed(self) -> bool:
        return bool(self.error)

    @property
    def sampled_tokens(self) -> int:
        return sum(len(c.token_ids) for call in self.calls for c in call.choices)

    @property
    def final_text(self) -> str:
        """The text of the agent's last reply (its answer), for rewards that score one."""
        for call in reversed(self.calls):
            if call.choices:
                return call.choices[0].text
        return ""

    @property
    def transcript(self) -> str:
        """The whole episode as text, for a judge that scores trajectories (RULER): every message the
        agent sent and every reply with its tool calls, in call order. A call that continues the
        conversation so far adds only its new messages; one whose history the agent rewrote starts a
        new section (``[call k: the agent rewrote its history]``) with all its messages."""
        lines: list[str] = []
        shown: list[dict] = []
        for k, call in enumerate(self.calls):
            messages = [_plain(m) for m in call.request.get("messages", [])] or [
                _plain({"role": "user", "content": str(call.request.get("prompt", ""))})]
            if shown and messages[:len(shown)] == shown:
                new = messages[len(shown):]
            else:
                if shown:
                    lines.append(f"[call {k + 1}: the agent rewrote its history]")
                new = messages
            lines += [_line(m) for m in new]
            reply = _reply(call)
            lines.append(_line(reply))
            shown = messages + [reply]
        return "\n".join(lines)


def load_agent(spec: str, *, where: str = "environment.function") -> Callable:
    """The agent ``spec`` names (``file.py:run`` or ``module:run``), checked to take ``(task, client)``."""
    agent = load_object(spec, where=where, what="agent function")
    if not callable(agent):
        raise UserError(f"{where}: {spec!r} is a {type(agent).__name__}, not a function run(task, client)")
    try:
        inspect.signature(agent).bind({}, None)
    except TypeError as exc:
        raise UserError(f"{where}: {spec!r} cannot be called as run(task, client): {exc}") from None
    except ValueError:  # a builtin without a signature: let the call tell
        pass
    return agent


def _returned(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"the agent returned {type(value).__name__} {value!r:.80}; it must return a number or None")
    if not math.isfinite(float(value)):
        raise ValueError(f"the agent returned {value!r}; a reward must be finite")
    return float(value)


def _call_agent(agent: Callable, task: dict, base_url: str, timeout: float) -> Any:
    import openai

    if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None)):
        async def run_async():
            async with openai.AsyncOpenAI(base_url=base_url, api_key="rljax", max_retries=0, timeout=timeout) as client:
                return await agent(task, client)
        return asyncio.run(run_async())
    with openai.OpenAI(base_url=base_url, api_key="rljax", max_retries=0, timeout=timeout) as client:
        return agent(task, client)


def _one_episode(agent, server: AgentServer, episode: AgentEpisode, *, seed: int, temperature, top_p, max_tokens,
                 strict: bool, timeout: float, max_sequence_tokens: int | None, max_transitions: int | None) -> None:
    t0 = time.perf_counter()
    eid = server.open_episode(seed=seed, temperature=temperature, top_p=top_p, max_tokens=max_tokens, strict=strict)
    try:
        episode.returned = _returned(_call_agent(agent, dict(episode.task), server.base_url(eid), timeout))
    except Exception as exc:  # noqa: BLE001 -- the agent's failure ends its episode only
        episode.error = f"{type(exc).__name__}: {exc}"
    finally:
        episode.calls = server.close_episode(eid)
    episode.reward = episode.returned
    if not episode.failed:
        try:
            episode.transitions = assemble(episode.calls, example=episode.task, max_tokens=max_sequence_tokens)
        except ValueError as exc:
            episode.error = f"{type(exc).__name__}: {exc}"
        if not episode.calls:
            episode.error = "the agent made no call to the policy (nothing to train on)"
    if max_transitions is not None and len(episode.transitions) > max_transitions:
        episode.dropped_transitions = len(episode.transitions) - max_transitions
        episode.transitions = episode.transitions[-max_transitions:]
    episode.seconds = time.perf_counter() - t0


def run_agent_episodes(agent: Callable, tasks: Sequence[dict], *, server: AgentServer, repeats: int = 1,
                       concurrency: int = 16, seed: int = 0, temperature: float | None = None,
                       top_p: float | None = None, max_tokens: int | None = None, strict: bool = False,
                       timeout: float = 600.0, max_sequence_tokens: int | None = None,
                       max_transitions: int | None = None) -> list[AgentEpisode]:
    """``repeats`` episodes of each task (task-major), at most ``concurrency`` at once.

    Episode ``i`` draws its calls' seeds from ``seed`` and ``i`` (:class:`AgentServer`); ``temperature``,
    ``top_p``, ``max_tokens`` and ``strict`` are its sampling settings there. ``timeout``: seconds per
    call. ``max_sequence_tokens``: each transition's length limit; ``max_transitions``: the most an
    episode keeps (its last ones)."""
    episodes = [AgentEpisode(task=dict(t)) for t in tasks for _ in range(repeats)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="rljax-agent") as pool:
        jobs = [pool.submit(_one_episode, agent, server, e, seed=(seed * 1_000_003 + i) % 2 ** 31,
                            temperature=temperature, top_p=top_p, max_tokens=max_tokens, strict=strict, timeout=timeout,
                            max_sequence_tokens=max_sequence_tokens, max_transitions=max_transitions)
                for i, e in enumerate(episodes)]
        for job in jobs:
            job.result()
    return episodes


def score_episodes(episodes: Sequence[AgentEpisode], rewards) -> None:
    """Give the episodes whose agent returned None the score of ``rewards`` (a ``rljax.rewards``
    ``RewardSet``); without ``rewards`` such an episode fails. Every unfailed episode is shown to
    ``rewards``: the completion is its last reply (what ``answer`` or ``python`` rewards check), the
    example its task with the reply's ``completion_ids`` and the episode's ``trajectory``
    (:attr:`AgentEpisode.transcript`), which a judge scores instead of the last reply, so a judge in
    ``group`` mode compares the whole episodes of one task side by side, as RULER does. A task without
    a ``prompt`` is shown with its JSON as the prompt (what groups the episodes of one task)."""
    unscored = [e for e in episodes if not e.failed and e.returned is None]
    if not unscored:
        return
    if rewards is None:
        for e in unscored:
            e.error = "the agent returned None and the run has no rewards to score it (set rewards, e.g. a judge)"
        return
    shown = [e for e in episodes if not e.failed]
    last = [e.calls[-1].choices[0].token_ids if e.calls and e.calls[-1].choices else [] for e in shown]
    examples = [dict(e.task, completion_ids=list(ids), completion_length=len(ids), trajectory=e.transcript)
                for e, ids in zip(shown, last)]
    for ex, e in zip(examples, shown):
        ex.setdefault("prompt", json.dumps(e.task, sort_keys=True, default=str))
    out = rewards([e.final_text for e in shown], examples)
    for e, total, missing in zip(shown, out.total, out.missing):
        if e.returned is None:
            if missing:
                e.error = "the rewards did not score the agent's reply"
            else:
                e.reward, e.scored_by = float(total), "rewards"


def agent_rollout(episodes: Sequence[AgentEpisode], tokenizer: Any, *, repeats: int, max_transitions: int,
                  pad_id: int) -> Rollout:
    """The rows of ``episodes`` (``repeats`` per task, in order): each episode's transitions then
    padding rows, ``max_transitions`` rows per episode, so each task's group is ``repeats ×
    max_transitions`` rows; a failed episode's rows and the padding are left out of the loss. The
    rows are :func:`rljax.environments.episodes.episodes_rollout`'s (``score`` the episode's reward,
    ``policy_mask`` the sampled tokens, ``finished`` the transition's last completion stopped)."""
    rows: list[Episode] = []
    for e in episodes:
        kept = [] if e.failed else e.transitions
        for t in kept:
            t.rewards, t.success = [float(e.reward)], bool(e.reward > 0)
            t.messages = _messages(e)
        pad = Episode(example=dict(e.task), status="failed", error=e.error or "padding")
        rows += kept + [pad] * (max_transitions - len(kept))
    return episodes_rollout(rows, tokenizer, repeats=repeats * max_transitions, pad_id=pad_id, credit="trajectory")


def _plain(message: dict) -> dict:
    """A message as the transcript compares it: role, text and tool calls (names and arguments)."""
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
             for c in message.get("tool_calls") or []]
    return {"role": message.get("role"), "content": content or "", "tool_calls": calls}


def _reply(call) -> dict:
    if not call.choices:
        return {"role": "assistant", "content": "", "tool_calls": []}
    return _plain({"role": "assistant", "content": call.choices[0].content, "tool_calls": call.choices[0].tool_calls})


def _line(m: dict) -> str:
    calls = "".join(f"\n  -> {name}({arguments})" for name, arguments in m["tool_calls"])
    return f"{m['role']}: {m['content']}{calls}"


def _messages(e: AgentEpisode) -> list[dict]:
    """The last call's conversation and reply (what the samples log shows)."""
    if not e.calls:
        return []
    last = e.calls[-1]
    messages = [dict(m) for m in last.request.get("messages", [])] or [{"role": "user",
                                                                        "content": str(last.request.get("prompt"))}]
    if last.choices:
        reply = {"role": "assistant", "content": last.choices[0].content}
        if last.choices[0].tool_calls:
            reply["tool_calls"] = last.choices[0].tool_calls
        messages.append(reply)
    return messages


def agent_metrics(episodes: Sequence[AgentEpisode], *, version: int | None = None, prefix: str = "agent/"
                  ) -> dict[str, float]:
    """``episodes`` and ``failed_episodes`` (counts); per episode: ``calls_per_episode``,
    ``tokens_per_episode`` (sampled), ``tool_calls_parsed`` and ``tool_calls_failed`` (tool-call blocks
    that did not parse), ``transitions_per_episode``, ``rewritten`` (fraction of episodes with more
    than one transition), ``dropped_transitions``, ``return`` (mean reward of the unfailed ones),
    ``scored_by_rewards`` (fraction), ``seconds`` (mean); ``stale_calls``: calls sampled with
    another policy version than ``version`` (when given)."""
    n = max(len(episodes), 1)
    ok = [e for e in episodes if not e.failed]
    choices = [c for e in episodes for call in e.calls for c in call.choices]
    m = {
        "episodes": float(len(episodes)),
        "failed_episodes": float(len(episodes) - len(ok)),
        "calls_per_episode": sum(len(e.calls) for e in episodes) / n,
        "tokens_per_episode": sum(e.sampled_tokens for e in episodes) / n,
        "tool_calls_parsed": sum(len(c.tool_calls) for c in choices) / n,
        "tool_calls_failed": sum(len(c.tool_call_errors) for c in choices) / n,
        "transitions_per_episode": sum(len(e.transitions) for e in ok) / max(len(ok), 1),
        "rewritten": sum(len(e.transitions) > 1 for e in ok) / max(len(ok), 1),
        "dropped_transitions": float(sum(e.dropped_transitions for e in episodes)),
        "return": float(np.mean([e.reward for e in ok])) if ok else float("nan"),
        "scored_by_rewards": sum(e.scored_by == "rewards" for e in ok) / max(len(ok), 1),
        "seconds": sum(e.seconds for e in episodes) / n,
    }
    if version is not None:
        m["stale_calls"] = float(sum(call.policy_version != version or call.policy_version_end != version
                                     for e in episodes for call in e.calls))
    return {prefix + k: float(v) for k, v in m.items()}
