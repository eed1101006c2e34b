"""rljax.losses.policy: clipped surrogate (token / GSPO), dual clip, TIS, KL and entropy terms,
REINFORCE; hand-computed values, TRL/verl references, gradient contracts, padding, micro-batches."""

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
from rljax.losses import policy as P
from rljax.losses import reduce as R

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
LOG = np.log


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


def _f32(*xs):
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _pad24(*xs):
    """Embed small hand-computed cases in [2, 4] arrays (masks padded with 0, values with junk):
    one shape for every hand case, so the eager runs share their per-op compilations, and every
    hand case also checks that padding is ignored."""
    out = []
    for x in xs:
        x = np.asarray(x, np.float32)
        y = np.full((2, 4), 7.0, np.float32)
        y[: x.shape[0], : x.shape[1]] = x
        out.append(jnp.asarray(y))
    return tuple(out)


def _mask24(m):
    m = np.asarray(m, np.float32)
    y = np.zeros((2, 4), np.float32)
    y[: m.shape[0], : m.shape[1]] = m
    return jnp.asarray(y)


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------
# Two rows, ε_low = ε_high = 0.2, old = −1, logp = −1 + log ρ:
#   row 0: ρ = [1.5, 0.5, 1.0, (masked)], A = [1, −1, 2, 5]
#     t0: −min(1.5·1, 1.2·1)      = −1.2   (high clip active)
#     t1: −min(0.5·−1, 0.8·−1)    = +0.8   (low clip active)
#     t2: −min(1·2, 1·2)          = −2.0
#   row 1: ρ = [1.1, 0.9], A = [−1, 1]:  +1.1, −0.9   (inside the clip range)
#   seq_mean_token_mean = ((−1.2 + 0.8 − 2)/3 + (1.1 − 0.9)/2) / 2 = (−0.8 + 0.1)/2 = −0.35
#   token_mean          = (−2.4 + 0.2) / 5                                     = −0.44
#   per row: low clipped 1/3 and 0, high clipped 1/3 and 0 -> low_seq_min 0, high_seq_max 1/3
#   clip_frac_low = clip_frac_high = 1/5; ratio mean (1.5+0.5+1+1.1+0.9)/5 = 1, min 0.5, max 1.5
#   approx_kl = mean((ρ−1) − log ρ) = (0.0945349 + 0.1931472 + 0 + 0.0046898 + 0.0053605)/5
#             = 0.0595465
HAND_RATIO = np.array([[1.5, 0.5, 1.0, 1.0], [1.1, 0.9, 1.0, 1.0]])
HAND_ADV = np.array([[1.0, -1.0, 2.0, 5.0], [-1.0, 1.0, 0.0, 0.0]])
HAND_MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)


def _hand():
    old = np.full(HAND_RATIO.shape, -1.0)
    return _f32(old + LOG(HAND_RATIO), old, HAND_ADV) + (jnp.asarray(HAND_MASK),)


@JIT
def test_hand_computed_token_level(use_jit):
    lp, old, adv, mask = _hand()
    fn = _maybe_jit(lambda *a: (P.policy_gradient_loss(*a),
                                P.policy_gradient_loss(*a, reduction="token_mean")), use_jit)
    (loss, m), (loss_tm, _) = fn(lp, old, adv, mask)
    np.testing.assert_allclose(loss, -0.35, rtol=1e-6)
    np.testing.assert_allclose(loss_tm, -0.44, rtol=1e-6)
    expect = {"policy/loss": -0.35, "policy/pg_loss": -0.35, "policy/clip_frac_low": 0.2,
              "policy/clip_frac_high": 0.2, "policy/ratio_mean": 1.0, "policy/ratio_min": 0.5,
              "policy/ratio_max": 1.5, "policy/approx_kl": 0.0595465,
              "policy/clip_frac_low_seq_min": 0.0, "policy/clip_frac_high_seq_max": 1 / 3}
    assert set(m) == set(expect)
    for key, value in expect.items():
        np.testing.assert_allclose(m[key], value, rtol=1e-6, err_msg=key)


