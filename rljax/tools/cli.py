"""The ``rljax`` command line: ``rljax generate | convert | export | train | eval | pairs | plot | sweep | compare | plan | serve``."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
import time

from rljax.errors import MissingFileError, UserError


# argparse `type=` checks for `rljax generate`: a bad value is a usage error naming the flag.
def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _temperature(text: str) -> float:
    value = _number(float, text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = greedy), got {text}")
    return value


def _top_p(text: str) -> float:
    value = _number(float, text)
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample completions from a model",
        description="Sample completions for one or more prompts with rljax's rollout engine (or the static sampler).",
    )
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="registered model name, .gguf file or Hugging Face directory (default: %(default)s)")
    p.add_argument("--checkpoint", default=None, metavar="RUN_DIR",
                   help="sample from a run directory's checkpoint (its latest, or --step) instead of --model")
    p.add_argument("--step", type=_non_negative_int, default=None, metavar="N",
                   help="with --checkpoint: checkpoint step N (default: the latest)")
    p.add_argument("--prompt", action="append", required=True, type=_prompt,
                   help="prompt text; repeat the flag for a batch of prompts")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message with the tokenizer's chat template")
    p.add_argument("--system", default=None, help="system message used with --chat")
    p.add_argument("--temperature", type=_temperature, default=0.0,
                   help="sampling temperature; 0 is greedy decoding (default: %(default)s)")
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling mass; 1 = off")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--num-samples", type=_positive_int, default=1, help="completions per prompt (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampler (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute and parameter dtype (default: %(default)s)")
    p.add_argument("--engine", choices=("paged", "static"), default="paged",
                   help="paged: the rollout engine (continuous batching over a paged KV cache); static: one "
                        "batch until its longest row (default: %(default)s)")
    p.add_argument("--max-slots", type=_positive_int, default=64,
                   help="with --engine paged: sequences decoded together (default: %(default)s)")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    import jax
    from rljax.data.batching import pad_token_id
    from rljax.models import dtype_from_name, load
    from rljax.data.prompts import PromptFormat
    from rljax.rollout import rollout, stop_token_ids
    from rljax.sampling import SamplingConfig

    if args.step is not None and not args.checkpoint:
        raise SystemExit("rljax generate: --step needs --checkpoint RUN_DIR")
    if args.checkpoint:
        from rljax.training.export import restore_run

        _check_checkpoint(args.checkpoint)
        run = restore_run(args.checkpoint, args.step)  # read-only; the run's own model.dtype
        model, tokenizer = run.policy.model(), run.tokenizer
        print(f"# {args.checkpoint}: checkpoint step {run.step} of {run.cfg.model.name}", file=sys.stderr)
    else:
        model, tokenizer = load(args.model, dtype=dtype_from_name(args.dtype))
    # raw prompts (no --chat) get the tokenizer's special tokens (BOS), as a base model expects;
    # --system only applies to the chat template. A prompt may fill the context less the completion.
    fmt = PromptFormat(chat=args.chat, system_prompt=(args.system or "") if args.chat else "",
                       add_special_tokens=not args.chat,
                       max_prompt_length=max(1, model.config.max_position_embeddings - args.max_new_tokens))
    config = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, stop_token_ids=stop_token_ids(tokenizer, model.config),
                            ignore_eos=args.ignore_eos, pad_token_id=pad_token_id(tokenizer))
    start = time.perf_counter()
    engine = None
    if args.engine == "paged":
        from rljax.data.prompts import encode_prompts
        from rljax.inference import Engine

        # the pool these prompts' rows can use, not a share of memory: it is allocated and zeroed up front
        longest = int(encode_prompts(tokenizer, args.prompt, fmt).attention_mask.sum(axis=-1).max())
        engine = Engine(model, max_slots=min(args.max_slots, len(args.prompt) * args.num_samples),
                        max_context=longest + args.max_new_tokens)
    roll = rollout(model, tokenizer, args.prompt, jax.random.key(args.seed), sampling=config, fmt=fmt,
                   repeats=args.num_samples, engine=engine)
    seconds = time.perf_counter() - start
    lengths = roll.completion_mask.sum(axis=-1)
    for i, completion in enumerate(roll.texts):
        print(f"--- [{i}] ({lengths[i]} tokens{', stopped' if roll.finished[i] else ''})")
        print(completion)
    print(f"# {int(lengths.sum())} new tokens in {seconds:.2f} s (compile included)", file=sys.stderr)
    return 0


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="write a Hugging Face model directory from a GGUF file or registered name",
        description="Dequantise a GGUF model (or a registered name such as smollm2-135m-instruct) and write a "
        "standard Hugging Face directory: config.json, model.safetensors and tokenizer files, loadable by "
        "transformers.AutoModelForCausalLM.from_pretrained and by rljax.",
    )
    p.add_argument("source", help="a .gguf file or a registered model name")
    p.add_argument("output", help="directory to write (created if missing)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the written weights (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="write into OUTPUT even if it is not empty")
    p.set_defaults(func=_convert)


def _convert(args) -> int:
    import json
    import os

    import numpy as np
    from safetensors.numpy import save_file

    from rljax.models import dtype_from_name
    from rljax.models.gguf_io import read_gguf
    from rljax.models.registry import resolve

    present = sorted(os.listdir(args.output)) if os.path.isdir(args.output) else []
    if present and not args.overwrite:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise SystemExit(f"rljax convert: {args.output} is not empty ({shown}); pass --overwrite to replace the "
                         "model in it, or name a new directory")
    if present:
        _clear_model_dir(args.output)
    resolved = resolve(args.source)
    if resolved.kind != "gguf":
        raise SystemExit(f"convert reads GGUF files; {args.source!r} is a {resolved.kind}")
    checkpoint = read_gguf(resolved.path)
    dtype = dtype_from_name(args.dtype)
    os.makedirs(args.output, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in checkpoint.state_dict.items()}
    save_file(tensors, os.path.join(args.output, "model.safetensors"), metadata={"format": "pt"})
    config = dict(checkpoint.hf_config, dtype=args.dtype)
    with open(os.path.join(args.output, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    checkpoint.tokenizer.save_pretrained(args.output)
    print(f"wrote {len(tensors)} tensors, config.json and tokenizer files to {args.output}")
    return 0


# What transformers and rljax read from a model directory: all of it goes before --overwrite writes a
# new model there, so no file of the old one (a shard index, a slow tokenizer's vocabulary) is read with it.
_MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin",
                "*.bin.index.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                "merges.txt", "chat_template.*", "*.model")


def _clear_model_dir(directory: str) -> None:
    """Delete the model files (``_MODEL_FILES``) in ``directory``; say which other files are left."""
    import fnmatch
    import os

    left = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and any(fnmatch.fnmatchcase(name, p) for p in _MODEL_FILES):
            os.remove(path)
        else:
            left.append(name)
    if left:
        print(f"# --overwrite: left in {directory} what is not a model file: {', '.join(left)}", file=sys.stderr)


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face directory (and a PEFT adapter for LoRA)",
        description="Write OUT/model, a Hugging Face directory (LoRA merged; a value head in "
        "value_head.safetensors) that transformers loads, and for a LoRA run OUT/adapter, a PEFT adapter for "
        "peft.PeftModel.from_pretrained(base, OUT/adapter): what a run writes to RUN_DIR at its end, from any of "
        "its checkpoints. The run directory is only read (a run still training there is not disturbed).",
    )
    p.add_argument("run_dir", help="a run directory (train.run_dir: config.yaml and checkpoints/)")
    p.add_argument("output", help="directory to write model/ (and adapter/) into (created if missing)")
    p.add_argument("--step", type=_non_negative_int, default=None, metavar="N",
                   help="checkpoint step N (default: the latest)")
    p.add_argument("--overwrite", action="store_true", help="write into OUTPUT even if it is not empty")
    p.set_defaults(func=_export)


def _export(args) -> int:
    import shutil

    from rljax.training.export import export_run, restore_run

    _check_checkpoint(args.run_dir, flag="export")
    present = sorted(os.listdir(args.output)) if os.path.isdir(args.output) else []
    if present and not args.overwrite:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise SystemExit(f"rljax export: {args.output} is not empty ({shown}); pass --overwrite to replace the "
                         "model in it, or name a new directory")
    run = restore_run(args.run_dir, args.step)
    for name in ("model", "adapter"):  # --overwrite: no file of an earlier export is read with this one
        shutil.rmtree(os.path.join(args.output, name), ignore_errors=True)
    written = export_run(run, args.output)
    print(f"# {args.run_dir} step {run.step}: " + ", ".join(f"{k} {v}" for k, v in written.items()))
    return 0


def _add_plot(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="draw a PNG of runs' main curves from their metrics.jsonl (several runs overlay)",
        description="Draw the main curves of one or more runs from RUN_DIR/metrics.jsonl into one PNG: the "
        "training reward of each function, every held-out metric (eval/*), the KL to the reference, entropy, "
        "completion length, loss and grad norm (offline runs: their loss, accuracy and held-out keys), each "
        "panel where some run logged it. Several run directories overlay, labelled by their names. Every "
        "training run writes RUN_DIR/curves.png at its end (train.plot: false turns that off).",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (train.run_dir) to draw")
    p.add_argument("--out", default=None, metavar="PNG",
                   help="the PNG to write (default with one RUN_DIR: RUN_DIR/curves.png; with several, required)")
    p.add_argument("--label", action="append", default=None, metavar="NAME",
                   help="legend label of each RUN_DIR, in order (repeat once per RUN_DIR; default: the names)")
    p.add_argument("--title", default=None, help="the figure's title")
    p.set_defaults(func=_plot)


def _plot(args) -> int:
    from rljax.plots import CURVES_FILE, plot_runs

    if args.out is None:
        if len(args.run_dirs) > 1:
            raise UserError(f"--out PNG is required with several run directories ({len(args.run_dirs)} given)")
        args.out = os.path.join(args.run_dirs[0], CURVES_FILE)
    print(plot_runs(args.run_dirs, args.out, labels=args.label, title=args.title))
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="run an RL training job from a YAML config",
        description="Train with the algorithm the config names: online grpo, ppo, rloo, reinforce_pp, reinforce; offline "
        "dpo, reward_model, records (scored records), sft (chat transcripts). Every config field is documented in "
        "rljax/run_config.py "
        "and the algorithm's module (rljax/algorithms/NAME.py); override any of them as dotted KEY=VALUE arguments, e.g. "
        "optim.learning_rate=1e-5 train.steps=10. Metrics go to RUN_DIR/metrics.jsonl, samples to "
        "RUN_DIR/samples.jsonl, checkpoints to RUN_DIR/checkpoints.",
    )
    p.add_argument("config", help="YAML file, e.g. configs/grpo_smollm2_arith.yaml")
    p.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides of the config")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest readable checkpoint in train.run_dir (parameters, optimizer, "
                   "step, data); the config may differ only in train.steps and how often to evaluate, save and log")
    p.add_argument("--resume-step", type=int, default=None, metavar="N",
                   help="with --resume: continue from exactly checkpoint step N (later steps are set aside)")
    p.add_argument("--overwrite", action="store_true",
                   help="train.run_dir holds a previous run: delete its checkpoints, logs and config and start over")
    g = p.add_argument_group(
        "several processes (jax.distributed)",
        "run the same command in every process, with its own --process-id; the mesh (mesh.*) spans the devices "
        "of all of them. On a TPU pod or under SLURM leave these out: JAX reads them from the environment.")
    g.add_argument("--coordinator-address", metavar="HOST:PORT", help="process 0's address, reachable by all")
    g.add_argument("--num-processes", type=int, metavar="N")
    g.add_argument("--process-id", type=int, metavar="I")
    g.add_argument("--heartbeat-timeout-s", type=int, default=None, metavar="S",
                   help="how long a silent process counts as alive before the others end with one line and "
                   "exit status 75 (default 60; docs/hangs-and-lost-processes.md)")
    p.set_defaults(func=_train)


def _train(args) -> int:
    from rljax.config import load_config
    from rljax.run_config import RunConfig
    from rljax.training import Preempted, trainer_for

    if args.resume and args.overwrite:
        raise SystemExit("rljax train: --resume and --overwrite exclude each other (continue the run in "
                         "train.run_dir, or delete it and start over)")
    if args.resume_step is not None and not args.resume:
        raise SystemExit("rljax train: --resume-step needs --resume")
    from rljax.distributed import HEARTBEAT_TIMEOUT_S, initialize

    heartbeat = HEARTBEAT_TIMEOUT_S if args.heartbeat_timeout_s is None else args.heartbeat_timeout_s
    if heartbeat < 1:
        raise SystemExit(f"rljax train: --heartbeat-timeout-s must be a whole number of seconds >= 1, got {heartbeat}")
    cfg = load_config(RunConfig, args.config, args.overrides)
    _keep_host_memory_for_run(cfg)
    # before any JAX computation
    initialize(args.coordinator_address, args.num_processes, args.process_id, heartbeat_timeout_s=heartbeat)
    start = time.perf_counter()
    trainer = trainer_for(cfg, resume=args.resume, resume_step=args.resume_step,  # online or offline, as the
                          overwrite=args.overwrite)                                # algorithm declares
    try:
        summary = trainer.fit()
    except Preempted as stop:
        # 128 + signal, as if the signal had ended the process: a scheduler sees a terminated job to requeue
        again = shlex.join(["rljax", "train", args.config, *args.overrides, "--resume"])
        print(f"# stopped by {signal.Signals(stop.signum).name} at step {stop.step} of {trainer.total_steps}, "
              f"checkpoint saved; continue with: {again}", file=sys.stderr, flush=True)
        return 128 + stop.signum
    import jax

    if jax.process_index() > 0:
        return 0  # process 0 reports for a multi-process run
    _print_eval(summary)
    steps = trainer.total_steps
    print(f"# {cfg.algorithm.name}: trained {steps} steps in {time.perf_counter() - start:.0f} s; "
          f"run dir {cfg.train.run_dir}")
    if summary.get("model_dir"):
        print(f"# model written to {summary['model_dir']}")
    if summary.get("adapter_dir"):
        print(f"# PEFT adapter written to {summary['adapter_dir']}")
    return 0


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a base model or a trained checkpoint on the config's held-out prompts",
        description="Online configs: sample (greedy by default: sampling.eval_temperature) on the held-out "
        "split of the config's task and print the mean of each reward and the mean completion length. "
        "Offline configs (dpo, reward_model, offline): the training objective and its metrics (preference "
        "accuracy and margin, log-likelihood of high- vs low-score responses) on the held-out split.",
    )
    p.add_argument("config", help="YAML config naming the model, task and rewards")
    p.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides of the config")
    p.add_argument("--checkpoint", default=None,
                   help="a run directory (train.run_dir) whose latest checkpoint to evaluate, sampled with the run's "
                   "sampling settings (its config.yaml; sampling.* overrides still apply); default: the base model")
    p.set_defaults(func=_eval)


def _eval(args) -> int:
    from rljax.config import load_config
    from rljax.run_config import RunConfig
    from rljax.training import trainer_for

    overrides = list(args.overrides)
    if args.checkpoint:
        _check_checkpoint(args.checkpoint)
        overrides.append(f"train.run_dir={args.checkpoint}")
    cfg = load_config(RunConfig, args.config, overrides)
    if args.checkpoint and cfg.is_online:
        cfg = _run_sampling(cfg, args.checkpoint, args.overrides)
    _keep_host_memory_for_run(cfg)
    extra = {} if cfg.is_online else {"evaluate_only": True}
    trainer = trainer_for(cfg, resume=bool(args.checkpoint), write_config=False, **extra)
    results = trainer.evaluate()
    label = f"checkpoint {args.checkpoint} (step {trainer.step})" if args.checkpoint else f"base model {cfg.model.name}"
    if not cfg.is_online:
        print(f"# {label}, {cfg.algorithm.name}, {len(trainer.eval_set)} held-out rows")
    else:
        print(f"# {label}, {len(trainer.eval_examples)} held-out prompts")
    for key, value in results.items():
        print(f"{key:28s} {value:.4f}")
    return 0


def _run_sampling(cfg, run_dir: str, overrides):
    """``eval --checkpoint RUN_DIR`` samples as the run was evaluated while it trained: ``cfg`` with the
    run's ``sampling`` section (``RUN_DIR/config.yaml``), then the command line's ``sampling.*``
    overrides; one stderr line says which settings are used and where they differ from CONFIG's."""
    import dataclasses

    from rljax.config import load_config, with_overrides
    from rljax.run_config import RunConfig

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        print(f"# sampling: the config's ({run_dir} has no config.yaml)", file=sys.stderr)
        return cfg
    run_sampling = load_config(RunConfig, path, [f"train.run_dir={run_dir}"]).sampling
    given = [o for o in overrides if o.split("=", 1)[0].strip().startswith("sampling.")]
    chosen = with_overrides(dataclasses.replace(cfg, sampling=run_sampling), given)
    mine, used = dataclasses.asdict(cfg.sampling), dataclasses.asdict(chosen.sampling)
    differ = [f"{k}={used[k]!r} (config: {mine[k]!r})" for k in used if used[k] != mine.get(k)]
    print(f"# sampling: the run's ({path})" + (", overridden by the command line" if given else "")
          + (f"; differs from the config's in {', '.join(differ)}" if differ else ""), file=sys.stderr)
    return chosen


