"""``rljax plan``: compile a run's programs for an accelerator topology on this machine, before paying for it.

    report = plan_run(cfg, "v5e-16")        # cfg: a RunConfig; no weights are read
    print(format_report(report)); sys.exit(0 if report.fits else 1)

From the config alone (the model's ``config.json`` gives every shape; no weights, no tokenizer) this
builds the run's state as ``jax.ShapeDtypeStruct`` s sharded on the target's mesh (``cfg.mesh``,
``rljax.sharding``) and ahead-of-time compiles, with XLA for the target (``libtpu`` for TPUs, as
maxtext's ``train_compile.py`` does; or the CPU devices of this process):

* the **update**: ``rljax.training.online.update_epochs`` (every optimizer update of one online
  step, policy and separate critic) or ``rljax.training.offline.offline_update``;
* the **scoring** pass: ``score_logprobs`` (reference / old log-probs of a step's rollouts),
  ``score_values`` (old values, PPO) or ``score_batch`` (the offline reference cache);
* the **sampler**: ``rljax.sampling``'s generation program (prefill, then the decode loop, whose
  body XLA's cost analysis counts once: prefill + one decode step).

For each program, per chip: bytes of arguments / outputs / temporaries (``memory_analysis()``)
against the chip's memory, FLOPs (``cost_analysis()``) beside the analytic ``6·N·tokens`` (plus
attention), the collectives in the optimised HLO, and a roofline time (FLOPs at the chip's peak vs
bytes at its memory bandwidth, whichever is longer) with the MFU it implies (an upper bound: real
steps also wait on collectives and on the host). A program that does not fit (XLA's compile-time
``CompileTimeHbmOom`` on TPU, or bytes over the chip's memory) makes the report not fit, with advice.

Targets (:data:`TARGETS`): TPU slices by their Cloud names (``v5e-4`` ... ``v5e-256``, ``v4-8`` ...,
``v5p-8`` ..., ``v6e-4`` ...; topologies as in maxtext's ``accelerator_to_spec_map.py``; needs the
``tpu`` extra, ``pip install -e '.[tpu]'``); NVIDIA GPUs by chip and count (``h100-1`` ... ``h100-8``,
``h100-16`` = 2 nodes × 8, likewise ``h200-N`` and ``a100-N``; compiled by the CUDA PJRT plugin from
XLA's GPU target description of the chip, ``rljax/gpu_specs/*.txtpb``, with no GPU present; needs the
``cuda`` extra, ``pip install -e '.[cuda]'``); and ``cpu`` / ``cpu-N`` (this machine's CPU as N
devices: the CLI re-runs itself in a subprocess with ``--xla_force_host_platform_device_count=N``).

A GPU compile gives no ``cost_analysis()`` and never refuses a program for its size: the roofline
then uses the analytic FLOPs, and for the first pass's bytes arguments + outputs + twice the
temporaries (a lower bound; the decode loop keeps its weights + KV cache term), and "fits" compares arguments + outputs + temporaries per device with the
memory JAX's GPU allocator may use: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75) of the GPU's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
import jax
import jax.numpy as jnp
from flax import nnx

from rljax.errors import UserError

__all__ = ["TARGETS", "ChipSpec", "Target", "ProgramReport", "PlanReport", "get_target", "target_devices",
           "model_config_for", "analytic_flops", "count_collectives", "plan_run", "format_report",
           "LIBTPU_MISSING", "CUDA_PLUGIN_MISSING", "replication_fallbacks", "usable_memory",
           "cuda_plugin_installed"]

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One chip's memory and speed: what the fit check and the roofline use."""

    name: str
    memory_bytes: int  # HBM per chip (per device the mesh sees)
    peak_flops: float  # dense bfloat16 FLOP/s per chip
    memory_bandwidth: float  # HBM bytes/s per chip
    source: str


# Per-chip figures, bfloat16 dense peak. Sources: Google Cloud TPU system-architecture pages
# (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e: "Peak compute per chip", "HBM2 capacity and
# bandwidth"); the CPU row is this project's measured float32 matmul rate (environment notes:
# 129-160 GFLOP/s on 2 cores) split over the simulated devices, with an assumed ~20 GB/s of DRAM.
CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("TPU v4", 32 * GiB, 275e12, 1200e9, "cloud.google.com/tpu/docs/v4"),
    "v5e": ChipSpec("TPU v5e", 16 * GiB, 197e12, 819e9, "cloud.google.com/tpu/docs/v5e"),
    "v5p": ChipSpec("TPU v5p", 95 * GiB, 459e12, 2765e9, "cloud.google.com/tpu/docs/v5p"),
    "v6e": ChipSpec("TPU v6e", 32 * GiB, 918e12, 1640e9, "cloud.google.com/tpu/docs/v6e"),
    "cpu": ChipSpec("CPU (host)", 0, 150e9, 20e9, "measured here (environment notes); memory: this host's RAM"),
    # NVIDIA GPUs (SXM boards): memory = device_memory_size of XLA's target description
    # (rljax/gpu_specs); dense bfloat16 Tensor Core peak and HBM bandwidth from NVIDIA's datasheets
    # (H100: 989.4 TFLOP/s, i.e. the 1,979 "with sparsity" halved, 3.35 TB/s; H200: same
    # compute, 4.8 TB/s; A100 80GB SXM: 312 TFLOP/s, 2,039 GB/s).
    "h100": ChipSpec("NVIDIA H100 SXM 80GB", 84942979072, 989.4e12, 3.35e12,
                     "nvidia.com H100 datasheet; memory: XLA gpu_specs/h100_sxm.txtpb"),
    "h200": ChipSpec("NVIDIA H200 SXM 141GB", 151397597184, 989.4e12, 4.8e12,
                     "nvidia.com H200 datasheet; memory: XLA gpu_specs/h200.txtpb"),
    "a100": ChipSpec("NVIDIA A100 SXM 80GB", 85100068864, 312e12, 2.039e12,
                     "nvidia.com A100 datasheet; memory: XLA gpu_specs/a100_sxm_80.txtpb"),
}

