"""rljax.advantages: group / RLOO / moving-average baseline / REINFORCE++ / GAE / whitening / KL shaping / overlong."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import _loss_reference as ref
except ImportError:
    import _loss_reference as ref
from rljax import advantages as A

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


# ---------------------------------------------------------------------------------------------
# Group-normalised (GRPO) and RLOO
# ---------------------------------------------------------------------------------------------
@JIT
def test_group_advantages_hand(use_jit):
    # Two prompts, G = 4: [1, 0, 0, 1] and [2, 2, 2, 2].
    #   group 1: mean 0.5, Σ(dev²) = 1, Bessel std = sqrt(1/3) = 0.5773503
    #            A = ±0.5 / (0.5773503 + 1e-4) = ±0.8658754;   group 2: all 0 (R − mean = 0)
    #   batch std (Bessel) of all 8: mean 1.25, Σ(dev²) = 5.5 -> sqrt(5.5/7) = 0.8864053
    #            A = ±0.5 / 0.8865053 = ±0.5640124 (group mean kept, TRL scale_rewards="batch")
    #   none: ±0.5;  population std (bessel=False): 0.5 -> ±0.5/0.5001 = ±0.9998000
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    fn = _maybe_jit(lambda x: [A.group_advantages(x, group_size=4, scale="group"),
                               A.group_advantages(x, group_size=4, scale="batch"),
                               A.group_advantages(x, group_size=4, scale="none"),
                               A.group_advantages(x, group_size=4, bessel=False)], use_jit)
    sign = np.array([1, -1, -1, 1, 0, 0, 0, 0])
    for got, magnitude in zip(fn(r), [0.8658754, 0.5640124, 0.5, 0.9998000]):
        np.testing.assert_allclose(got, sign * magnitude, rtol=1e-6, atol=1e-7)


@JIT
def test_group_advantages_missing_rewards_hand(use_jit):
    # Rewards [1, missing (NaN), 0, 1]: statistics over the 3 valid ones, mean 2/3,
    #   devs (1/3, −2/3, 1/3), Σ(dev²) = 2/3, Bessel var 1/3 -> std 0.5773503;
    #   A = (0.5772503, 0, −1.1545006, 0.5772503). A group with one valid reward -> all 0.
    r = jnp.array([1.0, jnp.nan, 0.0, 1.0, 5.0, jnp.nan, 7.0, 7.0])
    valid = jnp.array([1, 0, 1, 1, 1, 0, 0, 0], bool)
    fn = _maybe_jit(lambda x, v: (A.group_advantages(x, group_size=4, valid=v),
                                  A.rloo_advantages(x, group_size=4, valid=v)), use_jit)
    grpo, rloo = fn(r, valid)
    np.testing.assert_allclose(grpo, [0.5772503, 0, -1.1545006, 0.5772503, 0, 0, 0, 0], rtol=1e-6)
    # RLOO over the valid ones: 1 − (0 + 1)/2 = 0.5, 0 − (1 + 1)/2 = −1, 0.5; singleton group -> 0
    np.testing.assert_allclose(rloo, [0.5, 0, -1.0, 0.5, 0, 0, 0, 0], rtol=1e-6)


@JIT
def test_rloo_hand(use_jit):
    # [1, 0, 0, 1]: A_0 = 1 − (0 + 0 + 1)/3 = 2/3, A_1 = 0 − (1 + 0 + 1)/3 = −2/3, ...
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    fn = _maybe_jit(lambda x: (A.rloo_advantages(x[:4], group_size=4),
                               A.rloo_advantages(x[4:], group_size=2)), use_jit)
    g4, g2 = fn(r)
    np.testing.assert_allclose(g4, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(g2, [2.0, -2.0], rtol=1e-6)  # G = 2: A = R − R_other


def _rewards_with_missing(seed, b=24, g=6):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=b).astype(np.float32)
    r[:g] = rng.integers(0, 2, g)  # a binary-reward group
    valid = rng.random(b) > 0.2
    valid[g:2 * g] = True
    r_nan = np.where(valid, r, np.nan)
    return r, valid, r_nan


@functools.partial(jax.jit, static_argnames="group_size")
def _all_scales(r, valid, *, group_size):
    return {scale: A.group_advantages(r, group_size=group_size, scale=scale, valid=valid)
            for scale in A.GROUP_SCALES}


def test_group_advantages_match_trl_reference():
    r, valid, r_nan = _rewards_with_missing(0)
    for scale, got in _all_scales(r_nan, valid, group_size=6).items():
        np.testing.assert_allclose(got, ref.grpo_advantages_ref(r_nan, 6, scale), rtol=1e-6,
                                   atol=1e-7, err_msg=scale)


def test_group_advantages_match_verl_reference():
    r, _, _ = _rewards_with_missing(1)
    got = A.group_advantages(r, group_size=6, eps=1e-6)
    np.testing.assert_allclose(got, ref.grpo_advantages_verl_ref(r, 6), rtol=1e-6, atol=1e-7)


def test_rloo_matches_trl_and_verl_reference():
    r, valid, r_nan = _rewards_with_missing(2)
    got = A.rloo_advantages(r_nan, group_size=6, valid=valid)
    np.testing.assert_allclose(got, ref.rloo_advantages_ref(r_nan, 6), rtol=1e-6, atol=1e-7)
    # verl compute_rloo_outcome_advantage: n/(n−1) · (R − mean) (complete groups)
    grouped = r.reshape(-1, 6).astype(np.float64)
    verl = (grouped * 6 / 5 - grouped.mean(1, keepdims=True) * 6 / 5).reshape(-1)
    np.testing.assert_allclose(A.rloo_advantages(r, group_size=6), verl, rtol=1e-6, atol=1e-7)


def test_advantages_padding_invariance():
    """An extra group of missing rewards changes no other advantage, for every scale."""
    r, valid, r_nan = _rewards_with_missing(3)
    r_big = np.concatenate([r_nan, np.full(6, np.nan, np.float32)])
    v_big = np.concatenate([valid, np.zeros(6, bool)])
    base_all = _all_scales(r_nan, valid, group_size=6)
    big_all = _all_scales(r_big, v_big, group_size=6)
    for scale in A.GROUP_SCALES:
        np.testing.assert_allclose(big_all[scale][:24], base_all[scale], rtol=1e-6, err_msg=scale)
        np.testing.assert_array_equal(big_all[scale][24:], 0.0)
    big = A.rloo_advantages(r_big, group_size=6, valid=v_big)
    np.testing.assert_allclose(big[:24], A.rloo_advantages(r_nan, group_size=6, valid=valid), rtol=1e-6)


def test_bad_group_arguments():
    with pytest.raises(ValueError, match="multiple"):
        A.group_advantages(jnp.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="scale"):
        A.group_advantages(jnp.zeros(4), group_size=4, scale="prompt")
    with pytest.raises(AssertionError):
        A.rloo_advantages(jnp.zeros((2, 2)), group_size=2)


# ---------------------------------------------------------------------------------------------
# Moving-average baseline (REINFORCE, "vanilla PG" of Back to Basics)
# ---------------------------------------------------------------------------------------------
@JIT
def test_moving_average_baseline_hand(use_jit):
    # step 1 (no history): R = [1, 0, 3, (NaN, missing)] -> b = batch mean 4/3,
    #   A = [-1/3, -4/3, 5/3, 0]; the baseline becomes 4/3 after 3 rewards.
    # step 2: R = [2, 2] -> A = 2 - 4/3 = 2/3 each (the baseline of EARLIER steps, not this batch's 2);
    #   mean of all five rewards (1 + 0 + 3 + 2 + 2) / 5 = 1.6, count 5.
    # EMA with decay 0.75: step 1 the same (w = 1, b' = 4/3); step 2 b' = 4/3 + 0.25 (2 - 4/3) = 1.5.
    fn = _maybe_jit(functools.partial(A.moving_average_baseline_advantages, decay=None), use_jit)
    ema = _maybe_jit(functools.partial(A.moving_average_baseline_advantages, decay=0.75), use_jit)
    r1, v1 = jnp.array([1.0, 0.0, 3.0, jnp.nan]), jnp.array([True, True, True, False])
    adv, mean, count = fn(r1, 0.0, 0.0, valid=v1)
    np.testing.assert_allclose(adv, [-1 / 3, -4 / 3, 5 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose([mean, count], [4 / 3, 3.0], rtol=1e-6)
    adv2, mean2, count2 = fn(jnp.array([2.0, 2.0]), mean, count)
    np.testing.assert_allclose(adv2, [2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose([mean2, count2], [1.6, 5.0], rtol=1e-6)
    _, e_mean, e_count = ema(r1, 0.0, 0.0, valid=v1)
    _, e_mean2, _ = ema(jnp.array([2.0, 2.0]), e_mean, e_count)
    np.testing.assert_allclose([e_mean, e_mean2], [4 / 3, 1.5], rtol=1e-6)
    # a batch without one valid reward: advantages 0, the state unchanged
    adv3, mean3, count3 = fn(jnp.array([jnp.nan, 5.0]), mean2, count2, valid=jnp.array([False, False]))
    np.testing.assert_array_equal(adv3, [0.0, 0.0])
    np.testing.assert_allclose([mean3, count3], [1.6, 5.0], rtol=1e-6)


def test_moving_average_baseline_refuses_a_decay_outside_0_1():
    for decay in (1.0, -0.1):
        with pytest.raises(ValueError, match="decay"):
            A.moving_average_baseline_advantages(jnp.ones(2), 0.0, 0.0, decay=decay)


# ---------------------------------------------------------------------------------------------
# Whitening, GAE, REINFORCE++
# ---------------------------------------------------------------------------------------------
@JIT
def test_whiten_hand(use_jit):
    # valid [1, 2, 3] (the 4th masked): mean 2, Bessel std 1 -> [−1, 0, 1]/(1 + 1e-8);
    # shift_mean=False adds the mean back -> [1, 2, 3]; population std sqrt(2/3) -> ±1.2247449
    x = jnp.array([[1.0, 2.0, 3.0, 100.0]])
    m = jnp.array([[1, 1, 1, 0]])
    fn = _maybe_jit(lambda x, m: (A.whiten(x, m), A.whiten(x, m, shift_mean=False),
                                  A.whiten(x, m, bessel=False)), use_jit)
    w, keep, pop = fn(x, m)
    np.testing.assert_allclose(w, [[-1.0, 0.0, 1.0, 0.0]], atol=1e-7)
    np.testing.assert_allclose(keep, [[1.0, 2.0, 3.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(pop, [[-1.2247449, 0.0, 1.2247449, 0.0]], rtol=1e-6)


def test_whiten_matches_verl_reference():
    rng = np.random.default_rng(4)
    x = rng.normal(2.0, 3.0, (6, 7)).astype(np.float32)
    m = (rng.random((6, 7)) < 0.7).astype(np.float32)
    for shift in (True, False):
        got = A.whiten(x, m, shift_mean=shift)
        expect = ref.masked_whiten_ref(x, m, shift_mean=shift)
        np.testing.assert_allclose(np.asarray(got)[m > 0], expect[m > 0], rtol=1e-6, atol=1e-7)


@JIT
def test_gae_hand(use_jit):
    # γ = 1, λ = 0.5, r = [0, 0, 1], V = [0.5, 0.5, 0.5]:
    #   δ_2 = 1 − 0.5 = 0.5 -> A_2 = 0.5;  δ_1 = 0 + 0.5 − 0.5 = 0 -> A_1 = 0.5·0.5 = 0.25;
    #   δ_0 = 0 -> A_0 = 0.125;  returns = A + V = [0.625, 0.75, 1.0]
    # The same row with a masked junk token inserted (mask [1, 0, 1, 1]) gives the same values on
    # the valid tokens and 0 on the masked one.
    # γ = 0.9, λ = 0.8, r = [0, 1], V = [0.2, 0.4]: δ_1 = 0.6 -> A_1 = 0.6;
    #   δ_0 = 0.9·0.4 − 0.2 = 0.16 -> A_0 = 0.16 + 0.72·0.6 = 0.592; returns [0.792, 1.0]
    rewards = jnp.array([[0.0, 0.0, 1.0, 0.0], [0.0, 99.0, 0.0, 1.0]])
    values = jnp.array([[0.5, 0.5, 0.5, 7.0], [0.5, -99.0, 0.5, 0.5]])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 1, 1]])
    fn = _maybe_jit(lambda r, v, m, r2, v2, m2: (A.gae(r, v, m, gamma=1.0, lam=0.5),
                                                 A.gae(r2, v2, m2, gamma=0.9, lam=0.8)), use_jit)
    (adv, ret), (adv2, ret2) = fn(rewards, values, mask, jnp.array([[0.0, 1.0]]),
                                  jnp.array([[0.2, 0.4]]), jnp.array([[1, 1]]))
    np.testing.assert_allclose(adv, [[0.125, 0.25, 0.5, 0.0], [0.125, 0.0, 0.25, 0.5]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0.625, 0.75, 1.0, 0.0], [0.625, 0.0, 0.75, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(adv2, [[0.592, 0.6]], rtol=1e-6)
    np.testing.assert_allclose(ret2, [[0.792, 1.0]], rtol=1e-6)


def _token_batch(seed, b=6, t=9, holes=True):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(0, 0.3, (b, t)).astype(np.float32)
    values = rng.normal(0, 1, (b, t)).astype(np.float32)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    if holes:  # masked observation / tool tokens inside completions
        mask[:, 2] = 0
        mask[0, 4:6] = 0
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_scan_equals_python_loops(gamma, lam):
    """lax.scan GAE = a plain per-token Python loop (valid tokens only) = verl's loop."""
    rewards, values, mask = _token_batch(5)
    adv, ret = jax.jit(functools.partial(A.gae, gamma=gamma, lam=lam))(rewards, values, mask)
    loop_adv, loop_ret = ref.gae_scalar_loop_ref(rewards, values, mask, gamma, lam)
    # float32 recursion over up to 9 tokens with partial sums |A| ≲ 4 against a float64 loop:
    # absolute error ≲ 9 · 4 · 2^-24 ≈ 2e-6, so the comparison is absolute, not relative (an
    # advantage that happens to land near 0 has no meaningful relative error).
    tol = dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(adv, loop_adv, **tol)
    np.testing.assert_allclose(ret, loop_ret, **tol)
    verl_adv, verl_ret = ref.gae_verl_ref(rewards, values, mask, gamma, lam)
    valid = mask > 0
    np.testing.assert_allclose(np.asarray(adv)[valid], verl_adv[valid], **tol)
    np.testing.assert_allclose(np.asarray(ret)[valid], verl_ret[valid], **tol)
    np.testing.assert_array_equal(np.asarray(adv)[~valid], 0.0)


