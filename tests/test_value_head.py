"""A fresh value / reward head: normal(0, 0.02) from the seed by default, zeros on request, and a
head read from a checkpoint kept as it was trained."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.config import ConfigError, from_yaml
from rljax.models import fresh_value_head, load
from rljax.models.hf_io import save_hf_dir
from rljax.run_config import RunConfig
from rljax.training import build_run
from tests._tiny import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def test_a_fresh_normal_head_has_std_002_and_is_fixed_by_the_seed():
    head = fresh_value_head(4096, seed=3)
    assert head["w"].shape == (4096,) and head["w"].dtype == np.float32
    # the sample std of 4096 draws is within 0.02 * (1 +- 0.05) with probability ~1 - 1e-5
    assert abs(float(np.std(head["w"])) - 0.02) < 0.001 and abs(float(np.mean(head["w"]))) < 0.002
    np.testing.assert_array_equal(head["b"], np.zeros(1, np.float32))
    np.testing.assert_array_equal(fresh_value_head(4096, seed=3)["w"], head["w"])
    assert not np.array_equal(fresh_value_head(4096, seed=4)["w"], head["w"])
    np.testing.assert_allclose(fresh_value_head(4096, std=0.5, seed=3)["w"], 25 * head["w"], rtol=1e-6)


def test_the_zeros_option_gives_a_zero_head_and_bad_options_are_refused():
    head = fresh_value_head(64, init="zeros", seed=3)
    np.testing.assert_array_equal(head["w"], np.zeros(64, np.float32))
    np.testing.assert_array_equal(head["b"], np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="one of \\('normal', 'zeros'\\), got 'xavier'"):
        fresh_value_head(64, init="xavier")
    with pytest.raises(ConfigError, match="model.value_head_init: Invalid value 'xavier', expected one of"):
        from_yaml(RunConfig, "model: {value_head_init: xavier}")
    with pytest.raises(ConfigError, match="model.value_head_std: must be > 0"):
        from_yaml(RunConfig, "model: {value_head_std: 0.0}")


def test_a_run_starts_its_head_from_the_config_and_a_loaded_head_is_kept(tiny_dir, tmp_path):
    def run_head(name, run_dir, model_extra=""):
        cfg = from_yaml(RunConfig, f"""
model: {{name: {name}{model_extra}}}
data: {{task: "", path: unused.jsonl}}
algorithm: {{name: reward_model}}
train: {{seed: 5, run_dir: {run_dir}, progress: false}}
""")
        run = build_run(cfg, value_head=True, total_updates=1, resume=False, write_config=False)
        try:
            return {k: np.asarray(v) for k, v in run.policy.params["value_head"].items()}
        finally:
            run.close()

    fresh = run_head(tiny_dir, tmp_path / "a")
    np.testing.assert_array_equal(fresh["w"], fresh_value_head(64, seed=5)["w"])
    zeros = run_head(tiny_dir, tmp_path / "b", ", value_head_init: zeros")
    np.testing.assert_array_equal(zeros["w"], np.zeros(64, np.float32))

    # a directory with a trained head: that head, whatever the init settings say
    model, tokenizer = load(tiny_dir, value_head=True, value_head_init="zeros")
    trained = {"w": np.linspace(-1, 1, 64, dtype=np.float32), "b": np.asarray([0.25], np.float32)}
    model.value_head["w"][...], model.value_head["b"][...] = jnp.asarray(trained["w"]), jnp.asarray(trained["b"])
    save_hf_dir(str(tmp_path / "trained"), model, tokenizer=tokenizer)
    kept = run_head(tmp_path / "trained", tmp_path / "c")
    np.testing.assert_array_equal(kept["w"], trained["w"])
    np.testing.assert_array_equal(kept["b"], trained["b"])


def test_a_zero_head_passes_no_gradient_to_the_layers_below_it(tiny_dir):
    # Why the default changed: the Bradley-Terry loss -log sigmoid(r(chosen) - r(rejected)) with
    # r = w . h has d loss / d h = -sigmoid(-margin) * w, which is 0 for w = 0, so at the first step
    # only the head moves and a full fine-tune at a small learning rate learns slowly.
    chosen, rejected = jnp.asarray([[5, 6, 7, 8]]), jnp.asarray([[5, 6, 9, 10]])

    @jax.jit
    def grads(graphdef, params):
        def loss(params):
            m = nnx.merge(graphdef, params)
            margin = m.values(m.forward(chosen)[0])[:, -1] - m.values(m.forward(rejected)[0])[:, -1]
            return -jnp.mean(jax.nn.log_sigmoid(margin))

        return jax.grad(loss)(params)

    def head_and_body_grads(init):
        graphdef, params = nnx.split(load(tiny_dir, value_head=True, value_head_init=init, seed=0)[0])
        g = nnx.to_pure_dict(grads(graphdef, params))
        head = g.pop("value_head")
        return head, max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g))

    zero_head, zero_body = head_and_body_grads("zeros")
    normal_head, normal_body = head_and_body_grads("normal")
    assert zero_body == 0.0 and float(jnp.max(jnp.abs(zero_head["w"]))) > 0  # only the head learns
    assert normal_body > 1e-4  # every layer learns from the first step
