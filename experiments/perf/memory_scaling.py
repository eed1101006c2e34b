"""Memory of one GRPO step against completion length: full logits vs chunked log-probs, remat, mixed precision.

Question: how does the peak memory of a GRPO step of SmolLM2-135M grow with the completion length,
and what do ``model.logits_chunk`` (log-probs computed a chunk of positions at a time,
``rljax.logprobs.chunked_logprobs``), ``model.remat`` (rematerialised blocks,
``rljax.models.transformer.REMAT_POLICIES``) and bfloat16 weights with a float32 master copy
(``model.dtype: bfloat16``, ``optim.master_dtype: float32``, ``rljax.update.with_master_weights``) change?
Target (issue 13, section 3): peak memory grows no faster than linearly with the length, and the
``[B, N, V]`` logits no longer dominate it.

Workload: SmolLM2-135M-Instruct's architecture (its ``config.json`` read from the registered GGUF's
metadata: 30 layers, width 576, vocabulary 49,152, tied embeddings), full fine-tuning, 4 prompts x 4
completions = 16 rows, prompts of 64 tokens, completions of N = 64, 256, 1024, 2048 tokens (all
real, no padding), GRPO with ``kl_coef`` 0.04 (so the update reads reference log-probs), one
optimizer update per step (``num_iterations`` 1, no mini-batches, no micro-batches), AdamW after
global-norm clipping. The two passes of a step that grow with N are compiled as the trainer
compiles them: the update (``rljax.training.online.update_epochs``: forward, backward, AdamW,
parameters and AdamW state donated) and the scoring pass that gives the reference log-probs
(``rljax.training.online.score_logprobs``). Sampling (the KV-cached decode loop, whose memory is the
cache, ``[L, B, P + N, KVH, hd]``, 2 x 30 x 16 x 2112 x 3 x 64 x 4 bytes = 1.6 GB at N = 2048 in
float32) is not measured here.

Memory is XLA's own account of each compiled program (``compiled.memory_analysis()``): argument,
output and temporary bytes; the peak of a program is ``argument + output - alias + temporary``
(``alias``: outputs written into donated arguments, counted once), and the step's peak is the larger
of the update's and the scoring pass's. This is what the program needs on a device, independent of
the machine's load and of the allocator, unlike the process's RSS. Compiling needs no weights: the
programs are lowered from abstract shapes. The ``logits`` column is the size of one float32
``[16, N, 49152]`` array, for comparison.

Variants (every one with ``model.scan_layers: true``, the layer loop that remat needs to save
anything, rljax/run_config.py; ``--unrolled`` adds the default unrolled baseline):
  full        logits_chunk null, remat none: today's default settings
  chunk       logits_chunk 128
  remat       remat block
  chunk+remat logits_chunk 128, remat block
  bf16+master logits_chunk 128, remat block, bfloat16 weights and compute, float32 master and AdamW
  chunk+remat+attn  logits_chunk 128, remat block, attention_chunk 256 (query-chunked attention:
              rljax/models/transformer.py _chunked_causal_attention)

Time: one update (after a warm-up call that compiles) on random weights of the same shapes, at the
lengths ``--time-lengths`` (default 64 and 256; ``--quick``: 64 only), for the variants
``--time-variants``, where the compiled step peak is at most ``--max-time-gb`` (default 4.5 GB:
the shared host had ~9 GB free). The 2-core CPU is shared by other jobs: the 1-minute load average is printed
beside each time, and times are comparable only within one run.

Run (from the repository root):

    python experiments/perf/memory_scaling.py                       # compile all, time at 64 and 256
    python experiments/perf/memory_scaling.py --quick               # time at 64 only
    python experiments/perf/memory_scaling.py --lengths 64 256 --no-time
    python experiments/perf/memory_scaling.py --out experiments/results/memory_scaling.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import environment, markdown_table, time_call  # noqa: E402

from rljax.algorithms.grpo import GRPOConfig  # noqa: E402
from rljax.batches import RolloutBatch  # noqa: E402
from rljax.models.config import ModelConfig  # noqa: E402
from rljax.models.gguf_io import hf_config_from_gguf_metadata, read_gguf_metadata  # noqa: E402
from rljax.models.registry import resolve  # noqa: E402
from rljax.models.transformer import abstract_model, init_model  # noqa: E402
from rljax.run_config import OptimSection  # noqa: E402
from rljax.training.online import score_logprobs, update_epochs  # noqa: E402
from rljax.update import optimizer_for  # noqa: E402

MODEL_NAME = "smollm2-135m-instruct"
PROMPTS, GROUP = 4, 4
ROWS = PROMPTS * GROUP
PROMPT_LENGTH = 64
CHUNK = 128
ATTENTION_CHUNK = 256
ALGORITHM = GRPOConfig(group_size=GROUP, prompts_per_step=PROMPTS, kl_coef=0.04)
OPTIM = OptimSection(learning_rate=1e-6, grad_clip=1.0)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    logits_chunk: int | None = None
    remat: str = "none"
    bf16_master: bool = False
    scan_layers: bool = True
    attention_chunk: int | None = None


VARIANTS = {v.name: v for v in (
    Variant("full"),
    Variant("chunk", logits_chunk=CHUNK),
    Variant("remat", remat="block"),
    Variant("chunk+remat", logits_chunk=CHUNK, remat="block"),
    Variant("bf16+master", logits_chunk=CHUNK, remat="block", bf16_master=True),
    Variant("chunk+remat+attn", logits_chunk=CHUNK, remat="block", attention_chunk=ATTENTION_CHUNK),
)}
UNROLLED = Variant("full (unrolled)", scan_layers=False)


def model_config() -> ModelConfig:
    """SmolLM2-135M's architecture from the registered GGUF's metadata (no tensor is read)."""
    metadata, names = read_gguf_metadata(resolve(MODEL_NAME).path)
    return ModelConfig.from_hf_dict(hf_config_from_gguf_metadata(metadata, names))


def _model(config: ModelConfig, v: Variant, *, abstract: bool):
    dtype = jnp.bfloat16 if v.bf16_master else jnp.float32
    make = abstract_model if abstract else (lambda c, **kw: init_model(c, seed=0, **kw))
    model = make(config, param_dtype=dtype, dtype=dtype)
    model.scan_layers, model.logits_chunk, model.remat = v.scan_layers, v.logits_chunk, v.remat
    model.attention_chunk = v.attention_chunk
    return model


def _optimizer(v: Variant):
    return optimizer_for(dataclasses.replace(OPTIM, master_dtype="float32" if v.bf16_master else None), 1)


def _batch(n: int, *, abstract: bool) -> RolloutBatch:
    shapes = dict(prompt_ids=((ROWS, PROMPT_LENGTH), jnp.int32), prompt_mask=((ROWS, PROMPT_LENGTH), jnp.int32),
                  completion_ids=((ROWS, n), jnp.int32), completion_mask=((ROWS, n), jnp.int32),
                  loss_mask=((ROWS, n), jnp.int32), old_logprobs=((ROWS, n), jnp.float32),
                  scores=((ROWS,), jnp.float32), row_mask=((ROWS,), jnp.bool_), finished=((ROWS,), jnp.bool_),
                  ref_logprobs=((ROWS, n), jnp.float32), advantages=((ROWS, n), jnp.float32))
    if abstract:
        return RolloutBatch(**{k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()})
    rng = np.random.default_rng(0)
    ones = lambda shape, dtype: jnp.ones(shape, dtype)  # noqa: E731
    return RolloutBatch(
        prompt_ids=jnp.asarray(rng.integers(3, 40000, (ROWS, PROMPT_LENGTH)), jnp.int32),
        prompt_mask=ones((ROWS, PROMPT_LENGTH), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(3, 40000, (ROWS, n)), jnp.int32),
        completion_mask=ones((ROWS, n), jnp.int32), loss_mask=ones((ROWS, n), jnp.int32),
        old_logprobs=jnp.full((ROWS, n), -10.0, jnp.float32), scores=jnp.asarray(rng.random(ROWS), jnp.float32),
        row_mask=ones((ROWS,), jnp.bool_), finished=ones((ROWS,), jnp.bool_),
        ref_logprobs=jnp.full((ROWS, n), -10.0, jnp.float32),
        advantages=jnp.asarray(np.repeat(rng.standard_normal((ROWS, 1)), n, axis=1), jnp.float32))


def _update_kwargs(v: Variant) -> dict:
    return dict(optimizer=_optimizer(v), algorithm="grpo", cfg=ALGORITHM, temperature=1.0, num_micro=1,
                num_iterations=1, mini_batches=1)


def _memory(compiled) -> dict[str, float]:
    m = compiled.memory_analysis()
    gb = 1e9
    out = {"args": m.argument_size_in_bytes / gb, "out": m.output_size_in_bytes / gb,
           "alias": m.alias_size_in_bytes / gb, "temp": m.temp_size_in_bytes / gb}
    out["peak"] = out["args"] + out["out"] - out["alias"] + out["temp"]
    return out


def compile_memory(config: ModelConfig, v: Variant, n: int) -> dict:
    """Compiled memory (GB) of the update and the scoring pass at completion length ``n``, from shapes."""
    graphdef, params, frozen = nnx.split(_model(config, v, abstract=True), nnx.Param, ...)
    opt_state = jax.eval_shape(_optimizer(v).init, params)
    batch = _batch(n, abstract=True)
    t0 = time.perf_counter()
    update = update_epochs.lower(graphdef, params, frozen, opt_state, batch, jax.random.key(0),
                                 **_update_kwargs(v)).compile()
    score = score_logprobs.lower(graphdef, params, frozen, batch, temperature=1.0).compile()
    return {"update": _memory(update), "score": _memory(score), "compile_s": time.perf_counter() - t0}


def time_update(config: ModelConfig, v: Variant, n: int) -> float:
    """Seconds of one update at completion length ``n`` (after a compiling warm-up call)."""
    graphdef, params, frozen = nnx.split(_model(config, v, abstract=False), nnx.Param, ...)
    optimizer = _optimizer(v)
    opt_state = optimizer.init(params)
    batch = _batch(n, abstract=False)
    kwargs = _update_kwargs(v)
    params, opt_state, _, _, metrics = update_epochs(graphdef, params, frozen, opt_state, batch, jax.random.key(0),
                                                     **kwargs)
    jax.block_until_ready(metrics)
    seconds, _ = time_call(lambda: update_epochs(graphdef, params, frozen, opt_state, batch, jax.random.key(1),
                                                 **kwargs))
    return seconds


def logits_gb(config: ModelConfig, n: int) -> float:
    return ROWS * n * config.vocab_size * 4 / 1e9


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--unrolled", action="store_true", help="also the default unrolled layer loop (slow compiles)")
    parser.add_argument("--time-lengths", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--time-variants", nargs="*", default=["full", "chunk+remat", "bf16+master"])
    parser.add_argument("--no-time", action="store_true")
    parser.add_argument("--max-time-gb", type=float, default=4.5,
                        help="time only programs whose compiled peak is at most this (the host's free memory)")
    parser.add_argument("--quick", action="store_true", help="time at the shortest length only")
    parser.add_argument("--out", default="", help="write the markdown report here")
    args = parser.parse_args(argv)
    time_lengths = [] if args.no_time else (args.time_lengths[:1] if args.quick else args.time_lengths)

    config = model_config()
    variants = [VARIANTS[name] for name in args.variants] + ([UNROLLED] if args.unrolled else [])
    print(f"# {MODEL_NAME}: {config.num_layers} layers, width {config.hidden_size}, vocabulary {config.vocab_size}; "
          f"{ROWS} rows x ({PROMPT_LENGTH} prompt + N completion) tokens; load average {os.getloadavg()}", flush=True)
    rows, results = [], []
    for n in args.lengths:
        for v in variants:
            try:
                mem = compile_memory(config, v, n)
            except Exception as err:  # an oversized program fails to compile: a row that says so
                print(f"N={n} {v.name}: compile failed: {type(err).__name__}: {str(err)[:200]}", flush=True)
                rows.append([n, v.name] + ["failed"] * 8)
                continue
            seconds = load = None
            u, s = mem["update"], mem["score"]
            peak = max(u["peak"], s["peak"])
            if n in time_lengths and v.name in args.time_variants and peak <= args.max_time_gb:
                seconds = time_update(config, v, n)
                load = os.getloadavg()[0]
            results.append({"n": n, "variant": v.name, **mem, "peak": peak, "update_s": seconds, "load": load})
            print(f"N={n:5d} {v.name:16s} update: args {u['args']:.2f} out {u['out']:.2f} alias {u['alias']:.2f} "
                  f"temp {u['temp']:.2f} peak {u['peak']:.2f} GB; score: temp {s['temp']:.2f} peak {s['peak']:.2f} GB; "
                  f"logits {logits_gb(config, n):.2f} GB; compile {mem['compile_s']:.0f} s"
                  + (f"; update {seconds:.1f} s (load {load:.1f})" if seconds else ""), flush=True)
            rows.append([n, v.name, f"{u['args']:.2f}", f"{u['temp']:.2f}", f"{u['peak']:.2f}", f"{s['temp']:.2f}",
                         f"{s['peak']:.2f}", f"{peak:.2f}", f"{logits_gb(config, n):.2f}",
                         f"{seconds:.1f} (load {load:.1f})" if seconds else "-"])
            _report(rows, results, args.out, argv)  # after every row: a run cut short keeps what it measured
    print(markdown_table(HEADER, rows) + "\n" + _growth(results), flush=True)


HEADER = ["N", "variant", "update args GB", "update temp GB", "update peak GB", "score temp GB", "score peak GB",
          "step peak GB", "[16,N,V] f32 logits GB", "update s"]


def _report(rows: list, results: list[dict], out: str, argv) -> None:
    table = markdown_table(HEADER, rows)
    growth = _growth(results)
    if not out:
        return
    with open(out, "w") as f:
        f.write("# Peak memory of a GRPO step against completion length (SmolLM2-135M, 16 rows)\n\n")
        f.write("Command: `python experiments/perf/memory_scaling.py " + " ".join(argv or sys.argv[1:]) + "`\n\n")
        f.write("Method and variants: the docstring of experiments/perf/memory_scaling.py. GB = 1e9 bytes, "
                "from XLA's compiled memory analysis; peak = arguments + outputs - aliased + temporaries.\n\n")
        f.write(table + "\n\n" + growth + "\n\n")
        env = environment()
        f.write("Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if not isinstance(v, dict)) + "\n")


def _growth(results: list[dict]) -> str:
    """Per variant: the step peak's growth between consecutive lengths against the length's growth."""
    lines = ["Growth of the step peak between lengths (peak ratio / length ratio; <= 1 is at most linear):"]
    for name in dict.fromkeys(r["variant"] for r in results):
        rs = [r for r in results if r["variant"] == name]
        parts = [f"{a['n']}->{b['n']}: x{b['peak'] / a['peak']:.2f} / x{b['n'] / a['n']:.0f}" for a, b in zip(rs, rs[1:])]
        lines.append(f"- {name}: " + ", ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
