"""One step's updates in one jitted call (rljax.training.online.update_epochs) against the Python loop
it replaced: for each of ``num_iterations`` passes a permutation ``permutation(fold_in(key, pass), R)``,
for each mini-batch one jitted ``apply_update`` of the policy (and one of PPO's separate critic).

- GRPO (2 passes x 2 mini-batches x 2 micro-batches) and PPO with a separate critic give the loop's
  parameters, optimizer states and per-update metrics (in float64, the equalities' dtype).
- A NaN in one mini-batch refuses that update and every later one of the step (the state is the one
  before it, so a non-finite stop knows what it holds): the loop's, which stopped applying there.
- Steps of equal shapes share one compiled program.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import rng
from rljax.algorithms import get as get_algorithm
from rljax.algorithms.policy_gradient import totals as rollout_totals
from rljax.training import OnlineTrainer
from rljax.training.online import (mean_update_metrics, rollout_batch, score_logprobs, score_values, update_epochs,
                                   update_trace_count)
from rljax.update import apply_update


def _trainer(tiny_run_config, run_dir, algo, extra="", num_iterations=2, dtype="float32"):
    # 16 rows a step: 2 mini-batches of 8 rows, each 2 micro-batches of 4. float64 needs jax.enable_x64.
    return OnlineTrainer(tiny_run_config(
        run_dir, model={"dtype": dtype}, train={"steps": 4}, rewards={"length": 1.0},
        algorithm=f"{{name: {algo}, num_iterations: {num_iterations}, mini_batches: 2, micro_batch_size: 4, "
                  f"kl_coef: 0.01 {extra}}}"))


def _batch(trainer):
    """The first step's batch, as ``OnlineTrainer.step_once`` builds it."""
    a, run = trainer.cfg.algorithm, trainer.run
    roll, _ = trainer.rollouts(rng.step_key(trainer.sample_stream, run.step))
    batch = rollout_batch(roll, mask_truncated=False)
    if trainer.algorithm.needs_reference(a):
        batch = batch.replace(ref_logprobs=score_logprobs(run.policy.graphdef, run.reference(), run.policy.frozen,
                                                          batch, temperature=trainer.cfg.sampling.temperature))
    if trainer.algorithm.value_head(a) is not None:
        values_of = run.critic if run.critic is not None else run.policy
        batch = batch.replace(old_values=score_values(*values_of.split, batch))
    return trainer.algorithm.advantages(batch, a)


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "algorithm", "cfg", "temperature", "num_micro",
                                             "critic"), donate_argnames=("params", "opt_state"))
def _one_update(graphdef, params, frozen, opt_state, batch, *, optimizer, algorithm, cfg, temperature, num_micro,
                critic=False):
    """One optimizer step of the policy (or, ``critic=True``, of the separate critic) on a mini-batch:
    the update the old loop jitted and called once per mini-batch."""
    algo = get_algorithm(algorithm)
    loss_fn = (functools.partial(algo.critic_loss, cfg=cfg) if critic
               else functools.partial(algo.loss, cfg=cfg, temperature=temperature))
    return apply_update(graphdef, params, frozen, opt_state, batch, loss_fn=loss_fn, totals=rollout_totals(batch),
                        optimizer=optimizer, num_micro=num_micro)


def _copy(tree):
    # The updates donate their parameters and optimizer state: each version gets its own copy.
    return jax.tree.map(jnp.copy, tree)


