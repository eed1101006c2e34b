"""Reward-model over-optimisation, in miniature: gold vs proxy reward against d = √KL.

Paper: Gao, Schulman, Hilton, "Scaling Laws for Reward Model Overoptimization", arXiv:2210.10760,
Figures 1 and 2 (gold and proxy reward model score against d = √KL(π ‖ π_init) for best-of-n and for
RL, one curve per proxy reward model) and the functional forms of section 3 / Eq. (1)-(2).
Claims tested:

1. **The proxy keeps rising while the gold score peaks and falls** (Goodhart: optimising the proxy
   past a point makes the gold score worse).
2. **The gold peak comes later (at a larger d) with more reward-model data.**
3. **The functional forms fit**: R_bon(d) = d(α − βd) for best-of-n and R_RL(d) = d(α − β log d)
   for RL (R = gold score minus the initial policy's; least squares, linear in α and β).

Setup, top to bottom (``main``), per seed:

1. π_ref: the tiny Llama pretrained on the VADER movie-review snippets of the DPO reproduction
   (``_sentiment_corpus.pretrain_reference``, cached under ``runs/paper_repro/_cache/``).
   Prompt: the first 3 words of a snippet; continuation: up to 20 tokens.
2. Gold reward: the VADER compound score of the continuation (``rljax.rewards.sentiment``), in
   [-1, 1], as in the DPO reproduction.
3. Preference pairs: ``pair_samples`` π_ref samples per training prefix, taken two at a time; the
   one with the higher gold score is "chosen" (ties dropped; ``rljax.data.preferences.best_vs_worst_pairs``
   on each pair). The pairs are shuffled once per seed; the RM trained on N pairs gets the first N
   (nested sets). Held-out pairs are built the same way from the held-out prefixes.
4. Proxy RMs: rljax's ``algorithm.name=reward_model`` (Bradley-Terry, a scalar head on π_ref's
   trunk, ``rljax.training.OfflineTrainer``) for each N in ``rm_sizes``; held-out pair accuracy is reported.
5. Best-of-n: ``bon_samples`` π_ref samples per held-out prefix, scored by gold and every proxy.
   For each n the expected gold (and proxy) score of the proxy's choice among n samples is computed
   exactly from the pool (the unbiased estimator over all n-subsets, :func:`best_of_n_expectation`);
   KL_bon = log n − (n − 1)/n (the paper's analytic value).
6. RL: GRPO (``rljax.training.OnlineTrainer``, ``algorithm.name=grpo``, no KL penalty as in the
   paper's main runs) with the ``reward_model`` reward (the proxy) for each RM; every
   ``rl_eval_every`` steps (and at step 0) the policy is sampled on the held-out prefixes: mean gold,
   mean proxy, and KL(π ‖ π_ref) = mean of Σ_t log π − log π_ref over the samples (sampler log-probs
   vs a forward pass of π_ref).
7. Scores are reported relative to π_ref (gold minus π_ref's mean gold; proxy minus the proxy's mean
   on π_ref's samples), so every curve starts at (0, 0), the paper's convention.

Verdicts (plain rules on the numbers, in ``results.md``): claim 1, per method and RM size, the
"peak" is the evaluation point with the highest seed-mean gold; paired over seeds, gain = gold at
the peak − gold at d = 0, fall = gold at the peak − gold at the last point, and rise = proxy at the
last point − proxy at the peak; a curve is over-optimised ("yes") when all three are clearly
positive (``_arith_policy.clearly_positive``: every seed > 0 → yes, mean > one standard error →
partly; any "no" → no) and the mean fall is at least a tenth of the mean gain (else a plateau:
at most partly); the claim is "yes" when every curve is, "no" when none is, else "partly".
Claim 2: the peak's d (measured, and from the fit) against N, per method: strictly increasing →
yes, non-decreasing with an increase → partly, else no (all four yes → yes, all no → no); a curve
that is not over-optimised (claim 1 "no") counts as peaking beyond the measured range.
Claim 3: R² of the fit to the seed-pooled points, every curve ≥ 0.9 → yes, any < 0.5 → no, else
partly.

Command (after the set-up fetch ``python paper_repro/_sentiment_corpus.py --fetch``):

    python paper_repro/rm_overoptimization.py [--smoke|--full] [--seeds 0 1 2] [--out DIR]
    python paper_repro/rm_overoptimization.py --full --plan h100-1   # does --full fit one H100? (no GPU needed)

Writes ``runs/paper_repro/rm_overoptimization/<preset>/``: ``results.md``, ``overoptimization.png``
(gold and proxy vs d, best-of-n and RL, one line per RM size, the fitted forms dashed),
``curves.json``, ``config.json``, ``environment.json``.

The --full preset is sized for one NVIDIA H100 80GB; `--plan h100-1` (rljax plan with the cuda
extra, no GPU needed; 2026-11-24): the reward-model training and the GRPO run both fit, peak 1.96
GiB per GPU of the 59.33 GiB JAX's allocator takes (75 % of the 79.11 GiB GPU), in GRPO's update
(the reward model's 0.47 GiB; the proxy RM the GRPO run scores with, another copy of the 6-layer
trunk, is not in the plan).

Hardware and run time: a shared 2-core CPU (jax CPU backend). The default preset (3 seeds) took
23.3 min while other jobs loaded the machine (load average ~9; per seed: pairs ~0.5-1.3 min, four
RMs ~1-3 min, best-of-n pool ~45 s, four 300-step GRPO runs with evaluations ~1-1.6 min each), plus
~1 min to pretrain π_ref the first time (cached afterwards); a quiet machine should be faster.

Result of the default preset (``results.md``): claim 1 partly — RL on the 250-pair RM over-optimises
in every seed (gold +0.16 at d ≈ 5.3, back to +0.05 at d ≈ 8.3 while the proxy keeps rising);
best-of-n on the 3,000-pair RM flattens (partly); the other curves still rise at the largest d
reached (best-of-n d ≤ 2.13, where the 250-pair curve's small dip is not consistent across seeds;
RL gold near VADER's ceiling, +0.86 over π_ref, for the 3,000 and 8,000-pair RMs). Claim 2 partly:
the RMs with more data have not peaked within the range where the 250-pair RM's RL curve has,
but no trend is measurable among the larger RMs. Claim 3 no: R² 0.97-0.98 for best-of-n on the
larger RMs but 0.10-0.16 on the 250-pair RM's flat, noisy curves and 0.73-0.79 for RL, whose gold
curves are S-shaped (slow, then fast, then saturating) rather than d(α − β log d).

Deviations from the paper (numbered):

1. Policy and RMs: a 2-layer, 64-wide Llama (BPE vocabulary 2,048) trained from scratch on ~9,700
   movie-review snippets, instead of the paper's GPT-series policies (mostly 1.2B parameters) and
   proxy RMs of 3M-3B parameters; every proxy RM starts from π_ref itself, so RM size is not
   varied, only RM data (the paper varies both).
2. Gold reward: VADER (a lexicon and rules, in [-1, 1]), not a 6B reward model; like the paper's
   gold RM it labels the pairs without noise. VADER is easy to learn (the 8,000-pair RM ranks
   held-out pairs 85 % right, the 250-pair one 53 %) and bounded, so a good proxy can drive the
   gold near its maximum, leaving no room to fall within the KL the runs reach.
3. RM data: N ∈ {250, 1000, 3000, 8000} pairs (the paper: up to ~90k), two epochs each (the
   paper: one), so a small N also means fewer updates (14 steps at N = 250).
4. RL: GRPO (group-relative advantages, groups of 4, no KL penalty) instead of PPO; 300 steps
   of 16 prompts; KL measured on 64 held-out prefixes × 4 samples per evaluation (standard error
   ~0.1-0.5 nats), which makes d noisy and, for this tiny policy, not monotone in the step.
5. Best-of-n: n ≤ 256 from a pool of 256 samples per held-out prefix for 64 prefixes, so
   d_bon ≤ √(log 256 − 255/256) = 2.13; the paper's best-of-n reaches larger n.
6. Fits: per RM size to the seed-pooled points, R in VADER units; the "peak" of claim 1 is an
   evaluation point (the highest seed-mean gold), picked on the same data it is tested on.
7. Tuning, on seed 100 only (two trial runs before the measured run; no measured seed was
   chosen): a first trial with N ∈ {250, 1000, 4000} and 120 RL steps left every RL run but the
   250-pair one still rising in gold at d ≈ 3-3.5, so the default was lengthened to 300 steps and
   an 8,000-pair RM added (3,000 replacing 4,000). Learning rates (RM 1e-3, RL 3e-4) were set
   once from the DPO reproduction's and not varied. From what the seed-100 trial showed, a fall
   smaller than a tenth of the gain was made a plateau (before the measured run started), and,
   while the measured run was in progress and before its results were read, a curve that has not
   peaked was made to count as peaking beyond the range in claim 2 (before: at its last point).
   The run's own report used the earlier claim-2 rule and gave the same answers (partly / partly /
   no); ``--report-only`` rebuilt ``results.md`` with the rules above.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules below

import _sentiment_corpus as corpus  # noqa: E402
import dpo_sentiment_frontier as dpo  # noqa: E402  (its Sampler and evaluation point)
from _arith_policy import clearly_positive  # noqa: E402  (the verdict rule of the other reproductions)
from rljax.host_memory import keep_host_memory  # noqa: E402

NAME = "rm_overoptimization"
REPO_ROOT = Path(__file__).resolve().parents[1]
CLAIMS = {
    "overoptimization": "the proxy score keeps rising while the gold score peaks and then falls (Fig. 1)",
    "later_peak": "the gold peak comes later (larger d) with more RM data (Fig. 2)",
    "forms": "R_bon(d) = d(α − βd) and R_RL(d) = d(α − β log d) fit the gold curves (Eq. 1-2)",
}
METHODS = ("best-of-n", "RL")
MIN_FALL = 0.1  # a gold curve "falls" when it gives back at least this share of its gain (else a plateau)


@dataclasses.dataclass(frozen=True)
class Preset:
    """One setting of the whole reproduction."""

    pretrain: corpus.PretrainSettings = corpus.PretrainSettings()
    seeds: tuple[int, ...] = (0, 1, 2)
    # preference pairs and proxy reward models
    pair_prompts: int = 100_000  # training prefixes (at most; all 8,649 of the default split)
    pair_samples: int = 4  # π_ref samples per training prefix: pair_samples // 2 pairs each
    rm_sizes: tuple[int, ...] = (250, 1000, 3000, 8000)
    rm_epochs: float = 2.0
    rm_batch: int = 32
    rm_lr: float = 1e-3
    rm_eval_pairs: int = 512  # held-out prefixes (at most) giving one held-out pair each
    sample_batch: int = 512
    # evaluation prefixes, best-of-n
    eval_prompts: int = 64
    bon_samples: int = 256  # π_ref samples per held-out prefix
    best_of_n: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    # RL on the proxy
    rl_steps: int = 300
    rl_prompts_per_step: int = 16
    rl_group: int = 4
    rl_lr: float = 3e-4
    rl_kl_coef: float = 0.0
    rl_eval_every: int = 20
    eval_samples: int = 4  # samples per held-out prefix per RL evaluation


PRESETS = {
    "default": Preset(),
    # seconds: the 1-layer smoke reference, a few pairs, tiny RMs, two RL steps. Plumbing, not the claim.
    "smoke": Preset(pretrain=corpus.SMOKE_PRETRAIN, seeds=(0,), pair_prompts=128, rm_sizes=(16, 32, 48), rm_epochs=1.0,
                    rm_batch=8, rm_eval_pairs=16, sample_batch=128, eval_prompts=8, bon_samples=16,
                    best_of_n=(1, 2, 4, 8, 16), rl_steps=2, rl_prompts_per_step=4, rl_group=2, rl_eval_every=1,
                    eval_samples=2),
    # toward the paper on an accelerator: a larger reference and RMs, more RM data, longer RL.
    "full": Preset(pretrain=dataclasses.replace(corpus.PretrainSettings(), vocab_size=4096, layers=6, hidden=256,
                                                heads=8, kv_heads=4, response_words=12, max_response_tokens=32,
                                                epochs=8.0, learning_rate=1e-3),
                   seeds=(0, 1, 2, 3, 4), pair_samples=8, rm_sizes=(300, 1000, 3000, 10000, 30000), rm_epochs=1.0,
                   rm_lr=3e-4, eval_prompts=256, bon_samples=1024,
                   best_of_n=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), rl_steps=500, rl_prompts_per_step=64,
                   rl_lr=1e-4, rl_eval_every=25, eval_samples=8),
}


# ---------------------------------------------------------------------------------------------
# the estimators and the fits (pure numpy)


def bon_kl(n: int) -> float:
    """KL(best-of-n ‖ π_ref) = log n − (n − 1)/n nats (Stiennon et al. 2020; Gao et al. 2022, §2)."""
    return math.log(n) - (n - 1) / n


def best_of_n_expectation(proxy: np.ndarray, gold: np.ndarray, n: int) -> tuple[float, float]:
    """Expected ``(gold, proxy)`` score of best-of-n by the proxy, from pools ``[P, M]`` of π_ref samples.

    For each prefix the M samples are sorted by proxy score; the i-th smallest (1-based) is the
    proxy's choice among a uniformly random n-subset with probability C(i − 1, n − 1) / C(M, n), so
    Σ_i that · score_(i) is the exact mean over all n-subsets of the pool (an unbiased estimate of
    best-of-n's expected score, lower variance than disjoint groups). Averaged over prefixes.
    """
    P, M = proxy.shape
    if not 1 <= n <= M:
        raise ValueError(f"best-of-{n} needs 1 <= n <= {M} samples per prefix")
    total = math.comb(M, n)
    weights = np.array([math.comb(i - 1, n - 1) / total for i in range(1, M + 1)])  # [M], sums to 1
    order = np.argsort(proxy, axis=1, kind="stable")  # [P, M], ascending proxy
    gold_sorted = np.take_along_axis(gold, order, axis=1)
    proxy_sorted = np.take_along_axis(proxy, order, axis=1)
    return float((gold_sorted @ weights).mean()), float((proxy_sorted @ weights).mean())


FORMS = {"best-of-n": "d(α − βd)", "RL": "d(α − β log d)"}


def _design(method: str, d: np.ndarray) -> np.ndarray:
    """Columns ``[d, −d²]`` (best-of-n) or ``[d, −d log d]`` (RL; d log d → 0 at d = 0): R = X @ (α, β)."""
    d = np.asarray(d, dtype=np.float64)
    if method == "best-of-n":
        return np.stack([d, -d * d], axis=1)
    d_log_d = np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)
    return np.stack([d, -d_log_d], axis=1)


def fit_form(method: str, d: Sequence[float], reward: Sequence[float]) -> dict[str, float]:
    """Least-squares α, β of the paper's form for ``method`` (``FORMS``) to points ``(d, R)``, with
    R² = 1 − SS_res / SS_tot (SS_tot about the mean of R) and the fitted peak d*: α / (2β) for
    best-of-n, exp(α/β − 1) for RL; inf when β ≤ 0 < α (never turns down), 0 when α ≤ 0 < β (only
    falls), NaN when both are ≤ 0."""
    d, reward = np.asarray(d, np.float64), np.asarray(reward, np.float64)
    X = _design(method, d)
    (alpha, beta), *_ = np.linalg.lstsq(X, reward, rcond=None)
    residual = reward - X @ np.array([alpha, beta])
    ss_tot = float(np.sum((reward - reward.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residual ** 2)) / ss_tot if ss_tot > 0 else float("nan")
    if alpha <= 0 and beta <= 0:
        peak = float("nan")  # never rises and never turns down: no maximum
    elif beta <= 0:
        peak = float("inf")  # rises and never turns down: the peak lies beyond any d
    elif alpha <= 0:
        peak = 0.0  # turns down from the start: the best is π_ref itself
    elif method == "best-of-n":
        peak = float(alpha / (2 * beta))
    else:
        peak = float(math.exp(min(alpha / beta - 1.0, 700.0)))
    return {"alpha": float(alpha), "beta": float(beta), "r2": r2, "d_peak_fit": peak}


def form_curve(method: str, fit: dict[str, float], d: np.ndarray) -> np.ndarray:
    """The fitted form evaluated at ``d``."""
    return _design(method, d) @ np.array([fit["alpha"], fit["beta"]])


def trend(values: Sequence[float]) -> str:
    """``yes`` when strictly increasing, ``partly`` when non-decreasing with at least one increase, else
    ``no`` (NaN: no). ``inf`` is a peak beyond the measured range: above every finite value."""
    v = np.asarray(values, np.float64)
    if len(v) < 2 or np.any(np.isnan(v)):
        return "no"
    up, level = v[1:] > v[:-1], v[1:] >= v[:-1]  # pairwise, so inf (a peak beyond the range) compares
    if np.all(up):
        return "yes"
    return "partly" if np.all(level) and np.any(up) else "no"


# ---------------------------------------------------------------------------------------------
# pairs, reward models, RL


def _run_config(d: dict[str, Any]):
    from rljax.config import from_yaml
    from rljax.run_config import RunConfig

    return from_yaml(RunConfig, json.dumps(d))  # JSON is YAML


def gold_pairs(prompts: Sequence[str], texts: Sequence[str], gold: np.ndarray, samples: int) -> list[dict[str, Any]]:
    """Pairs of consecutive samples (``samples`` per prompt, prompt-major), the higher gold score
    chosen; ties and identical texts dropped (``best_vs_worst_pairs`` on each pair of two)."""
    from rljax.data.preferences import best_vs_worst_pairs

    examples = [{"prompt": x} for x in prompts for _ in range(samples // 2)]
    usable = len(examples) * 2
    per_prompt = np.arange(len(texts)).reshape(len(prompts), samples)[:, : (samples // 2) * 2].reshape(-1)
    pairs, _ = best_vs_worst_pairs(examples, [texts[i] for i in per_prompt], gold[per_prompt], num_samples=2)
    assert usable == len(per_prompt)
    return pairs


def rm_config(ref_dir: Path, pairs_path: Path, eval_path: Path, *, seed: int, preset: Preset, run_dir: Path):
    """The RunConfig of one proxy reward model's training (``train_reward_model``)."""
    p = preset.pretrain
    return _run_config({
        "model": {"name": str(ref_dir)},
        "data": {"task": "", "path": str(pairs_path), "eval_path": str(eval_path), "chat": False,
                 "max_prompt_length": 32, "too_long": "filter", "train_size": 0, "eval_size": preset.rm_eval_pairs},
        "algorithm": {"name": "reward_model", "rm_loss": "pairwise", "centering_coef": 0.01,
                      "batch_size": preset.rm_batch, "epochs": preset.rm_epochs,
                      "max_completion_length": p.max_response_tokens, "invalid_rows": "drop"},
        "optim": {"learning_rate": preset.rm_lr, "schedule": "cosine", "warmup_steps": 5},
        "train": {"seed": seed, "run_dir": str(run_dir), "progress": False, "save_model": True},
    })


def rl_config(ref_dir: Path, prompts_path: Path, rm_dir: Path, *, seed: int, preset: Preset, work: Path):
    """The RunConfig of one GRPO run on a proxy RM (``rl_run``)."""
    p = preset.pretrain
    return _run_config({
        "model": {"name": str(ref_dir)},
        "data": {"task": "", "path": str(prompts_path), "answer_column": "", "chat": False, "max_prompt_length": 32,
                 "too_long": "filter", "train_size": 100_000, "eval_size": 0, "eval_fraction": 0.0},
        "sampling": {"max_new_tokens": p.max_response_tokens, "temperature": 1.0},
        "algorithm": {"name": "grpo", "group_size": preset.rl_group, "prompts_per_step": preset.rl_prompts_per_step,
                      "kl_coef": preset.rl_kl_coef},
        "rewards": {"proxy": {"type": "reward_model", "path": str(rm_dir), "weight": 1.0,
                              "batch_size": preset.rl_prompts_per_step * preset.rl_group},
                    "gold": {"type": "sentiment", "weight": 0.0}},
        "optim": {"learning_rate": preset.rl_lr, "schedule": "constant"},
        "train": {"seed": seed, "steps": preset.rl_steps, "run_dir": str(work / f"rl_{rm_dir.parent.name}"),
                  "progress": False, "save_model": False},
    })


def plan_runs(preset: Preset, preset_name: str, out: Path, target: str, log) -> int:
    """``--plan TARGET``: ``rljax plan`` the preset's reward-model training and its GRPO run (the
    untrained reference's shapes, ``paper_repro/_plan.py``; the proxy RM the GRPO run scores with
    is not part of the plan); the worst exit status."""
    from _plan import config_only_model_dir
    from _plan import plan_runs as plan

    from rljax.models.tiny import tiny_config

    p = preset.pretrain
    work = out / "plan"
    ref_dir = Path(config_only_model_dir(str(work), tiny_config(
        p.vocab_size, layers=p.layers, hidden=p.hidden, heads=p.heads, kv_heads=p.kv_heads)))
    return plan([(f"reward model ({preset_name} preset)",
                  rm_config(ref_dir, work / "pairs.jsonl", work / "eval_pairs.jsonl", seed=0, preset=preset,
                            run_dir=work / "rm")),
                 (f"GRPO on the proxy ({preset_name} preset)",
                  rl_config(ref_dir, work / "prompts.jsonl", work / "rm" / "model", seed=0, preset=preset,
                            work=work))], target, log=log)


def train_reward_model(ref_dir: Path, pairs_path: Path, eval_path: Path, *, seed: int, preset: Preset, run_dir: Path,
                       log) -> tuple[Path, dict[str, float]]:
    """A Bradley-Terry RM on π_ref's trunk; returns its exported model directory and its held-out
    accuracy / margin before and after training."""
    from rljax.training import OfflineTrainer

    cfg = rm_config(ref_dir, pairs_path, eval_path, seed=seed, preset=preset, run_dir=run_dir)
    t0 = time.perf_counter()
    trainer = OfflineTrainer(cfg)
    summary = trainer.fit()
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    stats = {"pairs": len(trainer.train_set), "steps": trainer.total_steps,
             "eval_accuracy": summary["after"].get("eval/rewards/accuracy", float("nan")),
             "eval_margin": summary["after"].get("eval/rewards/margin", float("nan")),
             "seconds": round(time.perf_counter() - t0, 1)}
    log(f"  RM on {stats['pairs']} pairs: {stats['steps']} steps in {stats['seconds']:.0f} s, held-out accuracy "
        f"{stats['eval_accuracy']:.3f}")
    return run_dir / "model", stats


def rl_run(ref_dir: Path, prompts_path: Path, rm_dir: Path, *, seed: int, preset: Preset, work: Path,
           evaluate: Callable, log) -> list[dict[str, Any]]:
    """GRPO on the proxy RM's reward (gold logged with weight 0); ``evaluate(policy, ref)`` at step 0,
    every ``rl_eval_every`` steps and at the end."""
    import jax
    import jax.numpy as jnp

    from rljax.training import OnlineTrainer

    cfg = rl_config(ref_dir, prompts_path, rm_dir, seed=seed, preset=preset, work=work)
    trainer = OnlineTrainer(cfg)
    # π_ref: the parameters before any update (copied: the update donates the policy's buffers)
    ref = jax.tree.map(jnp.copy, trainer.run.policy.params)
    t0 = time.perf_counter()
    points = [{**evaluate(trainer.run.policy.split, ref), "step": 0}]
    while trainer.step < preset.rl_steps:
        metrics = trainer.step_once()  # advances trainer.step
        if trainer.step % preset.rl_eval_every == 0 or trainer.step == preset.rl_steps:
            point = evaluate(trainer.run.policy.split, ref)
            point.update(step=trainer.step, train_proxy=metrics.get("reward/proxy/mean"),
                         train_gold=metrics.get("reward/gold/mean"))
            points.append(point)
    log(f"  RL seed {seed} on {rm_dir.parent.name}: {preset.rl_steps} steps in {time.perf_counter() - t0:.0f} s; "
        f"last: d {points[-1]['d']:.2f}, gold {points[-1]['gold']:+.3f}, proxy {points[-1]['proxy']:+.3f}")
    return points


# ---------------------------------------------------------------------------------------------
# one seed


def run_seed(seed: int, preset: Preset, ref_dir: Path, train_prompts: list[str], heldout_prompts: list[str],
             eval_prompts: list[str], work: Path, log) -> dict[str, Any]:
    """Pairs, the proxy RMs, best-of-n and RL curves of one seed."""
    from flax import nnx

    from rljax import rng
    from rljax.data.preferences import write_jsonl
    from rljax.models import load
    from rljax.rewards import make_reward_model_reward

    p = preset.pretrain
    model, tokenizer = load(str(ref_dir))
    ref_policy = nnx.split(model, nnx.Param, ...)
    t0 = time.perf_counter()
    seed_dir = work / f"seed{seed}"

    def sampler(prompts, repeats):
        return dpo.Sampler(tokenizer, model.config, prompts, repeats=repeats, max_new_tokens=p.max_response_tokens,
                           batch_rows=preset.sample_batch)

    # gold-labelled pairs from π_ref (training and held-out prefixes), shuffled once
    s = sampler(train_prompts, preset.pair_samples)(ref_policy, rng.stream(seed, "pairs"))
    pairs = gold_pairs(train_prompts, s["texts"], s["rewards"], preset.pair_samples)
    order = np.random.default_rng(seed).permutation(len(pairs))
    pairs = [pairs[i] for i in order]
    s = sampler(heldout_prompts[: preset.rm_eval_pairs], 2)(ref_policy, rng.stream(seed, "eval_pairs"))
    eval_pairs = gold_pairs(heldout_prompts[: preset.rm_eval_pairs], s["texts"], s["rewards"], 2)
    eval_path = seed_dir / "eval_pairs.jsonl"
    write_jsonl(eval_pairs, eval_path)
    log(f"seed {seed}: {len(pairs)} training pairs from {len(train_prompts)} prefixes, {len(eval_pairs)} held-out "
        f"pairs, in {time.perf_counter() - t0:.0f} s")
    if len(pairs) < max(preset.rm_sizes):
        raise RuntimeError(f"only {len(pairs)} gold-labelled pairs; the largest RM needs {max(preset.rm_sizes)}")

    # proxy reward models
    rms: dict[int, dict[str, Any]] = {}
    for n in preset.rm_sizes:
        path = seed_dir / f"pairs_{n}.jsonl"
        write_jsonl(pairs[:n], path)
        rm_dir, stats = train_reward_model(ref_dir, path, eval_path, seed=seed, preset=preset,
                                           run_dir=seed_dir / f"rm_{n}", log=log)
        rms[n] = {"dir": rm_dir, "stats": stats,
                  "score": make_reward_model_reward(path=str(rm_dir), batch_size=preset.sample_batch)}

    # best-of-n from a pool of π_ref samples per held-out prefix
    t1 = time.perf_counter()
    pool = sampler(eval_prompts, preset.bon_samples)(ref_policy, rng.stream(seed, "bon_pool"))
    rows = [{"prompt": x} for x in eval_prompts for _ in range(preset.bon_samples)]
    gold = pool["rewards"].reshape(len(eval_prompts), preset.bon_samples)
    bon: dict[int, list[dict[str, float]]] = {}
    proxy_ref: dict[int, float] = {}
    for n_pairs, rm in rms.items():
        proxy = rm["score"](pool["texts"], rows).reshape(gold.shape)
        proxy_ref[n_pairs] = float(proxy.mean())  # the proxy's mean on π_ref samples: its zero
        curve = []
        for n in preset.best_of_n:
            if n > preset.bon_samples:
                continue
            g, q = best_of_n_expectation(proxy, gold, n)
            kl = bon_kl(n)
            curve.append({"n": n, "kl": kl, "d": math.sqrt(kl), "gold": g - float(gold.mean()),
                          "proxy": q - proxy_ref[n_pairs]})
        bon[n_pairs] = curve
    log(f"seed {seed}: best-of-n pool {gold.size} samples (gold mean {gold.mean():+.3f}) scored by {len(rms)} RMs "
        f"in {time.perf_counter() - t1:.0f} s")

    # RL on each proxy, evaluated on the held-out prefixes (the same keys for every run)
    prompts_path = seed_dir / "train_prompts.jsonl"
    write_jsonl([{"prompt": x} for x in train_prompts], prompts_path)
    eval_sampler = sampler(eval_prompts, preset.eval_samples)
    eval_rows = [{"prompt": x} for x in eval_sampler.rows]
    eval_key = rng.stream(seed, "evaluation")
    ref_gold = float(gold.mean())  # π_ref's gold from the large pool: the zero of every gold curve
    rl: dict[int, list[dict[str, Any]]] = {}
    for n_pairs, rm in rms.items():
        def evaluate(policy, ref, rm=rm, n_pairs=n_pairs):
            sample = eval_sampler(policy, eval_key, ref=ref)
            point = dpo.evaluation_point(sample)
            proxy = rm["score"](sample["texts"], eval_rows)
            kl = point["kl"]
            return {"kl": kl, "kl_se": point["kl_se"], "d": math.sqrt(max(kl, 0.0)),
                    "gold": point["reward"] - ref_gold, "gold_se": point["reward_se"],
                    "proxy": float(proxy.mean()) - proxy_ref[n_pairs],
                    "proxy_se": float(proxy.std(ddof=1) / math.sqrt(len(proxy))),
                    "mean_length": point["mean_length"], "example": sample["texts"][0]}

        rl[n_pairs] = rl_run(ref_dir, prompts_path, rm["dir"], seed=seed, preset=preset, work=seed_dir,
                             evaluate=evaluate, log=log)
    shutil.rmtree(seed_dir, ignore_errors=True)  # RMs, pairs, trainer folders: large, rebuilt by a rerun
    return {"seed": seed, "pairs": len(pairs), "eval_pairs": len(eval_pairs), "ref_gold": ref_gold,
            "proxy_ref": {str(k): v for k, v in proxy_ref.items()},
            "rm": {str(k): v["stats"] for k, v in rms.items()},
            "best_of_n": {str(k): v for k, v in bon.items()}, "rl": {str(k): v for k, v in rl.items()},
            "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------------
# summary, table, plot


def curve_points(results: list[dict[str, Any]], method: str, size: int) -> list[list[dict[str, float]]]:
    """Per seed, the evaluation points ``{d, gold, proxy, ...}`` of one method and RM size."""
    key = "best_of_n" if method == "best-of-n" else "rl"
    return [r[key][str(size)] for r in results]


def summarize(results: list[dict[str, Any]], preset: Preset) -> dict[str, Any]:
    """Per method and RM size: the peak, the fall after it, the proxy's rise, the fits; the verdicts."""
    out: dict[str, Any] = {"curves": {}, "verdicts": {}}
    for method in METHODS:
        for size in preset.rm_sizes:
            seeds = curve_points(results, method, size)
            length = min(len(c) for c in seeds)
            gold = np.array([[q["gold"] for q in c[:length]] for c in seeds])  # [S, points]
            proxy = np.array([[q["proxy"] for q in c[:length]] for c in seeds])
            d = np.array([[q["d"] for q in c[:length]] for c in seeds])
            peak = int(np.argmax(gold.mean(0)))
            fit = fit_form(method, d.reshape(-1), gold.reshape(-1))
            proxy_fit = fit_form(method, d.reshape(-1), proxy.reshape(-1))
            out["curves"][f"{method}/{size}"] = {
                "method": method, "rm_pairs": size, "peak_index": peak,
                "d_peak": d[:, peak].tolist(), "gold_peak": gold[:, peak].tolist(),
                "d_last": d[:, -1].tolist(), "gold_last": gold[:, -1].tolist(), "proxy_last": proxy[:, -1].tolist(),
                "gain": (gold[:, peak] - gold[:, 0]).tolist(), "fall": (gold[:, peak] - gold[:, -1]).tolist(),
                "proxy_rise": (proxy[:, -1] - proxy[:, peak]).tolist(),
                "fit": fit, "proxy_fit": proxy_fit,
                "rm_accuracy": [r["rm"][str(size)]["eval_accuracy"] for r in results]}
    curves = out["curves"]
    per_curve = {}
    for key, c in curves.items():
        # the gold rises to its peak, falls after it, while the proxy keeps rising past it; a fall
        # smaller than a tenth of the gain is a plateau (at most "partly"), not a peak and a fall
        says = [clearly_positive(c[k]) for k in ("gain", "fall", "proxy_rise")]
        if says[1] == "yes" and np.mean(c["fall"]) < MIN_FALL * np.mean(c["gain"]):
            says[1] = "partly"
        per_curve[key] = "yes" if all(a == "yes" for a in says) else ("no" if "no" in says else "partly")
    answers = list(per_curve.values())
    out["verdicts"]["overoptimization"] = {
        "answer": "yes" if all(a == "yes" for a in answers) else ("no" if all(a == "no" for a in answers)
                                                                   else "partly"),
        "per_curve": per_curve}
    later = {}
    for method in METHODS:
        # a curve that is not over-optimised ("no") has not peaked yet: its peak lies beyond the range
        measured = [float(np.mean(curves[f"{method}/{n}"]["d_peak"]))
                    if per_curve[f"{method}/{n}"] != "no" else float("inf") for n in preset.rm_sizes]
        fitted = [curves[f"{method}/{n}"]["fit"]["d_peak_fit"] for n in preset.rm_sizes]
        later[method] = {"measured": trend(measured), "fitted": trend(fitted), "d_peak": measured,
                         "d_peak_fit": fitted}
    answers = [v for m in later.values() for v in (m["measured"], m["fitted"])]
    out["verdicts"]["later_peak"] = {
        "answer": "yes" if all(a == "yes" for a in answers) else ("no" if all(a == "no" for a in answers)
                                                                   else "partly"),
        "per_method": later}
    r2 = [c["fit"]["r2"] for c in curves.values()]
    out["verdicts"]["forms"] = {
        "answer": "yes" if all(x >= 0.9 for x in r2) else ("no" if any(not x >= 0.5 for x in r2) else "partly"),
        "r2": {k: c["fit"]["r2"] for k, c in curves.items()}}
    return out


def _peak_text(d: float) -> str:
    return "beyond" if d == float("inf") else "none" if math.isnan(d) else f"{d:.2f}"


def build_table(summary: dict[str, Any]) -> str:
    """The markdown table: one row per method and RM size."""
    from rljax.tools.reporting import markdown_table, mean_std

    headers = ["method", "RM pairs", "RM held-out acc.", "peak d", "gold at peak", "largest d", "gold at largest d",
               "proxy at largest d", "fit α", "fit β", "fit R²", "fitted peak d*", "over-optimised"]
    rows = []
    for key, c in summary["curves"].items():
        fit = c["fit"]
        rows.append([c["method"], c["rm_pairs"], mean_std(c["rm_accuracy"]), mean_std(c["d_peak"]),
                     mean_std(c["gold_peak"]), mean_std(c["d_last"]), mean_std(c["gold_last"]),
                     mean_std(c["proxy_last"]), fit["alpha"], fit["beta"], fit["r2"],
                     _peak_text(fit["d_peak_fit"]),
                     summary["verdicts"]["overoptimization"]["per_curve"][key]])
    return markdown_table(headers, rows)


def verdict_lines(summary: dict[str, Any]) -> list[str]:
    """One plain line per claim, computed from the numbers."""
    v = summary["verdicts"]
    later = "; ".join(f"{m}: measured peak d {[_peak_text(x) for x in q['d_peak']]} ({q['measured']}), fitted d* "
                      f"{[_peak_text(x) for x in q['d_peak_fit']]} ({q['fitted']})"
                      for m, q in v["later_peak"]["per_method"].items())
    r2 = ", ".join(f"{k}: {x:.2f}" for k, x in v["forms"]["r2"].items())
    over = ", ".join(f"{k}: {a}" for k, a in v["overoptimization"]["per_curve"].items())
    return [f"1. {CLAIMS['overoptimization']} — claim reproduced: **{v['overoptimization']['answer']}** (per curve, "
            f"gold falls after its peak and the proxy rises over the same stretch, in every seed = yes: {over}).",
            f"2. {CLAIMS['later_peak']} — claim reproduced: **{v['later_peak']['answer']}** (by RM size, smallest "
            f"first: {later}).",
            f"3. {CLAIMS['forms']} — claim reproduced: **{v['forms']['answer']}** (R² of the seed-pooled fit, "
            f"≥ 0.9 everywhere = yes, any < 0.5 = no: {r2})."]


def plot(results: list[dict[str, Any]], summary: dict[str, Any], preset: Preset, out: Path) -> list[str]:
    """``overoptimization.png``: rows best-of-n / RL, columns gold / proxy, against d; one colour per RM size
    (seed means as markers, each seed faint), the fitted forms dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    colors = plt.cm.viridis(np.linspace(0.1, 0.85, len(preset.rm_sizes)))
    for row, method in enumerate(METHODS):
        for color, size in zip(colors, preset.rm_sizes):
            seeds = curve_points(results, method, size)
            length = min(len(c) for c in seeds)
            c = summary["curves"][f"{method}/{size}"]
            for col, key in enumerate(("gold", "proxy")):
                ax = axes[row, col]
                for pts in seeds:
                    ax.plot([q["d"] for q in pts], [q[key] for q in pts], color=color, alpha=0.2, lw=0.8)
                d = np.mean([[q["d"] for q in pts[:length]] for pts in seeds], axis=0)
                y = np.mean([[q[key] for q in pts[:length]] for pts in seeds], axis=0)
                ax.plot(d, y, "o-", color=color, ms=3, lw=1.5, label=f"RM on {size} pairs")
                fit = c["fit"] if key == "gold" else c["proxy_fit"]
                grid = np.linspace(0, max(q["d"] for pts in seeds for q in pts), 100)
                ax.plot(grid, form_curve(method, fit, grid), "--", color=color, lw=1,
                        label=f"fit {FORMS[method]}: α={fit['alpha']:.2f}, β={fit['beta']:.2f}, R²={fit['r2']:.2f}")
                ax.set_title(f"{method}: {'gold (VADER)' if key == 'gold' else 'proxy RM'} score")
                ax.set_xlabel("d = √KL(π ‖ π_ref), √nats")
                ax.set_ylabel(f"{key} score minus π_ref's")
                ax.axhline(0, color="grey", lw=0.5)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=6)
    fig.suptitle(f"RM over-optimisation (arXiv:2210.10760 Fig. 1-2), tiny sentiment policy, {len(results)} seed(s)")
    fig.tight_layout()
    fig.savefig(out / "overoptimization.png", dpi=120)
    plt.close(fig)
    return ["overoptimization.png"]


# ---------------------------------------------------------------------------------------------
# main


def write_report(out: Path, preset_name: str, preset: Preset, pretrain: dict[str, Any], results: list[dict[str, Any]],
                 seconds: float, log) -> str:
    """Summary, table, verdicts, plot, ``curves.json`` and ``results.md`` from the per-seed results."""
    from rljax.tools.reporting import mean_std, write_json

    summary = summarize(results, preset)
    table = build_table(summary)
    verdicts = verdict_lines(summary)
    plots = plot(results, summary, preset, out)
    write_json(str(out / "curves.json"), {"preset": preset_name, "pretrain": pretrain, "seeds": results,
                                          "summary": summary, "seconds": round(seconds, 1)})
    p = preset.pretrain
    md = [f"# Reward-model over-optimisation ({preset_name} preset)", "",
          "Reproduces arXiv:2210.10760 (Gao, Schulman, Hilton 2022) Figures 1-2 in miniature: proxy reward models "
          "trained on N gold-labelled preference pairs are optimised by best-of-n and by RL (GRPO); gold (VADER) and "
          "proxy scores of the optimised policy, minus π_ref's, against d = √KL(π ‖ π_ref). Per method and RM "
          "size: mean ± std over seeds; the fit (α, β, R²) is to the seed-pooled points.", "",
          table, "", "Claims and verdicts:", "", *verdicts, "",
          f"- π_ref: {p.layers}-layer, {p.hidden}-wide Llama, BPE vocabulary {p.vocab_size}, held-out NLL "
          f"{pretrain['eval_nll_per_token_after']:.2f} nats/token (trained in {pretrain['seconds']:.0f} s; cached).",
          f"- Gold-labelled pairs per seed: {mean_std([r['pairs'] for r in results], digits=4)} available "
          f"({preset.pair_samples} π_ref samples per training prefix, two at a time, ties dropped); RM held-out "
          f"accuracy on {mean_std([r['eval_pairs'] for r in results], digits=4)} held-out pairs.",
          f"- Best-of-n: {preset.eval_prompts} held-out prefixes × {preset.bon_samples} π_ref samples, n ∈ "
          f"{list(preset.best_of_n)}, KL = log n − (n−1)/n. RL: GRPO, {preset.rl_steps} steps of "
          f"{preset.rl_prompts_per_step} prompts × {preset.rl_group}, learning rate {preset.rl_lr:g}, KL coefficient "
          f"{preset.rl_kl_coef:g}; evaluated every {preset.rl_eval_every} steps on {preset.eval_prompts} held-out "
          f"prefixes × {preset.eval_samples} samples.",
          f"- π_ref's gold (VADER) mean: {mean_std([r['ref_gold'] for r in results])}.",
          f"- Seeds: {list(preset.seeds)}; run time {seconds / 60:.1f} min (this machine: {os.cpu_count()} CPUs).",
          "", "Plot: `overoptimization.png`. Raw points: `curves.json`."]
    (out / "results.md").write_text("\n".join(md) + "\n")
    log(f"wrote {out / 'results.md'} and {plots} ({seconds / 60:.1f} min of measurement)")
    print("\n" + table + "\n\n" + "\n".join(verdicts))
    return "\n".join(md)


def main(argv: Sequence[str] | None = None) -> int:
    keep_host_memory()  # process-wide malloc settings, before any JAX work (rljax/host_memory.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--smoke", action="store_true", help="seconds: plumbing check for the tests")
    group.add_argument("--full", action="store_true", help="toward the paper's scale (a GPU / TPU)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the preset's)")
    parser.add_argument("--out", help=f"output folder (default runs/paper_repro/{NAME}/<preset>)")
    parser.add_argument("--cache", help="folder of the cached reference policy (default runs/paper_repro/_cache)")
    parser.add_argument("--plan", metavar="TARGET", help="no training: `rljax plan` the preset's reward-model "
                        "training and GRPO run for TARGET (h100-1, v5e-4, cpu-N, ...; paper_repro/_plan.py) and "
                        "exit with its status")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild results.md, the plot and the summary from OUT/curves.json (no training)")
    args = parser.parse_args(argv)
    preset_name = "smoke" if args.smoke else "full" if args.full else "default"
    preset = PRESETS[preset_name]
    if args.seeds:
        preset = dataclasses.replace(preset, seeds=tuple(args.seeds))
    out = Path(args.out or REPO_ROOT / "runs" / "paper_repro" / NAME / preset_name)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.plan:
        raise SystemExit(plan_runs(preset, preset_name, out, args.plan, log))
    if args.report_only:
        with open(out / "curves.json") as f:
            saved = json.load(f)
        results = saved["seeds"]
        preset = dataclasses.replace(preset, seeds=tuple(r["seed"] for r in results))
        write_report(out, saved["preset"], preset, saved["pretrain"], results, saved.get("seconds", float("nan")), log)
        return 0

    from rljax.tools.reporting import save_run_metadata, write_json

    snippets = corpus.read_snippets()  # a clear error with the fetch command when the cache is empty
    save_run_metadata(str(out), {"preset": preset_name, **dataclasses.asdict(preset),
                                 "corpus": str(corpus.snippets_path()), "argv": list(argv or sys.argv[1:])})
    t_start = time.perf_counter()
    ref_dir = corpus.pretrain_reference(preset.pretrain, cache=args.cache, snippets=snippets, log=log)
    pretrain = corpus.pretrain_summary(ref_dir)
    p = preset.pretrain
    train_prompts = list(dict.fromkeys(r["prompt"] for r in corpus.prompt_response_pairs(snippets, p, held_out=False)))
    heldout_prompts = list(dict.fromkeys(r["prompt"] for r in corpus.prompt_response_pairs(snippets, p, held_out=True)))
    train_prompts = train_prompts[: preset.pair_prompts]
    eval_prompts = heldout_prompts[: preset.eval_prompts]
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)

    results = []
    for seed in preset.seeds:
        results.append(run_seed(seed, preset, ref_dir, train_prompts, heldout_prompts, eval_prompts, work, log))
        write_json(str(out / "curves.json"), {"preset": preset_name, "pretrain": pretrain, "seeds": results})
    shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - t_start
    write_json(str(out / "curves.json"), {"preset": preset_name, "pretrain": pretrain, "seeds": results,
                                          "seconds": round(seconds, 1)})
    write_report(out, preset_name, preset, pretrain, results, seconds, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
