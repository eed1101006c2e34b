"""train.max_staleness, train.partial_rollouts and mesh.rollout_devices: defaults and refusals at load
time, before step 0 (the asynchronous loop itself runs in tests/integration/test_async.py; the device
count checks of mesh.rollout_devices in tests/system/test_async_disaggregated.py)."""

import pytest

from rljax.config import ConfigError, load_config
from rljax.run_config import MeshSection, RunConfig, TrainSection


def test_defaults_are_the_synchronous_loop():
    train = TrainSection()
    assert train.max_staleness == 0 and train.partial_rollouts is False
    assert MeshSection().rollout_devices is None  # colocated


@pytest.mark.parametrize("overrides,message", [
    (["train.max_staleness=-1"], r"^train.max_staleness: must be >= 0"),
    (["train.max_staleness=1.5"], r"train.max_staleness: Value '1.5' of type 'float' could not be converted"),
    (["train.partial_rollouts=true"], r"^train.partial_rollouts: needs train.max_staleness >= 1"),
    (["train.partial_rollouts=true", "train.max_staleness=2", "sampling.engine=static"],
     r"^train.partial_rollouts: needs sampling.engine: paged"),
    (["train.partial_rollouts=true", "train.max_staleness=1", "environment.name=calculator", "rewards={}"],
     r"^train.partial_rollouts: is not supported with an environment"),
    (["mesh.rollout_devices=0", "train.max_staleness=1"], r"^mesh.rollout_devices: must be >= 1"),
    (["mesh.rollout_devices=2"], r"^mesh.rollout_devices: needs train.max_staleness >= 1"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, message, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: tiny}\nrewards: {answer: 1.0}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, str(config), overrides)


def test_good_settings_load(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: tiny}\nrewards: {answer: 1.0}\n")
    cfg = load_config(RunConfig, str(config), ["train.max_staleness=4", "train.partial_rollouts=true"])
    assert cfg.train.max_staleness == 4 and cfg.train.partial_rollouts
