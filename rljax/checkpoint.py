"""Checkpoint save / restore of the training state with orbax-checkpoint.

A checkpoint at step ``s`` is a directory ``<directory>/<s>/`` holding two items:

* ``state``: a pytree of arrays -- parameters, optimizer state, the step counter, the training PRNG
  key(s) -- written with ``ocp.args.StandardSave`` (tensorstore/zarr, sharded arrays written by
  their owning hosts). Typed PRNG keys (``jax.random.key``) are stored as their key data and
  restored as typed keys; raw ``uint32`` keys work too.
* ``metadata``: a small JSON dict -- data-loader position, the config as YAML text, wall time,
  anything that is not an array -- written with ``ocp.args.JsonSave``.

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
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "abstract_like", "is_finite_tree"]

_STATE = "state"
_METADATA = "metadata"


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
        """Restores checkpoint ``step`` (default: the latest) as ``(state, metadata)``.

        ``abstract_state`` is the target: a pytree with the saved structure whose leaves are
        ``jax.ShapeDtypeStruct`` (see :func:`abstract_like`; give shardings to restore sharded) or
        arrays. Restored leaves get its shapes, dtypes (values are cast if the saved dtype
        differs) and shardings; typed PRNG keys come back typed.

        Raises:
          FileNotFoundError: no checkpoint (at ``step``) in the directory.
          ValueError: the tree structure differs from the saved one.
        """
        self._manager.wait_until_finished()
        if not self._directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {self._directory} does not exist")
        # The listing is cached; rescan so checkpoints written by another process are seen.
        self._manager.reload()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint in {self._directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self._directory}; available steps: {steps}"
            )
        target = abstract_like(abstract_state)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardRestore(target), _METADATA: ocp.args.JsonRestore()}
            ),
        )
        state = restored[_STATE]
        _check_matches(state, target)
        return state, dict(restored[_METADATA] or {})

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


def _check_matches(state: Any, target: Any) -> None:
    """Guards the promise that restored leaves have the target's structure, shapes and dtypes."""
    state_def, target_def = jax.tree.structure(state), jax.tree.structure(target)
    if state_def != target_def:
        raise ValueError(f"restored tree {state_def} differs from the target {target_def}")
    state_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, got), want in zip(state_leaves, jax.tree.leaves(target), strict=True):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(
                f"restored leaf {jax.tree_util.keystr(path)} is {got.dtype}{list(got.shape)}, "
                f"expected {want.dtype}{list(want.shape)}"
            )
