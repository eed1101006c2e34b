"""rljax.losses.reward_model: Bradley–Terry (TRL RewardTrainer) and InstructGPT's K-wise loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import _loss_reference as ref
except ImportError:
    import _loss_reference as ref
from rljax.losses import reward_model as RM

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


@JIT
def test_hand_computed_bradley_terry(use_jit):
    # Pair 0: r⁺ = 1, r⁻ = 0, margin 0.5: −log σ(0.5) = 0.4740770.
    # Pair 1: r⁺ = −1, r⁻ = 0, margin 0:  −log σ(−1) = 1.3132617.   BT mean = 0.8936693.
    # Centring, c = 0.01: mean((1 + 0)², (−1 + 0)²) = 1 -> + 0.01 = 0.9036693.
    # Pair 2 is padding (mask 0). Metrics: chosen mean 0, rejected 0, margin 0, accuracy 1/2.
    chosen = jnp.array([1.0, -1.0, 50.0])
    rejected = jnp.array([0.0, 0.0, -50.0])
    margin = jnp.array([0.5, 0.0, 3.0])
    mask = jnp.array([1, 1, 0])
    fn = _maybe_jit(lambda c, r, mg, m: RM.bradley_terry_loss(c, r, margin=mg, centering_coef=0.01,
                                                              mask=m), use_jit)
    loss, metrics = fn(chosen, rejected, margin, mask)
    np.testing.assert_allclose(loss, 0.9036693, rtol=1e-6)
    expect = {"reward_model/loss": 0.9036693, "reward_model/bt_loss": 0.8936693,
              "reward_model/centering_loss": 1.0, "rewards/chosen": 0.0, "rewards/rejected": 0.0,
              "rewards/margin": 0.0, "rewards/accuracy": 0.5}
    assert set(metrics) == set(expect)
    for key, val in expect.items():
        np.testing.assert_allclose(metrics[key], val, rtol=1e-6, atol=1e-7, err_msg=key)


@JIT
def test_hand_computed_kwise(use_jit):
    # Prompt 0, K = 3 ranked [3, 2, 0]: pairs (3−2, 3−0, 2−0) = (1, 3, 2):
    #   (−log σ(1) − log σ(3) − log σ(2)) / 3 = (0.3132617 + 0.0485874 + 0.1269280)/3 = 0.1629257
    # Prompt 1 has answers 0 and 2 only ([1, ·, 0], the middle one masked): −log σ(1) = 0.3132617
    # Prompt 2 has a single answer: no pair, not counted.    loss = (0.1629257 + 0.3132617)/2
    rewards = jnp.array([[3.0, 2.0, 0.0], [1.0, 99.0, 0.0], [5.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 1], [1, 0, 0]])
    loss, metrics = _maybe_jit(lambda r, m: RM.kwise_ranking_loss(r, mask=m), use_jit)(rewards, mask)
    np.testing.assert_allclose(loss, (0.1629257 + 0.3132617) / 2, rtol=1e-6)
    # accuracy over the 4 valid pairs: all ranked correctly; margin mean (1 + 3 + 2 + 1)/4
    np.testing.assert_allclose([metrics["rewards/accuracy"], metrics["rewards/margin"]], [1.0, 1.75])


def _random(seed, b=8):
    rng = np.random.default_rng(seed)
    return (rng.normal(0.5, 1, b).astype(np.float32), rng.normal(0, 1, b).astype(np.float32),
            rng.uniform(0, 1, b).astype(np.float32))


def test_bradley_terry_matches_trl_reference():
    chosen, rejected, margin = _random(0)
    for kwargs, ref_kwargs in (({}, {}), ({"margin": margin}, {"margin": margin}),
                               ({"margin": margin, "centering_coef": 0.01},
                                {"margin": margin, "center_coef": 0.01})):
        loss, _ = RM.bradley_terry_loss(chosen, rejected, **kwargs)
        np.testing.assert_allclose(loss, ref.bradley_terry_ref(chosen, rejected, **ref_kwargs), rtol=1e-6)


_kwise = jax.jit(lambda r, m=None: RM.kwise_ranking_loss(r, mask=m)[0])


def test_kwise_matches_instructgpt_reference_and_reduces_to_bt():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(6, 4)).astype(np.float32)
    mask = (rng.random((6, 4)) < 0.8).astype(np.float32)
    mask[0] = [1, 0, 0, 0]  # one prompt without a pair
    np.testing.assert_allclose(_kwise(rewards), ref.kwise_ref(rewards), rtol=1e-6)
    np.testing.assert_allclose(_kwise(rewards, mask), ref.kwise_ref(rewards, mask), rtol=1e-6)
    # K = 2 is the Bradley–Terry loss
    chosen, rejected, _ = _random(2)
    np.testing.assert_allclose(_kwise(jnp.stack([chosen, rejected], 1)),
                               RM.bradley_terry_loss(chosen, rejected)[0], rtol=1e-6)


def test_gradients():
    """∂/∂r⁺ of −log σ(r⁺ − r⁻ − m) is −σ(−(r⁺ − r⁻ − m))/B, opposite for r⁻; the margin is a
    constant; centring adds 2c(r⁺ + r⁻)/B to both."""
    chosen, rejected, margin = _random(3)
    grads = jax.jit(jax.grad(lambda c, r, m: RM.bradley_terry_loss(
        c, r, margin=m, centering_coef=0.1)[0], argnums=(0, 1, 2)))(chosen, rejected, margin)
    gap = chosen.astype(np.float64) - rejected - margin
    bt = -1 / (1 + np.exp(gap)) / chosen.size
    centre = 2 * 0.1 * (chosen.astype(np.float64) + rejected) / chosen.size
    np.testing.assert_allclose(grads[0], bt + centre, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grads[1], -bt + centre, rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(grads[2], 0.0)


def test_padding_and_micro_batches():
    with jax.enable_x64(True):  # algebraic equalities: checked in float64
        _check_padding_and_micro_batches()


def _check_padding_and_micro_batches():
    chosen, rejected, margin = (x.astype(np.float64) for x in _random(4))
    bt = jax.jit(jax.value_and_grad(lambda c, r, mg, m=None, n=None: RM.bradley_terry_loss(
        c, r, margin=mg, centering_coef=0.01, mask=m, num_pairs=n)[0], argnums=(0, 1)))
    full_v, full_g = bt(chosen, rejected, margin)
    pad = lambda x, v: np.concatenate([x, np.full(2, v, np.float64)])
    pv, pg = bt(pad(chosen, np.nan), pad(rejected, np.inf), pad(margin, np.nan),
                pad(np.ones(8, np.float64), 0))
    assert full_v.dtype == np.float64
    np.testing.assert_allclose(pv, full_v, rtol=1e-12)
    np.testing.assert_allclose(pg[0][:8], full_g[0], rtol=1e-12)
    np.testing.assert_array_equal(pg[0][8:], 0.0)
    parts = [bt(chosen[i], rejected[i], margin[i], None, 8) for i in np.split(np.arange(8), 4)]
    np.testing.assert_allclose(sum(v for v, _ in parts), full_v, rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([g[0] for _, g in parts]), full_g[0], rtol=1e-12)

    rng = np.random.default_rng(5)
    rewards = rng.normal(size=(8, 3))
    kw = jax.jit(jax.value_and_grad(lambda r, m=None, n=None: RM.kwise_ranking_loss(
        r, mask=m, num_prompts=n)[0]))
    full_v, full_g = kw(rewards)
    big = np.full((10, 5), np.nan, np.float64)
    big[:8, :3] = rewards
    big_mask = np.zeros((10, 5), np.float64)
    big_mask[:8, :3] = 1
    pv, pg = kw(big, big_mask)
    np.testing.assert_allclose(pv, full_v, rtol=1e-12)
    np.testing.assert_allclose(pg[:8, :3], full_g, rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(pg)[big_mask == 0], 0.0)
    parts = [kw(r, None, 8) for r in np.split(rewards, 4)]
    np.testing.assert_allclose(sum(v for v, _ in parts), full_v, rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([g for _, g in parts]), full_g, rtol=1e-12)
