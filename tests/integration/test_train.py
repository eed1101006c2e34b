"""End-to-end online RL on a tiny random model: learning, determinism, resume, failures, configs."""

import collections
import dataclasses
import glob
import json
import os

import jax
import numpy as np
import pytest

from rljax.config import from_yaml, load_config
from rljax.rewards.base import per_sample, register_reward
from rljax.run_config import RunConfig
from rljax.training import OnlineTrainer as Trainer
from rljax.training import trainer_for
from rljax.update import NonFiniteLossError
from tests._tiny import tiny_run_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lowercase_fraction(completion, example):
    return sum(c.islower() for c in completion) / max(len(completion), 1)


def _raises_on_sevens(completion, example):
    if "7" in example["prompt"]:
        raise ValueError("this reward cannot score prompts with a 7")
    return 0.0


register_reward("lowercase", lambda: per_sample(_lowercase_fraction), overwrite=True)
register_reward("flaky", lambda: per_sample(_raises_on_sevens), overwrite=True)
register_reward("constant", lambda: per_sample(lambda completion, example: 1.0), overwrite=True)


def _bounded_stub():
    """A reward that reports bound hits as the bounded verifiers do: every second sample "timed out"."""
    def stub(completions, examples):
        stub.bound_hits["timeout"] += len(completions) // 2
        return np.zeros(len(completions))

    stub.bound_hits = collections.Counter()
    return stub


register_reward("bounded_stub", _bounded_stub, overwrite=True)


def _cfg(tiny_dir, run_dir, algo="grpo", extra="", steps=12, rewards="{lowercase: 1.0}"):
    return tiny_run_config(tiny_dir, run_dir, algorithm=f"{{name: {algo}{extra}}}",
                           train={"steps": steps, "samples_every": 4}, rewards=rewards)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train_rewards(run_dir):
    return [m["reward/total/mean"] for m in _metrics(run_dir) if "reward/total/mean" in m]


@pytest.mark.parametrize("algo,extra", [("grpo", ", kl_coef: 0.01"), ("rloo", ", kl_coef: 0.01"), ("ppo", ", kl_coef: 0.01"),
                                        # the critic settings of test_resume_equals_uninterrupted's PPO: one compiled update
                                        ("ppo", ", kl_coef: 0.01, critic: separate, critic_learning_rate: 3.0e-3"),
                                        ("rloo", ", kl_coef: 0.01, loss: reinforce"),  # the paper's REINFORCE form
                                        ("reinforce_pp", ", kl_coef: 0.01"),
                                        ("reinforce", ", kl_coef: 0.01")])  # moving-average baseline
def test_reward_rises(tiny_dir, tmp_path, algo, extra):
    summary = Trainer(_cfg(tiny_dir, tmp_path, algo, extra, steps=16)).fit()
    rewards = _train_rewards(tmp_path)
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.1, rewards
    assert summary["after"]["eval/lowercase"] > summary["before"]["eval/lowercase"] + 0.2, summary
    separate = ("critic/loss" in _metrics(tmp_path)[1]) and ("critic/grad_norm" in _metrics(tmp_path)[1])
    assert separate == ("separate" in extra)
    _check_trl_metrics([m for m in _metrics(tmp_path) if "loss" in m],
                       clipped="reinforce" not in extra and algo != "reinforce")


def test_the_second_step_reuses_the_first_steps_compiled_update(tiny_dir, tmp_path):
    # the update's outputs come back under XLA's name for the parameters' sharding; the trainer puts
    # them back under the inputs' own (rljax.sharding.keep_shardings), or step 2 compiled again
    from rljax.sharding import shardings_of
    from rljax.training import online

    trainer = Trainer(_cfg(tiny_dir, tmp_path, "grpo", ", kl_coef: 0.01", steps=3))
    before = shardings_of((trainer.run.policy.params, trainer.run.policy.opt_state))
    trainer.step_once()
    compiled = online.update_epochs._cache_size()
    assert shardings_of((trainer.run.policy.params, trainer.run.policy.opt_state)) == before
    trainer.step_once()
    assert online.update_epochs._cache_size() == compiled


def test_a_step_called_on_its_own_reuses_the_programs_fit_compiled(tiny_dir, tmp_path):
    # fit runs inside the run's mesh, and JAX keys a traced program on the context mesh: a step called
    # outside fit enters that mesh too (rljax.training.loop.in_run_mesh), or it traced and compiled
    # every program again (and without fit's activation constraints)
    from rljax.training import online

    Trainer(_cfg(tiny_dir, tmp_path / "fit", "grpo", ", kl_coef: 0.01", steps=1)).fit()
    compiled = online.update_epochs._cache_size()
    trainer = Trainer(_cfg(tiny_dir, tmp_path / "alone", "grpo", ", kl_coef: 0.01", steps=1))
    trainer.step_once()
    trainer.evaluate()
    assert online.update_epochs._cache_size() == compiled


