"""An LLM judge as a reward: relative scores of a group against a rubric, or P(yes) to a question.

    rewards:
      judge: {type: judge, mode: group, rubric: "...", retries: 2, fallback: 0.0}
      judge_yes: {type: judge, mode: pointwise, question: "Is the answer correct?"}

**group** (as RULER, OpenPipe ART): the completions of one prompt (a GRPO group: the rows of the
batch whose ``example["prompt"]`` is the same) are shown to the judge together, numbered, with the
rubric; it replies with JSON ``{"scores": [{"id": 1, "score": 0.8}, ...]}`` (scores in [0, 1]). Judging
them side by side is easier than absolute scoring, and group-relative advantages need only the
order and spread within a group. A reply that does not give every completion a score is retried
(``retries`` times, sampled at ``retry_temperature`` with a key from ``seed``, the group's text and
the attempt); the attempt with the most scores is kept and completions still without one get
``fallback`` (a float, or ``null`` for "missing": the trainer then leaves the row out). The counts
(``judge_counts``: ``groups``, ``parse_failures``, ``retries``, ``fallback_groups``,
``fallback_scores``) are read and reset by :func:`judge_metrics`, as ``bound_hit_metrics`` does for
bounded verifiers.

**pointwise**: one forward pass per completion reads the judge's next-token distribution after the
question and the answer, ``P(yes) / (P(yes) + P(no))`` with ``P(yes)`` summed over the single-token
spellings of "Yes" (and likewise "No"). No parsing, a smooth score, robust for small judges.

An example with a ``trajectory`` (text: agent episodes, ``rljax.agents``, give their whole
conversation with its tool calls and results) is judged on it instead of on the completion: RULER
scores whole trajectories, not their last reply.

The judge is any model ``rljax.models.load`` reads (``model``; default the run's base model, which
the trainer passes as ``base_model``, else the embedded SmolLM2). Judging is batched
(``batch_size`` prompts per jitted call, widths bucketed); the first attempt decodes greedily, so it
is deterministic and the same batched or one by one. The judge's raw replies are kept per completion
in ``fn.last_outputs`` (the trainer writes them beside the samples).
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.errors import UserError
from rljax.rewards.base import RewardFn, register_reward

DEFAULT_RUBRIC = (
    "- A response that reaches the correct, complete result scores higher than one that does not.\n"
    "- Among responses that reach it, more direct and better-formatted ones score higher.\n"
    "- A response that follows the instructions partly scores above one that ignores them.\n"
    "- Scores are relative: spread them out within the group; equal quality, equal score."
)

DEFAULT_QUESTION = "Is the response correct?"

_GROUP_SYSTEM = (
    "You are a strict grader. You will see one task and several numbered responses to it. Compare "
    "the responses with each other and give each a score between 0 and 1 by this rubric:\n{rubric}\n"
    'Reply with JSON only, exactly in this form: {{"scores": [{{"id": 1, "score": 0.5}}, '
    '{{"id": 2, "score": 0.5}}]}} with one entry for each of the {n} responses.'
)

_POINTWISE_USER = "Task:\n{prompt}\n\nResponse:\n{completion}\n\n{question} Answer Yes or No."


def _as_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + " [...]"


def group_messages(prompt: Any, completions: Sequence[str], *, rubric: str = DEFAULT_RUBRIC,
                   max_chars: int = 2000) -> list[dict[str, str]]:
    """The judge's conversation for one group: system (rubric, reply format), user (the task and the
    numbered responses, each cut to ``max_chars`` characters)."""
    body = "\n\n".join(f'<response id="{i + 1}">\n{_cut(c, max_chars)}\n</response>' for i, c in enumerate(completions))
    return [{"role": "system", "content": _GROUP_SYSTEM.format(rubric=rubric, n=len(completions))},
            {"role": "user", "content": f"Task:\n{_cut(_as_text(prompt), max_chars)}\n\nResponses:\n{body}"}]


def pointwise_messages(prompt: Any, completion: str, *, question: str = DEFAULT_QUESTION,
                       max_chars: int = 2000) -> list[dict[str, str]]:
    """The judge's conversation for one completion: the task, the response and the yes/no question."""
    return [{"role": "user", "content": _POINTWISE_USER.format(prompt=_cut(_as_text(prompt), max_chars),
                                                               completion=_cut(completion, max_chars),
                                                               question=question)}]


