"""The asynchronous loop (train.max_staleness, train.partial_rollouts) on the tiny model: k = 0 is the
synchronous loop bit for bit; k >= 1 samples batch s with policy version max(s0, s - k), so the
staleness of every step is known in advance and the run is deterministic; each token's version
reaches the batch; partial rollouts switch weights under a sequence in flight; a resume drops the
batches sampled ahead and samples them again."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from rljax.inference import Engine
from rljax.inference.batch import generate_batch, generate_batch_versions
from rljax.models.tiny import tiny_config
from rljax.models.transformer import init_model
from rljax.rewards.base import per_sample, register_reward
from rljax.sampling import SamplingConfig
from rljax.training import OnlineTrainer as Trainer

# the tiny run's default reward (as tests/integration/test_train.py registers it)
register_reward("lowercase", lambda: per_sample(lambda c, example: sum(x.islower() for x in c) / max(len(c), 1)),
                overwrite=True)

TIMING = ("time/", "async/queue_batches")  # wall-clock measurements (and `time`): the only keys allowed to differ


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


def _untimed(steps):
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith(TIMING)} for m in steps]


def _params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.run.policy.params)]


def _fit(cfg, **kwargs):
    trainer = Trainer(cfg, **kwargs)
    trainer.fit()
    return trainer


def _train(**train):
    return {"save_model": False, **train}


def test_max_staleness_0_is_the_synchronous_loop_bit_for_bit(tiny_run_config, tmp_path):
    absent = _fit(tiny_run_config(tmp_path / "absent", train=_train()))
    zero = _fit(tiny_run_config(tmp_path / "zero", train=_train(max_staleness=0)))
    a, z = _metrics(tmp_path / "absent"), _metrics(tmp_path / "zero")
    assert len(a) == 2 and _untimed(a) == _untimed(z)
    assert not any(k.startswith("async/") for m in z for k in m)  # nothing of the asynchronous loop runs
    for x, y in zip(_params(absent), _params(zero)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("k, expected", [(1, [0, 1, 1, 1]), (2, [0, 1, 2, 2])])
def test_staleness_follows_the_schedule(tiny_run_config, tmp_path, k, expected):
    # batch s is sampled by version max(0, s - k) and trained by version s: every counted token of
    # step s lags min(s, k) versions, whatever the threads' timing
    seen = []
    cfg = tiny_run_config(tmp_path, train=_train(steps=4, max_staleness=k))
    trainer = Trainer(cfg)
    update = trainer.update_epochs

    def spy(batch):
        seen.append((trainer.run.step, np.asarray(batch.versions), np.asarray(batch.loss_mask)))
        return update(batch)

    trainer.update_epochs = spy
    before = _params(trainer)
    trainer.fit()
    steps = _metrics(tmp_path)
    assert [m["async/staleness_max"] for m in steps] == expected
    assert [m["async/staleness_mean"] for m in steps] == expected
    for m in steps:
        assert 0 <= m["async/staleness_mean"] <= m["async/staleness_max"] <= k
        assert 1 <= m["async/queue_batches"] <= k + 1
        assert m["time/weight_sync_s"] >= 0 and m["time/generate_overlap_s"] >= 0
        assert np.isfinite(m["loss"])
    # each token's version reaches the batch the update trains on
    assert [step for step, _, _ in seen] == [0, 1, 2, 3]
    for step, versions, loss_mask in seen:
        assert versions.dtype == np.int32 and versions.shape == loss_mask.shape
        assert loss_mask.sum() > 0
        np.testing.assert_array_equal(versions[loss_mask > 0], max(0, step - k))
    assert any(not np.array_equal(x, y) for x, y in zip(before, _params(trainer)))  # it trained


def test_an_asynchronous_run_is_deterministic_whatever_the_evaluations(tiny_run_config, tmp_path):
    # evaluations in between take the engine from the producer at timing-dependent points; the
    # schedule, not the timing, fixes what each step trains on
    one = _fit(tiny_run_config(tmp_path / "one", train=_train(steps=3, max_staleness=1)))
    two = _fit(tiny_run_config(tmp_path / "two", train=_train(steps=3, max_staleness=1, eval_every=1)))
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("eval")} for m in _untimed(ms)]  # noqa: E731
    assert strip(_metrics(tmp_path / "one")) == strip(_metrics(tmp_path / "two"))
    for x, y in zip(_params(one), _params(two)):
        np.testing.assert_array_equal(x, y)


def test_partial_rollouts_give_a_row_two_versions(tiny_run_config, tmp_path):
    cfg = tiny_run_config(tmp_path, train=_train(steps=2, max_staleness=1, partial_rollouts=True))
    trainer = Trainer(cfg)
    engine = trainer.engine()
    engine_step, calls = engine.step, []

    def step():
        # step 1's batch starts under version 0 as soon as step 0's is sampled; after its third engine
        # step, wait for the update to publish version 1: the rest of its tokens are version 1's
        producer = trainer._producer
        if producer is not None and producer.producing == 1:
            calls.append(1)
            if len(calls) == 3:
                assert producer.wait_for_version(1, timeout=300)
        return engine_step()

    engine.step = step
    seen = {}
    update = trainer.update_epochs

    def spy(batch):
        seen[trainer.run.step] = (np.asarray(batch.versions), np.asarray(batch.completion_mask))
        return update(batch)

    trainer.update_epochs = spy
    trainer.fit()
    versions, mask = seen[1]
    rows = [set(v[m > 0].tolist()) for v, m in zip(versions, mask)]
    assert {0, 1} in rows, rows  # a sequence begun under version 0 finished under version 1
    for v, m in zip(versions, mask):  # versions never go back within a row
        assert np.all(np.diff(v[m > 0]) >= 0)
    np.testing.assert_array_equal(seen[0][0][seen[0][1] > 0], 0)
    last = _metrics(tmp_path)[1]
    assert 0 < last["async/staleness_mean"] < 1 and last["async/staleness_max"] == 1


def test_a_resume_samples_the_dropped_batches_again_under_the_resumed_policy(tiny_run_config, tmp_path):
    cfg = tiny_run_config(tmp_path, train=_train(steps=4, max_staleness=1, save_every=2))
    _fit(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2)))
    _fit(cfg, resume=True)
    steps = _metrics(tmp_path)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    # step 2's batch was sampled ahead (by version 1) and dropped with the first process; the resumed
    # run samples it again with version 2, the policy it resumed with
    assert [m["async/staleness_max"] for m in steps] == [0, 1, 0, 1]
    # from the data position of the last trained step: each step one batch of prompts further
    epochs = [m["epoch"] for m in steps]
    np.testing.assert_allclose(epochs, epochs[0] * np.arange(1, 5), rtol=1e-12)


def test_generate_batch_versions_records_a_weight_switch_mid_sequence():
    model = init_model(tiny_config(64), seed=1)
    newer = nnx.split(init_model(tiny_config(64), seed=2))[1:]
    rng = np.random.default_rng(0)
    ids = rng.integers(6, 64, size=(4, 6)).astype(np.int32)
    mask = np.ones_like(ids)
    config = SamplingConfig(max_new_tokens=10, temperature=1.0, pad_token_id=0)
    key = jax.random.key(3)
    alone = generate_batch(Engine(model, max_slots=8, page_size=4, num_pages=64), ids, mask, key, config)

    # never switching: the same tokens as generate_batch, every one version 0
    same, versions = generate_batch_versions(Engine(model, max_slots=8, page_size=4, num_pages=64), ids, mask, key,
                                             config, refresh=lambda: 0)
    np.testing.assert_array_equal(same.tokens, alone.tokens)
    np.testing.assert_array_equal(same.logprobs, alone.logprobs)
    np.testing.assert_array_equal(versions, 0)

    # new weights before the third engine step: the tokens sampled before are the old weights' (equal to
    # the run that never switched), the rest carry version 7
    engine = Engine(model, max_slots=8, page_size=4, num_pages=64)
    calls = []

    def refresh():
        calls.append(1)
        if len(calls) == 3:
            engine.set_weights(newer)
        return 7 if len(calls) >= 3 else 0

    out, versions = generate_batch_versions(engine, ids, mask, key, config, refresh)
    assert versions.dtype == np.int32 and versions.shape == (4, 10)
    np.testing.assert_array_equal(out.mask, 1)
    for row in versions:  # the first step prefills and samples 2 tokens (first + one decode), the second one more
        np.testing.assert_array_equal(row, [0, 0, 0] + [7] * 7)
    np.testing.assert_array_equal(out.tokens[:, :3], alone.tokens[:, :3])
    np.testing.assert_array_equal(out.logprobs[:, :3], alone.logprobs[:, :3])
    assert not np.array_equal(out.logprobs[:, 3:], alone.logprobs[:, 3:])  # other weights, other log-probs
