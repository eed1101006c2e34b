"""The rollout engine (rljax.inference) against the static sampler and the trainer's log-probs, and its
scheduling: queueing, slot refill, page exhaustion, prefix sharing, cancellation, bad requests,
preemption, new weights, LoRA, multi-turn continuation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.errors import UserError
from rljax.inference import Engine, Request
from rljax.inference import model_step
from rljax.logprobs import token_logprobs
from rljax.models.lora import add_lora, lora_trainable
from rljax.models.tiny import tiny_config
from rljax.models.transformer import init_model
from rljax.sampling import SamplingConfig, generate

STOP = 5
PAGE = 4


@pytest.fixture(scope="module")
def model():
    return init_model(tiny_config(64), seed=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(6, 64, size=n)] for n in (3, 4, 9, 17, 25, 8, 12)]


def _alone(model, prompt, max_tokens):
    """The static sampler's greedy output for ``prompt`` run alone (a batch of one), cut at
    ``max_tokens`` (one compiled program for every ``max_tokens`` up to 40: greedy tokens do not
    depend on how many follow)."""
    assert max_tokens <= 40
    out = generate(model, np.array([prompt]), np.ones((1, len(prompt)), np.int32), jax.random.key(0),
                   SamplingConfig(max_new_tokens=40, temperature=0.0, stop_token_ids=(STOP,)))
    n = min(int(out.mask.sum()), max_tokens)
    return [int(t) for t in out.tokens[0, :n]]


@jax.jit
def _logits(model_split, ids, mask):
    model = nnx.merge(*model_split)
    hidden, _ = model.forward(ids, mask)
    return model.logits(hidden)


def _trainer_logprobs(model, prompt, tokens, temperature=1.0, width=96):
    """The trainer's log-probs of ``tokens`` after ``prompt`` (one compiled program: right-padded to ``width``)."""
    seq = prompt + tokens
    ids = np.zeros((1, width), np.int32)
    ids[0, :len(seq)] = seq
    logits = _logits(nnx.split(model), jnp.asarray(ids), jnp.asarray((np.arange(width) < len(seq))[None], jnp.int32))
    logits = logits[0, len(prompt) - 1:len(seq) - 1]
    return np.asarray(token_logprobs(logits, jnp.array(tokens), temperature=temperature))


def test_greedy_requests_queue_refill_and_match_the_static_sampler_alone(model, prompts):
    max_tokens = [6, 30, 1, 17, 23, 40, 9]
    engine = Engine(model, max_slots=3, page_size=PAGE, num_pages=64)  # 7 requests, 3 slots: a queue
    outs = engine.generate([Request(prompt_ids=p, max_tokens=m, temperature=0.0, stop_token_ids=(STOP,))
                            for p, m in zip(prompts, max_tokens)])
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.token_ids == _alone(model, p, m)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == STOP else "length")
        assert o.finish_reason == "stop" or len(o.token_ids) == m
        # greedy log-probs are those of the unscaled distribution, as the trainer computes them
        np.testing.assert_allclose(o.logprobs, _trainer_logprobs(model, p, o.token_ids), atol=1e-5, rtol=0)
    assert engine.stats["decode_steps"] < sum(len(o.token_ids) for o in outs)  # rows decoded together
    assert engine.pool.in_use == engine.pool.cache.evictable()  # only the prefix cache holds pages now


def test_sampled_tokens_do_not_depend_on_the_slots_and_logprobs_are_the_trainers(model, prompts):
    reqs = [Request(prompt_ids=prompts[i % 4], max_tokens=10, temperature=0.7, top_k=20 if i % 2 else 0,
                    top_p=0.9 if i % 3 == 0 else 1.0, seed=1000 + i) for i in range(10)]
    outs2 = Engine(model, max_slots=2, page_size=PAGE, num_pages=64).generate(reqs)
    outs8 = Engine(model, max_slots=8, page_size=PAGE, num_pages=64).generate(reqs)
    assert [o.token_ids for o in outs2] == [o.token_ids for o in outs8]
    for r, o in zip(reqs, outs8):
        np.testing.assert_allclose(o.logprobs, _trainer_logprobs(model, list(r.prompt_ids), o.token_ids, 0.7),
                                   atol=1e-5, rtol=0)
    # different seeds draw differently (the same prompt and settings)
    assert outs8[0].token_ids != outs8[4].token_ids or outs8[0].token_ids != outs8[8].token_ids