@JIT
def test_row_clip_fractions_leave_out_rows_without_tokens(use_jit):
    # row 0: ρ = [0.5, 0.5, 1.5], A = [−1, −1, 1] -> low clipped 2/3, high clipped 1/3; row 1 has no
    # valid token, so it is no row of the min / max (its 0 would otherwise be the low minimum)
    lp, old, adv = _pad24([[LOG(0.5), LOG(0.5), LOG(1.5)]], [[0.0, 0.0, 0.0]], [[-1.0, -1.0, 1.0]])
    fn = _maybe_jit(P.policy_gradient_loss, use_jit)
    _, m = fn(lp, old, adv, _mask24([[1.0, 1.0, 1.0]]))
    np.testing.assert_allclose([m["policy/clip_frac_low_seq_min"], m["policy/clip_frac_high_seq_max"]],
                               [2 / 3, 1 / 3], rtol=1e-6)


@JIT
def test_hand_computed_dual_clip(use_jit):
    # A = −1 on both tokens, ρ = [5, 2]: clipped surrogate ℓ = max(−Aρ, −A·clip(ρ)) = [5, 2];
    # dual clip c = 3: min(ℓ, −c·A) = [3, 2] -> token mean 2.5 (3.5 without); dual clip on 1/2.
    lp, old, adv = _pad24([[LOG(5.0), LOG(2.0)]], [[0.0, 0.0]], [[-1.0, -1.0]])
    mask = _mask24([[1.0, 1.0]])
    fn = _maybe_jit(lambda *a: (P.policy_gradient_loss(*a, dual_clip=3.0, reduction="token_mean"),
                                P.policy_gradient_loss(*a, reduction="token_mean")), use_jit)
    (loss, m), (loss_plain, _) = fn(lp, old, adv, mask)
    np.testing.assert_allclose([loss, loss_plain, m["policy/dual_clip_frac"]], [2.5, 3.5, 0.5], rtol=1e-6)


@JIT
def test_hand_computed_clip_higher(use_jit):
    # ρ = 1.25, A = 1: symmetric ε = 0.2 clips to 1.2 (ℓ = −1.2, high clip on); DAPO's
    # ε_high = 0.28 leaves it alone (ℓ = −1.25). ε_low is untouched: ρ = 0.75, A = −1 -> 0.8.
    lp, old, adv = _pad24([[LOG(1.25), LOG(0.75)]], [[0.0, 0.0]], [[1.0, -1.0]])
    mask = _mask24([[1.0, 1.0]])
    fn = _maybe_jit(lambda *a: (P.policy_gradient_loss(*a, reduction="token_mean"),
                                P.policy_gradient_loss(*a, epsilon_high=0.28, reduction="token_mean")),
                    use_jit)
    (sym, m_sym), (high, m_high) = fn(lp, old, adv, mask)
    np.testing.assert_allclose(sym, (-1.2 + 0.8) / 2, rtol=1e-6)
    np.testing.assert_allclose(high, (-1.25 + 0.8) / 2, rtol=1e-6)
    np.testing.assert_allclose([m_sym["policy/clip_frac_high"], m_high["policy/clip_frac_high"],
                                m_high["policy/clip_frac_low"]], [0.5, 0.0, 0.5])


@JIT
def test_hand_computed_gspo(use_jit):
    # Row log-ratios [0.1, 0.3, (masked 5.0)], A = 1: s = exp((0.1 + 0.3)/2) = e^0.2 = 1.2214028
    # on both valid tokens. ε_high = 0.2 clips it to 1.2 -> loss −1.2; ε_high = 0.28 -> −1.2214028.
    lp, old, adv = _pad24([[0.1, 0.3, 5.0]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]])
    mask = _mask24([[1, 1, 0]])
    fn = _maybe_jit(lambda *a: (
        P.policy_gradient_loss(*a, ratio_level="sequence"),
        P.policy_gradient_loss(*a, ratio_level="sequence", epsilon_high=0.28)), use_jit)
    (clipped, m), (unclipped, _) = fn(lp, old, adv, mask)
    np.testing.assert_allclose([clipped, unclipped], [-1.2, -1.2214028], rtol=1e-6)
    np.testing.assert_allclose([m["policy/ratio_mean"], m["policy/ratio_max"],
                                m["policy/clip_frac_high"]], [1.2214028, 1.2214028, 1.0], rtol=1e-6)
    # approx_kl stays token level: mean of (e^0.1 − 1 − 0.1, e^0.3 − 1 − 0.3) = 0.0274495
    np.testing.assert_allclose(m["policy/approx_kl"],
                               (math.expm1(0.1) - 0.1 + math.expm1(0.3) - 0.3) / 2, rtol=1e-6)


