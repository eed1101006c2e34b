"""train.hang_timeout_s and train.stop_timeout_s: defaults and refusals (the watchdog itself runs in
tests/system/test_hangs.py, in subprocesses: it ends the process it watches)."""

import pytest

from rljax.config import ConfigError, load_config
from rljax.run_config import RunConfig, TrainSection


def test_defaults_leave_room_for_the_slowest_step_and_bound_a_stop():
    train = TrainSection()
    assert train.hang_timeout_s == 1800.0  # well above a step that compiles (minutes on a large model)
    assert train.stop_timeout_s == 60.0  # a stop signal during a hang ends the process within a minute


@pytest.mark.parametrize("override,message", [
    ("train.hang_timeout_s=0", "train.hang_timeout_s: .*> 0"),
    ("train.stop_timeout_s=-5", "train.stop_timeout_s: .*> 0"),
    ("train.hang_timeout_s=.inf", "train.hang_timeout_s"),
])
def test_bad_timeouts_are_refused_naming_the_key(override, message, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: tiny}\nrewards: {answer: 1.0}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, str(config), [override])


def test_null_turns_each_off(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: tiny}\nrewards: {answer: 1.0}\n")
    cfg = load_config(RunConfig, str(config), ["train.hang_timeout_s=null", "train.stop_timeout_s=null"])
    assert cfg.train.hang_timeout_s is None and cfg.train.stop_timeout_s is None