# XLA's GPU target description (GpuTargetConfigProto text) of each GPU chip, in rljax/gpu_specs/
GPU_SPEC_FILES = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "a100": "a100_sxm_80.txtpb"}
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True)
class Target:
    """A named topology: how to get its devices (``jax.experimental.topologies.get_topology_desc``)."""

    name: str
    chip: str  # key of CHIPS
    num_devices: int
    topology: str = ""  # e.g. "v5e:2x2"
    chip_config: str = "default"  # "megacore" for v4 / v5p (one device per chip, two cores)
    wrap: tuple[bool, bool, bool] = (False, False, False)

    @property
    def platform(self) -> str:
        return "cpu" if self.chip == "cpu" else "cuda" if self.chip in GPU_SPEC_FILES else "tpu"

    @property
    def spec(self) -> ChipSpec:
        return CHIPS[self.chip]


def _tpu_targets() -> dict[str, Target]:
    """TPU slices by their Cloud names (the topology strings maxtext's accelerator_to_spec_map lists)."""
    out: dict[str, Target] = {}
    for chips, (x, y), wrap in [(4, (2, 2), False), (8, (2, 4), False), (16, (4, 4), False), (32, (4, 8), False),
                                (64, (8, 8), False), (128, (8, 16), (False, True, False)),
                                (256, (16, 16), (True, True, False))]:
        w = wrap if isinstance(wrap, tuple) else (False, False, False)
        for gen in ("v5e", "v6e"):
            out[f"{gen}-{chips}"] = Target(f"{gen}-{chips}", gen, chips, f"{gen}:{x}x{y}", "default", w)
    # v4 / v5p: the name counts TensorCores (two per chip); megacore makes each chip one device
    for cores, dims, wrap in [(8, "2x2x1", False), (16, "2x2x2", False), (32, "2x2x4", False), (64, "2x4x4", False),
                              (128, "4x4x4", True), (256, "4x4x8", True), (512, "4x8x8", True)]:
        for gen, prefix in (("v4", "v4"), ("v5p", "v5")):
            out[f"{gen}-{cores}"] = Target(f"{gen}-{cores}", gen, cores // 2, f"{prefix}:{dims}", "megacore",
                                           (wrap, wrap, wrap))
    return out


