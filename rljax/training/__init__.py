"""Training: build a run, the one ``fit`` loop, and the thin online / offline trainers.

    trainer = trainer_for(cfg)      # OnlineTrainer or OfflineTrainer, as the algorithm declares
    summary = trainer.fit()

=============  ============================================================================
``run``        ``build_run``: model, LoRA, trainable/frozen split, reference, optimizer,
               checkpointer, restore, config save
``run_dir``    the run directory: one run in it (``--overwrite``), its lock, what a resume
               may change
``loop``       ``fit``: evaluation, steps, logging, checkpoints, the non-finite stop, the
               stop on SIGTERM / SIGINT (``Preempted``)
``data``       train / held-out rows by one rule (``split_by_prompt``) for every run
``online``     ``OnlineTrainer``: rollouts -> advantages -> updates, any online algorithm
``offline``    ``OfflineTrainer``: batches -> updates, any offline algorithm
=============  ============================================================================
"""

from __future__ import annotations

from rljax.algorithms import get as get_algorithm
from rljax.run_config import RunConfig
from rljax.training.loop import Preempted, fit
from rljax.training.offline import OfflineTrainer
from rljax.training.online import OnlineTrainer
from rljax.training.run import Run, TrainState, build_run


def trainer_for(cfg: RunConfig, **kwargs) -> OnlineTrainer | OfflineTrainer:
    """The trainer for ``cfg.algorithm``: online or offline, as the algorithm declares. ``kwargs``:
    the trainer's (``resume``, ``resume_step``, ``overwrite``, ``write_config``; see ``build_run``)."""
    return (OnlineTrainer if get_algorithm(cfg.algorithm.name).online else OfflineTrainer)(cfg, **kwargs)


__all__ = ["OfflineTrainer", "OnlineTrainer", "Preempted", "Run", "TrainState", "build_run", "fit", "trainer_for"]
