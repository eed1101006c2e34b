"""Online batches whose groups share a prompt (``RolloutBatch.prompt_group``): the scoring and training
passes run each group as one packed row (``rljax.logprobs.completion_states``) and give the unpacked
log-probs, entropies, values and gradients; ``packing_saves`` picks packing only when it is less work
(hand-computed costs); ``rollout_batch`` claims a group only when its rows' prompts are equal."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import rljax.logprobs as logprobs_module
from rljax import rng
from rljax.algorithms import get as get_algorithm
from rljax.algorithms.policy_gradient import totals as rollout_totals
from rljax.config import from_yaml
from rljax.logprobs import completion_logprobs, packing_saves
from rljax.run_config import RunConfig
from rljax.training import OnlineTrainer
from rljax.training.online import rollout_batch, score_logprobs, shared_prompt_group
from tests._tiny import make_tiny_model_dir

from tests.integration.test_logprobs_packed import CFG, COMPLETIONS, PROMPTS, model, x64  # noqa: F401 (fixtures)

K = len(COMPLETIONS[0])  # completions per prompt


def _rows():
    """``B·K`` rows as an online batch has them: each prompt (left-padded) repeated in its K rows."""
    P, N = max(map(len, PROMPTS)), max(len(c) for cs in COMPLETIONS for c in cs)
    R = len(PROMPTS) * K
    prompt_ids, prompt_mask = np.zeros((R, P), np.int32), np.zeros((R, P), np.int32)
    ids, mask = np.zeros((R, N), np.int32), np.zeros((R, N), np.int32)
    for b, p in enumerate(PROMPTS):
        for k, c in enumerate(COMPLETIONS[b]):
            r = b * K + k
            prompt_ids[r, P - len(p):], prompt_mask[r, P - len(p):] = p, 1
            ids[r, :len(c)], mask[r, :len(c)] = c, 1
    return tuple(map(jnp.asarray, (prompt_ids, prompt_mask, ids, mask)))


@pytest.fixture
def packed_calls(monkeypatch):
    """How many times the packed pass ran (so a test knows which path it compared)."""
    calls = []
    original = logprobs_module.packed_completion_states

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(logprobs_module, "packed_completion_states", spy)
    return calls


@pytest.mark.usefixtures("x64")  # `model` is float64: grouped = unpacked is an algebraic equality
@pytest.mark.parametrize("jit", [False, True])
def test_a_prompt_group_gives_the_unpacked_logprobs_entropy_and_values(model, packed_calls, jit):
    rows = _rows()
    fn = functools.partial(completion_logprobs, model, with_entropy=True, with_values=True)
    grouped = (jax.jit(lambda *a: fn(*a, prompt_group=K)) if jit else functools.partial(fn, prompt_group=K))(*rows)
    assert packed_calls == [(len(PROMPTS), rows[0].shape[1])]  # one packed pass, one row per prompt
    unpacked = fn(*rows)
    assert len(packed_calls) == 1  # prompt_group 1: the rows as they are
    mask = np.asarray(rows[3], bool)
    assert np.abs(np.asarray(unpacked["logprobs"])[mask]).max() > 1.0  # far from 0: the comparison can fail
    for key in ("logprobs", "entropy", "values"):
        assert grouped[key].dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(grouped[key])[mask], np.asarray(unpacked[key])[mask], atol=1e-12,
                                   rtol=1e-10,
                                   err_msg=key)


@pytest.mark.usefixtures("x64")
def test_rows_not_a_multiple_of_the_group_run_unpacked(model, packed_calls):
    rows = tuple(x[:5] for x in _rows())  # 5 rows, groups of 3
    out = completion_logprobs(model, *rows, prompt_group=K)["logprobs"]
    assert packed_calls == []
    np.testing.assert_array_equal(out, completion_logprobs(model, *rows)["logprobs"])


@pytest.mark.usefixtures("x64")  # `model` is float64: the gradients agree to ~1e-15
def test_the_gradient_through_a_prompt_group_equals_the_unpacked_one(model):
    graphdef, params = nnx.split(model)
    rows = _rows()
    weights = jax.random.normal(jax.random.key(3), rows[2].shape) * rows[3]

    def loss(p, group):
        out = completion_logprobs(nnx.merge(graphdef, p), *rows, with_values=True, prompt_group=group)
        return jnp.sum(weights * out["logprobs"]) + jnp.sum(weights * out["values"])

    (v1, g1) = jax.jit(jax.value_and_grad(functools.partial(loss, group=K)))(params)
    (v2, g2) = jax.jit(jax.value_and_grad(functools.partial(loss, group=1)))(params)
    assert v1.dtype == jnp.float64
    np.testing.assert_allclose(v1, v2, rtol=1e-12)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g1), jax.tree.leaves(g2)):
        scale = max(float(np.abs(np.asarray(b)).max()), 1e-6)
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=1e-12, err_msg=str(path[0]))


def test_packing_saves_by_the_hand_computed_costs():
    # CFG's block: q,o 32·32 each, k,v 32·16 each, gate/up/down 32·64 each = 9,216 weights, so a token
    # costs 18,432 FLOPs per layer and a (query, key) pair 4·4·8 = 128.
    # P=5, N=4, K=3: unpacked 3·(9·18,432 + 81·128) = 528,768; packed (T=17) 17·18,432 + 289·128 = 350,336.
    assert packing_saves(CFG, 5, 4, 3)
    # P=1, N=64, K=8: unpacked 8·(65·18,432 + 65²·128) = 13,911,040; packed (T=513)
    # 513·18,432 + 513²·128 = 43,141,248: long completions are not packed.
    assert not packing_saves(CFG, 1, 64, 8)
    # P=20, N=24, K=2: unpacked 2·(44·18,432 + 44²·128) = 2,117,632; packed (T=68) 68·18,432 + 68²·128
    # = 1,845,248.
    assert packing_saves(CFG, 20, 24, 2)
    assert not packing_saves(CFG, 5, 4, 1)  # no group
    windowed = dataclasses.replace(CFG, sliding_window=16)
    assert not packing_saves(windowed, 5, 4, 3)  # the packed row (17) exceeds the window
    assert packing_saves(windowed, 5, 3, 3)  # 14 fits


def test_shared_prompt_group_claims_a_group_only_when_its_prompts_are_equal():
    ids = np.repeat(np.asarray([[0, 5, 6], [7, 8, 9]], np.int32), 2, axis=0)
    mask = (ids != 0).astype(np.int32)
    assert shared_prompt_group(ids, mask, 2) == 2
    assert shared_prompt_group(ids, mask, 1) == 1
    assert shared_prompt_group(ids, mask, 3) == 1  # 4 rows are not groups of 3
    assert shared_prompt_group(ids, mask, 4) == 1  # two different prompts in one group of 4
    other = ids.copy()
    other[3, 2] = 4  # one token of the second group's second row
    assert shared_prompt_group(other, mask, 2) == 1
    other_mask = mask.copy()
    other_mask[1, 0] = 1  # same ids, a padding slot read as a token
    assert shared_prompt_group(ids, other_mask, 2) == 1


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def test_a_grpo_batch_is_grouped_and_its_loss_and_gradient_equal_the_unpacked_ones(tiny_dir, tmp_path):
    """The trainer's own batch (4 prompts x 4 completions, 2 micro-batches of 2 groups): rollout_batch
    claims the groups, the reference pass and the GRPO loss's value and gradient are the unpacked ones."""
    trainer = OnlineTrainer(from_yaml(RunConfig, f"""
model: {{name: {tiny_dir}}}
data: {{task: addition, train_size: 64, eval_size: 8, max_prompt_length: 64}}
sampling: {{max_new_tokens: 8, engine: static}}  # its draws for this seed stop some rows early
algorithm: {{name: grpo, group_size: 4, prompts_per_step: 4, kl_coef: 0.01}}
optim: {{learning_rate: 1.0e-2}}
train: {{steps: 1, run_dir: {tmp_path / "run"}, progress: false}}
rewards: {{length: 1.0}}
"""))
    a, run = trainer.cfg.algorithm, trainer.run
    roll, _ = trainer.rollouts(rng.step_key(trainer.sample_stream, run.step))
    batch = rollout_batch(roll, mask_truncated=False, group_size=trainer.group_rows)
    assert batch.prompt_group == 4
    assert rollout_batch(roll, mask_truncated=False).prompt_group == 1
    flat = batch.replace(prompt_group=1)
    p = run.policy
    ref = [score_logprobs(p.graphdef, run.reference(), p.frozen, b, temperature=1.0) for b in (batch, flat)]
    real = np.asarray(batch.completion_mask, bool)  # after a row's stop token the values are not defined
    assert 0 < real.sum() < real.size  # some rows stopped early: padding inside the packed rows
    np.testing.assert_allclose(np.asarray(ref[0])[real], np.asarray(ref[1])[real], atol=1e-5)
    assert np.abs(np.asarray(ref[1])[real]).max() > 0.5
    algo = get_algorithm(a.name)

    def loss(params, b):
        b = algo.advantages(b.replace(ref_logprobs=ref[1]), a)
        return algo.loss(nnx.merge(p.graphdef, params, p.frozen), b, cfg=a, temperature=1.0,
                         **rollout_totals(b))[0]

    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(loss))(p.params, b) for b in (batch, flat))
    np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-7)
    assert float(optax_global_norm(g2)) > 0
    for path, x, y in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g1), jax.tree.leaves(g2)):
        scale = max(float(np.abs(np.asarray(y)).max()), 1e-6)
        np.testing.assert_allclose(np.asarray(x) / scale, np.asarray(y) / scale, atol=1e-5, err_msg=str(path[0]))


def optax_global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def test_packing_group_needs_whole_groups_per_micro_batch_and_packed_rows_for_every_batch_shard(monkeypatch):
    from rljax import rollout

    assert rollout.packing_group(16, 4) == 4
    assert rollout.packing_group(16, 4, 2) == 4  # 2 micro-batches of 2 whole groups
    assert rollout.packing_group(12, 4, 2) == 1  # 6-row micro-batches would cut a group
    assert rollout.packing_group(16, 1) == 1
    monkeypatch.setattr(rollout, "batch_shards", lambda: 4)  # rows split 4 ways (e.g. mesh.fsdp=4)
    assert rollout.packing_group(16, 4) == 4  # 4 packed rows, one per shard
    assert rollout.packing_group(16, 4, 2) == 1  # 2 packed rows per micro-batch for 4 shards
    assert rollout.packing_group(32, 4, 2) == 4
