"""``rljax plan``'s targets: TPU slices, NVIDIA GPUs and CPU meshes, their chips' memory, peak and
bandwidth, and the devices XLA compiles for (libtpu, the CUDA plugin from a GPU target description,
or this process's CPU devices)."""

from __future__ import annotations

import dataclasses
import os
import re

import jax

from rljax.errors import UserError

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
# bandwidth"); the CPU row is a 2-core host's float32 matmul rate (docs/performance.md#cpu-matmul-rate)
# split over the simulated devices, with an assumed ~20 GB/s of DRAM.
CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("TPU v4", 32 * GiB, 275e12, 1200e9, "cloud.google.com/tpu/docs/v4"),
    "v5e": ChipSpec("TPU v5e", 16 * GiB, 197e12, 819e9, "cloud.google.com/tpu/docs/v5e"),
    "v5p": ChipSpec("TPU v5p", 95 * GiB, 459e12, 2765e9, "cloud.google.com/tpu/docs/v5p"),
    "v6e": ChipSpec("TPU v6e", 32 * GiB, 918e12, 1640e9, "cloud.google.com/tpu/docs/v6e"),
    "cpu": ChipSpec("CPU (host)", 0, 150e9, 20e9, "docs/performance.md#cpu-matmul-rate; memory: this host's RAM"),
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
    """Whether a JAX CUDA plugin is importable: the ``cuda`` extra's ``jax_plugins.xla_cuda12``, or the
    CUDA 13 one (``jax[cuda13]``, ``jax_plugins.xla_cuda13``) that newer GPU images bring."""
    import importlib.util

    return importlib.util.find_spec("jax_plugins") is not None and any(
        importlib.util.find_spec(f"jax_plugins.{name}") is not None for name in ("xla_cuda12", "xla_cuda13"))


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