def test_bfloat16_with_float32_master_weights_learns_and_checkpoints_its_master(tiny_dir, tmp_path):
    # model.dtype bfloat16 + optim.master_dtype float32: AdamW on a float32 master, bfloat16 weights;
    # 16 steps as test_reward_rises (with 10, the reward rose +0.097 against the +0.1 bar once the
    # prompt width changed from 24 to 20: bfloat16 matmuls round differently at another width)
    cfg = _cfg(tiny_dir, tmp_path, "grpo", ", kl_coef: 0.01", steps=16)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"),
                              optim=dataclasses.replace(cfg.optim, master_dtype="float32"))
    trainer = Trainer(cfg)
    summary = trainer.fit()
    rewards = _train_rewards(tmp_path)
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.1, rewards
    assert summary["after"]["eval/lowercase"] > summary["before"]["eval/lowercase"] + 0.2, summary
    p = trainer.run.policy
    assert {str(x.dtype) for x in jax.tree.leaves(p.params)} == {"bfloat16"}
    assert {str(x.dtype) for x in jax.tree.leaves(p.opt_state.master)} == {"float32"}
    for w, m in zip(jax.tree.leaves(p.params), jax.tree.leaves(p.opt_state.master)):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(m.astype(w.dtype)))
    # the checkpoint holds the master and the float32 moments: a resume restores them bit for bit
    restored = Trainer(cfg, resume=True).run.policy
    assert type(restored.opt_state) is type(p.opt_state)
    for got, want in zip(jax.tree.leaves((restored.params, restored.opt_state)), jax.tree.leaves((p.params, p.opt_state))):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


TRL_KEYS = ("learning_rate", "epoch", "num_tokens", "completions/mean_length", "completions/min_length",
            "completions/max_length", "completions/clipped_ratio", "rewards/lowercase/mean", "rewards/lowercase/std",
            "reward", "reward_std", "frac_reward_zero_std", "entropy", "kl")
CLIP_KEYS = ("clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
             "clip_ratio/region_mean")


