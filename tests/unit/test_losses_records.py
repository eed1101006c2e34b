"""rljax.losses.records: AWR / RWR / filtered-BC record weights and the weighted NLL, by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.losses import REDUCTIONS, prompt_baselines, record_weights, weighted_nll_loss

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])

# Scores s = [1, 0, 0.5, 2] of prompts a, a, b, c. Global mean 0.875.
#   prompt_mean baseline: "a" has two records -> 0.5; "b", "c" have one -> the global mean 0.875
#   AWR advantages: [0.5, −0.5, −0.375, 1.125]
SCORES = [1.0, 0.0, 0.5, 2.0]
KEYS = ["a", "a", "b", "c"]


def test_prompt_baselines_by_hand():
    np.testing.assert_allclose(prompt_baselines(np.asarray(SCORES), KEYS), [0.5, 0.5, 0.875, 0.875])
    np.testing.assert_allclose(prompt_baselines(np.asarray(SCORES), KEYS, baseline="global_mean"), [0.875] * 4)
    with pytest.raises(ValueError, match="baseline must be"):
        prompt_baselines(np.asarray(SCORES), KEYS, baseline="median")


def test_awr_weights_by_hand():
    # T = 0.5: exp([0.5, −0.5, −0.375, 1.125] / 0.5) = exp([1, −1, −0.75, 2.25])
    w, keep = record_weights(SCORES, KEYS, mode="awr", temperature=0.5, max_weight=20.0)
    np.testing.assert_allclose(w, [math.e, 1 / math.e, math.exp(-0.75), math.exp(2.25)], rtol=1e-6)
    assert w.dtype == np.float32 and keep.tolist() == [True] * 4
    # clipping at w_max = 5: exp(2.25) = 9.49 -> 5, the others are below it
    w, _ = record_weights(SCORES, KEYS, mode="awr", temperature=0.5, max_weight=5.0)
    np.testing.assert_allclose(w, [math.e, 1 / math.e, math.exp(-0.75), 5.0], rtol=1e-6)
    # T = 0.1: exp([5, −5, −3.75, 11.25]); exp(5) = 148 and exp(11.25) are both clipped at 20
    w, _ = record_weights(SCORES, KEYS, mode="awr", temperature=0.1, max_weight=20.0)
    np.testing.assert_allclose(w, [20.0, math.exp(-5), math.exp(-3.75), 20.0], rtol=1e-6)
    # max_weight = 0: no clipping
    w, _ = record_weights(SCORES, KEYS, mode="awr", temperature=0.1, max_weight=0.0)
    np.testing.assert_allclose(w, np.exp([5.0, -5.0, -3.75, 11.25]), rtol=1e-6)
    # global baseline 0.875 for every record, T = 1
    w, _ = record_weights(SCORES, KEYS, mode="awr", temperature=1.0, baseline="global_mean")
    np.testing.assert_allclose(w, np.exp([0.125, -0.875, -0.375, 1.125]), rtol=1e-6)


def test_awr_clips_in_log_space_without_overflow():
    # advantages ±500: exp(500) overflows float64 -> inf before a clip; here it is 20 and exp(−500) -> 0
    with np.errstate(over="raise"):
        w, _ = record_weights([1000.0, 0.0], ["a", "b"], mode="awr", temperature=1.0, max_weight=20.0)
    np.testing.assert_array_equal(w, [20.0, 0.0])


def test_rwr_weights_by_hand_have_mean_one():
    # s = [0, ln 3], T = 1: exp(s) = [1, 3], mean 2 -> [0.5, 1.5]
    w, keep = record_weights([0.0, math.log(3)], ["a", "b"], mode="rwr", temperature=1.0, max_weight=0.0)
    np.testing.assert_allclose(w, [0.5, 1.5], rtol=1e-6)
    assert keep.all() and w.mean() == pytest.approx(1.0)
    # T = 0.5: exp(s/T) = [1, 9], mean 5 -> [0.2, 1.8]; scores shifted by 1000 give the same (stable)
    for shift in (0.0, 1000.0):
        w, _ = record_weights([shift, shift + math.log(3)], ["a", "a"], mode="rwr", temperature=0.5, max_weight=0.0)
        np.testing.assert_allclose(w, [0.2, 1.8], rtol=1e-6, err_msg=str(shift))
    # clipping is applied after the mean-1 normalisation: 1.8 -> 1.5
    w, _ = record_weights([0.0, math.log(3)], ["a", "b"], mode="rwr", temperature=0.5, max_weight=1.5)
    np.testing.assert_allclose(w, [0.2, 1.5], rtol=1e-6)
    # the prompt keys do not matter to RWR
    w_same, _ = record_weights(SCORES, ["z"] * 4, mode="rwr", temperature=1.0, max_weight=0.0)
    w, _ = record_weights(SCORES, KEYS, mode="rwr", temperature=1.0, max_weight=0.0)
    np.testing.assert_array_equal(w, w_same)
    np.testing.assert_allclose(w, np.exp(SCORES) / np.mean(np.exp(SCORES)), rtol=1e-6)


def test_filtered_bc_keeps_scores_at_or_above_the_threshold():
    w, keep = record_weights(SCORES, KEYS, mode="filtered_bc", threshold=1.0)
    assert keep.tolist() == [True, False, False, True] and w.tolist() == [1.0, 0.0, 0.0, 1.0]
    w, keep = record_weights(SCORES, KEYS, mode="filtered_bc", threshold=5.0)
    assert not keep.any() and not w.any()


def test_record_weights_bad_arguments_and_empty():
    with pytest.raises(ValueError, match="mode must be"):
        record_weights(SCORES, KEYS, mode="ppo")
    with pytest.raises(ValueError, match="prompt_keys"):
        record_weights(SCORES, KEYS[:3], mode="awr")
    with pytest.raises(ValueError, match="baseline must be"):
        record_weights(SCORES, KEYS, mode="awr", baseline="median")
    w, keep = record_weights([], [], mode="awr")
    assert w.shape == keep.shape == (0,) and w.dtype == np.float32 and keep.dtype == bool


# log π = [[−1, −2, (−9)], [−0.5, −0.5, −0.5], [(7), (7), (7)]] with the bracketed tokens masked,
# w = [2, 0.5, 100] (row 2 is empty: it changes nothing).
#   −w·log π: row 0 [2, 4] sum 6 over 2 tokens; row 1 [0.25]·3 sum 0.75 over 3; N = 5, S = 2, T = 3
#   token_mean 6.75/5 = 1.35; seq_mean_token_mean (3 + 0.25)/2 = 1.625;
#   seq_mean_token_sum 6.75/2 = 3.375; seq_mean_token_sum_norm 6.75/(2·3) = 1.125
#   offline/nll = (1 + 2 + 1.5)/5 = 0.9; offline/weight_mean = (2 + 0.5)/2 = 1.25
LOGPROBS = np.array([[-1.0, -2.0, np.nan], [-0.5, -0.5, -0.5], [7.0, 7.0, 7.0]], np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], np.float32)
WEIGHTS = np.array([2.0, 0.5, 100.0], np.float32)
HAND = {"token_mean": 1.35, "seq_mean_token_mean": 1.625, "seq_mean_token_sum": 3.375,
        "seq_mean_token_sum_norm": 1.125}


@JIT
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_weighted_nll_by_hand(reduction, use_jit):
    fn = lambda lp, m, w: weighted_nll_loss(lp, m, w, reduction=reduction)  # noqa: E731
    loss, metrics = (jax.jit(fn) if use_jit else fn)(LOGPROBS, MASK, WEIGHTS)
    np.testing.assert_allclose(loss, HAND[reduction], rtol=1e-6)
    np.testing.assert_allclose(metrics["offline/loss"], HAND[reduction], rtol=1e-6)
    np.testing.assert_allclose(metrics["offline/nll"], 0.9, rtol=1e-6)
    np.testing.assert_allclose(metrics["offline/weight_mean"], 1.25, rtol=1e-6)


@JIT
def test_weighted_nll_global_counts_by_hand(use_jit):
    fn = lambda lp, m, w: (  # noqa: E731
        weighted_nll_loss(lp, m, w, reduction="token_mean", num_tokens=10)[0],  # 6.75 / 10
        weighted_nll_loss(lp, m, w, reduction="seq_mean_token_sum", num_sequences=3)[0],  # 6.75 / 3
        weighted_nll_loss(lp, m, w, reduction="seq_mean_token_sum_norm", max_length=9)[0])  # 6.75 / 18
    np.testing.assert_allclose((jax.jit(fn) if use_jit else fn)(LOGPROBS, MASK, WEIGHTS),
                               [0.675, 2.25, 0.375], rtol=1e-6)


def test_weighted_nll_gradient_and_stop_gradient():
    # token_mean: ∂loss/∂logπ[i, t] = −w_i · m[i, t] / N; the weights get no gradient
    lp = np.nan_to_num(LOGPROBS)
    grad_lp, grad_w = jax.grad(lambda x, w: weighted_nll_loss(x, MASK, w, reduction="token_mean")[0],
                               argnums=(0, 1))(lp, WEIGHTS)
    np.testing.assert_allclose(grad_lp, -WEIGHTS[:, None] * MASK / 5.0, rtol=1e-6)
    np.testing.assert_array_equal(grad_w, 0.0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_weighted_nll_micro_batches_sum_to_full_batch(reduction):
    with jax.enable_x64(True):  # an algebraic equality: checked in float64
        _check_weighted_nll_micro_batches(reduction)


def _check_weighted_nll_micro_batches(reduction):
    rng = np.random.default_rng(0)
    lp = -rng.random((6, 4)) * 3
    mask = (rng.random((6, 4)) < 0.7).astype(np.float64)
    mask[2] = 0
    w = rng.random(6) * 2
    counts = dict(num_sequences=float(np.any(mask, -1).sum()), num_tokens=float(mask.sum()), max_length=4)
    full = jax.value_and_grad(lambda x: weighted_nll_loss(x, mask, w, reduction=reduction, **counts)[0])(lp)
    parts = [jax.value_and_grad(lambda x, m=m, ww=ww: weighted_nll_loss(x, m, ww, reduction=reduction, **counts)[0])(x)
             for x, m, ww in zip(np.split(lp, 3), np.split(mask, 3), np.split(w, 3))]
    assert full[0].dtype == np.float64
    np.testing.assert_allclose(sum(p[0] for p in parts), full[0], rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), full[1], rtol=1e-12, atol=1e-15)
    # and the local default equals the explicit whole-batch counts
    np.testing.assert_allclose(weighted_nll_loss(lp, mask, w, reduction=reduction)[0], full[0], rtol=1e-12)


def test_weighted_nll_shape_checks():
    with pytest.raises(AssertionError):
        weighted_nll_loss(LOGPROBS, MASK, WEIGHTS[:, None])
    with pytest.raises(AssertionError):
        weighted_nll_loss(LOGPROBS, MASK[:, :2], WEIGHTS)
    with pytest.raises(ValueError, match="mode"):
        weighted_nll_loss(jnp.asarray(LOGPROBS), MASK, WEIGHTS, reduction="mean")
