"""Dtype names as configs and the command line spell them -> the dtype JAX and NumPy use."""

from __future__ import annotations

import jax.numpy as jnp

# float32 on CPU, bfloat16 on accelerators (rljax.run_config.ModelSection.dtype); float64 (with
# JAX_ENABLE_X64=1) checks an algebraic equality to float64 rounding.
DTYPE_NAMES = ("float32", "bfloat16", "float64")


def dtype_from_name(name: str) -> jnp.dtype:
    """``"float32"`` -> ``float32``, ``"bfloat16"`` -> ``bfloat16``, ``"float64"`` -> ``float64`` (a ``numpy.dtype``,
    so NumPy and JAX both take it).

    Any other value is a ValueError naming it and the allowed names.
    """
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return jnp.dtype(name)


__all__ = ["DTYPE_NAMES", "dtype_from_name"]
