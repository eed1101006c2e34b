"""DPO on a tiny random model: learning on held-out pairs, cached vs live reference, micro-batches,
LoRA, and the wiring of every preference loss."""

import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.algorithms import dpo
from rljax.config import from_yaml
from rljax.losses.preference import LOSS_TYPES, preference_loss
from rljax.algorithms.dpo import DPOConfig
from rljax.run_config import RunConfig
from rljax.training import OfflineTrainer
from rljax.training.offline import offline_update, score_batch

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pixel", "lemon", "violet"]


def toy_pairs(path, n=160, seed=0):
    """Chosen: lowercase letters; rejected: digits. Every response is fresh, so held-out pairs test
    whether the model learned the pattern, not the strings."""
    rng = random.Random(seed)
    text = lambda alphabet: "".join(rng.choice(alphabet) for _ in range(rng.randint(6, 10)))  # noqa: E731
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Say something about {rng.choice(WORDS)} {i}.",
                                "chosen": text("abcdefghijklmnopqrstuvwxyz"), "rejected": text("0123456789")}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory):
    return toy_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


def _cfg(tiny_dir, pairs_path, run_dir, *, steps=12, offline="", model="", micro=8, save="false"):
    return from_yaml(RunConfig, f"""
model: {{name: {tiny_dir} {model}}}
data: {{task: "", path: {pairs_path}, eval_size: 32, max_prompt_length: 64, eval_fraction: 0.2}}
algorithm: {{name: dpo, batch_size: 16, micro_batch_size: {micro}, max_completion_length: 16, beta: 0.5
            {offline}}}
optim: {{learning_rate: 3.0e-3}}
train: {{steps: {steps}, run_dir: {run_dir}, progress: false, save_model: {save}}}
""")


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _strip(ms):
    return [{k: v for k, v in m.items() if not k.startswith("time") and k != "time"} for m in ms]


