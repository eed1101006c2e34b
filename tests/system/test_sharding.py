"""Mesh, logical-axis rules, sharded init / loading, and sharded-vs-unsharded equality on 8 CPU devices."""

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from rljax import sharding
from rljax.models import sharded_loading
from rljax.models.config import ModelConfig
from rljax.models.transformer import abstract_model, init_model
from tests._processes import xla_flags

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16)
# every optional parameter present: biases, q/k norms (and a value head in the tests below)
FULL = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, o_bias=True, qk_norm=True)
MESH_1x4x2 = AbstractMesh((1, 4, 2), sharding.MESH_AXES)

# spec of every parameter of FULL (+ value head) on mesh (data=1, fsdp=4, tensor=2)
EXPECTED_SPECS = {
    "embed": P("tensor", "fsdp"),
    "final_norm": P(None),
    "lm_head": P("fsdp", "tensor"),
    "layers/attn_norm": P(None, None),
    "layers/mlp_norm": P(None, None),
    "layers/wq": P(None, "fsdp", "tensor", None),
    "layers/wk": P(None, "fsdp", "tensor", None),
    "layers/wv": P(None, "fsdp", "tensor", None),
    "layers/wo": P(None, "tensor", None, "fsdp"),
    "layers/bq": P(None, "tensor", None),
    "layers/bk": P(None, "tensor", None),
    "layers/bv": P(None, "tensor", None),
    "layers/bo": P(None, "fsdp"),
    "layers/q_norm": P(None, None),
    "layers/k_norm": P(None, None),
    "layers/w_gate": P(None, "fsdp", "tensor"),
    "layers/w_up": P(None, "fsdp", "tensor"),
    "layers/w_down": P(None, "tensor", "fsdp"),
    "value_head/w": P("fsdp"),
    "value_head/b": P(None),
}


def _flat(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in leaves}


