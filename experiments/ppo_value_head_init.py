"""Does PPO's value head learn better from a normal(0, 0.02) start or from zero?

The question behind ``model.value_head_init`` (rljax/models/value_head.py): a reward model learns
much faster from transformers' normal(0.02) score head than from a zero head (issue 15), and the
reference PPO implementations (TRL, verl, OpenRLHF) start their critics the same way. Some PPO
write-ups start the value head at zero so the first value targets are not fitted against noise.
This runs short PPO runs with each start, shared head and separate critic, over a few seeds, and
reports the value loss, explained variance and reward.

    PYTHONPATH=. nice -n 10 python experiments/ppo_value_head_init.py [--steps 20] [--seeds 0,1,2]

Task: the tiny random Llama of ``rljax.models.tiny`` (2 layers, width 64, byte tokenizer), prompts
from the addition task, reward = the fraction of lowercase letters in the completion (a learnable
reward the value head has to track as the policy moves). Full fine-tuning, lr 1e-2, 4 prompts x 4
samples per step, 8 new tokens, kl_coef 0.01, every other PPO setting its default. Writes
experiments/results/ppo_value_head_init.md.

Deviations from a real PPO run: a tiny random model, not SmolLM2 (12 SmolLM2 PPO runs do not fit
this 2-core CPU's budget); the numbers say how the two starts behave on one small problem, not how
they behave at scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from rljax.config import from_yaml
from rljax.models.tiny import make_tiny_model_dir
from rljax.tools.reporting import environment, markdown_table
from rljax.rewards.base import per_sample, register_reward
from rljax.run_config import RunConfig
from rljax.training import OnlineTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def _lowercase_fraction(completion, example):
    return sum(c.islower() for c in completion) / max(len(completion), 1)


register_reward("lowercase", lambda: per_sample(_lowercase_fraction), overwrite=True)


def _config(model_dir: str, run_dir: str, *, init: str, critic: str, seed: int, steps: int) -> RunConfig:
    return from_yaml(RunConfig, f"""
model: {{name: {model_dir}, value_head_init: {init}}}
data: {{task: addition, train_size: 64, eval_size: 16, max_prompt_length: 64}}
sampling: {{max_new_tokens: 8}}
algorithm: {{name: ppo, group_size: 4, prompts_per_step: 4, micro_batch_size: 8, kl_coef: 0.01, critic: {critic}}}
optim: {{learning_rate: 1.0e-2}}
train: {{steps: {steps}, seed: {seed}, run_dir: {run_dir}, progress: false, save_model: false}}
rewards: {{lowercase: 1.0}}
""")


def _one_run(model_dir: str, run_dir: str, **kw) -> dict[str, float]:
    summary = OnlineTrainer(_config(model_dir, run_dir, **kw)).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if "value/loss" in r]
    last = train[-5:]
    return {
        "first value loss": train[0]["value/loss"],
        "last-5 value loss": statistics.fmean(r["value/loss"] for r in last),
        "last-5 explained variance": statistics.fmean(r["value/explained_variance"] for r in last),
        "last-5 reward": statistics.fmean(r["reward/total/mean"] for r in last),
        "eval reward after": summary["after"]["eval/lowercase"],
    }


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "ppo_value_head_init.md"))
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(os.path.join(tmp, "model"))
        for critic in ("shared", "separate"):
            for init in ("normal", "zeros"):
                for seed in seeds:
                    run_dir = os.path.join(tmp, f"{critic}-{init}-{seed}")
                    out = _one_run(model_dir, run_dir, init=init, critic=critic, seed=seed, steps=args.steps)
                    print(critic, init, seed, out, flush=True)
                    results.setdefault((critic, init), []).append(out)
    keys = list(next(iter(results.values()))[0])
    rows = [[critic, init, *[_mean_std([r[k] for r in runs]) for k in keys]]
            for (critic, init), runs in results.items()]
    table = markdown_table(["critic", "value_head_init", *keys], rows)
    env = environment()
    text = (f"# PPO value head: normal(0, 0.02) vs zero start\n\n"
            f"`experiments/ppo_value_head_init.py --steps {args.steps} --seeds {args.seeds}`: tiny random Llama, "
            f"lowercase-fraction reward, {args.steps} PPO steps, mean ± std over seeds {args.seeds}. "
            f"\"last-5\": mean over the last 5 steps.\n\n{table}\n\n"
            f"jax {env['packages'].get('jax')}, {env['cpu_count']} CPUs, commit {env['git_commit']}\n")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