def _check_checkpoint(run_dir: str, flag: str = "--checkpoint") -> None:
    """``eval --checkpoint RUN_DIR`` reads a run: the directory must exist and hold a checkpoint
    (checked read-only, so a typo creates nothing)."""
    from rljax.checkpoint import Checkpointer

    if not os.path.isdir(run_dir):
        raise MissingFileError(f"{flag} {run_dir}: no such run directory")
    checkpoints = os.path.join(run_dir, "checkpoints")
    latest = None
    if os.path.isdir(checkpoints):
        with Checkpointer(checkpoints, save_every=0, read_only=True) as ckpt:
            latest = ckpt.latest_step()
    if latest is None:
        raise MissingFileError(f"{flag} {run_dir}: no checkpoint in {checkpoints}")


def _add_pairs(sub) -> None:
    from rljax.tools.pairs import DESCRIPTION, add_arguments

    p = sub.add_parser("pairs", help="build preference pairs: best vs worst of N samples under the config's rewards",
                       description=DESCRIPTION + " Train on them with algorithm.name=dpo 'data.task=\"\"' "
                       "data.path=OUT.jsonl.")
    add_arguments(p)
    p.set_defaults(func=_pairs)


def _pairs(args) -> int:
    from rljax.tools.pairs import run

    return run(args)


