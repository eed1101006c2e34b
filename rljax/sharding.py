"""Device mesh, logical-axis rules, activation constraints, and parameter / batch shardings.

The mesh has three axes, ``('data', 'fsdp', 'tensor')``:

* ``data``   -- pure data parallelism: the batch is split, parameters are replicated;
* ``fsdp``   -- the batch is split *and* parameters are sharded (ZeRO-3 style: each parameter is
  all-gathered where it is used);
* ``tensor`` -- parameters are split along heads / MLP width / vocabulary (Megatron style).

Every ``nnx.Param`` of :class:`rljax.models.transformer.Transformer` carries ``logical_axes``
metadata, e.g. ``("layers", "embed", "heads", "head_dim")`` for ``wq``. A *rule set* maps each
logical name to a mesh axis, a tuple of mesh axes, or ``None`` (replicated); :func:`logical_to_spec`
turns one parameter's names into a ``PartitionSpec``::

    mesh = make_mesh(fsdp=4, tensor=2)                   # 8 devices
    model = rljax.models.sharded_loading.init_sharded(config, mesh, seed=0)  # never unsharded
    graphdef, state = nnx.split(model)                   # what the jitted train/sample steps take
    ids = jax.device_put(ids, batch_sharding(mesh))      # [B, T] split over ('data', 'fsdp')

The mesh axes are ``Auto``: XLA (GSPMD) propagates the parameters' and inputs' shardings through
the jitted steps and inserts the collectives, so results are correct without any annotation. To make
the *batch* stay split inside the model (true FSDP rather than each device computing the whole
batch), the model pins its activations with :func:`constrain`, which takes effect while the step is
traced under ``with use_mesh(mesh):`` and is a no-op otherwise. With a one-device mesh (the default
on a laptop) every spec is trivially satisfied, so trainers can always go through this module.

This module knows nothing of the model (the model imports :func:`constrain` from here). Building or
loading a model directly onto its shardings (``init_sharded``, ``load_sharded``,
``load_hf_dir_sharded``, ``load_pretrained_sharded``) lives in :mod:`rljax.models.sharded_loading`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Union

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = [
    "MESH_AXES",
    "DEFAULT_RULES",
    "Rules",
    "make_mesh",
    "logical_to_spec",
    "param_shardings",
    "shard_model",
    "batch_sharding",
    "replicated",
    "use_mesh",
    "active_mesh",
    "active_rules",
    "batch_shards",
    "put",
    "constrain",
    "constrain_state",
    "on_mesh",
]

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = Union[str, tuple[str, ...], None]
Rules = tuple[tuple[str, MeshAxes], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),  # the scan axis: sharding it would serialise the layers across devices
    ("norm", None),
    ("unsharded", None),
    ("lora", None),  # LoRA rank: small, replicated (the adapter's other dims follow their base weight)
    # activations (see :func:`constrain`): batch-split everywhere, heads / MLP width / vocab over tensor
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

# (logical name, dim size, mesh axis, mesh axis size) already reported as not divisible.
_REPORTED_FALLBACKS: set[tuple[str, int, str, int]] = set()


# --------------------------------------------------------------------------------------- mesh
def make_mesh(*, data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with axes ``('data', 'fsdp', 'tensor')`` over ``devices`` (default: ``jax.devices()``).

    One size may be ``-1``: it takes the devices the others leave. The product of the sizes must
    equal the number of devices. The axes are ``AxisType.Auto`` (GSPMD propagation; ``jax.make_mesh``
    would default to ``Explicit``, under which the model's einsums would need output shardings).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1 (the rest of the devices), got {sizes}")
    for name, size in sizes.items():
        if size != -1 and size < 1:
            raise ValueError(f"mesh axis {name!r} must be >= 1 or -1, got {size}")
    if free:
        known = math.prod(size for size in sizes.values() if size != -1)
        if n % known:
            raise ValueError(f"{n} devices cannot be split into mesh {sizes}: {n} is not a multiple of {known}")
        sizes[free[0]] = n // known
    shape = tuple(sizes[name] for name in MESH_AXES)
    if math.prod(shape) != n:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices, but {n} are given "
            f"(set one axis to -1 to use the rest)"
        )
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


# -------------------------------------------------------------------------------------- rules
def _rule_table(rules: Rules | Mapping[str, MeshAxes]) -> dict[str, MeshAxes]:
    """``{logical name: mesh axis | tuple of mesh axes | None}``; lists (as YAML gives them) become tuples."""
    table = {}
    for name, target in rules.items() if isinstance(rules, Mapping) else rules:
        if isinstance(target, (list, tuple)):
            target = tuple(target) or None
        axes = (target,) if isinstance(target, str) else (target or ())
        if not all(isinstance(a, str) for a in axes):
            raise ValueError(f"rule {name!r} -> {target!r}: a target is a mesh axis name, a tuple of them, or None")
        table[name] = target
    return table


def logical_to_spec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES,
) -> PartitionSpec:
    """The ``PartitionSpec`` of an array of ``shape`` whose dims have names ``logical_axes``.

    Each dim goes to the mesh axes its name's rule gives, with two fallbacks:

    * a dim is split over a mesh axis only if its size is divisible by that axis' size (for a tuple
      of mesh axes, by the product of those kept); otherwise that mesh axis is dropped for this dim,
      i.e. the dim is replicated along it (e.g. a vocabulary of 97 on ``tensor=2``), logged once at
      debug level;
    * a mesh axis is used at most once per spec: the leftmost dim that asks for it gets it.

    A ``None`` logical name means replicated. An unknown name raises ``KeyError`` (a typo would
    otherwise silently replicate a parameter). Mesh axes of size 1 stay in the spec (harmless), so a
    parameter's spec reads the same on every mesh where its sizes divide.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    table = _rule_table(rules)
    mesh_sizes = dict(mesh.shape)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for name, size in zip(logical_axes, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no sharding rule; rules cover {sorted(table)}")
        target = table[name]
        wanted = (target,) if isinstance(target, str) else tuple(target or ())
        kept: list[str] = []
        for axis in wanted:
            if axis not in mesh_sizes:
                raise ValueError(f"rule {name!r} -> {target!r} names mesh axis {axis!r}; the mesh has {tuple(mesh_sizes)}")
            if axis in used:
                continue
            axis_size = mesh_sizes[axis]
            if size % (math.prod(mesh_sizes[a] for a in kept) * axis_size):
                key = (name, int(size), axis, axis_size)
                if key not in _REPORTED_FALLBACKS:
                    _REPORTED_FALLBACKS.add(key)
                    logger.debug(
                        "logical axis %r of size %d is not divisible by mesh axis %r (size %d): replicated along it",
                        name, size, axis, axis_size,
                    )
                continue
            kept.append(axis)
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(
    state: nnx.State | nnx.Module,
    mesh: Mesh,
    rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES,
) -> Any:
    """A tree matching ``state`` whose values are ``NamedSharding`` s on ``mesh``.

    ``state`` is an ``nnx.State`` (or a module, which is split first); its values may be arrays or
    ``jax.ShapeDtypeStruct`` s (from ``nnx.eval_shape``). Each ``nnx.Variable`` keeps its type and
    metadata with the sharding as its value, so the result can be passed directly to
    ``jax.device_put(state, shardings)`` or as ``jit``'s ``out_shardings``. A Variable without
    ``logical_axes`` metadata, or a bare array leaf, is replicated.
    """
    if isinstance(state, nnx.Module):
        state = nnx.state(state)

    def sharding_of(leaf):
        if _is_variable(leaf):
            value = leaf.get_value()
            axes = leaf.get_metadata().get("logical_axes")
            spec = PartitionSpec() if axes is None else logical_to_spec(axes, np.shape(value), mesh, rules)
            return leaf.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(sharding_of, state, is_leaf=_is_variable)


def batch_sharding(mesh: Mesh, rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES) -> NamedSharding:
    """Sharding of a ``[B, ...]`` batch: ``B`` split over the ``batch`` rule's mesh axes (``('data', 'fsdp')``).

    ``B`` must be divisible by the product of those axes' sizes (``jax.device_put`` says so if not).
    """
    target = _rule_table(rules).get("batch", ("data", "fsdp"))
    return NamedSharding(mesh, PartitionSpec(target))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of ``mesh`` (scalars, RNG keys, small tables)."""
    return NamedSharding(mesh, PartitionSpec())


# ------------------------------------------------------------------------- placing parameters
def shard_model(
    model: nnx.Module | tuple[nnx.GraphDef, nnx.State],
    mesh: Mesh,
    rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES,
):
    """Place every parameter of ``model`` on its sharding; returns the same kind it is given.

    A module gives a new module (same graph, sharded arrays; the input keeps its arrays); a
    ``(graphdef, state)`` pair gives ``(graphdef, sharded_state)``. Use this for a model already in
    memory; for a fresh or loaded model prefer ``init_sharded`` / ``load_sharded``
    (:mod:`rljax.models.sharded_loading`), which never hold the unsharded parameters on one device.
    """
    is_module = isinstance(model, nnx.Module)
    graphdef, state = nnx.split(model) if is_module else model
    state = jax.tree.map(put, state, param_shardings(state, mesh, rules))
    return nnx.merge(graphdef, state) if is_module else (graphdef, state)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` on ``sharding``. An array already there is kept (no copy); a host array, or a jax array
    held whole by this process (made before the mesh, e.g. fresh LoRA adapters), is placed slice by
    slice from host memory with ``jax.make_array_from_callback``, which is also right when several
    processes share the mesh (each places only its own devices' slices of the same values, where
    ``jax.device_put`` of a process-local array onto another process's devices is refused)."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if not x.is_fully_addressable:
            return jax.device_put(x, sharding)  # a global array: resharded by XLA
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Every array leaf of ``tree`` on ``mesh``: leaves already sharded on it are kept, the others
    (optimizer step counts, scalars made on the default device) are replicated.

    ``optax`` optimizers' ``init(params)`` gives moments sharded like the parameters (``zeros_like``
    keeps the sharding) but a step count on the default device, which a jitted update over the mesh
    would refuse as an argument on other devices.
    """

    def leaf(x):
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
            return x
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return put(x, replicated(mesh))
        return x

    return jax.tree.map(leaf, tree)


def _axes_of(target: MeshAxes) -> tuple[str, ...]:
    return (target,) if isinstance(target, str) else tuple(target or ())


# ---------------------------------------------------------------------- activation constraints
_ACTIVE_RULES: contextvars.ContextVar = contextvars.ContextVar("rljax_sharding_rules", default=None)
_ACTIVE_MESH: contextvars.ContextVar = contextvars.ContextVar("rljax_sharding_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | Mapping[str, MeshAxes] = DEFAULT_RULES):
    """Make ``mesh`` the context mesh (``jax.set_mesh``) and ``rules`` the rules :func:`constrain` uses.

    Wrap the calls of jitted steps (the first call traces them) so the model's activation
    constraints take effect. Rules are read when a function is traced: a function already traced
    under this mesh is not retraced for other rules.
    """
    token, mesh_token = _ACTIVE_RULES.set(rules), _ACTIVE_MESH.set(mesh)
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _ACTIVE_MESH.reset(mesh_token)
        _ACTIVE_RULES.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh of the innermost :func:`use_mesh`, or None outside one (where
    ``rljax.distributed.place_batch`` keeps arrays on the default device)."""
    return _ACTIVE_MESH.get()


def active_rules() -> Rules | Mapping[str, MeshAxes]:
    """The rules of the innermost :func:`use_mesh` (:data:`DEFAULT_RULES` outside one)."""
    return _ACTIVE_RULES.get() or DEFAULT_RULES


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` of an activation by logical names; a no-op without a context mesh.

    Without constraints, GSPMD is free to resolve the conflict between a batch split over ``fsdp``
    and parameters whose ``embed`` dim is split over ``fsdp`` by all-gathering the *batch* (each
    device then computes the whole batch). Pinning the residual stream to
    ``("batch", "length", "act_embed")`` keeps the batch split and makes XLA all-gather the
    parameters instead, which is what FSDP means.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    rules = _ACTIVE_RULES.get() or DEFAULT_RULES
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh, rules))


def batch_shards(mesh: Mesh | None = None, rules: Rules | Mapping[str, MeshAxes] | None = None) -> int:
    """How many ways the ``batch`` rule splits a batch's rows on ``mesh`` (default: :func:`active_mesh`;
    1 without one)."""
    mesh = active_mesh() if mesh is None else mesh
    if mesh is None:
        return 1
    rules = (_ACTIVE_RULES.get() or DEFAULT_RULES) if rules is None else rules
    return math.prod(dict(mesh.shape)[a] for a in _axes_of(batch_sharding(mesh, rules).spec[0]))


def constrain_state(tree: Any) -> Any:
    """``with_sharding_constraint`` of a parameter-shaped tree (parameters, optimizer state) to the
    sharding each ``nnx.Variable``'s ``logical_axes`` give it (:func:`param_shardings`' rule; a
    Variable without them replicated, bare array leaves such as step counts left alone); a no-op
    without a context mesh.

    Why: a jitted update whose new parameters and AdamW moments are not constrained leaves their
    output sharding to the partitioner, which for a GPU target returned them replicated on every
    device, the whole state on each device after every step (the CPU mesh happened to keep them
    sharded; see docs/performance.md#kept-shardings). Pinned, the outputs are what the inputs were.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    rules = _ACTIVE_RULES.get() or DEFAULT_RULES

    def one(leaf):
        if not _is_variable(leaf):
            return leaf
        value = leaf.get_value()
        axes = leaf.get_metadata().get("logical_axes")
        spec = PartitionSpec() if axes is None else logical_to_spec(axes, np.shape(value), mesh, rules)
        return leaf.replace(jax.lax.with_sharding_constraint(value, spec))

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def shardings_of(tree: Any) -> Any:
    """Each array leaf's sharding (None for other leaves): what :func:`keep_shardings` restores."""
    return jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else None, tree)


def keep_shardings(tree: Any, shardings: Any) -> Any:
    """``tree``'s arrays under ``shardings`` (:func:`shardings_of` of the inputs they replace) where
    the two are equivalent but not equal: the same buffers, no copy, on every process.

    Why: a jitted update's outputs come back with the sharding XLA reports, which names the same
    placement differently from the inputs' (a one-device mesh: ``P()`` for ``P(None, 'tensor',
    'fsdp')``); jit keys its cache on the sharding, so the next call compiled the update again
    (seconds on a small model, minutes for a large one on an accelerator; docs/performance.md#kept-shardings).
    A leaf whose sharding really differs is left as it is.
    """
    def one(x, s):
        if s is None or not isinstance(x, jax.Array) or x.sharding == s or not x.sharding.is_equivalent_to(s, x.ndim):
            return x
        return jax.make_array_from_single_device_arrays(x.shape, s, [shard.data for shard in x.addressable_shards])

    return jax.tree.map(one, tree, shardings)
