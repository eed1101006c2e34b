"""Mixed precision: bfloat16 parameters with a float32 master copy (rljax.update.with_master_weights,
``optim.master_dtype``), float32 optimizer state, float32 log-probs from a bfloat16 model.

- Hand-computed: SGD steps of 1e-3 on a bfloat16 weight of 1.0 (half its rounding step below 1.0 is
  2^-9 = 0.00195) are lost without the master (1 - 0.001 rounds back to 1.0, every step) and add up
  with it (after 2 steps the master is 0.998, which rounds to 1 - 2^-8 = 0.99609375; after 10 steps
  0.99, which rounds to 253 * 2^-8 = 0.98828125).
- The trainer's step (``apply_update``) with ``make_optimizer(master_dtype=float32)`` writes exactly the
  master rounded to bfloat16, keeps AdamW's moments in float32, and its first step's master equals a
  float32 AdamW step from the float32-cast parameters with the float32-cast bfloat16 gradient.
- Log-probs, entropies and the loss of a bfloat16 model are float32, equal to the same computation on
  float32-cast logits.
- ``optim.master_dtype`` over float32 parameters is refused, naming the key.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from rljax.config import ConfigError, from_yaml
from rljax.logprobs import chunked_logprobs, completion_logprobs, entropy, token_logprobs
from rljax.models.config import ModelConfig
from rljax.models.transformer import init_model
from rljax.run_config import OptimSection, RunConfig
from rljax.update import MasterWeightsState, apply_update, make_optimizer, master_params, with_master_weights
from tests._processes import xla_flags

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                  head_dim=8)
IDS = jnp.asarray([[3, 4, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12]])
MASK = jnp.asarray([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


def _sgd_steps(optimizer, steps):
    """``steps`` SGD updates with gradient 1 on a bfloat16 weight of 1.0; the weight after each."""
    params = {"w": jnp.ones((), jnp.bfloat16)}
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        updates, state = optimizer.update({"w": jnp.ones((), jnp.bfloat16)}, state, params)
        return optax.apply_updates(params, updates), state

    seen = []
    for _ in range(steps):
        params, state = step(params, state)
        assert params["w"].dtype == jnp.bfloat16
        seen.append(float(params["w"]))
    return seen, state


def test_steps_below_bfloat16s_rounding_are_lost_without_a_master_and_add_up_with_one():
    without, _ = _sgd_steps(optax.sgd(1e-3), 10)
    assert without == [1.0] * 10  # 1 - 0.001 rounds to 1.0 every time

    with_master, state = _sgd_steps(with_master_weights(optax.sgd(1e-3), jnp.float32), 10)
    assert isinstance(state, MasterWeightsState) and state.master["w"].dtype == jnp.float32
    np.testing.assert_allclose(float(state.master["w"]), 0.99, rtol=1e-6)  # 10 steps of 1e-3, in float32
    assert with_master[0] == 1.0  # 0.999 still rounds to 1.0
    assert with_master[1] == 1.0 - 2.0**-8  # 0.998 < 1 - 2^-9: rounds down to 0.99609375
    assert with_master[-1] == 253 * 2.0**-8  # 0.99: between 0.98828125 and 0.9921875, nearer the first
    assert all(a >= b for a, b in zip(with_master, with_master[1:]))


def test_the_returned_updates_make_the_parameters_the_rounded_master():
    # the optax contract: apply_updates(p, updates) == round(master), also for a weight crossing zero
    optimizer = with_master_weights(optax.sgd(0.37), jnp.float32)
    params = {"w": jnp.asarray([1.0, -0.01, 3e-3, 250.0], jnp.bfloat16)}
    state = optimizer.init(params)
    for _ in range(5):
        updates, state = optimizer.update({"w": jnp.asarray([0.1, -0.05, 0.02, 3.0], jnp.bfloat16)}, state, params)
        assert updates["w"].dtype == jnp.float32
        params = optax.apply_updates(params, updates)
        np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(state.master["w"].astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="needs the working parameters"):
        optimizer.update({"w": jnp.zeros(4, jnp.bfloat16)}, state)


def _loss(model, batch):
    logits = model(batch["ids"], batch["mask"])
    logp = token_logprobs(logits[:, :-1], batch["ids"][:, 1:])
    loss = -(logp * batch["mask"][:, 1:]).sum() / batch["mask"][:, 1:].sum()
    return loss, {"policy/loss": loss}


def test_the_trainers_step_writes_the_rounded_master_and_keeps_float32_state():
    model = init_model(CFG, seed=0, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    optimizer = make_optimizer(OptimSection(learning_rate=1e-2, grad_clip=1.0, master_dtype="float32"), 10)
    opt_state = optimizer.init(params)
    step = jax.jit(functools.partial(apply_update, graphdef, loss_fn=_loss, totals={}, optimizer=optimizer,
                                     num_micro=1))
    batch = {"ids": IDS, "mask": MASK}
    new_params, new_opt_state, metrics = step(params, frozen, opt_state, batch)

    # the first master: float32 AdamW (with clipping) from the float32-cast parameters and gradient
    inner = make_optimizer(OptimSection(learning_rate=1e-2, grad_clip=1.0), 10)

    @jax.jit
    def float32_adamw_step(params):
        grads = jax.grad(lambda p: _loss(nnx.merge(graphdef, p, frozen), batch)[0])(params)
        p32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        updates, _ = inner.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), inner.init(p32), p32)
        return optax.apply_updates(p32, updates)

    for got, want in zip(jax.tree.leaves(new_opt_state.master), jax.tree.leaves(float32_adamw_step(params))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)

    for _ in range(3):
        for p, rounded in zip(jax.tree.leaves(new_params), jax.tree.leaves(master_params(new_opt_state, new_params))):
            assert p.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(p), np.asarray(rounded))
        new_params, new_opt_state, metrics = step(new_params, frozen, new_opt_state, batch)
    floats = [x for x in jax.tree.leaves(new_opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(floats) == 3 * len(jax.tree.leaves(params))  # master, mu, nu
    assert all(x.dtype == jnp.float32 for x in floats)
    assert metrics["loss"].dtype == jnp.float32 and float(metrics["nonfinite"]) == 0.0
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)))  # it moved


@pytest.mark.parametrize("jit", [False, True])
def test_logprobs_and_entropy_of_bfloat16_logits_are_float32(jit):
    logits = jax.random.normal(jax.random.key(0), (2, 5, 300), jnp.float32).astype(jnp.bfloat16) * 4
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 300)
    lp_fn = jax.jit(token_logprobs) if jit else token_logprobs
    ent_fn = jax.jit(entropy) if jit else entropy
    lp, ent = lp_fn(logits, tokens), ent_fn(logits)
    assert lp.dtype == ent.dtype == jnp.float32
    # the same numbers as on float32 logits: the softmax sums over the vocabulary in float32
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(lp_fn(logits.astype(jnp.float32), tokens)))
    np.testing.assert_array_equal(np.asarray(ent), np.asarray(ent_fn(logits.astype(jnp.float32))))


def test_a_bfloat16_models_logprobs_are_float32_chunked_or_not():
    model = init_model(CFG, seed=0, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    assert model.embed[...].dtype == jnp.bfloat16
    prompt_ids, prompt_mask = IDS[:, :3], MASK[:, :3]
    completion_ids, completion_mask = IDS[:, 3:], jnp.ones_like(IDS[:, 3:])
    graphdef, state = nnx.split(model)

    @jax.jit
    def passes(state):
        model = nnx.merge(graphdef, state)
        full = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, with_entropy=True)
        hidden, _ = model.forward(IDS, MASK)
        chunked = chunked_logprobs(model.logits, hidden[:, 2:5], completion_ids, 2, with_entropy=True)
        return full, chunked, hidden, model.logits(hidden)

    full, chunked, hidden, logits = passes(state)
    assert hidden.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    for key in ("logprobs", "entropy"):
        assert full[key].dtype == chunked[key].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(chunked[key]), np.asarray(full[key]), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(full["logprobs"]) < 0)


def test_a_master_copy_of_float32_parameters_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="optim.master_dtype: float32 with float32 parameters"):
        from_yaml(RunConfig, "optim: {master_dtype: float32}\nrewards: {answer: 1.0}")
    cfg = from_yaml(RunConfig, "model: {dtype: bfloat16}\noptim: {master_dtype: float32}\nrewards: {answer: 1.0}")
    assert cfg.model.storage_dtype == "bfloat16" and cfg.optim.master_dtype == "float32"
    cfg = from_yaml(RunConfig, "model: {dtype: float32, param_dtype: bfloat16}\noptim: {master_dtype: float32}\n"
                               "rewards: {answer: 1.0}")
    assert cfg.model.storage_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="optim.master_dtype"):
        from_yaml(RunConfig, "model: {dtype: bfloat16}\noptim: {master_dtype: bfloat16}\nrewards: {answer: 1.0}")


_ON_A_MESH = """
import dataclasses, jax, numpy as np
from rljax.config import from_yaml
from rljax.run_config import RunConfig
from rljax.training import OnlineTrainer
cfg = from_yaml(RunConfig, '''
model: {name: %(model)s, dtype: bfloat16}
data: {task: addition, train_size: 16, eval_size: 4, max_prompt_length: 64}
sampling: {max_new_tokens: 4}
algorithm: {name: grpo, group_size: 4, prompts_per_step: 2, kl_coef: 0.01}
optim: {learning_rate: 1.0e-2, master_dtype: float32}
mesh: {fsdp: 2, tensor: 2}
train: {steps: 1, run_dir: %(run_dir)s, progress: false, plot: false, save_model: false}
rewards: {length: 1.0}
''')
trainer = OnlineTrainer(cfg)
trainer.step_once()
p = trainer.run.policy
for w, m in zip(jax.tree.leaves(p.params), jax.tree.leaves(p.opt_state.master)):
    assert m.sharding == w.sharding, (m.sharding, w.sharding)
    assert str(w.dtype) == "bfloat16" and str(m.dtype) == "float32"
    np.testing.assert_array_equal(np.asarray(w), np.asarray(m.astype(w.dtype)))
print("sharded", sum(not w.sharding.is_fully_replicated for w in jax.tree.leaves(p.params)))
"""


@pytest.mark.heavy
def test_on_a_mesh_the_master_copy_is_sharded_like_the_parameters(tmp_path):
    import os
    import subprocess
    import sys

    from tests._tiny import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "model")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu", PYTHONPATH=repo)
    result = subprocess.run([sys.executable, "-c", _ON_A_MESH % dict(model=model, run_dir=tmp_path / "run")],
                            capture_output=True, text=True, env=env, cwd=repo, timeout=1800)  # a hang guard
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split("sharded")[-1]) > 0  # some parameters (and their masters) are split
