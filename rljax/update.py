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

Also here: ``make_optimizer`` / ``optimizer_for`` (AdamW with warm-up, decay and clipping,
``rljax.adamw.ClippedAdamW``, whose guarded step runs fused and in place; the latter cached, so equal
settings share compiled updates), ``with_master_weights`` (mixed precision: a float32
master copy of bfloat16 parameters, ``optim.master_dtype``) and ``NonFiniteLossError``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rljax.adamw import ClippedAdamW
from rljax.sharding import constrain_state


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


class MasterWeightsState(NamedTuple):
    """The state of :func:`with_master_weights`: ``master``, the parameters in the master dtype
    (shaped and sharded like the working parameters), and ``inner``, the wrapped optimizer's state
    over them (AdamW's moments in the master dtype)."""

    master: Any
    inner: Any


def with_master_weights(optimizer: optax.GradientTransformation, master_dtype=jnp.float32
                        ) -> optax.GradientTransformation:
    """``optimizer`` run on a ``master_dtype`` copy of the parameters; the working parameters (e.g.
    bfloat16, what the forward and backward passes read) are the master rounded after each update.

        init(p):         m_0 = cast(p, master_dtype);  s_0 = optimizer.init(m_0)
        update(g, s, p): u', s' = optimizer.update(cast(g, master_dtype), s, m);  m' = m + u'
                         updates = cast(round(m'), master_dtype) - cast(p, master_dtype)

    so ``p + updates`` (``optax.apply_updates``: summed in the master dtype, then cast to p's) is
    ``round(m')``, the master rounded to the parameters' dtype. That difference is exact in float32
    whenever the old and new bfloat16 values are within 2^15 of each other in magnitude; ``apply_update``
    does not rely on it and writes ``round(m')`` itself (:func:`master_params`).

    Why: a bfloat16 weight has 8 significant bits, so an AdamW step ``lr * m_hat / sqrt(v_hat)`` below
    half its ulp (at lr 1e-6 and a weight of magnitude 0.01, the step is ~1e-6 against an ulp of 6e-5)
    rounds away to nothing on every step and the weight never moves; the float32 master keeps the
    sum of those steps until it crosses a rounding boundary of the bfloat16 weight. The moments live
    in ``master_dtype`` too (``optimizer.init`` sees the master), and ``v``, a running mean of squared
    gradients, needs float32's range and precision. This is the mixed-precision recipe of
    Micikevicius et al. 2018 (arXiv:1710.03740, "FP32 master copy of weights"), without loss scaling:
    bfloat16 has float32's exponent range, so gradients do not underflow.

    Memory per parameter: 2 bytes (bfloat16 working copy) + 4 (master) + 8 (two float32 moments) =
    14 bytes, against 12 for float32 parameters with float32 AdamW and 6 for bfloat16 throughout
    (whose updates below the ulp are lost). ``update`` needs ``params``.
    """
    master_dtype = jnp.dtype(master_dtype)

    def to_master(tree):
        return jax.tree.map(lambda x: x.astype(master_dtype), tree)

    def init(params):
        master = to_master(params)
        return MasterWeightsState(master, optimizer.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("with_master_weights: update needs the working parameters (params=...)")
        inner_updates, inner = optimizer.update(to_master(grads), state.inner, state.master)
        master = optax.apply_updates(state.master, inner_updates)
        updates = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(master_dtype) - p.astype(master_dtype),
                               master, params)
        return updates, MasterWeightsState(master, inner)

    return optax.GradientTransformation(init, update)


def master_params(opt_state, params):
    """The working parameters a master-weights state holds: its master rounded to ``params``'
    dtypes (:func:`with_master_weights`); None when ``opt_state`` keeps no master copy."""
    if not isinstance(opt_state, MasterWeightsState):
        return None
    return jax.tree.map(lambda m, p: m.astype(p.dtype), opt_state.master, params)