def test_dpo_raises_heldout_preference_accuracy_and_margin(tiny_dir, pairs_path, tmp_path, monkeypatch):
    monkeypatch.setenv("RLJAX_PLOT", "1")  # an offline run ends with RUN_DIR/curves.png (off in the suite)
    summary = OfflineTrainer(_cfg(tiny_dir, pairs_path, tmp_path)).fit()
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    before, after = summary["before"], summary["after"]
    assert summary["data"]["eval_rows"] >= 16 and summary["data"]["train_rows"] >= 120
    # the policy starts as the reference: implicit rewards are exactly zero
    assert before["eval/rewards/margin"] == 0.0 and before["eval/loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert after["eval/rewards/accuracy"] >= 0.95, after
    assert after["eval/rewards/margin"] > 2.0, after
    assert after["eval/loss"] < 0.2 * before["eval/loss"]
    assert after["eval/logps/rejected"] < before["eval/logps/rejected"]
    train = [m for m in _metrics(tmp_path) if "rewards/accuracy" in m]
    assert len(train) == 12 and {"rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen",
                                 "logps/rejected", "grad_norm", "loss"} <= set(train[0])
    assert np.mean([m["rewards/margin"] for m in train[-3:]]) > np.mean([m["rewards/margin"] for m in train[:3]])


@pytest.mark.parametrize("model", ["", ", lora_rank: 4, lora_targets: [wq, wv]"])
def test_cached_reference_equals_live_reference(tiny_dir, pairs_path, tmp_path, model):
    # (with LoRA the live reference is the base model, adapters' B zeroed: no copy either way)
    cached = OfflineTrainer(_cfg(tiny_dir, pairs_path, tmp_path / "cached", steps=3, model=model))
    live = OfflineTrainer(_cfg(tiny_dir, pairs_path, tmp_path / "live", steps=3, model=model,
                               offline=", precompute_ref_logprobs: false"))
    assert (live.run.ref_params is not None) == (not model) and cached.run.ref_params is None  # the cache: no copy
    assert "ref_logps" in cached.train_set.values and "ref_logps" not in live.train_set.values
    cached.fit()
    live.fit()
    a, b = _strip(_metrics(tmp_path / "cached")), _strip(_metrics(tmp_path / "live"))
    assert [m["step"] for m in a] == [m["step"] for m in b] == [0, 1, 2, 3, 3]
    for ma, mb in zip(a, b):
        assert set(ma) == set(mb)
        for k in ma:
            np.testing.assert_allclose(ma[k], mb[k], rtol=1e-5, atol=1e-6, err_msg=f"step {ma['step']} {k}")
    for pa, pb in zip(jax.tree.leaves(cached.run.policy.params), jax.tree.leaves(live.run.policy.params)):
        np.testing.assert_allclose(np.asarray(pa), np.asarray(pb), rtol=1e-5, atol=1e-6)


def test_micro_batches_give_the_full_batch_update(tiny_dir, pairs_path, tmp_path):
    # micro-batched = whole batch is an algebraic equality: checked in float64, where it holds to ~1e-15
    with jax.enable_x64(True):
        trainer = OfflineTrainer(_cfg(tiny_dir, pairs_path, tmp_path, steps=2, model=", dtype: float64"))
        # one step first: while the policy is the reference every margin is rounding noise around 0,
        # and the fraction of them above 0 (rewards/accuracy) is noise, not algebra (measured 0.1875 vs 0.25)
        trainer.step_once()
        batch = jax.tree.map(jnp.asarray, trainer.batch(trainer.train_set, range(16)))
        policy = trainer.run.policy
        assert {str(x.dtype) for x in jax.tree.leaves(policy.params)} == {"float64"}
        runs, updated = {}, {}
        for num_micro in (2, 1):
            params, opt_state = jax.tree.map(jnp.copy, (policy.params, policy.opt_state))  # donated
            updated[num_micro], _, runs[num_micro] = offline_update(
                policy.graphdef, params, policy.frozen, opt_state, batch, optimizer=policy.optimizer,
                algorithm="dpo", cfg=trainer.cfg.algorithm, num_micro=num_micro)
    assert runs[1].keys() == runs[2].keys()
    for k in ("loss", "preference/loss", "grad_norm", "rewards/accuracy", "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(runs[2][k], runs[1][k], rtol=1e-12, atol=1e-12, err_msg=k)
    for p2, p1 in zip(*(jax.tree.leaves(updated[n]) for n in (2, 1))):
        np.testing.assert_allclose(np.asarray(p2), np.asarray(p1), rtol=0, atol=1e-12)
    assert max(float(np.max(np.abs(np.asarray(p1) - np.asarray(p0)))) for p1, p0 in
               zip(jax.tree.leaves(updated[1]), jax.tree.leaves(policy.params))) > 1e-4  # the update moved them


def test_dpo_with_lora_learns_and_trains_only_adapters(tiny_dir, pairs_path, tmp_path):
    cfg = _cfg(tiny_dir, pairs_path, tmp_path, steps=10, model=", lora_rank: 4, lora_alpha: 8.0, lora_targets: [wq, wv, w_up]", save="true")
    trainer = OfflineTrainer(cfg)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(trainer.run.policy.params)[0]]
    assert paths and all("lora" in p for p in paths)
    summary = trainer.fit()
    assert summary["after"]["eval/rewards/accuracy"] >= 0.9, summary["after"]
    # the exported directory has the adapters merged: its log-probs are the trained policy's
    from rljax.models import load

    model, _ = load(summary["model_dir"])
    graphdef, params = nnx.split(model)
    batch = trainer.batch(trainer.eval_set, range(16))
    merged = score_batch(graphdef, params, nnx.State({}), batch, algorithm="dpo")[0]
    adapted = score_batch(*trainer.run.policy.split, batch, algorithm="dpo")[0]
    np.testing.assert_allclose(np.asarray(merged), np.asarray(adapted), rtol=1e-4)


@pytest.mark.parametrize("loss_type,extra", [(t, {}) for t in LOSS_TYPES] + [("sigmoid", {"reference_free": True}),
                                                                            ("cdpo", {"label_smoothing": 0.1}),
                                                                            ("robust", {"label_smoothing": 0.2})])
def test_every_preference_loss_is_selectable_by_config(loss_type, extra):
    cfg = DPOConfig(loss_type=loss_type, beta=0.3, simpo_gamma=0.4, **extra)
    key = jax.random.split(jax.random.key(0), 4)
    logps = -jax.random.uniform(key[0], (5, 2)) * 20
    ref = -jax.random.uniform(key[1], (5, 2)) * 20
    lengths = jnp.asarray([[3, 4], [5, 6], [2, 2], [7, 1], [4, 4]], jnp.float32)
    mask = jnp.asarray([1, 1, 1, 1, 0])
    got, metrics = dpo.pair_loss(logps, lengths, ref, mask, cfg)
    want, _ = preference_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], loss_type=loss_type, beta=0.3,
                              simpo_gamma=0.4, chosen_lengths=lengths[:, 0], rejected_lengths=lengths[:, 1],
                              mask=mask, **extra)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen"} <= set(metrics)
    assert dpo.needs_reference(cfg) == (loss_type != "simpo" and not extra.get("reference_free", False))


