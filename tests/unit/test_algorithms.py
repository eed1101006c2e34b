"""The algorithm interface: every algorithm registered with its config section, the trainers free of
algorithm names, and the wiring of REINFORCE++ and RLOO's paper form checked by hand."""

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.algorithms import ALGORITHMS, get, reinforce, reinforce_pp, rloo
from rljax.batches import RolloutBatch
from rljax.config import FieldError, from_yaml, union_members
from rljax.run_config import AlgorithmSection, RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_algorithm_is_registered_with_its_own_config_section():
    members = union_members(AlgorithmSection)
    assert set(ALGORITHMS) <= set(members) and len(ALGORITHMS) >= 9
    for name, algorithm in ALGORITHMS.items():
        assert members[name] is algorithm.config and algorithm.config().name == name
        cfg = from_yaml(RunConfig, f"algorithm: {{name: {name}}}\nrewards: {{answer: 1.0}}" if algorithm.online
                        else f"algorithm: {{name: {name}}}")
        assert isinstance(cfg.algorithm, algorithm.config) and hash(cfg.algorithm) == hash(algorithm.config())  # a static jit argument
    with pytest.raises(KeyError, match="known: grpo"):
        get("sac")


def _contract_rollouts(R: int, N: int, vocab: int) -> RolloutBatch:
    rng = np.random.default_rng(0)
    mask = np.ones((R, N), np.int32)
    mask[1, N - 2:] = 0  # a short completion
    old = -rng.uniform(0.5, 3.0, (R, N)).astype(np.float32)
    return RolloutBatch(
        prompt_ids=jnp.asarray(rng.integers(3, vocab, (R, 3)), jnp.int32), prompt_mask=jnp.ones((R, 3), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(3, vocab, (R, N)), jnp.int32), completion_mask=jnp.asarray(mask),
        loss_mask=jnp.asarray(mask), old_logprobs=jnp.asarray(old),
        scores=jnp.asarray(rng.uniform(0, 1, R), jnp.float32), row_mask=jnp.ones(R, bool),
        finished=jnp.ones(R, bool), ref_logprobs=jnp.asarray(old - 0.1),
        old_values=jnp.asarray(rng.normal(0, 0.5, (R, N)), jnp.float32))


