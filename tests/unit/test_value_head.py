"""A fresh value / reward head: normal(0, 0.02) from the seed, or zeros; the default per algorithm.
(A run's head from the config, a checkpoint's head kept, and why a zero head is slow to learn:
tests/integration/test_reward_model_training.py.)"""

import numpy as np
import pytest

from rljax.config import ConfigError, from_yaml
from rljax.models import fresh_value_head
from rljax.run_config import RunConfig


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


def test_the_default_start_is_the_algorithms_unless_the_config_names_one():
    def init(yaml):
        return from_yaml(RunConfig, yaml).value_head_init

    assert init("algorithm: {name: reward_model}") == "normal"
    assert init("algorithm: {name: ppo}\nrewards: {answer: 1.0}") == "zeros"
    assert init("model: {value_head_init: normal}\nalgorithm: {name: ppo}\nrewards: {answer: 1.0}") == "normal"
    assert init("model: {value_head_init: zeros}\nalgorithm: {name: reward_model}") == "zeros"
