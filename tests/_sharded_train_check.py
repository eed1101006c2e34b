"""One GRPO update (two micro-batches, float64) on a (data=1, fsdp=4, tensor=2) mesh of 8 simulated CPU
devices vs one device.

Run by tests/system/test_sharded_train.py in a subprocess (the device count is fixed when jax is imported):
XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/_sharded_train_check.py
Prints one JSON line.
"""

import json
import os
import sys

if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    sys.exit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax is imported)")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from rljax import sharding  # noqa: E402
from rljax.algorithms import grpo  # noqa: E402
from rljax.batches import RolloutBatch  # noqa: E402
from rljax.models.config import ModelConfig  # noqa: E402
from rljax.models.transformer import init_model  # noqa: E402
from rljax.sampling import SamplingConfig, generate  # noqa: E402
from rljax.training.online import update_epochs  # noqa: E402

CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)
ALGO = grpo.GRPOConfig(group_size=4, prompts_per_step=2, kl_coef=0.04, reduction="token_mean",
                        epsilon_high=0.28, entropy_coef=0.01)


def _batch(model):
    rng = np.random.default_rng(0)
    lengths = [5, 7, 3, 8, 6, 8, 2, 4]
    prompt_ids = np.zeros((8, 8), np.int32)
    prompt_mask = np.zeros((8, 8), np.int32)
    for i, n in enumerate(lengths):
        prompt_ids[i, 8 - n:] = rng.integers(1, 128, n)
        prompt_mask[i, 8 - n:] = 1
    out = generate(model, prompt_ids, prompt_mask, jax.random.key(1),
                   SamplingConfig(max_new_tokens=6, temperature=1.0, stop_token_ids=(3,)), bucket=False)
    batch = RolloutBatch(
        prompt_ids=jnp.asarray(prompt_ids), prompt_mask=jnp.asarray(prompt_mask),
        completion_ids=out.tokens, completion_mask=out.mask, loss_mask=out.mask,
        old_logprobs=out.logprobs, ref_logprobs=out.logprobs - 0.05 * out.mask,
        scores=jnp.asarray(rng.random(8), jnp.float32), row_mask=jnp.ones(8, bool), finished=out.finished,
    )
    return grpo.advantages(batch, ALGO)


def _step(model, batch):
    graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
    # Plain SGD with step 1: the parameter change is the gradient itself. (Adam's first step is
    # ~lr·sign(g), which turns float32 noise in near-zero gradients into lr-sized differences.)
    optimizer = optax.sgd(1.0)
    opt_state = optimizer.init(params)
    new_params, _, _, _, metrics = update_epochs(graphdef, params, frozen, opt_state, batch, jax.random.key(0),
                                                 optimizer=optimizer, algorithm="grpo", cfg=ALGO, temperature=1.0,
                                                 num_micro=2, num_iterations=1, mini_batches=1)
    return new_params, {k: v[0, 0] for k, v in metrics.items()}  # one pass, one mini-batch


def _float64(batch):
    return jax.tree.map(lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, batch)


def main():
    batch = _batch(init_model(CONFIG, seed=0))  # sampled in float32, as a run does
    # sharded = one device (and micro-batched = whole batch) is an algebraic equality: the update is
    # compared in float64, where it holds to ~1e-15 on every host
    with jax.enable_x64(True):
        _compare(_float64(batch))


def _compare(batch):
    f64 = {"param_dtype": jnp.float64, "dtype": jnp.float64}
    model = init_model(CONFIG, seed=0, **f64)
    ref_params, ref_metrics = _step(model, jax.tree.map(jnp.copy, batch))
    ref_params = jax.tree.map(np.asarray, nnx.to_pure_dict(ref_params))

    mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
    with sharding.use_mesh(mesh):
        sharded_model = sharding.shard_model(init_model(CONFIG, seed=0, **f64), mesh)
        sharded_batch = jax.tree.map(lambda x: jax.device_put(x, sharding.batch_sharding(mesh)), batch)
        new_params, metrics = _step(sharded_model, sharded_batch)
    wq = nnx.to_pure_dict(new_params)["layers"]["wq"]
    flat_new = jax.tree.map(np.asarray, nnx.to_pure_dict(new_params))
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), flat_new, ref_params))
    moved = jax.tree.leaves(jax.tree.map(
        lambda a, b: float(np.abs(a - b).max()), ref_params,
        jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.split(init_model(CONFIG, seed=0, **f64), nnx.Param, ...)[1]))))
    print(json.dumps({
        "devices": jax.device_count(),
        "param_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(flat_new)}),
        "wq_spec": [s if s is None or isinstance(s, str) else list(s) for s in wq.sharding.spec],
        "max_param_diff": max(diffs),
        "max_param_update": max(moved),
        "metric_diffs": {k: abs(float(metrics[k]) - float(ref_metrics[k])) for k in ref_metrics},
        "metrics": {k: float(ref_metrics[k]) for k in ref_metrics},
        "loss": float(ref_metrics["loss"]),
    }))


if __name__ == "__main__":
    main()
