"""``rljax plan``'s report: per program bytes, FLOPs, collectives and a roofline time, the advice
when a run does not fit, and the text the command prints."""

from __future__ import annotations

import dataclasses

from rljax.tools.plan.targets import GiB, ChipSpec, Target, _gpu_memory_fraction


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
    generation: bool = False  # the sampler's or the engine's program
    devices: int = 0  # the devices it runs on (0: all of the target's; set by plan_run)

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
    rollout_devices: int = 0  # mesh.rollout_devices: generation on the first ones (0: colocated)
    weight_sync_bytes: int = 0  # disaggregated: the parameters resharded to the rollout devices per update

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
                "programs": programs, "replicated": self.replicated, "advice": self.advice,
                "rollout_devices": self.rollout_devices, "weight_sync_bytes": self.weight_sync_bytes}


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
    if report.rollout_devices:
        lines.append(f"disaggregated (mesh.rollout_devices={report.rollout_devices}): generation on devices "
                     f"0-{report.rollout_devices - 1} (fsdp={report.rollout_devices}), the update on the other "
                     f"{n - report.rollout_devices} (mesh above); {_gib(report.weight_sync_bytes)} of parameters "
                     "resharded to the rollout devices after each update (the frozen ones placed once). The rollout "
                     "programs' resident state is the sampler's copy of the weights")
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
        d = p.devices or n
        analytic = p.analytic_flops / d
        mfu = p.step_flops / d / spec.peak_flops / p.time_s if p.time_s else 0.0
        coll = ", ".join(f"{k} {v}" for k, v in p.collectives.items()) or "none"
        lines.append(f"| {p.name}{' (rollout devices)' if report.rollout_devices and p.generation else ''} | "
                     f"{_tflop(p.flops)} | {_tflop(analytic)} | {_seconds(p.time_s)} | {p.bound} | {mfu:.0%} | {coll} |")
        if p.in_step:
            step_time, step_flops = step_time + p.time_s, step_flops + p.step_flops
    if report.rollout_devices and not any(p.oom for p in report.programs):
        gen = sum(p.time_s for p in report.programs if p.generation and p.in_step)
        train = sum(p.time_s for p in report.programs if not p.generation and p.in_step)
        lines.append(f"| **one step, overlapped** | | | {_seconds(max(gen, train))} | "
                     f"{'generation' if gen >= train else 'update'} | | |")
        lines.append(f"(disaggregated: generation {_seconds(gen)} on {report.rollout_devices} devices overlaps the "
                     f"update's {_seconds(train)} on {n - report.rollout_devices}; the step is the longer, when "
                     "train.max_staleness lets the next batch be generated during the update)")
    elif step_time and not any(p.oom for p in report.programs):
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
