"""One seed, named random streams, one key per step.

A run has a single integer ``seed`` in its config. Each consumer of randomness gets its own stream,
derived from the seed and a name, so adding a consumer never shifts the numbers another one draws::

    init_key = rng.stream(cfg.seed, "init")        # parameter initialisation
    sample_stream = rng.stream(cfg.seed, "sample")   # generation
    key = rng.step_key(sample_stream, step)         # the key for training step ``step``

Conventional names: ``"init"``, ``"data"`` (shuffling), ``"sample"`` (generation), ``"dropout"``.

Streams are typed JAX keys (``jax.random.key``, default implementation). The name is mixed in with
``zlib.crc32`` of its UTF-8 bytes -- not Python's ``hash()``, which is salted per process -- so a
stream is the same in every run, process and Python version. Per-step keys are
``fold_in(stream, step)``: a pure function of (seed, name, step), so a resumed run draws exactly
the keys an uninterrupted run would, with no RNG state to carry beyond the step number.
"""

from __future__ import annotations

import operator
import zlib

import jax

__all__ = ["stream", "step_key", "name_to_int"]


def name_to_int(name: str) -> int:
    """The stable 32-bit integer a stream name is folded in as (CRC-32 of its UTF-8 bytes)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a stream name must be a non-empty string, got {name!r}")
    return zlib.crc32(name.encode("utf-8"))


def stream(seed: int, name: str) -> jax.Array:
    """The typed PRNG key of stream ``name`` for run seed ``seed``; same inputs, same key."""
    if isinstance(seed, bool):
        raise TypeError("seed must be an integer, got a bool")
    seed = operator.index(seed)  # ints and NumPy integers; rejects floats
    return jax.random.fold_in(jax.random.key(seed), name_to_int(name))


def step_key(stream_key: jax.Array, step: int | jax.Array) -> jax.Array:
    """The key for training step ``step`` of a stream: ``jax.random.fold_in(stream_key, step)``.

    ``step`` may be a traced integer, so this works inside ``jax.jit``.
    """
    return jax.random.fold_in(stream_key, step)
