"""rljax.losses.value: clipped value loss and explained variance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import _loss_reference as ref
except ImportError:
    import _loss_reference as ref
from rljax.losses import reduce as R
from rljax.losses import value as V

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


@JIT
def test_hand_computed(use_jit):
    # c_v = 0.2, three tokens (the third masked):
    #   t0: V = 1, V_old = 0.5, R = 2: (V − R)² = 1; V_clip = 0.5 + clip(0.5) = 0.7,
    #       (V_clip − R)² = 1.69 -> max 1.69 (clipped term larger)
    #   t1: V = 2, V_old = 2, R = 1: both 1 -> 1
    #   loss = ½ (1.69 + 1) / 2 = 0.6725; clip_frac = 1/2; unclipped: ½ (1 + 1)/2 = 0.5
    #   explained variance over R = [2, 1], V = [1, 2]: Var R = 0.25, Var(R − V) = Var[1, −1] = 1
    #   -> 1 − 1/0.25 = −3; value/mean 1.5, returns_mean 1.5
    values = jnp.array([[1.0, 2.0, 9.0]])
    old = jnp.array([[0.5, 2.0, 0.0]])
    returns = jnp.array([[2.0, 1.0, -9.0]])
    mask = jnp.array([[1, 1, 0]])
    fn = _maybe_jit(lambda *a: (V.value_loss(*a), V.value_loss(*a, clip_range=None)), use_jit)
    (loss, m), (plain, m_plain) = fn(values, old, returns, mask)
    np.testing.assert_allclose([loss, plain], [0.6725, 0.5], rtol=1e-6)
    expect = {"value/loss": 0.6725, "value/clip_frac": 0.5, "value/explained_variance": -3.0,
              "value/mean": 1.5, "value/returns_mean": 1.5}
    assert set(m) == set(expect)
    for key, val in expect.items():
        np.testing.assert_allclose(m[key], val, rtol=1e-6, err_msg=key)
    assert m_plain["value/clip_frac"] == 0.0


@JIT
def test_explained_variance_hand(use_jit):
    fn = _maybe_jit(V.explained_variance, use_jit)
    r = jnp.array([1.0, 2.0, 3.0, 4.0])
    ones = jnp.ones(4)
    np.testing.assert_allclose(fn(r, r, ones), 1.0)  # perfect
    np.testing.assert_allclose(fn(jnp.full(4, 2.5), r, ones), 0.0)  # the mean: no better
    np.testing.assert_allclose(fn(r + 7.0, r, ones), 1.0)  # constant offset is not "variance"
    assert np.isnan(fn(r, jnp.full(4, 3.0), ones))  # Var R = 0
    # masked entries ignored: V = [1, 2, 99], R = [1, 2, -99] with the last masked -> 1
    np.testing.assert_allclose(fn(jnp.array([1.0, 2.0, 99.0]), jnp.array([1.0, 2.0, -99.0]),
                                  jnp.array([1, 1, 0])), 1.0)


def _random(seed, b=8, t=6):
    rng = np.random.default_rng(seed)
    ret = rng.normal(size=(b, t)).astype(np.float32)
    old = (ret + rng.normal(0, 0.5, (b, t))).astype(np.float32)
    val = (old + rng.normal(0, 0.4, (b, t))).astype(np.float32)
    mask = (rng.random((b, t)) < 0.75).astype(np.float32)
    return val, old, ret, mask


def test_matches_verl_and_cleanrl_reference():
    val, old, ret, mask = _random(0)
    loss, m = jax.jit(lambda *a: V.value_loss(*a, clip_range=0.2))(val, old, ret, mask)
    expect_loss, expect_frac = ref.value_loss_ref(val, ret, old, mask, 0.2)
    np.testing.assert_allclose(loss, expect_loss, rtol=1e-6)
    np.testing.assert_allclose(m["value/clip_frac"], expect_frac, rtol=1e-6)
    assert 0.1 < expect_frac < 0.9
    valid = mask > 0
    np.testing.assert_allclose(m["value/explained_variance"],
                               ref.explained_variance_ref(val[valid], ret[valid]), rtol=1e-6)


def test_gradient_contract():
    """∂L/∂V = (V − R)/N where the unclipped square is the larger, (V_clip − R)·∂V_clip/∂V/N
    otherwise (0 when the clip is active); none reaches V_old or R."""
    val, old, ret, mask = _random(1)
    grads = jax.jit(jax.grad(lambda v, o, r: V.value_loss(v, o, r, mask)[0], argnums=(0, 1, 2)))(
        val, old, ret)
    n = mask.sum()
    clipped_v = old + np.clip(val - old, -0.2, 0.2)
    use_clipped = (clipped_v - ret) ** 2 > (val - ret) ** 2
    inside = np.abs(val - old) < 0.2
    expect = np.where(use_clipped, np.where(inside, clipped_v - ret, 0.0), val - ret) * mask / n
    np.testing.assert_allclose(grads[0], expect, rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(grads[1], 0.0)
    np.testing.assert_array_equal(grads[2], 0.0)


def test_padding_invariance():
    val, old, ret, mask = _random(2, b=4, t=5)

    def pad(x, fill):
        y = np.full((6, 8), fill, np.float32)
        y[:4, :5] = x
        return y

    fn = jax.jit(jax.value_and_grad(lambda v, o, r, m: V.value_loss(v, o, r, m), has_aux=True))
    (v0, m0), g0 = fn(val, old, ret, mask)
    (v1, m1), g1 = fn(pad(val, np.nan), pad(old, np.inf), pad(ret, -1e9), pad(mask, 0))
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for key in m0:
        np.testing.assert_allclose(m1[key], m0[key], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose(np.asarray(g1)[:4, :5], g0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(g1)[4:], 0.0)
    np.testing.assert_array_equal(np.asarray(g1)[:, 5:], 0.0)


@jax.jit
def _value_and_grads(val, old, ret, mask, num_sequences=None, num_tokens=None):
    return {red: jax.value_and_grad(lambda v: V.value_loss(
        v, old, ret, mask, reduction=red, num_sequences=num_sequences, num_tokens=num_tokens,
        max_length=6)[0])(val) for red in R.REDUCTIONS}


def test_micro_batches_sum_to_full_batch():
    with jax.enable_x64(True):  # an algebraic equality: checked in float64
        _check_micro_batches_sum_to_full_batch()


def _check_micro_batches_sum_to_full_batch():
    val, old, ret, mask = (x.astype(np.float64) for x in _random(3))
    counts = dict(num_sequences=R.num_valid_sequences(mask), num_tokens=R.num_valid_tokens(mask))
    full = _value_and_grads(val, old, ret, mask)
    parts = [_value_and_grads(*p, **counts) for p in zip(*(np.split(x, 4) for x in (val, old, ret, mask)))]
    for red in R.REDUCTIONS:
        assert full[red][0].dtype == np.float64
        np.testing.assert_allclose(sum(p[red][0] for p in parts), full[red][0], rtol=1e-12, err_msg=red)
        np.testing.assert_allclose(np.concatenate([p[red][1] for p in parts]), full[red][1],
                                   rtol=1e-12, atol=1e-15, err_msg=red)
