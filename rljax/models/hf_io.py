"""Hugging Face checkpoint directories <-> rljax parameters, without torch.

A directory holds ``config.json``, ``model.safetensors`` (or ``model.safetensors.index.json`` with
shards) and tokenizer files. Weights use transformers' names and torch's ``[out, in]`` layout; rljax
stores per-layer tensors stacked along a leading layer axis with ``[in, ..., out]`` layout. The value
head, which transformers' causal-LM classes do not have, goes to ``value_head.safetensors``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.errors import MissingFileError
from rljax.models.config import ModelConfig
from rljax.models.finite import require_finite
from rljax.models.transformer import Transformer, abstract_model

VALUE_HEAD_FILE = "value_head.safetensors"
_PREFIX = "model.layers.{i}."


def params_from_hf_state_dict(config: ModelConfig, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """rljax's nested parameter dict from a transformers state dict (arrays in torch layout)."""
    c = config
    D, H, KVH, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

    def get(name: str) -> np.ndarray:
        if name not in state_dict:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        return np.asarray(state_dict[name])

    def stack(suffix: str, convert) -> np.ndarray:
        return np.stack([convert(get(_PREFIX.format(i=i) + suffix)) for i in range(c.num_layers)])

    layers = {
        "attn_norm": stack("input_layernorm.weight", lambda w: w),
        "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, hd)),
        "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(D, KVH, hd)),
        "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(D, KVH, hd)),
        "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(H, hd, D)),
        "mlp_norm": stack("post_attention_layernorm.weight", lambda w: w),
        "w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
        "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
        "w_down": stack("mlp.down_proj.weight", lambda w: w.T),
    }
    if c.qkv_bias:
        layers["bq"] = stack("self_attn.q_proj.bias", lambda b: b.reshape(H, hd))
        layers["bk"] = stack("self_attn.k_proj.bias", lambda b: b.reshape(KVH, hd))
        layers["bv"] = stack("self_attn.v_proj.bias", lambda b: b.reshape(KVH, hd))
    if c.o_bias:
        layers["bo"] = stack("self_attn.o_proj.bias", lambda b: b)
    if c.qk_norm:
        layers["q_norm"] = stack("self_attn.q_norm.weight", lambda w: w)
        layers["k_norm"] = stack("self_attn.k_norm.weight", lambda w: w)
    params: dict[str, Any] = {
        "embed": get("model.embed_tokens.weight"),
        "layers": layers,
        "final_norm": get("model.norm.weight"),
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = get("lm_head.weight").T
    return params


def hf_state_dict_from_params(config: ModelConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The inverse of :func:`params_from_hf_state_dict` (value head excluded)."""
    c = config
    D, H, KVH, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    layers = {k: np.asarray(v) for k, v in params["layers"].items()}
    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": np.asarray(params["embed"]),
        "model.norm.weight": np.asarray(params["final_norm"]),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"]).T
    for i in range(c.num_layers):
        pre = _PREFIX.format(i=i)
        out[pre + "input_layernorm.weight"] = layers["attn_norm"][i]
        out[pre + "self_attn.q_proj.weight"] = layers["wq"][i].reshape(D, H * hd).T
        out[pre + "self_attn.k_proj.weight"] = layers["wk"][i].reshape(D, KVH * hd).T
        out[pre + "self_attn.v_proj.weight"] = layers["wv"][i].reshape(D, KVH * hd).T
        out[pre + "self_attn.o_proj.weight"] = layers["wo"][i].reshape(H * hd, D).T
        out[pre + "post_attention_layernorm.weight"] = layers["mlp_norm"][i]
        out[pre + "mlp.gate_proj.weight"] = layers["w_gate"][i].T
        out[pre + "mlp.up_proj.weight"] = layers["w_up"][i].T
        out[pre + "mlp.down_proj.weight"] = layers["w_down"][i].T
        if c.qkv_bias:
            out[pre + "self_attn.q_proj.bias"] = layers["bq"][i].reshape(H * hd)
            out[pre + "self_attn.k_proj.bias"] = layers["bk"][i].reshape(KVH * hd)
            out[pre + "self_attn.v_proj.bias"] = layers["bv"][i].reshape(KVH * hd)
        if c.o_bias:
            out[pre + "self_attn.o_proj.bias"] = layers["bo"][i]
        if c.qk_norm:
            out[pre + "self_attn.q_norm.weight"] = layers["q_norm"][i]
            out[pre + "self_attn.k_norm.weight"] = layers["k_norm"][i]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def model_from_params(
    config: ModelConfig,
    params: Mapping[str, Any],
    *,
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    value_head: bool = False,
    value_head_params: Mapping[str, Any] | None = None,
) -> Transformer:
    """Build a :class:`Transformer` holding ``params`` (cast to ``param_dtype``); with ``value_head`` and
    no ``value_head_params`` the head is zero (``rljax.models.load`` passes a fresh normal one)."""
    model = abstract_model(config, param_dtype=param_dtype, dtype=dtype, value_head=value_head)
    graphdef, state = nnx.split(model)
    full = dict(params)
    if value_head:
        vh = value_head_params or {"w": np.zeros((config.hidden_size,), np.float32), "b": np.zeros((1,), np.float32)}
        full["value_head"] = dict(vh)
    expected = jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(state))
    got = jax.tree.map(lambda x: tuple(np.shape(x)), full)
    if jax.tree.structure(expected) != jax.tree.structure(got) or expected != got:
        raise ValueError(f"parameter shapes do not match the config: expected {expected}, got {got}")
    full = jax.tree.map(lambda x: jnp.asarray(x, dtype=param_dtype), full)
    nnx.replace_by_pure_dict(state, full)
    return nnx.merge(graphdef, state)


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory's ``model.safetensors`` (or its shards), as float32 NumPy.

    Keys are the checkpoint's own names (``model.layers.0.self_attn.q_proj.weight``, ...);
    :func:`params_from_hf_state_dict` turns them into rljax's nested parameters. A tensor holding
    NaN or inf raises ``ValueError`` naming it and its file.
    """
    from safetensors import safe_open

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise MissingFileError(
            f"{directory} has neither model.safetensors nor model.safetensors.index.json "
            "(PyTorch .bin checkpoints are not read: convert them to safetensors)"
        )
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        # framework="flax" reads bfloat16 too; convert to float32 numpy once, here.
        with safe_open(os.path.join(directory, name), framework="flax") as f:
            for key in f.keys():
                tensors[key] = require_finite(np.asarray(f.get_tensor(key).astype(jnp.float32)), tensor=key,
                                              source=os.path.join(directory, name))
    return tensors


# Any one of these holds a tokenizer's vocabulary: tokenizer.json (a fast tokenizer), a sentencepiece
# model (tokenizer.model, spiece.model), a byte-level BPE's vocab.json (+ merges.txt), a WordPiece vocab.txt.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def has_tokenizer(directory: str) -> bool:
    """Whether a Hugging Face directory holds tokenizer files (:data:`TOKENIZER_FILES`)."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


# The model types whose directory, when its tokenizer_config.json names the plain `tokenizers` backend,
# AutoTokenizer loads as that backend class itself (tests/integration/test_models_hf.py checks it
# against AutoTokenizer for every supported type). qwen2 is not one: transformers overrides the file's
# class with Qwen2Tokenizer.
_BACKEND_MODEL_TYPES = ("llama", "mistral", "qwen3")
_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _plain_backend(directory: str) -> bool:
    """Whether ``AutoTokenizer.from_pretrained(directory)`` would build ``PreTrainedTokenizerFast``
    (transformers' ``TokenizersBackend``) from ``tokenizer.json``, with no class of its own to choose."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            tokenizer_config = json.load(f)
        with open(os.path.join(directory, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        return False
    return (os.path.isfile(os.path.join(directory, "tokenizer.json")) and "auto_map" not in tokenizer_config
            and tokenizer_config.get("tokenizer_class") in _BACKEND_CLASSES and model_type in _BACKEND_MODEL_TYPES)


def load_hf_tokenizer(directory: str):
    """``AutoTokenizer.from_pretrained(directory)``, or ``FileNotFoundError`` naming the directory and
    the files it lacks (transformers would say "Couldn't instantiate the backend tokenizer").

    Where AutoTokenizer would build the plain ``tokenizers`` backend, that class is built directly:
    AutoTokenizer's module imports torch whenever it is installed (docs/performance.md)."""
    if not has_tokenizer(directory):
        raise MissingFileError(
            f"{directory} has model weights but no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there. "
            "Copy in the tokenizer files of the model it was trained from "
            f"(tokenizer.save_pretrained({directory!r}))")
    if _plain_backend(directory):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def read_hf_dir(
    directory: str, *, value_head: bool = False
) -> tuple[ModelConfig, dict[str, Any], dict[str, np.ndarray] | None]:
    """``(config, params, value_head_params)`` of a Hugging Face directory, all on the host.

    ``params`` is rljax's nested dict of NumPy arrays (:func:`params_from_hf_state_dict`);
    ``value_head_params`` is ``{"w", "b"}`` from ``value_head.safetensors`` when ``value_head`` is
    asked for and the file exists, else None.
    """
    with open(os.path.join(directory, "config.json")) as f:
        config = ModelConfig.from_hf_dict(json.load(f))
    params = params_from_hf_state_dict(config, read_safetensors(directory))
    vh_params = None
    vh_path = os.path.join(directory, VALUE_HEAD_FILE)
    if value_head and os.path.exists(vh_path):
        from safetensors.numpy import load_file

        vh_params = {k: require_finite(v, tensor=k, source=vh_path) for k, v in load_file(vh_path).items()}
    return config, params, vh_params


def load_hf_dir(
    directory: str, *, param_dtype=jnp.float32, dtype=jnp.float32, value_head: bool = False
) -> Transformer:
    """Load a Hugging Face checkpoint directory into a :class:`Transformer` (no tokenizer)."""
    config, params, vh_params = read_hf_dir(directory, value_head=value_head)
    return model_from_params(
        config, params, param_dtype=param_dtype, dtype=dtype, value_head=value_head, value_head_params=vh_params
    )


def save_hf_dir(directory: str, model: Transformer, tokenizer=None, *, dtype=np.float32) -> None:
    """Write ``model`` as a Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` loads."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    from rljax.models.lora import merged_params

    params = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.float32)), merged_params(model))
    value_head = params.pop("value_head", None)
    tensors = {k: v.astype(dtype) for k, v in hf_state_dict_from_params(model.config, params).items()}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
    if value_head is not None:
        save_file({k: np.ascontiguousarray(v) for k, v in value_head.items()}, os.path.join(directory, VALUE_HEAD_FILE))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