def _gpu_targets() -> dict[str, Target]:
    """NVIDIA GPU nodes by chip and count: 1, 2, 4, 8 GPUs in one node, 16 / 32 / 64 as nodes of 8.
    The CUDA plugin's topology string is ``slices x hosts-per-slice x devices-per-host``."""
    out: dict[str, Target] = {}
    for chip in GPU_SPEC_FILES:
        for n in (1, 2, 4, 8, 16, 32, 64):
            hosts, per_host = max(n // GPUS_PER_NODE, 1), min(n, GPUS_PER_NODE)
            out[f"{chip}-{n}"] = Target(f"{chip}-{n}", chip, n, f"1x{hosts}x{per_host}")
    return out


TARGETS: dict[str, Target] = {**_tpu_targets(), **_gpu_targets()}

CUDA_PLUGIN_MISSING = ("target {name!r} compiles with JAX's CUDA plugin, which is not installed: pip install -e "
                       "'.[cuda]' (the `cuda` extra: jax[cuda12-local] for this jax; no GPU is needed to plan); "
                       "or plan for the CPU with --target cpu-N")
LIBTPU_MISSING = ("target {name!r} compiles with libtpu, which is not installed: pip install -e '.[tpu]' "
                  "(the `tpu` extra pins the libtpu that jax[tpu] pins for this jax); or plan for the CPU "
                  "with --target cpu-N")


def get_target(name: str) -> Target:
    """The target called ``name``: a key of :data:`TARGETS`, ``cpu`` (this process's CPU devices) or
    ``cpu-N`` (N simulated CPU devices); ``UserError`` listing the known names otherwise."""
    if name in TARGETS:
        return TARGETS[name]
    match = re.fullmatch(r"cpu(?:-(\d+))?", name)
    if match:
        n = int(match.group(1)) if match.group(1) else len(jax.devices("cpu"))
        if n < 1:
            raise UserError(f"--target {name}: a CPU target needs at least one device")
        return Target(name, "cpu", n)
    raise UserError(f"--target {name!r} is not a known target; known: cpu, cpu-N (N simulated CPU devices), "
                    + ", ".join(sorted(TARGETS, key=_target_order)))


def _target_order(name: str) -> tuple:
    gen, size = name.rsplit("-", 1)
    return gen, int(size)


def target_devices(target: Target) -> list:
    """The target's devices: abstract TPU devices of its topology (compile-only), or this process's CPUs."""
    if target.platform == "cpu":
        devices = jax.devices("cpu")
        if len(devices) != target.num_devices:
            raise UserError(f"--target {target.name}: this process has {len(devices)} CPU devices, not "
                            f"{target.num_devices} (rljax plan re-runs itself with "
                            f"XLA_FLAGS=--xla_force_host_platform_device_count={target.num_devices})")
        return devices
    import importlib.util

    if target.platform == "cuda":
        return _gpu_devices(target)
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(LIBTPU_MISSING.format(name=target.name))
    from jax.experimental import topologies

    # libtpu reads these at start; without them it warns that it cannot find a TPU host here
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.name.replace("v5e-", "v5litepod-"))
    # compile-only: no TPU is opened, so plans may run side by side (else libtpu's lock file refuses a second)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    desc = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                        chip_config_name=target.chip_config, chips_per_host_bounds=(2, 2, 1),
                                        num_slices=1, wrap=target.wrap)
    devices = list(desc.devices)
    if len(devices) != target.num_devices:
        raise RuntimeError(f"topology {target.topology} gave {len(devices)} devices, expected {target.num_devices}")
    return devices


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (the ``cuda`` extra: ``jax_plugins.xla_cuda12``) is importable."""
    import importlib.util

    return importlib.util.find_spec("jax_plugins") is not None and \
        importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def _gpu_devices(target: Target) -> list:
    """Compile-only CUDA devices of ``target``: the plugin's topology built from XLA's description of
    the chip (no GPU is opened: this process computes on the CPU, ``JAX_PLATFORMS=cpu``)."""
    if not cuda_plugin_installed():
        raise UserError(CUDA_PLUGIN_MISSING.format(name=target.name))
    from importlib import resources

    from jax.experimental import topologies

    spec = resources.files("rljax").joinpath("gpu_specs", GPU_SPEC_FILES[target.chip]).read_text()
    desc = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=target.topology)
    devices = list(desc.devices)
    if len(devices) != target.num_devices:
        raise RuntimeError(f"topology {target.topology} gave {len(devices)} devices, expected {target.num_devices}")
    return devices


def usable_memory(target: Target) -> int:
    """Bytes per device a run on ``target`` may use: the chip's memory; on a GPU, the share JAX's
    allocator takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``, default 0.75: the rest is left to the CUDA
    context, cuBLAS / cuDNN workspaces and NCCL)."""
    if target.platform != "cuda":
        return target.spec.memory_bytes
    return int(target.spec.memory_bytes * _gpu_memory_fraction())


def _gpu_memory_fraction() -> float:
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    try:
        fraction = float(text)
    except ValueError:
        raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} must be in (0, 1]")
    return fraction


# ------------------------------------------------------------------------------------ model shapes
def model_config_for(name: str):
    """The ``ModelConfig`` of ``model.name`` from its ``config.json`` (a directory that may hold nothing
    else) or a GGUF file's metadata: no weights are read."""
    import json

    from rljax.models.config import ModelConfig
    from rljax.models.registry import resolve

    resolved = resolve(name)
    if resolved.kind == "hf_dir":
        with open(os.path.join(resolved.path, "config.json")) as f:
            return ModelConfig.from_hf_dict(json.load(f))
    from rljax.models.gguf_io import read_gguf

    return ModelConfig.from_hf_dict(read_gguf(resolved.path).hf_config)


def _abstract_split(config, cfg, *, value_head: bool, lora: bool, mesh, rules):
    """``(graphdef, params, frozen)`` of the run's model as sharded ``ShapeDtypeStruct`` s."""
    from rljax.models import dtype_from_name
    from rljax.models.lora import lora_trainable
    from rljax.models.transformer import abstract_model

    m = cfg.model
    dtype = dtype_from_name(m.dtype)
    kwargs = dict(param_dtype=dtype, dtype=dtype, value_head=value_head, scan_layers=m.scan_layers)
    if lora:
        kwargs.update(lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, lora_targets=tuple(m.lora_targets))
    model = abstract_model(config, **kwargs)
    model.logits_chunk, model.remat, model.attention_chunk = m.logits_chunk, m.remat, m.attention_chunk
    graphdef, params, frozen = nnx.split(model, lora_trainable() if lora else nnx.Param, ...)
    return graphdef, _with_shardings(params, mesh, rules), _with_shardings(frozen, mesh, rules)