def test_a_group_shares_its_prompt_pages_and_runs_one_prefill(model, prompts):
    prompt = prompts[4]  # 25 tokens: 6 full pages of 4 and one partly filled
    group = [Request(prompt_ids=prompt, max_tokens=8, seed=s) for s in range(4)]
    shared = Engine(model, max_slots=4, page_size=PAGE, num_pages=64)
    outs = shared.generate(group)
    assert shared.stats["prefill_tokens"] == len(prompt)  # one prefill for the four samples
    # 6 shared full pages + per sample: its copy of the partial page and 1 more page (25 + 8 = 33 tokens)
    assert shared.pool.peak_in_use == 6 + 4 * 2
    alone = [Engine(model, max_slots=1, page_size=PAGE, num_pages=64).generate([r])[0] for r in group]
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    # samples of a prompt admitted later (no free slot at first) reuse the cached prompt: still one prefill
    later = Engine(model, max_slots=2, page_size=PAGE, num_pages=64)
    assert [o.token_ids for o in later.generate(group)] == [o.token_ids for o in outs]
    assert later.stats["prefill_tokens"] == len(prompt) and later.stats["prompt_cache_hits"] == 2


def test_top_logprobs_are_the_trainers_likeliest_tokens_and_only_where_asked(model, prompts):
    reqs = [Request(prompt_ids=prompts[0], max_tokens=6, temperature=0.7, top_k=10, seed=3, top_logprobs=3),
            Request(prompt_ids=prompts[2], max_tokens=6, temperature=0.0, top_logprobs=1),
            Request(prompt_ids=prompts[3], max_tokens=6, temperature=0.7, seed=4)]
    outs = Engine(model, max_slots=4, page_size=PAGE, num_pages=64).generate(reqs)
    for r, o in zip(reqs, outs):
        if not r.top_logprobs:
            assert o.top_logprobs == []
            continue
        assert len(o.top_logprobs) == len(o.token_ids)
        prompt, scale = list(r.prompt_ids), r.temperature if r.temperature else 1.0
        seq = prompt + o.token_ids
        ids = np.zeros((1, 96), np.int32)
        ids[0, :len(seq)] = seq
        logits = _logits(nnx.split(model), jnp.asarray(ids), jnp.asarray((np.arange(96) < len(seq))[None], jnp.int32))
        full = np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1:len(seq) - 1] / scale, axis=-1))
        for t, top in enumerate(o.top_logprobs):
            want = np.argsort(-full[t], kind="stable")[:r.top_logprobs]
            assert [i for i, _ in top] == want.tolist()
            np.testing.assert_allclose([lp for _, lp in top], full[t, want], atol=1e-5, rtol=0)
        if r.temperature == 0:  # greedy: the sampled token is the likeliest one
            assert [top[0][0] for top in o.top_logprobs] == o.token_ids


def test_page_exhaustion_queues_requests_and_preemption_keeps_the_output(model, prompts):
    reqs = [Request(prompt_ids=p, max_tokens=24, temperature=0.0) for p in prompts]
    # 12 usable pages of 4 tokens: one sequence needs up to 13; four slots cannot all grow at once
    small = Engine(model, max_slots=4, page_size=PAGE, num_pages=14)
    outs = small.generate(reqs)
    assert small.pool.peak_in_use <= 13
    assert small.stats["preempted"] > 0
    big = Engine(model, max_slots=4, page_size=PAGE, num_pages=128).generate(reqs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in big]


