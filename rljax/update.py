"""The one optimizer step every trainer takes: exact gradient accumulation, a non-finite guard, AdamW.

    new_params, new_opt_state, metrics = apply_update(
        graphdef, params, frozen, opt_state, batch, loss_fn=loss_fn, totals=totals,
        optimizer=optimizer, num_micro=4)

Called inside the trainers' jitted, donated updates (``rljax.training.online.update_epochs``: every
update of an online step in one call, policy and critic; ``rljax.training.offline.offline_update``),
which pick the algorithm's loss and its static settings (the algorithm's config section). ``loss_fn(model, micro_batch, **totals)`` returns ``(loss, metrics)``;
``totals`` are the whole batch's denominators (token, sequence or pair counts), so each
micro-batch's loss is a share of the batch loss and the summed gradient equals the whole batch's
(the "global denominator" rule of ``rljax.losses.reduce``).

Also here: ``make_optimizer`` / ``optimizer_for`` (AdamW with warm-up, decay and clipping; the latter
cached, so equal settings share compiled updates) and ``NonFiniteLossError``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class NonFiniteLossError(RuntimeError):
    """The loss or gradient became NaN/inf, or the update would have made a parameter NaN/inf
    (e.g. ``learning_rate: nan``, a diverging step); the update was not applied.

    ``updates_applied``: how many of the step's earlier updates were (0 for a one-update step, or
    when the first update was refused): the state is then the step's starting state only if 0.
    """

    def __init__(self, message: str, *, updates_applied: int = 0):
        super().__init__(message)
        self.updates_applied = updates_applied


def learning_rate_schedule(cfg, total_steps: int) -> optax.Schedule:
    """The learning rate of update ``count + 1`` as a function of ``count`` (updates done): warm-up,
    then constant / cosine / linear decay over ``total_steps`` updates (``make_optimizer``'s)."""
    lr = cfg.learning_rate
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps)
    else:
        after = optax.linear_schedule(lr, 0.0, decay_steps)
    return (optax.join_schedules([optax.linear_schedule(0.0, lr, cfg.warmup_steps), after], [cfg.warmup_steps])
            if cfg.warmup_steps else after)


def make_optimizer(cfg, total_steps: int) -> optax.GradientTransformation:
    """AdamW with warm-up then constant / cosine / linear decay, after global-norm clipping.

    ``cfg`` is an ``rljax.run_config.OptimSection``; ``total_steps`` counts optimizer updates.
    """
    schedule = learning_rate_schedule(cfg, total_steps)
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip is not None else []
    chain.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
    return optax.chain(*chain)


def optimizer_for(cfg, total_steps: int) -> optax.GradientTransformation:
    """``make_optimizer``, one object per (settings, schedule length).

    The optimizer is a static argument of the jitted updates, so trainers with equal settings (a
    resumed run, a sweep, the tests) reuse one compiled update. A constant schedule without
    warm-up ignores the length.
    """
    return _cached_optimizer(cfg, schedule_length(cfg, total_steps))


def schedule_length(cfg, total_steps: int) -> int:
    """The schedule length ``optimizer_for`` builds its optimizer with (at least the warm-up + 1;
    one length for every constant schedule)."""
    if cfg.schedule == "constant":
        return cfg.warmup_steps + 1
    return max(total_steps, cfg.warmup_steps + 1)


@functools.lru_cache(maxsize=16)
def _cached_optimizer(cfg, total_steps: int) -> optax.GradientTransformation:
    return make_optimizer(cfg, total_steps)


