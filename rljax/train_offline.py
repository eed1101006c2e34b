"""The offline loop: DPO, reward-model training and learning from scored records.

    run = OfflineTrainer(cfg)   # cfg.algorithm.name in {"dpo", "reward_model", "offline"}
    run.fit()                   # step = one batch of pairs / ranked lists / records -> one update

One batch, top to bottom (``OfflineTrainer.step_once``): rows of the data set (tokenised once, at
start) → ``make_batch`` (prompts left-padded, responses right-padded, widths bucketed) → for DPO,
the cached reference log-probs (computed once by ``_cache_reference``, before any update, so no
reference copy of the model is kept; or from a live reference with
``offline.precompute_ref_logprobs: false``) → ``_update`` (jitted and donated, around
``rljax.update.apply_update``, the online loop's update too: gradient accumulation over
micro-batches in ``lax.scan`` with the batch's global pair / token counts, AdamW, and a refusal to
apply a non-finite update). The step loop and checkpoint round trip are ``rljax.loop``'s, as online.

The run directory is laid out as the online loop's: ``config.yaml``, ``metrics.jsonl`` (with
``eval/*`` on the held-out split before and after training and every ``train.eval_every``
steps), ``checkpoints/`` (``--resume`` continues exactly), ``summary.json``, and ``model/`` (a
Hugging Face directory; the reward model's value head in ``value_head.safetensors`` plus
``rljax_reward_model.json``, which the ``reward_model`` reward reads).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.algorithms import dpo, offline, reward_model
from rljax.checkpoint import Checkpointer
from rljax.config import save_config
from rljax.data.batching import PromptIterator, default_buckets, pad_token_id
from rljax.data.preferences import (
    load_preference_pairs,
    load_ranked_lists,
    pairs_from_task,
    ranked_from_task,
    strip_prefix,
    tokenize_response,
)
from rljax.data.prompts import format_prompt
from rljax.data.records import load_scored_records, records_from_task
from rljax.data.tasks import make_task, question_split
from rljax.loop import restore_state, run_steps, save_state
from rljax.metrics_log import MetricsLogger
from rljax.models import load
from rljax.models.lora import add_lora, lora_trainable, zero_adapters
from rljax.run_config import OFFLINE_ALGORITHMS, OfflineSection, RunConfig
from rljax.update import apply_update, optimizer_for, raise_if_nonfinite

ALGORITHMS = {"dpo": dpo, "reward_model": reward_model, "offline": offline}
REWARD_MODEL_META = "rljax_reward_model.json"
# The fields of the offline section that the jitted losses read. `_update` gets a config holding
# only these (the rest at their defaults), so runs that differ elsewhere (data, batching, cached vs
# live reference) share compiled programs.
LOSS_FIELDS = ("loss_type", "beta", "label_smoothing", "simpo_gamma", "reference_free", "rm_loss", "centering_coef",
               "margin_column", "odpo_alpha", "reduction")


def loss_config(cfg: OfflineSection) -> OfflineSection:
    """``cfg`` reduced to ``LOSS_FIELDS`` (a static argument of the jitted update)."""
    return OfflineSection(**{name: getattr(cfg, name) for name in LOSS_FIELDS})


# ---------------------------------------------------------------------------------------------
# jitted pure functions


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "algo", "cfg", "num_micro"),
                   donate_argnames=("params", "opt_state"))
def _update(graphdef, params, frozen, opt_state, batch, *, optimizer, algo, cfg, num_micro):
    """One optimizer step on a batch split into ``num_micro`` micro-batches: ``rljax.update.apply_update``
    with ``ALGORITHMS[algo].loss``, normalised by the whole batch's totals (``batch_totals``)."""
    module = ALGORITHMS[algo]
    return apply_update(graphdef, params, frozen, opt_state, batch, loss_fn=functools.partial(module.loss, cfg=cfg),
                        totals=module.batch_totals(batch, cfg), optimizer=optimizer, num_micro=num_micro)