@JIT
def test_hand_computed_truncated_importance_sampling(use_jit):
    # On-policy ratio 1, A = 1.5, sampler μ with π_old/μ = 3: the weight is min(3, cap = 2) = 2 ->
    # ℓ = −1.5 · 2 = −3; uncapped −4.5.
    lp, sampling, adv = _pad24([[-1.0]], [[-1.0 - LOG(3.0)]], [[1.5]])
    mask = _mask24([[1.0]])
    fn = _maybe_jit(lambda lp, s, a, m: (
        P.policy_gradient_loss(lp, lp, a, m, sampling_logprobs=s, tis_cap=2.0),
        P.policy_gradient_loss(lp, lp, a, m, sampling_logprobs=s)), use_jit)
    (capped, m), (uncapped, _) = fn(lp, sampling, adv, mask)
    np.testing.assert_allclose([capped, uncapped, m["policy/tis_weight_mean"]], [-3.0, -4.5, 2.0], rtol=1e-6)


@JIT
def test_hand_computed_kl_and_entropy_terms(use_jit):
    # A = 0, π = 0.5, π_ref = 0.25: k3 = 0.5 + log 2 − 1 = 0.1931472; β = 0.1 -> +0.0193147;
    # H = 2, c_H = 0.01 -> −0.02. Total −0.0006853.
    lp, rl, adv, ent = _pad24([[LOG(0.5)]], [[LOG(0.25)]], [[0.0]], [[2.0]])
    mask = _mask24([[1.0]])
    fn = _maybe_jit(lambda lp, rl, a, h, m: P.policy_gradient_loss(
        lp, lp, a, m, ref_logprobs=rl, kl_coef=0.1, entropy=h, entropy_coef=0.01), use_jit)
    loss, m = fn(lp, rl, adv, ent, mask)
    # 0.0193147 − 0.02 cancels: compare to float32's absolute resolution of the two terms
    # (|term| · 2^-24 ≈ 1.2e-9) rather than relative to the tiny difference.
    np.testing.assert_allclose(loss, 0.1 * 0.19314718 - 0.02, rtol=1e-6, atol=2e-9)
    np.testing.assert_allclose([m["kl/mean"], m["policy/entropy"], m["policy/pg_loss"]],
                               [0.1931472, 2.0, 0.0], rtol=1e-6, atol=1e-8)


@JIT
def test_hand_computed_reinforce(use_jit):
    # logp = [log 0.5, log 0.25], A = 2: −A Σ logp = 2 · 2.0794415 = 4.1588831 (one sequence);
    # the gradient w.r.t. every logp is −A = −2.
    lp, adv = _pad24([[LOG(0.5), LOG(0.25)]], [[2.0, 2.0]])
    mask = _mask24([[1.0, 1.0]])
    fn = _maybe_jit(jax.value_and_grad(lambda x, a, m: P.reinforce_loss(x, a, m)[0]), use_jit)
    loss, grad = fn(lp, adv, mask)
    np.testing.assert_allclose(loss, 4.1588831, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-2.0, -2.0, 0, 0], [0, 0, 0, 0]], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Random inputs against TRL / verl
# ---------------------------------------------------------------------------------------------
def _random(seed, b=8, t=6, spread=0.3):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (b, t))
    lp = old + rng.normal(0, spread, (b, t))
    adv = rng.normal(0, 1, (b, t))
    mask = (rng.random((b, t)) < 0.75).astype(np.float32)
    mask[:, 0] = 1
    sampling = old + rng.normal(0, 0.3, (b, t))
    rl = lp + rng.normal(0, 0.3, (b, t))
    ent = rng.uniform(0, 3, (b, t))
    return dict(lp=lp, old=old, adv=adv, mask=mask, sampling=sampling, rl=rl, ent=ent)


