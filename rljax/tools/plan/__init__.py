"""``rljax plan``: compile a run's programs for an accelerator topology on this machine, before paying for it.

Three parts: :mod:`~rljax.tools.plan.targets` (chips, topologies, devices),
:mod:`~rljax.tools.plan.programs` (the run's shapes and the compiles, :func:`plan_run`) and
:mod:`~rljax.tools.plan.report` (what is printed, the advice).

    report = plan_run(cfg, "v5e-16")        # cfg: a RunConfig; no weights are read
    print(format_report(report)); sys.exit(0 if report.fits else 1)

From the config alone (the model's ``config.json`` gives every shape; no weights, no tokenizer) this
builds the run's state as ``jax.ShapeDtypeStruct`` s sharded on the target's mesh (``cfg.mesh``,
``rljax.sharding``), with the trainer's own code (``rljax.training.run.build_state(..., abstract=True)``),
and ahead-of-time compiles, with XLA for the target (``libtpu`` for TPUs, as
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

from rljax.tools.plan.programs import (
    analytic_flops,
    count_collectives,
    model_config_for,
    plan_run,
    replication_fallbacks,
)
from rljax.tools.plan.report import PlanReport, ProgramReport, count_text, format_report
from rljax.tools.plan.targets import (
    CUDA_PLUGIN_MISSING,
    LIBTPU_MISSING,
    TARGETS,
    ChipSpec,
    Target,
    cuda_plugin_installed,
    get_target,
    target_devices,
    usable_memory,
)

__all__ = ["TARGETS", "ChipSpec", "Target", "ProgramReport", "PlanReport", "get_target", "target_devices",
           "model_config_for", "analytic_flops", "count_collectives", "plan_run", "format_report", "count_text",
           "LIBTPU_MISSING", "CUDA_PLUGIN_MISSING", "replication_fallbacks", "usable_memory",
           "cuda_plugin_installed"]
