"""Checkpointer: exact round trips (bf16, ints, typed PRNG keys), schedule, pruning, atomicity."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.checkpoint import Checkpointer, abstract_like, is_finite_tree
from tests._processes import xla_flags


def _state(scale: float = 1.0):
    """A training-state-like pytree covering the leaf kinds a trainer checkpoints."""
    return {
        "params": {
            "w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * (scale / 7.0),
            "b_bf16": (jnp.arange(5, dtype=jnp.float32) * (scale / 3.0)).astype(jnp.bfloat16),
        },
        "opt": [jnp.full((2, 2), -scale / 9.0, jnp.float32), jnp.arange(3, dtype=jnp.int32)],
        "step": jnp.asarray(17, jnp.int32),
        "rng": jax.random.fold_in(jax.random.key(0), 3),  # typed key
        "raw_rng": jax.random.PRNGKey(5),  # legacy uint32[2] key
    }


def _bits(x) -> bytes:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def _assert_bitwise_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert _bits(g) == _bits(w)


def test_round_trip_is_bitwise_exact(tmp_path):
    state = _state()
    meta = {"data_position": 1234, "config": "model:\n  name: tiny\n", "rng_note": [1, 2]}
    with Checkpointer(tmp_path / "ckpt", save_every=10) as ckpt:
        assert ckpt.save(10, state, meta)
        ckpt.wait()
        restored, restored_meta = ckpt.restore(abstract_state=abstract_like(state))
    _assert_bitwise_equal(restored, state)
    assert restored_meta == meta
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    assert restored["params"]["b_bf16"].dtype == jnp.bfloat16
    # The restored key continues the same random stream.
    np.testing.assert_array_equal(
        jax.random.uniform(restored["rng"], (4,)), jax.random.uniform(state["rng"], (4,))
    )


def test_restore_into_eval_shape_target_in_a_fresh_checkpointer(tmp_path):
    """A resumed process knows only shapes: restore into jax.eval_shape output, with shardings."""
    state = _state()
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        ckpt.save(3, state, {"pos": 3})

    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        jax.eval_shape(lambda: _state(scale=2.0)),
    )
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        assert ckpt.latest_step() == 3
        restored, meta = ckpt.restore(3, abstract_state=target)
    _assert_bitwise_equal(restored, state)
    assert meta == {"pos": 3}
    for leaf in jax.tree.leaves(restored):
        assert leaf.sharding == sharding


def test_schedule_force_and_no_overwrite(tmp_path):
    with Checkpointer(tmp_path, save_every=5) as ckpt:
        assert [s for s in range(12) if ckpt.should_save(s)] == [5, 10]
        assert not ckpt.save(3, _state())  # off schedule: skipped
        assert ckpt.save(3, _state(), force=True)  # final save
        assert not ckpt.save(3, _state(2.0), force=True)  # never overwrites a step
        assert ckpt.save(5, _state())
        ckpt.wait()
        assert ckpt.all_steps() == [3, 5]
        restored, _ = ckpt.restore(3, abstract_state=abstract_like(_state()))
    _assert_bitwise_equal(restored, _state())
    never = Checkpointer(tmp_path / "never", save_every=0)
    assert not any(never.should_save(s) for s in range(100))
    never.close()


def test_max_to_keep_prunes_oldest(tmp_path):
    with Checkpointer(tmp_path, save_every=1, max_to_keep=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, _state(float(step)), {"step": step})
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]
        assert ckpt.latest_step() == 5
        restored, meta = ckpt.restore(4, abstract_state=abstract_like(_state()))
    assert meta == {"step": 4}
    _assert_bitwise_equal(restored, _state(4.0))
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["4", "5"]


def test_leftover_temporary_directory_is_ignored(tmp_path):
    """A crash mid-save leaves '<step>.orbax-checkpoint-tmp-*'; it must not be seen or break restore."""
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ckpt.save(2, _state(), {"pos": 2})
    partial = tmp_path / "4.orbax-checkpoint-tmp-1712345678"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "half_written").write_bytes(b"\x00garbage")

    reader = Checkpointer(tmp_path, save_every=1, read_only=True)
    assert reader.all_steps() == [2]
    restored, meta = reader.restore(abstract_state=abstract_like(_state()))
    _assert_bitwise_equal(restored, _state())
    assert meta == {"pos": 2}
    reader.close()
    assert partial.exists()  # a read-only checkpointer deletes nothing

    with Checkpointer(tmp_path, save_every=1) as writer:  # a resumed run cleans up
        assert writer.latest_step() == 2
        assert writer.save(4, _state(3.0))  # orbax deletes leftovers in the background and
        writer.wait()  # awaits that before a save starts
        assert not partial.exists()
        assert writer.all_steps() == [2, 4]


def test_missing_checkpoints_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Checkpointer(tmp_path / "nope", save_every=1, read_only=True)
    with Checkpointer(tmp_path / "empty", save_every=1) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ckpt.restore(abstract_state=abstract_like(_state()))
        ckpt.save(1, _state())
        with pytest.raises(FileNotFoundError, match=r"step 7 .*available steps: \[1\]"):
            ckpt.restore(7, abstract_state=abstract_like(_state()))


def test_restore_rejects_a_different_tree(tmp_path):
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ckpt.save(1, _state())
        wrong = abstract_like(_state())
        del wrong["opt"]
        with pytest.raises(ValueError):
            ckpt.restore(abstract_state=wrong)


def test_save_refuses_non_finite_state_and_bad_metadata(tmp_path):
    bad = _state()
    bad["params"]["b_bf16"] = bad["params"]["b_bf16"].at[1].set(jnp.inf)
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        with pytest.raises(ValueError, match="non-finite"):
            ckpt.save(1, bad)
        with pytest.raises(ValueError, match="JSON"):
            ckpt.save(1, _state(), {"array": np.zeros(2)})
        assert ckpt.all_steps() == []
        assert ckpt.save(1, bad, check_finite=False)  # explicit opt-out


def test_is_finite_tree():
    assert is_finite_tree(_state())
    assert is_finite_tree({})
    assert is_finite_tree({"i": jnp.arange(3), "k": jax.random.key(0), "x": 1.0})
    assert not is_finite_tree({"x": jnp.array([1.0, jnp.nan])})
    assert not is_finite_tree([jnp.zeros(2), jnp.array([jnp.inf], jnp.bfloat16)])
    assert not is_finite_tree({"loss": float("nan")})
    assert not is_finite_tree(np.array([-np.inf], np.float32))
    assert not is_finite_tree(np.array([1.0, np.inf], jnp.bfloat16))  # host bf16 (ml_dtypes)


_SHARDED_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rljax.checkpoint import Checkpointer, abstract_like

assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "fsdp"))
w = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 3.0
state = {
    "w": jax.device_put(w, NamedSharding(mesh, P("data", "fsdp"))),
    "b": jax.device_put(w[0].astype(jnp.bfloat16), NamedSharding(mesh, P("fsdp"))),
    "rng": jax.random.key(7),
}
with Checkpointer(sys.argv[1], save_every=1) as ckpt:
    ckpt.save(1, state, {"pos": 1})
# Restore with a different layout: w sharded the other way, b replicated.
target = abstract_like(state)
target["w"] = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", "data")))
target["b"] = jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
with Checkpointer(sys.argv[1], save_every=1, read_only=True) as ckpt:
    restored, meta = ckpt.restore(abstract_state=target)
assert restored["w"].sharding == target["w"].sharding, restored["w"].sharding
assert restored["b"].sharding == target["b"].sharding
assert np.asarray(restored["w"]).tobytes() == np.asarray(w).tobytes()
assert np.asarray(restored["b"]).tobytes() == np.asarray(state["b"]).tobytes()
assert (jax.random.key_data(restored["rng"]) == jax.random.key_data(state["rng"])).all()
assert meta == {"pos": 1}
print("SHARDED-OK")
"""


def test_sharded_save_restores_into_another_sharding(tmp_path):
    """8 simulated CPU devices: save (data, fsdp)-sharded arrays, restore with other shardings."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(8),
           "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT, str(tmp_path / "ckpt")],
        env=env, capture_output=True, text=True, timeout=900,  # a hang guard
        cwd=Path(__file__).resolve().parents[2],  # the repository root, so `rljax` imports
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SHARDED-OK" in result.stdout
