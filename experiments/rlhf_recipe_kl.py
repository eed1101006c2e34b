"""Held-out KL to the reference, learned reward and gold score of the RLHF recipe's trained policies, sampled.

    python experiments/rlhf_recipe_kl.py runs/rlhf_sentiment_ppo runs/rlhf_sentiment_grpo [--samples 4]

The runs' own evaluation (``eval/rm``, ``eval/sentiment`` in ``metrics.jsonl``) decodes greedily and logs no KL.
This samples ``--samples`` completions (the run's sampling settings: temperature 1) of each held-out prompt (the
run config's own split) from the reference (``model.name``) and from each run's final policy (``RUN_DIR/model``,
LoRA merged), with the same keys, scores them with the run's rewards (the learned reward model and the gold
scorer), and estimates KL(π‖π_ref) per completion as Σ_t (log π − log π_ref) over its tokens (k1: unbiased for
samples from π; the sampler's log-probs are π's). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import numpy as np


def _ref_logprobs(ref, roll, batch: int = 32) -> np.ndarray:
    """``[R, N]`` log-probs of the rollout's tokens under ``ref`` (0 where masked)."""
    from rljax.logprobs import completion_logprobs

    out = []
    for s in range(0, len(roll), batch):
        lp = completion_logprobs(ref, roll.prompt_ids[s:s + batch], roll.prompt_mask[s:s + batch],
                                 roll.completion_ids[s:s + batch], roll.completion_mask[s:s + batch])["logprobs"]
        out.append(np.asarray(lp) * roll.completion_mask[s:s + batch])
    return np.concatenate(out)


def measure(run_dirs: Sequence[str], *, samples: int = 4) -> list[dict]:
    """One row for the reference and one per run: sampled held-out KL, learned reward, gold score."""
    import jax

    from rljax import rng
    from rljax.config import load_config
    from rljax.models import load
    from rljax.rewards.base import build_rewards
    from rljax.data.prompts import PromptFormat
    from rljax.rollout import rollout, sampling_config
    from rljax.run_config import RunConfig
    from rljax.training.data import online_examples

    cfg = load_config(RunConfig, Path(run_dirs[0]) / "config.yaml")
    ref, tokenizer = load(cfg.model.name)
    rewards = build_rewards(cfg.rewards, tokenizer=tokenizer)
    _, evals, _ = online_examples(cfg)
    sampling = sampling_config(cfg.sampling, tokenizer, ref.config)
    fmt = PromptFormat.from_data(cfg.data)
    key = rng.stream(cfg.train.seed, "heldout_kl")
    rows = []
    for name, path in [("reference", None)] + [(Path(d).name, Path(d) / "model") for d in run_dirs]:
        policy = ref if path is None else load(str(path))[0]
        roll = rollout(policy, tokenizer, evals, jax.random.fold_in(key, 0), sampling=sampling, fmt=fmt,
                       repeats=samples, rewards=rewards)
        kl = (roll.logprobs * roll.completion_mask - _ref_logprobs(ref, roll)).sum(-1)
        rows.append({"policy": name, "kl": float(kl.mean()), "kl_sem": float(kl.std(ddof=1) / np.sqrt(len(kl))),
                     **{k: float(np.nanmean(v)) for k, v in roll.per_function.items()},
                     "length": float(roll.completion_mask.sum(-1).mean()), "n": len(kl)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="the recipe's policy run directories")
    parser.add_argument("--samples", type=int, default=4, help="completions per held-out prompt (default: %(default)s)")
    args = parser.parse_args(argv)
    rows = measure(args.run_dirs, samples=args.samples)
    names = [k for k in rows[0] if k not in ("policy", "kl", "kl_sem", "length", "n")]
    print("| policy | samples | KL to reference (± s.e.) | " + " | ".join(names) + " | mean length |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        print(f"| {r['policy']} | {r['n']} | {r['kl']:.3f} ± {r['kl_sem']:.3f} | "
              + " | ".join(f"{r[k]:.3f}" for k in names) + f" | {r['length']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
