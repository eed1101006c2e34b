"""An online run's rollouts from agent code (``environment: {type: agent}``): what the trainer calls.

    sampler = AgentSampler(cfg.environment, tokenizer=tok, sampling=s, eval_sampling=e, engine_settings=cfg.sampling,
                           rewards=reward_set)
    roll, metrics = sampler.sample(policy.split, examples, key, repeats=G, version=step)
    sampler.close()

The first ``sample`` builds a rollout engine over the policy and an :class:`~rljax.agents.server.AgentServer`
on it; every ``sample`` first gives the engine the policy's current weights as policy ``version`` (the
step), so the agent's calls sample from the policy being trained and record which one they used.
Training episodes sample at ``sampling.temperature`` and ``top_p`` (a call asking for another
temperature is refused: the trainer's log-probs are taken at the run's); evaluation episodes default
to ``sampling.eval_temperature``. A call's ``max_tokens`` is capped at ``sampling.max_new_tokens``.
"""

from __future__ import annotations

from typing import Any

import jax

from rljax.agents.runner import agent_metrics, agent_rollout, load_agent, run_agent_episodes, score_episodes
from rljax.agents.server import AgentServer
from rljax.errors import UserError
from rljax.rollout import Rollout, policy_states

__all__ = ["AgentSampler"]


class AgentSampler:
    """Agent episodes as rollouts (see the module docstring). ``environment``: the run's
    ``EnvironmentSection`` (``function``, ``concurrency``, ``max_tokens``, ``max_transitions``);
    ``sampling`` / ``eval_sampling``: ``rljax.sampling.SamplingConfig``; ``engine_settings``: the
    run's ``sampling`` section (``max_slots``, ``page_size``, ``num_pages``); ``rewards``: a
    ``RewardSet`` for episodes whose agent returns None, or None."""

    def __init__(self, environment, *, tokenizer: Any, sampling, eval_sampling, engine_settings, rewards=None):
        self.environment, self.tokenizer = environment, tokenizer
        self.sampling, self.eval_sampling, self.engine_settings = sampling, eval_sampling, engine_settings
        self.rewards = rewards
        self.agent = load_agent(environment.function)  # a missing file or function fails before step 0
        self.server: AgentServer | None = None
        self.last_episodes: list = []

    def _server(self, policy) -> AgentServer:
        if self.server is None:
            from rljax.inference import Engine

            if jax.process_count() > 1:
                raise UserError("environment.type: agent runs in one process (its server drives one host's engine)")
            s = self.engine_settings
            engine = Engine(policy, max_slots=s.max_slots, page_size=s.page_size, num_pages=s.num_pages)
            stops = () if self.sampling.ignore_eos else tuple(self.sampling.stop_token_ids)
            self.server = AgentServer(engine, self.tokenizer, stop_token_ids=stops)
        return self.server

    def sample(self, policy, examples: list[dict], key: jax.Array, *, repeats: int, version: int,
               evaluation: bool = False) -> tuple[Rollout, dict[str, float]]:
        """``repeats`` episodes of each example under ``policy`` (split state) as policy ``version``:
        the rollout (``repeats × max_transitions`` rows per example) and its ``agent/*`` metrics
        (``eval/agent/*`` with ``evaluation``)."""
        from rljax.inference.batch import request_seeds

        env, s = self.environment, self.eval_sampling if evaluation else self.sampling
        server = self._server(policy)
        server.set_weights(policy_states(policy), version=version)
        episodes = run_agent_episodes(
            self.agent, examples, server=server, repeats=repeats, concurrency=env.concurrency,
            seed=int(request_seeds(key, 1)[0]), temperature=s.temperature, top_p=None if evaluation else s.top_p,
            max_tokens=s.max_new_tokens, strict=not evaluation, max_sequence_tokens=env.max_tokens,
            max_transitions=env.max_transitions)
        score_episodes(episodes, self.rewards)
        self.last_episodes = episodes
        roll = agent_rollout(episodes, self.tokenizer, repeats=repeats, max_transitions=env.max_transitions,
                             pad_id=s.pad_token_id)
        return roll, agent_metrics(episodes, version=version, prefix="eval/agent/" if evaluation else "agent/")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
