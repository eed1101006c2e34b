"""A run that stops making progress ends, with every thread's Python stack on disk, instead of hanging.

    watchdog = Watchdog(run_dir, hang_timeout_s=1800, stop_timeout_s=60)
    watchdog.start()          # in the main thread, after the stop-signal handlers are installed
    watchdog.beat("step 3")   # at every point of the loop that shows progress
    watchdog.stop()

Two deadlines, checked by a daemon thread once a second:

* no :meth:`Watchdog.beat` for ``hang_timeout_s`` seconds (a step, evaluation or save stuck in a
  collective that will never complete, a reward function that never returns): the stacks of every
  thread go to ``RUN_DIR/hang_stacks.process<i>.txt``, one line says so on stderr, and the process
  exits with :data:`HANG_EXIT_CODE` (75, ``EX_TEMPFAIL``: a scheduler restarts the job, which resumes
  from its last checkpoint).
* a stop signal (SIGTERM, SIGINT, SIGHUP) and the process still alive ``stop_timeout_s`` seconds
  later (the step boundary where ``rljax.training.loop`` saves and stops never came): the stacks are
  written the same way and the process exits with ``128 + signal``. The thread learns of the signal
  from the interpreter's wakeup file descriptor (``signal.set_wakeup_fd``), written by the C-level
  handler, because the Python handler runs only when the main thread returns to the interpreter,
  which a thread blocked inside an XLA computation never does.

Exiting is ``os._exit``: a hung collective or an orbax thread waiting on one would block a normal
exit for ever. ``faulthandler.dump_traceback_later`` is armed a minute past the hang deadline as a
backstop that needs no interpreter lock (stacks to stderr, exit status 1), for a hang that holds it.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
import threading
import time

HANG_EXIT_CODE = 75
"""Exit status of a run the watchdog ended for making no progress (``EX_TEMPFAIL``: try again)."""

_BACKSTOP_MARGIN_S = 60.0


def stacks_path(run_dir: str, process_index: int) -> str:
    """Where the watchdog writes every thread's stack for process ``process_index``."""
    return os.path.join(run_dir, f"hang_stacks.process{process_index}.txt")


class Watchdog:
    """The two deadlines of the module docstring; ``None`` turns one off. ``process_index`` names the
    stacks file (each process of a multi-process run writes its own); ``write`` prints the one line
    (default: stderr)."""

    def __init__(self, run_dir: str, *, hang_timeout_s: float | None, stop_timeout_s: float | None,
                 process_index: int = 0, write=None, poll_s: float = 1.0):
        self.run_dir, self.hang_timeout_s, self.stop_timeout_s = run_dir, hang_timeout_s, stop_timeout_s
        self.process_index, self.poll_s = process_index, poll_s
        self._write = write or (lambda line: os.write(2, (line + "\n").encode()))
        self._last_beat = time.monotonic()
        self._doing = "starting"
        self._signalled: tuple[int, float] | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup_fd: int | None = None
        self._backstop = False

    def start(self) -> None:
        """Start the thread; in the main thread also listen for stop signals (wakeup fd)."""
        if self.hang_timeout_s is None and self.stop_timeout_s is None:
            return
        if self.stop_timeout_s is not None and threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            try:
                self._previous_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
                self._pipe = (r, w)
            except ValueError:  # not the main thread of the main interpreter
                os.close(r)
                os.close(w)
        self._last_beat = time.monotonic()
        self._arm_backstop()
        self._thread = threading.Thread(target=self._watch, name="rljax-watchdog", daemon=True)
        self._thread.start()

    def beat(self, doing: str) -> None:
        """Progress: the hang deadline restarts; ``doing`` (``"step 4"``) is what the run does next."""
        self._last_beat = time.monotonic()
        self._doing = doing
        self._arm_backstop()

    def stop(self) -> None:
        """Stop watching and give the wakeup fd back (idempotent)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._backstop:
            faulthandler.cancel_dump_traceback_later()
            self._backstop = False
        if self._pipe is not None:
            try:
                signal.set_wakeup_fd(self._previous_wakeup_fd if self._previous_wakeup_fd is not None else -1)
            except ValueError:
                pass
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    # ------------------------------------------------------------------ the thread
    def _arm_backstop(self) -> None:
        if self.hang_timeout_s is None:
            return
        faulthandler.dump_traceback_later(self.hang_timeout_s + _BACKSTOP_MARGIN_S, exit=True, file=sys.__stderr__)
        self._backstop = True

    def _watch(self) -> None:
        while not self._done.is_set():
            if self._pipe is not None:
                readable, _, _ = select.select([self._pipe[0]], [], [], self.poll_s)
                if readable:
                    self._read_signals()
            else:
                self._done.wait(self.poll_s)
            if self._done.is_set():
                return
            now = time.monotonic()
            if self.hang_timeout_s is not None and now - self._last_beat > self.hang_timeout_s:
                self._fire(f"no progress for {self.hang_timeout_s:g} s (train.hang_timeout_s) during {self._doing}",
                           HANG_EXIT_CODE, "exiting with status 75 so the job is restarted; it resumes "
                                           "from its last checkpoint (rljax train CONFIG --resume)")
            if self._signalled is not None and now - self._signalled[1] > self.stop_timeout_s:
                signum = self._signalled[0]
                name = signal.Signals(signum).name
                self._fire(f"{name} {self.stop_timeout_s:g} s ago and no step boundary since "
                           f"(train.stop_timeout_s) during {self._doing}", 128 + signum,
                           "exiting without a checkpoint; rljax train CONFIG --resume continues from the last one")

    def _read_signals(self) -> None:
        try:
            data = os.read(self._pipe[0], 512)
        except (BlockingIOError, OSError):
            return
        stops = {int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        for signum in data:
            if signum in stops and self._signalled is None and self.stop_timeout_s is not None:
                self._signalled = (signum, time.monotonic())

    def _fire(self, why: str, code: int, then: str) -> None:
        path = stacks_path(self.run_dir, self.process_index)
        where = f"every thread's stack is in {path}"
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"rljax watchdog: {why}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as err:
            where = f"could not write {path} ({err}); the stacks follow on stderr"
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        process = f"process {self.process_index}: " if self.process_index else ""
        try:
            self._write(f"rljax: {process}{why}; {where}; {then}")
        finally:
            os._exit(code)


__all__ = ["HANG_EXIT_CODE", "Watchdog", "stacks_path"]
