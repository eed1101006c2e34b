"""Prompts -> encode -> generate -> decode -> score: the one path from prompt text to scored samples.

    fmt = PromptFormat(chat=True, system_prompt=R1_SYSTEM_PROMPT, max_prompt_length=256)
    sampling = sampling_config(cfg.sampling, tokenizer, model.config)
    roll = rollout((graphdef, params, frozen), tokenizer, examples, key, sampling=sampling, fmt=fmt,
                   repeats=8, rewards=build_rewards(cfg.rewards))
    roll.completion_ids, roll.logprobs, roll.scores, roll.texts     # rows example-major

``rollout`` formats each prompt (chat template, system prompt, assistant prefix), tokenises and
left-pads them (``rljax.data.prompts.encode_prompts`` under a ``PromptFormat``), repeats each prompt
``repeats`` times, samples with the jitted KV-cache sampler (``rljax.sampling.generate``), decodes
the completions (the assistant prefix, which the prompt already ends with, is put back in front:
rewards score the whole response) and scores them with a ``RewardSet``. The result,
:class:`Rollout`, is host-side numpy: the trainers turn its arrays into batches, the pair builder
(``rljax.tools.pairs``) and the command line read its texts.

The turn boundary: one call is one assistant turn for every row (prompt tokens in, completion
tokens, their sampler log-probs and a stop flag out). A multi-turn episode is a
sequence of such calls whose prompt is the previous context plus the environment's reply; the
completion mask then marks the policy's tokens only, which is what the losses train on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from rljax.data.batching import pad_token_id
from rljax.data.prompts import PromptFormat, encode_prompts
from rljax.distributed import gather_rows, local_rows, place_batch, to_host
from rljax.inference.batch import generate_batch, generate_batch_versions
from rljax.rewards.base import RewardOutput, RewardSet, reward_metrics
from rljax.sampling import SamplingConfig, generate
from rljax.sharding import batch_shards

__all__ = ["PromptFormat", "Rollout", "concat_rollouts", "encode_prompts", "packing_group", "render_prompt", "rollout",
           "sampling_config", "stop_token_ids"]


def stop_token_ids(tokenizer: Any, model_config: Any) -> tuple[int, ...]:
    """The tokens that end a completion: the sorted union of ``model_config.eos_token_ids`` (None
    entries ignored) and ``tokenizer.eos_token_id`` (if set).

    Both count because they disagree in practice: a chat model's config may list only the base
    model's ``<|endoftext|>`` while its tokenizer (and chat template) ends a turn with ``<|im_end|>``.
    """
    ids = {int(t) for t in (getattr(model_config, "eos_token_ids", None) or ()) if t is not None}
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    return tuple(sorted(ids))


def sampling_config(section: Any, tokenizer: Any, model_config: Any, *, evaluation: bool = False) -> SamplingConfig:
    """The :class:`SamplingConfig` of a run's ``sampling`` section (``rljax.run_config``'s, or anything
    with ``max_new_tokens``, ``temperature``, ``top_k`` (null = off), ``top_p``, ``eval_temperature`` and
    optionally ``ignore_eos``).

    Stops at :func:`stop_token_ids`, pads with ``rljax.data.batching.pad_token_id``. ``evaluation=True``
    samples at ``eval_temperature`` without top-k / top-p truncation (0 = greedy).
    """
    common = dict(max_new_tokens=section.max_new_tokens, stop_token_ids=stop_token_ids(tokenizer, model_config),
                  pad_token_id=pad_token_id(tokenizer), ignore_eos=getattr(section, "ignore_eos", False))
    if evaluation:
        return SamplingConfig(temperature=section.eval_temperature, **common)
    return SamplingConfig(temperature=section.temperature, top_k=section.top_k or 0, top_p=section.top_p, **common)


@dataclasses.dataclass
class Rollout:
    """Sampled and scored completions, host-side (numpy). Rows are example-major: the ``repeats``
    samples of example ``i`` are rows ``i * repeats ... (i + 1) * repeats - 1``.

    ``reward_metrics`` of a :meth:`take` or :func:`concat_rollouts` result are recomputed from its
    rows (``rljax.rewards.base.reward_metrics`` of ``per_function``, ``scores``, ``row_mask``), so
    they always describe exactly the rows held; ``reward/total/*`` then come from the float32
    ``scores`` (equal to ``RewardSet.metrics`` within float32 rounding).
    """

    prompt_ids: np.ndarray  # [R, P] int32, left-padded
    prompt_mask: np.ndarray  # [R, P] int32
    completion_ids: np.ndarray  # [R, N] int32, right-padded
    completion_mask: np.ndarray  # [R, N] int32, 1 up to and including the stop token
    logprobs: np.ndarray  # [R, N] float32, the sampler's log-probs (0 where the mask is 0)
    finished: np.ndarray  # [R] bool, emitted a stop token
    texts: list[str]  # assistant_prefix + decoded completion (special tokens skipped)
    examples: list[dict]  # each row's example, plus "completion_length" (its token count) and "completion_ids"
    scores: np.ndarray | None  # [R] float32 weighted reward total, a missing value counting 0 (None without rewards)
    row_mask: np.ndarray | None  # [R] bool, False where a reward function failed (None without rewards)
    per_function: dict[str, np.ndarray]  # reward name -> [R] float64 unweighted values, NaN = failed
    reward_metrics: dict[str, float]  # RewardSet.metrics of the rows ({} without rewards)
    num_dropped: int = 0  # prompts dropped by too_long="filter" (they have no rows)
    # [R, N] int32, 1 where the policy sampled the token: what the loss trains on. None = the whole
    # completion (single turn); a multi-turn trajectory (rljax.environments.episodes) also holds the
    # environment's tokens, which completion_mask keeps as context.
    policy_mask: np.ndarray | None = None
    # [R, N] int32, the policy version that sampled each token (the asynchronous loop,
    # rljax.training.asynchronous); None = not recorded (every token the current policy's)
    versions: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, rows) -> "Rollout":
        """The rows ``rows`` (indices, a slice or a boolean mask ``[R]``), widths unchanged;
        ``reward_metrics`` recomputed for them, ``num_dropped`` kept."""
        idx = np.arange(len(self))[rows]
        idx = np.atleast_1d(idx)
        return Rollout(
            prompt_ids=self.prompt_ids[idx], prompt_mask=self.prompt_mask[idx],
            completion_ids=self.completion_ids[idx], completion_mask=self.completion_mask[idx],
            logprobs=self.logprobs[idx], finished=self.finished[idx],
            texts=[self.texts[i] for i in idx], examples=[self.examples[i] for i in idx],
            scores=None if self.scores is None else self.scores[idx],
            row_mask=None if self.row_mask is None else self.row_mask[idx],
            per_function={k: v[idx] for k, v in self.per_function.items()},
            reward_metrics=_recompute_metrics(self.scores, self.row_mask, self.per_function, idx),
            num_dropped=self.num_dropped,
            policy_mask=None if self.policy_mask is None else self.policy_mask[idx],
            versions=None if self.versions is None else self.versions[idx],
        )


def _recompute_metrics(scores, row_mask, per_function, idx=None) -> dict[str, float]:
    if scores is None:
        return {}
    if idx is not None:
        scores, row_mask = scores[idx], row_mask[idx]
        per_function = {k: v[idx] for k, v in per_function.items()}
    return reward_metrics(RewardOutput(scores.astype(np.float64), per_function, ~row_mask))


def concat_rollouts(rollouts: Sequence[Rollout], *, pad_id: int = 0) -> Rollout:
    """The rows of ``rollouts`` one after another.

    Widths may differ (prompts bucketed per call, completions cut at different ``max_new_tokens``):
    prompts are re-padded on the left to the widest, completions on the right, with ``pad_id``
    (mask 0, log-prob 0; the ids there are never read). ``reward_metrics`` are recomputed from the
    rows (see :class:`Rollout`); ``num_dropped`` is the sum. All parts must have rewards (with the
    same reward names) or none. ``versions`` are kept where every part has them, else None.
    """
    if not rollouts:
        raise ValueError("concat_rollouts needs at least one Rollout")
    with_rewards = {r.scores is not None for r in rollouts}
    if len(with_rewards) > 1:
        raise ValueError("concat_rollouts: some rollouts have rewards and some do not")
    names = {tuple(r.per_function) for r in rollouts}
    if len(names) > 1:
        raise ValueError(f"concat_rollouts: the rollouts have different reward functions: {sorted(names)}")
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    N = max(r.completion_ids.shape[1] for r in rollouts)

    def cat(get, width=None, side="right", value=0):
        parts = []
        for r in rollouts:
            a = get(r)
            if width is not None and a.shape[1] < width:
                extra = width - a.shape[1]
                a = np.pad(a, ((0, 0), (extra, 0) if side == "left" else (0, extra)), constant_values=value)
            parts.append(a)
        return np.concatenate(parts)

    scores = None if rollouts[0].scores is None else cat(lambda r: r.scores)
    row_mask = None if rollouts[0].row_mask is None else cat(lambda r: r.row_mask)
    per_function = {k: cat(lambda r, k=k: r.per_function[k]) for k in rollouts[0].per_function}
    return Rollout(
        prompt_ids=cat(lambda r: r.prompt_ids, P, "left", pad_id), prompt_mask=cat(lambda r: r.prompt_mask, P, "left"),
        completion_ids=cat(lambda r: r.completion_ids, N, "right", pad_id),
        completion_mask=cat(lambda r: r.completion_mask, N), logprobs=cat(lambda r: r.logprobs, N),
        finished=cat(lambda r: r.finished),
        texts=[t for r in rollouts for t in r.texts], examples=[e for r in rollouts for e in r.examples],
        scores=scores, row_mask=row_mask, per_function=per_function,
        reward_metrics=_recompute_metrics(scores, row_mask, per_function),
        num_dropped=sum(r.num_dropped for r in rollouts),
        policy_mask=None if all(r.policy_mask is None for r in rollouts)
        else cat(lambda r: r.completion_mask if r.policy_mask is None else r.policy_mask, N),
        versions=None if any(r.versions is None for r in rollouts) else cat(lambda r: r.versions, N),
    )


def _as_example(item: Any, index: int) -> dict:
    if isinstance(item, Mapping):
        if "prompt" not in item:
            raise ValueError(f"example {index} has no 'prompt' key (keys: {sorted(item)})")
        return dict(item)
    if isinstance(item, (str, list, tuple)):  # prompt text or chat messages
        return {"prompt": item if isinstance(item, str) else list(item)}
    raise TypeError(f"example {index} must be a dict with 'prompt', a prompt string or chat messages, "
                    f"got {type(item).__name__}")


def _keep_reward_outputs(rewards: RewardSet, examples: list[dict]) -> None:
    """A reward function that leaves per-sample text in ``fn.last_outputs`` (a judge's raw replies,
    ``rljax.rewards.judge``) has it copied into each row's example as ``reward_outputs[name]``, read
    now, before a later call (the evaluation's) overwrites it; the trainers write it with the samples."""
    for name, fn in rewards.functions.items():
        outputs = getattr(fn, "last_outputs", None)
        if outputs is not None and len(outputs) == len(examples):
            for ex, output in zip(examples, outputs):
                ex.setdefault("reward_outputs", {})[name] = output


def policy_states(policy) -> tuple:
    """The state(s) of a policy given as an nnx module or as its split ``(graphdef, state, ...)``."""
    return tuple(policy[1:]) if isinstance(policy, tuple) else tuple(nnx.split(policy)[1:])


def packing_group(rows: int, group_size: int, micro_batches: int = 1) -> int:
    """``group_size`` when ``rows`` split into ``micro_batches`` equal micro-batches of whole groups whose
    packed rows (one per group) divide over the mesh's batch axes (``rljax.sharding.batch_shards``;
    fewer would leave devices computing the same rows), else 1. The ``prompt_group`` the sampler's
    prefill (``rollout``) and the trainer's passes (``rljax.training.online.rollout_batch``) may use."""
    if group_size < 2 or rows % (group_size * micro_batches) or (rows // group_size // micro_batches) % batch_shards():
        return 1
    return group_size


def rollout(policy, tokenizer: Any, prompts_or_examples: Sequence[Any], key: jax.Array, *,
            sampling: SamplingConfig, fmt: PromptFormat, repeats: int = 1,
            rewards: RewardSet | None = None, engine=None,
            refresh_weights: Callable[[], int] | None = None) -> Rollout:
    """Sample ``repeats`` completions of each prompt with ``policy`` and score them.

    ``policy``: an nnx ``Transformer`` or its split ``(graphdef, state, ...)`` (as
    ``rljax.sampling.generate`` takes). ``prompts_or_examples``: dicts with at least ``"prompt"``
    (text or chat messages; other keys such as ``"answer"`` go to the rewards) or plain prompts.
    Prompts dropped by ``fmt.too_long="filter"`` have no rows (counted in ``num_dropped``). The
    same ``key`` gives the same tokens; ``key`` is passed to the sampler as it is.
    ``engine``: a :class:`rljax.inference.Engine` to sample with (it is given ``policy``'s weights);
    ``None``: the static sampler (``rljax.sampling.generate``). ``refresh_weights`` (engine only):
    called before each engine step, it may give the engine newer weights and returns the policy
    version that step samples with; ``versions`` then holds each token's
    (``rljax.inference.batch.generate_batch_versions``).
    Each row's example gets ``"completion_length"`` (tokens, the stop token included) for
    length-aware rewards and ``"completion_ids"`` (those tokens, a list of ints) for TRL-style rewards. Without ``rewards``: ``scores`` and ``row_mask`` are None.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    examples = [_as_example(item, i) for i, item in enumerate(prompts_or_examples)]
    tok = encode_prompts(tokenizer, [ex["prompt"] for ex in examples], fmt)
    examples = [examples[i] for i in tok.kept]
    prompt_ids = np.repeat(tok.input_ids, repeats, axis=0)  # [R, P], example-major
    prompt_mask = np.repeat(tok.attention_mask, repeats, axis=0)
    R, N = len(prompt_ids), sampling.max_new_tokens
    if refresh_weights is not None and engine is None:
        raise ValueError("refresh_weights needs an engine: the static sampler generates under one set of weights")
    versions = None
    if R:
        # rows split over the active mesh's batch axes (none: the default device); the outputs
        # come back whole to this host (all-gathered when several processes share the batch)
        if engine is not None:
            engine.set_weights(policy_states(policy))
            if refresh_weights is None:
                out = generate_batch(engine, prompt_ids, prompt_mask, key, sampling)
            else:
                out, versions = generate_batch_versions(engine, prompt_ids, prompt_mask, key, sampling,
                                                        refresh_weights)
            mine = slice(0, R)
        else:
            ids, ids_mask = place_batch((prompt_ids, prompt_mask))
            sampled = generate(policy, ids, ids_mask, key, sampling, prompt_group=packing_group(R, repeats))
            mine = local_rows(sampled.tokens)  # the rows whose rewards this process computes
            out = jax.tree.map(to_host, sampled)
        tokens, mask, logprobs, finished = out.tokens, out.mask, out.logprobs, out.finished
    else:  # every prompt filtered out (or none given): no sampler call
        tokens, mask = np.full((0, N), sampling.pad_token_id, np.int32), np.zeros((0, N), np.int32)
        logprobs, finished = np.zeros((0, N), np.float32), np.zeros((0,), bool)
        mine = slice(0, 0)
    lengths = mask.sum(-1)
    texts = [fmt.assistant_prefix + tokenizer.decode(tokens[i, : lengths[i]], skip_special_tokens=True)
             for i in range(R)]
    # completion_ids (the stop token included, as TRL passes them) for TRL-style `python` rewards
    row_examples = [dict(ex, completion_length=int(lengths[i * repeats + j]),
                         completion_ids=tokens[i * repeats + j, : lengths[i * repeats + j]].tolist())
                    for i, ex in enumerate(examples) for j in range(repeats)]
    scores = row_mask = None
    per_function: dict[str, np.ndarray] = {}
    metrics: dict[str, float] = {}
    if rewards is not None:
        if R:
            # each process scores the rows its devices sampled (several processes: then shared)
            local = rewards(texts[mine], row_examples[mine])
            _keep_reward_outputs(rewards, row_examples[mine])
            reward = RewardOutput(gather_rows(local.total, mine, R),
                                  {k: gather_rows(v, mine, R) for k, v in local.per_function.items()},
                                  gather_rows(local.missing, mine, R))
        else:
            reward = RewardOutput(np.zeros(0), {name: np.zeros(0) for name in rewards.names}, np.zeros(0, bool))
        scores = reward.total.astype(np.float32)  # finite: RewardSet refuses totals beyond float32
        row_mask = ~reward.missing
        per_function = reward.per_function
        metrics = rewards.metrics(reward)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=tokens, completion_mask=mask,
                   logprobs=logprobs, finished=finished, texts=texts, examples=row_examples, scores=scores,
                   row_mask=row_mask, per_function=per_function, reward_metrics=metrics,
                   num_dropped=int(tok.dropped), versions=versions)
