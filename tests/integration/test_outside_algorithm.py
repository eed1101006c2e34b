"""An algorithm written outside rljax, in a file of its own, named from YAML and trained."""

import json
import os
import textwrap

import numpy as np
import pytest

from rljax.config import ConfigError, from_yaml, load_config
from rljax.rewards.base import per_sample, register_reward
from rljax.run_config import RunConfig
from rljax.training import trainer_for
from tests._tiny import make_tiny_model_dir

# A leave-one-out policy gradient built only on the public contract (rljax.algorithms.base and
# rljax.algorithms.policy_gradient): its own config section with a setting rljax does not have.
OUTSIDE = textwrap.dedent('''
    import dataclasses
    from typing import Literal

    import jax.numpy as jnp

    from rljax.algorithms import policy_gradient as pg
    from rljax.algorithms.base import OnlineAlgorithm


    @dataclasses.dataclass(frozen=True)
    class LeaveOneOutConfig(pg.ClipSettings):
        name: Literal["leave_one_out"] = "leave_one_out"
        advantage_scale: float = 1.0  # multiplies every advantage

        def validate(self):
            super().validate()
            if self.advantage_scale <= 0:
                raise ValueError(f"advantage_scale must be > 0, got {self.advantage_scale}")


    def advantages(batch, cfg):
        g = cfg.group_size
        scores = jnp.where(batch.row_mask, batch.scores, 0.0).reshape(-1, g)
        baseline = (scores.sum(-1, keepdims=True) - scores) / (g - 1)
        adv = (cfg.advantage_scale * (scores - baseline)).reshape(-1)
        return batch.replace(advantages=adv[:, None] * batch.loss_mask)


    def loss(model, batch, cfg, *, temperature, num_rows, num_tokens, max_length):
        out = pg.policy_logprobs(model, batch, cfg, temperature=temperature)
        return pg.clipped_loss(out, batch, cfg, num_rows=num_rows, num_tokens=num_tokens, max_length=max_length,
                               kl_in_loss=False, kl_estimator="k3")


    ALGORITHM = OnlineAlgorithm(name="leave_one_out", config=LeaveOneOutConfig, advantages=advantages, loss=loss,
                                needs_reference=lambda cfg: False)
''')


def _lowercase_fraction(completion, example):
    return sum(c.islower() for c in completion) / max(len(completion), 1)


register_reward("outside_lowercase", lambda: per_sample(_lowercase_fraction), overwrite=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def algorithm_file(tmp_path):
    path = tmp_path / "algos" / "leave_one_out.py"
    path.parent.mkdir()
    path.write_text(OUTSIDE)
    return str(path)


def _yaml(tiny_dir, run_dir, name, extra=""):
    return f"""
model: {{name: {tiny_dir}}}
data: {{task: addition, train_size: 64, eval_size: 8, max_prompt_length: 64}}
sampling: {{max_new_tokens: 8}}
algorithm: {{name: "{name}", group_size: 4, prompts_per_step: 4, micro_batch_size: 8{extra}}}
optim: {{learning_rate: 1.0e-2}}
train: {{steps: 16, run_dir: {run_dir}, progress: false, samples_every: null, save_model: false, plot: false}}
rewards: {{outside_lowercase: 1.0}}
"""


def test_an_algorithm_from_a_file_is_selected_from_yaml_and_learns(tiny_dir, tmp_path, algorithm_file):
    run_dir = tmp_path / "run"
    cfg = from_yaml(RunConfig, _yaml(tiny_dir, run_dir, f"{algorithm_file}:ALGORITHM", ", advantage_scale: 2.0"))
    assert type(cfg.algorithm).__name__ == "LeaveOneOutConfig" and cfg.algorithm.advantage_scale == 2.0
    assert cfg.is_online
    summary = trainer_for(cfg).fit()
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    rewards = [m["reward/total/mean"] for m in metrics if "reward/total/mean" in m]
    # on-policy with advantages that sum to 0 in each group the surrogate's value stays ~0; its gradient does not
    grad_norms = [m["grad_norm"] for m in metrics if "grad_norm" in m]
    assert len(rewards) == 16 and len(grad_norms) == 16 and min(grad_norms) > 0
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.1, rewards
    assert summary["after"]["eval/outside_lowercase"] > summary["before"]["eval/outside_lowercase"] + 0.2, summary
    # the saved config names the same file and loads again (a resume reads it)
    assert load_config(RunConfig, os.path.join(run_dir, "config.yaml")) == cfg


def test_an_outside_sections_keys_are_checked_against_its_config_class(tiny_dir, tmp_path, algorithm_file):
    name = f"{algorithm_file}:ALGORITHM"
    with pytest.raises(ConfigError, match=r"algorithm\.gamma: unknown key for LeaveOneOutConfig \(known keys: .*"
                                          r"advantage_scale"):
        from_yaml(RunConfig, _yaml(tiny_dir, tmp_path, name, ", gamma: 0.9"))
    with pytest.raises(ConfigError, match="algorithm: advantage_scale must be > 0, got -1.0"):
        from_yaml(RunConfig, _yaml(tiny_dir, tmp_path, name, ", advantage_scale: -1.0"))
    with pytest.raises(ConfigError, match=r"algorithm\.num_iterations: must be"):
        from_yaml(RunConfig, _yaml(tiny_dir, tmp_path, name, ", num_iterations: 0"))


def test_an_outside_algorithm_that_is_missing_or_not_an_algorithm_is_named(tiny_dir, tmp_path, algorithm_file):
    from rljax.errors import MissingFileError, UserError

    with pytest.raises(MissingFileError, match=r"algorithm\.name: algorithm 'nowhere/algo\.py:ALGORITHM': no such file"):
        from_yaml(RunConfig, _yaml(tiny_dir, tmp_path, "nowhere/algo.py:ALGORITHM"))
    with pytest.raises(UserError, match=r"has no attribute 'MISSING'; it defines .*ALGORITHM"):
        from_yaml(RunConfig, _yaml(tiny_dir, tmp_path, f"{algorithm_file}:MISSING"))
    with pytest.raises(UserError, match="is a function, not an rljax.algorithms.base.OnlineAlgorithm"):
        from_yaml(RunConfig, _yaml(tiny_dir, tmp_path, f"{algorithm_file}:advantages"))
    with pytest.raises(ConfigError, match=r"algorithm\.name: unknown tag 'grpoo'"):
        from_yaml(RunConfig, _yaml(tiny_dir, tmp_path, "grpoo"))


def test_a_package_module_algorithm_is_selected_by_module_name(tiny_dir, tmp_path, monkeypatch):
    package = tmp_path / "outside_algos_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loo.py").write_text(OUTSIDE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = from_yaml(RunConfig, _yaml(tiny_dir, tmp_path, "outside_algos_pkg.loo:ALGORITHM"))
    assert cfg.algorithm.name == "outside_algos_pkg.loo:ALGORITHM" and cfg.algorithm.advantage_scale == 1.0
