"""Reward-model training on a tiny random model: held-out pairwise accuracy, K-wise lists, and the
saved model scoring online rollouts through the `reward_model` reward."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.config import from_yaml
from rljax.models import fresh_value_head, load
from rljax.models.hf_io import save_hf_dir
from rljax.rewards import build_rewards
from rljax.run_config import RunConfig
from rljax.training import OfflineTrainer, build_run

LOWER, DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"


def _text(rng, alphabet):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(6, 10)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Pairs (lowercase preferred to digits, with a margin column) and ranked lists of three
    (lowercase > half lowercase, half digits > digits), every response fresh."""
    rng = random.Random(1)
    root = tmp_path_factory.mktemp("data")
    with open(root / "pairs.jsonl", "w") as f:
        for i in range(160):
            f.write(json.dumps({"prompt": f"Write a word, please ({i}).", "chosen": _text(rng, LOWER),
                                "rejected": _text(rng, DIGITS), "margin": 0.5}) + "\n")
    with open(root / "ranked.jsonl", "w") as f:
        for i in range(120):
            mixed = _text(rng, LOWER)[:4] + _text(rng, DIGITS)[:4]
            f.write(json.dumps({"prompt": f"Write a word, please ({i}).",
                                "responses": [_text(rng, LOWER), mixed, _text(rng, DIGITS)]}) + "\n")
    return root


def _cfg(tiny_dir, path, run_dir, *, steps, offline=""):
    return from_yaml(RunConfig, f"""
model: {{name: {tiny_dir}}}
data: {{task: "", path: {path}, eval_size: 32, max_prompt_length: 64, eval_fraction: 0.2}}
algorithm: {{name: reward_model, batch_size: 16, max_completion_length: 16 {offline}}}
optim: {{learning_rate: 3.0e-3}}
train: {{steps: {steps}, run_dir: {run_dir}, progress: false}}
""")


def test_reward_model_beats_chance_on_heldout_pairs_and_scores_rollouts(tiny_dir, data_dir, tmp_path):
    cfg = _cfg(tiny_dir, data_dir / "pairs.jsonl", tmp_path, steps=15,
               offline=", margin_column: margin, centering_coef: 0.01")
    trainer = OfflineTrainer(cfg)
    summary = trainer.fit()
    before, after = summary["before"], summary["after"]
    # the head starts at normal(0, 0.02) (model.value_head_init): small scores that are not all zero
    assert 0.0 < abs(before["eval/rewards/margin"]) < 0.5, before
    assert after["eval/rewards/accuracy"] >= 0.9, after
    assert after["eval/rewards/margin"] > 1.0 and after["eval/loss"] < 0.5 * before["eval/loss"], after
    assert after["eval/reward_model/centering_loss"] >= 0.0

    # The saved model is a reward for online runs; it scores exactly as in training.
    rewards = build_rewards({"rm": {"type": "reward_model", "path": summary["model_dir"], "batch_size": 8}})
    rows = trainer.eval_set.rows
    out = rewards([r["chosen"] for r in rows] + [r["rejected"] for r in rows], rows + rows)
    chosen, rejected = out.total[: len(rows)], out.total[len(rows):]
    assert np.mean(chosen > rejected) == pytest.approx(after["eval/rewards/accuracy"])
    np.testing.assert_allclose(chosen.mean(), after["eval/rewards/chosen"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rejected.mean(), after["eval/rewards/rejected"], rtol=1e-4, atol=1e-5)


def test_kwise_reward_model_ranks_heldout_lists(tiny_dir, data_dir, tmp_path):
    cfg = _cfg(tiny_dir, data_dir / "ranked.jsonl", tmp_path, steps=12,
               offline=", rm_loss: kwise")
    summary = OfflineTrainer(cfg).fit()
    after = summary["after"]
    # accuracy over all C(3, 2) pairs of each held-out list; chance is 0.5
    assert after["eval/rewards/accuracy"] >= 0.85, after
    assert after["eval/loss"] < 0.5 * summary["before"]["eval/loss"]


def test_reward_model_reward_rejects_a_directory_without_a_head(tiny_dir):
    with pytest.raises(FileNotFoundError, match="value_head.safetensors"):
        build_rewards({"rm": {"type": "reward_model", "path": tiny_dir}})


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
