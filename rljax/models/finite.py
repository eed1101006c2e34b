"""The check every weight reader applies: a checkpoint tensor with NaN or inf is refused by name.

A NaN in the weights on disk otherwise loads silently, makes every logit NaN, and is only noticed
steps later as a non-finite loss (or, with a finite loss and a NaN-producing update, never clearly).
"""

from __future__ import annotations

import numpy as np


def require_finite(array: np.ndarray, *, tensor: str, source: str) -> np.ndarray:
    """Return ``array`` if every value is finite; else raise ``ValueError`` naming ``tensor`` in ``source``
    with the count of NaN and inf values and the first bad index."""
    finite = np.isfinite(array)
    if finite.all():
        return array
    nan, inf = int(np.count_nonzero(np.isnan(array))), int(np.count_nonzero(np.isinf(array)))
    first = tuple(int(i) for i in np.argwhere(~finite)[0])
    raise ValueError(
        f"{source}: tensor {tensor!r} (shape {tuple(array.shape)}) holds {nan} NaN and {inf} inf values "
        f"(first at index {first}); refusing to load non-finite weights")


__all__ = ["require_finite"]