# --- rljax sweep / rljax compare (rljax/tools/sweep.py, rljax/tools/compare.py) ---

def _add_sweep(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help="train every combination of a grid of config values x seeds into one directory (resumable)",
        description="Run `rljax train CONFIG` once per combination of the --grid values and --seeds (train.seed), "
        "each in a subprocess, into SWEEP_DIR/<setting>__seed<N>, with SWEEP_DIR/sweep.json listing every run "
        "and its status. Re-running the same command skips finished runs (summary.json at train.steps), resumes "
        "interrupted ones (a checkpoint, not finished) and starts missing or failed ones. Ends with status 1 "
        "if any run failed. Then: rljax compare SWEEP_DIR.",
    )
    p.add_argument("config", help="YAML file, e.g. configs/grpo_smollm2_arith.yaml")
    p.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides shared by every run")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a config key and its values; repeat for more keys (every combination runs)")
    p.add_argument("--seeds", default="0", help="comma-separated train.seed values (default: %(default)s)")
    p.add_argument("--out", default=None, metavar="SWEEP_DIR",
                   help="the sweep directory (default: runs/sweeps/<config file stem>)")
    p.add_argument("--overwrite", action="store_true",
                   help="SWEEP_DIR holds another sweep (config, grid or overrides differ): delete its runs first")
    p.set_defaults(func=_sweep)


