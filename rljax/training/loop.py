"""The one ``fit`` loop every trainer runs: evaluate, step, log, evaluate, checkpoint, stop cleanly.

    summary = fit(trainer)

A trainer (``rljax.training.online.OnlineTrainer``, ``rljax.training.offline.OfflineTrainer``) has
``run`` (``rljax.training.run.Run``: config, state, checkpointer, ``step``), ``total_steps``,
``iterator`` (the data position, saved with every checkpoint), ``step_once() -> metrics`` (one
step; advances ``run.step``), ``evaluate() -> metrics``, ``log_keys`` (metrics shown next to the
progress bar), ``start_metrics()`` (logged with the first evaluation) and three plain methods
``fit`` calls at fixed points: ``on_step(logger)`` after each logged training step,
``on_evaluate(step)`` after each evaluation and ``on_end(summary)`` after the final checkpoint.

Order: evaluation of the initial policy (not on resume) -> ``total_steps`` steps (evaluation every
``train.eval_every`` steps, checkpoints on ``train.save_every``) -> final evaluation -> final
checkpoint -> ``summary.json`` -> the run directory's lock is released (``Run.close``, also when
the run fails). A non-finite loss stops the run: the state before the refused update
is saved (``--resume`` continues from it), a line is logged, and ``NonFiniteLossError`` propagates.
The malloc tuning of ``rljax.host_memory`` is applied here (and by the CLI), never on import.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from rljax.host_memory import keep_host_memory
from rljax.metrics_log import MetricsLogger
from rljax.training.run_dir import config_dict
from rljax.update import NonFiniteLossError


def save(trainer, *, force: bool = False) -> None:
    """Checkpoint the trainer's state with its step, data position and resolved config as metadata
    (the config lets a resume refuse one that changes the run: ``rljax.training.run.Run.restore``)."""
    run = trainer.run
    run.checkpointer.save(run.step, run.state(), {"step": run.step, "data": trainer.iterator.state_dict(),
                                                  "config": config_dict(run.cfg)}, force=force)


def fit(trainer) -> dict[str, Any]:
    """Train ``trainer`` to ``trainer.total_steps``; returns the summary (also ``RUN_DIR/summary.json``)."""
    keep_host_memory()
    run, train = trainer.run, trainer.run.cfg.train
    logger = MetricsLogger(train.run_dir, tensorboard=train.tensorboard, total_steps=trainer.total_steps,
                           progress=train.progress, keys_in_bar=trainer.log_keys)
    resumed = run.step > 0
    if resumed:
        logger.truncate_after(run.step)
    summary: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        if not resumed:
            summary["before"] = trainer.evaluate()
            logger.log(0, {**summary["before"], **trainer.start_metrics()})
            trainer.on_evaluate(0)
        while run.step < trainer.total_steps:
            try:
                metrics = trainer.step_once()
            except NonFiniteLossError as err:
                save(trainer, force=True)
                logger.write(f"stopping: {err}; last good state saved at step {run.step}")
                raise
            evaluated = bool(train.eval_every and run.step % train.eval_every == 0 and run.step < trainer.total_steps)
            if evaluated:
                metrics.update(trainer.evaluate())
            logger.log(run.step, metrics)
            trainer.on_step(logger)
            if evaluated:
                trainer.on_evaluate(run.step)
            if run.checkpointer.should_save(run.step):
                save(trainer)
        summary["train_seconds"] = round(time.perf_counter() - start, 2)
        summary["after"] = trainer.evaluate()
        logger.log(run.step, summary["after"])
        trainer.on_evaluate(run.step)
        save(trainer, force=True)
        summary["steps"] = run.step
        trainer.on_end(summary)
        run.checkpointer.wait()  # summary.json is written once the final checkpoint is on disk
        with open(os.path.join(train.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    finally:
        run.checkpointer.wait()
        logger.close()
        run.close()  # the run directory's lock: another run may use the directory now
    return summary


__all__ = ["fit", "save"]