_SCORE_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def _score(graphdef, params, frozen, batch, *, kind):
    """No-gradient scores of every response: ``(logps, lengths)`` or ``(rewards, lengths)``, ``[B, K]``."""
    return _score_jit(graphdef, params, frozen, {k: batch[k] for k in _SCORE_KEYS}, kind=kind)


@functools.partial(jax.jit, static_argnames=("graphdef", "kind"))
def _score_jit(graphdef, params, frozen, batch, *, kind):
    model = nnx.merge(graphdef, params, frozen)
    if kind == "rewards":
        lengths = jnp.sum(batch["response_mask"] != 0, axis=-1).astype(jnp.float32)
        return reward_model.response_rewards(model, batch), lengths
    return dpo.sequence_logps(model, batch)


# ---------------------------------------------------------------------------------------------
# data: rows -> tokens -> batches


@dataclasses.dataclass
class EncodedSet:
    """A tokenised split: per row a prompt and ``K`` responses (token lists), and per-row values."""

    rows: list[dict[str, Any]]
    prompts: list[list[int]]
    responses: list[list[list[int]]]  # [n][k] token ids
    values: dict[str, np.ndarray]  # name -> [n, ...] (margin, weight, score, ref_logps)

    def __len__(self) -> int:
        return len(self.rows)


def _bucket(length: int, buckets: tuple[int, ...]) -> int:
    return next((b for b in buckets if b >= length), buckets[-1])


def make_batch(data: EncodedSet, indices, *, num_responses: int, pad_id: int, prompt_buckets, response_buckets,
               rows: int | None = None) -> dict[str, np.ndarray]:
    """Arrays for ``data``'s rows ``indices`` (padded with empty rows, ``row_mask`` 0, to ``rows``)."""
    indices = [int(i) for i in indices]
    rows = len(indices) if rows is None else rows
    P = _bucket(max(len(data.prompts[i]) for i in indices), prompt_buckets)
    N = _bucket(max(len(r) for i in indices for r in data.responses[i]), response_buckets)
    K = num_responses
    prompt_ids = np.full((rows, P), pad_id, np.int32)
    prompt_mask = np.zeros((rows, P), np.int32)
    response_ids = np.full((rows, K, N), pad_id, np.int32)
    response_mask = np.zeros((rows, K, N), np.int32)
    response_valid = np.zeros((rows, K), np.int32)
    row_mask = np.zeros((rows,), np.int32)
    for b, i in enumerate(indices):
        p = data.prompts[i]
        prompt_ids[b, P - len(p):], prompt_mask[b, P - len(p):] = p, 1
        for k, r in enumerate(data.responses[i]):
            response_ids[b, k, :len(r)], response_mask[b, k, :len(r)] = r, 1
            response_valid[b, k] = 1
        row_mask[b] = 1
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                 response_mask=response_mask, response_valid=response_valid, row_mask=row_mask)
    for name, values in data.values.items():
        out = np.zeros((rows, *values.shape[1:]), values.dtype)
        out[:len(indices)] = values[indices]
        batch[name] = out
    return batch


def split_by_prompt(rows: list[dict], *, eval_fraction: float, eval_size: int, seed: int) -> tuple[list, list]:
    """Train / held-out rows: a prompt is held out when a hash of (seed, its key) falls below
    ``eval_fraction``; held-out prompts beyond ``eval_size`` rows go back to train. All rows of a
    prompt stay in one split."""
    if eval_fraction <= 0:
        return list(rows), []
    held = [question_split(r["key"], task="offline", seed=seed, eval_fraction=eval_fraction) == "eval" for r in rows]
    eval_keys, count = set(), 0
    sizes: dict[str, int] = {}
    for r, h in zip(rows, held):
        if h:
            sizes[r["key"]] = sizes.get(r["key"], 0) + 1
    for key, n in sizes.items():
        if count + n > eval_size:
            break
        eval_keys.add(key)
        count += n
    return [r for r in rows if r["key"] not in eval_keys], [r for r in rows if r["key"] in eval_keys]


