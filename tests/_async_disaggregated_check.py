"""Run by tests/system/test_async_disaggregated.py. ``disaggregated`` (8 simulated CPU devices): a tiny
asynchronous GRPO run with mesh.rollout_devices=4 (devices 0-3 generate, 4-7 train), then the refusals
of bad rollout_devices; ``colocated`` (4 devices): the same run on one 4-device mesh. Prints one JSON
line: the run's metrics and final parameters' checksum, where its arrays live, the errors."""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rljax.config import ConfigError  # noqa: E402
from rljax.rewards.base import per_sample, register_reward  # noqa: E402
from rljax.training import OnlineTrainer  # noqa: E402
from tests._tiny import make_tiny_model_dir, tiny_run_config  # noqa: E402

register_reward("lowercase", lambda: per_sample(lambda c, example: sum(x.islower() for x in c) / max(len(c), 1)),
                overwrite=True)


def devices_of(tree):
    return sorted({d.id for leaf in jax.tree.leaves(tree) for d in leaf.devices()})


def main():
    root = tempfile.mkdtemp()
    model = os.path.join(root, "model")
    make_tiny_model_dir(model)
    disaggregated = sys.argv[1] == "disaggregated"
    cfg = tiny_run_config(model, os.path.join(root, "run"), train={"steps": 3, "max_staleness": 1, "save_model": False},
                          mesh={"rollout_devices": 4} if disaggregated else {})
    trainer = OnlineTrainer(cfg)
    summary = trainer.fit()
    with open(os.path.join(root, "run", "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "loss" in m]
    sampler = trainer._sampling_policy()
    params = [np.asarray(x, np.float64) for x in jax.tree.leaves(trainer.run.policy.params)]
    report = {"devices": jax.device_count(), "train_devices": devices_of(trainer.run.policy.params),
              "train_mesh": [d.id for d in trainer.run.mesh.devices.flat],
              "rollout_mesh": disaggregated and [d.id for d in trainer.run.rollout_mesh.devices.flat],
              "sampler_devices": devices_of(sampler[1]), "steps": steps,
              "params": [float(np.sum(p)) for p in params] + [float(np.sum(np.abs(p))) for p in params],
              "eval": [summary["before"]["eval/reward"], summary["after"]["eval/reward"]], "errors": {}}
    if not disaggregated:
        print(json.dumps(report))
        return
    for n, mesh in [(8, {}), (3, {"fsdp": 4}), (0, {})]:
        try:
            OnlineTrainer(tiny_run_config(model, os.path.join(root, f"bad{n}"), train={"max_staleness": 1},
                                          mesh={"rollout_devices": n, **mesh}))
            report["errors"][str(n)] = None
        except ConfigError as err:
            report["errors"][str(n)] = str(err)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
