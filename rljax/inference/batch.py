"""A left-padded batch through the engine, with the static sampler's contract (``rljax.sampling.generate``):
the callers that think in batches (the rollout, the multi-turn turn sampler, ``rljax generate``) switch
sampler without changing shape."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax.errors import UserError
from rljax.inference.engine import Engine, Output, Request
from rljax.sampling import SampleOutput, SamplingConfig


def request_seeds(key: jax.Array, rows: int) -> np.ndarray:
    """One 32-bit seed per row from ``key``: the same key gives the same requests, so the same tokens."""
    return np.asarray(jax.random.bits(key, (rows,), jnp.uint32))


def generate_batch(engine: Engine, input_ids, attention_mask, key: jax.Array, config: SamplingConfig) -> SampleOutput:
    """Sample each row of a left-padded ``[B, P]`` batch as its own request; numpy ``SampleOutput``
    ``[B, config.max_new_tokens]`` (pad id after the stop token, log-probs 0 there)."""
    return _sample_output(engine.generate(_requests(input_ids, attention_mask, key, config)), config)


def generate_batch_versions(engine: Engine, input_ids, attention_mask, key: jax.Array, config: SamplingConfig,
                            refresh: Callable[[], int]) -> tuple[SampleOutput, np.ndarray]:
    """:func:`generate_batch` (the same requests, so the same tokens while the weights stay) driving the
    engine step by step: ``refresh()`` runs before each step, may give the engine newer weights
    (``Engine.set_weights``: sequences in flight go on under them) and returns the policy version that
    step samples with. Returns the output and ``versions`` ``[B, N]`` int32, each sampled token's
    version (0 after the stop token). The engine must hold no other caller's requests."""
    requests = _requests(input_ids, attention_mask, key, config)
    for i, r in enumerate(requests):
        try:
            engine._validate(r)
        except UserError as e:
            raise UserError(f"request {i}: {e}") from None
    row_of = {engine.submit(r): i for i, r in enumerate(requests)}
    versions = np.zeros((len(requests), config.max_new_tokens), np.int32)
    counts = np.zeros(len(requests), np.int64)
    done: dict[int, Output] = {}
    while len(done) < len(requests):
        version = int(refresh())
        done.update((o.request_id, o) for o in engine.step() if o.request_id in row_of)
        for request_id, i in row_of.items():
            n = len(done[request_id].token_ids) if request_id in done else len(engine.progress(request_id)[0])
            versions[i, counts[i]:n] = version  # the tokens this step sampled
            counts[i] = n
    return _sample_output([done[r] for r in row_of], config), versions


def _requests(input_ids, attention_mask, key: jax.Array, config: SamplingConfig) -> list[Request]:
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
    B, N = ids.shape[0], config.max_new_tokens
    seeds = request_seeds(key, B)
    stop = () if config.ignore_eos else tuple(config.stop_token_ids)
    return [Request(prompt_ids=ids[i][mask[i] > 0].tolist(), max_tokens=N, temperature=config.temperature,
                    top_k=config.top_k, top_p=config.top_p, stop_token_ids=stop, seed=int(seeds[i]))
            for i in range(B)]


def _sample_output(outputs: list[Output], config: SamplingConfig) -> SampleOutput:
    B, N = len(outputs), config.max_new_tokens
    tokens = np.full((B, N), config.pad_token_id, np.int32)
    logprobs = np.zeros((B, N), np.float32)
    out_mask = np.zeros((B, N), np.int32)
    finished = np.zeros(B, bool)
    for i, out in enumerate(outputs):
        n = len(out.token_ids)
        tokens[i, :n], logprobs[i, :n], out_mask[i, :n] = out.token_ids, out.logprobs, 1
        finished[i] = out.finish_reason == "stop"
    return SampleOutput(tokens=tokens, logprobs=logprobs, mask=out_mask, finished=finished)


def engine_for(policy, section, *, max_context: int | None = None) -> Engine | None:
    """The engine a run's ``sampling`` section asks for (``engine: paged``, with its ``max_slots``,
    ``page_size`` and ``num_pages``), or None for the static sampler (``engine: static``, or a run over
    several processes: the engine drives the devices of one host). ``max_context``: the run's longest
    sequence (``Engine``'s; None: the model's context)."""
    if getattr(section, "engine", "static") != "paged" or jax.process_count() > 1:
        return None
    return Engine(policy, max_slots=section.max_slots, page_size=section.page_size, num_pages=section.num_pages,
                  max_context=max_context)