def _loop(trainer, batch):
    """The Python loop ``OnlineTrainer.update_epochs`` ran before the one-call version."""
    a, run = trainer.cfg.algorithm, trainer.run
    p, c = run.policy, run.critic
    params, opt_state = _copy((p.params, p.opt_state))
    critic = None if c is None else _copy((c.params, c.opt_state))
    rows = batch.num_rows
    mb_rows = rows // a.mini_batches
    perm_key = rng.step_key(rng.stream(trainer.cfg.train.seed, "minibatch"), run.step)
    updates, halted = [], False
    for it in range(a.num_iterations):
        order = np.asarray(jax.random.permutation(jax.random.fold_in(perm_key, it), rows)) \
            if a.mini_batches > 1 else np.arange(rows)
        for m in range(a.mini_batches):
            idx = order[m * mb_rows : (m + 1) * mb_rows]
            mb = jax.tree.map(lambda x: x[idx], batch)
            new_params, new_opt_state, um = _one_update(
                p.graphdef, _copy(params), p.frozen, _copy(opt_state), mb, optimizer=p.optimizer, algorithm=a.name,
                cfg=a, temperature=trainer.cfg.sampling.temperature, num_micro=a.num_micro)
            if not halted:  # after a refused update the loop keeps the state (and still reports metrics)
                params, opt_state = new_params, new_opt_state
            if c is not None:
                cp, co, cm = _one_update(c.graphdef, *critic[:1], c.frozen, critic[1], mb, optimizer=c.optimizer,
                                         algorithm=a.name, cfg=a, temperature=trainer.cfg.sampling.temperature,
                                         num_micro=a.num_micro, critic=True)
                critic = (cp, co)
                renamed = {"loss": "critic/loss", "grad_norm": "critic/grad_norm"}
                um = {**um, **{renamed.get(k, k): v for k, v in cm.items()},
                      "nonfinite": jnp.maximum(um["nonfinite"], cm["nonfinite"])}
            um = dict(um, applied=np.float32(not halted and float(um["nonfinite"]) == 0.0))
            halted = halted or float(um["nonfinite"]) > 0
            updates.append(jax.device_get(um))
    return (params, opt_state), critic, updates


def _one_call(trainer, batch):
    a, run = trainer.cfg.algorithm, trainer.run
    p, c = run.policy, run.critic
    params, opt_state = _copy((p.params, p.opt_state))
    critic = {} if c is None else dict(critic_graphdef=c.graphdef, critic_params=_copy(c.params),
                                       critic_frozen=c.frozen, critic_opt_state=_copy(c.opt_state),
                                       critic_optimizer=c.optimizer)
    perm_key = rng.step_key(rng.stream(trainer.cfg.train.seed, "minibatch"), run.step)
    params, opt_state, critic_params, critic_opt_state, metrics = update_epochs(
        p.graphdef, params, p.frozen, opt_state, batch, perm_key, optimizer=p.optimizer, algorithm=a.name, cfg=a,
        temperature=trainer.cfg.sampling.temperature, num_micro=a.num_micro, num_iterations=a.num_iterations,
        mini_batches=a.mini_batches, **critic)
    return (params, opt_state), (None if c is None else (critic_params, critic_opt_state)), metrics


def _max_diff(got, want):
    diffs = [float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want))
    return max(diffs)


# Exact: the same ops on the same mini-batches (same permutation, same gather); although the scan
# compiles them inside while loops, XLA:CPU gives the loop's results bit for bit (measured max
# |difference| 0 for every parameter, AdamW moment and metric, in float32 and in float64). The check
# runs in float64, where an equality of the same maths holds on every host.
@pytest.mark.parametrize("algo,extra", [("grpo", ""), ("ppo", ", critic: separate")])
def test_one_call_equals_the_python_loop(tiny_run_config, tmp_path, algo, extra):
    with jax.enable_x64(True):
        _one_call_equals_the_python_loop(tiny_run_config, tmp_path, algo, extra)


