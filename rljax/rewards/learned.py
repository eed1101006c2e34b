"""Learned reward: a trained reward model (transformer + scalar head) scores prompt + completion.

    rewards:
      rm: {type: reward_model, path: runs/reward_model_smollm2_arith/model, weight: 1.0}

``path`` is a Hugging Face directory with ``value_head.safetensors``, as ``rljax train`` writes for
a ``reward_model`` run (``RUN_DIR/model``). The reward is the value head at the last real token of
the rendered prompt followed by the completion (and EOS when the model was trained so), exactly as
``rljax.logprobs.sequence_rewards`` computes it in training. The prompt rendering
(chat template, system prompt) and lengths default to what the reward model was trained with
(``rljax_reward_model.json`` in the directory); options override them. A directory without
tokenizer files reads the policy's tokens with the policy's tokenizer (``build_rewards(...,
tokenizer=...)``, as the online trainer calls it).

Scoring is batched: ``batch_size`` rows per call of one jitted function, widths bucketed, so a run
compiles a handful of programs. Prompts longer than ``max_prompt_length`` keep their last tokens;
completions longer than ``max_completion_length`` keep their first.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.batches import pad_sequences
from rljax.rewards.base import RewardFn, register_reward

_META = "rljax_reward_model.json"


@functools.lru_cache(maxsize=4)
def _load_reward_model(path: str, dtype: str, tokenizer=None):
    from flax import nnx

    from rljax.models import dtype_from_name, load

    model, tokenizer = load(path, dtype=dtype_from_name(dtype), value_head=True, tokenizer=tokenizer)
    if model.value_head is None:  # pragma: no cover - load(value_head=True) always builds one
        raise ValueError(f"{path}: no value head")
    graphdef, state = nnx.split(model)
    return graphdef, state, tokenizer


@functools.cache
def _jitted_score():
    """``score(graphdef, state, prompt_ids, prompt_mask, completion_ids, completion_mask) -> [B]``, jitted once.

    Built on first use rather than at module level so that ``import rljax.rewards`` (verifiers and
    all) does not import JAX, which takes over a second.
    """
    import jax
    from flax import nnx

    from rljax.logprobs import sequence_rewards

    def score(graphdef, state, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return sequence_rewards(nnx.merge(graphdef, state), prompt_ids, prompt_mask, completion_ids, completion_mask)

    return jax.jit(score, static_argnames=("graphdef",))


def make_reward_model_reward(
    *,
    path: str,
    batch_size: int = 16,
    chat: bool | None = None,
    system_prompt: str | None = None,
    assistant_prefix: str | None = None,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    append_eos: bool | None = None,
    dtype: str = "float32",
    tokenizer: Any = None,
) -> RewardFn:
    """Batch reward: the reward model at ``path`` scores ``example["prompt"]`` + completion.

    ``chat``, ``system_prompt``, ``assistant_prefix``, ``max_prompt_length``,
    ``max_completion_length`` and ``append_eos`` default to the values in the directory's
    ``rljax_reward_model.json`` (written by the reward model trainer), else ``True``, ``""``, ``""``,
    ``512``, ``512``, ``True``. With an assistant prefix the prompt ends with it and a completion
    that starts with it (as the online trainer's texts do) is scored without repeating it.
    ``tokenizer`` (context from ``build_rewards``: the policy's) is used only when the directory has
    no tokenizer files of its own.
    """
    from rljax.data.batching import default_buckets, pad_token_id
    from rljax.data.preferences import strip_prefix, tokenize_response
    from rljax.data.prompts import format_prompt

    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"reward_model: {path} is not a model directory (no config.json); point `path` at "
                                "the `model` folder of a reward_model run")
    if not os.path.isfile(os.path.join(path, "value_head.safetensors")):
        raise FileNotFoundError(f"reward_model: {path} has no value_head.safetensors: it is not a trained reward model")
    if batch_size < 1:
        raise ValueError(f"reward_model: batch_size must be >= 1, got {batch_size}")
    meta: dict[str, Any] = {}
    if os.path.isfile(os.path.join(path, _META)):
        with open(os.path.join(path, _META)) as f:
            meta = json.load(f)
    chat = meta.get("chat", True) if chat is None else chat
    system_prompt = meta.get("system_prompt", "") if system_prompt is None else system_prompt
    assistant_prefix = meta.get("assistant_prefix", "") if assistant_prefix is None else assistant_prefix
    max_prompt_length = max_prompt_length or meta.get("max_prompt_length", 512)
    max_completion_length = max_completion_length or meta.get("max_completion_length", 512)
    append_eos = meta.get("append_eos", True) if append_eos is None else append_eos
    from rljax.models.hf_io import has_tokenizer

    # the policy's tokenizer only where the directory has none: the cache then keys on the path alone
    graphdef, state, tokenizer = _load_reward_model(path, dtype, None if has_tokenizer(path) else tokenizer)
    score = _jitted_score()
    pad = pad_token_id(tokenizer)
    prompt_buckets, completion_buckets = default_buckets(max_prompt_length), default_buckets(max_completion_length)

    def reward_model(completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> np.ndarray:
        if len(completions) != len(examples):
            raise ValueError(f"got {len(completions)} completions but {len(examples)} examples")
        texts = [format_prompt(tokenizer, ex["prompt"], system_prompt=system_prompt or None, chat=chat,
                               assistant_prefix=assistant_prefix) for ex in examples]
        prompts = [p[-max_prompt_length:] for p in tokenizer(texts, add_special_tokens=False)["input_ids"]] \
            if texts else []
        responses = [tokenize_response(tokenizer, strip_prefix(c, assistant_prefix),
                                       append_eos=append_eos)[:max_completion_length] for c in completions]
        out = np.empty(len(completions), np.float64)
        for start in range(0, len(completions), batch_size):
            rows = range(start, min(start + batch_size, len(completions)))
            prompt_ids, prompt_mask = pad_sequences([prompts[i] for i in rows], side="left", pad_id=pad,
                                                    buckets=prompt_buckets, num_rows=batch_size)
            # buckets are >= 1 wide, so a batch of empty completions still has a column (and reads
            # each row's last prompt token)
            completion_ids, completion_mask = pad_sequences([responses[i] for i in rows], side="right", pad_id=pad,
                                                            buckets=completion_buckets, num_rows=batch_size)
            scores = score(graphdef, state, prompt_ids, prompt_mask, completion_ids, completion_mask)
            out[start:start + len(rows)] = np.asarray(scores, np.float64)[: len(rows)]
        return out

    reward_model.reward_name = "reward_model"  # type: ignore[attr-defined]
    return reward_model


register_reward("reward_model", make_reward_model_reward)
