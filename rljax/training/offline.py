"""Offline training from a fixed data set: any ``OfflineAlgorithm`` (DPO and variants, reward
models, scored records), with no branch on its name.

    trainer = OfflineTrainer(cfg)       # build_run + rows tokenised once (+ cached reference log-probs)
    summary = trainer.fit()             # rljax.training.loop.fit

One step, top to bottom (:meth:`OfflineTrainer.step_once`): the next rows of the train split ->
``rljax.data.kinds.collate`` (prompts left-padded, completions right-padded, widths bucketed) ->
reference log-probs (cached once before training unless ``precompute_ref_logprobs: false``) ->
:func:`offline_update` (``rljax.update.apply_update`` with the algorithm's loss and the batch's
global totals). Evaluation scores every held-out completion without gradient and hands the scores
to the algorithm's ``evaluate`` (the training objective's own functions). The run directory holds
``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``summary.json`` and (``train.save_model``)
``model/`` and, for LoRA, ``adapter/`` (``rljax.training.export``; a reward model's directory also
holds ``value_head.safetensors`` and ``rljax_reward_model.json``, which the ``reward_model`` reward
reads).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from rljax.algorithms import get as get_algorithm
from rljax.data.batching import PromptIterator, default_buckets, pad_token_id
from rljax.data.encoded import EncodedSet
from rljax.data.kinds import collate, get_kind
from rljax.data.prompts import format_prompt
from rljax.distributed import place_batch, to_host
from rljax.run_config import RunConfig
from rljax.sharding import keep_shardings, shardings_of
from rljax.training import loop
from rljax.training.data import offline_rows
from rljax.training.export import export_run
from rljax.training.run import build_run
from rljax.training.spec import offline_updates, run_spec
from rljax.update import apply_update, optimizer_for, raise_if_nonfinite

@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "algorithm", "cfg", "num_micro"),
                   donate_argnames=("params", "opt_state"))
def offline_update(graphdef, params, frozen, opt_state, batch, *, optimizer, algorithm: str, cfg, num_micro: int):
    """One optimizer step on a batch split into ``num_micro`` micro-batches: ``apply_update`` with the
    algorithm's loss, normalised by the whole batch's totals."""
    algo = get_algorithm(algorithm)
    return apply_update(graphdef, params, frozen, opt_state, batch, loss_fn=functools.partial(algo.loss, cfg=cfg),
                        totals=algo.totals(batch, cfg), optimizer=optimizer, num_micro=num_micro)


@functools.partial(jax.jit, static_argnames=("graphdef", "algorithm"))
def score_batch(graphdef, params, frozen, batch, *, algorithm: str):
    """The algorithm's no-gradient scores of every completion: ``(scores [B, K], lengths [B, K])``."""
    return get_algorithm(algorithm).score(nnx.merge(graphdef, params, frozen), batch)