def _contract_offline_batch(kind, cfg, B: int, N: int, vocab: int):
    """A concrete batch with the data kind's own shapes: random tokens, every mask and row 1."""
    rng = np.random.default_rng(1)
    shapes = kind.abstract_batch(B, 3, N, cfg, reference=True)

    def fill(path, x):
        name = jax.tree_util.keystr(path)
        if jnp.issubdtype(x.dtype, jnp.floating):
            value = -rng.uniform(1, 4, x.shape) if "ref_logps" in name else rng.uniform(0.5, 1.5, x.shape)
            return jnp.asarray(value, x.dtype)
        if "ids" in name:
            return jnp.asarray(rng.integers(3, vocab, x.shape), x.dtype)
        return jnp.ones(x.shape, x.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_meets_the_contract_on_a_tiny_batch(name):
    """Whatever is registered: its section builds from defaults (with a KL term where it has one),
    its advantages fill the batch, and its loss over the model is a finite scalar with a finite,
    non-zero gradient; offline, its score has the data kind's ``[B, K]`` shape."""
    from flax import nnx

    from rljax.data.kinds import get_kind
    from rljax.models.tiny import tiny_config
    from tests._tiny import model_with_value_head

    algorithm = ALGORITHMS[name]
    fields = {f.name for f in dataclasses.fields(algorithm.config)}
    cfg = algorithm.config(**({"kl_coef": 0.05} if "kl_coef" in fields else {}))
    config = tiny_config(64)
    model = model_with_value_head(config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if algorithm.online:
        batch = _contract_rollouts(cfg.rows, 5, 64)
        filled, _ = algorithm.advantages_and_state(batch, cfg, algorithm.start_state(cfg))
        assert filled.advantages is not None and filled.advantages.shape == (cfg.rows, 5)
        assert bool(jnp.all(jnp.isfinite(filled.advantages)))
        assert float(jnp.abs(filled.advantages).sum()) > 0
        totals = algorithm.totals(filled, cfg)
        assert set(totals) >= {"num_rows", "num_tokens", "max_length"}
        loss_fn = lambda p: algorithm.loss(nnx.merge(graphdef, p, rest), filled, cfg, temperature=1.0, **totals)  # noqa: E731
        if algorithm.value_head(cfg) == "separate":
            critic = lambda p: algorithm.critic_loss(nnx.merge(graphdef, p, rest), filled, cfg, **totals)  # noqa: E731
            (value, _), _ = jax.jit(jax.value_and_grad(critic, has_aux=True))(params)
            assert np.isfinite(float(value))
        assert algorithm.critic(cfg).learning_rate is None or algorithm.critic(cfg).learning_rate > 0
    else:
        kind = get_kind(algorithm.data_kind(cfg))
        batch = _contract_offline_batch(kind, cfg, 2, 5, 64)
        totals = algorithm.totals(batch, cfg)
        loss_fn = lambda p: algorithm.loss(nnx.merge(graphdef, p, rest), batch, cfg, **totals)  # noqa: E731
        scores, lengths = jax.jit(lambda p, b: algorithm.score(nnx.merge(graphdef, p, rest), b))(params, batch)
        assert scores.shape[0] == 2 and scores.shape == lengths.shape
        assert bool(jnp.all(jnp.isfinite(scores)))
    (value, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    assert np.ndim(value) == 0 and np.isfinite(float(value))
    assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())
    norms = [float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and sum(norms) > 0


def test_trainers_hold_no_branch_on_an_algorithm_name():
    names = "|".join(ALGORITHMS)
    for file in ("online.py", "offline.py", "loop.py", "run.py", "data.py", "__init__.py"):
        source = open(os.path.join(REPO, "rljax", "training", file)).read()
        # (a data kind may be called "records"; a comparison with an algorithm's name is a branch)
        assert not re.search(rf"""(==|!=|\bin)\s*[(\[{{]?\s*['"]({names})['"]""", source), \
            f"rljax/training/{file} branches on an algorithm's name"
    assert re.search(rf"""(==|!=|\bin)\s*[(\[{{]?\s*['"]({names})['"]""", 'if cfg.name == "ppo":')  # the check works


def _batch(scores, mask, old, ref, row_mask=None):
    mask = jnp.asarray(mask, jnp.int32)
    R, N = mask.shape
    return RolloutBatch(prompt_ids=jnp.zeros((R, 1), jnp.int32), prompt_mask=jnp.ones((R, 1), jnp.int32),
                        completion_ids=jnp.zeros((R, N), jnp.int32), completion_mask=mask, loss_mask=mask,
                        old_logprobs=jnp.asarray(old, jnp.float32), scores=jnp.asarray(scores, jnp.float32),
                        row_mask=jnp.ones(R, bool) if row_mask is None else jnp.asarray(row_mask),
                        finished=jnp.ones(R, bool), ref_logprobs=jnp.asarray(ref, jnp.float32))


@pytest.mark.parametrize("jit", [False, True])
def test_reinforce_pp_advantages_by_hand(jit):
    # two rows, gamma 1, k1 KL in the reward: r_t = -beta (old - ref), score on the last real token
    old = [[-1.0, -2.0, -0.5], [-1.5, -1.0, 0.0]]
    ref = [[-1.5, -1.0, -0.5], [-1.0, -1.0, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    batch = _batch([1.0, 0.0], mask, old, ref)
    cfg = reinforce_pp.ReinforcePPConfig(kl_coef=0.1, group_size=1)
    fn = jax.jit(reinforce_pp.advantages, static_argnums=1) if jit else reinforce_pp.advantages
    out = fn(batch, cfg)
    r = -0.1 * (np.asarray(old) - np.asarray(ref)) * np.asarray(mask)
    r[0, 2] += 1.0
    r[1, 1] += 0.0
    returns = np.array([[r[0, 0] + r[0, 1] + r[0, 2], r[0, 1] + r[0, 2], r[0, 2]], [r[1, 0] + r[1, 1], r[1, 1], 0.0]])
    valid = np.asarray(mask, bool)
    mean, std = returns[valid].mean(), returns[valid].std(ddof=1)
    want = np.where(valid, (returns - mean) / (std + 1e-8), 0.0)
    np.testing.assert_allclose(out.returns, returns, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out.advantages, want, rtol=1e-5, atol=1e-6)


def test_reinforce_carries_its_baseline_across_steps():
    # KL in the reward at sequence level (k1, beta 0.1), then advantages against the earlier steps' mean:
    # step 1: sum_t (old - ref) = 0.5 and -0.5 -> R = [1 - 0.05, 0 + 0.05] = [0.95, 0.05], b = 0.5 (its own
    # batch: no history), A = [0.45, -0.45]; the baseline becomes 0.5 after 2 rewards.
    old = [[-1.0, -2.0, -0.5], [-1.5, -1.0, 0.0]]
    ref = [[-1.5, -1.0, -1.5], [-1.0, -1.0, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    cfg = reinforce.ReinforceConfig(kl_coef=0.1)
    state = reinforce.initial_state(cfg)
    batch = _batch([1.0, 0.0], mask, old, ref)
    out, state = reinforce.advantages(batch, cfg, state)
    np.testing.assert_allclose(out.advantages, [[0.45, 0.45, 0.45], [-0.45, -0.45, 0.0]], rtol=1e-5)
    np.testing.assert_allclose([state["baseline"], state["count"]], [0.5, 2.0], rtol=1e-6)
    out2, state2 = reinforce.advantages(_batch([1.0, 1.0], mask, old, ref), cfg, state)
    # step 2, scores [1, 1]: R = [0.95, 1.05], A = R - 0.5 = [0.45, 0.55] (the earlier steps' baseline,
    # not this batch's mean 1.0); mean of all four R = 0.75
    np.testing.assert_allclose(out2.advantages[:, 0], [0.45, 0.55], rtol=1e-5)
    np.testing.assert_allclose([state2["baseline"], state2["count"]], [0.75, 4.0], rtol=1e-6)
    with pytest.raises(ValueError, match="num_iterations"):
        reinforce.ReinforceConfig(num_iterations=2).validate()
    with pytest.raises(FieldError, match="baseline_decay"):
        reinforce.ReinforceConfig(baseline_decay=1.0).validate()


def test_rloo_paper_form_is_reinforce_over_the_whole_sequence():
    # loss: reinforce -> -(1/S) sum_i A_i log pi(y_i) with A_i the leave-one-out advantage of the
    # KL-penalised sequence reward; checked against a hand computation with a fake model.
    logp = np.array([[-0.5, -1.0, -2.0], [-1.0, -0.2, 0.0], [-0.3, -0.3, -0.3], [-2.0, 0.0, 0.0]], np.float32)
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    scores = [1.0, 0.0, 0.5, 2.0]
    old = logp - 0.1
    ref = logp - 0.3
    cfg = rloo.RLOOConfig(loss="reinforce", kl_coef=0.05, group_size=4, prompts_per_step=1)
    batch = rloo.advantages(_batch(scores, mask, old, ref), cfg)
    m = np.asarray(mask, np.float32)
    R = np.asarray(scores) - 0.05 * ((old - ref) * m).sum(-1)  # k1 in the reward, summed over the sequence
    A = R - (R.sum() - R) / 3
    want = -np.mean(A * (logp * m).sum(-1))

    class FakeModel:  # completion_logprobs asks for hidden states, logits: give the chosen log-probs
        pass

    def loss_of(batch):
        import rljax.algorithms.policy_gradient as pg
        out = {"logprobs": jnp.asarray(logp), "entropy": jnp.zeros_like(jnp.asarray(logp))}
        original = pg.policy_logprobs
        pg.policy_logprobs = lambda *a, **k: out
        try:
            return rloo.loss(FakeModel(), batch, cfg, temperature=1.0, num_rows=4, num_tokens=int(m.sum()),
                             max_length=3)
        finally:
            pg.policy_logprobs = original

    value, metrics = loss_of(batch)
    np.testing.assert_allclose(np.asarray(batch.advantages)[:, 0], A, rtol=1e-5)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    assert rloo.token_reduction(cfg) == "seq_mean_token_sum"
    assert rloo.token_reduction(rloo.RLOOConfig()) == "seq_mean_token_mean"


def test_grpo_kl_placement_reward_moves_the_kl_from_the_loss_into_the_group_normalised_scores():
    from rljax.algorithms import grpo
    from rljax.config import ConfigError

    logp = np.array([[-0.5, -1.0, -2.0], [-1.0, -0.2, 0.0], [-0.3, -0.3, -0.3], [-2.0, 0.0, 0.0]], np.float32)
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    m = np.asarray(mask, np.float32)
    scores = np.array([1.0, 0.0, 0.5, 2.0])
    old, ref = logp - 0.1, logp - np.array([[0.3], [0.0], [0.6], [0.2]], np.float32)  # a different KL per row
    common = dict(kl_coef=0.5, kl_estimator="k1", group_size=4, prompts_per_step=1)
    in_reward = grpo.advantages(_batch(scores, mask, old, ref), grpo.GRPOConfig(kl_placement="reward", **common))
    in_loss = grpo.advantages(_batch(scores, mask, old, ref), grpo.GRPOConfig(**common))
    R = scores - 0.5 * ((old - ref) * m).sum(-1)  # k1 = old - ref per token: 0.2*3, -0.1*2, 0.5*3, 0.1*1
    np.testing.assert_allclose(R, [0.7, 0.1, -0.25, 1.95], rtol=1e-5)
    want = (R - R.mean()) / (R.std(ddof=1) + 1e-4)
    np.testing.assert_allclose(np.asarray(in_reward.advantages)[:, 0], want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(in_loss.advantages)[:, 0], (scores - scores.mean()) / (scores.std(ddof=1) + 1e-4),
                               rtol=1e-5)

    # the loss: the KL term only with kl_placement loss (on-policy, so the surrogate parts are equal)
    out = {"logprobs": jnp.asarray(old), "entropy": jnp.zeros_like(jnp.asarray(old))}
    import rljax.algorithms.policy_gradient as pg
    original = pg.policy_logprobs
    pg.policy_logprobs = lambda *a, **k: out
    try:
        values = {}
        for placement, batch in (("loss", in_loss), ("reward", in_reward)):
            cfg = grpo.GRPOConfig(kl_placement=placement, **common)
            values[placement] = grpo.loss(None, batch, cfg, temperature=1.0, num_rows=4, num_tokens=int(m.sum()),
                                          max_length=3)[1]
    finally:
        pg.policy_logprobs = original
    # on-policy (ratio 1) the surrogate is 0 with these sums, so the loss is beta * the k1 term, reduced
    # seq_mean_token_mean: row means 0.2, -0.1, 0.5, 0.1 -> 0.175 -> 0.5 * 0.175
    np.testing.assert_allclose(values["loss"]["policy/loss"], 0.0875, rtol=1e-5)
    np.testing.assert_allclose(values["reward"]["policy/loss"], 0.0, atol=1e-7)
    assert "kl/mean" in values["loss"] and "kl/mean" not in values["reward"]
    with pytest.raises(ConfigError, match="k3_unbiased"):
        from_yaml(RunConfig, "algorithm: {name: grpo, kl_placement: reward, kl_estimator: k3_unbiased, kl_coef: 0.1}\n"
                  "rewards: {answer: 1.0}")
