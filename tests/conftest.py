"""Test-wide settings: no silent rank promotion, float32 matmuls at full precision."""
import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")
