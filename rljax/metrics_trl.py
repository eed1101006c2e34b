"""TRL ``GRPOTrainer``'s training metrics, under TRL's names, from one online step's arrays and
rljax's own update metrics, so a researcher can put an rljax curve beside a TRL one.

    metrics.update(trl_metrics(per_function=..., total=..., group_size=G, completion_lengths=...,
                               truncated=..., update_metrics=metrics, learning_rate=..., epoch=...,
                               num_tokens=...))

Definitions (TRL ``trl/trainer/grpo_trainer.py``, ``_generate_and_score_completions`` and
``_compute_loss``), over the step's R = P·G rows, groups of G consecutive rows:

==============================  ==================================================================
``rewards/<name>/mean``         mean of that function over the rows it scored (NaN skipped)
``rewards/<name>/std``          Bessel std of the same values (TRL ``nanstd``; NaN under 2 values)
``reward``                      mean of the weighted total (a missing value counts 0, TRL ``nansum``)
``reward_std``                  mean over groups of the total's Bessel std within the group (TRL
                                up to v0.26; TRL from v0.27 logs the std over the whole batch here,
                                which rljax logs, without Bessel's correction, as ``reward/total/std``)
``frac_reward_zero_std``        fraction of groups whose total has std 0 (``torch.isclose``: ≤ 1e-8)
``completions/mean_length``     mean completion length in tokens (the stop token included), and
``completions/min_length``      ... its minimum and
``completions/max_length``      ... maximum over the rows
``completions/clipped_ratio``   fraction of rows cut at ``max_new_tokens`` (no stop token)
``entropy``                     mean per-token entropy of the policy (``policy/entropy``)
``kl``                          mean per-token KL estimate to the reference (``kl/mean``)
``clip_ratio/low_mean``         fraction of tokens with ρ < 1 − ε_low and A < 0 (``policy/clip_frac_low``)
``clip_ratio/high_mean``        fraction with ρ > 1 + ε_high and A > 0 (``policy/clip_frac_high``)
``clip_ratio/region_mean``      either (the two are disjoint: low + high)
``clip_ratio/low_min``          smallest per-row low fraction (``policy/clip_frac_low_seq_min``)
``clip_ratio/high_max``         largest per-row high fraction (``policy/clip_frac_high_seq_max``)
``learning_rate``, ``epoch``,   passed through: the rate the next update uses (HF ``Trainer`` logs
``num_tokens``                  the scheduler's rate after the step), passes over the training
                                prompts, prompt + completion tokens trained on so far
==============================  ==================================================================

The ``clip_ratio/*`` fractions count tokens, which is TRL's definition with a token-level ratio;
with GSPO's sequence-level ratio (``algorithm.ratio_level: sequence``) TRL counts sequences (each
row once), while these count the tokens of the clipped sequences, so a long clipped row weighs more.

With ``group_size`` 1 there are no groups: ``reward_std`` and ``frac_reward_zero_std`` are left
out. The update metrics (``entropy``, ``kl``, ``clip_ratio/*``) are the means over the step's
updates and appear only when the loss produced their rljax source (no ``kl`` without a reference,
as TRL logs none with ``beta = 0``; no ``clip_ratio/*`` for a loss without a clip, as TRL's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

# TRL name <- rljax update metric (means over the step's updates); the same quantities
_UPDATE_ALIASES = {
    "entropy": "policy/entropy",
    "kl": "kl/mean",
    "clip_ratio/low_mean": "policy/clip_frac_low",
    "clip_ratio/high_mean": "policy/clip_frac_high",
    "clip_ratio/low_min": "policy/clip_frac_low_seq_min",
    "clip_ratio/high_max": "policy/clip_frac_high_seq_max",
}


def trl_metrics(*, per_function: Mapping[str, np.ndarray], total: np.ndarray, group_size: int,
                completion_lengths: np.ndarray, truncated: np.ndarray, update_metrics: Mapping[str, float],
                learning_rate: float, epoch: float, num_tokens: int) -> dict[str, float]:
    """TRL ``GRPOTrainer``'s metrics of one online step (definitions: the module docstring).

    Args:
      per_function: name -> ``[R]`` unweighted values of each reward function, NaN where missing.
      total: ``[R]`` weighted total, a missing value counting 0; rows example-major (groups of
        ``group_size`` consecutive rows).
      group_size: completions per prompt (G).
      completion_lengths: ``[R]`` completion tokens of each row.
      truncated: ``[R]`` bool, the row never emitted a stop token.
      update_metrics: rljax's update metrics of the step (``policy/entropy``, ``kl/mean``, ...).
      learning_rate, epoch, num_tokens: passed through.
    """
    total = np.asarray(total, np.float64)
    lengths = np.asarray(completion_lengths, np.float64)
    if total.shape != lengths.shape or total.ndim != 1 or len(total) % group_size:
        raise ValueError(f"trl_metrics: total {total.shape} and completion_lengths {lengths.shape} must be "
                         f"[R] with R a multiple of group_size {group_size}")
    out: dict[str, float] = {"learning_rate": float(learning_rate), "epoch": float(epoch),
                             "num_tokens": int(num_tokens)}
    for name, values in per_function.items():
        scored = np.asarray(values, np.float64)
        scored = scored[~np.isnan(scored)]
        out[f"rewards/{name}/mean"] = float(scored.mean()) if scored.size else math.nan
        out[f"rewards/{name}/std"] = float(scored.std(ddof=1)) if scored.size > 1 else math.nan
    out["reward"] = float(total.mean()) if total.size else math.nan
    if group_size > 1 and total.size:
        group_std = total.reshape(-1, group_size).std(axis=1, ddof=1)  # [P]
        out["reward_std"] = float(group_std.mean())
        out["frac_reward_zero_std"] = float(np.mean(np.abs(group_std) <= 1e-8))
    if lengths.size:
        out["completions/mean_length"] = float(lengths.mean())
        out["completions/min_length"] = float(lengths.min())
        out["completions/max_length"] = float(lengths.max())
        out["completions/clipped_ratio"] = float(np.mean(np.asarray(truncated, bool)))
    for trl_name, rljax_name in _UPDATE_ALIASES.items():
        if rljax_name in update_metrics:
            out[trl_name] = float(update_metrics[rljax_name])
    if "clip_ratio/low_mean" in out and "clip_ratio/high_mean" in out:
        # low (A < 0) and high (A > 0) clipping never hit the same token: the region is their sum
        out["clip_ratio/region_mean"] = out["clip_ratio/low_mean"] + out["clip_ratio/high_mean"]
    return out


__all__ = ["trl_metrics"]
