"""rljax.losses.reduce: hand-computed values, TRL/verl references, padding, micro-batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import _loss_reference as ref
except ImportError:
    import _loss_reference as ref
from rljax.losses import reduce as R

MODES = R.REDUCTIONS
JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


# ℓ = [[1, 2, 3, 9], [4, 7, 7, 7]], m = [[1, 1, 1, 0], [1, 0, 0, 0]]
#   row sums 6 and 4, row lengths 3 and 1, N = 4, S = 2, T = 4
#   seq_mean_token_mean     = (6/3 + 4/1) / 2 = 3
#   token_mean              = (6 + 4) / 4     = 2.5
#   seq_mean_token_sum      = (6 + 4) / 2     = 5
#   seq_mean_token_sum_norm = 10 / (2 · 4)    = 1.25     (max_length = 8: 10/16 = 0.625)
HAND_LOSS = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 7.0, 7.0, 7.0]], np.float32)
HAND_MASK = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], np.float32)
HAND = {"seq_mean_token_mean": 3.0, "token_mean": 2.5, "seq_mean_token_sum": 5.0,
        "seq_mean_token_sum_norm": 1.25}


@JIT
@pytest.mark.parametrize("mode", MODES)
def test_hand_computed(mode, use_jit):
    fn = _maybe_jit(lambda x, m: R.reduce_tokens(x, m, mode=mode), use_jit)
    np.testing.assert_allclose(fn(HAND_LOSS, HAND_MASK), HAND[mode], rtol=1e-6)


@JIT
def test_hand_computed_global_counts(use_jit):
    fn = _maybe_jit(lambda x, m: (
        R.reduce_tokens(x, m, mode="seq_mean_token_sum_norm", max_length=8),
        R.reduce_tokens(x, m, mode="token_mean", num_tokens=10),  # 10 / 10
        R.reduce_tokens(x, m, mode="seq_mean_token_mean", num_sequences=4),  # 6 / 4
        R.masked_mean(x, m), R.masked_mean(x, m, denominator=5.0),  # 10/4, 10/5
        R.masked_min(x, m), R.masked_max(x, m),  # 1, 4 (the 9 and 7s are masked)
        R.masked_var(x, m),  # values 1,2,3,4: mean 2.5, Σ(dev²) = 5, / 3
        R.masked_var(x, m, bessel=False),  # 5 / 4
    ), use_jit)
    out = fn(HAND_LOSS, HAND_MASK)
    np.testing.assert_allclose(out, [0.625, 1.0, 1.5, 2.5, 2.0, 1.0, 4.0, 5 / 3, 1.25], rtol=1e-6)


def test_bool_int_and_float_masks_agree():
    for mode in MODES:
        values = [R.reduce_tokens(HAND_LOSS, HAND_MASK.astype(dt), mode=mode)
                  for dt in (np.float32, np.int32, bool)]
        np.testing.assert_array_equal(values[0], values[1])
        np.testing.assert_array_equal(values[0], values[2])


def test_empty_row_and_all_masked():
    # An empty row contributes 0 and is not counted in S; an all-masked batch gives 0, not NaN.
    mask = HAND_MASK.copy()
    mask[1] = 0  # only row 0: mean 2, sum 6, N = 3, S = 1
    expect = {"seq_mean_token_mean": 2.0, "token_mean": 2.0, "seq_mean_token_sum": 6.0,
              "seq_mean_token_sum_norm": 1.5}
    for mode in MODES:
        np.testing.assert_allclose(R.reduce_tokens(HAND_LOSS, mask, mode=mode), expect[mode], rtol=1e-6)
        assert R.reduce_tokens(HAND_LOSS, np.zeros_like(mask), mode=mode) == 0.0
    assert R.masked_min(HAND_LOSS, np.zeros_like(mask)) == 0.0
    assert R.masked_var(HAND_LOSS, np.zeros_like(mask)) == 0.0


def test_unknown_mode_and_rank_checks():
    with pytest.raises(ValueError, match="mode"):
        R.reduce_tokens(HAND_LOSS, HAND_MASK, mode="mean")
    with pytest.raises(AssertionError):
        R.reduce_tokens(HAND_LOSS[0], HAND_MASK[0], mode="token_mean")
    with pytest.raises(AssertionError):
        R.reduce_tokens(HAND_LOSS, HAND_MASK[:, :3], mode="token_mean")


def _random(seed, b=8, t=6):
    rng = np.random.default_rng(seed)
    loss = rng.normal(size=(b, t)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    mask[:, 0] = 1  # TRL divides by B, so keep every row non-empty for the comparison
    return loss, mask


@pytest.mark.parametrize("mode", MODES)
def test_matches_trl_and_verl_reference(mode):
    loss, mask = _random(0)
    np.testing.assert_allclose(R.reduce_tokens(loss, mask, mode=mode),
                               ref.reduce_ref(loss, mask, mode), rtol=1e-6)
    kwargs = dict(num_sequences=11, num_tokens=37, max_length=9)
    np.testing.assert_allclose(R.reduce_tokens(loss, mask, mode=mode, **kwargs),
                               ref.reduce_ref(loss, mask, mode, **kwargs), rtol=1e-6)


@jax.jit
def _all_modes_fixed_length(x, m):
    return {mode: jax.value_and_grad(lambda y: R.reduce_tokens(y, m, mode=mode, max_length=5))(x)
            for mode in MODES}


def test_padding_invariance():
    """Two extra masked columns and two extra fully masked rows full of garbage (NaN, 1e30)
    change neither the value nor the gradient, in every mode (L_max given explicitly)."""
    loss, mask = _random(1, b=4, t=5)
    big_loss = np.full((6, 7), np.nan, np.float32)
    big_loss[:4, :5] = loss
    big_loss[4, :] = 1e30
    big_mask = np.zeros((6, 7), np.float32)
    big_mask[:4, :5] = mask
    small, big = _all_modes_fixed_length(loss, mask), _all_modes_fixed_length(big_loss, big_mask)
    for mode in MODES:
        np.testing.assert_allclose(big[mode][0], small[mode][0], rtol=1e-6, err_msg=mode)
        np.testing.assert_array_equal(np.asarray(big[mode][1])[big_mask == 0], 0.0)
        np.testing.assert_allclose(np.asarray(big[mode][1])[:4, :5], small[mode][1], rtol=1e-6)


@jax.jit
def _all_modes_value_and_grad(x, m, num_sequences=None, num_tokens=None):
    return {mode: jax.value_and_grad(lambda y: R.reduce_tokens(
        y, m, mode=mode, num_sequences=num_sequences, num_tokens=num_tokens, max_length=6))(x)
        for mode in MODES}


def test_micro_batches_sum_to_full_batch():
    """Every mode: four micro-batches with the global S and N (and L_max) sum to the whole-batch
    value and gradient. An algebraic equality: checked in float64."""
    with jax.enable_x64(True):
        _check_micro_batches_sum_to_full_batch()


def _check_micro_batches_sum_to_full_batch():
    loss, mask = _random(2, b=8, t=6)
    loss, mask = loss.astype(np.float64), mask.astype(np.float64)
    mask[3] = 0  # an empty row inside one micro-batch
    counts = dict(num_sequences=R.num_valid_sequences(mask), num_tokens=R.num_valid_tokens(mask))
    full = _all_modes_value_and_grad(loss, mask)
    parts = [_all_modes_value_and_grad(x, m, **counts)
             for x, m in zip(np.split(loss, 4), np.split(mask, 4))]
    for mode in MODES:
        full_value, full_grad = full[mode]
        assert full_value.dtype == np.float64
        np.testing.assert_allclose(sum(p[mode][0] for p in parts), full_value, rtol=1e-12, atol=1e-15,
                                   err_msg=mode)
        np.testing.assert_allclose(np.concatenate([p[mode][1] for p in parts]), full_grad,
                                   rtol=1e-12, atol=1e-15, err_msg=mode)
    # Without the global counts, averaging the parts' token means is NOT the whole-batch mean.
    local = [_all_modes_value_and_grad(x, m)["token_mean"][0]
             for x, m in zip(np.split(loss, 4), np.split(mask, 4))]
    assert not np.isclose(np.mean(local), full["token_mean"][0], rtol=1e-4)


def test_bfloat16_inputs_reduce_in_float32():
    loss, mask = _random(4)
    for mode in MODES:
        out = R.reduce_tokens(jnp.asarray(loss, jnp.bfloat16), mask, mode=mode)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(
            out, R.reduce_tokens(jnp.asarray(loss, jnp.bfloat16).astype(jnp.float32), mask, mode=mode),
            rtol=1e-6)


def test_masked_mean_micro_batches():
    with jax.enable_x64(True):  # an algebraic equality: checked in float64
        loss, mask = (x.astype(np.float64) for x in _random(3))
        n = R.num_valid_tokens(mask)
        parts = sum(R.masked_mean(x, m, denominator=n) for x, m in zip(np.split(loss, 4), np.split(mask, 4)))
        whole = R.masked_mean(loss, mask)
    assert whole.dtype == np.float64
    np.testing.assert_allclose(parts, whole, rtol=1e-12)
