"""The asynchronous loop (``train.max_staleness: k >= 1``): a producer thread samples the batches of
steps t+1 .. t+k while the trainer updates on step t's.

    producer = RolloutProducer(produce, policy, start_step=t0, total_steps=T, max_staleness=k)
    item = producer.take(step)            # step's batch: rollout, its stats, data position, timings
    ...update...
    producer.publish(step + 1, policy)    # the new weights, for the batches still to be sampled

A policy *version* is the number of optimizer steps the policy has taken (the run's ``step``). Batch
``s`` is sampled by version ``v(s) = max(s0, s - k)`` (``s0``: the step the run started or resumed at)
with the prompts and sample key of step ``s``, and trained at step ``s`` by version ``s``: no token
lags more than ``k`` versions, and the producer never runs more than ``k + 1`` batches ahead (it
waits for ``v(s)`` to be published). Because the schedule, not thread timing, fixes which weights
sample which batch, a ``k >= 1`` run is deterministic given the seed. With ``partial_rollouts`` a
batch starts under ``v(s)`` and each engine step switches to the newest version published by then
(sequences in flight go on under the new weights, with the keys and values the old ones wrote): the
versions a token gets then depend on timing, and the run is not deterministic.

Why one producer thread: the engine (``rljax.inference.Engine``) has one owner; JAX dispatch is
thread-safe, so the trainer's update and the producer's generation run concurrently (on one set of
devices they share the devices: the overlap hides host work, rewards and the environment).
Weights reach the producer as copies (:meth:`RolloutProducer.publish`): the update donates its
parameter buffers, so the sampler must never hold the trainer's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ProducedBatch", "RolloutProducer", "staleness_metrics"]


@dataclasses.dataclass
class ProducedBatch:
    """One step's sampled batch: ``rollout`` (its ``versions`` filled), the sampler's ``stats``,
    ``position`` (the data iterator after its prompts), ``version`` (the one that started it) and
    ``generate_s`` (wall seconds the producer spent on it)."""

    step: int
    rollout: Any
    stats: dict
    position: dict
    version: int
    generate_s: float


class RolloutProducer:
    """The producer thread of the asynchronous loop (see the module docstring).

    ``produce(step, policy, refresh) -> (rollout, stats, position)`` samples and scores step ``step``'s
    batch with ``policy`` (a split ``(graphdef, params, frozen)``); ``refresh`` is None, or (partial
    rollouts) a callable for ``rljax.rollout.rollout``'s ``refresh_weights``. ``set_weights(policy)``
    gives the engine weights (partial rollouts only). ``context()``: entered by the thread around its
    work (the mesh it samples on: JAX's mesh context is per thread). ``place(policy)``: the sampler's
    own copy of a policy (default :func:`sampler_weights` with no mesh: a copy in place).
    """

    def __init__(self, produce: Callable, policy: tuple, *, start_step: int, total_steps: int, max_staleness: int,
                 partial_rollouts: bool = False, set_weights: Callable | None = None,
                 context: Callable = contextlib.nullcontext, place: Callable | None = None):
        if max_staleness < 1:
            raise ValueError(f"the asynchronous loop needs max_staleness >= 1, got {max_staleness}")
        if partial_rollouts and set_weights is None:
            raise ValueError("partial_rollouts needs set_weights (the engine's)")
        self.start_step, self.total_steps, self.max_staleness = start_step, total_steps, max_staleness
        self.partial_rollouts = partial_rollouts
        self._produce, self._set_weights, self._context = produce, set_weights, context
        self._place = place or sampler_weights
        self._cond = threading.Condition()
        self._versions: dict[int, tuple] = {}
        self._latest = -1
        self._ready: dict[int, ProducedBatch] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._next = start_step  # the next step whose batch the thread samples
        self.producing: int | None = None  # the step whose batch is being sampled (None: waiting or done)
        self.publish(start_step, policy)
        self._thread = threading.Thread(target=self._run, name="rljax-rollout-producer", daemon=True)
        self._thread.start()

    def version_for(self, step: int) -> int:
        """The policy version that starts step ``step``'s batch: ``max(start_step, step - max_staleness)``."""
        return max(self.start_step, step - self.max_staleness)

    # ------------------------------------------------------------------ trainer side
    def publish(self, version: int, policy: tuple) -> float:
        """Hand the producer a copy of ``policy``'s weights as ``version`` (``place``); returns the seconds
        the copy took (``time/weight_sync_s``). The trainer's arrays may be donated once this returns."""
        t0 = time.perf_counter()
        copied = self._place(policy)
        jax.block_until_ready(copied[1])
        seconds = time.perf_counter() - t0
        with self._cond:
            self._versions[version] = copied
            self._latest = max(self._latest, version)
            self._prune()
            self._cond.notify_all()
        return seconds

    def take(self, step: int) -> tuple[ProducedBatch, dict[str, float]]:
        """Step ``step``'s batch (waiting for it) and the loop's metrics: ``async/queue_batches`` (batches
        sampled and waiting when it was taken, itself included) and ``time/generate_overlap_s`` (its
        generation time not spent waiting: hidden behind the updates)."""
        t0 = time.perf_counter()
        with self._cond:
            while step not in self._ready and self._error is None:
                self._cond.wait(timeout=1.0)
            if step not in self._ready:
                raise self._error  # type: ignore[misc]
            queued = len(self._ready)
            item = self._ready.pop(step)
            self._cond.notify_all()
        waited = time.perf_counter() - t0
        return item, {"async/queue_batches": float(queued),
                      "time/generate_overlap_s": max(item.generate_s - waited, 0.0)}

    def wait_for_version(self, version: int, timeout: float = 600.0) -> bool:
        """Block until ``version`` is published (or the producer stops); True if it was."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._latest < version and not self._stop and time.monotonic() < deadline:
                self._cond.wait(timeout=0.1)
            return self._latest >= version

    def close(self) -> None:
        """Stop the thread (after the engine step it is in) and wait for it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60.0)

    # ------------------------------------------------------------------ producer side
    def _prune(self) -> None:
        """Drop the versions no batch still to be sampled starts from (the latest stays: partial rollouts)."""
        nxt = self.producing if self.producing is not None else self._next
        floor = min(self.version_for(nxt), self._latest)
        for v in [v for v in self._versions if v < floor]:
            del self._versions[v]

    def _run(self) -> None:
        try:
            with self._context():
                for step in range(self.start_step, self.total_steps):
                    version = self.version_for(step)
                    with self._cond:
                        self._next = step
                        while version not in self._versions and not self._stop:
                            self._cond.wait(timeout=1.0)
                        if self._stop:
                            return
                        policy = self._versions[version]
                        self.producing = step
                    t0 = time.perf_counter()
                    refresh = self._refresher(version) if self.partial_rollouts else None
                    roll, stats, position = self._produce(step, policy, refresh)
                    if roll.versions is None:
                        roll.versions = np.full(roll.completion_ids.shape, version, np.int32)
                    item = ProducedBatch(step, roll, stats, position, version, time.perf_counter() - t0)
                    with self._cond:
                        self._ready[step] = item
                        self.producing, self._next = None, step + 1
                        self._prune()
                        self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the trainer, which raises it
            with self._cond:
                self._error = err
                self.producing = None
                self._cond.notify_all()

    def _refresher(self, version: int) -> Callable[[], int]:
        current = [version]

        def refresh() -> int:
            with self._cond:
                if self._stop:
                    raise RuntimeError("the rollout producer was stopped")
                latest = self._latest
                policy = self._versions[latest] if latest != current[0] else None
            if policy is not None:
                self._set_weights(policy)
                current[0] = latest
            return current[0]

        return refresh