def _score_value(value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return min(max(x, 0.0), 1.0) if math.isfinite(x) else math.nan


def _json_objects(text: str):
    """Every JSON object that starts at a ``{`` of ``text`` and parses, in order (code fences,
    prose around the object and trailing text are skipped)."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = decoder.raw_decode(text, start)
            if isinstance(obj, dict):
                yield obj
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)


def parse_group_scores(text: str, n: int) -> np.ndarray:
    """``[n]`` scores in [0, 1] from a judge's reply; NaN for a response it gives none.

    Reads the first JSON object with a ``scores`` key in any of the forms
    ``{"scores": [{"id": 1, "score": 0.8}, ...]}`` (``id`` or ``trajectory_id``, 1-based),
    ``{"scores": [0.8, 0.1]}`` (in order) or ``{"scores": {"1": 0.8, "2": 0.1}}``; failing that, the
    complete ``{"id": .., "score": ..}`` objects of a reply cut short; failing that, the first object
    read as ``{"1": 0.8, ...}``.
    Values are clipped to [0, 1]; ids outside 1..n and values that are not finite numbers are ignored.
    """
    out = np.full(n, np.nan)
    objects = list(_json_objects(text))
    entries = [o for o in objects if ("id" in o or "trajectory_id" in o) and "score" in o]
    obj = next((o for o in objects if "scores" in o), None)
    if obj is None and entries:  # a reply cut short: the complete {"id", "score"} entries it holds
        obj = {"scores": entries}
    if obj is None and objects:
        obj = objects[0]
    if obj is None:
        return out
    scores = obj.get("scores", obj)
    items: list[tuple[Any, Any]] = []
    if isinstance(scores, list):
        for pos, entry in enumerate(scores):
            if isinstance(entry, Mapping):
                items.append((entry.get("id", entry.get("trajectory_id")), entry.get("score")))
            else:
                items.append((pos + 1, entry))
    elif isinstance(scores, Mapping):
        items = list(scores.items())
    for ident, value in items:
        try:
            i = int(str(ident).strip()) - 1
        except (TypeError, ValueError):
            continue
        if 0 <= i < n and math.isnan(out[i]):
            out[i] = _score_value(value)
    return out


YES_WORDS = ("Yes", "yes", " Yes", " yes")
NO_WORDS = ("No", "no", " No", " no")


def yes_no_token_ids(tokenizer, yes: Sequence[str] = YES_WORDS,
                     no: Sequence[str] = NO_WORDS) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids of the spellings of yes and of no that are one token each (others are skipped)."""
    def single(words):
        ids = []
        for w in words:
            toks = tokenizer(w, add_special_tokens=False)["input_ids"]
            if len(toks) == 1 and toks[0] not in ids:
                ids.append(toks[0])
        return tuple(ids)

    ids = single(yes), single(no)
    if not ids[0] or not ids[1]:
        raise UserError(f"the judge's tokenizer has no single-token spelling of {yes if not ids[0] else no} "
                        "(a pointwise judge reads the probability of one yes token against one no token)")
    if set(ids[0]) & set(ids[1]):
        raise ValueError("a token spells both yes and no")
    return ids


@functools.cache
def _jitted_last_logprobs():
    """``(graphdef, state, ids, mask) -> [B, V]`` log-softmax of the next-token logits after
    left-padded prompts; built on first use so that importing rewards does not import JAX."""
    import jax
    from flax import nnx

    def last(graphdef, state, ids, mask):
        model = nnx.merge(graphdef, state)
        hidden, _ = model.forward(ids, mask)
        return jax.nn.log_softmax(model.logits(hidden[:, -1:])[:, 0].astype(jax.numpy.float32), axis=-1)

    return jax.jit(last, static_argnames=("graphdef",))


class JudgeModel:
    """A loaded judge: generation and next-token probabilities over rendered chat prompts, batched.

    ``model``: an ``nnx`` module or its split ``(graphdef, state)``; ``tokenizer`` with a chat
    template. Prompts longer than ``max_prompt_length`` tokens keep their last tokens.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 8, max_prompt_length: int = 2048):
        from flax import nnx

        from rljax.data.batching import default_buckets, pad_token_id

        if batch_size < 1:
            raise ValueError(f"judge: batch_size must be >= 1, got {batch_size}")
        self.graphdef, self.state = nnx.split(model) if isinstance(model, nnx.Module) else model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_prompt_length = max_prompt_length
        self.pad_id = pad_token_id(tokenizer)
        self.buckets = default_buckets(max_prompt_length)

    def _encode(self, conversations: Sequence[Sequence[Mapping[str, str]]]) -> list[list[int]]:
        from rljax.data.prompts import format_prompt

        texts = [format_prompt(self.tokenizer, list(c)) for c in conversations]
        return [ids[-self.max_prompt_length:] for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _batches(self, prompts: list[list[int]]):
        from rljax.batches import pad_sequences

        for start in range(0, len(prompts), self.batch_size):
            rows = prompts[start:start + self.batch_size]
            ids, mask = pad_sequences(rows, side="left", pad_id=self.pad_id, buckets=self.buckets,
                                      num_rows=self.batch_size)
            yield start, len(rows), ids, mask

    def generate(self, conversations: Sequence[Sequence[Mapping[str, str]]], *, max_new_tokens: int,
                 temperature: float = 0.0, key=None) -> list[str]:
        """The judge's reply to each conversation (greedy at ``temperature`` 0; else sampled, each
        conversation with its own seed drawn from ``key``), through the rollout engine
        (``rljax.inference``: ``batch_size`` replies decoded together)."""
        import jax

        from rljax.inference import Request
        from rljax.inference.batch import request_seeds

        if not conversations:
            return []
        engine = self._engine_for(max_new_tokens)
        eos = self.tokenizer.eos_token_id
        prompts = self._encode(conversations)
        seeds = request_seeds(jax.random.key(0) if key is None else key, len(prompts))
        outs = engine.generate([Request(prompt_ids=p, max_tokens=max_new_tokens, temperature=temperature,
                                              stop_token_ids=(eos,) if eos is not None else (), seed=int(s))
                                      for p, s in zip(prompts, seeds)])
        return [self.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]

    def _engine_for(self, max_new_tokens: int):
        """The rollout engine of :meth:`generate`: ``batch_size`` sequences of a truncated prompt and
        its reply, not of the model's whole context; built again, larger, for a longer reply (the
        engine caps it at the model's context)."""
        from rljax.inference import Engine

        context = self.max_prompt_length + max_new_tokens
        if getattr(self, "_engine", None) is None or self._engine_context < context:
            self._engine = Engine((self.graphdef, self.state), max_slots=self.batch_size, max_context=context)
            self._engine_context = context
        return self._engine

    def next_token_logprobs(self, conversations: Sequence[Sequence[Mapping[str, str]]]) -> np.ndarray:
        """``[n, V]`` log-probs of the judge's first reply token for each conversation."""
        fn = _jitted_last_logprobs()
        rows = []
        for _, n, ids, mask in self._batches(self._encode(conversations)):
            rows.append(np.asarray(fn(self.graphdef, self.state, ids, mask))[:n])
        return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)

    def yes_probability(self, conversations: Sequence[Sequence[Mapping[str, str]]], *,
                        yes_words: Sequence[str] = YES_WORDS, no_words: Sequence[str] = NO_WORDS) -> np.ndarray:
        """``[n]`` ``P(yes) / (P(yes) + P(no))`` of the judge's first reply token, each summed over
        the single-token spellings in ``yes_words`` / ``no_words`` (:func:`yes_no_token_ids`)."""
        yes, no = yes_no_token_ids(self.tokenizer, yes_words, no_words)
        logp = self.next_token_logprobs(conversations).astype(np.float64)
        if not len(logp):
            return np.zeros(0)
        # log-sum-exp over the spellings, then a two-way softmax: stable for tiny probabilities
        log_yes = np.logaddexp.reduce(logp[:, list(yes)], axis=-1)
        log_no = np.logaddexp.reduce(logp[:, list(no)], axis=-1)
        return 1.0 / (1.0 + np.exp(log_no - log_yes))


