"""The one ``fit`` loop every trainer runs: evaluate, step, log, evaluate, checkpoint, stop cleanly.

    summary = fit(trainer)

A trainer (``rljax.training.online.OnlineTrainer``, ``rljax.training.offline.OfflineTrainer``) has
``run`` (``rljax.training.run.Run``: config, state, checkpointer, ``step``), ``total_steps``,
``iterator`` (the data position, saved with every checkpoint; an online trainer's ``algorithm_state``
too), ``step_once() -> metrics`` (one
step; advances ``run.step``), ``evaluate() -> metrics``, ``log_keys`` (metrics shown next to the
progress bar), ``start_metrics()`` (logged with the first evaluation) and three plain methods
``fit`` calls at fixed points: ``on_step(logger)`` after each logged training step,
``on_evaluate(step)`` after each evaluation and ``on_end(summary)`` after the final checkpoint.

Order: evaluation of the initial policy (not on resume) -> ``total_steps`` steps (evaluation every
``train.eval_every`` steps, checkpoints every ``train.save_every`` steps and every
``train.save_every_minutes`` minutes) -> final evaluation -> final checkpoint -> ``summary.json``
-> ``curves.png`` (:func:`write_curves`) -> the run directory's lock is released (``Run.close``, also when the run fails).
A non-finite loss stops the run: the state before the refused update is saved with the data
position before the failed step (``--resume`` repeats that step, as a clean run would), a line is
logged, and ``NonFiniteLossError`` propagates; when earlier updates of that step were applied
(several updates a step), that state is not saved and the line names the last clean checkpoint. SIGTERM, SIGINT or SIGHUP
(a preemption, Ctrl-C, a closed terminal or SSH session) stops the run at the next step boundary: the state is checkpointed (and committed), a line is logged and
``Preempted`` is raised (``rljax train`` exits with ``128 + signal``); a second SIGINT raises
``KeyboardInterrupt`` at once. A step, evaluation or save that makes no progress for
``train.hang_timeout_s``, or a stop signal whose step boundary does not come within
``train.stop_timeout_s``, ends the process with every thread's stack in the run directory
(``rljax.training.watchdog``); another process of a multi-process run dying ends this one with one
line naming it and the resume command (``rljax.distributed.exit_if_lost_process``). Saving never changes the state, so where saves happen does not
change the run. The malloc tuning of ``rljax.host_memory`` is applied here (and by the CLI), never
on import.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import threading
import time
import warnings
from typing import Any

from rljax.distributed import any_process, exit_if_lost_process, process_index
from rljax.host_memory import keep_host_memory_for_run
from rljax.metrics_log import MetricsLogger
from rljax.sharding import active_mesh, use_mesh
from rljax.training.run_dir import config_dict
from rljax.training.watchdog import Watchdog
from rljax.update import NonFiniteLossError


class Preempted(Exception):
    """``fit`` stopped on a signal (SIGTERM, SIGINT, SIGHUP) at a step boundary; the state at ``step`` is saved.

    ``signum`` is the signal's number (``rljax train`` exits with ``128 + signum``: 143, 130, 129).
    """

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"received {signal.Signals(signum).name} at step {step}: checkpoint saved; "
                         "continue with rljax train CONFIG --resume")


def save(trainer, *, force: bool = False, data: dict | None = None) -> bool:
    """Checkpoint the trainer's state with its step, data position (``data``, default the iterator's
    current one) and resolved config as metadata (the config lets a resume refuse one that changes
    the run: ``rljax.training.run.Run.restore``); returns whether a checkpoint was started."""
    run = trainer.run
    data = trainer.iterator.state_dict() if data is None else data
    metadata = {"step": run.step, "data": data, "config": config_dict(run.cfg)}
    algorithm_state = getattr(trainer, "algorithm_state", None)  # state carried across steps, if any
    if algorithm_state is not None:
        metadata["algorithm_state"] = algorithm_state
    return run.checkpointer.save(run.step, run.state(), metadata, force=force)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop ``fit`` at the next step boundary with a checkpoint (``Preempted``)."""


