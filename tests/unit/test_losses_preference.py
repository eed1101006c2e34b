"""rljax.losses.preference: the DPO family against hand values and TRL's DPOTrainer/CPOTrainer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests import _loss_reference as ref
except ImportError:
    import _loss_reference as ref
from rljax.losses import preference as PL

JIT = pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, use_jit):
    return jax.jit(fn) if use_jit else fn


# Two pairs and a padded third (mask 0, junk values), β = 0.1, |y⁺| = 2, |y⁻| = 4:
#   pair 0: logπ(y⁺) = −10, logπ_ref(y⁺) = −12 -> c = 2;  logπ(y⁻) = −15, ref −14 -> r = −1;  βΔ = 0.3
#   pair 1: logπ(y⁺) = −9,  ref −8 -> c = −1;             logπ(y⁻) = −10, ref −11 -> r = 1;   βΔ = −0.2
#   sigmoid: −log σ(0.3) = 0.5543552, −log σ(−0.2) = 0.7981389            mean 0.6762471
#   cdpo ε = 0.1: 0.9·0.5543552 + 0.1·0.8543552 = 0.5843552; 0.7781389     mean 0.6812471
#   robust ε = 0.1: (0.9·0.5543552 − 0.1·0.8543552)/0.8 = 0.5168552; 0.8231389  mean 0.6699971
#   hinge: relu(1 − 0.3) = 0.7, relu(1 + 0.2) = 1.2                        mean 0.95
#   ipo: (2/2 + 1/4 − 1/(2β))² = (1.25 − 5)² = 14.0625; (−0.5 − 0.25 − 5)² = 33.0625  mean 23.5625
#   metrics: rewards/chosen = mean(0.2, −0.1) = 0.05, rejected mean(−0.1, 0.1) = 0,
#            margin mean(0.3, −0.2) = 0.05, accuracy 1/2
PC = [-10.0, -9.0, 3.0]
PR = [-15.0, -10.0, 3.0]
RC = [-12.0, -8.0, np.nan]
RR = [-14.0, -11.0, np.nan]
LEN_C, LEN_R = [2, 2, 0], [4, 4, 0]
MASK = [1, 1, 0]
HAND = {"sigmoid": (0.0, 0.6762471), "cdpo": (0.1, 0.6812471), "robust": (0.1, 0.6699971),
        "hinge": (0.0, 0.95), "ipo": (0.0, 23.5625)}


@JIT
@pytest.mark.parametrize("loss_type", sorted(HAND))
def test_hand_computed(loss_type, use_jit):
    eps, expect = HAND[loss_type]
    fn = _maybe_jit(lambda *a: PL.preference_loss(
        *a[:4], loss_type=loss_type, beta=0.1, label_smoothing=eps, chosen_lengths=a[4],
        rejected_lengths=a[5], mask=a[6]), use_jit)
    args = [jnp.asarray(x, jnp.float32) for x in (PC, PR, RC, RR)] + [
        jnp.asarray(LEN_C), jnp.asarray(LEN_R), jnp.asarray(MASK)]
    loss, m = fn(*args)
    np.testing.assert_allclose(loss, expect, rtol=1e-6)
    np.testing.assert_allclose(m["preference/loss"], expect, rtol=1e-6)
    for key, val in {"rewards/chosen": 0.05, "rewards/rejected": 0.0, "rewards/margin": 0.05,
                     "rewards/accuracy": 0.5, "logps/chosen": -9.5, "logps/rejected": -12.5}.items():
        np.testing.assert_allclose(m[key], val, rtol=1e-6, atol=1e-7, err_msg=key)


@JIT
def test_hand_computed_simpo_and_reference_free(use_jit):
    # SimPO, β = 2, γ = 0.5, logπ(y⁺) = −4 over 2 tokens, logπ(y⁻) = −12 over 4:
    #   β(−2 − (−3)) − γ = 1.5 -> −log σ(1.5) = 0.2014133; rewards β·avg: −4 and −6, margin 2.
    # Reference-free DPO on the hand pairs: Δ = logπ(y⁺) − logπ(y⁻) = 5 and 1, β = 0.1:
    #   (−log σ(0.5) − log σ(0.1)) / 2 = (0.4740770 + 0.6443967)/2 = 0.5592368
    def f(pc, pr, rc, rr, lc, lr, m):
        simpo = PL.preference_loss(pc[:1] * 0 - 4.0, pr[:1] * 0 - 12.0, rc[:1], rr[:1],
                                   loss_type="simpo", beta=2.0, simpo_gamma=0.5,
                                   chosen_lengths=lc[:1], rejected_lengths=lr[:1])
        free = PL.preference_loss(pc, pr, rc, rr, beta=0.1, reference_free=True, mask=m)
        return simpo, free

    args = [jnp.asarray(x, jnp.float32) for x in (PC, PR, RC, RR)] + [
        jnp.asarray(LEN_C), jnp.asarray(LEN_R), jnp.asarray(MASK)]
    (simpo, m), (free, _) = _maybe_jit(f, use_jit)(*args)
    np.testing.assert_allclose(simpo, 0.2014133, rtol=1e-6)
    np.testing.assert_allclose([m["rewards/chosen"], m["rewards/rejected"], m["rewards/margin"],
                                m["rewards/accuracy"]], [-4.0, -6.0, 2.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(free, 0.5592368, rtol=1e-6)


def _random(seed, b=8):
    rng = np.random.default_rng(seed)
    len_c = rng.integers(1, 30, b)
    len_r = rng.integers(1, 30, b)
    pc = (-len_c * rng.uniform(0.5, 2, b)).astype(np.float32)
    pr = (-len_r * rng.uniform(0.5, 2, b)).astype(np.float32)
    rc = (pc + rng.normal(0, 2, b)).astype(np.float32)
    rr = (pr + rng.normal(0, 2, b)).astype(np.float32)
    return pc, pr, rc, rr, len_c, len_r


REF_CASES = [("sigmoid", 0.1, 0.0), ("cdpo", 0.1, 0.2), ("robust", 0.1, 0.2), ("ipo", 0.5, 0.0),
             ("hinge", 0.1, 0.0), ("simpo", 2.5, 0.1)]


@functools.partial(jax.jit, static_argnames=("loss_type",))
def _pref(pc, pr, rc, rr, lc, lr, beta, eps, mask=None, num_pairs=None, *, loss_type):
    return PL.preference_loss(pc, pr, rc, rr, loss_type=loss_type, beta=beta, label_smoothing=eps,
                              simpo_gamma=0.7, chosen_lengths=lc, rejected_lengths=lr, mask=mask,
                              num_pairs=num_pairs)


@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: c[0])
def test_matches_trl_reference(case):
    loss_type, beta, eps = case
    pc, pr, rc, rr, lc, lr = _random(0)
    loss, m = _pref(pc, pr, rc, rr, lc, lr, beta, eps, loss_type=loss_type)
    expect, ref_m = ref.preference_ref(pc, pr, rc, rr, loss_type, beta, eps, gamma=0.7,
                                       len_c=lc, len_r=lr)
    np.testing.assert_allclose(loss, expect, rtol=1e-6)
    for key, val in ref_m.items():
        np.testing.assert_allclose(m[key], val, rtol=1e-6, atol=1e-7, err_msg=key)


@jax.jit
def _all_value_and_grads(pc, pr, rc, rr, lc, lr, mask=None, num_pairs=None):
    """Value and gradient w.r.t. all four log-prob inputs, for every REF_CASES loss, in one program."""
    out = {}
    for loss_type, beta, eps in REF_CASES:
        def f(a, b, c, d):
            return PL.preference_loss(a, b, c, d, loss_type=loss_type, beta=beta,
                                      label_smoothing=eps, simpo_gamma=0.7, chosen_lengths=lc,
                                      rejected_lengths=lr, mask=mask, num_pairs=num_pairs)[0]
        out[loss_type] = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(pc, pr, rc, rr)
    return out


def test_reference_free_equals_zero_reference_and_stop_gradients():
    pc, pr, rc, rr, lc, lr = _random(1)
    free, _ = PL.preference_loss(pc, pr, rc, rr, reference_free=True)
    zero, _ = PL.preference_loss(pc, pr, np.zeros_like(rc), np.zeros_like(rr))
    np.testing.assert_allclose(free, zero, rtol=1e-7)
    for loss_type, (_, grads) in _all_value_and_grads(pc, pr, rc, rr, lc, lr).items():
        assert np.any(np.asarray(grads[0]) != 0) and np.any(np.asarray(grads[1]) != 0)
        np.testing.assert_array_equal(grads[2], 0.0, err_msg=loss_type)
        np.testing.assert_array_equal(grads[3], 0.0, err_msg=loss_type)


def test_dpo_gradient_hand_formula():
    """∂/∂logπ(y⁺) of the DPO loss is −β σ(−βΔ) / B (and the opposite for y⁻) — the DPO paper's
    gradient, eq. 7."""
    pc, pr, rc, rr, lc, lr = _random(2)
    _, g = _all_value_and_grads(pc, pr, rc, rr, lc, lr)["sigmoid"]
    delta = (pc.astype(np.float64) - rc) - (pr - rr)
    weight = 0.1 / (1 + np.exp(0.1 * delta)) / pc.size
    np.testing.assert_allclose(g[0], -weight, rtol=1e-6)
    np.testing.assert_allclose(g[1], weight, rtol=1e-6)


def test_padding_rows_and_micro_batches():
    """Two junk pairs with mask 0 change nothing; 4 micro-batches with the global pair count sum
    to the whole-batch value and gradient — for every loss type. Algebraic equalities: in float64."""
    with jax.enable_x64(True):
        _check_padding_rows_and_micro_batches()


def _check_padding_rows_and_micro_batches():
    pc, pr, rc, rr, lc, lr = (x.astype(np.float64) if x.dtype == np.float32 else x for x in _random(3, b=8))
    full = _all_value_and_grads(pc, pr, rc, rr, lc, lr)

    def pad(x, v):
        return np.concatenate([x, np.full(2, v, x.dtype)])

    padded = _all_value_and_grads(pad(pc, -np.inf), pad(pr, np.nan), pad(rc, np.nan),
                                  pad(rr, np.inf), pad(lc, 0), pad(lr, 0),
                                  pad(np.ones(8, np.float64), 0))
    parts = [_all_value_and_grads(pc[i], pr[i], rc[i], rr[i], lc[i], lr[i], None, 8)
             for i in np.split(np.arange(8), 4)]
    for loss_type, (full_v, full_g) in full.items():
        pv, pg = padded[loss_type]
        assert full_v.dtype == np.float64
        np.testing.assert_allclose(pv, full_v, rtol=1e-12, err_msg=loss_type)
        for k in range(2):
            np.testing.assert_allclose(pg[k][:8], full_g[k], rtol=1e-12, err_msg=loss_type)
            np.testing.assert_array_equal(pg[k][8:], 0.0)
        np.testing.assert_allclose(sum(p[loss_type][0] for p in parts), full_v, rtol=1e-12,
                                   err_msg=loss_type)
        for k in range(2):
            np.testing.assert_allclose(np.concatenate([p[loss_type][1][k] for p in parts]),
                                       full_g[k], rtol=1e-12, err_msg=loss_type)


# ODPO (arXiv:2402.10571) on the hand pairs, β = 0.1, offsets o = [0.5, −0.3, (NaN: padded)]:
#   pair 0: βΔ − o = 0.3 − 0.5 = −0.2 -> −log σ(−0.2) = 0.7981389
#   pair 1: βΔ − o = −0.2 + 0.3 = 0.1 -> −log σ(0.1)  = 0.6443967        mean 0.7212678
#   ∂/∂logπ(y⁺) = −β σ(−(βΔ − o)) / 2: −0.1·σ(0.2)/2 = −0.0274917, −0.1·σ(−0.1)/2 = −0.0237510
#   odpo/offset_mean = (0.5 − 0.3)/2 = 0.1; the implicit-reward metrics are those of plain DPO
OFFSET = [0.5, -0.3, np.nan]


@JIT
def test_odpo_offset_hand_computed(use_jit):
    def f(pc, pr, rc, rr, m, o):
        return jax.value_and_grad(
            lambda x, z: PL.preference_loss(x, pr, rc, rr, beta=0.1, mask=m, offset=z), argnums=(0, 1),
            has_aux=True)(pc, o)

    args = [jnp.asarray(x, jnp.float32) for x in (PC, PR, RC, RR, MASK, OFFSET)]
    (loss, m), (grad_chosen, grad_offset) = _maybe_jit(f, use_jit)(*args)
    np.testing.assert_allclose(loss, 0.7212678, rtol=1e-6)
    np.testing.assert_allclose(m["preference/loss"], 0.7212678, rtol=1e-6)
    np.testing.assert_allclose(m["odpo/offset_mean"], 0.1, rtol=1e-6)
    for key, val in {"rewards/chosen": 0.05, "rewards/rejected": 0.0, "rewards/margin": 0.05,
                     "rewards/accuracy": 0.5, "logps/chosen": -9.5, "logps/rejected": -12.5}.items():
        np.testing.assert_allclose(m[key], val, rtol=1e-6, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(grad_chosen, [-0.0274917, -0.0237510, 0.0], rtol=1e-5)
    np.testing.assert_array_equal(grad_offset, 0.0)  # the offset is a constant of the data


def test_odpo_gradient_hand_formula_and_micro_batches():
    """∂/∂logπ(y⁺) of ODPO is −β σ(−(βΔ − o)) / B (DPO's with βΔ shifted), −that for y⁻; four
    micro-batches with the global pair count sum to the whole-batch value and gradient (in float64)."""
    with jax.enable_x64(True):
        _check_odpo_gradient_and_micro_batches()


def _check_odpo_gradient_and_micro_batches():
    pc, pr, rc, rr = (x.astype(np.float64) for x in _random(5)[:4])
    offset = np.random.default_rng(5).normal(0, 1, pc.size)

    @jax.jit
    def value_and_grad(pc, pr, rc, rr, o, num_pairs=None):
        return jax.value_and_grad(lambda a, b: PL.preference_loss(a, b, rc, rr, beta=0.1, offset=o,
                                                                  num_pairs=num_pairs)[0], argnums=(0, 1))(pc, pr)

    full, (g_c, g_r) = value_and_grad(pc, pr, rc, rr, offset)
    delta = (pc.astype(np.float64) - rc) - (pr - rr)
    weight = 0.1 / (1 + np.exp(0.1 * delta - offset)) / pc.size
    assert g_c.dtype == np.float64
    np.testing.assert_allclose(g_c, -weight, rtol=1e-10)
    np.testing.assert_allclose(g_r, weight, rtol=1e-10)
    parts = [value_and_grad(pc[i], pr[i], rc[i], rr[i], offset[i], pc.size) for i in np.split(np.arange(pc.size), 4)]
    np.testing.assert_allclose(sum(p[0] for p in parts), full, rtol=1e-12)
    np.testing.assert_allclose(np.concatenate([p[1][0] for p in parts]), g_c, rtol=1e-12)


def test_odpo_zero_offset_is_dpo():
    pc, pr, rc, rr, _, _ = _random(6)

    def f(offset):
        return jax.value_and_grad(lambda a: PL.preference_loss(a, pr, rc, rr, beta=0.1, offset=offset),
                                  has_aux=True)(pc)

    (odpo, odpo_m), odpo_g = f(np.zeros_like(pc))
    (dpo, dpo_m), dpo_g = f(None)
    np.testing.assert_array_equal(odpo, dpo)
    np.testing.assert_array_equal(odpo_g, dpo_g)
    assert odpo_m.pop("odpo/offset_mean") == 0.0 and "odpo/offset_mean" not in dpo_m
    assert odpo_m.keys() == dpo_m.keys()
    for key in dpo_m:
        np.testing.assert_array_equal(odpo_m[key], dpo_m[key], err_msg=key)


@pytest.mark.parametrize("loss_type", [t for t in PL.LOSS_TYPES if t != "sigmoid"])
def test_odpo_offset_refuses_other_loss_types(loss_type):
    x, lengths = jnp.zeros(3), jnp.ones(3)
    with pytest.raises(ValueError, match=f"offset.*loss_type='{loss_type}'"):
        PL.preference_loss(x, x, x, x, loss_type=loss_type, chosen_lengths=lengths, rejected_lengths=lengths,
                           offset=x)
    with pytest.raises(ValueError, match="offset.*label_smoothing=0.1"):
        PL.preference_loss(x, x, x, x, label_smoothing=0.1, offset=x)
    with pytest.raises(ValueError, match="offset.*label_smoothing"):
        jax.jit(lambda e: PL.preference_loss(x, x, x, x, label_smoothing=e, offset=x))(0.0)
    with pytest.raises(AssertionError):
        PL.preference_loss(x, x, x, x, offset=x[:2])


def test_bad_arguments():
    x = jnp.zeros(3)
    with pytest.raises(ValueError, match="loss_type"):
        PL.preference_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match="lengths"):
        PL.preference_loss(x, x, x, x, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing"):
        PL.preference_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(AssertionError):
        PL.preference_loss(x, x[:2], x, x)
