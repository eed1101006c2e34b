"""Online RL: sample, score, compute advantages, update. Any ``OnlineAlgorithm`` (GRPO, PPO, RLOO,
REINFORCE++), with no branch on its name.

    trainer = OnlineTrainer(cfg)        # build_run + prompts + rewards
    summary = trainer.fit()             # rljax.training.loop.fit

One step, top to bottom (:meth:`OnlineTrainer.step_once`): prompts -> ``rljax.rollout.rollout``
(sampler with the current policy, decode, rewards; DAPO's dynamic sampling resamples flat groups)
-> ``RolloutBatch`` -> reference log-probs (if the algorithm needs them) and old values (its value
head or separate critic) -> ``algorithm.advantages`` -> :func:`update_epochs`: the
``num_iterations × mini_batches`` optimizer updates of ``algorithm.loss`` in one jitted call (each
``rljax.update.apply_update``: micro-batch gradient accumulation with the mini-batch's global
totals, AdamW, a refusal to apply a non-finite update), plus the critic's on each mini-batch.

With an ``environment`` section the rollouts are multi-turn episodes instead
(``rljax.environments.episodes``: the environment's rewards score them, the loss counts the policy's
tokens only), through the same batch, advantages and updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import rng
from rljax.algorithms import get as get_algorithm
from rljax.batches import RolloutBatch
from rljax.config import ConfigError
from rljax.data.batching import PromptIterator
from rljax.data.prompts import PromptFormat
from rljax.distributed import is_main_process, place_batch
from rljax.environments.base import environment_factory
from rljax.environments.episodes import episode_metrics, episodes_rollout, run_episodes, turn_sampler
from rljax.errors import UserError
from rljax.inference import Engine
from rljax.inference.batch import engine_for
from rljax.logprobs import completion_logprobs, completion_values
from rljax.losses.kl import kl_penalty
from rljax.losses.reduce import masked_mean
from rljax.metrics_log import METRICS_FILE, read_jsonl
from rljax.metrics_trl import trl_metrics
from rljax.rewards.base import build_rewards
from rljax.rewards.bounded import bound_hit_metrics
from rljax.rewards.judge import judge_metrics
from rljax.rollout import Rollout, concat_rollouts, packing_group, policy_states, rollout, sampling_config
from rljax.run_config import RunConfig
from rljax.sharding import keep_shardings, replicated, shardings_of, use_mesh
from rljax.training import loop
from rljax.training.asynchronous import RolloutProducer, sampler_weights, staleness_metrics
from rljax.training.data import online_examples
from rljax.training.export import export_run
from rljax.training.run import build_run
from rljax.training.spec import run_spec
from rljax.update import apply_update, learning_rate_schedule, raise_if_nonfinite, schedule_length


_TRACES = {"update_epochs": 0}


def update_trace_count() -> int:
    """How many times :func:`update_epochs` has been traced (compiled) in this process."""
    return _TRACES["update_epochs"]


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "algorithm", "cfg", "temperature", "num_micro",
                                             "num_iterations", "mini_batches", "critic_graphdef", "critic_optimizer"),
                   donate_argnames=("params", "opt_state", "critic_params", "critic_opt_state"))
def update_epochs(graphdef, params, frozen, opt_state, batch: RolloutBatch, perm_key, *, optimizer, algorithm: str,
                  cfg, temperature: float, num_micro: int, num_iterations: int, mini_batches: int,
                  critic_graphdef=None, critic_params=None, critic_frozen=None, critic_opt_state=None,
                  critic_optimizer=None):
    """All ``num_iterations × mini_batches`` optimizer updates of one step in one call (purejaxrl's
    ``_update_epoch``): a ``lax.scan`` over passes, each drawing the mini-batches by the permutation
    ``jax.random.permutation(fold_in(perm_key, pass), R)`` (rows in order when ``mini_batches == 1``),
    around a ``lax.scan`` over the mini-batches, each one ``rljax.update.apply_update`` of the policy and,
    with a separate critic (``critic_*``, all or none), one of the critic on the same mini-batch.

    Returns ``(params, opt_state, critic_params, critic_opt_state, metrics)``: the critic's are None
    without one; ``metrics[k]`` is ``[num_iterations, mini_batches]``, one entry per update (the
    critic's ``loss`` / ``grad_norm`` as ``critic/loss`` / ``critic/grad_norm``, ``nonfinite`` the
    max of the two). The first refused (non-finite) update ends the step's updates: the later ones
    are refused too, so the state is the one before that update and ``updates_applied`` (in
    :func:`mean_update_metrics`) says how many were applied.
    """
    _TRACES["update_epochs"] += 1
    algo = get_algorithm(algorithm)
    policy_loss = functools.partial(algo.loss, cfg=cfg, temperature=temperature)
    critic_loss = functools.partial(algo.critic_loss, cfg=cfg) if critic_graphdef is not None else None
    rows = batch.num_rows
    mb_rows = rows // mini_batches

    def one_update(states, mb):
        p, po, c, co, halted = states
        p, po, metrics = apply_update(graphdef, p, frozen, po, mb, loss_fn=policy_loss, totals=algo.totals(mb, cfg),
                                      optimizer=optimizer, num_micro=num_micro, skip=halted)
        if critic_loss is not None:
            # the critic's update is refused with the policy's, and the policy's with the critic's
            # (a non-finite critic update stops the step as the policy's does): both halt together
            c, co, cm = apply_update(critic_graphdef, c, critic_frozen, co, mb, loss_fn=critic_loss,
                                     totals=algo.totals(mb, cfg), optimizer=critic_optimizer, num_micro=num_micro,
                                     skip=halted | (metrics["nonfinite"] > 0))
            renamed = {"loss": "critic/loss", "grad_norm": "critic/grad_norm"}
            metrics = {**metrics, **{renamed.get(k, k): v for k, v in cm.items()},
                       "nonfinite": jnp.maximum(metrics["nonfinite"], cm["nonfinite"])}
        metrics["applied"] = (~halted & (metrics["nonfinite"] == 0)).astype(jnp.float32)
        return (p, po, c, co, halted | (metrics["nonfinite"] > 0)), metrics

    def one_pass(states, it):
        if mini_batches == 1:
            minis = jax.tree.map(lambda x: x[None], batch)
        else:  # rows drawn across groups: a mini-batch's rows no longer come in runs of one prompt
            order = jax.random.permutation(jax.random.fold_in(perm_key, it), rows)[: mini_batches * mb_rows]
            minis = jax.tree.map(lambda x: x[order].reshape(mini_batches, mb_rows, *x.shape[1:]),
                                 batch.replace(prompt_group=1))
        return jax.lax.scan(one_update, states, minis)

    (params, opt_state, critic_params, critic_opt_state, _), metrics = jax.lax.scan(
        one_pass, (params, opt_state, critic_params, critic_opt_state, jnp.asarray(False)), jnp.arange(num_iterations))
    return params, opt_state, critic_params, critic_opt_state, metrics


def mean_update_metrics(metrics: dict) -> dict[str, float]:
    """Host summary of :func:`update_epochs`' per-update metrics: each the mean over the updates,
    ``nonfinite`` the max (above 0 if any update was refused: ``rljax.update.raise_if_nonfinite``)
    and, when one was, ``updates_applied`` (how many before it were)."""
    metrics = dict(jax.device_get(metrics))
    applied = int(np.sum(metrics.pop("applied")))
    summary = {k: float(np.max(v)) if k == "nonfinite" else float(np.mean(np.ravel(v).astype(np.float64)))
               for k, v in metrics.items()}
    if summary["nonfinite"] > 0:
        summary["updates_applied"] = applied
    return summary


@functools.partial(jax.jit, static_argnames=("algorithm", "cfg"))
def step_advantages(batch: RolloutBatch, state: dict | None, *, algorithm: str, cfg):
    """``(batch with advantages, state')`` of the algorithm (``OnlineAlgorithm.advantages_and_state``)
    as one jitted program. Why jitted: the batch is split over every process of a multi-process run,
    so each eager op of the estimator would be a cross-process program of its own; a run of them in
    flight together once hung both processes of a two-process run for ever (gloo on CPU)."""
    return get_algorithm(algorithm).advantages_and_state(batch, cfg, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def score_logprobs(graphdef, params, frozen, batch: RolloutBatch, *, temperature: float):
    """Log-probs ``[R, N]`` of the rollout's completion tokens under ``params``: no gradient."""
    return completion_logprobs(nnx.merge(graphdef, params, frozen), batch.prompt_ids, batch.prompt_mask,
                               batch.completion_ids, batch.completion_mask, temperature=temperature,
                               prompt_group=batch.prompt_group)["logprobs"]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def score_values(graphdef, params, frozen, batch: RolloutBatch):
    """Value estimates ``[R, N]`` of the rollout's completion tokens (value head): no gradient."""
    return completion_values(nnx.merge(graphdef, params, frozen), batch.prompt_ids, batch.prompt_mask,
                             batch.completion_ids, batch.completion_mask)


def rollout_batch(roll: Rollout, *, mask_truncated: bool, group_size: int = 1, micro_batches: int = 1) -> RolloutBatch:
    """The ``RolloutBatch`` of a scored rollout: rows whose reward failed (and, with
    ``mask_truncated``, rows that never stopped) are left out of the loss. ``prompt_group`` is
    ``group_size`` where :func:`shared_prompt_group` allows it, else 1."""
    row_mask = np.asarray(roll.row_mask, bool)
    keep = row_mask & (np.asarray(roll.finished, bool) if mask_truncated else True)
    # a multi-turn trajectory trains on the policy's tokens only (the environment's are context)
    trained = roll.completion_mask if roll.policy_mask is None else roll.policy_mask
    loss_mask = trained * keep[:, None].astype(np.int32)
    return place_batch(RolloutBatch(
        prompt_ids=roll.prompt_ids, prompt_mask=roll.prompt_mask, completion_ids=roll.completion_ids,
        completion_mask=roll.completion_mask, loss_mask=loss_mask, old_logprobs=roll.logprobs,
        scores=np.asarray(roll.scores, np.float32), row_mask=row_mask, finished=np.asarray(roll.finished, bool),
        prompt_group=shared_prompt_group(roll.prompt_ids, roll.prompt_mask, group_size, micro_batches=micro_batches),
        versions=roll.versions))


def shared_prompt_group(prompt_ids: np.ndarray, prompt_mask: np.ndarray, group_size: int, *,
                        micro_batches: int = 1) -> int:
    """``group_size`` if each run of ``group_size`` consecutive rows has one prompt (ids and mask) and
    ``rljax.rollout.packing_group`` allows it (packed rows fewer than the batch shards would leave devices
    computing the same rows); else 1."""
    R = len(prompt_ids)
    if packing_group(R, group_size, micro_batches) == 1:
        return 1
    same = lambda a: bool((np.asarray(a).reshape(R // group_size, group_size, -1) == np.asarray(a)[::group_size, None]).all())  # noqa: E731
    return group_size if same(prompt_ids) and same(prompt_mask) else 1


class OnlineTrainer:
    """A run (``rljax.training.run.Run``) plus prompts, rewards and the algorithm."""

    log_keys = ("reward/total/mean", "loss")

    def __init__(self, cfg: RunConfig, *, resume: bool = False, write_config: bool = True, overwrite: bool = False,
                 resume_step: int | None = None):
        """``resume``, ``resume_step``, ``write_config`` and ``overwrite``: as ``rljax.training.run.build_run``."""
        self.algorithm = get_algorithm(cfg.algorithm.name)
        if not self.algorithm.online:
            raise ValueError(f"{cfg.algorithm.name} is an offline algorithm (rljax.training.offline.OfflineTrainer)")
        a = cfg.algorithm
        spec = run_spec(cfg)
        # TRL's learning_rate metric: the schedule the optimizer was built with (rljax.update.optimizer_for)
        self._learning_rate = learning_rate_schedule(cfg.optim, schedule_length(cfg.optim, spec.total_updates))
        self._num_tokens: int | None = None  # TRL's num_tokens, read back from metrics.jsonl on resume
        self.run = build_run(
            cfg, **spec.build_args(), resume=resume, write_config=write_config,
            overwrite=overwrite, resume_step=resume_step, defer_restore=True)  # restored once the data passed
        with self.run.released_on_error():  # a failed set-up frees the run directory
            self.cfg, self.total_steps = cfg, cfg.train.steps
            tokenizer = self.run.tokenizer
            # every prompt checked (and, with too_long: filter, dropped) before step 0 and before config.yaml
            self.train_examples, self.eval_examples, self.data_counts = online_examples(cfg, tokenizer)
            _check_enough_prompts(len(self.train_examples), self.data_counts, cfg)
            # an environment run is scored by its environment (rljax.environments), not by rewards
            env = cfg.environment
            self.rewards = None if env.name or (env.is_agent and not cfg.rewards) else build_rewards(
                cfg.rewards, tokenizer=tokenizer, base_model=cfg.model.name)
            self.make_env = environment_factory(env.name, env.options, tokenizer=tokenizer) if env.name else None
            # rows per group: a per-turn run pads each group's turns to group_size × max_turns rows, an
            # agent run each episode's transitions to max_transitions rows
            self.group_rows = a.group_size * (env.max_turns if env.name and env.credit == "turn" else
                                              env.max_transitions if env.is_agent else 1)
            self.advantage_cfg = a if self.group_rows == a.group_size else dataclasses.replace(
                a, group_size=self.group_rows)
            self.last_episodes: list = []  # the latest sample's episodes (environment runs)
            self.last_episode_metrics: dict[str, float] = {}  # and their metrics (the last round's, if several)
            self.iterator = PromptIterator(self.train_examples, a.prompts_per_step, seed=cfg.train.seed)
            # state an algorithm carries across steps (a moving-average baseline): the last completed
            # step's, saved with every checkpoint (rljax.training.loop.save)
            self.algorithm_state = self.algorithm.start_state(a)
            if resume:
                metadata = self.run.restore(resume_step)
                self.iterator.load_state_dict(metadata["data"])
                if self.algorithm_state is not None:
                    self.algorithm_state = _restored_algorithm_state(metadata, self.algorithm_state)
            self.prompt_format = PromptFormat.from_data(cfg.data)
            self.sampling = sampling_config(cfg.sampling, tokenizer, self.run.model_config)
            self.eval_sampling = sampling_config(cfg.sampling, tokenizer, self.run.model_config, evaluation=True)
            self.sample_stream = rng.stream(cfg.train.seed, "sample")
            self._engine: Engine | None = None
            self.agents = None  # an agent run's sampler (rljax.agents): its server over an engine of its own
            if env.is_agent:
                from rljax.agents import AgentSampler  # the openai client and the server load only for agent runs

                self.agents = AgentSampler(env, tokenizer=tokenizer, sampling=self.sampling,
                                           eval_sampling=self.eval_sampling, engine_settings=cfg.sampling,
                                           rewards=self.rewards)
            # the engine has one owner at a time: the asynchronous loop's producer thread or an evaluation
            self._sampler_lock = threading.RLock()
            self._producer: RolloutProducer | None = None  # train.max_staleness >= 1, started at the first step
            self._rollout_frozen = None  # disaggregated: the frozen state on the rollout devices, placed once
            self.last_rollouts: Rollout | None = None  # the latest step's rollouts (texts, examples, rewards)
            self.last_eval_rollouts: list[Rollout] = []  # the latest evaluation's, one per batch of 64 prompts
            if write_config:
                self.run.save_config()

    @property
    def step(self) -> int:
        return self.run.step

    def fit(self) -> dict:
        try:
            return loop.fit(self)
        finally:
            self.close_producer()

    # ------------------------------------------------------------------ rollouts
    @loop.in_run_mesh
    def sample(self, examples: list[dict], key, *, repeats: int, evaluation: bool = False, policy=None,
               refresh_weights=None) -> Rollout:
        """``repeats`` completions per example with the current policy (or ``policy``, a split), scored;
        rows example-major. With an environment: ``repeats`` episodes per example
        (``rljax.environments.episodes``; evaluation always scores whole trajectories), their metrics in
        ``last_episode_metrics``. ``refresh_weights``: as ``rljax.rollout.rollout``'s (partial rollouts)."""
        policy = self._sampling_policy() if policy is None else policy
        if self.run.rollout_mesh is not None:  # the key too lives where the sampler runs
            key = jax.device_put(key, replicated(self.run.rollout_mesh))
        with self._sampler_lock, self._sampling_mesh(thread_default=contextlib.nullcontext()):
            if self.make_env is not None:
                return self._sample_episodes(examples, key, repeats=repeats, evaluation=evaluation, policy=policy)
            if self.agents is not None:  # agent code's calls, served by the policy at this step's weights
                roll, self.last_episode_metrics = self.agents.sample(policy, examples, key, repeats=repeats,
                                                                     version=self.run.step, evaluation=evaluation)
                return roll
            return rollout(policy, self.run.tokenizer, examples, key,
                           sampling=self.eval_sampling if evaluation else self.sampling, fmt=self.prompt_format,
                           repeats=repeats, rewards=self.rewards, engine=self.engine(),
                           refresh_weights=refresh_weights)

    def engine(self) -> Engine | None:
        """The run's rollout engine (``sampling.engine: paged``, one process), built on first use; it
        is given the current weights at each rollout. None: the static sampler."""
        if self._engine is None:
            self._engine = engine_for(self._sampling_policy(), self.cfg.sampling,
                                      max_context=self.longest_sequence()) or False
        return self._engine or None

    def longest_sequence(self) -> int:
        """The most tokens one sampled sequence can hold: an environment's trajectory
        (``environment.max_tokens``), else the longest prompt (``data.max_prompt_length``: a longer one
        is refused) and ``sampling.max_new_tokens`` (training's and evaluation's). The engine refuses a
        longer request and sizes its default page pool by it (``num_pages: null``)."""
        if self.make_env is not None:
            return self.cfg.environment.max_tokens
        return self.cfg.data.max_prompt_length + self.cfg.sampling.max_new_tokens

    def _sample_episodes(self, examples: list[dict], key, *, repeats: int, evaluation: bool, policy) -> Rollout:
        env, sampling = self.cfg.environment, self.eval_sampling if evaluation else self.sampling
        episodes = run_episodes(turn_sampler(policy, sampling, key, engine=self.engine()),
                                self.run.tokenizer, self.make_env,
                                examples, repeats=repeats, max_turns=env.max_turns, max_tokens=env.max_tokens,
                                max_new_tokens=sampling.max_new_tokens, pad_id=sampling.pad_token_id,
                                workers=env.workers)
        self.last_episodes = episodes
        self.last_episode_metrics = episode_metrics(episodes, prefix="eval/env/" if evaluation else "env/")
        return episodes_rollout(episodes, self.run.tokenizer, repeats=repeats, pad_id=sampling.pad_token_id,
                                credit="trajectory" if evaluation else env.credit, max_turns=env.max_turns,
                                turn_reward=env.turn_reward, gamma=env.gamma)

    @loop.in_run_mesh
    def rollouts(self, key, *, iterator: PromptIterator | None = None, policy=None,
                 refresh_weights=None) -> tuple[Rollout, dict[str, float]]:
        """One step's rollouts: G completions for each of ``prompts_per_step`` prompts, from ``iterator``
        (default the trainer's) with ``policy`` (default the current one; ``sample``'s other arguments).

        With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and more
        prompts are sampled (up to ``max_sampling_rounds`` rounds); if the batch is still not full,
        the remaining places are filled with dropped groups (their advantages are zero).
        """
        a = self.cfg.algorithm
        G = self.group_rows
        groups, dropped = [], []
        stats = {"sampling/rounds": 0.0, "sampling/zero_variance_groups": 0.0}
        iterator = self.iterator if iterator is None else iterator
        for round_ in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
            examples = [self.train_examples[i] for i in iterator.next_indices()]
            roll = self.sample(examples, jax.random.fold_in(key, round_), repeats=a.group_size, policy=policy,
                               refresh_weights=refresh_weights)
            stats["sampling/rounds"] += 1
            flat = [_all_equal(roll.scores[g * G:(g + 1) * G][roll.row_mask[g * G:(g + 1) * G]])
                    for g in range(len(roll) // G)]
            if round_ == 0:
                stats["sampling/zero_variance_groups"] = sum(flat) / a.prompts_per_step
            if not a.dynamic_sampling:
                return roll, stats  # the whole round is the batch: nothing to select
            for g, is_flat in enumerate(flat):
                (dropped if is_flat else groups).append(roll.take(np.arange(g * G, (g + 1) * G)))
            if len(groups) >= a.prompts_per_step:
                break
        return concat_rollouts((groups + dropped)[: a.prompts_per_step], pad_id=self.sampling.pad_token_id), stats

    # ------------------------------------------------------------------ one step
    @loop.in_run_mesh
    def step_once(self) -> dict[str, float]:
        """Rollouts -> advantages -> updates; advances ``step``. Raises ``NonFiniteLossError``
        (leaving the state as before the refused update) if an update was not finite."""
        cfg, a, run = self.cfg, self.cfg.algorithm, self.run
        t0 = time.perf_counter()
        if cfg.train.max_staleness == 0:
            roll, metrics = self.rollouts(rng.step_key(self.sample_stream, run.step))
        else:  # sampled ahead by the producer thread (rljax.training.asynchronous)
            roll, metrics = self._produced_rollouts()
        t_sample = time.perf_counter() - t0
        batch = rollout_batch(roll, mask_truncated=a.mask_truncated, group_size=self.group_rows,
                              micro_batches=a.num_micro)
        if batch.versions is not None:
            metrics.update(staleness_metrics(batch.versions, batch.loss_mask, run.step))
        temperature = cfg.sampling.temperature
        t1 = time.perf_counter()
        if a.off_policy_correction != "none":
            # π_old is the policy about to be updated, scored by the trainer's own forward pass; the
            # sampler's log-probs are μ (rljax.losses.off_policy)
            batch = batch.replace(sampling_logprobs=batch.old_logprobs,
                                  old_logprobs=score_logprobs(*run.policy.split, batch, temperature=temperature))
        if self.algorithm.needs_reference(a):
            batch = batch.replace(ref_logprobs=score_logprobs(run.policy.graphdef, run.reference(), run.policy.frozen,
                                                              batch, temperature=temperature))
        value_head = self.algorithm.value_head(a)
        if value_head is not None:
            values_of = run.critic if value_head == "separate" else run.policy
            batch = batch.replace(old_values=score_values(*values_of.split, batch))
        batch, state = step_advantages(batch, self.algorithm_state, algorithm=a.name, cfg=self.advantage_cfg)
        jax.block_until_ready(batch)
        t_ref = time.perf_counter() - t1
        t2 = time.perf_counter()
        metrics.update(self.update_epochs(batch))
        t_update = time.perf_counter() - t2
        estimator = self.algorithm.reward_kl_estimator(a)
        if batch.ref_logprobs is not None and "kl/mean" not in metrics and estimator is not None:
            # the KL is in the reward (PPO, RLOO, REINFORCE++): log the estimate the reward used
            metrics["kl/mean"] = reward_kl(batch, estimator=estimator)
        metrics.update(roll.reward_metrics)
        if self.rewards is not None and self._producer is None:  # every sample scored this step, dropped groups too
            metrics.update(_reward_counters(self.rewards.functions))
        metrics.update(self.last_episode_metrics)
        metrics.update({
            "completion/mean_length": float(roll.completion_mask.sum(-1).mean()),
            "completion/stopped_frac": float(np.mean(roll.finished)),
            "time/sample_s": t_sample, "time/ref_and_values_s": t_ref, "time/update_s": t_update,
        })
        raise_if_nonfinite(metrics, run.step)
        if state is not None:  # committed with the step: a refused update leaves the state as it was
            self.algorithm_state = {k: float(v) for k, v in state.items()}
            metrics.update({f"algorithm/{k}": v for k, v in self.algorithm_state.items()})
        self.last_rollouts = roll
        run.step += 1
        if self._producer is not None:  # the new weights, for the batches still to be sampled
            metrics["time/weight_sync_s"] = self._producer.publish(run.step, run.policy.split)
        metrics.update(self._trl_metrics(roll, metrics))
        return metrics

    # ------------------------------------------------------------------ the asynchronous loop
    def _produced_rollouts(self) -> tuple[Rollout, dict[str, float]]:
        """This step's batch from the producer thread (started on first use), with the data position
        after its prompts (what a checkpoint of this step saves) and the loop's metrics."""
        if self._producer is None:
            self.engine()  # built here, from the trainer's weights, before the thread can race the update
            self._producer_iterator.load_state_dict(self.iterator.state_dict())  # before the thread reads it
            train = self.cfg.train
            self._producer = RolloutProducer(
                self._produce, self.run.policy.split, start_step=self.run.step, total_steps=self.total_steps,
                max_staleness=train.max_staleness, partial_rollouts=train.partial_rollouts,
                set_weights=self._engine_weights if train.partial_rollouts else None,
                context=self._sampling_mesh, place=self._sampler_copy)
        item, metrics = self._producer.take(self.run.step)
        self.iterator.load_state_dict(item.position)
        self.last_episode_metrics = item.stats.pop("_episode_metrics")
        return item.rollout, {**item.stats, **metrics}

    @functools.cached_property
    def _producer_iterator(self) -> PromptIterator:
        """The producer's own data iterator: it runs ahead of the trainer's by the batches in flight."""
        a = self.cfg.algorithm
        return PromptIterator(self.train_examples, a.prompts_per_step, seed=self.cfg.train.seed)

    def _produce(self, step: int, policy, refresh_weights) -> tuple[Rollout, dict, dict]:
        """Step ``step``'s rollouts with ``policy`` (in the producer thread): the rollout, its stats (the
        reward counters and episode metrics of exactly its samples) and the data position after it."""
        with self._sampler_lock:
            engine = self.engine()
            if engine is not None:  # a batch's tokens never depend on what the engine served before
                engine.clear_prefix_cache()
            roll, stats = self.rollouts(rng.step_key(self.sample_stream, step), iterator=self._producer_iterator,
                                        policy=policy, refresh_weights=refresh_weights)
            if self.rewards is not None:
                stats.update(_reward_counters(self.rewards.functions))
            stats["_episode_metrics"] = dict(self.last_episode_metrics)
        return roll, stats, self._producer_iterator.state_dict()

    def _sampling_policy(self) -> tuple:
        """The current policy where the sampler runs: the trainer's own split, or (disaggregated,
        ``mesh.rollout_devices``) a copy resharded onto the rollout devices."""
        if self.run.rollout_mesh is None:
            return self.run.policy.split
        return self._sampler_copy(self.run.policy.split)

    def _sampler_copy(self, policy) -> tuple:
        """``rljax.training.asynchronous.sampler_weights`` on this run's rollout mesh (None: colocated)."""
        if self.run.rollout_mesh is None:
            return sampler_weights(policy)
        if self._rollout_frozen is None:
            self._rollout_frozen = sampler_weights(policy, self.run.rollout_mesh, self.run.rules)[2]
        return sampler_weights(policy, self.run.rollout_mesh, self.run.rules, frozen=self._rollout_frozen)

    def _sampling_mesh(self, thread_default=None):
        """The mesh the sampler's batches go to: the rollout devices' (disaggregated), else
        ``thread_default`` (default the run's mesh: the producer thread has no mesh of its own)."""
        if self.run.rollout_mesh is None:
            return loop.mesh_of(self.run) if thread_default is None else thread_default
        return use_mesh(self.run.rollout_mesh, self.run.rules)

    def _engine_weights(self, policy) -> None:
        self.engine().set_weights(policy_states(policy))

    def close_producer(self) -> None:
        """Stop the asynchronous loop's producer thread (batches it sampled ahead are dropped: a resumed
        run samples them again, from the data position of the last trained step)."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    def _trl_metrics(self, roll: Rollout, metrics: dict[str, float]) -> dict[str, float]:
        """TRL ``GRPOTrainer``'s metrics of the step just taken (``rljax.metrics_trl``)."""
        a, run = self.cfg.algorithm, self.run
        if self._num_tokens is None:
            self._num_tokens = _logged_num_tokens(self.cfg.train.run_dir, run.step - 1)
        self._num_tokens += int(roll.prompt_mask.sum()) + int(roll.completion_mask.sum())
        updates_done = run.step * a.num_iterations * a.mini_batches
        it = self.iterator
        return trl_metrics(
            per_function=roll.per_function, total=roll.scores, group_size=self.group_rows,
            completion_lengths=roll.completion_mask.sum(-1), truncated=~np.asarray(roll.finished, bool),
            update_metrics=metrics, learning_rate=float(self._learning_rate(updates_done)),
            epoch=it.epoch + it.index / len(self.train_examples), num_tokens=self._num_tokens)

    @loop.in_run_mesh
    def update_epochs(self, batch: RolloutBatch) -> dict[str, float]:
        """The step's ``num_iterations × mini_batches`` optimizer updates (:func:`update_epochs`,
        mini-batches drawn by a seeded permutation per pass); returns :func:`mean_update_metrics`."""
        a, run = self.cfg.algorithm, self.run
        p, c = run.policy, run.critic
        perm_key = rng.step_key(rng.stream(self.cfg.train.seed, "minibatch"), run.step)
        critic = {} if c is None else dict(critic_graphdef=c.graphdef, critic_params=c.params, critic_frozen=c.frozen,
                                           critic_opt_state=c.opt_state, critic_optimizer=c.optimizer)
        before = shardings_of((p.params, p.opt_state, *((None, None) if c is None else (c.params, c.opt_state))))
        *state, metrics = update_epochs(
            p.graphdef, p.params, p.frozen, p.opt_state, batch, perm_key, optimizer=p.optimizer, algorithm=a.name,
            cfg=a, temperature=self.cfg.sampling.temperature, num_micro=a.num_micro,
            num_iterations=a.num_iterations, mini_batches=a.mini_batches, **critic)
        # the inputs' own shardings, so the next step reuses this compiled update (keep_shardings)
        p.params, p.opt_state, critic_params, critic_opt_state = keep_shardings(tuple(state), before)
        if c is not None:
            c.params, c.opt_state = critic_params, critic_opt_state
        return mean_update_metrics(metrics)

    # ------------------------------------------------------------------ evaluation
    @loop.in_run_mesh
    def evaluate(self, examples: list[dict] | None = None) -> dict[str, float]:
        """Greedy (by default) completions on held-out prompts: mean of each reward, length.

        As TRL ``GRPOTrainer`` logs them (and as the training metrics, ``rljax.rewards.reward_metrics``):
        ``eval/<name>`` is that function's mean over the samples it scored (``nanmean``; NaN if none),
        with ``eval/<name>/missing``, the fraction it did not score, when above 0; ``eval/reward``
        is the mean over every sample of the weighted total in which a missing value counts 0
        (``nansum``), so ``eval/reward = Σ_k w_k · (1 − eval/<name>/missing) · eval/<name>``.
        """
        with self._sampler_lock:  # the producer thread waits while the evaluation uses the engine
            return self._evaluate(examples)

    def _evaluate(self, examples: list[dict] | None) -> dict[str, float]:
        examples = self.eval_examples if examples is None else examples
        key = rng.stream(self.cfg.train.seed, "eval")
        rolls, episodes = [], []
        for start in range(0, len(examples), 64):
            rolls.append(self.sample(examples[start : start + 64], key, repeats=1, evaluation=True))
            episodes += self.last_episodes if self.agents is None else self.agents.last_episodes
        self.last_eval_rollouts = rolls
        if not rolls:
            return {}
        results = {}
        for name in rolls[0].per_function:
            values = np.concatenate([r.per_function[name] for r in rolls])
            scored = ~np.isnan(values)
            results[f"eval/{name}"] = float(np.mean(values[scored])) if scored.any() else float("nan")
            if not scored.all():
                results[f"eval/{name}/missing"] = float(np.mean(~scored))
        results["eval/reward"] = float(np.mean(np.concatenate([r.scores for r in rolls]), dtype=np.float64))
        results["eval/mean_length"] = float(np.concatenate([r.completion_mask.sum(-1) for r in rolls]).mean())
        if self.rewards is not None:
            results.update(_reward_counters(self.rewards.functions, prefix="eval/"))
        if episodes and self.agents is not None:  # every batch's agent episodes
            from rljax.agents import agent_metrics

            results.update(agent_metrics(episodes, version=self.run.step, prefix="eval/agent/"))
        elif episodes:  # every batch's episodes
            results.update(episode_metrics(episodes, prefix="eval/env/"))
        return results

    # ------------------------------------------------------------------ what fit calls
    def start_metrics(self) -> dict:
        return {f"data/{k}": v for k, v in self.data_counts.items()}

    def on_step(self, logger) -> None:
        every = self.cfg.train.samples_every
        if every and self.run.step % every == 0 and self.last_rollouts is not None:
            logger.log_samples(self.run.step, _sample_rows(self.last_rollouts, prefix="reward/"))

    def on_evaluate(self, step: int) -> None:
        if not is_main_process():
            return
        with open(os.path.join(self.cfg.train.run_dir, f"eval_samples_step{step}.jsonl"), "w") as f:
            for roll in self.last_eval_rollouts:
                for row in _sample_rows(roll, prefix=""):
                    f.write(json.dumps(row) + "\n")

    def on_end(self, summary: dict) -> None:
        if self.agents is not None:
            self.agents.close()
        if self.cfg.train.save_model:
            summary.update(export_run(self.run, self.cfg.train.run_dir))


def _restored_algorithm_state(metadata: dict, initial: dict) -> dict[str, float]:
    """The algorithm state a checkpoint saved (its keys must be the algorithm's)."""
    saved = metadata.get("algorithm_state")
    if not isinstance(saved, dict) or set(saved) != set(initial):
        raise ValueError(f"the checkpoint of step {metadata.get('step')} has no algorithm state with keys "
                         f"{sorted(initial)} (found {saved!r}); it was not saved by this algorithm")
    return {k: float(v) for k, v in saved.items()}


def reward_kl(batch: RolloutBatch, *, estimator: str) -> float:
    """Mean over the counted tokens of the KL estimate ``k(π_old, π_ref)`` that enters the reward
    (PPO, RLOO, REINFORCE++; TRL ``RLOOTrainer``'s ``kl``)."""
    return float(_reward_kl(batch, estimator=estimator))


@functools.partial(jax.jit, static_argnames=("estimator",))
def _reward_kl(batch: RolloutBatch, *, estimator: str):
    kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, estimator=estimator, mask=batch.loss_mask)
    return masked_mean(kl, batch.loss_mask)


def _logged_num_tokens(run_dir: str, step: int) -> int:
    """The ``num_tokens`` logged at or before ``step`` (0 if none): a resumed run counts on from it."""
    path = os.path.join(run_dir, METRICS_FILE)
    if step < 1 or not os.path.exists(path):
        return 0
    logged = [r["num_tokens"] for r in read_jsonl(path) if r.get("step", 0) <= step and "num_tokens" in r]
    return int(logged[-1]) if logged else 0


def _check_enough_prompts(n: int, counts: dict, cfg: RunConfig) -> None:
    """One step needs ``prompts_per_step`` distinct training prompts; say what was dropped."""
    dropped, need = counts.get("dropped/too_long", 0), cfg.algorithm.prompts_per_step
    limit = f"over data.max_prompt_length={cfg.data.max_prompt_length} tokens"
    if dropped or counts.get("eval_dropped/too_long"):
        held_out = counts.get("eval_dropped/too_long", 0)
        print(f"data.too_long=filter dropped {dropped} prompts{f' (and {held_out} held-out ones)' if held_out else ''} "
              f"{limit}", file=sys.stderr, flush=True)
    if n == 0 and dropped:
        raise UserError(f"no training prompt is left: data.too_long=filter dropped {dropped} prompts {limit} "
                         "once formatted; raise data.max_prompt_length")
    if n < need:
        after = f" (after data.too_long=filter dropped {dropped} {limit})" if dropped else ""
        raise ConfigError("algorithm.prompts_per_step", f"{need} prompts per step, but the training data has only "
                                                        f"{n} prompts{after}")


def _all_equal(scores: np.ndarray) -> bool:
    """A group with no scored row, or whose scores are all equal, has no learning signal."""
    return len(scores) == 0 or bool(np.ptp(scores) == 0)


def _reward_counters(functions, prefix: str = "reward/") -> dict[str, float]:
    """What reward functions count beside their values since the last call: the bounded verifiers'
    timeouts / memory / crashes (``rljax.rewards.bounded``) and the judges' parse failures, retries
    and fallbacks (``rljax.rewards.judge``)."""
    return {**bound_hit_metrics(functions, prefix=prefix), **judge_metrics(functions, prefix=prefix)}


def _sample_rows(roll: Rollout, *, prefix: str) -> list[dict]:
    rows = []
    for i, (text, ex) in enumerate(zip(roll.texts, roll.examples)):
        row = {"prompt": ex["prompt"], "completion": text, "answer": ex.get("answer")}
        if "episode" in ex:  # a multi-turn episode: its conversation, status, return and tool calls
            row["episode"] = ex["episode"]
        if "reward_outputs" in ex:  # what a reward function wrote for this sample (a judge's reply)
            row["reward_outputs"] = ex["reward_outputs"]
        row.update({f"{prefix}{k}": float(v[i]) for k, v in roll.per_function.items()})
        rows.append(row)
    return rows


__all__ = ["OnlineTrainer", "mean_update_metrics", "reward_kl", "rollout_batch", "score_logprobs",
           "score_values", "step_advantages", "update_epochs", "update_trace_count"]
