"""The RLHF recipe's chain (configs/rlhf_sentiment_*.yaml) on a tiny random model: pairs -> reward model -> PPO / GRPO.

Each stage runs its config as committed, from a working directory holding the recipe's `runs/` layout, with the
model swapped for the tiny one and the sizes cut; only the pairs' scorer is swapped too (VADER scores a tiny
model's random bytes 0, so every pair would tie): a python reward that tells the samples apart.

The chain's tests are marked heavy (run them with `-m heavy`): they took 82 s of CPU together (pairs, reward model,
PPO, GRPO; each stage compiles its own programs), over the default suite's budget for this file; each stage's
wiring is also covered by its own module's tests. The default suite keeps the configs' load-and-agree test.
"""

import glob
import json
import os

import pytest

from rljax.tools.cli import main as cli_main
from rljax.config import load_config
from rljax.run_config import RunConfig
from rljax.training import trainer_for
from tests._tiny import make_tiny_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "rlhf_sentiment_*.yaml")))
_SMALL = ["train.progress=false", "data.max_prompt_length=512", "sampling.max_new_tokens=4"]


def _config(stage: str, tiny_dir, *overrides) -> RunConfig:
    return load_config(RunConfig, os.path.join(REPO, "configs", f"rlhf_sentiment_{stage}.yaml"),
                       [f"model.name={tiny_dir}", *_SMALL, *overrides])


def test_every_rlhf_config_loads_and_the_stages_are_the_recipe():
    assert [os.path.basename(p) for p in CONFIGS] == [f"rlhf_sentiment_{s}.yaml" for s in
                                                      ("grpo", "pairs", "ppo", "rm")]
    cfgs = {os.path.basename(p)[len("rlhf_sentiment_"):-5]: load_config(RunConfig, p) for p in CONFIGS}
    assert cfgs["rm"].algorithm.name == "reward_model" and cfgs["rm"].data.path == "runs/rlhf_sentiment/pairs.jsonl"
    assert cfgs["rm"].data.eval_path == "runs/rlhf_sentiment/eval_pairs.jsonl"  # pairs of the held-out prompts
    for stage in ("ppo", "grpo"):
        cfg = cfgs[stage]
        assert cfg.algorithm.name == stage and cfg.algorithm.kl_coef > 0
        assert cfg.rewards["rm"] == {"type": "reward_model", "path": "runs/rlhf_sentiment_rm/model", "weight": 1.0}
        assert cfg.rewards["sentiment"] == {"type": "sentiment", "weight": 0.0}  # the gold scorer, logged only
        # the policies hold out the prompts the pairs were not built from: same file, seed and rule
        assert (cfg.data.path, cfg.data.eval_size, cfg.train.seed) == (
            cfgs["pairs"].data.path, cfgs["pairs"].data.eval_size, cfgs["pairs"].train.seed)
        assert cfg.data.chat == cfgs["rm"].data.chat == cfgs["pairs"].data.chat
    assert cfgs["ppo"].algorithm.critic == "shared"


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
    """A working directory after the recipe's first two stages (pairs, reward model) on a tiny model."""
    root = tmp_path_factory.mktemp("recipe")
    tiny_dir = make_tiny_model_dir(root / "tiny")
    cwd = os.getcwd()
    os.chdir(root)  # the configs' relative runs/ paths
    try:
        os.makedirs("runs/rlhf_sentiment")
        words = ["the", "film", "is", "a", "plot", "dull", "great", "story", "cast", "long"]
        with open("runs/rlhf_sentiment/prompts.jsonl", "w") as f:
            for i in range(48):
                f.write(json.dumps({"prompt": " ".join(words[(i * k) % 10] for k in (1, 3, 7)) + f" {i}"}) + "\n")
        with open("scorer.py", "w") as f:  # distinct scores for distinct texts
            f.write("def byte_sum(completions, **kw):\n    return [float(sum(c.encode())) for c in completions]\n")
        for split, out in (("train", "pairs"), ("eval", "eval_pairs")):
            assert cli_main(["pairs", os.path.join(REPO, "configs", "rlhf_sentiment_pairs.yaml"),
                             f"runs/rlhf_sentiment/{out}.jsonl", "--num-samples", "2", "--split", split,
                             f"model.name={tiny_dir}", *_SMALL, "data.train_size=24", "data.eval_size=4",
                             "rewards={scorer: {type: python, function: 'scorer.py:byte_sum'}}"]) == 0
        rm = trainer_for(_config("rm", tiny_dir, "algorithm.batch_size=4", "algorithm.micro_batch_size=4",
                                 "algorithm.max_completion_length=8")).fit()
    finally:
        os.chdir(cwd)
    return root, tiny_dir, rm


@pytest.mark.heavy
def test_rlhf_pairs_and_reward_model_stages(recipe_dir):
    root, _, rm = recipe_dir
    with open(root / "runs/rlhf_sentiment/pairs.jsonl") as f:
        pairs = [json.loads(line) for line in f]
    with open(root / "runs/rlhf_sentiment/eval_pairs.jsonl") as f:
        eval_prompts = {json.loads(line)["prompt"] for line in f}
    assert len(pairs) >= 16 and all(p["chosen_score"] > p["rejected_score"] for p in pairs)
    assert eval_prompts and not eval_prompts & {p["prompt"] for p in pairs}  # held out from the training pairs
    assert "eval/rewards/accuracy" in rm["after"]  # held-out pair accuracy
    assert (root / "runs/rlhf_sentiment_rm/model/value_head.safetensors").is_file()


def _policy_stage(stage, recipe_dir, monkeypatch):
    root, tiny_dir, _ = recipe_dir
    monkeypatch.chdir(root)
    summary = trainer_for(_config(stage, tiny_dir, "train.steps=1", "data.train_size=16", "data.eval_size=4",
                                  "algorithm.prompts_per_step=2")).fit()
    assert summary["steps"] == 1
    for when in ("before", "after"):  # both the learned reward and the gold scorer, held out
        assert {"eval/rm", "eval/sentiment"} <= set(summary[when])
    assert summary["after"]["eval/reward"] == pytest.approx(summary["after"]["eval/rm"])  # the gold weighs 0


@pytest.mark.heavy
def test_rlhf_ppo_stage_scores_with_the_learned_reward_and_logs_the_gold(recipe_dir, monkeypatch):
    _policy_stage("ppo", recipe_dir, monkeypatch)


@pytest.mark.heavy
def test_rlhf_grpo_stage_scores_with_the_learned_reward_and_logs_the_gold(recipe_dir, monkeypatch):
    _policy_stage("grpo", recipe_dir, monkeypatch)
