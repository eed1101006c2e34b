"""rljax's optimizer (rljax.adamw.ClippedAdamW): optax's clip + AdamW, and its fused guarded step.

- ``init``/``update`` are optax's own (same state, same updates).
- ``guarded_step`` equals optax's update then ``apply_updates`` to float32 rounding, eager and jitted,
  over several steps, with and without clipping (the clip triggered and not), weight decay, warm-up.
- A refused step (``ok`` False, or a NaN/inf learning rate) leaves every array bitwise as it was.
- Through ``apply_update`` (what the trainers call), ``make_optimizer``'s optimizer takes the fused
  path and gives optax's step; a NaN learning rate is refused with code 2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rljax.adamw import ClippedAdamW
from rljax.models.config import ModelConfig
from rljax.models.transformer import init_model
from rljax.run_config import OptimSection
from rljax.update import apply_update, learning_rate_schedule, make_optimizer

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 600, dtype=jnp.float32).reshape(20, 30), "b": jnp.arange(7, dtype=jnp.float32)}


def _grads(scale):
    return jax.tree.map(lambda x: scale * (jnp.sin(3.0 * x) + 0.5), PARAMS)


def _reference(grad_clip, weight_decay, schedule):
    adamw = optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=weight_decay)
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw) if grad_clip is not None else adamw


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


CASES = [  # (grad_clip, weight_decay, gradient scale): scale 10 triggers the clip at 1.0, 0.01 does not
    (1.0, 0.0, 10.0), (1.0, 0.1, 0.01), (None, 0.0, 1.0), (None, 0.05, 1.0)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("grad_clip,weight_decay,scale", CASES)
def test_guarded_step_equals_optax_update_then_apply(grad_clip, weight_decay, scale, jit):
    schedule = optax.join_schedules([optax.linear_schedule(0.0, 1e-2, 2), optax.constant_schedule(1e-2)], [2])
    opt = ClippedAdamW.create(schedule, grad_clip=grad_clip, b1=0.9, b2=0.99, weight_decay=weight_decay)
    ref = _reference(grad_clip, weight_decay, schedule)
    step = jax.jit(opt.guarded_step) if jit else opt.guarded_step
    p, s = PARAMS, opt.init(PARAMS)
    want_p, want_s = PARAMS, ref.init(PARAMS)
    assert jax.tree.structure(s) == jax.tree.structure(want_s)  # the state is optax's
    for i in range(4):  # the warm-up's first learning rate is 0: the parameters move from step 2 on
        grads = _grads(scale * (1 + i))
        p, s, finite = step(grads, s, p, jnp.asarray(True))
        updates, want_s = ref.update(grads, want_s, want_p)
        want_p = optax.apply_updates(want_p, updates)
        assert bool(finite)
        # float32 rounding: XLA contracts a * b + c into fused multiply-adds differently in the two
        # programs (rljax.adamw's docstring), and the differences carry over steps through the
        # moments. Measured over these 4 steps: parameters within 4 ulp, or 2e-8 (2e-6 of the
        # learning rate, each step's size) where one crossed zero; moments within 1.3e-9 absolute
        # where (1 - b1) g and b1 m nearly cancel.
        for got, want in zip(_leaves(p), _leaves(want_p)):
            np.testing.assert_allclose(got, want, rtol=5e-7, atol=5e-8)
        for got, want in zip(_leaves(s), _leaves(want_s)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    assert int(s[1][0].count if grad_clip is not None else s[0].count) == 4
    assert max(np.abs(a - b).max() for a, b in zip(_leaves(p), _leaves(PARAMS))) > 1e-2  # it moved


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_refused_step_leaves_everything_bitwise(jit):
    opt = ClippedAdamW.create(1e-2, grad_clip=1.0, weight_decay=0.1)
    s0 = opt.init(PARAMS)
    p1, s1, _ = opt.guarded_step(_grads(1.0), s0, PARAMS, jnp.asarray(True))  # a state with non-zero moments
    step = jax.jit(opt.guarded_step) if jit else opt.guarded_step
    p2, s2, finite = step(_grads(3.0), s1, p1, jnp.asarray(False))
    assert bool(finite)  # the step itself was fine; the caller said no
    for got, want in zip(_leaves((p2, s2)), _leaves((p1, s1))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("learning_rate", [float("nan"), float("inf")])
def test_a_step_that_would_make_parameters_non_finite_is_refused(learning_rate):
    opt = ClippedAdamW.create(lambda count: jnp.asarray(learning_rate, jnp.float32), grad_clip=1.0, weight_decay=0.0)
    s = opt.init(PARAMS)
    p, s2, finite = jax.jit(opt.guarded_step)(_grads(1.0), s, PARAMS, jnp.asarray(True))
    assert not bool(finite)
    for got, want in zip(_leaves((p, s2)), _leaves((PARAMS, s))):
        np.testing.assert_array_equal(got, want)


CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
IDS = jnp.asarray([[3, 4, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12]])
MASK = jnp.asarray([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


def _loss(model, batch):
    logp = jax.nn.log_softmax(model(batch["ids"], batch["mask"])[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, batch["ids"][:, 1:, None], axis=-1)[..., 0]
    return -(picked * batch["mask"][:, 1:]).sum(), {}


@pytest.mark.parametrize("learning_rate", [1e-2, float("nan")])
def test_apply_update_takes_the_fused_step_of_make_optimizer(learning_rate):
    cfg = OptimSection(learning_rate=learning_rate, grad_clip=1.0, weight_decay=0.1, warmup_steps=0)
    optimizer = make_optimizer(cfg, 10)
    assert isinstance(optimizer, ClippedAdamW)
    # the same optimizer as a plain optax chain takes apply_update's generic path (lax.cond guard)
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate_schedule(cfg, 10),
                                                                          weight_decay=0.1))
    graphdef, params, frozen = nnx.split(init_model(CFG, seed=0), nnx.Param, ...)
    batch = {"ids": IDS, "mask": MASK}

    def step(opt):
        run = jax.jit(functools.partial(apply_update, graphdef, loss_fn=_loss, totals={}, optimizer=opt, num_micro=1))
        return run(params, frozen, opt.init(params), batch)

    new_params, new_opt_state, metrics = step(optimizer)
    want_params, want_opt_state, want_metrics = step(reference)
    assert float(metrics["nonfinite"]) == float(want_metrics["nonfinite"]) == (2.0 if learning_rate != learning_rate
                                                                               else 0.0)
    assert float(metrics["grad_norm"]) == float(want_metrics["grad_norm"])
    if learning_rate != learning_rate:  # NaN: refused, nothing written
        for got, want in zip(_leaves((new_params, new_opt_state)), _leaves((params, optimizer.init(params)))):
            np.testing.assert_array_equal(got, want)
        return
    assert jax.tree.structure(new_opt_state) == jax.tree.structure(want_opt_state)
    for got, want in zip(_leaves(new_params), _leaves(want_params)):
        np.testing.assert_allclose(got, want, rtol=5e-7, atol=5e-8)
    for got, want in zip(_leaves(new_opt_state), _leaves(want_opt_state)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    assert max(np.abs(a - b).max() for a, b in zip(_leaves(new_params), _leaves(params))) > 1e-3  # it moved