def test_a_cancelled_request_frees_its_pages_and_slot(model, prompts):
    engine = Engine(model, max_slots=2, page_size=PAGE, num_pages=64)
    a = engine.submit(Request(prompt_ids=prompts[4], max_tokens=50))
    b = engine.submit(Request(prompt_ids=prompts[3], max_tokens=50))
    waiting = engine.submit(Request(prompt_ids=prompts[0], max_tokens=3))
    for _ in range(3):
        engine.step()
    held = engine.pool.in_use - engine.pool.cache.evictable()
    assert held == len(engine._sequences[a].pages) + len(engine._sequences[b].pages)
    engine.cancel(a)
    engine.cancel(waiting)
    finished = {o.request_id: o for o in engine.pop_finished()}
    assert finished[a].finish_reason == finished[waiting].finish_reason == "cancelled"
    assert len(finished[a].token_ids) == 4 and finished[waiting].token_ids == []  # 1 per step + the first
    assert engine.pool.in_use - engine.pool.cache.evictable() == len(engine._sequences[b].pages)
    engine.cancel(b)
    assert engine.pool.in_use == engine.pool.cache.evictable() and not engine.has_work()


@pytest.mark.parametrize("field, bad, message", [
    ("prompt_ids", [], "prompt_ids: empty"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("max_tokens", 10_000, "exceeds the engine's max_context of 256 tokens"),
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
    ("top_k", -1, "top_k must be an integer >= 0"),
    ("prompt_ids", [1, 64], "prompt_ids: token ids must be in [0, 64)"),
    ("top_logprobs", 21, "top_logprobs must be an integer in [0, 20]"),
    ("top_logprobs", -1, "top_logprobs must be an integer in [0, 20]"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(model, prompts, field, bad, message):
    engine = Engine(model, max_slots=2, page_size=PAGE, num_pages=64, max_context=256)
    good = engine.submit(Request(prompt_ids=prompts[0], max_tokens=4, temperature=0.0))
    with pytest.raises(UserError, match=re.escape(message)):
        engine.submit(Request(**{"prompt_ids": prompts[1], "max_tokens": 4, field: bad}))
    with pytest.raises(UserError, match="request 1: "):
        engine.generate([Request(prompt_ids=prompts[1]), Request(**{"prompt_ids": prompts[1], field: bad})])
    finished = []
    while engine.has_work():
        finished += engine.step()
    assert [o.request_id for o in finished] == [good]


def test_without_max_context_a_request_is_bounded_by_the_models_context(model, prompts):
    engine = Engine(model, max_slots=2, page_size=PAGE, num_pages=64)
    context = model.config.max_position_embeddings
    assert engine.max_context == context
    with pytest.raises(UserError, match=f"exceeds the model's context of {context} tokens"):
        engine.submit(Request(prompt_ids=prompts[0], max_tokens=context))


def test_a_request_longer_than_the_pool_is_refused_at_once(model, prompts):
    engine = Engine(model, max_slots=2, page_size=PAGE, num_pages=5)  # 4 usable pages: 16 tokens
    with pytest.raises(UserError, match="more pages than the whole pool"):
        engine.submit(Request(prompt_ids=prompts[2], max_tokens=8))  # 9 + 8 = 17 tokens


def test_new_weights_run_without_a_recompile_and_give_the_new_models_output(model, prompts):
    other = init_model(tiny_config(64), seed=2)
    reqs = [Request(prompt_ids=p, max_tokens=12, temperature=0.0, stop_token_ids=(STOP,)) for p in prompts[:3]]
    engine = Engine(model, max_slots=4, page_size=PAGE, num_pages=64)
    engine.generate(reqs)
    traces = dict(model_step.TRACES)
    engine.set_weights(nnx.split(other)[1:])
    outs = engine.generate(reqs)
    assert model_step.TRACES["decode"] == traces["decode"] and model_step.TRACES["prefill"] == traces["prefill"]
    assert engine.stats["page_cache_hits"] == 0  # the old weights' cached pages were dropped
    assert [o.token_ids for o in outs] == [_alone(other, p, 12) for p in prompts[:3]]


def test_lora_adapters_on_a_frozen_base(model, prompts):
    lora = add_lora(model, rank=4, seed=3)
    graphdef, trainable, frozen = nnx.split(lora, lora_trainable(), ...)
    # give the adapters non-zero B so they change the output
    trainable = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(4), x.shape, x.dtype), trainable)
    split = (graphdef, trainable, frozen)
    outs = Engine(split, max_slots=2, page_size=PAGE, num_pages=64).generate(
        [Request(prompt_ids=p, max_tokens=10, temperature=0.0, stop_token_ids=(STOP,)) for p in prompts[:3]])
    merged = nnx.merge(*split)
    assert [o.token_ids for o in outs] == [_alone(merged, p, 10) for p in prompts[:3]]
    assert [o.token_ids for o in outs] != [_alone(model, p, 10) for p in prompts[:3]]


def test_the_next_turn_prefills_only_its_new_tokens(model, prompts):
    engine = Engine(model, max_slots=2, page_size=PAGE, num_pages=64)
    first = engine.generate([Request(prompt_ids=prompts[4], max_tokens=11, temperature=0.0)])[0]
    assert len(first.token_ids) == 11
    before = engine.stats["prefill_tokens"]
    history = prompts[4] + first.token_ids  # 36 tokens; the keys and values of 35 are in pages
    turn = history + [7, 8, 9]
    second = engine.generate([Request(prompt_ids=turn, max_tokens=6, temperature=0.0, stop_token_ids=(STOP,))])[0]
    assert engine.stats["page_cache_hits"] == 35 // PAGE
    assert engine.stats["prefill_tokens"] - before == len(turn) - (35 // PAGE) * PAGE
    assert second.token_ids == _alone(model, turn, 6)


@pytest.mark.parametrize("sections,longest", [
    ({"rewards": {"answer": 1.0}}, 64 + 8),  # tests/_tiny.py's run: prompts of at most 64 tokens, 8 new tokens
    ({"rewards": {"answer": 1.0}, "sampling": {"max_new_tokens": 40}}, 64 + 40),
    ({"environment": {"name": "toy", "max_tokens": 100}, "rewards": {}}, 100),  # a trajectory's tokens
])
def test_a_trainers_engine_holds_the_pages_its_longest_sequence_needs(tiny_run_config, tmp_path, sections, longest):
    from rljax.training import OnlineTrainer

    trainer = OnlineTrainer(tiny_run_config(tmp_path, **sections))
    engine = trainer.engine()
    assert trainer.longest_sequence() == engine.max_context == longest
    # num_pages: null, and the tiny model's 2,048-token context left room for 64 x 128 pages + the null
    # page; the run can use at most 64 slots x ceil(longest / 16) pages
    assert engine.stats["num_pages"] == 64 * -(-longest // 16) + 1
    with pytest.raises(UserError, match=f"= {longest + 1} exceeds the engine's max_context of {longest} tokens"):
        engine.generate([Request(prompt_ids=[5] * (longest - 7), max_tokens=8)])
    assert engine.generate([Request(prompt_ids=[5] * (longest - 8), max_tokens=8, seed=1)])[0].finish_reason


def test_an_engine_built_again_with_the_same_pool_compiles_no_zero_fill(model):
    from jax import monitoring

    compiled = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(str(kwargs.get("fun_name")))

    Engine(model, max_slots=2, page_size=8, num_pages=12)
    monitoring.register_event_duration_secs_listener(count)
    try:
        engine = Engine(model, max_slots=2, page_size=8, num_pages=12)
    finally:
        monitoring.unregister_event_duration_listener(count)
    assert compiled == [], compiled  # the pools' zero-fill (and the decode weights) came compiled
    assert len(engine.kv[0]) == model.config.num_layers and not any(bool(jnp.any(k)) for k in engine.kv[0])
    assert engine.kv[0][0] is not engine.kv[0][1]  # one buffer per layer (they are donated one by one)