@functools.partial(jax.jit, static_argnames=("ratio_level", "reduction", "kl_estimator", "dual"))
def _pg(lp, old, adv, mask, sampling, rl, ent, *, ratio_level, reduction, kl_estimator, dual):
    return P.policy_gradient_loss(
        lp, old, adv, mask, ratio_level=ratio_level, epsilon_low=0.2, epsilon_high=0.28,
        dual_clip=3.0 if dual else None, sampling_logprobs=sampling, tis_cap=2.0,
        entropy=ent, entropy_coef=0.01, ref_logprobs=rl, kl_coef=0.04,
        kl_estimator=kl_estimator, reduction=reduction)


CASES = [  # (ratio_level, reduction, kl_estimator, dual clip)
    ("token", "seq_mean_token_mean", "k3", False),  # TRL loss_type="grpo"
    ("token", "token_mean", "k3_unbiased", False),  # TRL "bnpo"/"dapo", use_bias_correction_kl
    ("token", "seq_mean_token_sum_norm", "k3", False),  # TRL "dr_grpo"
    ("token", "seq_mean_token_sum", "k2", True),  # verl dual clip
    ("sequence", "seq_mean_token_mean", "k1", False),  # TRL importance_sampling_level="sequence"
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_trl_reference(case):
    level, reduction, estimator, dual = case
    d = _random(0, spread=0.4)
    d["adv"][:, :] = d["adv"][:, :1] if level == "sequence" else d["adv"]  # GRPO: A per row
    loss, m = _pg(*_f32(d["lp"], d["old"], d["adv"]), d["mask"], *_f32(d["sampling"], d["rl"], d["ent"]),
                  ratio_level=level, reduction=reduction, kl_estimator=estimator, dual=dual)
    expect, ref_m = ref.policy_loss_ref(
        d["lp"], d["old"], d["adv"], d["mask"], level=level, eps_low=0.2, eps_high=0.28,
        dual_clip=3.0 if dual else None, is_ratio=ref.vllm_is_ratio_ref(d["old"], d["sampling"], 2.0),
        ref=d["rl"], beta=0.04, kl_estimator=estimator, entropy=d["ent"], entropy_coef=0.01,
        mode=reduction)
    np.testing.assert_allclose(loss, expect, rtol=1e-6, atol=1e-7)
    assert ref_m["clip_frac_high"] + ref_m["clip_frac_low"] > 0.1  # the clipping is exercised
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max"):
        np.testing.assert_allclose(m["policy/" + key], ref_m[key], rtol=1e-6, err_msg=key)


def test_reinforce_matches_verl_gpg_reference():
    d = _random(1)
    losses = jax.jit(lambda lp, a, m: [P.reinforce_loss(lp, a, m, reduction=red)[0]
                                       for red in R.REDUCTIONS])(*_f32(d["lp"], d["adv"]), d["mask"])
    for reduction, loss in zip(R.REDUCTIONS, losses):
        np.testing.assert_allclose(loss, ref.reinforce_ref(d["lp"], d["adv"], d["mask"], reduction),
                                   rtol=1e-6, err_msg=reduction)


# ---------------------------------------------------------------------------------------------
# Gradient contracts
# ---------------------------------------------------------------------------------------------
def test_on_policy_gradient_is_minus_advantage_grad_logp():
    """ρ = 1: ∂loss/∂logp = −A · m / N (token mean) and −A · m / (S · |y_i|) (seq-mean-token-mean)
    on every valid token, for the token ratio and for GSPO (A constant per row)."""
    d = _random(2)
    lp, adv, mask = jnp.asarray(d["lp"], jnp.float32), jnp.asarray(d["adv"], jnp.float32), d["mask"]
    n, s = mask.sum(), mask.shape[0]
    lengths = mask.sum(1, keepdims=True)
    grad = jax.jit(jax.grad(lambda x, o, a, red, lvl: P.policy_gradient_loss(
        x, o, a, mask, reduction=red, ratio_level=lvl)[0]), static_argnums=(3, 4))
    np.testing.assert_allclose(grad(lp, lp, adv, "token_mean", "token"), -adv * mask / n, rtol=1e-6)
    np.testing.assert_allclose(grad(lp, lp, adv, "seq_mean_token_mean", "token"),
                               -adv * mask / (s * lengths), rtol=1e-6)
    row_adv = jnp.broadcast_to(adv[:, :1], adv.shape)
    np.testing.assert_allclose(grad(lp, lp, row_adv, "seq_mean_token_mean", "sequence"),
                               -row_adv * mask / (s * lengths), rtol=1e-6)


def test_off_policy_gradient_zero_on_clipped_tokens():
    """ρ ≠ 1 (token mean): ∂loss/∂logp = −A ρ m/N where unclipped, exactly 0 where clipped."""
    d = _random(3, spread=0.5)
    lp, old, adv = _f32(d["lp"], d["old"], d["adv"])
    mask = d["mask"]
    grad = jax.jit(jax.grad(lambda x: P.policy_gradient_loss(
        x, old, adv, mask, reduction="token_mean", epsilon_high=0.28)[0]))(lp)
    ratio = np.exp(d["lp"] - d["old"])
    clipped = ((ratio > 1.28) & (d["adv"] > 0)) | ((ratio < 0.8) & (d["adv"] < 0))
    assert clipped[mask > 0].sum() >= 3 and (~clipped)[mask > 0].sum() >= 3
    expect = np.where(clipped, 0.0, -d["adv"] * ratio) * mask / mask.sum()
    np.testing.assert_allclose(grad, expect, rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(np.asarray(grad)[clipped], 0.0)


def test_gspo_token_form_equals_trl_sequence_form_gradient():
    """GSPO-token (sg tricks) vs TRL's exp(mean log ratio): same value and gradient when A is
    constant per row, for every reduction."""
    d = _random(4, spread=0.15)
    lp, old = _f32(d["lp"], d["old"])
    adv = jnp.broadcast_to(jnp.asarray(d["adv"][:, :1], jnp.float32), lp.shape)
    mask = d["mask"]

    def trl_form(x, reduction):  # TRL L3087-3095, L3113-3120
        seq = jnp.sum(jnp.where(mask > 0, x - old, 0.0), -1, keepdims=True) / mask.sum(-1, keepdims=True)
        coef_1 = jnp.exp(seq)
        per_token = -jnp.minimum(coef_1 * adv, jnp.clip(coef_1, 0.8, 1.2) * adv)
        return R.reduce_tokens(per_token, mask, mode=reduction)

    @jax.jit
    def both(x):
        return [(jax.value_and_grad(lambda y: P.policy_gradient_loss(
                    y, old, adv, mask, ratio_level="sequence", reduction=reduction)[0])(x),
                 jax.value_and_grad(trl_form)(x, reduction)) for reduction in R.REDUCTIONS]

    for ours, theirs in both(lp):
        np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6)
        np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-6, atol=1e-8)


