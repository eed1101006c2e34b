"""The off-policy settings in a tiny online run: the trainer recomputes π_old, keeps the sampler's
log-probs as μ, and logs the correction's metrics; the synchronous loop is on-policy up to numerics,
so the sampler and the trainer agree and the weights are 1."""

import json
import os

import numpy as np
import pytest

from rljax.losses.off_policy import OFF_POLICY_METRICS
from rljax.rewards.base import per_sample, register_reward
from rljax.training import OnlineTrainer as Trainer

# the tiny run's default reward (as tests/integration/test_train.py registers it)
register_reward("lowercase", lambda: per_sample(lambda c, example: sum(x.islower() for x in c) / max(len(c), 1)),
                overwrite=True)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


@pytest.mark.parametrize("algorithm", ["{name: grpo, off_policy_correction: token_tis, correction_bounds: [0, 2]}",
                                       "{name: ppo, off_policy_correction: seq_mask, "
                                       "correction_bounds: [0.999, 1.001]}"])
def test_a_run_with_a_correction_logs_sampler_and_trainer_agreeing(tiny_run_config, tmp_path, algorithm):
    Trainer(tiny_run_config(tmp_path, algorithm=algorithm)).fit()
    steps = _metrics(tmp_path)
    assert len(steps) == 2
    for m in steps:
        assert set(OFF_POLICY_METRICS) <= m.keys()
        # the sampler's log-probs and the trainer's forward pass of the same tokens agree (float32),
        # so nothing is truncated or rejected and every weight is 1 to that precision
        assert 0 <= m["policy/logp_diff_max"] < 1e-5, m["policy/logp_diff_max"]  # the design's float32 bar
        np.testing.assert_allclose([m["off_policy/weight_mean"], m["off_policy/weight_max"]], 1.0, atol=1e-5)
        assert m["off_policy/token_masked_frac"] == 0 and m["off_policy/row_masked_frac"] == 0
        assert np.isfinite(m["loss"])


def test_without_a_correction_nothing_is_recomputed_or_logged(tiny_run_config, tmp_path):
    trainer = Trainer(tiny_run_config(tmp_path, train={"steps": 1}))
    trainer.fit()
    assert not set(OFF_POLICY_METRICS) & _metrics(tmp_path)[0].keys()


def test_plan_compiles_the_update_with_the_sampler_log_probs(tmp_path):
    # rljax plan's abstract batch carries sampling_logprobs when a correction is on: without them the
    # update would not trace; with them its arguments grow by one [R, N] float32 array
    from rljax.config import from_yaml
    from rljax.run_config import RunConfig
    from rljax.tools.plan import plan_run

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 256,
        "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}))

    def update_program(correction):
        cfg = from_yaml(RunConfig, f"""
model: {{name: {model}}}
data: {{max_prompt_length: 16}}
sampling: {{max_new_tokens: 16}}
algorithm: {{name: grpo, group_size: 2, prompts_per_step: 2, off_policy_correction: {correction}}}
mesh: {{fsdp: 1}}
rewards: {{answer: 1.0}}
""")
        report = plan_run(cfg, "cpu-1", memory_bytes=2 ** 34)
        return {p.name: p for p in report.programs}["update"]

    plain, corrected = update_program("none"), update_program("seq_mask")
    assert corrected.argument_bytes - plain.argument_bytes == 4 * 16 * 4  # R = 4 rows, N = 16 tokens, float32