def test_reference_free_and_simpo_skip_the_reference_pass(tiny_dir, pairs_path, tmp_path):
    for name, offline in (("simpo", ", loss_type: simpo"), ("reference_free", ", reference_free: true")):
        trainer = OfflineTrainer(_cfg(tiny_dir, pairs_path, tmp_path / name, offline=offline))
        assert trainer.ref_seconds == 0.0 and trainer.run.ref_params is None
        assert "ref_logps" not in trainer.train_set.values and "ref_logps" not in trainer.eval_set.values


def test_a_margin_column_makes_sigmoid_dpo_odpo():
    # ODPO (arXiv:2402.10571): -log sigmoid(beta * delta - alpha * margin), by hand.
    cfg = DPOConfig(loss_type="sigmoid", beta=0.5, margin_column="margin", odpo_alpha=2.0)
    logps = jnp.asarray([[-3.0, -5.0], [-4.0, -2.0], [-6.0, -6.5], [-1.0, -9.0]])
    ref = jnp.asarray([[-3.5, -4.5], [-4.0, -3.0], [-6.0, -6.0], [0.0, 0.0]])
    margin = jnp.asarray([0.5, 0.0, 1.5, 7.0])
    mask = jnp.asarray([1, 1, 1, 0])
    lengths = jnp.ones((4, 2))
    got, metrics = dpo.pair_loss(logps, lengths, ref, mask, cfg, margin=margin)
    delta = (np.asarray(logps[:, 0]) - np.asarray(ref[:, 0])) - (np.asarray(logps[:, 1]) - np.asarray(ref[:, 1]))
    per_pair = np.log1p(np.exp(-(0.5 * delta - 2.0 * np.asarray(margin))))
    np.testing.assert_allclose(got, per_pair[:3].mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["preference/loss"], got, rtol=1e-6)
    np.testing.assert_allclose(metrics["odpo/offset_mean"], 2.0 * 2.0 / 3, rtol=1e-6)
    # the implicit-reward metrics do not see the offset; without a margin column it is plain DPO
    _, plain = dpo.pair_loss(logps, lengths, ref, mask, DPOConfig(loss_type="sigmoid", beta=0.5))
    for k in ("rewards/chosen", "rewards/margin", "rewards/accuracy", "logps/chosen"):
        np.testing.assert_allclose(metrics[k], plain[k], rtol=1e-6, err_msg=k)
    # the offset is a constant: the gradient is that of the hand formula
    grad = jax.grad(lambda lp: dpo.pair_loss(lp, lengths, ref, mask, cfg, margin=margin)[0])(logps)
    s = 1.0 / (1.0 + np.exp(0.5 * delta - 2.0 * np.asarray(margin)))  # sigmoid(-(beta delta - offset))
    want = -0.5 * s * np.asarray(mask) / 3
    np.testing.assert_allclose(grad[:, 0], want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad[:, 1], -want, rtol=1e-5, atol=1e-7)


def test_odpo_trains_from_a_margin_column_and_other_losses_refuse_it(tiny_dir, tmp_path):
    from rljax.config import ConfigError

    rows = [json.loads(line) for line in open(toy_pairs(tmp_path / "plain.jsonl", n=64))]
    path = tmp_path / "margins.jsonl"
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({**row, "strength": float(i % 3)}) + "\n")
    summary = OfflineTrainer(_cfg(tiny_dir, path, tmp_path / "run", steps=2,
                                  offline=", margin_column: strength, odpo_alpha: 0.5")).fit()
    train = [m for m in _metrics(tmp_path / "run") if "odpo/offset_mean" in m and m["step"] > 0]
    assert len(train) >= 2 and all(0.0 <= m["odpo/offset_mean"] <= 1.0 for m in train)
    assert "eval/odpo/offset_mean" in summary["after"]
    with pytest.raises(ConfigError, match="ODPO"):
        from_yaml(RunConfig, f"algorithm: {{name: dpo, margin_column: strength, loss_type: ipo}}\n"
                             f"data: {{path: {path}}}")


