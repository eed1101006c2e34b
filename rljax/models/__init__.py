"""Models: the Llama-family transformer, its configs, and loading from names, HF directories and GGUF.

    model, tokenizer = rljax.models.load("smollm2-135m-instruct")
    logits = model(input_ids, attention_mask)            # [B, T, V], float32
    hidden, _ = model.forward(input_ids, attention_mask)  # [B, T, D]
    values = model.values(hidden)                         # [B, T], with value_head=True
"""

from __future__ import annotations

import jax.numpy as jnp

from rljax.errors import UserError
from rljax.models.config import ModelConfig, UnsupportedConfigError
from rljax.models.dtypes import DTYPE_NAMES, dtype_from_name
from rljax.models.transformer import KVCache, Transformer, init_model
from rljax.models.value_head import DEFAULT_VALUE_HEAD_STD, VALUE_HEAD_INITS, fresh_value_head

__all__ = ["DTYPE_NAMES", "KVCache", "ModelConfig", "Transformer", "UnsupportedConfigError", "dtype_from_name",
           "init_model", "load", "model_config_for", "read_checkpoint", "DEFAULT_VALUE_HEAD_STD", "VALUE_HEAD_INITS", "fresh_value_head"]


def read_checkpoint(name_or_path: str, *, value_head: bool = False, tokenizer=None):
    """``(config, params, value_head_params, tokenizer)`` of a registered name, ``.gguf`` file or Hugging
    Face directory, as host arrays (``value_head_params`` None unless the directory has a head):
    what :func:`load` and ``rljax.models.sharded_loading.load_pretrained_sharded`` place.

    ``tokenizer``: the one to use when a Hugging Face directory has no tokenizer files of its own (a
    critic or reward model that reads the policy's tokens); without one such a directory raises
    ``FileNotFoundError`` naming the files it lacks. A tokenizer with more tokens than the model's
    ``vocab_size`` raises ``ValueError`` (its extra ids would index past the embedding table).
    """
    from rljax.models.gguf_io import read_gguf
    from rljax.models.hf_io import has_tokenizer, load_hf_tokenizer, params_from_hf_state_dict, read_hf_dir
    from rljax.models.registry import resolve

    resolved = resolve(name_or_path)
    if resolved.kind == "gguf":
        checkpoint = read_gguf(resolved.path)
        config = ModelConfig.from_hf_dict(checkpoint.hf_config)
        _check_vocab(checkpoint.tokenizer, config, name_or_path)
        return config, params_from_hf_state_dict(config, checkpoint.state_dict), None, checkpoint.tokenizer
    # the tokenizer first: a directory without one fails before its weights are read
    if tokenizer is None or has_tokenizer(resolved.path):
        tokenizer = load_hf_tokenizer(resolved.path)
    config, params, value_head_params = read_hf_dir(resolved.path, value_head=value_head)
    _check_vocab(tokenizer, config, name_or_path)
    return config, params, value_head_params, tokenizer


def model_config_for(name_or_path: str) -> ModelConfig:
    """The ``ModelConfig`` of a registered name or Hugging Face directory (its ``config.json``: a
    directory that may hold nothing else) or a GGUF file's metadata: no weights are read."""
    import json
    import os

    from rljax.models.gguf_io import read_gguf
    from rljax.models.registry import resolve

    resolved = resolve(name_or_path)
    if resolved.kind == "hf_dir":
        with open(os.path.join(resolved.path, "config.json")) as f:
            return ModelConfig.from_hf_dict(json.load(f))
    return ModelConfig.from_hf_dict(read_gguf(resolved.path).hf_config)


def _check_vocab(tokenizer, config: ModelConfig, name: str) -> None:
    # len() counts added tokens too (vocab_size does not): those are the ids a prompt or the sampler can hold
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"{name}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{config.vocab_size}: ids from {config.vocab_size} on have no embedding row; use the "
                         "model's own tokenizer")


def load(
    name_or_path: str,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    value_head: bool = False,
    scan_layers: bool = False,
    tokenizer=None,
    value_head_init: str = "normal",
    value_head_std: float = DEFAULT_VALUE_HEAD_STD,
    seed: int = 0,
    mesh=None,
    rules=None,
):
    """Load ``(model, tokenizer)`` from a registered name, a ``.gguf`` file or a Hugging Face directory.

    ``dtype`` is the compute dtype; ``param_dtype`` (default: ``dtype``) the storage dtype.
    ``value_head=True`` adds a scalar value head: the directory's own (``value_head.safetensors``)
    when it has one, else a fresh one, ``fresh_value_head(init=value_head_init, std=value_head_std,
    seed=seed)`` (default normal(0, 0.02), as transformers' score head; see
    ``rljax.models.value_head``).
    ``scan_layers=True`` loops over the layers in training and scoring passes instead of unrolling
    them (``Transformer``). ``tokenizer``: used when a Hugging Face directory has none of its own
    (:func:`read_checkpoint`). ``mesh`` (and ``rules``, default ``rljax.sharding.DEFAULT_RULES``):
    each tensor is placed straight onto its sharding (``rljax.models.sharded_loading.load_sharded``),
    so the model never exists whole on one device.
    """
    from rljax.models.hf_io import model_from_params

    config, params, value_head_params, tokenizer = read_checkpoint(name_or_path, value_head=value_head,
                                                                   tokenizer=tokenizer)
    if value_head and value_head_params is None:
        value_head_params = fresh_value_head(config.hidden_size, init=value_head_init, std=value_head_std, seed=seed)
    param_dtype = dtype if param_dtype is None else param_dtype
    if mesh is None:
        model = model_from_params(config, params, param_dtype=param_dtype, dtype=dtype, value_head=value_head,
                                  value_head_params=value_head_params)
    else:
        from rljax.models.sharded_loading import load_sharded
        from rljax.sharding import DEFAULT_RULES

        model = load_sharded(config, params, mesh, rules=DEFAULT_RULES if rules is None else rules,
                             param_dtype=param_dtype, dtype=dtype, value_head=value_head,
                             value_head_params=value_head_params)
    model.scan_layers = scan_layers  # static execution setting, no parameter
    return model, tokenizer
