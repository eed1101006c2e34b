"""Models: the Llama-family transformer, its configs, and loading from names, HF directories and GGUF.

    model, tokenizer = rljax.models.load("smollm2-135m-instruct")
    logits = model(input_ids, attention_mask)            # [B, T, V], float32
    hidden, _ = model.forward(input_ids, attention_mask)  # [B, T, D]
    values = model.values(hidden)                         # [B, T], with value_head=True
"""

from __future__ import annotations

import jax.numpy as jnp

from rljax.models.config import ModelConfig, UnsupportedConfigError
from rljax.models.dtypes import DTYPE_NAMES, dtype_from_name
from rljax.models.transformer import KVCache, Transformer, init_model

__all__ = ["DTYPE_NAMES", "KVCache", "ModelConfig", "Transformer", "UnsupportedConfigError", "dtype_from_name",
           "init_model", "load", "read_checkpoint"]


def read_checkpoint(name_or_path: str, *, value_head: bool = False):
    """``(config, params, value_head_params, tokenizer)`` of a registered name, ``.gguf`` file or Hugging
    Face directory, as host arrays (``value_head_params`` None unless the directory has a head):
    what :func:`load` and ``rljax.models.sharded_loading.load_pretrained_sharded`` place."""
    from transformers import AutoTokenizer

    from rljax.models.gguf_io import read_gguf
    from rljax.models.hf_io import params_from_hf_state_dict, read_hf_dir
    from rljax.models.registry import resolve

    resolved = resolve(name_or_path)
    if resolved.kind == "gguf":
        checkpoint = read_gguf(resolved.path)
        config = ModelConfig.from_hf_dict(checkpoint.hf_config)
        return config, params_from_hf_state_dict(config, checkpoint.state_dict), None, checkpoint.tokenizer
    config, params, value_head_params = read_hf_dir(resolved.path, value_head=value_head)
    return config, params, value_head_params, AutoTokenizer.from_pretrained(resolved.path)


def load(
    name_or_path: str,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    value_head: bool = False,
    scan_layers: bool = False,
):
    """Load ``(model, tokenizer)`` from a registered name, a ``.gguf`` file or a Hugging Face directory.

    ``dtype`` is the compute dtype; ``param_dtype`` (default: ``dtype``) the storage dtype.
    ``value_head=True`` adds a scalar value head (zero-initialised unless the directory has one).
    ``scan_layers=True`` loops over the layers in training and scoring passes instead of unrolling
    them (``Transformer``).
    """
    from rljax.models.hf_io import model_from_params

    config, params, value_head_params, tokenizer = read_checkpoint(name_or_path, value_head=value_head)
    model = model_from_params(config, params, param_dtype=dtype if param_dtype is None else param_dtype, dtype=dtype,
                              value_head=value_head, value_head_params=value_head_params)
    model.scan_layers = scan_layers  # static execution setting, no parameter
    return model, tokenizer
