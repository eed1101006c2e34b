"""What the online and offline trainers' ``fit`` share: the step loop and the checkpoint round trip.

    state = {"params": ..., "opt_state": ...}          # the trainer's arrays (``Trainer._state``)
    save_state(checkpointer, step, state, iterator)     # + step and data position as metadata
    state, step = restore_state(checkpointer, state, iterator)
    run_steps(trainer, logger, total_steps=..., eval_every=...)

A trainer here is anything with ``step`` (int), ``step_once() -> metrics``, ``evaluate() ->
metrics``, ``save(force=)`` and ``checkpointer`` (``rljax.train.Trainer``,
``rljax.train_offline.OfflineTrainer``).
"""

from __future__ import annotations

from typing import Any, Callable

from rljax.checkpoint import Checkpointer
from rljax.update import NonFiniteLossError


def save_state(checkpointer: Checkpointer, step: int, state: Any, iterator, *, force: bool = False) -> None:
    """Checkpoint ``state`` at ``step`` with the step and the data iterator's position as metadata."""
    checkpointer.save(step, state, {"step": step, "data": iterator.state_dict()}, force=force)


def restore_state(checkpointer: Checkpointer, abstract_state: Any, iterator) -> tuple[Any, int]:
    """The latest checkpoint's state (shaped like ``abstract_state``) and step; moves ``iterator``
    to its saved position. ``FileNotFoundError`` when there is none (``--resume`` on a fresh run)."""
    if checkpointer.latest_step() is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {checkpointer.directory}")
    state, metadata = checkpointer.restore(abstract_state=abstract_state)
    iterator.load_state_dict(metadata["data"])
    return state, int(metadata["step"])


def run_steps(trainer, logger, *, total_steps: int, eval_every: int,
              after_log: Callable[[Any], None] | None = None) -> None:
    """Step ``trainer`` until ``trainer.step == total_steps``: update, evaluate every ``eval_every``
    steps (not at the last; ``fit`` evaluates after the loop), log, ``after_log(logger)``, and save
    on the checkpointer's schedule.

    A non-finite loss stops the run: the state before the refused update is saved (so nothing is
    lost and ``--resume`` can continue from it), a line is logged, and the error propagates.
    """
    while trainer.step < total_steps:
        try:
            metrics = trainer.step_once()
        except NonFiniteLossError as err:
            trainer.save(force=True)
            logger.write(f"stopping: {err}; last good state saved at step {trainer.step}")
            raise
        trainer.step += 1
        if eval_every and trainer.step % eval_every == 0 and trainer.step < total_steps:
            metrics.update(trainer.evaluate())
        logger.log(trainer.step, metrics)
        if after_log is not None:
            after_log(logger)
        if trainer.checkpointer.should_save(trainer.step):
            trainer.save()


__all__ = ["restore_state", "run_steps", "save_state"]
