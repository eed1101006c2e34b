"""What a run holds, derived once from its config: the one owner the trainers, ``export`` and
``rljax plan`` read, so they cannot disagree about a value head, a critic, a reference copy or the
schedule's length.

    spec = run_spec(cfg)                            # offline with epochs: run_spec(cfg, train_rows=n)
    run = build_run(cfg, **spec.build_args(), resume=...)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rljax.algorithms import get as get_algorithm
from rljax.run_config import RunConfig


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run's parts and shapes.

    Attributes:
      algorithm: the ``OnlineAlgorithm`` / ``OfflineAlgorithm`` the config names.
      value_head: the policy carries a scalar head (PPO's shared head, reward models).
      critic: the separate critic's model, or None without one.
      critic_learning_rate: the critic's AdamW rate (None: ``optim.learning_rate``).
      needs_reference: the loss reads reference log-probs.
      keep_reference: a frozen reference copy is held (online: whenever reference log-probs are
        read; offline: only for live ones, ``precompute_ref_logprobs: false``; else cached once).
      total_updates: optimizer updates the learning-rate schedule spans.
      batch_kind: ``"rollouts"`` (online) or the offline data kind (``rljax.data.kinds``).
      rows: rows of one step's batch (prompts × group size, or ``batch_size``).
      completion_length: completion tokens per row (``sampling.max_new_tokens`` or
        ``algorithm.max_completion_length``).
    """

    algorithm: Any
    value_head: bool
    critic: str | None
    critic_learning_rate: float | None
    needs_reference: bool
    keep_reference: bool
    total_updates: int
    batch_kind: str
    rows: int
    completion_length: int

    def build_args(self) -> dict:
        """The keywords of ``rljax.training.run.build_run`` this spec decides."""
        return dict(value_head=self.value_head, keep_reference=self.keep_reference, total_updates=self.total_updates,
                    critic=self.critic, critic_learning_rate=self.critic_learning_rate)


def offline_updates(cfg: RunConfig, train_rows: int | None) -> int:
    """An offline run's optimizer updates: ``train.steps``, or ``epochs`` passes over ``train_rows``."""
    a = cfg.algorithm
    if a.epochs is None or train_rows is None:
        return cfg.train.steps
    return max(1, math.ceil(a.epochs * (train_rows // a.batch_size)))


def run_spec(cfg: RunConfig, *, train_rows: int | None = None) -> RunSpec:
    """The spec of ``cfg``'s run; ``train_rows`` (an offline run with ``epochs``) sizes the schedule,
    else ``train.steps`` updates."""
    algo, a = get_algorithm(cfg.algorithm.name), cfg.algorithm
    needs_reference = bool(algo.needs_reference(a))
    if algo.online:
        head = algo.value_head(a)
        critic = algo.critic(a) if head == "separate" else None
        return RunSpec(algo, value_head=head == "shared",
                       critic=(critic.model or cfg.model.name) if critic is not None else None,
                       critic_learning_rate=critic.learning_rate if critic is not None else None,
                       needs_reference=needs_reference, keep_reference=needs_reference,
                       total_updates=cfg.train.steps * a.num_iterations * a.mini_batches, batch_kind="rollouts",
                       rows=a.prompts_per_step * a.group_size, completion_length=cfg.sampling.max_new_tokens)
    live_reference = needs_reference and not algo.caches_reference(a)
    return RunSpec(algo, value_head=bool(algo.value_head), critic=None, critic_learning_rate=None,
                   needs_reference=needs_reference, keep_reference=live_reference,
                   total_updates=offline_updates(cfg, train_rows), batch_kind=algo.data_kind(a), rows=a.batch_size,
                   completion_length=a.max_completion_length)


__all__ = ["RunSpec", "offline_updates", "run_spec"]
