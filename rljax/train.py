"""The online RL loop: sample, score, compute advantages, update, evaluate, checkpoint, log.

    run = Trainer(cfg)          # loads the model, data, rewards; restores a checkpoint if asked
    run.fit()                   # step = rollouts -> advantages -> num_iterations × mini_batches updates

One batch, top to bottom (``Trainer.step_once``): prompts → ``rollouts`` (sampler with the current
policy, rewards, reference log-probs and values) → ``online.compute_advantages`` → ``_update`` (a
jitted pure function around ``rljax.update.apply_update``: gradient accumulation over micro-batches
in ``lax.scan`` with the mini-batch's global token/sequence counts, AdamW, and a refusal to apply a
non-finite update). PPO with ``algorithm.critic: separate`` also runs ``_update_critic`` on each
mini-batch: the critic model (its own parameters and optimizer state) learns the value loss, the
policy the policy loss.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax import rng
from rljax.algorithms import online
from rljax.checkpoint import Checkpointer
from rljax.config import save_config
from rljax.data.batching import PromptIterator, pad_token_id, tokenize_prompts
from rljax.data.loading import load_records
from rljax.data.prompts import format_prompt
from rljax.data.tasks import make_task
from rljax.logprobs import completion_logprobs
from rljax.loop import restore_state, run_steps, save_state
from rljax.metrics_log import MetricsLogger
from rljax.models import load
from rljax.models.lora import add_lora, lora_trainable, zero_adapters
from rljax.rewards.base import build_rewards
from rljax.run_config import RunConfig
from rljax.sampling import SamplingConfig, generate
from rljax.update import NonFiniteLossError, apply_update, make_optimizer, optimizer_for, raise_if_nonfinite

__all__ = ["NonFiniteLossError", "Rollouts", "Trainer", "make_optimizer"]


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "algo", "temperature", "num_micro"),
                   donate_argnames=("params", "opt_state"))
def _update(graphdef, params, frozen, opt_state, batch, *, optimizer, algo, temperature, num_micro):
    """One policy optimizer step on a mini-batch split into ``num_micro`` micro-batches
    (``rljax.update.apply_update`` with ``online.loss``; the mini-batch's global token/sequence counts)."""
    loss_fn = functools.partial(online.loss, cfg=algo, temperature=temperature)
    return apply_update(graphdef, params, frozen, opt_state, batch, loss_fn=loss_fn,
                        totals=online.batch_totals(batch), optimizer=optimizer, num_micro=num_micro)


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "algo", "num_micro"),
                   donate_argnames=("params", "opt_state"))
def _update_critic(graphdef, params, frozen, opt_state, batch, *, optimizer, algo, num_micro):
    """One optimizer step of a separate PPO critic (``online.critic_loss``) on the same mini-batch."""
    return apply_update(graphdef, params, frozen, opt_state, batch, loss_fn=functools.partial(online.critic_loss, cfg=algo),
                        totals=online.batch_totals(batch), optimizer=optimizer, num_micro=num_micro)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _critic_values(graphdef, params, frozen, batch):
    """A separate critic's values ``[R, N]`` of the rollout's completion tokens: no gradient."""
    return online.completion_values(nnx.merge(graphdef, params, frozen), batch["prompt_ids"], batch["prompt_mask"],
                                    batch["completion_ids"], batch["completion_mask"])


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "with_values"))
def _score_tokens(graphdef, params, frozen, batch, *, temperature, with_values):
    """Log-probs (and values) of the rollout's completion tokens under ``params``: no gradient."""
    model = nnx.merge(graphdef, params, frozen)
    return completion_logprobs(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                               batch["completion_mask"], temperature=temperature, with_values=with_values)


@dataclasses.dataclass
class Rollouts:
    arrays: dict[str, np.ndarray]
    texts: list[str]  # decoded completions
    examples: list[dict]
    reward_metrics: dict[str, float]
    per_function: dict[str, np.ndarray]


