"""Sharded vs unsharded forward pass and sampler on 8 simulated CPU devices; prints one JSON line.

Run by tests/system/test_sharding.py in a subprocess, because the device count is fixed when jax is first
imported: XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/_sharded_check.py
"""

import json
import os
import sys
import time

if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    sys.exit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax is imported)")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rljax import sharding  # noqa: E402
from rljax.models import sharded_loading  # noqa: E402
from rljax.logprobs import completion_logprobs  # noqa: E402
from rljax.models.config import ModelConfig  # noqa: E402
from rljax.models.transformer import abstract_model, init_model  # noqa: E402
from rljax.sampling import SamplingConfig, generate  # noqa: E402

CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)
# mesh (data=1, fsdp=4, tensor=2): expected spec and per-device shard shape of every parameter.
EXPECTED = {
    "embed": ([128, 64], ["tensor", "fsdp"], [64, 16]),
    "final_norm": ([64], [None], [64]),
    "lm_head": ([64, 128], ["fsdp", "tensor"], [16, 64]),
    "layers/attn_norm": ([2, 64], [None, None], [2, 64]),
    "layers/mlp_norm": ([2, 64], [None, None], [2, 64]),
    "layers/wq": ([2, 64, 4, 16], [None, "fsdp", "tensor", None], [2, 16, 2, 16]),
    "layers/wk": ([2, 64, 2, 16], [None, "fsdp", "tensor", None], [2, 16, 1, 16]),
    "layers/wv": ([2, 64, 2, 16], [None, "fsdp", "tensor", None], [2, 16, 1, 16]),
    "layers/wo": ([2, 4, 16, 64], [None, "tensor", None, "fsdp"], [2, 2, 16, 16]),
    "layers/w_gate": ([2, 64, 128], [None, "fsdp", "tensor"], [2, 16, 64]),
    "layers/w_up": ([2, 64, 128], [None, "fsdp", "tensor"], [2, 16, 64]),
    "layers/w_down": ([2, 128, 64], [None, "tensor", "fsdp"], [2, 64, 16]),
}


def _flat(model_or_state) -> dict[str, jax.Array]:
    state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in leaves}


def _layout(array: jax.Array) -> tuple[list, list, list]:
    spec = list(array.sharding.spec) + [None] * (array.ndim - len(array.sharding.spec))
    spec = [list(s) if isinstance(s, tuple) else s for s in spec]
    shard_shapes = {tuple(s.data.shape) for s in array.addressable_shards}
    assert len(shard_shapes) == 1, shard_shapes
    return [list(array.shape), spec, list(shard_shapes.pop())]


def _ulps(a, b) -> int:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return int(np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))))


def _batch(rng: np.random.Generator, batch_size: int = 8, width: int = 12):
    lengths = [12, 1, 7, 3, 12, 5, 9, 2]
    ids = np.zeros((batch_size, width), np.int32)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.integers(1, CONFIG.vocab_size, n)
        mask[i, width - n:] = 1
    return ids, mask


