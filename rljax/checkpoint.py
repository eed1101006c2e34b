"""Checkpoint save / restore of the training state with orbax-checkpoint.

A checkpoint at step ``s`` is a directory ``<directory>/<s>/`` holding two items:

* ``state``: a pytree of arrays -- parameters, optimizer state, the step counter, the training PRNG
  key(s) -- written with ``ocp.args.StandardSave`` (tensorstore/zarr, sharded arrays written by
  their owning hosts). Typed PRNG keys (``jax.random.key``) are stored as their key data and
  restored as typed keys; raw ``uint32`` keys work too.
* ``metadata``: a small JSON dict -- data-loader position, the resolved config as a plain dict
  (``rljax.training.loop.save``), anything that is not an array -- written with
  ``ocp.args.JsonSave``. :meth:`Checkpointer.save` adds ``state_fingerprints`` (see below);
  :meth:`Checkpointer.restore` checks and removes it.

Usage in a trainer::

    ckpt = Checkpointer(run_dir / "checkpoints", save_every=cfg.save_every)
    if ckpt.latest_step() is not None:                       # resume
        state, meta = ckpt.restore(abstract_state=abstract_like(state))
    ...
    if ckpt.should_save(step) and is_finite_tree(loss):
        ckpt.save(step, state, {"data_position": pos})
    ...
    ckpt.save(final_step, state, {...}, force=True)
    ckpt.close()

Atomicity: orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it into place
only once every item is complete, so a crash mid-save leaves the previous checkpoints intact and
the unfinished step invisible to :meth:`Checkpointer.latest_step` / :meth:`Checkpointer.restore`.
Leftover temporary directories are deleted when a (writable) ``Checkpointer`` is opened.

Corruption: orbax checksums only its index, and a flipped byte inside the compressed array data
reads back as other (often finite) numbers. So :meth:`Checkpointer.save` stores a fingerprint of
every leaf (:func:`fingerprint_tree`: a position-weighted sum of its bits, computed on device) and
:meth:`Checkpointer.restore` recomputes it: a step whose files cannot be read, whose values do not
match their fingerprints or are not finite is unreadable. Restoring the latest step falls back to
the newest readable one, logging which step failed, why and which is used
(:attr:`Checkpointer.unreadable_steps`); an explicit ``step`` is restored exactly or not at all.

The NaN rule: **the trainer must never save a non-finite state.** A step whose loss or gradients are
not finite is skipped or the run stops; it is not checkpointed, so the latest checkpoint is always
one a run can resume from. :func:`is_finite_tree` is the check, and :meth:`Checkpointer.save`
applies it to the state as a backstop (``check_finite=True``).

Saves are asynchronous by default: :meth:`Checkpointer.save` returns once the arrays are copied to
host memory and the files are written in the background. :meth:`Checkpointer.wait` blocks until
the write is committed; :meth:`Checkpointer.close` waits too. All hosts of a multi-host run call
``save`` / ``restore`` together.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rljax.errors import UserError

__all__ = ["Checkpointer", "CheckpointReadError", "abstract_like", "fingerprint_tree", "is_finite_tree"]

logger = logging.getLogger(__name__)

_STATE = "state"
_METADATA = "metadata"
_FINGERPRINTS = "state_fingerprints"


class CheckpointReadError(UserError, RuntimeError):
    """No checkpoint could be read: every step tried is named with the reason it failed. A
    :class:`rljax.errors.UserError` (the checkpoint is input the user named: ``rljax`` prints the
    message as its error line)."""


def is_finite_tree(tree: Any) -> bool:
    """True iff every floating-point leaf of ``tree`` is free of NaN and +-inf.

    Integer, boolean and PRNG-key leaves are ignored. JAX arrays are checked on device in one
    jitted reduction (compiled once per tree structure), then one scalar is fetched; NumPy and
    Python values are checked on the host.
    """
    device_leaves = []
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):  # floating and complex, bfloat16 too
                device_leaves.append(leaf)
        elif isinstance(leaf, (float, complex, np.ndarray, np.generic)):
            host = np.asarray(leaf)
            if jnp.issubdtype(host.dtype, jnp.inexact) and not np.all(np.isfinite(host)):
                return False
    return not device_leaves or bool(_all_finite(device_leaves))


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def fingerprint_tree(tree: Any) -> list[list]:
    """``[dtype name, fingerprint]`` for every leaf of ``tree`` (``jax.tree.leaves`` order).

    A leaf's fingerprint is ``sum_i bits_i * (2654435761 * i | 1) mod 2**32`` over its elements in
    row-major order, ``bits_i`` the element's bit pattern (as an unsigned integer of its width; 64-bit
    ones folded to 32 bits; typed PRNG keys by their key data). Every weight is odd, so a change to any
    one element changes the sum; several changes cancel with probability about ``2**-32``. It is
    computed on device in one jitted call (sharded leaves stay sharded: the flat position comes from
    ``broadcasted_iota``, not a reshape) and one small fetch. A leaf of a dtype without a bit view
    (complex, 4-bit) gets ``None``.
    """
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    # one call per set of devices: a jitted call takes arrays on one set only (a replicated PRNG key
    # restored onto one device sits beside parameters sharded over all of them)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        if _bits_dtype(x) is not None:
            groups.setdefault(frozenset(d.id for d in x.sharding.device_set), []).append(i)
    values: dict[int, int] = {}
    for indices in groups.values():
        for i, v in zip(indices, jax.device_get(_fingerprints([leaves[i] for i in indices])), strict=True):
            values[i] = int(v)
    return [[str(x.dtype), values.get(i)] for i, x in enumerate(leaves)]


def _bits_dtype(x: jax.Array):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) or x.dtype == jnp.bool_:
        return jnp.uint32
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return None
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}.get(x.dtype.itemsize)


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if x.dtype == jnp.bool_:
            bits = x.astype(jnp.uint32)
        else:
            bits = jax.lax.bitcast_convert_type(x, _bits_dtype(x))
            if bits.dtype == jnp.uint64:
                bits = bits ^ (bits >> 32)
            bits = bits.astype(jnp.uint32)
        position = jnp.zeros(x.shape, jnp.uint32)
        stride = 1
        for axis in reversed(range(x.ndim)):
            position = position + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % 2**32)
            stride *= x.shape[axis]
        weight = (position * jnp.uint32(2654435761)) | jnp.uint32(1)
        out.append(jnp.sum(bits * weight, dtype=jnp.uint32))
    return out


def abstract_like(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves (shape, dtype and, for jax arrays, sharding) of ``tree``.

    The target to pass to :meth:`Checkpointer.restore`. Unlike ``ocp.utils.to_shape_dtype_struct``
    it keeps typed PRNG keys as key dtypes. ``ShapeDtypeStruct`` leaves are kept as they are, so
    the result of ``jax.eval_shape(init_fn, ...)`` (with shardings) may be passed directly.
    """

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    return jax.tree.map(leaf, tree)