class _StopSignals:
    """While installed, SIGTERM, SIGINT and SIGHUP only append their number to ``received``; a second
    SIGINT raises ``KeyboardInterrupt`` (the user insists). ``restore`` puts the previous handlers back.

    SIGHUP is a terminal or SSH session closing under a run started in it: by default it would end
    the process between checkpoints, losing the steps since the last save. Only the main thread may
    set handlers, so elsewhere nothing is installed. A signal the process ignores (SIGINT of a shell
    script's background job, SIGHUP under ``nohup``) stays ignored.
    """

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in STOP_SIGNALS:
            handler = signal.getsignal(s)
            if handler is not signal.SIG_IGN:
                self._previous[s] = handler
                signal.signal(s, self._on_signal)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        again = ""
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            again = " (Ctrl-C again: stop now, without saving)"
        try:  # os.write, not print: the signal may have interrupted a print to the same stream
            os.write(2, f"\nreceived {signal.Signals(signum).name}: stopping after this step with a "
                        f"checkpoint{again}\n".encode())
        except OSError:
            pass


def _stop_if_signalled(trainer, logger, received: list[int], *, stop: bool) -> None:
    """At a step boundary where ``stop`` (a signal reached some process: the decision all processes
    agreed on, ``rljax.distributed.any_process``): save (committed on return), log, raise ``Preempted``."""
    if not stop:
        return
    run = trainer.run
    save(trainer, force=True)
    run.checkpointer.wait()
    # a process that received no signal itself stops because another did
    err = Preempted(received[0] if received else signal.SIGTERM, run.step)
    logger.write(str(err))
    write_curves(run.cfg.train, active=logger.active)
    raise err


def write_curves(train, *, active: bool = True) -> None:
    """``RUN_DIR/curves.png`` of the run's metrics (``rljax.plots.plot_runs``), where ``train.plot``
    is on, ``active`` (process 0) and the environment does not set ``RLJAX_PLOT=0`` (the test
    suite does: matplotlib costs seconds a run). A failure to plot never fails the run: it warns."""
    if not (train.plot and active and os.environ.get("RLJAX_PLOT", "1") != "0"):
        return
    try:
        from rljax.plots import CURVES_FILE, plot_runs

        plot_runs([train.run_dir], os.path.join(train.run_dir, CURVES_FILE))
    except Exception as err:  # noqa: BLE001 - a picture must never cost the run
        warnings.warn(f"could not write {os.path.join(train.run_dir, 'curves.png')}: {type(err).__name__}: {err}",
                      RuntimeWarning, stacklevel=2)


def fit(trainer) -> dict[str, Any]:
    """Train ``trainer`` to ``trainer.total_steps``; returns the summary (also ``RUN_DIR/summary.json``).

    Everything runs inside the run's mesh (``run.mesh``, ``rljax.sharding.use_mesh``): batches are
    placed split over it and the model's activation constraints apply."""
    with mesh_of(trainer.run):
        return _fit(trainer)


def mesh_of(run):
    """``use_mesh(run.mesh, run.rules)``, or nothing for a run built without a mesh."""
    return contextlib.nullcontext() if run.mesh is None else use_mesh(run.mesh, run.rules)


def in_run_mesh(method):
    """A trainer method that runs inside its run's mesh (:func:`mesh_of`) as it does under :func:`fit`,
    when called on its own (a script's or a test's ``trainer.step_once()``).

    JAX keys a traced program on the context mesh: outside it, a step would trace and compile every
    program again, without the activation constraints ``fit``'s have. A mesh already active is kept.
    """
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.run.mesh is None or active_mesh() is not None:  # under fit, or a mesh the caller chose
            return method(self, *args, **kwargs)
        with mesh_of(self.run):
            return method(self, *args, **kwargs)
    return wrapper


