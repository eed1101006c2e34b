"""rljax.losses.kl: estimator values, reference, non-negativity, Monte-Carlo and gradient contracts."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import _loss_reference as ref
except ImportError:
    import _loss_reference as ref
from rljax.losses import kl as K
from rljax.losses import reduce as R

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


@JIT
def test_hand_computed(use_jit):
    # π(y) = 0.5, π_ref(y) = 0.25, π_old(y) = 0.4:  d = log 0.25 − log 0.5 = −log 2 = −0.6931472
    #   k1 = −d = 0.6931472;  k2 = d²/2 = 0.2402265;  k3 = e^d − d − 1 = 0.5 + 0.6931472 − 1
    #   = 0.1931472;  k3_unbiased = (0.5 / 0.4) · k3 = 0.2414340
    lp = jnp.log(jnp.array([[0.5]], jnp.float32))
    rl = jnp.log(jnp.array([[0.25]], jnp.float32))
    old = jnp.log(jnp.array([[0.4]], jnp.float32))
    fn = _maybe_jit(lambda a, b, c: [K.kl_penalty(a, b, estimator=e, old_logprobs=c)
                                     for e in K.KL_ESTIMATORS], use_jit)
    out = [float(x[0, 0]) for x in fn(lp, rl, old)]
    np.testing.assert_allclose(out, [0.6931472, 0.2402265, 0.1931472, 0.2414340], rtol=1e-6)


@pytest.mark.parametrize("estimator", K.KL_ESTIMATORS)
def test_matches_verl_trl_reference(estimator):
    rng = np.random.default_rng(0)
    lp = rng.normal(-2.0, 1.0, (6, 7)).astype(np.float32)
    rl = (lp + rng.normal(0, 0.5, lp.shape)).astype(np.float32)
    old = (lp + rng.normal(0, 0.1, lp.shape)).astype(np.float32)
    got = K.kl_penalty(lp, rl, estimator=estimator, old_logprobs=old)
    np.testing.assert_allclose(got, ref.kl_ref(lp, rl, estimator, old), rtol=1e-6, atol=1e-7)


def test_k3_non_negative_everywhere():
    d = np.concatenate([np.linspace(-20, 20, 4001), [1e-8, -1e-8, 1e-12, 3e-5, -3e-5, 0.0]])
    lp = np.zeros((1, d.size), np.float32)
    k3 = K.kl_penalty(lp, d[None].astype(np.float32), estimator="k3")
    assert np.all(np.asarray(k3) >= 0.0)
    assert float(k3[0, -1]) == 0.0  # d = 0


def _categoricals(seed, n=5):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=n).astype(np.float32) for _ in range(3)]  # policy, ref, old logits


def _kl_exact(p_logits, q_logits):
    """KL(p ‖ q) of two categoricals, float64."""
    lp = p_logits - np.logaddexp.reduce(p_logits.astype(np.float64))
    lq = q_logits - np.logaddexp.reduce(q_logits.astype(np.float64))
    return float(np.sum(np.exp(lp) * (lp - lq)))


def test_expectations_equal_exact_kl():
    """Σ_y π(y) k1 = Σ_y π(y) k3 = KL(π‖π_ref); Σ_y π_old(y) ρ k3 = KL(π‖π_ref) (importance
    weighting makes k3 unbiased off-policy); Σ_y π(y) k2 ≠ KL in general (biased value)."""
    pol, rf, old = _categoricals(1)
    lp, lr, lo = (jax.nn.log_softmax(x)[None] for x in (pol, rf, old))
    exact = _kl_exact(pol, rf)
    p, p_old = np.exp(np.asarray(lp, np.float64)), np.exp(np.asarray(lo, np.float64))
    k = {e: np.asarray(K.kl_penalty(lp, lr, estimator=e, old_logprobs=lo), np.float64)
         for e in K.KL_ESTIMATORS}
    np.testing.assert_allclose(np.sum(p * k["k1"]), exact, rtol=1e-6)
    np.testing.assert_allclose(np.sum(p * k["k3"]), exact, rtol=1e-6)
    np.testing.assert_allclose(np.sum(p_old * k["k3_unbiased"]), exact, rtol=1e-6)
    assert abs(np.sum(p * k["k2"]) - exact) > 1e-3


def test_monte_carlo_mean_of_k3_matches_exact_kl():
    """Sample 200k tokens from π (numpy RNG) and average k3: within 4 standard errors of the
    exact KL of the two categoricals (and k3 ≥ 0 on every sample)."""
    pol, rf, old = _categoricals(2)
    lp_all, lr_all, lo_all = (np.asarray(jax.nn.log_softmax(x)) for x in (pol, rf, old))
    exact = _kl_exact(pol, rf)
    rng = np.random.default_rng(3)
    for estimator, sampler in (("k3", lp_all), ("k1", lp_all), ("k3_unbiased", lo_all)):
        y = rng.choice(pol.size, size=(400, 500), p=np.exp(sampler.astype(np.float64)) /
                       np.exp(sampler.astype(np.float64)).sum())
        k = np.asarray(K.kl_penalty(jnp.asarray(lp_all[y]), jnp.asarray(lr_all[y]),
                                    estimator=estimator, old_logprobs=jnp.asarray(lo_all[y])),
                       np.float64)
        if estimator != "k1":
            assert np.all(k >= 0)
        standard_error = k.std() / math.sqrt(k.size)
        assert abs(k.mean() - exact) < 4 * standard_error, (estimator, k.mean(), exact)


def test_expected_gradients_match_docstring():
    """On-policy expected gradients E_π[∇k]: k1 → 0, k2 → ∇KL(π‖ref), k3 → ∇KL(ref‖π);
    off-policy with y ~ π_old: E_old[∇(ρ k3)] → ∇KL(π‖ref) (k3_unbiased)."""
    pol, rf, old = _categoricals(4)
    lr = jax.nn.log_softmax(rf)[None]
    lo = jax.nn.log_softmax(old)[None]

    def expected(theta, estimator, weights_logits):
        lp = jax.nn.log_softmax(theta)[None]
        w = jax.lax.stop_gradient(jax.nn.softmax(weights_logits))[None]
        k = K.kl_penalty(lp, lr, estimator=estimator, old_logprobs=lo)
        return jnp.sum(w * k)

    def reverse_kl(theta):
        lp = jax.nn.log_softmax(theta)
        return jnp.sum(jnp.exp(lp) * (lp - lr[0]))

    def forward_kl(theta):
        lp = jax.nn.log_softmax(theta)
        return jnp.sum(jnp.exp(lr[0]) * (lr[0] - lp))

    @jax.jit
    def all_grads(theta, old_logits):
        g = {e: jax.grad(expected)(theta, e, theta) for e in ("k1", "k2", "k3")}
        g["k3_unbiased"] = jax.grad(expected)(theta, "k3_unbiased", old_logits)
        return g, jax.grad(reverse_kl)(theta), jax.grad(forward_kl)(theta)

    theta = jnp.asarray(pol)
    g, grad_reverse, grad_forward = all_grads(theta, jnp.asarray(old))
    np.testing.assert_allclose(g["k1"], 0.0, atol=1e-7)
    np.testing.assert_allclose(g["k2"], grad_reverse, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g["k3"], grad_forward, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g["k3_unbiased"], grad_reverse, rtol=1e-6, atol=1e-7)
    # and k3 is NOT the reverse-KL gradient (the reason k3_unbiased exists)
    assert np.max(np.abs(g["k3"] - grad_reverse)) > 1e-3


@pytest.mark.parametrize("estimator", K.KL_ESTIMATORS)
def test_stop_gradients(estimator):
    rng = np.random.default_rng(5)
    lp, rl, old = (jnp.asarray(rng.normal(-1, 0.3, (2, 3)), jnp.float32) for _ in range(3))
    grads = jax.grad(lambda a, b, c: jnp.sum(K.kl_penalty(a, b, estimator=estimator,
                                                          old_logprobs=c)), argnums=(0, 1, 2))(lp, rl, old)
    assert np.any(np.asarray(grads[0]) != 0)
    np.testing.assert_array_equal(grads[1], 0.0)
    np.testing.assert_array_equal(grads[2], 0.0)


def test_masked_positions_are_zero_with_finite_gradients():
    lp = jnp.array([[-1.0, -jnp.inf], [-0.5, jnp.nan]], jnp.float32)
    rl = jnp.array([[-1.5, -2.0], [-0.7, -jnp.inf]], jnp.float32)
    mask = jnp.array([[1, 0], [1, 0]])
    for estimator in K.KL_ESTIMATORS:
        fn = lambda x: jnp.sum(K.kl_penalty(x, rl, estimator=estimator, old_logprobs=lp, mask=mask))
        k = K.kl_penalty(lp, rl, estimator=estimator, old_logprobs=lp, mask=mask)
        np.testing.assert_array_equal(k[:, 1], 0.0)
        g = jax.jit(jax.grad(fn))(lp)
        assert np.all(np.isfinite(g)), estimator
        np.testing.assert_array_equal(g[:, 1], 0.0)


def test_unknown_estimator_and_missing_old():
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="estimator"):
        K.kl_penalty(x, x, estimator="k4")
    with pytest.raises(ValueError, match="old_logprobs"):
        K.kl_penalty(x, x, estimator="k3_unbiased")


@JIT
def test_kl_loss_hand_computed(use_jit):
    # token_mean of k1 over mask [[1, 1, 0]]: (0.5 + 0.1) / 2 = 0.3 (the 5.0 is masked)
    lp = jnp.array([[0.0, 0.0, 5.0]], jnp.float32)
    rl = jnp.array([[-0.5, -0.1, 0.0]], jnp.float32)
    fn = _maybe_jit(lambda a, b, m: K.kl_loss(a, b, m, estimator="k1", reduction="token_mean"), use_jit)
    loss, metrics = fn(lp, rl, jnp.array([[1, 1, 0]]))
    np.testing.assert_allclose([loss, metrics["kl/mean"], metrics["kl/loss"]], [0.3] * 3, rtol=1e-6)


@functools.partial(jax.jit, static_argnames="reduction")
def _kl_value_and_grad(lp, rl, mask, num_sequences=None, num_tokens=None, *, reduction):
    return jax.value_and_grad(lambda x: K.kl_loss(
        x, rl, mask, reduction=reduction, num_sequences=num_sequences, num_tokens=num_tokens)[0])(lp)


@pytest.mark.parametrize("reduction", R.REDUCTIONS)
def test_kl_loss_micro_batches_and_reference(reduction):
    rng = np.random.default_rng(6)
    lp = rng.normal(-1, 0.5, (8, 5)).astype(np.float32)
    rl = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    mask = (rng.random((8, 5)) < 0.7).astype(np.float32)
    mask[:, 0] = 1
    counts = dict(num_sequences=R.num_valid_sequences(mask), num_tokens=R.num_valid_tokens(mask))
    full_v, full_g = _kl_value_and_grad(lp, rl, mask, reduction=reduction)
    parts = [_kl_value_and_grad(a, b, m, **counts, reduction=reduction)
             for a, b, m in zip(*(np.split(x, 4) for x in (lp, rl, mask)))]
    np.testing.assert_allclose(sum(v for v, _ in parts), full_v, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([g for _, g in parts]), full_g, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(full_v, ref.reduce_ref(ref.kl_ref(lp, rl, "k3"), mask, reduction),
                               rtol=1e-6)