class Checkpointer:
    """Periodic, atomic, size-limited checkpoints of a training state in one directory.

    Args:
      directory: where step directories are written (created unless ``read_only``).
      save_every: :meth:`should_save` is true every ``save_every`` steps; 0 means only forced saves.
      max_to_keep: number of most recent checkpoints kept; older ones are deleted after a save.
        ``None`` keeps all.
      async_save: write in a background thread (see module docstring).
      read_only: open existing checkpoints for restoring only (eval / generate); the directory
        must exist.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {save_every}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        self._directory = Path(directory).absolute()
        if read_only and not self._directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self._directory} does not exist")
        self._save_every = save_every
        self._read_only = read_only
        self.unreadable_steps: list[tuple[int, str]] = []  # (step, reason) skipped by the last restore
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
            # Our should_save decides when to save; the manager saves whenever it is asked.
            save_interval_steps=1,
        )
        self._manager = ocp.CheckpointManager(
            self._directory, options=options, item_names=(_STATE, _METADATA)
        )
        # orbax deletes leftover temporary directories in a background thread; wait for it here, so no
        # orbax thread outlives an early error: one still running when the process ends prints a
        # "cannot schedule new futures after shutdown" traceback after the command's error line
        await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()

    @property
    def directory(self) -> Path:
        """The checkpoint directory (absolute)."""
        return self._directory

    def should_save(self, step: int) -> bool:
        """Whether the periodic schedule saves at ``step`` (``step % save_every == 0``, step > 0)."""
        return self._save_every > 0 and step > 0 and step % self._save_every == 0

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints in the directory, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` if there is none."""
        return self._manager.latest_step()

    def save(
        self,
        step: int,
        state: Any,
        metadata: dict[str, Any] | None = None,
        *,
        force: bool = False,
        check_finite: bool = True,
    ) -> bool:
        """Saves ``state`` (a pytree of arrays) and JSON ``metadata`` as checkpoint ``step``.

        Saves only if ``force`` or :meth:`should_save` ``(step)``; a step already on disk is not
        overwritten. Returns whether a checkpoint was started.

        Raises:
          ValueError: a floating leaf of ``state`` is not finite (with ``check_finite``), or
            ``metadata`` is not JSON-serialisable.
        """
        if self._read_only:
            raise RuntimeError(f"checkpointer for {self._directory} is read-only")
        if not force and not self.should_save(step):
            return False
        if step in self._manager.all_steps():
            return False
        metadata = {} if metadata is None else metadata
        try:
            # Fail here, not in the background writer; strict JSON (no NaN) keeps it portable.
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint metadata must be JSON-serialisable: {e}") from None
        if check_finite and not is_finite_tree(state):
            raise ValueError(
                f"refusing to checkpoint step {step}: the state has non-finite values; "
                "the trainer must never save a NaN/inf state"
            )
        metadata = {**metadata, _FINGERPRINTS: fingerprint_tree(state)}
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(state), _METADATA: ocp.args.JsonSave(metadata)}
            ),
            force=True,
        )

    def restore(
        self, step: int | None = None, *, abstract_state: Any
    ) -> tuple[Any, dict[str, Any]]:
        """Restores checkpoint ``step`` (default: the newest readable one) as ``(state, metadata)``.

        ``abstract_state`` is the target: a pytree with the saved structure whose leaves are
        ``jax.ShapeDtypeStruct`` (see :func:`abstract_like`; give shardings to restore sharded) or
        arrays. Restored leaves get its shapes, dtypes (values are cast if the saved dtype
        differs) and shardings; typed PRNG keys come back typed.

        A step is unreadable when orbax/tensorstore cannot read it, its values do not match the
        fingerprints saved with them, or they are not finite. With ``step=None`` an unreadable step
        is skipped for the one before it, with a log line (which step, why, which is used); the
        skipped steps are in :attr:`unreadable_steps` (see :meth:`set_aside`).

        Raises:
          FileNotFoundError: no checkpoint (at ``step``) in the directory.
          CheckpointReadError: ``step`` is unreadable, or (``step=None``) every step is; the
            message names each step tried and why it failed.
          ValueError: the tree structure differs from the saved one.
        """
        self._manager.wait_until_finished()
        if not self._directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self._directory} does not exist")
        # The listing is cached; rescan so checkpoints written by another process are seen.
        self._manager.reload()
        steps = self.all_steps()
        self.unreadable_steps = []
        if step is not None and step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self._directory}; available steps: {steps}"
            )
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {self._directory}")
        target = abstract_like(abstract_state)
        for tried in [step] if step is not None else steps[::-1]:
            try:
                state, metadata = self._restore_step(tried, target)
            except _StructureError:
                raise
            except Exception as e:  # orbax and tensorstore raise many types for damaged files
                if "tree structures do not match" in str(e):  # orbax: the target is not the saved tree
                    raise ValueError(f"checkpoint step {tried} in {self._directory}: {e}") from e
                reason = _one_line(e)
                self.unreadable_steps.append((tried, reason))
                if step is not None:
                    raise CheckpointReadError(
                        f"checkpoint step {step} in {self._directory} cannot be read: {reason}; "
                        f"available steps: {steps}"
                    ) from e
                earlier = [s for s in steps if s < tried]
                logger.warning("checkpoint step %d in %s cannot be read (%s); %s", tried, self._directory, reason,
                               f"trying step {earlier[-1]}" if earlier else "no earlier step")
                continue
            if self.unreadable_steps:
                logger.warning("restoring checkpoint step %d (unreadable: %s)", tried,
                               ", ".join(str(s) for s, _ in self.unreadable_steps))
            return state, metadata
        tried = "; ".join(f"step {s}: {r}" for s, r in self.unreadable_steps)
        raise CheckpointReadError(f"no checkpoint in {self._directory} can be read ({tried})")

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardRestore(target), _METADATA: ocp.args.JsonRestore()}
            ),
        )
        state = restored[_STATE]
        _check_matches(state, target)
        metadata = dict(restored[_METADATA] or {})
        saved = metadata.pop(_FINGERPRINTS, None)
        if saved is not None:  # checkpoints written before fingerprints were stored have none
            got = fingerprint_tree(state)
            paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
            for path, (dtype, want), (now_dtype, now) in zip(paths, saved, got, strict=True):
                # a leaf restored into another dtype (cast on purpose) cannot be compared bit for bit
                if dtype == now_dtype and want is not None and want != now:
                    raise ValueError(f"leaf {path} does not match the fingerprint saved with it (damaged files)")
        if not is_finite_tree(state):
            raise ValueError("the restored state has non-finite values (damaged files: saves are always finite)")
        return state, metadata

    def set_aside(self, step: int, reason: str) -> Path:
        """Renames step ``step``'s folder to ``<step>.<reason>`` (``reason`` a short slug such as
        ``unreadable``), out of orbax's view: later saves of that step are not skipped and later
        restores do not try it. The files are kept for inspection. Returns the new path."""
        if self._read_only:
            raise RuntimeError(f"checkpointer for {self._directory} is read-only")
        self._manager.wait_until_finished()
        source = self._directory / str(step)
        target = self._directory / f"{step}.{reason}"
        suffix = 1
        while target.exists():
            suffix += 1
            target = self._directory / f"{step}.{reason}-{suffix}"
        os.rename(source, target)
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Blocks until every started save is committed to disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StructureError(ValueError):
    """The restored tree is not the target's: a caller's mistake, never a damaged step."""


def _one_line(e: BaseException) -> str:
    """An exception as one short line: the type and first message line of its root cause (orbax
    wraps tensorstore's specific error in a generic one)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def _check_matches(state: Any, target: Any) -> None:
    """Guards the promise that restored leaves have the target's structure, shapes and dtypes."""
    state_def, target_def = jax.tree.structure(state), jax.tree.structure(target)
    if state_def != target_def:
        raise _StructureError(f"restored tree {state_def} differs from the target {target_def}")
    state_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, got), want in zip(state_leaves, jax.tree.leaves(target), strict=True):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise _StructureError(
                f"restored leaf {jax.tree_util.keystr(path)} is {got.dtype}{list(got.shape)}, "
                f"expected {want.dtype}{list(want.shape)}"
            )
