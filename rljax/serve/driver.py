"""One thread that owns a rollout engine, for callers on other threads (an HTTP server's handlers).

    driver = EngineDriver(engine)            # starts the thread
    future = driver.submit([Request(...), ...], on_tokens=callback)[0]
    output = future.result()                 # an rljax.inference.Output
    driver.close()

:class:`~rljax.inference.Engine` is not thread-safe, so every call into it (submit, step, cancel,
set_weights) runs on the driver's thread; requests submitted from many threads between two steps
are batched by the engine like any others. ``on_tokens(token_ids, logprobs, top_logprobs)`` is called
on the driver's thread after each step in which a running request sampled new tokens (what it has so
far, as :meth:`Engine.progress` gives it);
it returns True to cancel the request there and then (a stop string found), so it must be quick.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, Sequence

from rljax.inference import Engine, Output, Request

OnTokens = Callable[[list, list, list], bool]


class EngineDriver:
    """Runs ``engine`` on a background thread (see the module docstring)."""

    def __init__(self, engine: Engine, *, name: str = "rljax-engine"):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._watchers: dict[int, tuple[OnTokens, int]] = {}  # id -> (callback, tokens seen)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from any thread
    def submit(self, requests: Sequence[Request], on_tokens: Sequence[OnTokens | None] | None = None
               ) -> list[concurrent.futures.Future]:
        """Queue ``requests`` together; one future per request, resolved with its :class:`Output`.

        Blocks until the engine has accepted or refused them: a bad request raises its
        :class:`~rljax.errors.UserError` here and none of ``requests`` runs."""
        on_tokens = list(on_tokens) if on_tokens is not None else [None] * len(requests)
        return self.call(lambda: self._submit(list(requests), on_tokens))

    def cancel(self, futures: Sequence[concurrent.futures.Future]) -> None:
        """Stop the requests of ``futures`` that are still running (their outputs say "cancelled")."""
        ids = [f.request_id for f in futures if not f.done()]
        if ids:
            self._commands.put((lambda: [self.engine.cancel(i) for i in ids], None))

    def set_weights(self, states) -> None:
        """``engine.set_weights(states)`` between two steps; returns when done."""
        self.call(lambda: self.engine.set_weights(states))

    def call(self, fn: Callable):
        """Run ``fn()`` on the driver's thread between two steps; its result, or its exception raised here."""
        if self._closed:
            raise RuntimeError("the engine driver is closed")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, done))
        return done.result()

    def close(self) -> None:
        """Stop the thread; requests still running are cancelled (their futures get an error)."""
        if not self._closed:
            self._closed = True
            self._commands.put((None, None))
            self._thread.join()

    # ------------------------------------------------------------------ the driver's thread
    def _submit(self, requests: list[Request], on_tokens: list) -> list[concurrent.futures.Future]:
        ids: list[int] = []
        try:
            for r in requests:
                ids.append(self.engine.submit(r))
        except BaseException:
            for i in ids:
                self.engine.cancel(i)  # the loop collects their outputs; no future waits for them
            raise
        futures = []
        for i, callback in zip(ids, on_tokens):
            f: concurrent.futures.Future = concurrent.futures.Future()
            f.request_id = i  # type: ignore[attr-defined]
            self._futures[i] = f
            if callback is not None:
                self._watchers[i] = (callback, 0)
            futures.append(f)
        return futures

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting for one if ``block``); False when asked to stop."""
        while True:
            try:
                fn, done = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if fn is None:
                return False
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                if done is not None:
                    done.set_exception(e)
            else:
                if done is not None:
                    done.set_result(result)

    def _loop(self) -> None:
        try:
            while self._run_commands(block=not self.engine.has_work()):
                if self.engine.has_work():
                    for out in self.engine.step():
                        self._resolve(out)
                self._collect()
                self._watch()
        except BaseException as e:  # noqa: BLE001 -- a failed step fails every request in flight
            for f in self._futures.values():
                f.set_exception(e)
            self._futures.clear()
            self._closed = True
            raise
        for i, f in self._futures.items():
            f.set_exception(RuntimeError("the engine driver was closed before the request finished"))
        self._futures.clear()

    def _collect(self) -> None:
        """Resolve every output finished outside a step (cancellations)."""
        for out in self.engine.pop_finished():
            self._resolve(out)

    def _resolve(self, out: Output) -> None:
        watcher = self._watchers.pop(out.request_id, None)
        if watcher is not None and len(out.token_ids) > watcher[1]:
            watcher[0](list(out.token_ids), list(out.logprobs), list(out.top_logprobs))  # the last tokens, before the output
        f = self._futures.pop(out.request_id, None)
        if f is not None:
            f.set_result(out)

    def _watch(self) -> None:
        for i, (callback, seen) in list(self._watchers.items()):
            progress = self.engine.progress(i)
            if progress is None or len(progress[0]) == seen:
                continue
            self._watchers[i] = (callback, len(progress[0]))
            try:
                stop = callback(*progress)
            except Exception as e:  # noqa: BLE001 -- the request fails, the others go on
                self._watchers.pop(i, None)
                f = self._futures.pop(i, None)
                if f is not None:
                    f.set_exception(e)
                stop = True
            if stop:
                self.engine.cancel(i)
        self._collect()
