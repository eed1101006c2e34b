"""rljax.models.dtype_from_name: the one mapping from a config's dtype name to a dtype."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rljax.models import DTYPE_NAMES, dtype_from_name


def test_names_map_to_the_dtypes_numpy_and_jax_use():
    assert DTYPE_NAMES == ("float32", "bfloat16", "float64")
    assert dtype_from_name("float32") == np.float32 == jnp.float32
    assert dtype_from_name("float64") == np.float64
    assert dtype_from_name("bfloat16") == ml_dtypes.bfloat16 == jnp.bfloat16
    assert np.ones(2).astype(dtype_from_name("bfloat16")).dtype == jnp.bfloat16  # NumPy takes it
    assert jnp.ones(2, dtype_from_name("bfloat16")).dtype == jnp.bfloat16  # and JAX


@pytest.mark.parametrize("bad", ["bf16", "float16", "Float32", "", None])
def test_other_values_are_an_error_naming_them_and_the_allowed_names(bad):
    with pytest.raises(ValueError, match=rf"unknown dtype {bad!r}.*float32, bfloat16, float64"):
        dtype_from_name(bad)


@pytest.mark.parametrize("key", ["dtype", "param_dtype"])
def test_a_float64_model_needs_64_bit_jax_and_the_error_says_how(key):
    import jax

    from rljax.config import ConfigError, from_yaml
    from rljax.run_config import RunConfig

    text = f"model: {{{key}: float64}}\nrewards: {{answer: 1.0}}"
    with pytest.raises(ConfigError, match=rf"model.{key}: float64 needs 64-bit JAX: set JAX_ENABLE_X64=1"):
        from_yaml(RunConfig, text)
    with jax.enable_x64(True):
        assert from_yaml(RunConfig, text).model.storage_dtype == "float64"