def main() -> None:
    start = time.time()
    result: dict = {"device_count": jax.device_count()}
    model = init_model(CONFIG, seed=0)
    ids, mask = _batch(np.random.default_rng(0))

    @jax.jit
    def logits_fn(graphdef, state, ids, mask):
        return nnx.merge(graphdef, state)(ids, mask)

    configs = {"greedy": SamplingConfig(max_new_tokens=8, temperature=0.0),
               "temp1": SamplingConfig(max_new_tokens=8, temperature=1.0)}
    key = jax.random.key(1234)

    # ---- unsharded reference (everything on device 0)
    graphdef, state = nnx.split(model)
    ref_logits = np.asarray(logits_fn(graphdef, state, ids, mask))
    ref_samples = {name: generate((graphdef, state), ids, mask, key, cfg) for name, cfg in configs.items()}

    # ---- sharded: parameters over (fsdp=4, tensor=2), batch over ('data', 'fsdp')
    mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
    result["mesh"] = dict(mesh.shape)
    s_graphdef, s_state = sharding.shard_model((graphdef, state), mesh)
    layouts = {name: _layout(a) for name, a in _flat(s_state).items()}
    result["layouts"] = layouts
    result["layouts_ok"] = all(layouts.get(k) == list(v) for k, v in EXPECTED.items()) and set(layouts) == set(EXPECTED)
    result["shard_model_values_equal"] = all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(_flat(state).values(), _flat(s_state).values())
    )

    s_ids = jax.device_put(ids, sharding.batch_sharding(mesh))
    s_mask = jax.device_put(mask, sharding.batch_sharding(mesh))
    result["batch_shard_shape"] = list(s_ids.addressable_shards[0].data.shape)
    s_logits_arr = logits_fn(s_graphdef, s_state, s_ids, s_mask)
    s_logits = np.asarray(s_logits_arr)
    result["logits_max_abs_diff"] = float(np.max(np.abs(s_logits - ref_logits)))
    result["logits_sharding"] = str(s_logits_arr.sharding.spec)
    hlo = logits_fn.lower(s_graphdef, s_state, s_ids, s_mask).compile().as_text()
    result["forward_collectives"] = sum(hlo.count(op) for op in ("all-gather", "all-reduce", "reduce-scatter",
                                                                 "all-to-all", "collective-permute"))

    for name, cfg in configs.items():
        ref = ref_samples[name]
        out = generate((s_graphdef, s_state), s_ids, s_mask, key, cfg)
        # the trainer's forward pass on the sharded model scores the sampled tokens
        scored = jax.jit(
            lambda st, pi, pm, ci, cm, t=cfg.temperature: completion_logprobs(
                nnx.merge(s_graphdef, st), pi, pm, ci, cm, temperature=t)["logprobs"]
        )(s_state, s_ids, s_mask, out.tokens, out.mask)
        m = np.asarray(out.mask)
        result[name] = {
            "tokens_equal": bool(np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))),
            "mask_equal": bool(np.array_equal(m, np.asarray(ref.mask))),
            "logprobs_max_abs_diff": float(np.max(np.abs(np.asarray(out.logprobs) - np.asarray(ref.logprobs)))),
            "trainer_logprobs_max_abs_diff": float(np.max(np.abs((np.asarray(scored) - np.asarray(out.logprobs)) * m))),
            "tokens_sharding": str(out.tokens.sharding.spec),
            "distinct_tokens": int(len(np.unique(np.asarray(out.tokens)))),
        }

    # ---- sharded = one device is an algebraic equality: the forward pass and the trainer's log-probs
    # of the sampled tokens again in float64, where they agree to ~1e-15 on every host
    with jax.enable_x64(True):
        g64, st64 = nnx.split(init_model(CONFIG, seed=0, param_dtype=jnp.float64, dtype=jnp.float64))
        s_g64, s_st64 = sharding.shard_model((g64, st64), mesh)
        sample = ref_samples["temp1"]
        logps64 = jax.jit(lambda g, st, *batch: completion_logprobs(nnx.merge(g, st), *batch)["logprobs"],
                          static_argnums=0)
        placed = [jax.device_put(np.asarray(a), sharding.batch_sharding(mesh))
                  for a in (ids, mask, sample.tokens, sample.mask)]
        ref64 = np.asarray(logits_fn(g64, st64, ids, mask))
        got64 = np.asarray(logits_fn(s_g64, s_st64, *placed[:2]))
        ref_lp64 = np.asarray(logps64(g64, st64, ids, mask, np.asarray(sample.tokens), np.asarray(sample.mask)))
        got_lp64 = np.asarray(logps64(s_g64, s_st64, *placed))
    result["float64"] = {
        "dtypes": sorted({str(got64.dtype), str(got_lp64.dtype)}),
        "logits_max_abs": float(np.max(np.abs(ref64))),
        "logits_max_abs_diff": float(np.max(np.abs(got64 - ref64))),
        "logprobs_max_abs": float(np.max(np.abs(ref_lp64))),
        "logprobs_max_abs_diff": float(np.max(np.abs(got_lp64 - ref_lp64))),
    }

    # ---- init_sharded: the random init materialised directly sharded
    init_s = sharded_loading.init_sharded(CONFIG, mesh, seed=0)
    flat_init = _flat(init_s)
    jit_init = _flat(jax.jit(lambda: nnx.state(init_model(CONFIG, seed=0)))())
    eager_init = _flat(model)
    result["init_layouts_ok"] = all(_layout(flat_init[k]) == list(v) for k, v in EXPECTED.items())
    result["init_bitwise_equal_to_jit_init_model"] = all(
        np.array_equal(np.asarray(flat_init[k]), np.asarray(jit_init[k])) for k in EXPECTED)
    result["init_max_ulps_vs_init_model"] = max(_ulps(flat_init[k], eager_init[k]) for k in EXPECTED)
    # the same program init_sharded compiles: per device it holds slices, never a whole tensor
    abstract_state = nnx.state(abstract_model(CONFIG))
    init_program = jax.jit(lambda: nnx.state(init_model(CONFIG, seed=0)),
                           out_shardings=sharding.param_shardings(abstract_state, mesh)).lower().compile()
    stats = init_program.memory_analysis()
    result["init_device_bytes"] = int(stats.output_size_in_bytes + stats.temp_size_in_bytes)
    result["param_bytes"] = int(sum(np.asarray(a).nbytes for a in eager_init.values()))

    # ---- constrain / use_mesh: an activation pinned to ("batch", "length", "act_embed")
    pin = jax.jit(lambda x: sharding.constrain(x * 2.0, ("batch", "length", "act_embed")))
    x = np.ones((8, 4, 64), np.float32)
    result["constrain_without_mesh_devices"] = len(pin(x).sharding.device_set)
    with sharding.use_mesh(mesh):
        pinned = pin(x)
    result["constrain_under_mesh"] = str(pinned.sharding.spec)
    result["constrain_shard_shape"] = list(pinned.addressable_shards[0].data.shape)

    # ---- load_sharded: host arrays placed tensor by tensor
    host = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    loaded = _flat(sharded_loading.load_sharded(CONFIG, host, mesh))
    result["load_layouts_ok"] = all(_layout(loaded[k]) == list(v) for k, v in EXPECTED.items())
    result["load_values_equal"] = all(np.array_equal(np.asarray(loaded[k]), np.asarray(eager_init[k])) for k in EXPECTED)

    result["seconds"] = round(time.time() - start, 1)
    result["cpu_seconds"] = round(time.process_time(), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