def test_replace_train_split_continues_as_a_run_started_on_the_new_rows(tiny_dir, pairs_path, tmp_path):
    # iterated DPO: train on one split, swap in another; the policy, optimizer state, schedule and
    # reference (the kept initial copy) carry on, so the next updates equal those of a trainer built on
    # the new rows from the same parameters and optimizer state
    new_path = toy_pairs(tmp_path / "round2.jsonl", n=80, seed=7)
    live = ", precompute_ref_logprobs: false"
    a = OfflineTrainer(_cfg(tiny_dir, pairs_path, tmp_path / "a", steps=4, offline=live))
    b = OfflineTrainer(_cfg(tiny_dir, new_path, tmp_path / "b", steps=4, offline=live))
    for _ in range(2):
        a.step_once()
    b.run.policy.params, b.run.policy.opt_state = jax.tree.map(jnp.copy, (a.run.policy.params, a.run.policy.opt_state))
    assert a.replace_train_split(new_path) == len(b.train_set) >= 16
    assert [r["prompt"] for r in a.train_set.rows] == [r["prompt"] for r in b.train_set.rows]
    assert a.step == 2
    for _ in range(2):
        ma, mb = a.step_once(), b.step_once()
        for k in ("loss", "rewards/accuracy", "logps/chosen", "grad_norm"):
            np.testing.assert_allclose(ma[k], mb[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert a.step == 4
    for pa, pb in zip(jax.tree.leaves(a.run.policy.params), jax.tree.leaves(b.run.policy.params)):
        np.testing.assert_allclose(np.asarray(pa), np.asarray(pb), rtol=1e-5, atol=1e-6)


def test_replace_train_split_refuses_a_cached_reference_after_an_update(tiny_dir, pairs_path, tmp_path):
    new_path = toy_pairs(tmp_path / "round2.jsonl", n=80, seed=7)
    trainer = OfflineTrainer(_cfg(tiny_dir, pairs_path, tmp_path / "run", steps=2))
    # before any update the policy is the reference: the new rows' reference log-probs are cached
    n = trainer.replace_train_split(new_path)
    assert trainer.train_set.values["ref_logps"].shape == (n, 2)
    trainer.step_once()
    with pytest.raises(ValueError, match="precompute_ref_logprobs=false"):
        trainer.replace_train_split(new_path)
    few = toy_pairs(tmp_path / "few.jsonl", n=12, seed=8)
    live = OfflineTrainer(_cfg(tiny_dir, pairs_path, tmp_path / "live", steps=2,
                               offline=", precompute_ref_logprobs: false"))
    with pytest.raises(ValueError, match="fewer than algorithm.batch_size=16"):
        live.replace_train_split(few)


def test_pairs_identical_after_truncation_are_dropped_and_counted_at_load(tiny_dir, tmp_path):
    # 40 pairs that differ only past 16 tokens (byte tokenizer: one token per character) and 40 that
    # differ at once: the first 40 would be identical after the cut (a loss stuck at log 2)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(80):
            shared = "abcdefghijklmnopqrst" if i < 40 else ""
            f.write(json.dumps({"prompt": f"Say something {i}.", "chosen": shared + "good", "rejected": shared + "bad"}) + "\n")
    trainer = OfflineTrainer(_cfg(tiny_dir, tmp_path / "pairs.jsonl", tmp_path / "run"))
    counts = trainer.start_metrics()
    dropped = counts.get("data/train_dropped/identical_after_truncation", 0)
    dropped += counts.get("data/eval_dropped/identical_after_truncation", 0)
    assert dropped == 40 and counts["data/train_rows"] + counts["data/eval_rows"] == 40
    assert all(len({tuple(c) for c in cs}) == 2 for s in (trainer.train_set, trainer.eval_set) for cs in s.completions)
    trainer.run.close()
