"""Build or load a model directly onto its shardings, so that no device ever holds it whole.

:func:`init_sharded` runs the random initialiser under ``jit`` with ``out_shardings``.
:func:`load_sharded`, :func:`load_hf_dir_sharded` and :func:`load_pretrained_sharded` read
checkpoints (safetensors, GGUF) into host (NumPy) arrays and place each tensor, cast to
``param_dtype``, straight onto its target sharding, one tensor at a time, with
``jax.make_array_from_callback``: each device receives only its own slice (host memory still holds
the checkpoint once). Meshes, rules and parameter shardings come from :mod:`rljax.sharding`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from rljax.models.config import ModelConfig
from rljax.models.hf_io import read_hf_dir
from rljax.models.transformer import Transformer, abstract_model, init_model
from rljax.models.value_head import DEFAULT_VALUE_HEAD_STD
from rljax.sharding import DEFAULT_RULES, MeshAxes, Rules, param_shardings

__all__ = ["init_sharded", "load_hf_dir_sharded", "load_pretrained_sharded", "load_sharded"]


def init_sharded(
    config: ModelConfig,
    mesh: Mesh,
    *,
    seed: int = 0,
    rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES,
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    value_head: bool = False,
) -> Transformer:
    """:func:`rljax.models.transformer.init_model`, materialised directly on its shardings.

    The initialiser runs under ``jit`` with ``out_shardings``, so each device computes only its own
    slices and a model larger than one device's memory never exists unsharded. The values are
    bitwise those of ``jax.jit(init_model)`` with the same seed on any mesh (threefry random bits do
    not depend on the sharding). Eagerly run ``init_model`` can differ from any jitted init by one
    float32 ulp in tensors whose init std is not a power of two: under ``jit`` XLA folds
    ``std * sqrt(2)`` (``jax.random.normal`` is ``sqrt(2) * erfinv(u)``) into one constant.
    """
    graphdef, abstract_state = nnx.split(
        abstract_model(config, param_dtype=param_dtype, dtype=dtype, value_head=value_head)
    )
    shardings = param_shardings(abstract_state, mesh, rules)

    def init():
        model = init_model(config, seed=seed, param_dtype=param_dtype, dtype=dtype, value_head=value_head)
        return nnx.state(model)

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def _place(host: Any, sharding: NamedSharding, dtype) -> jax.Array:
    """One host tensor onto ``sharding``: each device gets (a cast copy of) only its own slice."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: np.asarray(host[index], dtype=dtype))


def load_sharded(
    config: ModelConfig,
    params: Mapping[str, Any],
    mesh: Mesh,
    *,
    rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES,
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    value_head: bool = False,
    value_head_params: Mapping[str, Any] | None = None,
) -> Transformer:
    """:func:`rljax.models.hf_io.model_from_params` with every tensor placed on its sharding.

    ``params`` is rljax's nested dict of host arrays (what ``params_from_hf_state_dict`` returns,
    from safetensors or a GGUF file's ``state_dict``). Tensors are cast to ``param_dtype`` and
    placed one at a time, each device receiving only its slice. ``value_head=True`` adds the value
    head from ``value_head_params`` (zeros when not given).
    """
    graphdef, abstract_state = nnx.split(
        abstract_model(config, param_dtype=param_dtype, dtype=dtype, value_head=value_head)
    )
    full = dict(params)
    if value_head:
        vh = value_head_params or {"w": np.zeros((config.hidden_size,), np.float32), "b": np.zeros((1,), np.float32)}
        full["value_head"] = dict(vh)
    expected = jax.tree.map(lambda x: tuple(x.shape), nnx.to_pure_dict(abstract_state))
    got = jax.tree.map(lambda x: tuple(np.shape(x)), full)
    if jax.tree.structure(expected) != jax.tree.structure(got) or expected != got:
        raise ValueError(f"parameter shapes do not match the config: expected {expected}, got {got}")
    shardings = nnx.to_pure_dict(param_shardings(abstract_state, mesh, rules))
    placed = jax.tree.map(lambda host, sharding: _place(host, sharding, param_dtype), full, shardings)
    nnx.replace_by_pure_dict(abstract_state, placed)
    return nnx.merge(graphdef, abstract_state)


def load_hf_dir_sharded(
    directory: str,
    mesh: Mesh,
    *,
    rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES,
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    value_head: bool = False,
) -> Transformer:
    """:func:`rljax.models.hf_io.load_hf_dir`, placing each tensor on its sharding (see :func:`load_sharded`)."""
    config, params, vh_params = read_hf_dir(directory, value_head=value_head)
    return load_sharded(
        config, params, mesh, rules=rules, param_dtype=param_dtype, dtype=dtype, value_head=value_head,
        value_head_params=vh_params,
    )


def load_pretrained_sharded(
    name_or_path: str,
    mesh: Mesh,
    *,
    rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES,
    dtype=jnp.float32,
    param_dtype=None,
    value_head: bool = False,
    value_head_init: str = "normal",
    value_head_std: float = DEFAULT_VALUE_HEAD_STD,
    seed: int = 0,
):
    """:func:`rljax.models.load` onto ``mesh``: ``(model, tokenizer)`` from a name, ``.gguf`` or HF directory
    (a fresh value head as there: ``rljax.models.value_head.fresh_value_head``)."""
    from rljax.models import load

    return load(name_or_path, dtype=dtype, param_dtype=param_dtype, value_head=value_head,
                value_head_init=value_head_init, value_head_std=value_head_std, seed=seed, mesh=mesh, rules=rules)