class OfflineTrainer:
    """A run (``rljax.training.run.Run``) plus the tokenised train / held-out splits."""

    log_keys = ("loss", "rewards/accuracy")

    def __init__(self, cfg: RunConfig, *, resume: bool = False, write_config: bool = True,
                 evaluate_only: bool = False, overwrite: bool = False, resume_step: int | None = None):
        """``evaluate_only`` (``rljax eval``): reference log-probs are cached for the held-out split only.
        ``resume``, ``resume_step``, ``write_config`` and ``overwrite``: as ``rljax.training.run.build_run``."""
        self.algorithm = get_algorithm(cfg.algorithm.name)
        if self.algorithm.online:
            raise ValueError(f"{cfg.algorithm.name} is an online algorithm (rljax.training.online.OnlineTrainer)")
        self.cfg, a, d = cfg, cfg.algorithm, cfg.data
        self.kind = self.algorithm.data_kind(a)
        # rows first: the schedule's length (epochs) depends on the train split's size
        train_rows, eval_rows, self.data_counts = offline_rows(cfg, self.kind)
        spec = run_spec(cfg, train_rows=len(train_rows))
        needs_ref, live_reference = spec.needs_reference, spec.keep_reference
        self.run = build_run(cfg, **spec.build_args(), resume=resume, write_config=write_config, overwrite=overwrite,
                             resume_step=resume_step, defer_restore=True)
        with self.run.released_on_error():  # a failed set-up frees the run directory
            tokenizer = self.run.tokenizer
            self.pad_id = pad_token_id(tokenizer)
            # four widths per octave (rljax.buckets; at most a fifth padding): rm_vs_trl's pairs
            # (34-token prompts) are packed rows of 40 + 2 x 16 = 72 token-positions, not 48 + 2 x 16 = 80.
            self.prompt_buckets = default_buckets(d.max_prompt_length)
            self.completion_buckets = default_buckets(a.max_completion_length)
            self.train_set = self._encode(train_rows, "train")
            self.eval_set = self._encode(eval_rows, "eval")
            if len(self.train_set) < a.batch_size:
                raise ValueError(f"the train split has {len(self.train_set)} usable rows, fewer than "
                                 f"algorithm.batch_size={a.batch_size}")
            self.num_completions = max([len(c) for s in (self.train_set, self.eval_set) for c in s.completions] or [1])
            self.iterator = PromptIterator(self.train_set.rows, a.batch_size, seed=cfg.train.seed)
            self.total_steps = self._total_steps_for(len(self.train_set))
            if self.total_steps != self._total_steps_for(len(train_rows)):
                # rows were dropped or filtered: the schedule's length changes (the AdamW state does not)
                self.run.policy.optimizer = optimizer_for(cfg.optim, self.total_steps)
            # the reference's log-probs: cached once (before any update, so no reference copy is kept)
            self.ref_seconds = 0.0
            self.initial_policy_is_reference = needs_ref
            if needs_ref:
                t0 = time.perf_counter()
                sets = (self.eval_set,) if (evaluate_only or live_reference) else (self.train_set, self.eval_set)
                with loop.mesh_of(self.run):
                    for s in sets:
                        s.values["ref_logps"] = self._score_set(s, self.run.reference())[0]
                self.ref_seconds = time.perf_counter() - t0
            self.live_reference = live_reference
            self.evaluate_only = evaluate_only
            if resume:  # after the reference cache: the reference is the initial policy
                self.iterator.load_state_dict(self.run.restore(resume_step)["data"])
            if write_config:
                self.run.save_config()

    def replace_train_split(self, path: str) -> int:
        """Train from now on on the rows of ``path`` (read as ``data.path`` is: same columns, same
        train/held-out rule; the held-out split is kept) and return how many are usable.

        For iterated (online) preference or filtered-imitation training: each round samples from the
        current policy, scores and writes fresh pairs or records, and swaps them in; the parameters,
        optimizer state, schedule and step count carry on. Algorithms with a reference need a kept
        reference copy (``algorithm.precompute_ref_logprobs: false``, full fine-tuning or LoRA) once
        the policy has moved: the cached log-probs of a new split would otherwise be the current
        policy's. A run whose split was replaced cannot be resumed exactly (the checkpoint's data
        position refers to the split of the moment).
        """
        if self.evaluate_only:
            raise RuntimeError("this OfflineTrainer was built with evaluate_only=True; it cannot train")
        needs_ref = self.algorithm.needs_reference(self.cfg.algorithm)
        if needs_ref and not self.live_reference and self.run.step > 0:
            raise ValueError("replace_train_split after an update needs a kept reference: set "
                             "algorithm.precompute_ref_logprobs=false (the cached log-probs would be the current "
                             "policy's, not the reference's)")
        data = dataclasses.replace(self.cfg.data, path=str(path))
        rows, _, counts = offline_rows(dataclasses.replace(self.cfg, data=data), self.kind)
        train_set = self._encode(rows, "train")
        a = self.cfg.algorithm
        if len(train_set) < a.batch_size:
            raise ValueError(f"{path} has {len(train_set)} usable train rows, fewer than "
                             f"algorithm.batch_size={a.batch_size}")
        if needs_ref and not self.live_reference:  # step 0: the policy is still the reference
            with loop.mesh_of(self.run):
                train_set.values["ref_logps"] = self._score_set(train_set, self.run.reference())[0]
        self.train_set = train_set
        self.iterator = PromptIterator(train_set.rows, a.batch_size, seed=self.cfg.train.seed)
        self.data_counts.update({f"replaced/{k}": v for k, v in counts.items()})
        return len(train_set)

    def _total_steps_for(self, rows: int) -> int:
        return offline_updates(self.cfg, rows)

    @property
    def step(self) -> int:
        return self.run.step

    def fit(self) -> dict[str, Any]:
        if self.evaluate_only:
            raise RuntimeError("this OfflineTrainer was built with evaluate_only=True; it cannot train")
        return loop.fit(self)

    # ------------------------------------------------------------------ data
    def format(self, prompt) -> str:
        """The rendered prompt text (chat template, system prompt and assistant prefix as ``data`` says)."""
        d = self.cfg.data
        return format_prompt(self.run.tokenizer, prompt, system_prompt=d.system_prompt or None, chat=d.chat,
                             assistant_prefix=d.assistant_prefix, few_shot=[(shot.user, shot.reply) for shot in d.few_shot])

    def _encode(self, rows: list[dict], split: str) -> EncodedSet:
        d, a = self.cfg.data, self.cfg.algorithm
        data, dropped = get_kind(self.kind).encode(rows, self.run.tokenizer, a, data=d, render=self.format,
                                                   split=split)
        self.data_counts.update({f"{split}_dropped/{k}": v for k, v in dropped.items()})
        if self.algorithm.prepare is not None:
            data, counts = self.algorithm.prepare(data, a, split)
            self.data_counts.update(counts)
        return data

    def batch(self, data: EncodedSet, indices, *, rows: int | None = None):
        """The typed batch of ``data``'s rows ``indices`` (padded with empty rows to ``rows``)."""
        return collate(data, indices, kind=self.kind, num_completions=self.num_completions, pad_id=self.pad_id,
                       prompt_buckets=self.prompt_buckets, completion_buckets=self.completion_buckets, rows=rows)

    def _placed(self, batch):
        """A host batch on the run's mesh, rows split over its batch axes (``rljax.distributed.place_batch``)."""
        return place_batch(batch, self.run.mesh, self.run.rules)

    def _score_set(self, data: EncodedSet, params) -> tuple[np.ndarray, np.ndarray]:
        """``[n, K]`` scores (summed log-probs or rewards) and lengths of every completion, no gradient."""
        size, p = self.cfg.algorithm.eval_batch_size, self.run.policy
        scores, lengths = [], []
        for start in range(0, len(data), size):
            idx = range(start, min(start + size, len(data)))
            s, n = score_batch(p.graphdef, params, p.frozen, self._placed(self.batch(data, idx, rows=size)),
                               algorithm=self.algorithm.name)
            scores.append(to_host(s)[: len(idx)])
            lengths.append(to_host(n)[: len(idx)])
        if not scores:
            return np.zeros((0, self.num_completions), np.float32), np.zeros((0, self.num_completions), np.float32)
        return np.concatenate(scores), np.concatenate(lengths)

    # ------------------------------------------------------------------ one step
    @loop.in_run_mesh
    def step_once(self) -> dict[str, float]:
        """One batch, one update; advances ``step``."""
        a, run = self.cfg.algorithm, self.run
        t0 = time.perf_counter()
        batch = self._placed(self.batch(self.train_set, self.iterator.next_indices()))
        metrics: dict[str, float] = {}
        if self.live_reference:  # full fine-tuning: the kept copy; LoRA: the base (adapters' B zeroed)
            t1 = time.perf_counter()
            p = run.policy
            ref, _ = score_batch(p.graphdef, run.reference(), p.frozen, batch, algorithm=self.algorithm.name)
            batch = batch.replace(ref_logps=ref)
            metrics["time/ref_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        p = run.policy
        before = shardings_of((p.params, p.opt_state))
        *state, um = offline_update(p.graphdef, p.params, p.frozen, p.opt_state, batch, optimizer=p.optimizer,
                                    algorithm=a.name, cfg=a, num_micro=a.num_micro)
        p.params, p.opt_state = keep_shardings(tuple(state), before)  # the next step reuses this compile
        metrics.update({k: float(v) for k, v in jax.device_get(um).items()})
        metrics["time/update_s"] = time.perf_counter() - t2
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["epoch"] = self.iterator.epoch + self.iterator.index / max(len(self.train_set), 1)
        raise_if_nonfinite(metrics, run.step)
        run.step += 1
        return metrics

    # ------------------------------------------------------------------ evaluation
    @loop.in_run_mesh
    def evaluate(self, data: EncodedSet | None = None) -> dict[str, float]:
        """The training objective and its metrics on the held-out split (``eval/*``)."""
        data = self.eval_set if data is None else data
        if not len(data):
            return {}
        if data is self.eval_set and self.run.step == 0 and self.initial_policy_is_reference \
                and "ref_logps" in data.values:
            # before any update the policy is the reference: its log-probs are the cached ones
            scores = data.values["ref_logps"]
            lengths = np.asarray([[len(c) for c in cs] for cs in data.completions], np.float32)
        else:
            scores, lengths = self._score_set(data, self.run.policy.params)
        metrics = self.algorithm.evaluate(scores, lengths, data, self.cfg.algorithm)
        return {f"eval/{k}": float(v) for k, v in metrics.items() if k == "loss" or not k.endswith("/loss")}

    # ------------------------------------------------------------------ what fit calls
    def start_metrics(self) -> dict:
        data = {"train_rows": len(self.train_set), "eval_rows": len(self.eval_set), **self.data_counts}
        return {**{f"data/{k}": v for k, v in data.items()}, "time/ref_cache_s": self.ref_seconds}

    def on_step(self, logger) -> None:
        pass

    def on_evaluate(self, step: int) -> None:
        pass

    def on_end(self, summary: dict) -> None:
        summary["data"] = {"train_rows": len(self.train_set), "eval_rows": len(self.eval_set), **self.data_counts}
        summary["ref_cache_seconds"] = round(self.ref_seconds, 2)
        if self.cfg.train.save_model:
            summary.update(export_run(self.run, self.cfg.train.run_dir))


__all__ = ["OfflineTrainer", "offline_update", "score_batch"]
