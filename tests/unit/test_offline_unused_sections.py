"""Offline algorithms train on the data's rows: a rewards or sampling section they would ignore is
refused at load with the section named (it used to be accepted and silently unused)."""

import glob
import os

import pytest

from rljax.config import ConfigError, from_yaml, load_config, to_yaml
from rljax.run_config import RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DPO = 'model: {name: m}\ndata: {task: "", path: pairs.jsonl}\nalgorithm: {name: dpo}\n'


@pytest.mark.parametrize("algorithm", ["dpo", "reward_model", "records", "sft"])
def test_offline_algorithms_refuse_rewards_and_sampling(algorithm):
    base = DPO.replace("name: dpo", f"name: {algorithm}")
    with pytest.raises(ConfigError, match=rf"rewards: {algorithm} is an offline algorithm: it never scores"):
        from_yaml(RunConfig, base + "rewards: {answer: 1.0}\n")
    with pytest.raises(ConfigError, match=rf"sampling: {algorithm} is an offline algorithm: it never samples"):
        from_yaml(RunConfig, base + "sampling: {max_new_tokens: 32}\n")
    cfg = from_yaml(RunConfig, base)  # without them it loads, and so does the config a run writes
    assert from_yaml(RunConfig, to_yaml(cfg)) == cfg


def test_online_algorithms_keep_both_and_shipped_offline_configs_load():
    cfg = from_yaml(RunConfig, "algorithm: {name: grpo}\nrewards: {answer: 1.0}\nsampling: {max_new_tokens: 32}\n")
    assert cfg.sampling.max_new_tokens == 32
    offline = [path for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
               if not load_config(RunConfig, path).is_online]
    assert len(offline) >= 5  # dpo, records, reward_model (two), sft