def _with_shardings(state, mesh, rules):
    from rljax.sharding import param_shardings

    shardings = param_shardings(state, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def _opt_state(optimizer, params, mesh):
    """The optimizer state's shapes and shardings: a leaf that mirrors a parameter (Adam's moments:
    its path ends with the parameter's path) is sharded like it, as ``optimizer.init`` on sharded
    parameters gives; the rest (step counts) is replicated."""
    from rljax.sharding import replicated

    by_path = {tuple(path): x.sharding for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    shapes = jax.eval_shape(optimizer.init, params)

    def place(path, x):
        for i in range(len(path)):
            sharding = by_path.get(tuple(path[i:]))
            if sharding is not None and len(sharding.spec) <= x.ndim:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated(mesh))

    return jax.tree_util.tree_map_with_path(place, shapes)


def _key_dtype():
    return jax.eval_shape(lambda: jax.random.key(0)).dtype


def _spec(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def replication_fallbacks(state, mesh, rules) -> list[str]:
    """Parameters a rule asks to split over a mesh axis whose size does not divide the dimension
    (``rljax.sharding.logical_to_spec`` then replicates that dimension): ``["path: name=size / axis=size"]``."""
    from rljax.sharding import _rule_table

    table = _rule_table(rules)
    sizes = dict(mesh.shape)
    found = []
    for path, var in nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state():
        axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
        if not axes:
            continue
        spec = tuple(var.get_value().sharding.spec) + (None,) * len(axes)
        for i, (name, dim) in enumerate(zip(axes, var.get_value().shape)):
            target = table.get(name)
            wanted = [target] if isinstance(target, str) else list(target or [])
            got = spec[i] if isinstance(spec[i], tuple) else (spec[i],) if spec[i] else ()
            for axis in wanted:
                if sizes.get(axis, 1) > 1 and axis not in got and dim % sizes[axis]:
                    found.append(f"{'.'.join(str(p) for p in path)}: {name}={dim} not divisible by {axis}={sizes[axis]}")
    return found


# -------------------------------------------------------------------------------- the programs
@dataclasses.dataclass
class ProgramReport:
    """One compiled program, per chip (device)."""

    name: str  # "update", "scoring", "sampler", ...
    what: str  # the function compiled and its shapes
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs that reuse donated argument buffers
    temp_bytes: int = 0
    flops: float | None = None  # cost_analysis, per chip
    bytes_accessed: float | None = None
    analytic_flops: float = 0.0  # whole program, all chips
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)
    oom: str = ""  # the compiler's out-of-memory message, if it refused
    note: str = ""  # how the compile differed from the default (printed under the table)
    # the sampler's decode loop: steps after the one counted above, the FLOPs (all chips) and the
    # bytes per chip (weights + KV cache) each step reads
    decode_steps: int = 0
    decode_flops: float = 0.0
    decode_bytes: float = 0.0
    time_s: float = 0.0  # roofline estimate (set by plan_run)
    bound: str = ""  # "compute" | "memory"
    in_step: bool = True  # counted in the step's time (the offline reference cache is not: it runs once)
    compile_s: float = 0.0  # seconds this machine took to lower and compile it
    state_arg_bytes: int = 0  # of the arguments, the run's persistent state (parameters, optimizer state)
    resident_bytes: int = 0  # all of the run's persistent state on a chip (set by plan_run)

    @property
    def step_flops(self) -> float:
        """Analytic FLOPs (all chips) of one call, the whole decode loop included."""
        return self.analytic_flops + self.decode_steps * self.decode_flops

    @property
    def other_argument_bytes(self) -> int:
        """Arguments that are not persistent state (the batch, keys)."""
        return max(self.argument_bytes - self.state_arg_bytes, 0)

    @property
    def total_bytes(self) -> int:
        """Peak estimate per chip: every persistent array of the run (the trainer holds its parameters,
        optimizer state, reference copy and critic through every program) + this program's other
        arguments + its outputs not written into donated buffers + its temporaries."""
        return self.resident_bytes + self.other_argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclasses.dataclass
class PlanReport:
    target: Target
    memory_bytes: int
    mesh_shape: dict[str, int]
    model: str
    num_params: int
    trainable_params: int
    programs: list[ProgramReport]
    replicated: list[str]
    advice: list[str]

    @property
    def fits(self) -> bool:
        return all(not p.oom and p.total_bytes <= self.memory_bytes for p in self.programs)

    def to_dict(self) -> dict:
        """Everything in the report as JSON-able values (``rljax plan --json``)."""
        programs = [{**dataclasses.asdict(p), "total_bytes": p.total_bytes, "step_flops": p.step_flops,
                     "other_argument_bytes": p.other_argument_bytes}
                    for p in self.programs]
        return {"target": self.target.name, "num_devices": self.target.num_devices, "chip": dataclasses.asdict(
                    self.target.spec), "memory_bytes": self.memory_bytes, "mesh": self.mesh_shape, "model": self.model,
                "num_params": self.num_params, "trainable_params": self.trainable_params, "fits": self.fits,
                "programs": programs, "replicated": self.replicated, "advice": self.advice}


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many collective ops of each kind the (optimised) HLO text holds: ``all-gather``,
    ``all-reduce``, ``reduce-scatter``, ``all-to-all``, ``collective-permute`` (async ``-start``
    halves counted once, ``-done`` not). Ops inside loops count once."""
    kinds = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    counts = {}
    for kind in kinds:
        n = len(re.findall(rf"\s{kind}(?:-start)?\(", hlo_text))
        if n:
            counts[kind] = n
    return counts


def analytic_flops(config, tokens_per_row: int, rows: int, *, passes: float, with_head: bool = True) -> float:
    """``2·N·tokens`` per forward pass (``passes`` forwards' worth: 1 scoring, 3 training = forward +
    backward, 2 for the backward of frozen (LoRA) weights), plus attention's ``4·T²·H·hd`` per layer
    and row per forward (full ``T×T`` scores: masked, not skipped). ``N`` counts the matmul weights
    (the embedding lookup is not a matmul; the LM head is, tied or not)."""
    c = config
    n_matmul = _matmul_params(config, with_head=with_head)
    tokens = rows * tokens_per_row
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * tokens_per_row ** 2 * rows
    return passes * (2 * n_matmul * tokens + attention)


def _matmul_params(config, *, with_head: bool = True) -> int:
    """Weights that enter a matmul per token: every layer's projections, and the LM head."""
    c = config
    attention = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    per_layer = attention + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + (c.hidden_size * c.vocab_size if with_head else 0)


def _chip_bytes(tree) -> int:
    """Bytes of one device's shards of a tree of sharded ``ShapeDtypeStruct`` s (the largest shard
    where a dimension does not divide evenly)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


_TRITON_TILING_FAILURE = "Couldn't find output tile sizes"


def _compile(name: str, what: str, jitted, args: tuple, kwargs: dict, analytic: float, *, state=()) -> ProgramReport:
    """Lower and compile ``jitted(*args, **kwargs)``; ``state``: the arguments that are persistent state."""
    report = ProgramReport(name, what, analytic_flops=analytic, state_arg_bytes=_chip_bytes(state))
    start = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    try:
        try:
            compiled = lowered.compile()
        except Exception as err:
            if _TRITON_TILING_FAILURE not in str(err):
                raise
            # XLA's GPU compiler, with no GPU to autotune on, found no Triton tiling for some f32 matmuls
            # (seen: a [55296, 256] weight gradient of paper_repro/online_vs_offline.py --full on
            # h100-1); the same program with cuBLAS matmuls compiles, and its buffers are the plan's
            compiled = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
            report.note = (f"{name}: compiled with xla_gpu_enable_triton_gemm=false (XLA found no Triton tiling for "
                           "a matmul without a GPU to autotune on; a GPU run may pick Triton kernels instead)")
        report.compile_s = time.perf_counter() - start
    except Exception as err:  # XlaRuntimeError: RESOURCE_EXHAUSTED ... CompileTimeHbmOom
        text = str(err)
        if "RESOURCE_EXHAUSTED" in text or "HbmOom" in text or "out of memory" in text.lower():
            report.oom = text.strip().splitlines()[0][:400]
            return report
        raise
    mem = compiled.memory_analysis()
    if mem is not None:
        report.argument_bytes = int(mem.argument_size_in_bytes)
        report.output_bytes = int(mem.output_size_in_bytes)
        report.alias_bytes = int(mem.alias_size_in_bytes)
        report.temp_bytes = int(mem.temp_size_in_bytes)
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else None
    if cost:
        report.flops = float(cost.get("flops", 0.0)) or None
        report.bytes_accessed = float(cost.get("bytes accessed", 0.0)) or None
    report.collectives = count_collectives(compiled.as_text())
    return report


def _count(state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def _mesh(cfg, devices):
    from rljax.sharding import make_mesh

    m = cfg.mesh
    try:
        return make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, devices=devices)
    except ValueError as err:
        raise UserError(f"mesh.data={m.data} mesh.fsdp={m.fsdp} mesh.tensor={m.tensor} on {len(devices)} devices: "
                        f"{err}") from None


def _check_batch_split(rows: int, mesh, what: str) -> None:
    split = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % split:
        raise UserError(f"{what} = {rows} rows cannot be split over mesh.data × mesh.fsdp = {split} devices: make "
                        f"the rows a multiple of {split}, or move devices to mesh.tensor")


def plan_run(cfg, target_name: str, *, memory_bytes: int | None = None) -> PlanReport:
    """Compile ``cfg``'s programs for ``target_name`` from shapes alone; see the module docstring.

    ``memory_bytes`` overrides the chip's memory (what the fit check compares against)."""
    from rljax.sharding import replicated, use_mesh
    from rljax.training.spec import run_spec
    from rljax.rollout import packing_group
    from rljax.update import optimizer_for

    target = get_target(target_name)
    devices = target_devices(target)
    mesh = _mesh(cfg, devices)
    rules = cfg.mesh.rule_table()
    config = model_config_for(cfg.model.name)
    spec = run_spec(cfg)
    algo, a = spec.algorithm, cfg.algorithm
    lora = bool(cfg.model.lora_rank)
    memory = memory_bytes if memory_bytes is not None else (usable_memory(target) or _host_memory() // target.num_devices)

    programs: list[ProgramReport] = []
    with use_mesh(mesh, rules):
        if algo.online:
            value_head = algo.value_head(a)
            graphdef, params, frozen = _abstract_split(config, cfg, value_head=spec.value_head, lora=lora,
                                                       mesh=mesh, rules=rules)
            total_updates = spec.total_updates
            optimizer = optimizer_for(cfg.optim, total_updates)
            opt_state = _opt_state(optimizer, params, mesh)
            R, P, N = spec.rows, _prompt_width(cfg), spec.completion_length
            _check_batch_split(R, mesh, "algorithm.prompts_per_step × group_size")
            batch = _rollout_batch(algo, a, R, P, N, mesh, rules, reference=spec.needs_reference,
                                   values=value_head is not None,
                                   # single-turn groups share their prompt (rljax.training.online.rollout_batch)
                                   prompt_group=1 if cfg.environment.name else packing_group(R, a.group_size,
                                                                                             a.num_micro))
            critic = {}
            if spec.critic is not None:
                critic_config = model_config_for(spec.critic)
                cg, cp, cf = _abstract_split(critic_config, cfg, value_head=True, lora=False, mesh=mesh, rules=rules)
                critic_opt = optimizer_for(cfg.optim if spec.critic_learning_rate is None
                                           else dataclasses.replace(cfg.optim, learning_rate=spec.critic_learning_rate),
                                           total_updates)
                critic = dict(critic_graphdef=cg, critic_params=cp, critic_frozen=cf,
                              critic_opt_state=_opt_state(critic_opt, cp, mesh), critic_optimizer=critic_opt)
            critic_state = (critic["critic_params"], critic["critic_frozen"], critic["critic_opt_state"]) if critic else ()
            # what the trainer holds all step: policy, optimizer state, a full fine-tune's reference copy
            # (rljax.training.run.build_run: keep_reference when the algorithm needs one), the critic
            resident = _chip_bytes((params, frozen, opt_state, critic_state)) + (
                _chip_bytes(params) if spec.keep_reference and not lora else 0)
            from rljax.training.online import score_logprobs, score_values, update_epochs

            train_passes = (2.0 if lora else 3.0) + (1.0 if cfg.model.remat != "none" else 0.0)
            analytic = analytic_flops(config, P + N, R, passes=train_passes * a.num_iterations)
            if critic:
                analytic += analytic_flops(critic_config, P + N, R, passes=(3.0 + (cfg.model.remat != "none"))
                                           * a.num_iterations, with_head=False)
            programs.append(_compile(
                "update", f"update_epochs: {a.num_iterations} pass(es) × {a.mini_batches} mini-batch(es) × "
                          f"{a.num_micro} micro-batch(es) of [{R} rows, {P}+{N} tokens]",
                update_epochs, (graphdef, params, frozen, opt_state, batch, _spec((), _key_dtype(),
                                                                                  replicated(mesh))),
                dict(optimizer=optimizer, algorithm=a.name, cfg=a, temperature=cfg.sampling.temperature,
                     num_micro=a.num_micro, num_iterations=a.num_iterations, mini_batches=a.mini_batches, **critic),
                analytic, state=(params, frozen, opt_state, critic_state)))
            if algo.needs_reference(a):
                programs.append(_compile(
                    "scoring", f"score_logprobs: reference log-probs of [{R} rows, {P}+{N} tokens]",
                    score_logprobs, (graphdef, params, frozen, batch), dict(temperature=cfg.sampling.temperature),
                    analytic_flops(config, P + N, R, passes=1.0), state=(params, frozen)))
            if value_head is not None:
                separate = value_head == "separate"
                split = ((critic["critic_graphdef"], critic["critic_params"], critic["critic_frozen"]) if separate
                         else (graphdef, params, frozen))
                programs.append(_compile(
                    "values", f"score_values: {'the critic' if separate else 'the value head'}'s values of "
                              f"[{R} rows, {P}+{N} tokens]",
                    score_values, (*split, batch), {},
                    analytic_flops(critic_config if separate else config, P + N, R, passes=1.0, with_head=False),
                    state=split[1:]))
            programs.append(_sampler(cfg, config, graphdef, params, frozen, R, P, N, mesh, rules))
        else:
            graphdef, params, frozen = _abstract_split(config, cfg, value_head=spec.value_head, lora=lora, mesh=mesh,
                                                       rules=rules)
            optimizer = optimizer_for(cfg.optim, spec.total_updates)
            opt_state = _opt_state(optimizer, params, mesh)
            B, P, N = spec.rows, _prompt_width(cfg), spec.completion_length
            _check_batch_split(B, mesh, "algorithm.batch_size")
            batch, K = _offline_batch(spec, a, B, P, N, mesh, rules)
            # a reference copy only for live reference log-probs of a full fine-tune (else cached once)
            resident = _chip_bytes((params, frozen, opt_state)) + (_chip_bytes(params) if spec.keep_reference
                                                                   and not lora else 0)
            from rljax.training.offline import offline_update, score_batch

            train_passes = (2.0 if lora else 3.0) + (1.0 if cfg.model.remat != "none" else 0.0)
            programs.append(_compile(
                "update", f"offline_update: {a.num_micro} micro-batch(es) of [{B} rows × {K} completions, "
                          f"{P}+{N} tokens]",
                offline_update, (graphdef, params, frozen, opt_state, batch),
                dict(optimizer=optimizer, algorithm=a.name, cfg=a, num_micro=a.num_micro),
                analytic_flops(config, P + N, B * K, passes=train_passes), state=(params, frozen, opt_state)))
            if spec.needs_reference:
                E = a.eval_batch_size
                eval_batch, _ = _offline_batch(spec, a, E, P, N, mesh, rules)
                programs.append(_compile(
                    "scoring", f"score_batch: reference log-probs of [{E} rows × {K} completions, {P}+{N} tokens]",
                    score_batch, (graphdef, params, frozen, eval_batch), dict(algorithm=a.name),
                    analytic_flops(config, P + N, E * K, passes=1.0), state=(params, frozen)))
    for p in programs:
        p.resident_bytes = resident
        _roofline(p, target.spec, target.num_devices)
        p.in_step = algo.online or p.name == "update"
    report = PlanReport(target, memory, dict(mesh.shape), cfg.model.name, _count(params) + _count(frozen),
                        _count(params), programs, replication_fallbacks(params, mesh, rules)
                        + replication_fallbacks(frozen, mesh, rules), [])
    report.advice = _advice(report, cfg)
    return report


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def _prompt_width(cfg) -> int:
    from rljax.buckets import bucket_length

    return bucket_length(cfg.data.max_prompt_length, 16)  # the widest prompt bucket a batch can have


def _rollout_batch(algo, a, R, P, N, mesh, rules, *, reference: bool, values: bool, prompt_group: int = 1):
    """The update's ``RolloutBatch`` as sharded shapes (rows over the batch axes), advantages filled
    by the algorithm's own function (traced, not run)."""
    from rljax.batches import RolloutBatch
    from rljax.sharding import batch_sharding

    rows = batch_sharding(mesh, rules)
    i32, f32 = jnp.int32, jnp.float32
    base = RolloutBatch(
        prompt_ids=_spec((R, P), i32, rows), prompt_mask=_spec((R, P), i32, rows),
        completion_ids=_spec((R, N), i32, rows), completion_mask=_spec((R, N), i32, rows),
        loss_mask=_spec((R, N), i32, rows), old_logprobs=_spec((R, N), f32, rows), scores=_spec((R,), f32, rows),
        row_mask=_spec((R,), jnp.bool_, rows), finished=_spec((R,), jnp.bool_, rows),
        ref_logprobs=_spec((R, N), f32, rows) if reference else None,
        old_values=_spec((R, N), f32, rows) if values else None, prompt_group=prompt_group)
    state = algo.start_state(a)
    filled = jax.eval_shape(lambda b: algo.advantages_and_state(b, a, state)[0], base)
    return jax.tree.map(lambda x: _spec(x.shape, x.dtype, rows), filled)


def _offline_batch(spec, a, B, P, N, mesh, rules):
    """The update's batch as sharded shapes: the data kind's own abstract batch (``rljax.data.kinds``),
    rows over the batch axes; returns it and its completions per row."""
    from rljax.data.kinds import get_kind
    from rljax.sharding import batch_sharding

    rows = batch_sharding(mesh, rules)
    kind = get_kind(spec.batch_kind)
    shapes = kind.abstract_batch(B, P, N, a, reference=spec.needs_reference)
    return jax.tree.map(lambda x: _spec(x.shape, x.dtype, rows), shapes), kind.completions(a)


def _sampler(cfg, config, graphdef, params, frozen, R, P, N, mesh, rules) -> ProgramReport:
    """The sampler's program for one step's rollouts (batch and prompt width bucketed as ``generate`` does)."""
    from rljax.buckets import bucket_length
    from rljax.sampling import SamplingConfig, _generate
    from rljax.sharding import batch_sharding, replicated

    B = bucket_length(R, 8)
    rows = batch_sharding(mesh, rules)
    s = cfg.sampling
    sampling = SamplingConfig(max_new_tokens=N, temperature=s.temperature, top_k=s.top_k or 0, top_p=s.top_p,
                              stop_token_ids=config.eos_token_ids, ignore_eos=s.ignore_eos,
                              pad_token_id=config.pad_token_id or 0)
    ids = _spec((B, P), jnp.int32, rows)
    key = _spec((), _key_dtype(), replicated(mesh))
    # prefill of [B, P], then one decode step: one token per row against P + N cached keys
    c = config
    decode = B * (2 * _matmul_params(config) + 4 * c.num_layers * c.num_heads * c.head_dim * (P + N))
    report = _compile("sampler", f"generate: prefill [{B} rows, {P} tokens] + decode loop to {N} new tokens "
                                 "(XLA's cost: prefill + one decode step)",
                      _generate, (graphdef, (params, frozen), ids, ids, key, sampling), {},
                      analytic_flops(config, P, B, passes=1.0) + decode, state=(params, frozen))
    n = mesh.devices.size
    itemsize = jnp.dtype(_dtype_of(cfg)).itemsize
    cache = 2 * c.num_layers * B * (P + N) * c.num_kv_heads * c.head_dim * itemsize
    weights = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves((params, frozen)))
    report.decode_steps, report.decode_flops, report.decode_bytes = N - 1, decode, (weights + cache) / n
    return report


def _dtype_of(cfg):
    from rljax.models import dtype_from_name

    return dtype_from_name(cfg.model.dtype)


def _roofline(p: ProgramReport, spec: ChipSpec, n: int) -> None:
    """``p.time_s``: the first call's FLOPs (the larger of XLA's and the analytic count, per chip) at
    peak, or its bytes accessed at the memory bandwidth, whichever is longer; plus, for the sampler,
    each further decode step the same way over the weights and KV cache it reads."""
    flops = max(p.analytic_flops / n, p.flops or 0.0)
    # no cost analysis (GPU targets): every argument read and output written once, every temporary
    # written and read once, a lower bound on the bytes the program moves
    moved = p.bytes_accessed if p.bytes_accessed else p.argument_bytes + p.output_bytes + 2 * p.temp_bytes
    first_c, first_m = flops / spec.peak_flops, moved / spec.memory_bandwidth
    decode_c = p.decode_steps * p.decode_flops / n / spec.peak_flops
    decode_m = p.decode_steps * p.decode_bytes / spec.memory_bandwidth
    p.time_s = max(first_c, first_m) + max(decode_c, decode_m)
    t_compute, t_memory = first_c + decode_c, first_m + decode_m
    p.bound = "compute" if t_compute >= t_memory else "memory"


# ----------------------------------------------------------------------------------- the report
def _advice(report: PlanReport, cfg) -> list[str]:
    """What to change when a program does not fit: the state's share first when the arguments alone
    are over (more sharding, LoRA, bfloat16), the activations' when the temporaries are."""
    if report.fits:
        return []
    memory = report.memory_bytes
    lines, state_over = [], False
    for p in report.programs:
        if p.oom:
            lines.append(f"{p.name}: the compiler refused it: {p.oom[:300]}")
        elif p.total_bytes > memory:
            state_over |= p.resident_bytes > memory / 2
            lines.append(f"{p.name} needs {_gib(p.total_bytes)} per chip (state {_gib(p.resident_bytes)}, "
                         f"temporaries {_gib(p.temp_bytes)}) of {_gib(memory)}")
    state = []
    if report.mesh_shape["fsdp"] < report.target.num_devices:
        state.append("shard parameters and optimizer state over more devices: mesh.fsdp=-1 (all devices not on "
                     "mesh.data / mesh.tensor), mesh.data=1")
    state.append("a larger target (more chips to shard over)")
    if report.target.platform == "cuda" and _gpu_memory_fraction() < 0.9:
        state.append("XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 when planning and training (JAX's allocator takes "
                     f"{_gpu_memory_fraction():.0%} of each GPU now)")
    if not cfg.model.lora_rank:
        state.append("model.lora_rank=16 (train adapters: no full-size gradients or optimizer state)")
    if cfg.model.dtype == "float32":
        state.append("model.dtype=bfloat16 (half the parameter and activation bytes)")
    activations = []
    if cfg.model.remat == "none":
        activations.append("model.remat=block with model.scan_layers=true (keep only each block's input for the "
                           "backward)")
    if cfg.model.logits_chunk is None:
        activations.append("model.logits_chunk=256 (never hold [B, T, V] logits at once)")
    if cfg.model.attention_chunk is None:
        activations.append("model.attention_chunk=256 (never hold [B, H, T, T] attention scores at once)")
    activations.append("fewer sequences per micro-batch: algorithm.micro_batch_size (the same gradient)")
    activations.append("shorter sequences: sampling.max_new_tokens / data.max_prompt_length")
    ordered = state + activations if state_over else activations + state
    return lines + ["try:"] + ["  - " + a for a in ordered]


def _seconds(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 10 else f"{n / 2 ** 20:.2f} MiB"


def count_text(n: int) -> str:
    """A parameter count with the unit that keeps it readable: ``1.71 B``, ``135 M``, ``46.1 K``, ``12``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return str(int(n))


def _tflop(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e12:.3g} TFLOP"


def format_report(report: PlanReport) -> str:
    """The report as markdown-ish text: one table of memory, one of FLOPs and time, the collectives."""
    t, spec = report.target, report.target.spec
    n = t.num_devices
    lines = [f"# rljax plan: {report.model} on {t.name} ({n} × {spec.name}"
             + (f", topology {t.topology}" if t.topology else "") + ")",
             f"mesh {report.mesh_shape}; parameters {count_text(report.num_params)}, trainable "
             f"{count_text(report.trainable_params)}",
             f"chip: {_gib(report.memory_bytes)} memory, {spec.peak_flops / 1e12:.4g} TFLOP/s bf16 peak, "
             f"{spec.memory_bandwidth / 1e9:.4g} GB/s (source: {spec.source})"]
    if t.platform == "cuda":
        lines.append(f"GPU memory for the fit: {_gib(report.memory_bytes)} of the GPU's {_gib(spec.memory_bytes)} "
                     "(the share JAX's allocator takes: XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75; or "
                     "--memory-gib). A GPU compile checks no sizes: 'fits' is the table's total against this")
    if any(p.flops is None and not p.oom for p in report.programs):
        lines.append("XLA gave no cost analysis for this target: FLOPs are analytic only, and the roofline's bytes "
                     "for the first pass are arguments + outputs + twice the temporaries (each read or written "
                     "once: a lower bound)")
    lines += ["",
             "| program | resident state | other arguments | outputs | temporaries | total / chip | of memory | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for p in report.programs:
        if p.oom:
            lines.append(f"| {p.name} | {_gib(p.resident_bytes)} | - | - | - | over | - | NO (compiler: {p.oom[:160]}) |")
            continue
        frac = p.total_bytes / report.memory_bytes if report.memory_bytes else float("nan")
        lines.append(f"| {p.name} | {_gib(p.resident_bytes)} | {_gib(p.other_argument_bytes)} | "
                     f"{_gib(p.output_bytes - p.alias_bytes)} | {_gib(p.temp_bytes)} | {_gib(p.total_bytes)} | "
                     f"{frac:.0%} | {'yes' if p.total_bytes <= report.memory_bytes else 'NO'} |")
    lines += [p.note for p in report.programs if p.note]
    lines += ["", "(resident state: parameters, optimizer state, reference copy and critic, held through every "
                  "program; outputs: those not written into donated argument buffers)", "",
              "| program | FLOPs / chip (XLA) | analytic / chip | roofline time | bound | MFU (≤) | collectives |",
              "|---|---|---|---|---|---|---|"]
    step_time = step_flops = 0.0
    for p in report.programs:
        if p.oom:
            continue
        analytic = p.analytic_flops / n
        mfu = p.step_flops / n / spec.peak_flops / p.time_s if p.time_s else 0.0
        coll = ", ".join(f"{k} {v}" for k, v in p.collectives.items()) or "none"
        lines.append(f"| {p.name} | {_tflop(p.flops)} | {_tflop(analytic)} | {_seconds(p.time_s)} | {p.bound} | "
                     f"{mfu:.0%} | {coll} |")
        if p.in_step:
            step_time, step_flops = step_time + p.time_s, step_flops + p.step_flops
    if step_time and not any(p.oom for p in report.programs):
        lines.append(f"| **one step** | | {_tflop(step_flops / n)} | {_seconds(step_time)} | | "
                     f"{step_flops / n / spec.peak_flops / step_time:.0%} | |")
    lines += ["", "Programs: " + "; ".join(f"{p.name} = {p.what} (compiled in {p.compile_s:.0f} s)"
                                          for p in report.programs),
              "analytic = 2·N·tokens per forward (3 forwards' worth for training, 2 with LoRA's frozen weights, "
              "+1 with remat) + 4·T²·H·hd per layer and row, N = matmul weights; XLA counts a loop body (layer "
              "scan, decode loop) once. Roofline time = max(FLOPs / peak, bytes accessed / bandwidth) of the "
              "first pass, plus for the sampler each further decode step reading the weights and KV cache; "
              "collectives and the host are ignored, so the time is a lower bound and the MFU (analytic FLOPs "
              "of the whole call / peak / time) an upper bound."]
    if report.replicated:
        lines += ["", f"replicated where the rules ask for a split ({len(report.replicated)} dims: the mesh axis "
                      "does not divide the size):"] + [f"  - {r}" for r in report.replicated]
    lines.append("")
    lines.append("FITS" if report.fits else "DOES NOT FIT")
    lines += report.advice
    return "\n".join(lines)
