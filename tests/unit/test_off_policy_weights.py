"""rljax.losses.off_policy_weights and the off-policy settings: hand-computed weights and metrics of
every mode (eager and jitted, garbage at masked positions), the stop-gradient contract, bad bounds,
and the policy losses with a correction (``token_tis`` with bounds (0, c) is ``tis_cap=c``; ``none``
leaves the loss as it was)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.algorithms import grpo, ppo, reinforce, rloo
from rljax.algorithms import policy_gradient as pg
from rljax.batches import RolloutBatch
from rljax.config import ConfigError, from_yaml
from rljax.losses import OFF_POLICY_MODES, off_policy_weights
from rljax.losses import policy as P
from rljax.losses.off_policy import OFF_POLICY_METRICS
from rljax.run_config import RunConfig

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
LOG = math.log
NAN, INF = float("nan"), float("inf")
BOUNDS = (0.5, 2.0)

# Four rows of d_t = old_t − μ_t (μ = 0 on valid tokens, so old = d), bounds (0.5, 2):
#   row 0: d = [ln 3, ln 0.25], 3rd masked (old NaN, μ +inf)
#   row 1: d = [ln 1.5, ln 1.5, ln 1.5]
#   row 2: d = [ln 9, ln 1],     3rd masked (old −inf, μ NaN)
#   row 3: every token masked (NaN / inf)
# token_tis  min(r, 2):          [2, .25, 0 | 1.5, 1.5, 1.5 | 2, 1, 0 | 0 0 0]
# seq_tis    min(Π r, 2):        Π = .75, 3.375, 9 -> [.75 .75 0 | 2 2 2 | 2 2 0 | 0 0 0]
# token_mask 1 if .5 <= r <= 2:  [0 0 0 | 1 1 1 | 0 1 0 | 0 0 0]
# seq_mask   geometric mean (√.75 = .866, 1.5, √9 = 3) in [.5, 2]: [1 1 0 | 1 1 1 | 0 0 0 | 0 0 0]
OLD = np.array([[LOG(3.0), LOG(0.25), NAN],
                [LOG(1.5), LOG(1.5), LOG(1.5)],
                [LOG(9.0), 0.0, -INF],
                [NAN, INF, -INF]])
SAMPLING = np.array([[0.0, 0.0, INF],
                     [0.0, 0.0, 0.0],
                     [0.0, 0.0, NAN],
                     [INF, NAN, 0.0]])
MASK = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]], np.int32)
HAND_WEIGHTS = {
    "token_tis": [[2, 0.25, 0], [1.5, 1.5, 1.5], [2, 1, 0], [0, 0, 0]],
    "seq_tis": [[0.75, 0.75, 0], [2, 2, 2], [2, 2, 0], [0, 0, 0]],
    "token_mask": [[0, 0, 0], [1, 1, 1], [0, 1, 0], [0, 0, 0]],
    "seq_mask": [[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]],
}
# 7 valid tokens in 3 rows with a valid token. |d| = ln 3, ln 4, 3 × ln 1.5, ln 9, 0.
LOGP_DIFF_MEAN = (LOG(3) + LOG(4) + 3 * LOG(1.5) + LOG(9)) / 7
HAND_METRICS = {  # weight_mean, weight_max, token_masked_frac, row_masked_frac, truncated_frac
    "token_tis": (9.75 / 7, 2.0, 0.0, 0.0, 2 / 7),  # ratios 3 and 9 truncated
    "seq_tis": (11.5 / 7, 2.0, 0.0, 0.0, 5 / 7),  # rows 1 and 2 truncated
    "token_mask": (4 / 7, 1.0, 3 / 7, 1 / 3, 0.0),  # row 0 wholly rejected
    "seq_mask": (5 / 7, 1.0, 2 / 7, 1 / 3, 0.0),  # row 2 rejected
}


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


def _hand_inputs(dtype=jnp.float32):
    return jnp.asarray(OLD, dtype), jnp.asarray(SAMPLING, dtype), jnp.asarray(MASK)


@JIT
@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_hand_computed_weights_and_metrics(mode, use_jit):
    fn = _maybe_jit(lambda o, s, m: off_policy_weights(o, s, m, mode=mode, bounds=BOUNDS), use_jit)
    weights, metrics = fn(*_hand_inputs())
    assert weights.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(weights)))
    np.testing.assert_allclose(weights, HAND_WEIGHTS[mode], rtol=1e-6)
    assert set(metrics) == set(OFF_POLICY_METRICS)
    mean, top, token_frac, row_frac, truncated = HAND_METRICS[mode]
    got = [metrics[k] for k in ("off_policy/weight_mean", "off_policy/weight_max", "off_policy/token_masked_frac",
                                "off_policy/row_masked_frac", "off_policy/truncated_frac",
                                "policy/logp_diff_mean", "policy/logp_diff_max")]
    np.testing.assert_allclose(got, [mean, top, token_frac, row_frac, truncated, LOGP_DIFF_MEAN, LOG(9)],
                               rtol=1e-6)


def test_weights_in_float64_match_the_formulas():
    # an algebraic identity, so in float64: the weights of random inputs against the table's formulas
    rng = np.random.default_rng(0)
    old, samp = rng.normal(-1.5, 0.5, (6, 5)), rng.normal(-1.5, 0.5, (6, 5))
    mask = (rng.random((6, 5)) < 0.7).astype(np.int32)
    mask[0], mask[1, 0] = 0, 1
    d = (old - samp) * mask
    n = np.maximum(mask.sum(-1, keepdims=True), 1)
    lo, hi = 0.7, 1.6
    expected = {
        "token_tis": np.minimum(np.exp(d), hi) * mask,
        "seq_tis": np.minimum(np.exp(d.sum(-1, keepdims=True)), hi) * mask,
        "token_mask": ((np.exp(d) >= lo) & (np.exp(d) <= hi)) * mask,
        "seq_mask": ((np.exp(d.sum(-1, keepdims=True) / n) >= lo) & (np.exp(d.sum(-1, keepdims=True) / n) <= hi))
                    * mask,
    }
    with jax.enable_x64(True):
        for mode in OFF_POLICY_MODES:
            w, _ = off_policy_weights(jnp.asarray(old), jnp.asarray(samp), jnp.asarray(mask), mode=mode,
                                      bounds=(lo, hi))
            assert w.dtype == jnp.float64
            np.testing.assert_allclose(w, expected[mode], rtol=1e-12, err_msg=mode)
    assert 0 < expected["token_mask"].sum() < mask.sum()  # the case masks some tokens and keeps others


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_weights_carry_no_gradient_and_stay_finite(mode):
    # the gradient of anything built from the weights is 0 for both inputs, NaN at masked places or not
    def total(o, s):
        w, metrics = off_policy_weights(o, s, jnp.asarray(MASK), mode=mode, bounds=BOUNDS)
        return jnp.sum(w * jnp.arange(1.0, 4.0)[None, :]) + metrics["off_policy/weight_mean"]

    grads = jax.jit(jax.grad(total, argnums=(0, 1)))(*_hand_inputs()[:2])
    for g in grads:
        np.testing.assert_array_equal(g, np.zeros_like(OLD))


def test_bfloat16_inputs_give_bfloat16_weights_summed_in_float32():
    w, metrics = off_policy_weights(*_hand_inputs(jnp.bfloat16), mode="seq_mask", bounds=BOUNDS)
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w, np.float32), HAND_WEIGHTS["seq_mask"])
    np.testing.assert_allclose(metrics["off_policy/row_masked_frac"], 1 / 3, rtol=1e-6)


@pytest.mark.parametrize("bounds,message", [
    ((2.0, 0.5), r"lo must be <= hi"),
    ((-0.1, 2.0), r"lo must be >= 0"),
    ((0.0, 0.0), r"hi must be > 0"),
    ((0.0, -1.0), r"hi must be > 0"),
    ((NAN, 2.0), r"must be numbers"),
    ((0.5,), r"must be a pair"),
    (2.0, r"must be a pair"),
])
def test_bad_bounds_are_refused(bounds, message):
    with pytest.raises(ValueError, match=r"^bounds.*" + message):
        off_policy_weights(*_hand_inputs(), mode="token_mask", bounds=bounds)


def test_bad_mode_and_shapes_are_refused():
    old, samp, mask = _hand_inputs()
    with pytest.raises(ValueError, match="mode must be one of"):
        off_policy_weights(old, samp, mask, mode="token", bounds=BOUNDS)
    with pytest.raises(AssertionError):
        off_policy_weights(old, samp[:, :2], mask, mode="token_tis", bounds=BOUNDS)
    with pytest.raises(AssertionError):  # [B, T] only
        off_policy_weights(old[0], samp[0], mask[0], mode="token_tis", bounds=BOUNDS)


def test_uncapped_token_tis_is_the_plain_ratio():
    w, _ = off_policy_weights(*_hand_inputs(), mode="token_tis", bounds=(0.0, INF))
    np.testing.assert_allclose(w, [[3, 0.25, 0], [1.5, 1.5, 1.5], [9, 1, 0], [0, 0, 0]], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# In the policy losses
# ---------------------------------------------------------------------------------------------
@JIT
@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_hand_computed_loss_with_each_correction(mode, use_jit):
    # on-policy (logp = old, ratio 1) with token_mean: ℓ_t = −w_t A_t, loss = −Σ w A / 7 over the 7
    # valid tokens, A = 1, 2, 3 by column. A rejected token stays in the denominator.
    old, samp, mask = _hand_inputs()
    adv = jnp.tile(jnp.arange(1.0, 4.0), (4, 1))
    fn = _maybe_jit(lambda o, s, a, m: P.policy_gradient_loss(
        o, o, a, m, sampling_logprobs=s, off_policy_correction=mode, correction_bounds=BOUNDS,
        reduction="token_mean"), use_jit)
    loss, metrics = fn(old, samp, adv, mask)
    w = np.asarray(HAND_WEIGHTS[mode])
    np.testing.assert_allclose(loss, -(w * np.asarray(adv)).sum() / 7, rtol=1e-6)
    np.testing.assert_allclose(metrics["off_policy/weight_mean"], HAND_METRICS[mode][0], rtol=1e-6)
    assert "policy/tis_weight_mean" not in metrics


def test_token_tis_with_bounds_zero_c_is_tis_cap_c():
    # in float64 (an algebraic equality), loss and gradient, token and sequence ratio, both losses;
    # and against the formula ℓ = min(π_old/μ, c) · ℓ_pg written out here
    rng = np.random.default_rng(3)
    b, t, c = 6, 5, 1.3
    old = rng.normal(-1.5, 0.5, (b, t))
    lp, samp = old + rng.normal(0, 0.3, (b, t)), old + rng.normal(0, 0.4, (b, t))
    adv = rng.normal(0, 1, (b, t))
    mask = (rng.random((b, t)) < 0.75).astype(np.float64)
    mask[:, 0] = 1
    with jax.enable_x64(True):
        x = [jnp.asarray(v) for v in (lp, old, adv, mask, samp)]
        for level in ("token", "sequence"):
            def loss(y, **kw):
                return P.policy_gradient_loss(y, *x[1:4], ratio_level=level, sampling_logprobs=x[4], **kw)[0]

            tis = jax.value_and_grad(lambda y: loss(y, tis_cap=c))(x[0])
            corr = jax.value_and_grad(lambda y: loss(y, off_policy_correction="token_tis",
                                                     correction_bounds=(0.0, c)))(x[0])
            for a, b_ in zip(tis, corr):
                np.testing.assert_array_equal(a, b_)
        rho = np.exp(lp - old)
        pg_terms = np.maximum(-adv * rho, -adv * np.clip(rho, 0.8, 1.2)) * np.minimum(np.exp(old - samp), c)
        expected = np.mean([(pg_terms[i] * mask[i]).sum() / mask[i].sum() for i in range(b)])
        got = P.policy_gradient_loss(*x[:4], sampling_logprobs=x[4], off_policy_correction="token_tis",
                                     correction_bounds=(0.0, c))[0]
        np.testing.assert_allclose(got, expected, rtol=1e-12)
        r_tis = P.reinforce_loss(x[0], x[2], x[3], sampling_logprobs=x[4], tis_cap=c)[0]
        r_corr = P.reinforce_loss(x[0], x[2], x[3], sampling_logprobs=x[4], off_policy_correction="token_tis",
                                  correction_bounds=(0.0, c))[0]
        np.testing.assert_array_equal(r_tis, r_corr)


def test_reinforce_weights_are_taken_against_the_trained_policy():
    # REINFORCE has no π_old: the weight is min(π_θ/μ, hi) with π_θ stopped. logp = ln .5, μ = ln .25
    # -> ratio 2 > 1.5: token_tis weight 1.5, token_mask weight 0 (rejected); loss −A·w·logp.
    lp, samp = jnp.asarray([[LOG(0.5)]]), jnp.asarray([[LOG(0.25)]])
    adv, mask = jnp.asarray([[2.0]]), jnp.asarray([[1]])
    for mode, w in (("token_tis", 1.5), ("token_mask", 0.0)):
        loss, grad = jax.value_and_grad(lambda y: P.reinforce_loss(
            y, adv, mask, sampling_logprobs=samp, off_policy_correction=mode, correction_bounds=(0.5, 1.5))[0])(lp)
        np.testing.assert_allclose([loss, grad[0, 0]], [-2.0 * w * LOG(0.5), -2.0 * w], rtol=1e-6, atol=1e-12)


def test_loss_refuses_a_correction_it_cannot_apply():
    old, samp, mask = _hand_inputs()
    adv = jnp.ones_like(old)
    with pytest.raises(ValueError, match="without sampling_logprobs"):
        P.policy_gradient_loss(old, old, adv, mask, off_policy_correction="seq_mask")
    with pytest.raises(ValueError, match="tis_cap and off_policy_correction='token_tis' both given"):
        P.policy_gradient_loss(old, old, adv, mask, sampling_logprobs=samp, tis_cap=2.0,
                               off_policy_correction="token_tis")
    with pytest.raises(ValueError, match="off_policy_correction must be 'none' or one of"):
        P.reinforce_loss(old, adv, mask, sampling_logprobs=samp, off_policy_correction="tis")
    with pytest.raises(ValueError, match=r"^correction_bounds: lo must be <= hi"):
        P.policy_gradient_loss(old, old, adv, mask, sampling_logprobs=samp, off_policy_correction="seq_tis",
                               correction_bounds=(3.0, 2.0))


# ---------------------------------------------------------------------------------------------
# The algorithms' wiring (pure arrays: the policy's log-probs given, no model)
# ---------------------------------------------------------------------------------------------
def _batch_and_out(seed=0, R=4, N=5):
    rng = np.random.default_rng(seed)
    mask = np.ones((R, N), np.int32)
    mask[1, 3:] = 0
    old = rng.normal(-1.5, 0.5, (R, N)).astype(np.float32)
    sampling = (old + rng.normal(0, 0.3, (R, N))).astype(np.float32)
    old[1, 3:], sampling[1, 3:] = NAN, INF  # garbage past the end of a short row
    batch = RolloutBatch(
        prompt_ids=jnp.ones((R, 2), jnp.int32), prompt_mask=jnp.ones((R, 2), jnp.int32),
        completion_ids=jnp.ones((R, N), jnp.int32), completion_mask=jnp.asarray(mask), loss_mask=jnp.asarray(mask),
        old_logprobs=jnp.asarray(old), scores=jnp.zeros(R), row_mask=jnp.ones(R, bool), finished=jnp.ones(R, bool),
        advantages=jnp.asarray(rng.normal(0, 1, (R, N)), jnp.float32),
        ref_logprobs=jnp.asarray(old - 0.1))
    out = {"logprobs": jnp.asarray(old + rng.normal(0, 0.2, (R, N)).astype(np.float32)),
           "entropy": jnp.asarray(rng.uniform(0, 2, (R, N)), jnp.float32)}
    return batch, jnp.asarray(sampling), out


def _counts(batch):
    return dict(num_rows=4, num_tokens=jnp.sum(batch.loss_mask), max_length=batch.loss_mask.shape[1])


@pytest.mark.parametrize("config", [grpo.GRPOConfig(kl_coef=0.04), ppo.PPOConfig(dual_clip=3.0)])
def test_clipped_loss_none_is_unchanged_and_token_tis_is_tis_cap(config):
    batch, sampling, out = _batch_and_out()
    kl = isinstance(config, grpo.GRPOConfig)
    counts = _counts(batch)
    # correction none: the loss the algorithm computed before the setting existed, bit for bit, even
    # with sampler log-probs in the batch
    before = P.policy_gradient_loss(
        out["logprobs"], batch.old_logprobs, batch.advantages, batch.loss_mask, ratio_level=config.ratio_level,
        epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high, dual_clip=config.dual_clip,
        entropy=out["entropy"], entropy_coef=config.entropy_coef, ref_logprobs=batch.ref_logprobs if kl else None,
        kl_coef=config.kl_coef if kl else 0.0, reduction=config.reduction, num_sequences=counts["num_rows"],
        num_tokens=counts["num_tokens"], max_length=counts["max_length"])
    for b in (batch, batch.replace(sampling_logprobs=sampling)):
        now = pg.clipped_loss(out, b, config, kl_in_loss=kl, **counts)
        np.testing.assert_array_equal(now[0], before[0])
        assert now[1].keys() == before[1].keys()
    # token_tis with bounds (0, c) from the config: the loss of tis_cap = c
    c = 1.2
    corrected = dataclasses.replace(config, off_policy_correction="token_tis", correction_bounds=(0.0, c))
    loss, metrics = pg.clipped_loss(out, batch.replace(sampling_logprobs=sampling), corrected, kl_in_loss=kl,
                                    **counts)
    tis = P.policy_gradient_loss(
        out["logprobs"], batch.old_logprobs, batch.advantages, batch.loss_mask, ratio_level=config.ratio_level,
        epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high, dual_clip=config.dual_clip,
        entropy=out["entropy"], entropy_coef=config.entropy_coef, ref_logprobs=batch.ref_logprobs if kl else None,
        kl_coef=config.kl_coef if kl else 0.0, reduction=config.reduction, num_sequences=counts["num_rows"],
        num_tokens=counts["num_tokens"], max_length=counts["max_length"], sampling_logprobs=sampling, tis_cap=c)
    np.testing.assert_array_equal(loss, tis[0])
    assert loss != before[0] and np.isfinite(loss)
    np.testing.assert_array_equal(metrics["off_policy/weight_mean"], tis[1]["policy/tis_weight_mean"])
    assert 0 < metrics["off_policy/truncated_frac"] < 1
    with pytest.raises(ValueError, match="needs the batch's sampling_logprobs"):
        pg.clipped_loss(out, batch, corrected, kl_in_loss=kl, **counts)


def test_reinforce_algorithms_apply_the_correction(monkeypatch):
    batch, sampling, out = _batch_and_out(seed=1)
    counts = _counts(batch)
    batch = batch.replace(sampling_logprobs=sampling)
    # the losses' forward pass replaced by fixed log-probs: the wiring alone is under test
    monkeypatch.setattr(pg, "policy_logprobs", lambda model, b, cfg, temperature: out)
    bounds = (0.9, 1.1)
    for algo_module, config in ((rloo, rloo.RLOOConfig(loss="reinforce", off_policy_correction="seq_mask",
                                                         correction_bounds=bounds)),
                                (reinforce, reinforce.ReinforceConfig(off_policy_correction="seq_mask",
                                                                      correction_bounds=bounds))):
        expected = P.reinforce_loss(out["logprobs"], batch.advantages, batch.loss_mask, entropy=out["entropy"],
                                    reduction="seq_mean_token_sum", sampling_logprobs=sampling,
                                    off_policy_correction="seq_mask", correction_bounds=bounds,
                                    num_sequences=counts["num_rows"], num_tokens=counts["num_tokens"],
                                    max_length=counts["max_length"])
        loss, metrics = algo_module.loss(None, batch, config, temperature=1.0, **counts)
        np.testing.assert_array_equal(loss, expected[0])
        assert 0 < metrics["off_policy/row_masked_frac"] < 1
        plain = algo_module.loss(None, batch, dataclasses.replace(config, off_policy_correction="none"),
                                 temperature=1.0, **counts)[0]
        assert plain != loss


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["grpo", "ppo", "rloo", "reinforce_pp", "reinforce"])
def test_every_online_algorithm_takes_the_settings(name):
    cfg = from_yaml(RunConfig, f"algorithm: {{name: {name}, off_policy_correction: seq_mask, "
                               "correction_bounds: [0.999, 1.001]}\nrewards: {answer: 1.0}")
    assert cfg.algorithm.off_policy_correction == "seq_mask" and cfg.algorithm.correction_bounds == (0.999, 1.001)
    hash(cfg.algorithm)  # a static jit argument
    default = from_yaml(RunConfig, f"algorithm: {{name: {name}}}\nrewards: {{answer: 1.0}}").algorithm
    assert default.off_policy_correction == "none"


@pytest.mark.parametrize("setting,message", [
    ("correction_bounds: [2.0, 0.5]", r"algorithm.correction_bounds: \[lo, hi\]: lo must be <= hi"),
    ("correction_bounds: [-1.0, 2.0]", r"algorithm.correction_bounds: \[lo, hi\]: lo must be >= 0"),
    ("correction_bounds: [0.0, 0.0]", r"algorithm.correction_bounds: \[lo, hi\]: hi must be > 0"),
    ("correction_bounds: [0.0, .inf]", r"algorithm.correction_bounds: must be two finite numbers"),
    ("correction_bounds: [1.0]", r"algorithm.correction_bounds: must be two finite numbers \[lo, hi\], got \[1.0\]"),
    ("correction_bounds: [0.5, 1.0, 2.0]", r"algorithm.correction_bounds: must be two finite numbers"),
    ("off_policy_correction: tis", r"algorithm.off_policy_correction"),
])
def test_bad_settings_name_the_key(setting, message):
    with pytest.raises(ConfigError, match=message):
        from_yaml(RunConfig, f"algorithm: {{name: grpo, {setting}}}\nrewards: {{answer: 1.0}}")