def test_stop_gradients_and_term_gradients():
    """No gradient reaches old_logprobs, advantages, sampling_logprobs or ref_logprobs; the
    entropy term's gradient is −c_H m/N and the k3 term's is β(1 − π_ref/π) m/N."""
    d = _random(5)
    args = _f32(d["lp"], d["old"], d["adv"], d["sampling"], d["rl"], d["ent"])
    mask = d["mask"]
    n = mask.sum()

    def loss(lp, old, adv, sampling, rl, ent, kl_estimator="k3_unbiased"):
        return P.policy_gradient_loss(lp, old, adv, mask, sampling_logprobs=sampling, tis_cap=2.0,
                                      ref_logprobs=rl, kl_coef=0.1, kl_estimator=kl_estimator,
                                      entropy=ent, entropy_coef=0.01, dual_clip=3.0,
                                      reduction="token_mean")[0]

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))(*args)
    assert np.any(np.asarray(grads[0]) != 0)
    for g in grads[1:5]:
        np.testing.assert_array_equal(g, 0.0)
    np.testing.assert_allclose(grads[5], -0.01 * mask / n, rtol=1e-6)

    lp = args[0]
    kl_only = jax.jit(jax.grad(lambda x: P.policy_gradient_loss(
        x, lp, jnp.zeros_like(lp), mask, ref_logprobs=args[4], kl_coef=0.1,
        reduction="token_mean")[0]))(lp)
    np.testing.assert_allclose(kl_only, 0.1 * (1 - np.exp(d["rl"] - d["lp"])) * mask / n,
                               rtol=1e-6, atol=1e-8)

    r_grads = jax.jit(jax.grad(lambda x, a, s, rl: P.reinforce_loss(
        x, a, mask, sampling_logprobs=s, tis_cap=1.5, ref_logprobs=rl, kl_coef=0.1)[0],
        argnums=(0, 1, 2, 3)))(args[0], args[2], args[3], args[4])
    assert np.any(np.asarray(r_grads[0]) != 0)
    for g in r_grads[1:]:
        np.testing.assert_array_equal(g, 0.0)


