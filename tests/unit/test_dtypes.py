"""rljax.models.dtype_from_name: the one mapping from a config's dtype name to a dtype."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rljax.models import DTYPE_NAMES, dtype_from_name


def test_names_map_to_the_dtypes_numpy_and_jax_use():
    assert DTYPE_NAMES == ("float32", "bfloat16")
    assert dtype_from_name("float32") == np.float32 == jnp.float32
    assert dtype_from_name("bfloat16") == ml_dtypes.bfloat16 == jnp.bfloat16
    assert np.ones(2).astype(dtype_from_name("bfloat16")).dtype == jnp.bfloat16  # NumPy takes it
    assert jnp.ones(2, dtype_from_name("bfloat16")).dtype == jnp.bfloat16  # and JAX


@pytest.mark.parametrize("bad", ["bf16", "float16", "Float32", "", None])
def test_other_values_are_an_error_naming_them_and_the_allowed_names(bad):
    with pytest.raises(ValueError, match=rf"unknown dtype {bad!r}.*float32, bfloat16"):
        dtype_from_name(bad)