def apply_update(graphdef, params, frozen, opt_state, batch: dict[str, jax.Array], *,
                 loss_fn: Callable[..., tuple[jax.Array, dict[str, jax.Array]]], totals: dict[str, Any],
                 optimizer: optax.GradientTransformation, num_micro: int, skip: jax.Array | bool = False):
    """One optimizer step on ``batch`` split into ``num_micro`` micro-batches (traceable; call under jit).

    Every leaf of ``batch`` has the rows on axis 0, a multiple of ``num_micro``. Gradients,
    the loss and the metrics are accumulated in ``lax.scan`` from zeros (one traced copy of the
    forward/backward pass). Metrics whose names end in ``loss`` are normalised by ``totals`` and so
    add up over micro-batches; the others (clip fractions, accuracies, means) are micro-batch
    means, averaged. A non-finite loss or gradient norm leaves ``params`` and ``opt_state``
    unchanged and sets ``metrics['nonfinite'] = 1``; so does an update that would make any
    parameter non-finite (a NaN/inf learning rate, an overflowing step), with
    ``metrics['nonfinite'] = 2``. The trainer then stops with ``NonFiniteLossError``. ``skip``
    (a traced bool) refuses the update whatever its values: ``update_epochs`` ends a step's updates
    at the first refused one.

    Returns ``(new_params, new_opt_state, metrics)``; metrics add ``loss``, ``grad_norm`` (before
    clipping) and ``nonfinite``.
    """
    micro = jax.tree.map(lambda x: x.reshape(num_micro, x.shape[0] // num_micro, *x.shape[1:]), batch)

    def micro_grad(p, mb):
        def f(p):
            return loss_fn(nnx.merge(graphdef, p, frozen), mb, **totals)
        (value, metrics), grads = jax.value_and_grad(f, has_aux=True)(p)
        return value, metrics, grads

    first = jax.tree.map(lambda x: x[0], micro)
    if num_micro == 1:
        value, metrics, grads = micro_grad(params, first)
    else:
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(micro_grad, params, first))
        weight = {k: 1.0 if k.endswith("loss") else 1.0 / num_micro for k in zeros[1]}

        def body(acc, mb):
            value, metrics, grads = micro_grad(params, mb)
            acc_value, acc_metrics, acc_grads = acc
            return (acc_value + value, {k: acc_metrics[k] + weight[k] * metrics[k] for k in metrics},
                    jax.tree.map(jnp.add, acc_grads, grads)), None

        (value, metrics, grads), _ = jax.lax.scan(body, zeros, micro)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
    updates, stepped_opt_state = optimizer.update(grads, opt_state, params)
    # The parameters the step would write, checked before it is applied: one fused all-isfinite
    # reduction over p + u (as optax.apply_updates computes it, in the parameter dtype), with no new
    # parameter copy. A finite gradient and a finite AdamW state give a finite new AdamW state, so
    # the parameters are what a NaN/inf learning rate or an overflowing step first spoils.
    params_finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite((p + u).astype(p.dtype)))
                                         for p, u in zip(jax.tree.leaves(params), jax.tree.leaves(updates))]))

    def step(state):
        p, _, u, o = state
        return optax.apply_updates(p, u), o

    # lax.cond, not jnp.where over every leaf: the where re-read the old parameters and AdamW state
    # (SmolLM2-135M GRPO update on the 2-core CPU: 5.0 s with it, 4.75 s with the cond, as without a guard).
    new_params, new_opt_state = jax.lax.cond(finite & params_finite & ~jnp.asarray(skip), step, lambda state: state[:2],
                                             (params, opt_state, updates, stepped_opt_state))
    # 0: applied; 1: the loss or gradient is not finite; 2: the parameters would not be finite
    nonfinite = jnp.where(finite, jnp.where(params_finite, 0.0, 2.0), 1.0).astype(jnp.float32)
    metrics = {**metrics, "loss": value, "grad_norm": grad_norm, "nonfinite": nonfinite}
    return new_params, new_opt_state, metrics


def raise_if_nonfinite(metrics: dict[str, float], step: int) -> None:
    """Pop ``metrics['nonfinite']`` (and ``updates_applied``, when a step makes several updates) and
    raise ``NonFiniteLossError`` if an update was refused (1: the loss or gradient is not finite;
    2: the parameters would have become non-finite)."""
    code = metrics.pop("nonfinite")
    applied = int(metrics.pop("updates_applied", 0))
    if code >= 2:
        raise NonFiniteLossError(updates_applied=applied, message=
            f"step {step}: the update would make the parameters non-finite (NaN/inf) although the loss and "
            f"gradient are finite (loss={metrics['loss']}, grad_norm={metrics['grad_norm']}): check "
            "optim.learning_rate and the schedule, or lower the learning rate / set optim.grad_clip if the "
            "step diverges; the update was not applied")
    if code > 0:
        raise NonFiniteLossError(updates_applied=applied, message=(
            f"step {step}: the loss or gradient is not finite (loss={metrics['loss']}, "
            f"grad_norm={metrics['grad_norm']}); the update was not applied"))


__all__ = ["NonFiniteLossError", "apply_update", "learning_rate_schedule", "make_optimizer", "optimizer_for",
           "raise_if_nonfinite", "schedule_length"]