def _sweep(args) -> int:
    from rljax.tools.sweep import parse_grid, parse_seeds, plan_sweep, run_sweep, sweep_failures

    plan = plan_sweep(args.config, grid=parse_grid(args.grid), seeds=parse_seeds(args.seeds),
                      overrides=args.overrides, out=args.out)
    print(f"# sweep: {len(plan.runs)} runs into {plan.out}", flush=True)
    records = run_sweep(plan, overwrite=args.overwrite, echo=lambda line: print(line, flush=True))
    failed = sweep_failures(records)
    if failed:
        print(f"# {len(failed)} of {len(records)} runs not finished: "
              + ", ".join(f"{r['run_dir']} ({r['status']})" for r in failed), file=sys.stderr)
        return 130 if any(r["status"] == "interrupted" for r in failed) else 1
    print(f"# all {len(records)} runs finished; compare with: rljax compare {plan.out}")
    return 0


def _add_compare(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="a table of held-out metrics per setting: mean ± std over seeds, paired differences with a CI",
        description="Read the runs of a sweep directory (or run directories) and write compare.md and "
        "compare.json: per setting and eval/* metric, the final and best values (mean ± std over seeds) and "
        "the final value's paired difference against a baseline setting with a 95% bootstrap interval over seeds.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="a sweep directory, or run directories")
    p.add_argument("--baseline", default=None, metavar="SETTING",
                   help="the setting to difference against (default: the first grid combination / first run)")
    p.add_argument("--metric", action="append", default=None, metavar="KEY",
                   help="an eval/... key to show; repeat for more (default: every eval/ key)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where to write compare.md and compare.json (default: the sweep directory, or the "
                   "first run directory's parent)")
    p.set_defaults(func=_compare)


def _compare(args) -> int:
    from rljax.tools.compare import compare, write_compare

    result = compare(args.paths, baseline=args.baseline, metrics=args.metric)
    out = args.out or (args.paths[0] if len(args.paths) == 1 and os.path.isfile(os.path.join(args.paths[0], "sweep.json"))
                       else os.path.dirname(os.path.abspath(args.paths[0])))
    md, js, png = write_compare(result, out)
    print(result["markdown"])
    print(f"# wrote {md}, {js} and {png}", file=sys.stderr)
    return 0


def _print_eval(summary: dict) -> None:
    before, after = summary.get("before", {}), summary.get("after", {})
    print(f"{'metric':28s} {'before':>8s} {'after':>8s}")
    for key in after:
        b = before.get(key)
        print(f"{key:28s} {'' if b is None else f'{b:8.4f}':>8s} {after[key]:8.4f}")


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="compile a run for an accelerator topology on this machine: memory, FLOPs, collectives, time",
        description="Ahead-of-time compile the run's update step, scoring pass and sampler for --target from "
        "shapes alone (the model's config.json; no weights), and print per chip the bytes of arguments, outputs "
        "and temporaries against the chip's memory, FLOPs (XLA's and analytic), the collectives, and a roofline "
        "step time and MFU (rljax/tools/plan/). Exit status 1 when the run does not fit, with what to change. TPU "
        "targets need the tpu extra (pip install -e '.[tpu]'), GPU targets the cuda extra (pip install -e "
        "'.[cuda]'); neither needs the accelerator.",
    )
    p.add_argument("config", help="YAML file, e.g. configs/accel/grpo_qwen2.5_1.5b_v5e16.yaml")
    p.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides of the config (e.g. mesh.fsdp=8)")
    p.add_argument("--target", required=True, metavar="NAME",
                   help="v5e-4 ... v5e-256, v6e-N, v4-8 ..., v5p-8 ...; h100-N, h200-N, a100-N (N GPUs: 1, 2, 4, 8, "
                   "or nodes of 8: 16, 32, 64); cpu (this process's CPU devices) or cpu-N (N simulated CPU devices)")
    p.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                   help="the memory per chip to fit in (default: the target chip's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON to PATH")
    p.set_defaults(func=_plan)


