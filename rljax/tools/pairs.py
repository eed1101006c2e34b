"""Preference pairs from a policy's own samples: best vs worst of N under any scorer.

    pairs, counts = sample_preference_pairs(cfg, num_samples=8)
    rljax pairs CONFIG OUT.jsonl [--num-samples 8] [--split train|eval] [--min-gap 0.0] [KEY=VALUE ...]
    python -m rljax.tools.pairs CONFIG OUT.jsonl ...          (the same command)

Sample N completions per prompt of the config's data with its model and sampling settings
(``rljax.rollout.rollout``), score them with its ``rewards`` (any verifier or a trained
``reward_model``), keep the best and the worst of each prompt
(``rljax.data.preferences.best_vs_worst_pairs``) and write them as JSONL (``prompt``, ``chosen``,
``rejected``, ``chosen_score``, ``rejected_score``), ready for ``algorithm.name=dpo`` with
``'data.task=""' data.path=OUT.jsonl``. The pure pair logic lives in the data layer; this module
runs the sampler, so it sits above it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import numpy as np

__all__ = ["add_arguments", "main", "run", "sample_preference_pairs"]


def _examples(cfg, split: str) -> list[dict[str, Any]]:
    """The ``split`` prompts of ``cfg``'s data, by the training runs' own rule (``rljax.training.data``)."""
    from rljax.training.data import online_examples

    train, evals, _ = online_examples(cfg)
    return train if split == "train" else evals


def sample_preference_pairs(cfg, *, num_samples: int = 8, split: str = "train", min_gap: float = 0.0,
                            batch_prompts: int = 16) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Sample ``num_samples`` completions per prompt of ``cfg``'s data with ``cfg``'s model and
    sampling settings, score them with ``cfg.rewards``, and keep the best and worst of each prompt
    (:func:`rljax.data.preferences.best_vs_worst_pairs`: failed scores and ties are skipped and counted).

    ``cfg`` is a :class:`rljax.run_config.RunConfig`; only ``model``, ``data``, ``sampling``,
    ``rewards`` and ``train.seed`` are read. Prompts are the ``split`` split of ``data.task`` or
    ``data.path``, held out by the same rule as training runs (``rljax.training.data``), ``batch_prompts`` per sampler
    call; the key of the call starting at prompt ``s`` is ``fold_in(stream(seed, "pairs"), s)``.
    Scores are the rewards' float64 weighted sums (the rollout's ``scores`` are rounded to float32).
    """
    import jax

    from rljax import rng
    from rljax.models import dtype_from_name, load
    from rljax.rewards.base import build_rewards
    from rljax.data.preferences import best_vs_worst_pairs
    from rljax.data.prompts import PromptFormat
    from rljax.inference.batch import engine_for
    from rljax.rollout import rollout, sampling_config

    examples = _examples(cfg, split)
    model, tokenizer = load(cfg.model.name, dtype=dtype_from_name(cfg.model.dtype))
    rewards = build_rewards(cfg.rewards, tokenizer=tokenizer)  # a reward model may share the policy's tokenizer
    sampling = sampling_config(cfg.sampling, tokenizer, model.config)
    fmt = PromptFormat.from_data(cfg.data)
    key = rng.stream(cfg.train.seed, "pairs")
    kept_examples, completions, scores = [], [], []
    engine = engine_for(model, cfg.sampling)
    for start in range(0, len(examples), batch_prompts):
        roll = rollout(model, tokenizer, examples[start:start + batch_prompts], jax.random.fold_in(key, start),
                       sampling=sampling, fmt=fmt, repeats=num_samples, rewards=rewards, engine=engine)
        kept_examples += [{k: v for k, v in ex.items() if k not in ("completion_length", "completion_ids")}
                          for ex in roll.examples[::num_samples]]
        completions += roll.texts
        scores.append(_weighted_totals(rewards, roll.per_function, roll.row_mask))
    return best_vs_worst_pairs(kept_examples, completions, np.concatenate(scores) if scores else [],
                               num_samples=num_samples, min_gap=min_gap)


def _weighted_totals(rewards, per_function: dict[str, np.ndarray], row_mask: np.ndarray) -> np.ndarray:
    """``Σ_k w_k r_k`` in float64 as ``RewardSet`` sums it, NaN where a function failed."""
    total = np.zeros(len(row_mask), np.float64)
    for name, values in per_function.items():
        total += rewards.weights[name] * values
    total[~row_mask] = np.nan
    return total


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments (shared by ``rljax pairs`` and ``python -m rljax.tools.pairs``)."""
    parser.add_argument("config", help="a RunConfig YAML naming the model, data (task or path), sampling and rewards")
    parser.add_argument("output", help="JSONL file to write")
    parser.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides of the config")
    parser.add_argument("--num-samples", type=int, default=8, help="completions per prompt (default: %(default)s)")
    parser.add_argument("--split", choices=("train", "eval"), default="train", help="task split to sample")
    parser.add_argument("--min-gap", type=float, default=0.0,
                        help="keep a prompt only if best - worst score exceeds this (default: %(default)s)")


DESCRIPTION = ("Build a DPO / reward-model preference set: sample N completions per prompt with the config's "
               "model (model.*, sampling.*), score them with the config's rewards (any verifier or a "
               "reward_model), keep the best and worst of each prompt, write JSONL with prompt, chosen, "
               "rejected, chosen_score, rejected_score.")


def run(args: argparse.Namespace) -> int:
    """Load the config (with overrides), build the pairs, write them."""
    from rljax.config import load_config
    from rljax.data.preferences import write_jsonl
    from rljax.run_config import RunConfig

    cfg = load_config(RunConfig, args.config, args.overrides)
    if not cfg.rewards:
        raise SystemExit("the config has no rewards: name the scorer(s), e.g. rewards.correct={type: answer}")
    pairs, counts = sample_preference_pairs(cfg, num_samples=args.num_samples, split=args.split, min_gap=args.min_gap)
    write_jsonl(pairs, args.output)
    print(f"wrote {len(pairs)} pairs to {args.output}; {counts}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rljax.tools.pairs CONFIG OUT.jsonl [options] [KEY=VALUE ...]``."""
    parser = argparse.ArgumentParser(prog="python -m rljax.tools.pairs", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_intermixed_args(argv))  # overrides may follow the options


if __name__ == "__main__":
    sys.exit(main())