@functools.lru_cache(maxsize=2)
def _load_judge(name: str, dtype: str, batch_size: int, max_prompt_length: int) -> JudgeModel:
    from rljax.models import dtype_from_name, load

    model, tokenizer = load(name, dtype=dtype_from_name(dtype))
    return JudgeModel(model, tokenizer, batch_size=batch_size, max_prompt_length=max_prompt_length)


def judge_groups(judge: JudgeModel, groups: Sequence[tuple[Any, Sequence[str]]], *, rubric: str = DEFAULT_RUBRIC,
                 retries: int = 2, fallback: float | None = 0.0, seed: int = 0, max_new_tokens: int = 256,
                 retry_temperature: float = 0.7, max_chars: int = 2000) -> tuple[list[np.ndarray], list[str], Counter]:
    """Scores of every group ``(prompt, completions)``: ``([scores [k]] per group, final reply per
    group, counts)`` (module docstring). Attempt 0 decodes greedily; retries sample with a key from
    ``seed``, the group's conversation and the attempt, so a seed gives the same scores."""
    import jax

    conversations = [group_messages(p, cs, rubric=rubric, max_chars=max_chars) for p, cs in groups]
    best = [np.full(len(cs), np.nan) for _, cs in groups]
    replies = [""] * len(groups)
    counts: Counter = Counter(groups=len(groups))
    todo = list(range(len(groups)))
    for attempt in range(retries + 1):
        if not todo:
            break
        if attempt:
            counts["retries"] += len(todo)
        text = json.dumps([conversations[g] for g in todo], sort_keys=True)
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(f"{attempt}:{text}".encode()) & 0x7FFFFFFF)
        outs = judge.generate([conversations[g] for g in todo], max_new_tokens=max_new_tokens,
                              temperature=0.0 if attempt == 0 else retry_temperature, key=key)
        left = []
        for g, reply in zip(todo, outs):
            scores = parse_group_scores(reply, len(best[g]))
            if np.isfinite(scores).sum() > np.isfinite(best[g]).sum() or attempt == 0:
                best[g], replies[g] = scores, reply
            if not np.isfinite(scores).all():
                counts["parse_failures"] += 1
                left.append(g)
        todo = left
    fill = np.nan if fallback is None else float(fallback)
    for g in range(len(groups)):
        missing = ~np.isfinite(best[g])
        if missing.all():
            counts["fallback_groups"] += 1
        counts["fallback_scores"] += int(missing.sum())
        best[g] = np.where(missing, fill, best[g])
    return best, replies, counts