def _variables(state: nnx.State) -> dict:
    """name -> nnx.Variable of a state."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {"/".join(str(k.key) for k in path): v for path, v in flat}


def _ulps(a, b) -> int:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return int(np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))))


@pytest.fixture(scope="module")
def tiny_model():
    return init_model(TINY, seed=0)


# --------------------------------------------------------------------------------------- rules
def test_rules_give_the_expected_spec_for_every_parameter():
    state = nnx.state(abstract_model(FULL, value_head=True))
    variables = _variables(state)
    assert set(variables) == set(EXPECTED_SPECS)
    for name, var in variables.items():
        axes = var.get_metadata()["logical_axes"]
        assert sharding.logical_to_spec(axes, var.get_value().shape, MESH_1x4x2) == EXPECTED_SPECS[name], name


def test_lora_adapters_follow_their_base_weight():
    # A [L, D, r] / B [L, r, H, hd] of a LoRA on wq: the rank is replicated
    assert sharding.logical_to_spec(("layers", "embed", "lora"), (2, 64, 8), MESH_1x4x2) == P(None, "fsdp", None)
    assert sharding.logical_to_spec(("layers", "lora", "heads", "head_dim"), (2, 8, 4, 16), MESH_1x4x2) == P(
        None, None, "tensor", None)


def test_param_shardings_matches_the_state_tree():
    mesh = sharding.make_mesh()
    state = nnx.state(abstract_model(FULL, value_head=True))
    shardings = sharding.param_shardings(state, mesh)
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    for name, s in _flat(nnx.to_pure_dict(shardings)).items():
        assert isinstance(s, NamedSharding) and s.mesh == mesh
        assert s.spec == EXPECTED_SPECS[name], name  # the 1-device mesh keeps the same specs


def test_variables_without_logical_axes_are_replicated():
    class Plain(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 2)))
            self.stat = nnx.BatchStat(jnp.zeros((2,)))
            self.named = nnx.Param(jnp.ones((4,)), logical_axes=("embed",))

    mesh = sharding.make_mesh()
    specs = {k: s.spec for k, s in _flat(nnx.to_pure_dict(sharding.param_shardings(Plain(), mesh))).items()}
    assert specs == {"w": P(), "stat": P(), "named": P("fsdp")}
    sharded = sharding.shard_model(Plain(), mesh)
    assert sharded.w[...].sharding.spec == P() and sharded.named[...].sharding.spec == P("fsdp")


def test_indivisible_dims_fall_back_to_replication_and_log_once(caplog):
    # Reports are once per process: a vocabulary of 9973 appears in no other test, so not reported yet.
    with caplog.at_level(logging.DEBUG, logger="rljax.sharding"):
        for _ in range(3):
            assert sharding.logical_to_spec(("vocab", "embed"), (9973, 64), MESH_1x4x2) == P(None, "fsdp")
    messages = [r.getMessage() for r in caplog.records if r.name == "rljax.sharding"]
    assert len(messages) == 1 and "'vocab' of size 9973" in messages[0] and "'tensor'" in messages[0]
    # one KV head (multi-query attention) on tensor=2; an embed of 6 on fsdp=4
    assert sharding.logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (2, 6, 1, 16), MESH_1x4x2) == P(
        None, None, None, None)
    # a batch of 6 on (data=2, fsdp=4): data divides, data*fsdp does not
    mesh_2x4x1 = AbstractMesh((2, 4, 1), sharding.MESH_AXES)
    assert sharding.logical_to_spec(("batch", None), (6, 5), mesh_2x4x1) == P("data", None)
    assert sharding.logical_to_spec(("batch", None), (8, 5), mesh_2x4x1) == P(("data", "fsdp"), None)
    assert sharding.logical_to_spec(("batch", None), (3, 5), mesh_2x4x1) == P(None, None)


def test_a_mesh_axis_is_used_at_most_once_per_spec():
    rules = (("a", "tensor"), ("b", ("tensor", "fsdp")), ("c", "fsdp"))
    assert sharding.logical_to_spec(("a", "b"), (4, 8), MESH_1x4x2, rules) == P("tensor", "fsdp")
    assert sharding.logical_to_spec(("a", "a"), (4, 4), MESH_1x4x2, rules) == P("tensor", None)
    assert sharding.logical_to_spec(("b", "c"), (8, 8), MESH_1x4x2, rules) == P(("tensor", "fsdp"), None)
    # the batch claims fsdp first, so an activation's embed dim named by the parameter rule stays whole
    assert sharding.logical_to_spec(("batch", "length", "embed"), (8, 3, 64), MESH_1x4x2) == P(("data", "fsdp"), None, None)


def test_custom_rules_from_a_config():
    data_parallel = tuple((name, None) for name, _ in sharding.DEFAULT_RULES if name != "batch") + (
        ("batch", ("data", "fsdp", "tensor")),)
    assert sharding.logical_to_spec(("layers", "embed", "heads", "head_dim"), (2, 64, 4, 16), MESH_1x4x2,
                                    data_parallel) == P(None, None, None, None)
    as_mapping = dict(sharding.DEFAULT_RULES) | {"vocab": None, "embed": ("fsdp", "tensor")}
    assert sharding.logical_to_spec(("vocab", "embed"), (128, 64), MESH_1x4x2, as_mapping) == P(None, ("fsdp", "tensor"))
    mesh = sharding.make_mesh()
    assert sharding.batch_sharding(mesh, data_parallel).spec == P(("data", "fsdp", "tensor"))
    from_yaml = [[name, list(t) if isinstance(t, tuple) else t] for name, t in sharding.DEFAULT_RULES]
    assert sharding.logical_to_spec(("batch", "embed"), (8, 64), MESH_1x4x2, from_yaml) == P(("data", "fsdp"), None)
    assert sharding.batch_sharding(mesh, from_yaml).spec == P(("data", "fsdp"))


def test_rule_errors_are_clear():
    with pytest.raises(KeyError, match="'embd' has no sharding rule"):
        sharding.logical_to_spec(("embd",), (64,), MESH_1x4x2)
    with pytest.raises(ValueError, match="do not match shape"):
        sharding.logical_to_spec(("embed",), (64, 2), MESH_1x4x2)
    with pytest.raises(ValueError, match="names mesh axis 'model'"):
        sharding.logical_to_spec(("embed",), (64,), MESH_1x4x2, (("embed", "model"),))


# ---------------------------------------------------------------------------------------- mesh
def test_make_mesh_defaults_to_all_devices_on_fsdp():
    mesh = sharding.make_mesh()
    assert mesh.axis_names == sharding.MESH_AXES
    assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "tensor": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert dict(sharding.make_mesh(data=-1, fsdp=1).shape)["data"] == jax.device_count()


def test_make_mesh_rejects_a_wrong_device_count():
    n = jax.device_count()
    with pytest.raises(ValueError, match=f"needs {2 * n} devices, but {n} are given"):
        sharding.make_mesh(fsdp=2 * n)
    with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
        sharding.make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="not a multiple of"):
        sharding.make_mesh(fsdp=-1, tensor=n + 1)
    with pytest.raises(ValueError, match="must be >= 1"):
        sharding.make_mesh(data=0)


def test_batch_sharding_and_replicated():
    mesh = sharding.make_mesh()
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"))
    assert sharding.replicated(mesh).spec == P()
    batch = jax.device_put(np.arange(12).reshape(4, 3), sharding.batch_sharding(mesh))
    assert batch.sharding.spec == P(("data", "fsdp"))


# ------------------------------------------------------------- sharded parameters on one device
def test_shard_model_on_one_device_keeps_values_and_logits(tiny_model):
    mesh = sharding.make_mesh()
    sharded = sharding.shard_model(tiny_model, mesh)
    assert isinstance(sharded, type(tiny_model))
    for name, leaf in _flat(nnx.to_pure_dict(nnx.state(sharded))).items():
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.spec == EXPECTED_SPECS[name], name
    graphdef, state = sharding.shard_model(nnx.split(tiny_model), mesh)  # a (graphdef, state) pair stays a pair
    ids = np.array([[0, 0, 5, 6], [1, 2, 3, 4]], np.int32)
    mask = (np.arange(4)[None, :] >= np.array([[2], [0]])).astype(np.int32)
    forward = jax.jit(lambda g, s: nnx.merge(g, s)(ids, mask), static_argnums=0)
    expected = np.asarray(forward(*nnx.split(tiny_model)))
    np.testing.assert_array_equal(np.asarray(forward(graphdef, state)), expected)
    np.testing.assert_array_equal(np.asarray(forward(*nnx.split(sharded))), expected)


def test_init_sharded_equals_init_model(tiny_model):
    mesh, value_head = sharding.make_mesh(), True
    model = sharded_loading.init_sharded(TINY, mesh, seed=0, value_head=value_head)
    got = _flat(nnx.to_pure_dict(nnx.state(model)))
    jitted = _flat(nnx.to_pure_dict(jax.jit(lambda: nnx.state(init_model(TINY, seed=0, value_head=value_head)))()))
    eager = _flat(nnx.to_pure_dict(nnx.state(tiny_model)))
    assert set(got) == set(jitted)
    for name, value in got.items():
        assert value.sharding.spec == EXPECTED_SPECS[name], name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(jitted[name]), err_msg=name)
        if name in eager:
            # eager init_model rounds std * sqrt(2) differently from any jitted init: at most one ulp
            assert _ulps(value, eager[name]) <= 1, name
    assert model.config == TINY


def test_init_sharded_dtypes():
    model = sharded_loading.init_sharded(TINY, sharding.make_mesh(), seed=1, param_dtype=jnp.bfloat16,
                                         dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))} == {jnp.dtype(jnp.bfloat16)}
    assert model.dtype == jnp.bfloat16


def test_load_sharded_places_host_arrays(tiny_model):
    mesh = sharding.make_mesh()
    host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(tiny_model)))
    loaded = sharded_loading.load_sharded(TINY, host, mesh, value_head=True)
    got = _flat(nnx.to_pure_dict(nnx.state(loaded)))
    for name, value in _flat(host).items():
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)
        assert got[name].sharding.spec == EXPECTED_SPECS[name], name
    assert not np.asarray(got["value_head/w"]).any()
    bf16 = sharded_loading.load_sharded(TINY, host, mesh, param_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16.embed[...]), host["embed"].astype(jnp.bfloat16))
    wrong = dict(host, embed=np.zeros((127, 64), np.float32))
    with pytest.raises(ValueError, match="parameter shapes do not match the config"):
        sharded_loading.load_sharded(TINY, wrong, mesh)


def test_load_hf_dir_sharded_round_trip(tmp_path, tiny_model):
    pytest.importorskip("safetensors")
    from rljax.models.hf_io import load_hf_dir, save_hf_dir

    host = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(tiny_model)))
    value_head = {"w": np.arange(64, dtype=np.float32), "b": np.array([0.5], np.float32)}
    model = sharded_loading.load_sharded(TINY, host, sharding.make_mesh(), value_head=True,
                                         value_head_params=value_head)
    save_hf_dir(str(tmp_path), model)
    loaded = sharded_loading.load_hf_dir_sharded(str(tmp_path), sharding.make_mesh(), value_head=True)
    reference = _flat(nnx.to_pure_dict(nnx.state(load_hf_dir(str(tmp_path), value_head=True))))
    got = _flat(nnx.to_pure_dict(nnx.state(loaded)))
    assert set(got) == set(reference)
    for name, value in got.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(reference[name]), err_msg=name)
        assert value.sharding.spec == EXPECTED_SPECS[name], name
    np.testing.assert_array_equal(np.asarray(got["value_head/w"]), value_head["w"])
    np.testing.assert_array_equal(np.asarray(got["value_head/b"]), value_head["b"])


def test_constrain_is_a_no_op_without_a_mesh_and_pins_under_one():
    x = jnp.ones((4, 3, 64))
    pin = jax.jit(lambda x: sharding.constrain(x + 1.0, ("batch", "length", "act_embed")))
    np.testing.assert_array_equal(np.asarray(pin(x)), np.full((4, 3, 64), 2.0))
    mesh = sharding.make_mesh()
    with sharding.use_mesh(mesh) as active:
        assert active is mesh
        out = pin(x)
    assert isinstance(out.sharding, NamedSharding) and out.sharding.mesh == mesh
    assert jax.sharding.get_abstract_mesh().empty  # the context is restored


# ------------------------------------------------------------------- 8 simulated CPU devices
def test_sharded_forward_and_sampler_match_unsharded_on_8_devices():
    """tests/_sharded_check.py on a (data=1, fsdp=4, tensor=2) mesh; see that script for what it computes."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, os.path.join(root, "tests", "_sharded_check.py")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=1800)  # a hang guard, not a speed limit
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])

    assert r["device_count"] == 8 and r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    # parameters are really split: spec and per-device shard shape of every tensor
    assert r["layouts_ok"], r["layouts"]
    assert r["layouts"]["layers/wq"] == [[2, 64, 4, 16], [None, "fsdp", "tensor", None], [2, 16, 2, 16]]
    assert r["shard_model_values_equal"]
    assert r["batch_shard_shape"] == [2, 12]
    assert r["forward_collectives"] > 0  # the program is partitioned, not run on one device
    # logits and the sampler agree with the unsharded model: the logits and the trainer's log-probs in
    # float64 (an algebraic equality; float64 rounding at the values' scale), the sampler in float32
    f64 = r["float64"]
    assert f64["dtypes"] == ["float64"] and f64["logits_max_abs"] > 0.1 and f64["logprobs_max_abs"] > 1.0, f64
    assert f64["logits_max_abs_diff"] <= 1e-12 * f64["logits_max_abs"], f64
    assert f64["logprobs_max_abs_diff"] <= 1e-12 * f64["logprobs_max_abs"], f64
    for name in ("greedy", "temp1"):
        s = r[name]
        assert s["tokens_equal"] and s["mask_equal"], (name, s)
        assert s["logprobs_max_abs_diff"] <= 1e-5, (name, s)
        assert s["trainer_logprobs_max_abs_diff"] <= 1e-5, (name, s)  # on-policy under sharding too
        assert s["distinct_tokens"] > 8, (name, s)  # a non-degenerate sample
    # sharded init and loading
    assert r["init_layouts_ok"] and r["init_bitwise_equal_to_jit_init_model"]
    assert r["init_max_ulps_vs_init_model"] <= 1
    assert r["init_device_bytes"] < r["param_bytes"] / 2, r  # no device materialises the unsharded model
    assert r["load_layouts_ok"] and r["load_values_equal"]
    # activation constraints: no-op without a mesh, batch split under use_mesh
    assert r["constrain_without_mesh_devices"] == 1
    assert r["constrain_shard_shape"] == [2, 4, 64]


def test_keep_shardings_renames_an_equivalent_sharding_without_a_copy():
    mesh = sharding.make_mesh()  # every device on fsdp; one CPU device here
    named = NamedSharding(mesh, P(None, "tensor", "fsdp"))
    x = jax.device_put(jnp.arange(24.0).reshape(2, 3, 4), named)
    y = jax.jit(lambda a: a * 2)(x)  # XLA reports its own name for the same placement
    z = jnp.arange(3.0)
    kept, other = sharding.keep_shardings((y, z), (sharding.shardings_of(x), None))
    assert kept.sharding == named
    assert kept.unsafe_buffer_pointer() == y.unsafe_buffer_pointer()  # the same buffer, not a copy
    np.testing.assert_array_equal(np.asarray(kept), 2 * np.arange(24.0).reshape(2, 3, 4))
    assert other is z  # a leaf without a recorded sharding is left alone