# ---------------------------------------------------------------------------------------------
# the trainer


class OfflineTrainer:
    """Model split into (graphdef, trainable, frozen), the tokenised train / held-out splits, optimizer."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, write_config: bool = True,
                 evaluate_only: bool = False):
        """``evaluate_only``: for ``rljax eval``; DPO then caches reference log-probs of the
        held-out split only (``fit`` refuses to run)."""
        if cfg.algorithm.name not in OFFLINE_ALGORITHMS:
            raise ValueError(f"OfflineTrainer runs {OFFLINE_ALGORITHMS}; {cfg.algorithm.name!r} is online "
                             "(rljax.train.Trainer)")
        self.cfg, self.algo, o = cfg, cfg.algorithm.name, cfg.offline
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        dtype = jnp.bfloat16 if cfg.model.dtype == "bfloat16" else jnp.float32
        model, self.tokenizer = load(cfg.model.name, dtype=dtype, value_head=self.algo == "reward_model",
                                     scan_layers=cfg.model.scan_layers)
        if cfg.model.lora_rank:
            model = add_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                             targets=cfg.model.lora_targets, seed=cfg.train.seed)
            self.graphdef, self.params, self.frozen = nnx.split(model, lora_trainable(), ...)
        else:
            self.graphdef, self.params, self.frozen = nnx.split(model, nnx.Param, ...)
        self.pad_id = pad_token_id(self.tokenizer)
        self.prompt_buckets = default_buckets(cfg.data.max_prompt_length)
        self.response_buckets = default_buckets(o.max_completion_length)

        train_rows, eval_rows, self.data_counts = self._load_rows()
        self.train_set = self._encode(train_rows, "train")
        self.eval_set = self._encode(eval_rows, "eval")
        if self.algo == "offline":
            self._weigh(self.train_set, "train")
            self._weigh(self.eval_set, "eval")
        if len(self.train_set) < o.batch_size:
            raise ValueError(f"the train split has {len(self.train_set)} usable rows, fewer than "
                             f"offline.batch_size={o.batch_size}")
        self.num_responses = max([len(r) for s in (self.train_set, self.eval_set) for r in s.responses] or [1])

        # DPO's reference: the model as loaded (LoRA: adapters' B are zero), before any update.
        self.ref_params = None
        self.ref_seconds = 0.0
        self._ref_is_initial_policy = False
        if self.algo == "dpo":
            if not dpo.needs_reference(o):
                for s in (self.train_set, self.eval_set):
                    s.values["ref_logps"] = np.zeros((len(s), 2), np.float32)
            elif o.precompute_ref_logprobs:
                t0 = time.perf_counter()
                for s in (self.eval_set,) if evaluate_only else (self.train_set, self.eval_set):
                    s.values["ref_logps"] = self._score_set(s, "logps", self._reference())[0]
                self.ref_seconds = time.perf_counter() - t0
                self._ref_is_initial_policy = True
            elif not cfg.model.lora_rank:
                self.ref_params = jax.tree.map(jnp.copy, self.params)
            if not o.precompute_ref_logprobs and dpo.needs_reference(o):
                self.eval_set.values["ref_logps"] = self._score_set(self.eval_set, "logps", self._reference())[0]
                self._ref_is_initial_policy = True

        self.iterator = PromptIterator(self.train_set.rows, o.batch_size, seed=cfg.train.seed)
        self.total_steps = (max(1, math.ceil(o.epochs * len(self.iterator))) if o.epochs > 0 else cfg.train.steps)
        self.num_micro = o.batch_size // (o.micro_batch_size or o.batch_size)
        self.loss_cfg = loss_config(o)
        self.optimizer = optimizer_for(cfg.optim, self.total_steps)
        self.opt_state = self.optimizer.init(self.params)
        self.step = 0
        self.evaluate_only = evaluate_only
        self.checkpointer = Checkpointer(os.path.join(cfg.train.run_dir, "checkpoints"),
                                         save_every=cfg.train.save_every, max_to_keep=2)
        if resume:
            self._restore()
        if write_config:
            save_config(cfg, os.path.join(cfg.train.run_dir, "config.yaml"))

    # ------------------------------------------------------------------ data
    def _load_rows(self) -> tuple[list[dict], list[dict], dict[str, int]]:
        cfg, d, o = self.cfg, self.cfg.data, self.cfg.offline
        kind = self._row_kind()
        counts: dict[str, int] = {}
        if d.path:
            rows, counts = self._read(d.path, kind)
            if o.eval_path:
                train, (evals, eval_counts) = rows, self._read(o.eval_path, kind)
                counts.update({f"eval_{k}": v for k, v in eval_counts.items()})
                evals = evals[: d.eval_size] if d.eval_size else evals
            else:
                train, evals = split_by_prompt(rows, eval_fraction=o.eval_fraction, eval_size=d.eval_size,
                                               seed=cfg.train.seed)
            train = train[: d.train_size] if d.train_size else train
        else:
            options = dict(d.task_options)
            seed = cfg.train.seed
            train_ex = make_task(d.task, split="train", size=d.train_size, seed=seed, **options)
            eval_ex = make_task(d.task, split="eval", size=d.eval_size, seed=seed, **options) if d.eval_size else []
            if kind == "pairs":
                train, evals = pairs_from_task(train_ex, seed=seed), pairs_from_task(eval_ex, seed=seed + 1)
            elif kind == "ranked":
                train = ranked_from_task(train_ex, num_responses=o.task_responses, seed=seed)
                evals = ranked_from_task(eval_ex, num_responses=o.task_responses, seed=seed + 1)
            else:
                train = records_from_task(train_ex, responses_per_prompt=o.task_responses, seed=seed)
                evals = records_from_task(eval_ex, responses_per_prompt=o.task_responses, seed=seed + 1)
        return train, evals, counts

    def _row_kind(self) -> str:
        if self.algo == "offline":
            return "records"
        return "ranked" if self.algo == "reward_model" and self.cfg.offline.rm_loss == "kwise" else "pairs"

    def _read(self, source: str, kind: str):
        d, o = self.cfg.data, self.cfg.offline
        if kind == "pairs":
            return load_preference_pairs(source, prompt_column=d.prompt_column, chosen_column=o.chosen_column,
                                         rejected_column=o.rejected_column, margin_column=o.margin_column or None,
                                         invalid=o.invalid_rows)
        if kind == "ranked":
            return load_ranked_lists(source, prompt_column=d.prompt_column, ranked_column=o.ranked_column,
                                     invalid=o.invalid_rows)
        return load_scored_records(source, prompt_column=d.prompt_column, response_column=o.response_column,
                                   score_column=o.score_column, invalid=o.invalid_rows)

    def _responses_of(self, row: dict) -> list[str]:
        if "responses" in row:
            return list(row["responses"])
        if "response" in row:
            return [row["response"]]
        return [row["chosen"], row["rejected"]]

    def format(self, prompt) -> str:
        """The rendered prompt text (chat template, system prompt and assistant prefix as ``data`` says)."""
        d = self.cfg.data
        return format_prompt(self.tokenizer, prompt, system_prompt=d.system_prompt or None, chat=d.chat,
                             assistant_prefix=d.assistant_prefix)

    def _encode(self, rows: list[dict], split: str) -> EncodedSet:
        """Tokenise once; too-long prompts / responses are an error, dropped or truncated as configured."""
        d, o = self.cfg.data, self.cfg.offline
        texts = [self.format(r["prompt"]) for r in rows]
        prompt_tokens = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        kept_rows, prompts, responses = [], [], []
        dropped = {"prompt_too_long": 0, "response_too_long": 0}
        for i, (row, p) in enumerate(zip(rows, prompt_tokens)):
            if len(p) > d.max_prompt_length:
                if d.too_long == "error":
                    raise ValueError(f"{split} row {i}: the prompt is {len(p)} tokens, over data.max_prompt_length="
                                     f"{d.max_prompt_length} (raise it, or set data.too_long=filter to drop such rows)")
                dropped["prompt_too_long"] += 1
                continue
            if not p:
                raise ValueError(f"{split} row {i}: the prompt renders to zero tokens")
            # with data.assistant_prefix the prompt ends with it; a response that repeats it (as online
            # rollouts' texts do) has it removed, so the loss covers only what the model wrote
            rs = [tokenize_response(self.tokenizer, strip_prefix(t, d.assistant_prefix), append_eos=o.append_eos)
                  for t in self._responses_of(row)]
            if any(len(r) > o.max_completion_length for r in rs):
                if o.completion_too_long == "error":
                    longest = max(map(len, rs))
                    raise ValueError(f"{split} row {i}: a response is {longest} tokens, over offline.max_completion_"
                                     f"length={o.max_completion_length} (raise it, or set offline.completion_too_long "
                                     "to filter or truncate)")
                if o.completion_too_long == "filter":
                    dropped["response_too_long"] += 1
                    continue
                rs = [r[: o.max_completion_length] for r in rs]
            if any(not r for r in rs):
                raise ValueError(f"{split} row {i}: a response tokenises to zero tokens")
            kept_rows.append(row)
            prompts.append(list(p))
            responses.append(rs)
        for reason, n in dropped.items():
            if n:
                self.data_counts[f"{split}_dropped/{reason}"] = n
        values: dict[str, np.ndarray] = {}
        if kept_rows and "margin" in kept_rows[0]:
            values["margin"] = np.asarray([r["margin"] for r in kept_rows], np.float32)
        if kept_rows and "score" in kept_rows[0]:
            values["score"] = np.asarray([r["score"] for r in kept_rows], np.float32)
        return EncodedSet(kept_rows, prompts, responses, values)

    def _weigh(self, data: EncodedSet, split: str) -> None:
        """Record weights (offline): computed over the split, records a filter rejects removed."""
        o = self.cfg.offline
        weights, keep = offline.record_weights(
            data.values.get("score", np.zeros(0)), [r["key"] for r in data.rows], mode=o.records_mode,
            temperature=o.temperature, max_weight=o.max_weight, baseline=o.baseline, threshold=o.score_threshold)
        data.values["weight"] = weights
        if split == "train" and not keep.all():
            self.data_counts["train_filtered_out"] = int((~keep).sum())
            index = np.flatnonzero(keep)
            data.rows = [data.rows[i] for i in index]
            data.prompts = [data.prompts[i] for i in index]
            data.responses = [data.responses[i] for i in index]
            data.values = {k: v[index] for k, v in data.values.items()}

    def batch(self, data: EncodedSet, indices, *, rows: int | None = None) -> dict[str, np.ndarray]:
        return make_batch(data, indices, num_responses=self.num_responses, pad_id=self.pad_id,
                          prompt_buckets=self.prompt_buckets, response_buckets=self.response_buckets, rows=rows)

    def _reference(self):
        if self.ref_params is not None:
            return self.ref_params
        # LoRA: the base model (adapters' B zeroed); full fine-tuning before any update: the params.
        return zero_adapters(self.params) if self.cfg.model.lora_rank else self.params

    def _score_set(self, data: EncodedSet, kind: str, params) -> tuple[np.ndarray, np.ndarray]:
        """``[n, K]`` log-probs (or rewards) and lengths of every response in ``data``, no gradient."""
        size = self.cfg.offline.eval_batch_size
        scores, lengths = [], []
        for start in range(0, len(data), size):
            idx = range(start, min(start + size, len(data)))
            s, n = _score(self.graphdef, params, self.frozen, self.batch(data, idx, rows=size), kind=kind)
            scores.append(np.asarray(s)[: len(idx)])
            lengths.append(np.asarray(n)[: len(idx)])
        if not scores:
            return np.zeros((0, self.num_responses), np.float32), np.zeros((0, self.num_responses), np.float32)
        return np.concatenate(scores), np.concatenate(lengths)

    # ------------------------------------------------------------------ one step
    def step_once(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = {k: jnp.asarray(v) for k, v in self.batch(self.train_set, self.iterator.next_indices()).items()}
        metrics: dict[str, float] = {}
        if self.algo == "dpo" and not self.cfg.offline.precompute_ref_logprobs and dpo.needs_reference(self.cfg.offline):
            t1 = time.perf_counter()
            batch["ref_logps"] = _score(self.graphdef, self._reference(), self.frozen, batch, kind="logps")[0]
            metrics["time/ref_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        self.params, self.opt_state, um = _update(
            self.graphdef, self.params, self.frozen, self.opt_state, batch, optimizer=self.optimizer,
            algo=self.algo, cfg=self.loss_cfg, num_micro=self.num_micro)
        um = jax.device_get(um)
        metrics.update({k: float(v) for k, v in um.items()})
        metrics["time/update_s"] = time.perf_counter() - t2
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["epoch"] = self.iterator.epoch + self.iterator.index / max(len(self.train_set), 1)
        raise_if_nonfinite(metrics, self.step)
        return metrics

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, data: EncodedSet | None = None) -> dict[str, float]:
        """The training objective and its metrics on the held-out split (``eval/*``)."""
        data = self.eval_set if data is None else data
        if not len(data):
            return {}
        o = self.cfg.offline
        kind = "rewards" if self.algo == "reward_model" else "logps"
        if self.algo == "dpo" and data is self.eval_set and self.step == 0 and self._ref_is_initial_policy:
            # before any update the policy is the reference: its log-probs are the cached ones
            scores = data.values["ref_logps"]
            lengths = np.asarray([[len(r) for r in rs] for rs in data.responses], np.float32)
        else:
            scores, lengths = self._score_set(data, kind, self.params)
        row_mask = jnp.ones((len(data),), jnp.int32)
        if self.algo == "dpo":
            margin = data.values.get("margin")
            loss, metrics = dpo.pair_loss(jnp.asarray(scores), jnp.asarray(lengths), jnp.asarray(data.values["ref_logps"]),
                                          row_mask, o, margin=None if margin is None else jnp.asarray(margin))
        elif self.algo == "reward_model":
            masks = {"row_mask": row_mask, "response_valid": jnp.asarray(lengths > 0, jnp.int32),
                     **{k: jnp.asarray(v) for k, v in data.values.items()}}
            loss, metrics = reward_model.rm_loss(jnp.asarray(scores), masks, o)
        else:
            return self._evaluate_records(data, scores[:, 0], lengths[:, 0])
        out = {"eval/loss": float(loss)}
        out.update({f"eval/{k}": float(v) for k, v in metrics.items() if not k.endswith("/loss")})
        return out

    def _evaluate_records(self, data: EncodedSet, logps: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
        """Held-out records: the weighted objective, NLL, and whether likelihood follows the score."""
        per_token = logps / np.maximum(lengths, 1)
        score, weight = data.values["score"], data.values["weight"]
        loss = -np.sum(weight * logps) / max(lengths[weight > 0].sum(), 1)  # token_mean of the objective
        out = {"eval/loss": float(loss), "eval/nll": float(-logps.sum() / max(lengths.sum(), 1))}
        median = float(np.median(score))
        high, low = score > median, score <= median
        if high.any() and low.any():
            out["eval/logp_high"] = float(per_token[high].mean())
            out["eval/logp_low"] = float(per_token[low].mean())
            out["eval/logp_gap"] = out["eval/logp_high"] - out["eval/logp_low"]
        # same-prompt pairs with different scores: does the better response get the higher
        # per-token log-prob?
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(data.rows):
            groups.setdefault(r["key"], []).append(i)
        right = total = 0
        for rows in groups.values():
            for a in rows:
                for b in rows:
                    if score[a] > score[b]:
                        total += 1
                        right += per_token[a] > per_token[b]
        if total:
            out["eval/pair_accuracy"] = right / total
        return out

    # ------------------------------------------------------------------ checkpoints
    def _state(self):
        return {"params": self.params, "opt_state": self.opt_state}

    def save(self, *, force: bool = False) -> None:
        save_state(self.checkpointer, self.step, self._state(), self.iterator, force=force)

    def _restore(self) -> None:
        state, self.step = restore_state(self.checkpointer, self._state(), self.iterator)
        self.params, self.opt_state = state["params"], state["opt_state"]

    def export(self, directory: str | None = None) -> str:
        """Write the trained model as a Hugging Face directory (LoRA merged; value head included)."""
        from rljax.models.hf_io import save_hf_dir

        directory = directory or os.path.join(self.cfg.train.run_dir, "model")
        model = nnx.merge(self.graphdef, self.params, self.frozen)
        save_hf_dir(directory, model, self.tokenizer)
        if self.algo == "reward_model":
            d, o = self.cfg.data, self.cfg.offline
            meta = {"chat": d.chat, "system_prompt": d.system_prompt, "assistant_prefix": d.assistant_prefix,
                    "max_prompt_length": d.max_prompt_length,
                    "max_completion_length": o.max_completion_length, "append_eos": o.append_eos,
                    "trained_steps": self.step, "base_model": self.cfg.model.name}
            with open(os.path.join(directory, REWARD_MODEL_META), "w") as f:
                json.dump(meta, f, indent=2)
        return directory

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        if self.evaluate_only:
            raise RuntimeError("this OfflineTrainer was built with evaluate_only=True; it cannot train")
        cfg = self.cfg.train
        logger = MetricsLogger(cfg.run_dir, tensorboard=cfg.tensorboard, total_steps=self.total_steps,
                               progress=cfg.progress, keys_in_bar=("loss", "rewards/accuracy"))
        resumed = self.step > 0
        if resumed:
            logger.truncate_after(self.step)
        summary: dict[str, Any] = {"data": {"train_rows": len(self.train_set), "eval_rows": len(self.eval_set),
                                            **self.data_counts}}
        start = time.perf_counter()
        try:
            if not resumed:
                summary["before"] = self.evaluate()
                logger.log(0, {**summary["before"], **{f"data/{k}": v for k, v in summary["data"].items()},
                               "time/ref_cache_s": self.ref_seconds})
            run_steps(self, logger, total_steps=self.total_steps, eval_every=cfg.eval_every)
            train_seconds = time.perf_counter() - start
            summary["after"] = self.evaluate()
            logger.log(self.step, summary["after"])
            self.save(force=True)
            if self.cfg.offline.save_model:
                summary["model_dir"] = self.export()
        finally:
            self.checkpointer.wait()
            logger.close()
        summary.update(steps=self.step, train_seconds=round(train_seconds, 2), ref_cache_seconds=round(self.ref_seconds, 2))
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary


def trainer_for(cfg: RunConfig, **kwargs):
    """The loop ``cfg.algorithm.name`` runs in: ``OfflineTrainer`` or the online ``rljax.train.Trainer``."""
    if cfg.algorithm.name in OFFLINE_ALGORITHMS:
        return OfflineTrainer(cfg, **kwargs)
    from rljax.train import Trainer

    return Trainer(cfg, **kwargs)


__all__ = ["ALGORITHMS", "EncodedSet", "OfflineSection", "OfflineTrainer", "make_batch", "split_by_prompt",
           "trainer_for"]