def make_optimizer(cfg, total_steps: int) -> optax.GradientTransformation:
    """AdamW with warm-up then constant / cosine / linear decay, after global-norm clipping
    (``rljax.adamw.ClippedAdamW``: optax's transformations, whose guarded step ``apply_update`` runs
    fused); with ``cfg.master_dtype`` set, all of it on a master copy of the parameters
    (:func:`with_master_weights`).

    ``cfg`` is an ``rljax.run_config.OptimSection``; ``total_steps`` counts optimizer updates.
    """
    optimizer = ClippedAdamW.create(learning_rate_schedule(cfg, total_steps), grad_clip=cfg.grad_clip, b1=cfg.b1,
                                    b2=cfg.b2, weight_decay=cfg.weight_decay)
    master_dtype = getattr(cfg, "master_dtype", None)
    return with_master_weights(optimizer, jnp.dtype(master_dtype)) if master_dtype else optimizer


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
        # bfloat16 gradients are summed in float32: a bfloat16 sum of many micro-batches rounds each
        # addition to 8 significant bits (float32 gradients are summed as they are)
        value0, metrics0, grads0 = jax.eval_shape(micro_grad, params, first)
        zeros = (*jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (value0, metrics0)),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32)), grads0))
        weight = {k: 1.0 if k.endswith("loss") else 1.0 / num_micro for k in zeros[1]}

        def body(acc, mb):
            value, metrics, grads = micro_grad(params, mb)
            acc_value, acc_metrics, acc_grads = acc
            return (acc_value + value, {k: acc_metrics[k] + weight[k] * metrics[k] for k in metrics},
                    jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc_grads, grads)), None

        (value, metrics, grads), _ = jax.lax.scan(body, zeros, micro)
        if not isinstance(opt_state, MasterWeightsState):
            # an optimizer on the parameters themselves keeps its state in their dtype
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
    if isinstance(optimizer, ClippedAdamW):
        # rljax's optimizer (make_optimizer): the same step and check, fused and in place (rljax.adamw)
        new_params, new_opt_state, params_finite = optimizer.guarded_step(
            grads, opt_state, params, finite & ~jnp.asarray(skip), grad_norm=grad_norm)
    else:
        new_params, new_opt_state, params_finite = _guarded_optax_step(optimizer, grads, opt_state, params,
                                                                        finite & ~jnp.asarray(skip))
    # 0: applied; 1: the loss or gradient is not finite; 2: the parameters would not be finite
    nonfinite = jnp.where(finite, jnp.where(params_finite, 0.0, 2.0), 1.0).astype(jnp.float32)
    metrics = {**metrics, "loss": value, "grad_norm": grad_norm, "nonfinite": nonfinite}
    # the new state keeps the parameters' sharding (rljax.sharding.constrain_state: unconstrained, a
    # GPU partitioner returned it replicated on every device)
    return constrain_state(new_params), constrain_state(new_opt_state), metrics


def _guarded_optax_step(optimizer, grads, opt_state, params, ok):
    """Any optax optimizer's step, applied where ``ok`` and the new parameters are finite:
    ``(new_params, new_opt_state, params_finite)``."""
    updates, stepped_opt_state = optimizer.update(grads, opt_state, params)
    # The parameters the step would write, checked before it is applied: one fused all-isfinite
    # reduction over p + u (as optax.apply_updates computes it, in the parameter dtype), with no new
    # parameter copy. A finite gradient and a finite optimizer state give a finite new state, so
    # the parameters are what a NaN/inf learning rate or an overflowing step first spoils. With a
    # master copy (with_master_weights) the new parameters are the new master rounded, exactly.
    rounded = master_params(stepped_opt_state, params)
    written = (jax.tree.leaves(rounded) if rounded is not None else
               [(p + u).astype(p.dtype) for p, u in zip(jax.tree.leaves(params), jax.tree.leaves(updates))])
    params_finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in written]))

    def step(state):
        p, _, u, o = state
        from_master = master_params(o, p)
        return (optax.apply_updates(p, u) if from_master is None else from_master), o

    # lax.cond, not jnp.where over every leaf: the where re-read the old parameters and optimizer
    # state (docs/performance.md#smaller-things).
    new_params, new_opt_state = jax.lax.cond(ok & params_finite, step, lambda state: state[:2],
                                             (params, opt_state, updates, stepped_opt_state))
    return new_params, new_opt_state, params_finite


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


__all__ = ["MasterWeightsState", "NonFiniteLossError", "apply_update", "learning_rate_schedule", "make_optimizer",
           "master_params", "optimizer_for", "raise_if_nonfinite", "schedule_length", "with_master_weights"]
