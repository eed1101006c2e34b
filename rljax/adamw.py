"""Global-norm clipping + AdamW, rljax's optimizer: optax's own transformations, plus one guarded step
that writes the new parameters and moments in place.

    opt = ClippedAdamW.create(schedule, grad_clip=1.0, b1=0.9, b2=0.999, weight_decay=0.0)
    state = opt.init(params)                     # optax.chain(clip_by_global_norm, adamw)'s state
    updates, state = opt.update(grads, state, params)               # optax's update, unchanged
    params, state, finite = opt.guarded_step(grads, state, params, ok)   # the trainers' step

``init`` and ``update`` are those of ``optax.chain(optax.clip_by_global_norm(grad_clip),
optax.adamw(schedule, b1, b2, eps, eps_root, weight_decay))`` (no clipping when ``grad_clip`` is
None), so the state, checkpoints and every generic optax use are optax's. ``guarded_step`` is the
same step with ``rljax.update.apply_update``'s non-finite guard folded in (Loshchilov & Hutter 2019,
arXiv:1711.05101, AdamW; Kingma & Ba 2015, Adam):

    g' = g                      if ||g|| < c   else (g / ||g||) · c       (optax's clip_by_global_norm)
    m' = (1 − b1) g' + b1 m;    v' = (1 − b2) g'² + b2 v;    t' = t + 1
    u  = −lr(t) · ( (m'/(1 − b1^t')) / (sqrt(v'/(1 − b2^t') + eps_root) + eps) + wd · p )   (t: updates done)
    finite = all(isfinite(p + u));   written = ok and finite
    p, m, v, t ← (p + u, m', v', t') if written else (p, m, v, t)

what ``optimizer.update`` then ``optax.apply_updates`` give when written, operation for operation;
equal to float32 rounding, not always bitwise: XLA:CPU contracts ``a * b + c`` into one fused
multiply-add inside a fusion (23% of random float32 triples round differently), so two programs
fused differently can differ in a last bit, as optax's own update does from one program to another
(tests/integration/test_adamw.py, eager and jitted, against optax; a refused step leaves every array bitwise).
Why not optax's update and a guard around it: under ``lax.cond`` XLA copied the new moments out of
the taken branch, and a ``jnp.where`` over optax's outputs made it recompute the new moments from
the old ones inside the parameter update after writing them in place, so it copied the old moments
first. Here the check is one read-only pass (p + u reduced to one bool, nothing written), and the
writes select the moments first and compute the parameter update from the *selected* moments, so
every array is read and overwritten in place once: about half the time of the ``lax.cond``-guarded
optax step (see docs/performance.md#the-optimizer-step).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


class ClippedAdamW(NamedTuple):
    """optax's ``clip_by_global_norm`` + ``adamw`` with their hyperparameters kept, so that
    :meth:`guarded_step` can run the same step fused. Build with :meth:`create`; ``init`` and
    ``update`` make it an ``optax.GradientTransformation`` wherever one is expected."""

    init: Callable
    update: Callable
    schedule: Callable[[jax.Array], jax.Array]
    grad_clip: float | None
    b1: float
    b2: float
    eps: float
    eps_root: float
    weight_decay: float

    @classmethod
    def create(cls, schedule, *, grad_clip: float | None, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               eps_root: float = 0.0, weight_decay: float = 1e-4) -> "ClippedAdamW":
        schedule = schedule if callable(schedule) else optax.constant_schedule(schedule)
        adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay)
        chain = optax.chain(optax.clip_by_global_norm(grad_clip), adamw) if grad_clip is not None else adamw
        return cls(chain.init, chain.update, schedule, grad_clip, b1, b2, eps, eps_root, weight_decay)

    def _states(self, state):
        """(adam state, schedule state) inside optax's chain state, and a function that rebuilds the
        chain state around new ones."""
        inner = state[1] if self.grad_clip is not None else state  # (ScaleByAdamState, add_decayed, by_schedule)
        adam, decay, sched = inner

        def rebuild(new_adam, new_sched):
            new_inner = (new_adam, decay, new_sched)
            return (state[0], new_inner) if self.grad_clip is not None else new_inner

        return adam, sched, rebuild

    def guarded_step(self, grads, state, params, ok: jax.Array, grad_norm: jax.Array | None = None
                     ) -> tuple[Any, Any, jax.Array]:
        """``(new_params, new_state, finite)``: the clipped AdamW step applied where ``ok`` (a traced
        bool) and the new parameters would all be finite (``finite``), else ``params`` and ``state``
        unchanged. ``grad_norm``: ``optax.tree.norm(grads)`` when the caller has it (the clip uses
        it; recomputed otherwise). Traceable; call under jit with the state donated."""
        adam, sched, rebuild = self._states(state)
        if self.grad_clip is not None:
            g_norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
            trigger = jnp.squeeze(g_norm < self.grad_clip)
            # optax.clip_by_global_norm's expression, operation for operation
            clip = lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * self.grad_clip)  # noqa: E731
        else:
            clip = lambda t: t  # noqa: E731
        count = optax.safe_increment(adam.count)
        # optax.tree.bias_correction: 1 - decay**count in float32, then cast to the moment's dtype
        bc1, bc2 = 1 - self.b1 ** count, 1 - self.b2 ** count
        step_size = -1 * self.schedule(sched.count)  # optax.scale_by_learning_rate(schedule)
        b1, b2 = self.b1, self.b2

        def moments(g, m, v):
            g = clip(g)
            # optax.tree.update_moment / update_moment_per_elem_norm (order 2 of a real array: g ** 2)
            return (1 - b1) * g + b1 * m, (1 - b2) * (g ** 2) + b2 * v

        def update(m, v, p):
            u = (m / bc1.astype(m.dtype)) / (jnp.sqrt(v / bc2.astype(v.dtype) + self.eps_root) + self.eps)
            if self.weight_decay != 0.0:  # optax.add_decayed_weights skips a zero constant
                u = u + self.weight_decay * p
            u = jnp.array(step_size, dtype=u.dtype) * u  # optax.scale_by_schedule
            return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)  # optax.apply_updates

        leaves, treedef = jax.tree.flatten(params)
        g_l, m_l, v_l = treedef.flatten_up_to(grads), treedef.flatten_up_to(adam.mu), treedef.flatten_up_to(adam.nu)
        # read-only: would every new parameter be finite? (one fused reduction per leaf, nothing written)
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(update(*moments(g, m, v), p)))
                                      for g, m, v, p in zip(g_l, m_l, v_l, leaves)]))
        write = ok & finite
        new_m, new_v, new_p = [], [], []
        for g, m, v, p in zip(g_l, m_l, v_l, leaves):
            m2, v2 = moments(g, m, v)
            m_sel = jnp.where(write, m2.astype(m.dtype), m)  # optax casts mu to mu_dtype (None: its own)
            v_sel = jnp.where(write, v2.astype(v.dtype), v)
            new_m.append(m_sel)
            new_v.append(v_sel)
            # from the selected moments: when written they are m2 and v2; the old ones are not needed
            # after their buffers are overwritten, so XLA writes all three in place
            new_p.append(jnp.where(write, update(m_sel, v_sel, p), p))
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
        new_adam = adam._replace(count=jnp.where(write, count, adam.count), mu=unflat(new_m), nu=unflat(new_v))
        new_sched = sched._replace(count=jnp.where(write, optax.safe_increment(sched.count), sched.count))
        return unflat(new_p), rebuild(new_adam, new_sched), finite


__all__ = ["ClippedAdamW"]