def sampler_weights(policy: tuple, mesh=None, rules=None, frozen=None) -> tuple:
    """The sampler's copy of a split ``policy`` ``(graphdef, params, frozen)``: colocated (``mesh``
    None) the parameters copied where they are; disaggregated, resharded onto ``mesh`` (the rollout
    devices) by the logical-axis ``rules``, with ``frozen`` the frozen state already placed there (None:
    placed now). The copy never aliases the trainer's buffers, which the update donates."""
    graphdef, params, rest = policy
    if mesh is None:
        return graphdef, jax.tree.map(jnp.copy, params), rest
    from rljax.sharding import param_shardings

    if frozen is None:
        frozen = jax.device_put(rest, param_shardings(rest, mesh, rules))
    return graphdef, jax.device_put(params, param_shardings(params, mesh, rules)), frozen


@jax.jit
def _staleness(versions, loss_mask, step):
    counted = loss_mask > 0
    lag = jnp.where(counted, step - versions, 0).astype(jnp.float32)
    n = jnp.sum(counted)
    return jnp.sum(lag) / jnp.maximum(n, 1), jnp.max(lag)


def staleness_metrics(versions, loss_mask, step: int) -> dict[str, float]:
    """``async/staleness_mean`` / ``async/staleness_max``: ``step - version`` over the tokens the loss
    counts (``loss_mask > 0``), in policy versions; 0 when none counts. One jitted call (the batch
    may be split over processes)."""
    mean, most = _staleness(versions, loss_mask, jnp.asarray(step, jnp.int32))
    return {"async/staleness_mean": float(mean), "async/staleness_max": float(most)}