def _one_call_equals_the_python_loop(tiny_run_config, tmp_path, algo, extra):
    trainer = _trainer(tiny_run_config, tmp_path, algo, extra, dtype="float64")
    assert {str(x.dtype) for x in jax.tree.leaves(trainer.run.policy.params)} == {"float64"}
    a = trainer.cfg.algorithm
    assert (a.num_iterations, a.mini_batches, a.num_micro) == (2, 2, 2)
    batch = _batch(trainer)
    want_policy, want_critic, want_updates = _loop(trainer, batch)
    got_policy, got_critic, got_metrics = _one_call(trainer, batch)

    assert _max_diff(got_policy, want_policy) == 0.0
    assert (got_critic is None) == (want_critic is None) == (algo == "grpo")
    if want_critic is not None:
        assert _max_diff(got_critic, want_critic) == 0.0
    got_metrics = jax.device_get(got_metrics)
    assert set(got_metrics) == set(want_updates[0])
    for k, v in got_metrics.items():
        assert v.shape == (2, 2), k
        np.testing.assert_array_equal(v.reshape(-1), [u[k] for u in want_updates], err_msg=k)
    # The host summary: each metric's mean over the 4 updates, as the loop averaged them.
    summary = mean_update_metrics(got_metrics)
    for k in got_metrics:
        if k not in ("nonfinite", "applied"):
            assert summary[k] == float(np.mean([float(u[k]) for u in want_updates])), k
    assert summary["nonfinite"] == 0.0
    # It trained: the parameters moved.
    assert _max_diff(got_policy[0], trainer.run.policy.params) > 1e-4


def test_a_nan_update_refuses_it_and_every_later_update_of_the_step(tiny_run_config, tmp_path):
    with jax.enable_x64(True):
        _a_nan_update_refuses_it_and_every_later_update_of_the_step(tiny_run_config, tmp_path)


def _a_nan_update_refuses_it_and_every_later_update_of_the_step(tiny_run_config, tmp_path):
    trainer = _trainer(tiny_run_config, tmp_path, "grpo", num_iterations=2, dtype="float64")
    batch = _batch(trainer)
    # advantages spread over the rows: the length reward gave many groups equal rewards, so a mini-batch
    # could have no gradient (in float32 its rounding noise, which AdamW scales up to lr-sized steps, hid that)
    spread = jnp.linspace(-1.0, 1.0, batch.num_rows, dtype=batch.advantages.dtype)
    batch = batch.replace(advantages=(spread[:, None] * batch.loss_mask).astype(batch.advantages.dtype))
    # The NaN row is the first row of pass 0's second mini-batch (the permutation update_epochs
    # draws): update 0 is applied, update 1 is refused, and updates 2 and 3 (pass 1, whose other
    # mini-batch is finite) are refused too, so the state is the one after update 0.
    perm_key = rng.step_key(rng.stream(trainer.cfg.train.seed, "minibatch"), trainer.run.step)
    row = int(jax.random.permutation(jax.random.fold_in(perm_key, 0), batch.num_rows)[batch.num_rows // 2])
    # its old log-probs are NaN: its importance ratio, and so its mini-batch's loss, is NaN
    batch = batch.replace(old_logprobs=batch.old_logprobs.at[row].set(jnp.nan))
    want_policy, _, want_updates = _loop(trainer, batch)
    got_policy, _, got_metrics = _one_call(trainer, batch)

    got_metrics = jax.device_get(got_metrics)
    nonfinite = np.asarray(got_metrics["nonfinite"]).reshape(-1)
    assert nonfinite[:2].tolist() == [0.0, 1.0] and sorted(nonfinite[2:].tolist()) == [0.0, 1.0]
    assert nonfinite.tolist() == [u["nonfinite"] for u in want_updates]
    assert np.asarray(got_metrics["applied"]).reshape(-1).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert _max_diff(got_policy, want_policy) == 0.0
    assert _max_diff(got_policy[0], trainer.run.policy.params) > 1e-4  # update 0 was applied
    summary = mean_update_metrics(got_metrics)
    assert (summary["nonfinite"], summary["updates_applied"]) == (1.0, 1)


def test_steps_of_equal_shapes_compile_once(tiny_run_config, tmp_path):
    # Settings no other test here uses (3 passes), so this test's first call compiles.
    trainer = _trainer(tiny_run_config, tmp_path, "ppo", ", critic: separate", num_iterations=3)
    batch = _batch(trainer)
    before = update_trace_count()
    first = trainer.update_epochs(batch)
    second = trainer.update_epochs(batch)  # new parameters and optimizer states, the same shapes
    assert update_trace_count() - before == 1
    assert first["loss"] != second["loss"] and first["nonfinite"] == second["nonfinite"] == 0.0