def test_gae_padding_invariance():
    """Masked columns inserted anywhere, and masked rows, change no valid output."""
    rewards, values, mask = _token_batch(6, holes=False)
    adv, ret = A.gae(rewards, values, mask)
    insert_at = [0, 3, 3, 9]  # before the first column, twice in the middle, at the end
    big = [np.insert(x, insert_at, 123.0, axis=1) for x in (rewards, values)]
    big_mask = np.insert(mask, insert_at, 0.0, axis=1)
    big = [np.concatenate([x, np.full((2, x.shape[1]), -5.0, np.float32)]) for x in big]
    big_mask = np.concatenate([big_mask, np.zeros((2, big_mask.shape[1]), np.float32)])
    adv_b, ret_b = A.gae(big[0], big[1], big_mask)
    keep = np.delete(np.arange(big_mask.shape[1]), np.array(insert_at) + np.arange(4))
    np.testing.assert_allclose(np.asarray(adv_b)[:6, keep], adv, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(ret_b)[:6, keep], ret, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(adv_b)[big_mask == 0], 0.0)


@JIT
def test_reinforce_plus_plus_hand(use_jit):
    # token rewards [[0, 0, 1], [0, 2, ·]], γ = 1: returns [[1, 1, 1], [2, 2, 0]];
    # valid returns (1, 1, 1, 2, 2): mean 1.4, Bessel var (3·0.16 + 2·0.36)/4 = 0.3 ->
    # A = −0.4/0.5477226 = −0.7302967 and 0.6/0.5477226 = 1.0954451
    r = jnp.array([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    m = jnp.array([[1, 1, 1], [1, 1, 0]])
    # discounted_returns with γ = 0.5: [[0.25, 0.5, 1], [1, 2, 0]]
    fn = _maybe_jit(lambda r, m: (A.reinforce_plus_plus_advantages(r, m),
                                  A.discounted_returns(r, m, gamma=0.5)), use_jit)
    (adv, ret), discounted = fn(r, m)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], rtol=1e-6)
    lo, hi = -0.7302967, 1.0954451
    np.testing.assert_allclose(adv, [[lo, lo, lo], [hi, hi, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(discounted, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]], rtol=1e-6)


def test_reinforce_plus_plus_matches_verl_reference():
    # compared in float64: in float32 the whitened advantages carry the returns' rounding (~2e-7 at
    # returns of ~1), above a 1e-7 absolute tolerance on advantages near 0
    rewards, _, mask = _token_batch(7, holes=False)  # verl resets at the first masked token
    rewards, mask = rewards.astype(np.float64), mask.astype(np.float64)
    for gamma in (1.0, 0.95):
        with jax.enable_x64(True):
            adv, ret = A.reinforce_plus_plus_advantages(rewards, mask, gamma=gamma)
            adv, ret = np.asarray(adv), np.asarray(ret)
        assert adv.dtype == np.float64
        verl_adv, verl_ret = ref.reinforce_pp_ref(rewards, mask, gamma)
        valid = mask > 0
        np.testing.assert_allclose(ret[valid], verl_ret[valid], rtol=1e-12, atol=1e-12)
        # whitening's eps sits elsewhere (rljax: std + 1e-8; verl: rsqrt(var + 1e-8)): ~1e-8 relative
        np.testing.assert_allclose(adv, verl_adv, rtol=1e-7, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# KL-shaped token rewards, soft overlong punishment, broadcasting
# ---------------------------------------------------------------------------------------------
@JIT
def test_kl_shaped_rewards_hand(use_jit):
    # β = 0.1, k1. Row 0: logp [−1, −2, −1], ref [−1.5, −2, −0.5] -> k1 [0.5, 0, −0.5] ->
    #   −β k1 = [−0.05, 0, 0.05]; score 2 on the last real token (t = 2) -> [−0.05, 0, 2.05, 0].
    # Row 1: logp = ref -> 0; score 3 but no EOS, penalty 1 -> 2 on t = 1 -> [0, 2, 0, 0].
    # Row 2: no valid token -> no score anywhere.
    scores = jnp.array([2.0, 3.0, 9.0])
    lp = jnp.array([[-1.0, -2.0, -1.0, 0.0], [-1.0, -1.0, 4.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    rl = jnp.array([[-1.5, -2.0, -0.5, 9.0], [-1.0, -1.0, -4.0, -4.0], [1.0, 1.0, 1.0, 1.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    eos = jnp.array([True, False, True])
    fn = _maybe_jit(lambda *a: A.kl_shaped_rewards(*a[:4], kl_coef=0.1, eos_found=a[4],
                                                   missing_eos_penalty=1.0), use_jit)
    np.testing.assert_allclose(fn(scores, lp, rl, mask, eos),
                               [[-0.05, 0.0, 2.05, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0] * 4], rtol=1e-6)


def test_kl_shaped_rewards_match_reference():
    rng = np.random.default_rng(8)
    _, _, mask = _token_batch(8)
    lp = rng.normal(-1, 0.5, mask.shape).astype(np.float32)
    rl = (lp + rng.normal(0, 0.3, mask.shape)).astype(np.float32)
    scores = rng.normal(size=mask.shape[0]).astype(np.float32)
    eos = rng.random(mask.shape[0]) > 0.5
    for estimator in ("k1", "k2", "k3"):
        got = A.kl_shaped_rewards(scores, lp, rl, mask, kl_coef=0.05, estimator=estimator,
                                  eos_found=eos, missing_eos_penalty=0.5)
        expect = ref.kl_shaped_rewards_ref(scores, lp, rl, mask, 0.05, estimator, eos, 0.5)
        np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-7)
    # sum over tokens = score − β Σ k1 (what RLOO puts in its sequence reward)
    got = A.kl_shaped_rewards(scores, lp, rl, mask, kl_coef=0.05)
    np.testing.assert_allclose(np.sum(got, 1), scores - 0.05 * np.sum((lp - rl) * mask, 1),
                               rtol=1e-6, atol=1e-7)


@JIT
def test_soft_overlong_punishment_hand_and_reference(use_jit):
    # L_max = 10, L_cache = 4: ≤ 6 -> 0; 7 -> (6 − 7)/4 = −0.25; 8 -> −0.5; 10 -> −1; 11 -> −1
    lengths = jnp.array([5, 6, 7, 8, 10, 11])
    fn = _maybe_jit(lambda y: A.soft_overlong_punishment(y, max_length=10, cache_length=4), use_jit)
    np.testing.assert_allclose(fn(lengths), [0, 0, -0.25, -0.5, -1, -1], rtol=1e-6)
    ys = np.arange(0, 40)
    np.testing.assert_allclose(A.soft_overlong_punishment(jnp.asarray(ys), max_length=32, cache_length=8),
                               [ref.soft_overlong_ref(y, 32, 8) for y in ys], rtol=1e-6)


@JIT
def test_broadcast_to_tokens_and_stop_gradient(use_jit):
    adv = jnp.array([1.5, -2.0])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(_maybe_jit(A.broadcast_to_tokens, use_jit)(adv, mask),
                                  [[1.5, 1.5, 0], [-2.0, 0, 0]])
    g = jax.grad(lambda r: jnp.sum(A.group_advantages(r, group_size=2)))(jnp.array([1.0, 0.0]))
    np.testing.assert_array_equal(g, 0.0)


# ---------------------------------------------------------------------------------------------
# Flat groups give exactly 0; large rewards do not overflow the statistics
# ---------------------------------------------------------------------------------------------
FLAT_VALUES = [0.1, 0.3, 1 / 3, 1e-7, 1e6 + 0.1, 1.0]


@JIT
@pytest.mark.parametrize("value", FLAT_VALUES)
def test_flat_groups_give_exactly_zero_for_every_estimator(value, use_jit):
    # Eight equal float32 rewards: before the fix 0.1 gave |A| 7.4e-5 / 7.4e-3 / 0.83 with eps
    # 1e-4 / 1e-6 / 1e-9 and 1e6 + 0.1 (G = 3) gave 0.82 whatever eps. The third group is flat over
    # its present samples (two missing). Between them, [1, 0, 0, 1, 1, 0, 0, 1] keeps its hand values:
    # mean 0.5, Σ dev² = 2, Bessel std sqrt(2/7) = 0.5345225 -> A = ±0.5 / 0.5346225 = ±0.9352394;
    # scale="none": ±0.5; RLOO: 1 − 3/7 = 4/7 and 0 − 4/7.
    G = 8
    live = np.array([1, 0, 0, 1, 1, 0, 0, 1], np.float32)
    r = jnp.asarray(np.concatenate([np.full(G, value), live, np.full(G, value)]).astype(np.float32))
    valid = jnp.asarray(np.concatenate([np.ones(2 * G, bool), [1, 0, 1, 1, 1, 1, 0, 1]]))  # 2 missing

    def everything(r, valid):
        out = {f"{scale}/eps={eps}": A.group_advantages(r, group_size=G, scale=scale, eps=eps, valid=valid)
               for scale in A.GROUP_SCALES for eps in (1e-4, 1e-6, 1e-9)}
        out["group/population"] = A.group_advantages(r, group_size=G, bessel=False, valid=valid)
        out["rloo"] = A.rloo_advantages(r, group_size=G, valid=valid)
        return out

    for name, adv in _maybe_jit(everything, use_jit)(r, valid).items():
        adv = np.asarray(adv)
        assert adv.dtype == np.float32
        np.testing.assert_array_equal(adv[:G], 0.0, err_msg=name)
        np.testing.assert_array_equal(adv[2 * G:], 0.0, err_msg=name)  # flat over the present samples
        assert np.all(adv[G:2 * G] != 0.0), name
    sign = 2 * live - 1
    np.testing.assert_allclose(A.group_advantages(r, group_size=G, valid=valid)[G:2 * G], sign * 0.9352394, rtol=1e-6)
    np.testing.assert_allclose(A.group_advantages(r, group_size=G, scale="none", valid=valid)[G:2 * G], sign * 0.5,
                               rtol=1e-6)
    np.testing.assert_allclose(A.rloo_advantages(r, group_size=G, valid=valid)[G:2 * G], sign * 4 / 7, rtol=1e-6)


@JIT
@pytest.mark.parametrize("value", FLAT_VALUES)
def test_flat_batches_whiten_and_reinforce_pp_to_exactly_zero(value, use_jit):
    # REINFORCE++ / PPO whiten over the valid tokens of the batch: equal values -> 0 exactly
    # (shift_mean=False gives the values back); before the fix eps = 1e-8 inflated ±1 ulp to ~±1.
    x = jnp.full((3, 5), value, jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    x = jnp.where(mask == 0, 7.0, x)  # padding holds other values: it must not count
    fn = _maybe_jit(lambda x, m: (A.whiten(x, m), A.whiten(x, m, shift_mean=False)), use_jit)
    centred, kept = fn(x, mask)
    np.testing.assert_array_equal(np.asarray(centred), 0.0)
    np.testing.assert_array_equal(np.asarray(kept), np.where(np.asarray(mask) == 1, np.float32(value), 0.0))
    # one reward at the last token of rows of equal length, γ = 1: equal returns on every token
    token_rewards = jnp.zeros((4, 3)).at[:, 2].set(value)
    adv, _ = _maybe_jit(lambda r: A.reinforce_plus_plus_advantages(r, jnp.ones((4, 3))), use_jit)(token_rewards)
    np.testing.assert_array_equal(np.asarray(adv), 0.0)


def _group_advantages_f64(rewards, group_size, *, scale, eps=1e-4):
    r = np.asarray(rewards, np.float64).reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale == "none":
        return centred.reshape(-1)
    std = r.std(axis=1, ddof=1, keepdims=True) if scale == "group" else r.std(ddof=1)
    return (centred / (std + eps)).reshape(-1)


@JIT
def test_rewards_of_1e19_do_not_overflow_the_group_statistics(use_jit):
    # Σ (R − mean)² ≈ 4 · 1e38 > float32 max (3.4e38): the plain formula gave inf variance and
    # advantages 0. Against a float64 NumPy reference, to float32 precision.
    r = np.array([0.0, 1e19, 2e19, -1e19, 3e19, -2e19, 5e18, 0.0], np.float32)
    fn = _maybe_jit(lambda r: ({scale: A.group_advantages(r, group_size=4, scale=scale) for scale in A.GROUP_SCALES},
                               A.rloo_advantages(r, group_size=4)), use_jit)
    grouped, rloo = fn(jnp.asarray(r))
    for scale, got in grouped.items():
        want = _group_advantages_f64(r, 4, scale=scale)
        assert np.all(np.isfinite(np.asarray(got))), scale
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * np.abs(want).max(), err_msg=scale)
    g = r.astype(np.float64).reshape(-1, 4)
    want_rloo = (g - (g.sum(1, keepdims=True) - g) / 3).reshape(-1)
    np.testing.assert_allclose(rloo, want_rloo, rtol=2e-6, atol=1e-6 * np.abs(want_rloo).max())
    # the same for whitening (PPO, REINFORCE++)
    x = r.reshape(2, 4)
    w = np.asarray(A.whiten(jnp.asarray(x), jnp.ones((2, 4))))
    want_w = (x.astype(np.float64) - x.mean(dtype=np.float64)) / x.astype(np.float64).std(ddof=1)
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=1e-6)