JUDGE_COUNTS = ("groups", "parse_failures", "retries", "fallback_groups", "fallback_scores")


def make_judge_reward(*, mode: str = "group", model: str | None = None, base_model: str | None = None,
                      rubric: str = DEFAULT_RUBRIC, question: str = DEFAULT_QUESTION, retries: int = 2,
                      fallback: float | None = 0.0, seed: int = 0, batch_size: int = 8, max_new_tokens: int = 256,
                      retry_temperature: float = 0.7, max_prompt_length: int = 2048, max_chars: int = 2000,
                      dtype: str = "float32", yes_words: Sequence[str] = YES_WORDS,
                      no_words: Sequence[str] = NO_WORDS, judge: JudgeModel | None = None) -> RewardFn:
    """Batch reward: the judge's scores (module docstring). ``judge``: an already loaded
    :class:`JudgeModel` (tests, experiments); else ``model`` (or ``base_model`` from the trainer,
    else the embedded SmolLM2) is loaded once per process."""
    from rljax.data.preferences import prompt_key
    from rljax.models.registry import DEFAULT_MODEL

    if mode not in ("group", "pointwise"):
        raise ValueError(f"judge: mode must be 'group' or 'pointwise', got {mode!r}")
    if retries < 0:
        raise ValueError(f"judge: retries must be >= 0, got {retries}")
    if fallback is not None and not 0.0 <= float(fallback) <= 1.0:
        raise ValueError(f"judge: fallback must be in [0, 1] or null (missing), got {fallback}")
    if judge is None:
        judge = _load_judge(model or base_model or DEFAULT_MODEL, dtype, batch_size, max_prompt_length)
    if mode == "pointwise":  # at start, not at the first scoring: the tokenizer must spell yes and no in one token
        yes_no_token_ids(judge.tokenizer, tuple(yes_words), tuple(no_words))

    def judge_reward(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        if len(completions) != len(examples):
            raise ValueError(f"got {len(completions)} completions but {len(examples)} examples")
        out = np.empty(len(completions), np.float64)
        completions = [ex.get("trajectory") or c for c, ex in zip(completions, examples)]
        if mode == "pointwise":
            conversations = [pointwise_messages(ex["prompt"], c, question=question, max_chars=max_chars)
                             for c, ex in zip(completions, examples)]
            out[:] = judge.yes_probability(conversations, yes_words=tuple(yes_words), no_words=tuple(no_words))
            judge_reward.last_outputs = [f"P(yes)={p:.6f}" for p in out]
            judge_reward.judge_counts["requests"] += len(completions)
            return out
        members: dict[str, list[int]] = {}
        for i, ex in enumerate(examples):
            members.setdefault(prompt_key(ex["prompt"]), []).append(i)
        rows = list(members.values())
        groups = [(examples[r[0]]["prompt"], [completions[i] for i in r]) for r in rows]
        scores, replies, counts = judge_groups(judge, groups, rubric=rubric, retries=retries, fallback=fallback,
                                               seed=seed, max_new_tokens=max_new_tokens,
                                               retry_temperature=retry_temperature, max_chars=max_chars)
        outputs = [""] * len(completions)
        for r, s, reply in zip(rows, scores, replies):
            out[r] = s
            for i in r:
                outputs[i] = reply
        judge_reward.last_outputs = outputs
        judge_reward.judge_counts.update(counts)
        return out

    judge_reward.reward_name = "judge"  # type: ignore[attr-defined]
    judge_reward.judge_counts = Counter()  # type: ignore[attr-defined]
    judge_reward.judge_mode = mode  # type: ignore[attr-defined]
    judge_reward.last_outputs = []  # type: ignore[attr-defined]
    return judge_reward


def judge_metrics(functions: Mapping[str, Any], prefix: str = "reward/") -> dict[str, float]:
    """``{prefix}<name>/judge_<count>`` of every judge reward since the last call (counts reset):
    groups, parse_failures, retries, fallback_groups, fallback_scores (group mode), requests
    (pointwise). ``functions`` maps names to reward functions (``RewardSet.functions``)."""
    metrics: dict[str, float] = {}
    for name, fn in functions.items():
        counts = getattr(fn, "judge_counts", None)
        if not isinstance(counts, Counter):
            continue
        for key in JUDGE_COUNTS if fn.judge_mode == "group" else ("requests",):
            metrics[f"{prefix}{name}/judge_{key}"] = float(counts[key])
        counts.clear()
    return metrics


register_reward("judge", make_judge_reward)

__all__ = ["DEFAULT_QUESTION", "DEFAULT_RUBRIC", "JUDGE_COUNTS", "NO_WORDS", "YES_WORDS", "JudgeModel",
           "group_messages", "judge_groups", "judge_metrics", "make_judge_reward", "parse_group_scores",
           "pointwise_messages", "yes_no_token_ids"]