def _check_trl_metrics(steps, *, clipped):
    """TRL GRPOTrainer's metrics in every training step's line (rljax.metrics_trl), with sane values."""
    for m in steps:
        missing = [k for k in TRL_KEYS + (CLIP_KEYS if clipped else ()) if k not in m]
        assert not missing, (m["step"], missing)
        assert clipped or not any(k.startswith("clip_ratio/") for k in m)
        assert m["learning_rate"] == pytest.approx(1e-2)
        assert m["epoch"] == pytest.approx(m["step"] * 4 / 64)  # 4 of the 64 training prompts a step
        assert 1 <= m["completions/min_length"] <= m["completions/mean_length"] <= m["completions/max_length"] <= 8
        assert 0 <= m["completions/clipped_ratio"] <= 1 and 0 <= m["frac_reward_zero_std"] <= 1
        assert m["completions/clipped_ratio"] == pytest.approx(1 - m["completion/stopped_frac"])
        assert m["reward"] == pytest.approx(m["reward/total/mean"], abs=1e-6)
        assert m["rewards/lowercase/mean"] == pytest.approx(m["reward/lowercase/mean"])
        assert m["reward_std"] >= 0 and m["rewards/lowercase/std"] >= 0 and m["entropy"] > 0
        assert m["kl"] == m["kl/mean"] and np.isfinite(m["kl"])
        if clipped:
            assert 0 <= m["clip_ratio/low_min"] <= m["clip_ratio/low_mean"] <= 1
            assert 0 <= m["clip_ratio/high_mean"] <= m["clip_ratio/high_max"] <= 1
    tokens = [m["num_tokens"] for m in steps]  # cumulative prompt + completion tokens, each step at least
    assert all(isinstance(t, int) for t in tokens)  # 16 rows of a prompt token and a completion token
    assert all(b - a >= 32 for a, b in zip([0] + tokens, tokens)), tokens


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_ppo_value_loss_falls(tiny_dir, tmp_path, critic):
    # A constant score of 1: the returns are a fixed target (1 at every token with gamma = 1 and no
    # KL and lambda = 1), so the zero-initialised value head's loss must fall from 0.5 towards 0.
    Trainer(_cfg(tiny_dir, tmp_path, "ppo", f", vf_coef: 1.0, lam: 1.0, critic: {critic}", steps=10,
                 rewards="{constant: 1.0}")).fit()
    value_losses = [m["value/loss"] for m in _metrics(tmp_path) if "value/loss" in m]
    assert value_losses[0] == pytest.approx(0.5, abs=0.05)
    assert value_losses[-1] < 0.25 * value_losses[0], value_losses


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_separate_critics_value_loss_never_reaches_the_policy(tiny_dir, tmp_path):
    # One step with vf_coef 0.01 and 10: the critics' updates differ, the policies' are identical to
    # the bit (the first step's values come from the same initial critic, and the policy's loss has
    # no value term). The policy is LoRA-adapted and has no value head; the critic is fully trained.
    trainers = {}
    for vf_coef in (0.01, 10.0):
        cfg = _cfg(tiny_dir, tmp_path / str(vf_coef), "ppo", f", vf_coef: {vf_coef}, kl_coef: 0.05, critic: separate",
                   steps=1)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_rank=4, lora_targets=("wq", "wv")))
        trainer = Trainer(cfg)
        before = (_leaves(trainer.run.policy.params), _leaves(trainer.run.critic.params))
        trainer.step_once()
        trainers[vf_coef] = (trainer, before)
    (small, (policy0, critic0)), (large, _) = trainers[0.01], trainers[10.0]
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(small.run.policy.params)]
    assert len(names) == 4 and all("_lora_" in n for n in names), names
    assert any(not np.array_equal(a, b) for a, b in zip(policy0, _leaves(small.run.policy.params)))  # the policy learned
    for a, b in zip(_leaves(small.run.policy.params), _leaves(large.run.policy.params)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(small.run.critic.params), _leaves(large.run.critic.params)))
    # The head starts at zero, so the first step moves only the head; from the second on the whole
    # critic (every transformer weight, not LoRA) trains.
    assert small.step == 1  # step_once advances the step
    small.step_once()
    moved = {jax.tree_util.keystr(p): not np.array_equal(a, np.asarray(b)) for (p, b), a in
             zip(jax.tree_util.tree_leaves_with_path(small.run.critic.params), critic0)}
    assert all(moved.values()), moved


def test_same_seed_same_metrics(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RLJAX_PLOT", "1")  # an online run ends with RUN_DIR/curves.png (off in the suite)
    Trainer(_cfg(tiny_dir, tmp_path / "a", steps=3)).fit()
    assert (tmp_path / "a" / "curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    monkeypatch.setenv("RLJAX_PLOT", "0")
    Trainer(_cfg(tiny_dir, tmp_path / "b", steps=3)).fit()
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("time")} for m in ms]
    assert strip(_metrics(tmp_path / "a")) == strip(_metrics(tmp_path / "b"))


# GRPO's resume to the uninterrupted run, bit for bit: tests/system/test_preemption.py (a refused update
# resumed in-process; SIGTERM and SIGKILL resumed from periodic saves)
@pytest.mark.parametrize("algo,extra", [("ppo", ", kl_coef: 0.01, critic: separate, "
                                         "critic_learning_rate: 3.0e-3"),
                                        # the baseline carried across steps is checkpointed and restored
                                        ("reinforce", ", baseline_decay: 0.5")])
def test_resume_equals_uninterrupted(tiny_dir, tmp_path, algo, extra):
    # (with a separate critic, its parameters and optimizer state are checkpointed and restored too)
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("time")} for m in ms]
    Trainer(_cfg(tiny_dir, tmp_path / "full", algo, extra, steps=4)).fit()
    cfg = _cfg(tiny_dir, tmp_path / "resumed", algo, extra, steps=4)

    half = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=2, save_every=2))
    Trainer(half).fit()
    Trainer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, save_every=2)), resume=True).fit()
    full = [m for m in strip(_metrics(tmp_path / "full")) if "loss" in m]
    resumed = [m for m in strip(_metrics(tmp_path / "resumed")) if "loss" in m]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert full == resumed
    if algo == "reinforce":  # steps 3-4 used the baseline of steps 1-2, read back from the checkpoint
        assert len({m["algorithm/baseline"] for m in resumed}) == 4, resumed


