"""The shared optimizer step (rljax.update.apply_update) and the layer loop it differentiates.

- A finite step equals a hand-written value_and_grad + optax AdamW step.
- A NaN loss leaves the parameters and the AdamW state exactly as they were and flags it; so does a
  finite loss whose step would make a parameter NaN/inf (NaN or inf learning rate).
- Unrolled layers (the default) and ``scan_layers=True`` give the same logits and gradients,
  and LoRA copies keep the setting.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rljax.models import load
from rljax.models.config import ModelConfig
from rljax.models.lora import add_lora
from rljax.models.tiny import make_tiny_model_dir
from rljax.models.transformer import init_model
from rljax.run_config import OptimSection
from rljax.update import (NonFiniteLossError, apply_update, learning_rate_schedule, raise_if_nonfinite,
                          schedule_length)

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8)
IDS = jnp.asarray([[3, 4, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12]])
MASK = jnp.asarray([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


def _loss(model, batch, *, scale):
    logits = model(batch["ids"], batch["mask"])
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, batch["ids"][:, 1:, None], axis=-1)[..., 0]
    return -(picked * batch["mask"][:, 1:]).sum() * scale, {"tokens": batch["mask"].sum().astype(jnp.float32)}


def _setup(scale):
    graphdef, params, frozen = nnx.split(init_model(CFG, seed=0), nnx.Param, ...)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    opt_state = optimizer.init(params)
    step = jax.jit(functools.partial(apply_update, graphdef, loss_fn=functools.partial(_loss, scale=scale),
                                     totals={}, optimizer=optimizer, num_micro=1))
    return graphdef, params, frozen, optimizer, opt_state, step


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_finite_step_equals_value_and_grad_then_adamw():
    graphdef, params, frozen, optimizer, opt_state, step = _setup(scale=1.0)
    batch = {"ids": IDS, "mask": MASK}
    new_params, new_opt_state, metrics = step(params, frozen, opt_state, batch)

    # The reference is jitted too. Against an eager reference the gradients differ by XLA's float32
    # reassociation (8e-5 on embed entries of up to 78, 1.1e-7 on a w_gate entry of 2e-5), and AdamW's
    # first step, g / (|g| + eps), turns a tiny gradient's relative error into a parameter error:
    # that entry moved 7.6e-6 apart, 1.85x this tolerance, once attention went head-major. Jitted, the
    # worst entry is at 1% of it: what differs then is apply_update's wiring, which is what this tests.
    @jax.jit
    def reference(params, opt_state):
        value, grads = jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p, frozen), batch, scale=1.0)[0])(params)
        updates, want_opt_state = optimizer.update(grads, opt_state, params)
        return value, grads, optax.apply_updates(params, updates), want_opt_state

    value, grads, want_params, want_opt_state = reference(params, opt_state)
    for got, want in zip(_leaves(new_params) + _leaves(new_opt_state), _leaves(want_params) + _leaves(want_opt_state)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(metrics["nonfinite"]) == 0.0
    np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(_leaves(new_params), _leaves(params)))  # it moved


def test_a_nan_loss_leaves_parameters_and_optimizer_state_unchanged():
    graphdef, params, frozen, optimizer, opt_state, step = _setup(scale=float("nan"))
    before = _leaves(params) + _leaves(opt_state)
    new_params, new_opt_state, metrics = step(params, frozen, opt_state, {"ids": IDS, "mask": MASK})
    assert float(metrics["nonfinite"]) == 1.0
    for got, want in zip(_leaves(new_params) + _leaves(new_opt_state), before):
        np.testing.assert_array_equal(got, want)


def test_unrolled_and_scanned_layers_agree_in_logits_and_gradients():
    # an algebraic equality, checked in float64 (the same on every host to ~1e-15)
    with jax.enable_x64(True):
        _check_unrolled_and_scanned_layers_agree()


def _check_unrolled_and_scanned_layers_agree():
    f64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}
    unrolled = init_model(CFG, seed=0, **f64)
    scanned = init_model(CFG, seed=0, scan_layers=True, **f64)
    assert not unrolled.scan_layers and scanned.scan_layers
    assert unrolled(IDS, MASK).dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(scanned(IDS, MASK)), np.asarray(unrolled(IDS, MASK)), rtol=1e-10, atol=1e-12)

    def grads(model):
        graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
        return jax.grad(lambda p: _loss(nnx.merge(graphdef, p, frozen), {"ids": IDS, "mask": MASK}, scale=1.0)[0])(
            params)

    for got, want in zip(_leaves(grads(scanned)), _leaves(grads(unrolled))):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12 * float(np.abs(want).max()))
    assert add_lora(scanned, rank=2).scan_layers and not add_lora(unrolled, rank=2).scan_layers


def test_unrolling_removes_the_layer_loop_from_the_program():
    def while_loops(model):
        graphdef, state = nnx.split(model)
        hlo = jax.jit(lambda s: nnx.merge(graphdef, s)(IDS, MASK)).lower(state).as_text()
        return hlo.count("stablehlo.while")

    assert while_loops(init_model(CFG, seed=0, scan_layers=True)) == 1
    assert while_loops(init_model(CFG, seed=0)) == 0


def test_load_sets_the_layer_loop(tmp_path):
    make_tiny_model_dir(str(tmp_path))
    assert load(str(tmp_path))[0].scan_layers is False
    assert load(str(tmp_path), scan_layers=True)[0].scan_layers is True


@functools.lru_cache(maxsize=1)
def _step_with_learning_rate_in_state():
    """One compiled update whose AdamW learning rate is optimizer state (optax.inject_hyperparams)."""
    graphdef, params, frozen = nnx.split(init_model(CFG, seed=0), nnx.Param, ...)
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1)
    step = jax.jit(functools.partial(apply_update, graphdef, loss_fn=functools.partial(_loss, scale=1.0),
                                     totals={}, optimizer=optimizer, num_micro=1))
    return params, frozen, optimizer, step


@pytest.mark.parametrize("learning_rate", [float("nan"), float("inf")])
def test_an_update_that_would_make_parameters_non_finite_is_refused(learning_rate):
    # A finite loss and gradient, but a NaN/inf learning rate: before the parameter check the NaN
    # step was applied (the run then logged loss 0.0 and died at "refusing to checkpoint").
    params, frozen, optimizer, step = _step_with_learning_rate_in_state()
    opt_state = optimizer.init(params)
    opt_state.hyperparams["learning_rate"] = jnp.asarray(learning_rate, jnp.float32)
    before = _leaves(params) + _leaves(opt_state)
    new_params, new_opt_state, metrics = step(params, frozen, opt_state, {"ids": IDS, "mask": MASK})
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["nonfinite"]) == 2.0
    for got, want in zip(_leaves(new_params) + _leaves(new_opt_state), before):
        np.testing.assert_array_equal(got, want)
    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
    with pytest.raises(NonFiniteLossError, match=r"step 7: the update would make the parameters non-finite"):
        raise_if_nonfinite(host, 7)
    # the same compiled update with a finite learning rate applies the step
    opt_state.hyperparams["learning_rate"] = jnp.asarray(1e-2, jnp.float32)
    moved, _, metrics = step(params, frozen, opt_state, {"ids": IDS, "mask": MASK})
    assert float(metrics["nonfinite"]) == 0.0
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(_leaves(moved), _leaves(params)))


def test_raise_if_nonfinite_names_the_cause():
    raise_if_nonfinite(ok := {"loss": 1.0, "grad_norm": 2.0, "nonfinite": 0.0}, 3)
    assert "nonfinite" not in ok  # popped, not logged
    with pytest.raises(NonFiniteLossError, match=r"step 3: the loss or gradient is not finite \(loss=nan"):
        raise_if_nonfinite({"loss": float("nan"), "grad_norm": 2.0, "nonfinite": 1.0}, 3)
    with pytest.raises(NonFiniteLossError, match="learning_rate"):
        raise_if_nonfinite({"loss": 1.0, "grad_norm": 2.0, "nonfinite": 2.0}, 3)


def test_learning_rate_schedule_warms_up_then_decays():
    # warm-up 2 then linear decay to 0 over the 8 updates after it: rate of update count+1
    cfg = OptimSection(learning_rate=0.1, warmup_steps=2, schedule="linear")
    lr = learning_rate_schedule(cfg, schedule_length(cfg, 10))
    np.testing.assert_allclose([float(lr(c)) for c in (0, 1, 2, 6, 10)], [0.0, 0.05, 0.1, 0.05, 0.0], atol=1e-7)
    const = OptimSection(learning_rate=0.1)
    assert schedule_length(const, 10) == schedule_length(const, 1000) == 1
