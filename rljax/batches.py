"""Token rows into arrays: the one padding helper.

    ids, mask = pad_sequences([[5, 6, 7], [8]], side="left", pad_id=0)          # [2, 3]
    ids, mask = pad_sequences(rows, side="right", pad_id=0, buckets=(16, 24, 32))  # width bucketed

Prompts are padded on the left (every row's last prompt token in the last column, so generation
continues at one position for the whole batch); completions on the right (token ``t`` of every
row in column ``t``). Every place that turns token lists into arrays (prompt batches, offline
batches, the reward model's scoring, ``rljax generate``) goes through :func:`pad_sequences`.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np


def pad_sequences(
    rows: Sequence[Sequence[int]],
    *,
    side: Literal["left", "right"],
    pad_id: int,
    width: int | None = None,
    buckets: Sequence[int] | None = None,
    num_rows: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` ``[num_rows, W]`` int32 of token ``rows`` padded on ``side`` with ``pad_id``.

    ``W`` is ``width`` if given, else the smallest of ``buckets`` that fits the longest row (else
    the longest row). ``num_rows`` (default ``len(rows)``) appends empty rows (mask 0). A row longer
    than ``W``, or more rows than ``num_rows``, is an error naming it: cutting is the caller's choice.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    longest = max((len(r) for r in rows), default=0)
    if width is None:
        width = longest
        if buckets:
            fitting = [b for b in sorted(buckets) if b >= longest]
            if not fitting:
                raise ValueError(f"the longest row has {longest} tokens, over the largest bucket {max(buckets)}")
            width = fitting[0]
    num_rows = len(rows) if num_rows is None else num_rows
    if len(rows) > num_rows:
        raise ValueError(f"{len(rows)} rows do not fit num_rows={num_rows}")
    ids = np.full((num_rows, width), pad_id, np.int32)
    mask = np.zeros((num_rows, width), np.int32)
    for i, row in enumerate(rows):
        n = len(row)
        if n > width:
            raise ValueError(f"row {i} has {n} tokens, over the width {width}")
        if n == 0:
            continue
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, cols], mask[i, cols] = row, 1
    return ids, mask


__all__ = ["pad_sequences"]