def test_a_reward_that_raises_does_not_stop_the_run(tiny_dir, tmp_path):
    Trainer(_cfg(tiny_dir, tmp_path, steps=3, rewards="{lowercase: 1.0, flaky: 0.5, bounded_stub: 0.0}")).fit()
    missing = [m["reward/missing_count"] for m in _metrics(tmp_path) if "reward/missing_count" in m]
    assert len(missing) == 3 and sum(missing) > 0
    # a bounded reward's hits are logged per step (16 samples: 8 "timed out") and per evaluation (8 prompts)
    steps = [m for m in _metrics(tmp_path) if "loss" in m]
    assert [m["reward/bounded_stub/timeouts"] for m in steps] == [8.0, 8.0, 8.0]
    assert all(m["reward/bounded_stub/memory"] == m["reward/bounded_stub/crashes"] == 0.0 for m in steps)
    evals = [m["eval/bounded_stub/timeouts"] for m in _metrics(tmp_path) if "eval/bounded_stub/timeouts" in m]
    assert evals and set(evals) == {4.0}


def test_nan_loss_stops_with_a_clear_error_and_keeps_a_checkpoint(tiny_dir, tmp_path):
    cfg = _cfg(tiny_dir, tmp_path, steps=5)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, learning_rate=1e30, grad_clip=None))
    with pytest.raises(NonFiniteLossError, match="not finite"):
        Trainer(cfg).fit()
    assert glob.glob(os.path.join(tmp_path, "checkpoints", "*"))
    assert os.path.getsize(os.path.join(tmp_path, "metrics.jsonl")) > 0


def test_bad_config_names_the_key(tmp_path):
    from rljax.config import ConfigError

    with pytest.raises(ConfigError, match="algorithm.name"):
        from_yaml(RunConfig, "algorithm: {name: sac}\nrewards: {answer: 1.0}")
    with pytest.raises(ConfigError, match="optim.learning_rat"):
        from_yaml(RunConfig, "optim: {learning_rat: 1.0}\nrewards: {answer: 1.0}")
    with pytest.raises(ConfigError, match="rewards"):
        from_yaml(RunConfig, "train: {steps: 1}")
    # a setting of another algorithm is refused with its key named, not silently ignored
    with pytest.raises(ConfigError, match="algorithm.critic: .*'critic' is a setting of ppo"):
        from_yaml(RunConfig, "algorithm: {name: grpo, critic: separate}\nrewards: {answer: 1.0}")
    with pytest.raises(ConfigError, match="algorithm.gamma: .*does nothing for algorithm 'grpo'"):
        from_yaml(RunConfig, "algorithm: {name: grpo, gamma: 0.9}\nrewards: {answer: 1.0}")
    with pytest.raises(ConfigError, match="algorithm.missing_eos_penalty: .*setting of ppo"):
        from_yaml(RunConfig, "algorithm: {name: rloo, missing_eos_penalty: 1.0}\nrewards: {answer: 1.0}")
    with pytest.raises(ConfigError, match="epsilon_high does nothing with loss: reinforce"):
        from_yaml(RunConfig, "algorithm: {name: rloo, loss: reinforce, epsilon_high: 0.28}\nrewards: {answer: 1.0}")
    with pytest.raises(ConfigError, match="rewards"):
        from_yaml(RunConfig, "algorithm: {name: reinforce_pp}")
    with pytest.raises(ConfigError, match="optim.grad_clip: must be > 0 \\(null = no clipping\\)"):  # not a sentinel
        from_yaml(RunConfig, "optim: {grad_clip: 0.0}\nrewards: {answer: 1.0}")


# the RLHF recipe's configs read each other's outputs: tests/integration/test_rlhf_recipe.py runs them as a chain;
# sft_* configs read a generator's transcripts: tests/integration/test_sft.py runs them
@pytest.mark.parametrize("path", sorted(p for p in glob.glob(os.path.join(REPO, "configs", "*.yaml"))
                                        if not os.path.basename(p).startswith(("rlhf_sentiment_", "sft_"))))
def test_every_config_parses_and_runs_a_smoke_step(path, tiny_dir, tmp_path):
    overrides = [f"model.name={tiny_dir}", "train.steps=1", f"train.run_dir={tmp_path}", "train.progress=false",
                 "data.train_size=32", "data.eval_size=4",
                 "data.max_prompt_length=512"]  # byte-level tiny tokenizer: long prompts
    cfg = load_config(RunConfig, path, overrides)
    if cfg.is_online:  # offline algorithms refuse a sampling section they would never use
        cfg = load_config(RunConfig, path, overrides + ["sampling.max_new_tokens=4"])
    summary = trainer_for(cfg).fit()
    assert summary["steps"] == 1
    if cfg.is_online:
        assert "eval/reward" in summary["after"]
    else:  # dpo, reward_model, records: the held-out objective
        assert "eval/loss" in summary["after"]
