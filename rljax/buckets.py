"""Shape buckets: the one rule that pads a length or a batch size to a few sizes.

Every jitted program (sampler, update, scoring) compiles once per distinct shape, so lengths are
padded up to a bucket. The buckets are ``minimum`` times 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, ...
(four per power of two), so at most a fifth of a padded length is padding, while a run still
compiles only O(log n) programs: 13 prompt widths from 16 to 128. Powers of two alone waste up to
half (a 45-token chat prompt padded to 64 does 42% extra work); two per octave (16, 24, 32, 48, ...)
up to a third, and the padding saved shows in the step time (see docs/performance.md#prompt-buckets);
the price is one more compiled program per extra width a run meets.
"""

from __future__ import annotations


def bucket_length(n: int, minimum: int = 16, per_octave: int = 4) -> int:
    """The smallest bucket ``>= n``: from ``minimum``, each next bucket is the next multiple of
    ``2^k / per_octave`` (``2^k`` the largest power of two not above the current one). For a
    power-of-two ``minimum`` and ``per_octave=4``: ``minimum`` times 1, 1.25, 1.5, 1.75, 2, 2.5, ...
    (at most a fifth of a bucket is padding); ``per_octave=2``: times 1, 1.5, 2, 3, 4, 6, ... (at most
    a third, for half as many compiled shapes)."""
    if minimum < 1:
        raise ValueError(f"minimum must be positive, got {minimum}")
    if per_octave < 1:
        raise ValueError(f"per_octave must be positive, got {per_octave}")
    size = minimum
    while size < n:
        step = max((1 << (size.bit_length() - 1)) // per_octave, 1)
        size = (size // step + 1) * step
    return size


def bucket_sizes(maximum: int, minimum: int = 16, per_octave: int = 4) -> tuple[int, ...]:
    """Every bucket below ``maximum``, then ``maximum`` itself (so every allowed length fits one)."""
    if maximum < 1:
        raise ValueError(f"maximum must be positive, got {maximum}")
    sizes, size = [], min(minimum, maximum)
    while size < maximum:
        sizes.append(size)
        size = bucket_length(size + 1, minimum, per_octave)
    sizes.append(maximum)
    return tuple(sizes)