def _fit(trainer) -> dict[str, Any]:
    keep_host_memory_for_run(trainer.run.cfg.is_online)  # the CLI has applied it already; a script may not
    run, train = trainer.run, trainer.run.cfg.train
    logger = MetricsLogger(train.run_dir, tensorboard=train.tensorboard, total_steps=trainer.total_steps,
                           progress=train.progress, keys_in_bar=trainer.log_keys)
    # a restored run (even at step 0, after a stop during the first evaluation) has logged that evaluation
    resumed = run.step > 0 or run.restored_metadata is not None
    if resumed:
        logger.truncate_after(run.step)
    summary: dict[str, Any] = {}
    start = time.perf_counter()
    save_seconds = None if train.save_every_minutes is None else 60.0 * train.save_every_minutes
    last_save = time.monotonic()
    signals = _StopSignals()
    signals.install()
    # a hung step (a collective that never completes) or a stop signal the step boundary never
    # answers ends the process with its stacks written (rljax.training.watchdog)
    watchdog = Watchdog(train.run_dir, hang_timeout_s=train.hang_timeout_s, stop_timeout_s=train.stop_timeout_s,
                        process_index=process_index())
    watchdog.start()
    try:
        if not resumed:
            watchdog.beat("the first evaluation")
            summary["before"] = trainer.evaluate()
            logger.log(0, {**summary["before"], **trainer.start_metrics()})
            trainer.on_evaluate(0)
        due = False
        while run.step < trainer.total_steps:
            # every process must agree before acting (a save or a stop runs collectives): a signal may
            # reach one host only, and each host's clock decides `due` alone; the save decided at the
            # end of the previous step happens here, together with the stop it may precede
            stop, due = any_process(bool(signals.received), due)
            if due and not stop and save(trainer, force=True):
                last_save = time.monotonic()
            _stop_if_signalled(trainer, logger, signals.received, stop=stop)
            # step_once advances the data iterator before it can fail: a stop saves the position before it
            position = trainer.iterator.state_dict()
            watchdog.beat(f"step {run.step + 1}")
            try:
                metrics = trainer.step_once()
            except NonFiniteLossError as err:
                if err.updates_applied:
                    # earlier updates of the step were applied: the state is neither the step's start
                    # nor its end, and no checkpoint of it can resume as a clean run would
                    latest = run.checkpointer.latest_step()
                    logger.write(f"stopping: {err}; {err.updates_applied} earlier update(s) of this step were "
                                 f"applied, so this state is not saved; the last clean state is checkpoint "
                                 f"{latest} (--resume continues from it)")
                else:
                    save(trainer, force=True, data=position)
                    logger.write(f"stopping: {err}; last good state saved at step {run.step}")
                raise
            evaluated = bool(train.eval_every and run.step % train.eval_every == 0 and run.step < trainer.total_steps)
            if evaluated:
                watchdog.beat(f"the evaluation at step {run.step}")
                metrics.update(trainer.evaluate())
            watchdog.beat(f"the end of step {run.step}")
            logger.log(run.step, metrics)
            trainer.on_step(logger)
            if evaluated:
                trainer.on_evaluate(run.step)
            # saves copy the state; they never change it, so where they happen does not change the run
            if run.checkpointer.should_save(run.step) and save(trainer, force=True):
                last_save = time.monotonic()
            due = save_seconds is not None and time.monotonic() - last_save >= save_seconds
        (stop,) = any_process(bool(signals.received))
        _stop_if_signalled(trainer, logger, signals.received, stop=stop)
        summary["train_seconds"] = round(time.perf_counter() - start, 2)
        watchdog.beat("the final evaluation")
        summary["after"] = trainer.evaluate()
        logger.log(run.step, summary["after"])
        trainer.on_evaluate(run.step)
        watchdog.beat("the final checkpoint")
        save(trainer, force=True)
        summary["steps"] = run.step
        trainer.on_end(summary)
        run.checkpointer.wait()  # summary.json is written once the final checkpoint is on disk
        if logger.active:  # process 0 of a multi-process run
            with open(os.path.join(train.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        write_curves(train, active=logger.active)
    except Exception as err:
        # another process of a multi-process run died: one line and out, not a traceback followed by
        # a minute's wait for the runtime's shutdown barrier and its abort (rljax.distributed)
        exit_if_lost_process(err)
        raise
    finally:
        run.checkpointer.close()  # not only wait: orbax's threads end here, not during interpreter exit
        logger.close()
        run.close()  # the run directory's lock: another run may use the directory now
        watchdog.stop()
        signals.restore()  # last: a signal during the final commit is only noted
    return summary


__all__ = ["Preempted", "fit", "in_run_mesh", "mesh_of", "save", "write_curves"]