def _plan(args) -> int:
    import re
    import subprocess

    cpu = re.fullmatch(r"cpu-(\d+)", args.target)
    initialized = "jax" in sys.modules and sys.modules["jax"]._src.xla_bridge.backends_are_initialized()
    if cpu:
        flag = f"--xla_force_host_platform_device_count={cpu.group(1)}"
        if initialized:
            import jax

            if len(jax.devices("cpu")) != int(cpu.group(1)):
                # the CPU device count is fixed when JAX starts: plan in a fresh process
                env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
                           JAX_PLATFORMS="cpu")
                argv = [sys.executable, "-m", "rljax", "plan", args.config, *args.overrides, "--target",
                        args.target] + ([] if args.memory_gib is None else ["--memory-gib", str(args.memory_gib)]) \
                    + ([] if args.json is None else ["--json", args.json])
                return subprocess.run(argv, env=env).returncode
        else:
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
    elif not initialized:
        # TPU targets compile through libtpu's topology API; this process itself computes on the CPU
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # libtpu: no TPU host here, no warnings
    from rljax.config import load_config
    from rljax.tools.plan import format_report, plan_run
    from rljax.run_config import RunConfig

    if args.memory_gib is not None and not args.memory_gib > 0:
        raise SystemExit("rljax plan: --memory-gib must be > 0")
    cfg = load_config(RunConfig, args.config, args.overrides)
    start = time.perf_counter()
    report = plan_run(cfg, args.target,
                      memory_bytes=None if args.memory_gib is None else int(args.memory_gib * 2 ** 30))
    print(format_report(report))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    print(f"# compiled {len(report.programs)} programs in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0 if report.fits else 1


# --- rljax serve (rljax/serve/) ---

def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (chat and text completions, tools, streaming)",
        description="Serve a model (--model), a run's checkpoint (--checkpoint) or a config's model (CONFIG) "
        "with rljax's rollout engine at /v1/chat/completions, /v1/completions and /v1/models. Every choice "
        "carries its sampled token_ids and the response its prompt_token_ids. Binds 127.0.0.1 by default; "
        "another host needs --api-key.",
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config whose model (and sampling.* engine settings) "
                   "to serve, instead of --model / --checkpoint")
    p.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides of CONFIG")
    p.add_argument("--model", default=None,
                   help="registered model name, .gguf file or Hugging Face directory (default: smollm2-135m-instruct)")
    p.add_argument("--checkpoint", default=None, metavar="RUN_DIR",
                   help="serve a run directory's checkpoint (its latest, or --step)")
    p.add_argument("--step", type=_non_negative_int, default=None, metavar="N",
                   help="with --checkpoint: checkpoint step N (default: the latest)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=_non_negative_int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (needed for any host but 127.0.0.1 / localhost)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send (default: the --model value, the run directory or the config's "
                        "model name)")
    p.add_argument("--max-slots", type=_positive_int, default=None,
                   help="sequences decoded together (default: sampling.max_slots of CONFIG, else 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="with --model: compute and parameter dtype (default: %(default)s)")
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    from rljax.serve import Server, check_bind

    sources = [bool(args.model), bool(args.checkpoint), bool(args.config)]
    if sum(sources) > 1:
        raise UserError("give one of --model, --checkpoint RUN_DIR or CONFIG")
    if args.step is not None and not args.checkpoint:
        raise UserError("--step needs --checkpoint RUN_DIR")
    if args.overrides and not args.config:
        raise UserError(f"overrides ({' '.join(args.overrides)}) need a CONFIG")
    check_bind(args.host, args.api_key)  # before loading anything
    import uvicorn

    from rljax.inference import Engine
    from rljax.models import dtype_from_name, load

    engine_options = {"max_slots": args.max_slots or 64}
    if args.checkpoint:
        from rljax.training.export import restore_run

        _check_checkpoint(args.checkpoint)
        run = restore_run(args.checkpoint, args.step)
        model, tokenizer = run.policy.model(), run.tokenizer
        name = args.served_model_name or os.path.basename(os.path.normpath(args.checkpoint))
        print(f"# {args.checkpoint}: checkpoint step {run.step} of {run.cfg.model.name}", file=sys.stderr)
    elif args.config:
        from rljax.config import load_config
        from rljax.run_config import RunConfig

        cfg = load_config(RunConfig, args.config, args.overrides)
        model, tokenizer = load(cfg.model.name, dtype=dtype_from_name(cfg.model.dtype))
        name = args.served_model_name or cfg.model.name
        engine_options = {"max_slots": args.max_slots or cfg.sampling.max_slots, "page_size": cfg.sampling.page_size,
                          "num_pages": cfg.sampling.num_pages}
    else:
        model_name = args.model or "smollm2-135m-instruct"
        model, tokenizer = load(model_name, dtype=dtype_from_name(args.dtype))
        name = args.served_model_name or model_name
    server = Server(Engine(model, **engine_options), tokenizer, model_id=name, api_key=args.api_key)
    print(f"# serving {name!r} at http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level="info")
    finally:
        server.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rljax", description="rljax: reinforcement-learning fine-tuning of language models in JAX.",
        epilog="A mistake in the input (a config key or value, a data file or row, a missing file) ends with one "
        "line, 'rljax COMMAND: error: MESSAGE', and exit status 2; set RLJAX_TRACEBACK=1 to see its traceback "
        "too. Other failures print their traceback.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_convert(sub)
    _add_export(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_pairs(sub)
    _add_plot(sub)
    _add_sweep(sub)
    _add_compare(sub)
    _add_plan(sub)
    _add_serve(sub)
    return parser


# Commands that run JAX for long enough to gain from keeping freed host memory (rljax/host_memory.py).
_KEEP_HOST_MEMORY = ("generate", "export", "pairs", "serve")  # train and eval: _keep_host_memory_for_run


def _keep_host_memory_for_run(cfg) -> None:
    """``rljax.host_memory.keep_host_memory_for_run`` (its rule: online runs only), before any JAX work."""
    from rljax.host_memory import keep_host_memory_for_run

    keep_host_memory_for_run(cfg.is_online)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns its exit status.

    A :class:`rljax.errors.UserError` (bad config, data or flag) is printed as the last line,
    ``rljax COMMAND: error: MESSAGE``, and gives status 2, like argparse's usage errors; with
    ``RLJAX_TRACEBACK=1`` it propagates with its traceback. Other exceptions propagate.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found": rljax needs none
    _quiet_teardown()
    parser = build_parser()
    # KEY=VALUE overrides may also follow the options (`rljax pairs CFG OUT --num-samples 4 train.seed=3`):
    # argparse fills `overrides` at the first positionals and leaves later ones over
    args, rest = parser.parse_known_args(argv)
    stray = [r for r in rest if r.startswith("-") or "=" not in r]
    if stray or (rest and getattr(args, "overrides", None) is None):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    from rljax.compile_cache import use_compilation_cache

    if args.command != "plan":  # plan compiles for other targets, ahead of time: a GPU plugin without a GPU
        use_compilation_cache()  # cannot load its entries back; else a rerun loads its compiled programs
    if args.command in _KEEP_HOST_MEMORY:
        from rljax.host_memory import keep_host_memory

        keep_host_memory()  # process-wide, so here at the entry point and before any JAX work
    try:
        return args.func(args)
    except UserError as err:
        if os.environ.get("RLJAX_TRACEBACK", "") not in ("", "0"):
            raise
        sys.stdout.flush()
        print(f"rljax {args.command}: error: {err}", file=sys.stderr)
        return 2


def _quiet_teardown() -> None:
    """Drop exceptions reported while the interpreter shuts down, so the error that ended a command
    stays the last line printed. After a failed checkpoint write (a full disk) orbax leaves writer
    coroutines behind; Python finalises them at exit, when imports no longer work, and prints
    "Exception ignored in ... sys.meta_path is None" once per coroutine. Reports made while the
    process still runs are kept."""

    def hook(unraisable, _finalizing=sys.is_finalizing, _report=sys.unraisablehook):
        if not _finalizing():
            _report(unraisable)

    if getattr(sys.unraisablehook, "__qualname__", "") != hook.__qualname__:  # once per process
        sys.unraisablehook = hook


if __name__ == "__main__":
    sys.exit(main())
