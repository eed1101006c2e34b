"""A left-padded batch through the engine, with the static sampler's contract (``rljax.sampling.generate``):
the callers that think in batches (the rollout, the multi-turn turn sampler, ``rljax generate``) switch
sampler without changing shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rljax.inference.engine import Engine, Request
from rljax.sampling import SampleOutput, SamplingConfig


def request_seeds(key: jax.Array, rows: int) -> np.ndarray:
    """One 32-bit seed per row from ``key``: the same key gives the same requests, so the same tokens."""
    return np.asarray(jax.random.bits(key, (rows,), jnp.uint32))


def generate_batch(engine: Engine, input_ids, attention_mask, key: jax.Array, config: SamplingConfig) -> SampleOutput:
    """Sample each row of a left-padded ``[B, P]`` batch as its own request; numpy ``SampleOutput``
    ``[B, config.max_new_tokens]`` (pad id after the stop token, log-probs 0 there)."""
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
    B, N = ids.shape[0], config.max_new_tokens
    seeds = request_seeds(key, B)
    stop = () if config.ignore_eos else tuple(config.stop_token_ids)
    requests = [Request(prompt_ids=ids[i][mask[i] > 0].tolist(), max_tokens=N, temperature=config.temperature,
                        top_k=config.top_k, top_p=config.top_p, stop_token_ids=stop, seed=int(seeds[i]))
                for i in range(B)]
    tokens = np.full((B, N), config.pad_token_id, np.int32)
    logprobs = np.zeros((B, N), np.float32)
    out_mask = np.zeros((B, N), np.int32)
    finished = np.zeros(B, bool)
    for i, out in enumerate(engine.generate(requests)):
        n = len(out.token_ids)
        tokens[i, :n], logprobs[i, :n], out_mask[i, :n] = out.token_ids, out.logprobs, 1
        finished[i] = out.finish_reason == "stop"
    return SampleOutput(tokens=tokens, logprobs=logprobs, mask=out_mask, finished=finished)


def engine_for(policy, section) -> Engine | None:
    """The engine a run's ``sampling`` section asks for (``engine: paged``, with its ``max_slots``,
    ``page_size`` and ``num_pages``), or None for the static sampler (``engine: static``, or a run over
    several processes: the engine drives the devices of one host)."""
    if getattr(section, "engine", "static") != "paged" or jax.process_count() > 1:
        return None
    return Engine(policy, max_slots=section.max_slots, page_size=section.page_size, num_pages=section.num_pages)
