"""rljax.metrics_trl.trl_metrics: TRL GRPOTrainer's metric names and definitions, hand-computed."""

import math

import numpy as np
import pytest

from rljax.metrics_trl import trl_metrics

NAN = float("nan")

# Two groups of G = 3. Rewards: acc (weight 1) and fmt (weight 0.5); acc missed row 3.
#   acc = [1, 0, 1, NaN, 0, 0]   fmt = [0, 0, 0, 1, 1, 1]
#   total (missing counts 0) = [1, 0, 1 | 0.5, 0.5, 0.5]
#   rewards/acc/mean = 2/5 = 0.4; Bessel std: Σ(x − 0.4)² = 3·0.16 + 2·0.36 = 1.2, /4 -> √0.3
#   rewards/fmt/mean = 0.5;       Bessel std: 6·0.25 = 1.5, /5 -> √0.3
#   reward = 3.5 / 6
#   group 0 std (Bessel): mean 2/3, Σ dev² = 1/9 + 4/9 + 1/9 = 2/3, /2 -> √(1/3); group 1 std 0
#   reward_std = √(1/3) / 2 = 0.2886751; frac_reward_zero_std = 1/2
#   lengths [3, 8, 5, 8, 2, 4]: mean 5, min 2, max 8; truncated rows 1 and 3: clipped_ratio 1/3
PER_FUNCTION = {"acc": np.array([1, 0, 1, NAN, 0, 0.0]), "fmt": np.array([0, 0, 0, 1, 1, 1.0])}
TOTAL = np.array([1, 0, 1, 0.5, 0.5, 0.5], np.float32)
LENGTHS = np.array([3, 8, 5, 8, 2, 4])
TRUNCATED = np.array([False, True, False, True, False, False])
UPDATE = {"policy/entropy": 1.25, "kl/mean": 0.02, "policy/clip_frac_low": 0.1, "policy/clip_frac_high": 0.05,
          "policy/clip_frac_low_seq_min": 0.0, "policy/clip_frac_high_seq_max": 0.25, "loss": 3.0}


def _metrics(**overrides):
    args = dict(per_function=PER_FUNCTION, total=TOTAL, group_size=3, completion_lengths=LENGTHS,
                truncated=TRUNCATED, update_metrics=UPDATE, learning_rate=1e-5, epoch=0.75, num_tokens=1234)
    return trl_metrics(**{**args, **overrides})


def test_hand_computed_two_groups():
    m = _metrics()
    expect = {
        "learning_rate": 1e-5, "epoch": 0.75, "num_tokens": 1234,
        "rewards/acc/mean": 0.4, "rewards/acc/std": math.sqrt(0.3),
        "rewards/fmt/mean": 0.5, "rewards/fmt/std": math.sqrt(0.3),
        "reward": 3.5 / 6, "reward_std": math.sqrt(1 / 3) / 2, "frac_reward_zero_std": 0.5,
        "completions/mean_length": 5.0, "completions/min_length": 2.0, "completions/max_length": 8.0,
        "completions/clipped_ratio": 1 / 3,
        "entropy": 1.25, "kl": 0.02, "clip_ratio/low_mean": 0.1, "clip_ratio/high_mean": 0.05,
        "clip_ratio/region_mean": 0.15, "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 0.25,
    }
    assert set(m) == set(expect)
    for key, value in expect.items():
        np.testing.assert_allclose(m[key], value, rtol=1e-6, err_msg=key)
    assert isinstance(m["num_tokens"], int)


def test_only_what_the_step_produced():
    # no reference (kl_coef 0) and a loss without a clip: TRL logs neither kl nor clip_ratio/*
    m = _metrics(update_metrics={"policy/entropy": 0.5})
    assert m["entropy"] == 0.5
    assert not [k for k in m if k == "kl" or k.startswith("clip_ratio/")]


def test_group_size_one_has_no_group_statistics():
    m = _metrics(group_size=1)
    assert "reward_std" not in m and "frac_reward_zero_std" not in m
    np.testing.assert_allclose(m["reward"], 3.5 / 6)


def test_a_function_that_scored_at_most_one_row():
    m = _metrics(per_function={"acc": np.array([NAN, NAN, 1, NAN, NAN, NAN]), "none": np.full(6, NAN)})
    assert m["rewards/acc/mean"] == 1.0 and math.isnan(m["rewards/acc/std"])
    assert math.isnan(m["rewards/none/mean"]) and math.isnan(m["rewards/none/std"])


def test_rows_not_in_whole_groups_are_refused():
    with pytest.raises(ValueError, match="multiple of group_size 4"):
        _metrics(group_size=4)


def test_reward_kl_is_the_mean_of_the_estimate_over_counted_tokens():
    # the KL PPO / RLOO / REINFORCE++ put in the reward, as `kl`: log π_old − log π_ref per token
    # (k1) over the loss mask's tokens only: row 0 [0.5, −0.25], row 1's first token 1.0 (its second,
    # not counted, would add −12): mean (0.5 − 0.25 + 1.0) / 3
    import jax.numpy as jnp

    from rljax.batches import RolloutBatch
    from rljax.training.online import reward_kl

    old = jnp.asarray([[-1.0, -2.0], [-0.5, -3.0]])
    ref = jnp.asarray([[-1.5, -1.75], [-1.5, 9.0]])
    ones = jnp.ones((2, 2), jnp.int32)
    batch = RolloutBatch(prompt_ids=ones, prompt_mask=ones, completion_ids=ones, completion_mask=ones,
                         loss_mask=jnp.asarray([[1, 1], [1, 0]], jnp.int32), old_logprobs=old,
                         scores=jnp.zeros(2), row_mask=jnp.ones(2, bool), finished=jnp.ones(2, bool),
                         ref_logprobs=ref)
    np.testing.assert_allclose(reward_kl(batch, estimator="k1"), 1.25 / 3, rtol=1e-6)
    # k3 = exp(d) − d − 1 with d = ref − old: [e^−0.5 − 0.5, e^0.25 − 1.25, e^−1 + 0]
    k3 = (math.exp(-0.5) - 0.5 + math.exp(0.25) - 1.25 + math.exp(-1.0)) / 3
    np.testing.assert_allclose(reward_kl(batch, estimator="k3"), k3, rtol=1e-6)
