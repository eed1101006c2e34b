"""LoRA (arXiv:2106.09685) on chosen projections: add adapters to a loaded model, merge them back.

The adapters are ``nnx.LoRAParam`` variables (``A`` random, ``B`` zero, so a fresh adapter leaves the
model unchanged); the base weights stay ``nnx.Param``. Trainers update only the adapters (and a
value head if there is one), and the frozen base weights double as the reference policy: the
reference forward pass is the same model with its ``B`` matrices set to zero.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models.transformer import _LORA_SPECS, LORA_TARGETS, Transformer, abstract_model


def add_lora(model: Transformer, *, rank: int, alpha: float = 16.0, targets=LORA_TARGETS, seed: int = 0) -> Transformer:
    """A copy of ``model`` with rank-``rank`` adapters on ``targets`` (scale ``alpha / rank``)."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    base = nnx.to_pure_dict(nnx.state(model))
    param_dtype = model.embed[...].dtype
    new = abstract_model(model.config, param_dtype=param_dtype, dtype=model.dtype,
                         value_head=model.value_head is not None, lora_rank=rank, lora_alpha=alpha,
                         lora_targets=tuple(targets), scan_layers=model.scan_layers)
    graphdef, state = nnx.split(new)
    full = nnx.to_pure_dict(state)
    key = jax.random.key(seed)
    for i, name in enumerate(targets):
        a_shape = full["layers"][f"{name}_lora_a"].shape
        fan_in = int(np.prod(a_shape[1:-1]))
        a = jax.random.normal(jax.random.fold_in(key, i), a_shape, jnp.float32) / math.sqrt(fan_in)
        full["layers"][f"{name}_lora_a"] = a.astype(param_dtype)
        full["layers"][f"{name}_lora_b"] = jnp.zeros(full["layers"][f"{name}_lora_b"].shape, param_dtype)
    for k, v in base["layers"].items():
        full["layers"][k] = v
    for k, v in base.items():
        if k != "layers":
            full[k] = v
    nnx.replace_by_pure_dict(state, full)
    return nnx.merge(graphdef, state)


def merged_params(model: Transformer) -> dict:
    """The model's parameters with every adapter folded in (``W + scale · A @ B``) and removed."""
    params = nnx.to_pure_dict(nnx.state(model))
    layers = dict(params["layers"])
    for name in LORA_TARGETS:
        if f"{name}_lora_a" not in layers:
            continue
        a, b = layers.pop(f"{name}_lora_a"), layers.pop(f"{name}_lora_b")
        ins, outs = _LORA_SPECS[name]
        delta = jnp.einsum(f"l{ins}r,lr{outs}->l{ins}{outs}", a.astype(jnp.float32), b.astype(jnp.float32))
        layers[name] = (layers[name].astype(jnp.float32) + model.lora_scale * delta).astype(layers[name].dtype)
    params["layers"] = layers
    return params


def lora_trainable() -> nnx.filterlib.Filter:
    """The filter of what a LoRA run trains: the adapters and the value head."""
    return nnx.Any(nnx.LoRAParam, nnx.PathContains("value_head"))


def zero_adapters(trainable_state):
    """``trainable_state`` with every LoRA ``B`` set to zero: the base model, for reference log-probs."""
    def zero(path, x):
        return jnp.zeros_like(x) if any(str(getattr(p, "key", p)).endswith("_lora_b") for p in path) else x

    return jax.tree_util.tree_map_with_path(zero, trainable_state)