class Trainer:
    """Everything a run holds: model split into (graphdef, trainable, frozen), reference, data, rewards."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, write_config: bool = True):
        self.cfg = cfg
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        dtype = jnp.bfloat16 if cfg.model.dtype == "bfloat16" else jnp.float32
        model, self.tokenizer = load(cfg.model.name, dtype=dtype, value_head=online.shared_value_head(cfg.algorithm),
                                     scan_layers=cfg.model.scan_layers)
        if cfg.model.lora_rank:
            model = add_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                             targets=cfg.model.lora_targets, seed=cfg.train.seed)
            self.graphdef, self.params, self.frozen = nnx.split(model, lora_trainable(), ...)
            self.ref_params = None  # the reference is the base: adapters' B set to zero
        else:
            self.graphdef, self.params, self.frozen = nnx.split(model, nnx.Param, ...)
            needs_ref = cfg.algorithm.kl_coef > 0
            self.ref_params = jax.tree.map(jnp.copy, self.params) if needs_ref else None
        self.model_config = model.config
        self.pad_id = pad_token_id(self.tokenizer)
        self.stop_ids = tuple(sorted({*model.config.eos_token_ids, *([self.tokenizer.eos_token_id]
                                                                    if self.tokenizer.eos_token_id is not None else [])}))
        self.train_examples, self.eval_examples = self._load_data()
        self.rewards = build_rewards(cfg.rewards)
        self.iterator = PromptIterator(self.train_examples, cfg.algorithm.prompts_per_step, seed=cfg.train.seed)
        a = cfg.algorithm
        # the schedule counts optimizer updates: num_iterations × mini_batches per step
        updates = cfg.train.steps * a.num_iterations * a.mini_batches
        self.optimizer = optimizer_for(cfg.optim, updates)
        self.opt_state = self.optimizer.init(self.params)
        self.separate_critic = a.name == "ppo" and a.critic == "separate"
        if self.separate_critic:
            self._load_critic(dtype, updates)
        self.step = 0
        self.sample_stream = rng.stream(cfg.train.seed, "sample")
        self.checkpointer = Checkpointer(os.path.join(cfg.train.run_dir, "checkpoints"),
                                         save_every=cfg.train.save_every, max_to_keep=2)
        if resume:
            self._restore()
        if write_config:
            save_config(cfg, os.path.join(cfg.train.run_dir, "config.yaml"))

    def _load_critic(self, dtype, updates: int) -> None:
        """PPO's separate critic: its own transformer with a value head (fully fine-tuned), optimizer."""
        a, optim = self.cfg.algorithm, self.cfg.optim
        name = a.critic_model or self.cfg.model.name
        critic, tokenizer = load(name, dtype=dtype, value_head=True, scan_layers=self.cfg.model.scan_layers)
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(f"algorithm.critic_model={name!r} has another tokenizer than model.name="
                             f"{self.cfg.model.name!r}; the critic reads the policy's tokens, so they must match")
        self.critic_graphdef, self.critic_params, self.critic_frozen = nnx.split(critic, nnx.Param, ...)
        if a.critic_learning_rate:
            optim = dataclasses.replace(optim, learning_rate=a.critic_learning_rate)
        self.critic_optimizer = optimizer_for(optim, updates)
        self.critic_opt_state = self.critic_optimizer.init(self.critic_params)

    # ------------------------------------------------------------------ data
    def _load_data(self):
        d = self.cfg.data
        if d.path:
            rows = load_records(d.path, prompt_column=d.prompt_column,
                                answer_column=d.answer_column or None)
            n_eval = min(d.eval_size, len(rows) // 5)
            train, evals = rows[n_eval:][: d.train_size], rows[:n_eval]
        else:
            options = dict(d.task_options)
            train = make_task(d.task, split="train", size=d.train_size, seed=self.cfg.train.seed, **options)
            evals = make_task(d.task, split="eval", size=d.eval_size, seed=self.cfg.train.seed, **options)
        return train, evals

    def encode(self, examples: list[dict]):
        d = self.cfg.data
        texts = [format_prompt(self.tokenizer, ex["prompt"], system_prompt=d.system_prompt or None, chat=d.chat,
                               assistant_prefix=d.assistant_prefix)
                 for ex in examples]
        tok = tokenize_prompts(self.tokenizer, texts, max_prompt_length=d.max_prompt_length, too_long=d.too_long)
        return tok

    # ------------------------------------------------------------------ rollouts
    def sampling_config(self, *, evaluation: bool = False) -> SamplingConfig:
        s = self.cfg.sampling
        if evaluation:
            return SamplingConfig(max_new_tokens=s.max_new_tokens, temperature=s.eval_temperature,
                                  stop_token_ids=self.stop_ids, pad_token_id=self.pad_id)
        return SamplingConfig(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, stop_token_ids=self.stop_ids, pad_token_id=self.pad_id)

    def sample(self, examples: list[dict], key, *, repeats: int, evaluation: bool = False):
        """Sample ``repeats`` completions per example; score them. Rows are example-major."""
        tok = self.encode(examples)
        if tok.dropped:
            examples = [examples[i] for i in tok.kept]
        ids = np.repeat(tok.input_ids, repeats, axis=0)
        mask = np.repeat(tok.attention_mask, repeats, axis=0)
        out = generate((self.graphdef, self.params, self.frozen), ids, mask, key,
                       self.sampling_config(evaluation=evaluation))
        out = jax.tree.map(np.asarray, out)
        lengths = out.mask.sum(-1)
        prefix = self.cfg.data.assistant_prefix
        texts = [prefix + self.tokenizer.decode(out.tokens[i, : lengths[i]], skip_special_tokens=True)
                 for i in range(len(ids))]
        # the trainer fills in token lengths for length-aware rewards (e.g. overlong)
        row_examples = [dict(ex, completion_length=int(lengths[i * repeats + j]))
                        for i, ex in enumerate(examples) for j in range(repeats)]
        reward = self.rewards(texts, row_examples)
        arrays = dict(prompt_ids=ids, prompt_mask=mask, completion_ids=out.tokens, completion_mask=out.mask,
                      old_logprobs=out.logprobs, finished=out.finished,
                      scores=np.nan_to_num(reward.total).astype(np.float32), valid=~reward.missing)
        return Rollouts(arrays, texts, row_examples, self.rewards.metrics(reward), reward.per_function)

    def rollouts(self, key) -> tuple[Rollouts, dict[str, float]]:
        """One step's rollouts: G completions for each of ``prompts_per_step`` prompts.

        With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and more
        prompts are sampled (up to ``max_sampling_rounds`` rounds); if the batch is still not full,
        the remaining places are filled with dropped groups (their advantages are zero).
        """
        a = self.cfg.algorithm
        G = a.group_size
        groups, dropped, stats = [], [], {"sampling/rounds": 0.0, "sampling/zero_variance_groups": 0.0}
        for round_ in range(a.max_sampling_rounds if a.dynamic_sampling else 1):
            examples = [self.train_examples[i] for i in self.iterator.next_indices()]
            roll = self.sample(examples, jax.random.fold_in(key, round_), repeats=G)
            stats["sampling/rounds"] += 1
            for g in range(len(roll.arrays["scores"]) // G):
                rows = slice(g * G, (g + 1) * G)
                scores = roll.arrays["scores"][rows][roll.arrays["valid"][rows]]
                flat = len(scores) == 0 or np.ptp(scores) == 0
                stats["sampling/zero_variance_groups"] += float(flat) if round_ == 0 else 0.0
                (dropped if (a.dynamic_sampling and flat) else groups).append((roll, rows))
            if len(groups) >= a.prompts_per_step:
                break
        groups = (groups + dropped)[: a.prompts_per_step]
        stats["sampling/zero_variance_groups"] /= a.prompts_per_step
        return _concat_groups(groups), stats

    # ------------------------------------------------------------------ one step
    def step_once(self) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algorithm
        t0 = time.perf_counter()
        key = rng.step_key(self.sample_stream, self.step)
        roll, metrics = self.rollouts(key)
        t_sample = time.perf_counter() - t0
        batch = {k: jnp.asarray(v) for k, v in roll.arrays.items()}
        loss_mask = batch["completion_mask"] * batch["valid"][:, None].astype(jnp.int32)
        if a.mask_truncated:
            loss_mask = loss_mask * batch["finished"][:, None].astype(jnp.int32)
        batch["loss_mask"] = loss_mask
        t1 = time.perf_counter()
        temperature = cfg.sampling.temperature
        if a.kl_coef > 0:
            ref = zero_adapters(self.params) if self.ref_params is None else self.ref_params
            batch["ref_logprobs"] = _score_tokens(self.graphdef, ref, self.frozen, batch, temperature=temperature,
                                                  with_values=False)["logprobs"]
        else:
            batch["ref_logprobs"] = batch["old_logprobs"]
        if self.separate_critic:
            batch["old_values"] = _critic_values(self.critic_graphdef, self.critic_params, self.critic_frozen, batch)
        elif a.name == "ppo":
            batch["old_values"] = _score_tokens(self.graphdef, self.params, self.frozen, batch,
                                                temperature=temperature, with_values=True)["values"]
        batch.update(online.compute_advantages(batch, a))
        jax.block_until_ready(batch)
        t_ref = time.perf_counter() - t1
        t2 = time.perf_counter()
        rows = len(roll.arrays["scores"])
        mb_rows = rows // a.mini_batches
        num_micro = mb_rows // (a.micro_batch_size or mb_rows)
        update_metrics = []
        perm_key = rng.step_key(rng.stream(cfg.train.seed, "minibatch"), self.step)
        for it in range(a.num_iterations):
            order = np.asarray(jax.random.permutation(jax.random.fold_in(perm_key, it), rows)) \
                if a.mini_batches > 1 else np.arange(rows)
            for m in range(a.mini_batches):
                idx = order[m * mb_rows : (m + 1) * mb_rows]
                mb = {k: v[idx] for k, v in batch.items()}
                self.params, self.opt_state, um = _update(
                    self.graphdef, self.params, self.frozen, self.opt_state, mb, optimizer=self.optimizer,
                    algo=a, temperature=temperature, num_micro=num_micro)
                if self.separate_critic:
                    self.critic_params, self.critic_opt_state, cm = _update_critic(
                        self.critic_graphdef, self.critic_params, self.critic_frozen, self.critic_opt_state, mb,
                        optimizer=self.critic_optimizer, algo=a, num_micro=num_micro)
                    cm = _critic_metrics(cm)
                    um = {**um, **cm, "nonfinite": jnp.maximum(um["nonfinite"], cm["nonfinite"])}
                update_metrics.append(jax.device_get(um))
        t_update = time.perf_counter() - t2
        for k in update_metrics[0]:
            metrics[k] = float(np.mean([float(u[k]) for u in update_metrics]))
        metrics.update(roll.reward_metrics)
        lengths = roll.arrays["completion_mask"].sum(-1)
        metrics.update({
            "completion/mean_length": float(lengths.mean()),
            "completion/stopped_frac": float(roll.arrays["finished"].mean()),
            "time/sample_s": t_sample, "time/ref_and_values_s": t_ref, "time/update_s": t_update,
        })
        raise_if_nonfinite(metrics, self.step)
        self._last_rollouts = roll
        return metrics

    @property
    def last_rollouts(self) -> Rollouts:
        """The rollouts of the latest :meth:`step_once` (arrays, texts, examples, per-function rewards)."""
        return self._last_rollouts

    @property
    def last_eval_rollouts(self) -> list[Rollouts]:
        """The rollouts of the latest :meth:`evaluate`, one per batch of 64 held-out prompts."""
        return self._last_eval

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, examples: list[dict] | None = None) -> dict[str, float]:
        """Greedy (by default) completions on held-out prompts: mean of each reward, length."""
        examples = self.eval_examples if examples is None else examples
        key = rng.stream(self.cfg.train.seed, "eval")
        results = {}
        rows = []
        batch = 64
        for start in range(0, len(examples), batch):
            roll = self.sample(examples[start : start + batch], key, repeats=1, evaluation=True)
            rows.append(roll)
        per_fn = {name: np.concatenate([r.per_function[name] for r in rows]) for name in rows[0].per_function}
        for name, values in per_fn.items():
            results[f"eval/{name}"] = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
        lengths = np.concatenate([r.arrays["completion_mask"].sum(-1) for r in rows])
        results["eval/reward"] = float(np.mean(np.concatenate([r.arrays["scores"] for r in rows])))
        results["eval/mean_length"] = float(lengths.mean())
        self._last_eval = rows
        return results

    # ------------------------------------------------------------------ checkpoints
    def _state(self):
        state = {"params": self.params, "opt_state": self.opt_state}
        if self.separate_critic:
            state.update(critic_params=self.critic_params, critic_opt_state=self.critic_opt_state)
        return state

    def save(self, *, force: bool = False) -> None:
        save_state(self.checkpointer, self.step, self._state(), self.iterator, force=force)

    def _restore(self) -> None:
        state, self.step = restore_state(self.checkpointer, self._state(), self.iterator)
        self.params, self.opt_state = state["params"], state["opt_state"]
        if self.separate_critic:
            self.critic_params, self.critic_opt_state = state["critic_params"], state["critic_opt_state"]

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg.train
        logger = MetricsLogger(cfg.run_dir, tensorboard=cfg.tensorboard, total_steps=cfg.steps,
                               progress=cfg.progress, keys_in_bar=("reward/total/mean", "loss"))
        resumed = self.step > 0
        if resumed:
            logger.truncate_after(self.step)
        summary = {}
        try:
            if not resumed:
                summary["before"] = self.evaluate()
                logger.log(0, summary["before"])
                self._write_eval_samples(0)
            run_steps(self, logger, total_steps=cfg.steps, eval_every=cfg.eval_every,
                      after_log=self._maybe_write_samples)
            summary["after"] = self.evaluate()
            logger.log(self.step, summary["after"])
            self._write_eval_samples(self.step)
            self.save(force=True)
        finally:
            self.checkpointer.wait()
            logger.close()
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary

    def _maybe_write_samples(self, logger) -> None:
        every = self.cfg.train.samples_every
        if every and self.step % every == 0:
            self._write_samples(logger)

    def _write_samples(self, logger) -> None:
        roll = self._last_rollouts
        rows = []
        for i, (text, ex) in enumerate(zip(roll.texts, roll.examples)):
            row = {"prompt": ex["prompt"], "completion": text, "answer": ex.get("answer")}
            row.update({f"reward/{k}": float(v[i]) for k, v in roll.per_function.items()})
            rows.append(row)
        logger.log_samples(self.step, rows)

    def _write_eval_samples(self, step: int) -> None:
        with open(os.path.join(self.cfg.train.run_dir, f"eval_samples_step{step}.jsonl"), "w") as f:
            for roll in self._last_eval:
                for i, (text, ex) in enumerate(zip(roll.texts, roll.examples)):
                    row = {"prompt": ex["prompt"], "completion": text, "answer": ex.get("answer")}
                    row.update({k: float(v[i]) for k, v in roll.per_function.items()})
                    f.write(json.dumps(row) + "\n")


def _critic_metrics(metrics: dict) -> dict:
    """A separate critic's update metrics: its loss and gradient norm as ``critic/*``, ``value/*`` as they are."""
    renamed = {"loss": "critic/loss", "grad_norm": "critic/grad_norm"}
    return {renamed.get(k, k): v for k, v in metrics.items()}


def _concat_groups(groups) -> Rollouts:
    """Concatenate (rollouts, row slice) pairs; prompt widths may differ between sampling rounds."""
    width = max(r.arrays["prompt_ids"].shape[1] for r, _ in groups)
    arrays: dict[str, list] = {}
    texts, examples, per_fn = [], [], {}
    for roll, rows in groups:
        for k, v in roll.arrays.items():
            v = v[rows]
            if k in ("prompt_ids", "prompt_mask"):
                pad = width - v.shape[1]
                v = np.pad(v, ((0, 0), (pad, 0)), constant_values=0)
            arrays.setdefault(k, []).append(v)
        texts += roll.texts[rows]
        examples += roll.examples[rows]
        for k, v in roll.per_function.items():
            per_fn.setdefault(k, []).append(v[rows])
    merged = {k: np.concatenate(v) for k, v in arrays.items()}
    metrics = groups[0][0].reward_metrics if len({id(r) for r, _ in groups}) == 1 else _mean_metrics(groups)
    return Rollouts(merged, texts, examples, metrics, {k: np.concatenate(v) for k, v in per_fn.items()})


def _mean_metrics(groups) -> dict[str, Any]:
    rolls = list({id(r): r for r, _ in groups}.values())
    keys = rolls[0].reward_metrics.keys()
    return {k: float(np.mean([r.reward_metrics[k] for r in rolls])) for k in keys}
