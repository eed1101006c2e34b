"""Tiny model helpers for tests (the builders live in :mod:`rljax.models.tiny`)."""

from rljax.models.tiny import CHATML, byte_tokenizer, make_tiny_model_dir

tiny_tokenizer = byte_tokenizer

__all__ = ["CHATML", "make_tiny_model_dir", "model_with_value_head", "tiny_tokenizer"]


def model_with_value_head(config, seed: int = 1, **kwargs):
    """A random ``rljax.models.transformer.Transformer`` whose value head has random weights and bias 0.25
    (a fresh head is zero, so every position would read the same value); kwargs as ``init_model``'s."""
    import jax
    import jax.numpy as jnp

    from rljax.models.transformer import init_model

    model = init_model(config, seed=seed, value_head=True, **kwargs)
    dtype = model.value_head["w"][...].dtype
    model.value_head["w"][...] = jax.random.normal(jax.random.key(2), (config.hidden_size,), dtype)
    model.value_head["b"][...] = jnp.asarray([0.25], dtype)
    return model