def test_bad_arguments():
    lp, old, adv, mask = _hand()
    with pytest.raises(ValueError, match="ratio_level"):
        P.policy_gradient_loss(lp, old, adv, mask, ratio_level="seq")
    with pytest.raises(ValueError, match="dual_clip"):
        P.policy_gradient_loss(lp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_coef"):
        P.policy_gradient_loss(lp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef"):
        P.reinforce_loss(lp, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="tis_cap"):
        P.policy_gradient_loss(lp, old, adv, mask, tis_cap=2.0)
    with pytest.raises(AssertionError):
        P.policy_gradient_loss(lp, old[:, :3], adv, mask)


# ---------------------------------------------------------------------------------------------
# Padding invariance and micro-batches
# ---------------------------------------------------------------------------------------------
PADDING_CONFIGS = {  # every reduction and every KL estimator appears once
    "token": (("seq_mean_token_mean", "k3_unbiased"), ("seq_mean_token_sum_norm", "k2")),
    "sequence": (("token_mean", "k3"), ("seq_mean_token_sum", "k1")),
}


@functools.partial(jax.jit, static_argnames="ratio_level")
def _pg_all_configs(e, mask, *, ratio_level):
    out = []
    for reduction, estimator in PADDING_CONFIGS[ratio_level]:
        def f(x):
            return P.policy_gradient_loss(
                x, e["old"], e["adv"], mask, ratio_level=ratio_level, dual_clip=3.0,
                sampling_logprobs=e["sampling"], tis_cap=2.0, ref_logprobs=e["rl"], kl_coef=0.05,
                kl_estimator=estimator, entropy=e["ent"], entropy_coef=0.01, reduction=reduction,
                max_length=5)
        out.append(jax.value_and_grad(f, has_aux=True)(e["lp"]))
    return out


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_padding_invariance(ratio_level):
    """Two extra masked columns and two extra masked rows holding garbage (−inf log-probs, NaN,
    huge advantages) change neither the loss, nor any metric, nor the gradient."""
    d = _random(6, b=4, t=5)
    big = {}
    for key, fill in (("lp", -np.inf), ("old", np.nan), ("adv", 1e6), ("sampling", np.nan),
                      ("rl", -np.inf), ("ent", np.nan)):
        x = np.full((6, 7), fill, np.float32)
        x[:4, :5] = d[key]
        big[key] = x
    big_mask = np.zeros((6, 7), np.float32)
    big_mask[:4, :5] = d["mask"]
    small = {k: np.asarray(v, np.float32) for k, v in d.items() if k != "mask"}
    results_small = _pg_all_configs(small, d["mask"], ratio_level=ratio_level)
    results_big = _pg_all_configs(big, big_mask, ratio_level=ratio_level)
    for ((v0, m0), g0), ((v1, m1), g1) in zip(results_small, results_big):
        np.testing.assert_allclose(v1, v0, rtol=1e-6)
        assert set(m0) == set(m1)
        for key in m0:
            np.testing.assert_allclose(m1[key], m0[key], rtol=1e-6, err_msg=key)
        assert np.all(np.isfinite(g1))
        np.testing.assert_array_equal(np.asarray(g1)[big_mask == 0], 0.0)
        np.testing.assert_allclose(np.asarray(g1)[:4, :5], g0, rtol=1e-6, atol=1e-9)


@functools.partial(jax.jit, static_argnames="ratio_level")
def _pg_value_and_grad(lp, old, adv, mask, sampling, rl, ent, num_sequences=None, num_tokens=None,
                       *, ratio_level):
    out = {}
    for reduction in R.REDUCTIONS:
        def f(x):
            return P.policy_gradient_loss(
                x, old, adv, mask, ratio_level=ratio_level, epsilon_high=0.28, dual_clip=3.0,
                sampling_logprobs=sampling, tis_cap=2.0, ref_logprobs=rl, kl_coef=0.04,
                entropy=ent, entropy_coef=0.01, reduction=reduction, num_sequences=num_sequences,
                num_tokens=num_tokens, max_length=6)[0]
        out[reduction] = jax.value_and_grad(f)(lp)
    return out


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_micro_batches_sum_to_full_batch(ratio_level):
    """Every reduction: 4 micro-batches with the global counts sum to the whole-batch value and
    gradient (with dual clip, TIS, KL and entropy terms all on). An algebraic equality: in float64."""
    with jax.enable_x64(True):
        _check_micro_batches_sum_to_full_batch(ratio_level)


def _check_micro_batches_sum_to_full_batch(ratio_level):
    d = _random(7, b=8, t=6, spread=0.4)
    d["mask"][5, :] = 0  # one empty row
    keys = ("lp", "old", "adv", "mask", "sampling", "rl", "ent")
    arrays = [jnp.asarray(d[k], jnp.float64) for k in keys]
    counts = dict(num_sequences=R.num_valid_sequences(d["mask"]), num_tokens=R.num_valid_tokens(d["mask"]))
    full = _pg_value_and_grad(*arrays, ratio_level=ratio_level)
    parts = [_pg_value_and_grad(*part, **counts, ratio_level=ratio_level)
             for part in zip(*(jnp.split(a, 4) for a in arrays))]
    for reduction in R.REDUCTIONS:
        full_v, full_g = full[reduction]
        assert full_v.dtype == jnp.float64
        np.testing.assert_allclose(sum(p[reduction][0] for p in parts), full_v, rtol=1e-12, atol=1e-15,
                                   err_msg=reduction)
        np.testing.assert_allclose(jnp.concatenate([p[reduction][1] for p in parts]), full_g,
                                   rtol=1e-12, atol=1e-15, err_msg=reduction)


def test_reinforce_micro_batches_and_padding():
    with jax.enable_x64(True):  # an algebraic equality: checked in float64
        _check_reinforce_micro_batches_and_padding()


def _check_reinforce_micro_batches_and_padding():
    d = _random(8)
    lp, adv = (jnp.asarray(d[k], jnp.float64) for k in ("lp", "adv"))
    mask = d["mask"].astype(np.float64)
    vg = jax.jit(lambda x, a, m, s=None, n=None: jax.value_and_grad(
        lambda y: P.reinforce_loss(y, a, m, reduction="token_mean", num_sequences=s, num_tokens=n)[0])(x))
    full_v, full_g = vg(lp, adv, mask)
    parts = [vg(x, a, m, R.num_valid_sequences(mask), R.num_valid_tokens(mask))
             for x, a, m in zip(jnp.split(lp, 4), jnp.split(adv, 4), np.split(mask, 4))]
    assert full_v.dtype == jnp.float64
    np.testing.assert_allclose(sum(v for v, _ in parts), full_v, rtol=1e-12)
    np.testing.assert_allclose(jnp.concatenate([g for _, g in parts]), full_g, rtol=1e-12, atol=1e-15)
    padded_lp = jnp.pad(lp, ((0, 1), (0, 2)), constant_values=-jnp.inf)
    padded = vg(padded_lp, jnp.pad(adv, ((0, 1), (0, 2))), np.pad(mask, ((0, 1), (0, 2))))
    np.testing.assert_allclose(padded[0], full_v, rtol=1e-12)
    assert np.all(np.isfinite(padded[1]))
