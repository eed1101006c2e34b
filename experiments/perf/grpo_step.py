"""One GRPO step: rljax's online trainer against Hugging Face TRL's ``GRPOTrainer``, same workload, one run.

Question: how long does one GRPO step (sample, score against the reference, update) take in rljax,
next to TRL's GRPOTrainer on the same machine, and where does each side's time go?

Workload (the issue's wording): SmolLM2-135M-Instruct (the registered GGUF, dequantised to float32),
full fine-tuning, 4 prompts x 4 completions per step, exactly 64 new tokens per completion (EOS
ignored on both sides), temperature 1, no top-k/top-p, KL coefficient 0.04 (so a reference forward
runs), one pass and one optimizer step per batch (``num_iterations=1``, no mini-batches, no
gradient accumulation), AdamW at lr 1e-6 after global-norm clipping at 1.0. The prompts are the same
on both sides and in the same order: two-digit additions from ``rljax.data.tasks`` ("What is
12+35?") through the model's ChatML template (which adds its default system message), drawn by
rljax's seeded ``PromptIterator``; TRL gets them as a dataset in that order with
``shuffle_dataset=False``. The reward is a trivial one on both sides (completion length in
characters / 256), so the groups have non-zero advantages and the whole loss runs.

- rljax: ``rljax.training.OnlineTrainer(RunConfig)`` built in code (``lora_rank null``,
  ``algorithm.kl_coef 0.04``, group 4 x 4 prompts, ``sampling.max_new_tokens 64``,
  ``sampling.ignore_eos true``); each step is ``OnlineTrainer.step_once()``, whose metrics split it
  into ``time/sample_s`` (sampling + rewards), ``time/ref_and_values_s`` (the reference forward and
  the advantages) and ``time/update_s`` (the jitted forward/backward and AdamW). The "old" log-probs
  are the sampler's, so no extra forward runs for them. ``--num-iterations`` / ``--mini-batches``
  (rljax side only; default 1 and 1, the workload above) time several updates per step.
  ``--sampling-engine`` picks rljax's sampler: ``paged`` (the rollout engine, ``sampling.engine``'s
  default) or ``static`` (the static-batch sampler).
- TRL: ``rljax convert`` writes the same float32 weights and tokenizer as a Hugging Face directory
  (cached); ``GRPOTrainer(model=DIR, reward_funcs=[length], args=GRPOConfig(...))`` with the settings
  printed at the start of its run (per-device batch 16, 4 generations, 64 completion tokens with
  ``generation_kwargs={"min_new_tokens": 64}`` so EOS cannot end a row, beta 0.04, ``loss_type="grpo"``
  (rljax's default sequence-mean of token-means), fp32, ``use_cpu``, ``gradient_checkpointing=False``
  (TRL's default is True, which recomputes activations; rljax does not, so off is the like-for-like
  setting; ``--trl-gradient-checkpointing`` turns it on). TRL also skips the old log-prob forward when
  generation and optimisation are aligned, as here. Each step is timed by a ``TrainerCallback``
  (``on_step_begin`` .. ``on_step_end``); ``_generate`` (sampling) and
  ``_generate_and_score_completions`` (sampling, reference forward, rewards, advantages) are timed by a
  subclass, so the split is sampling / the rest of scoring / update = the remainder of the step.
- Both: ``torch.set_num_threads(os.cpu_count())``, the thread count XLA's CPU backend uses, and
  ``OMP_WAIT_POLICY=PASSIVE`` (see ``sampler.py``: spinning OpenMP workers on a shared 2-core machine
  made torch 5-10x slower). The first step of each side is a warm-up (rljax: the compiles) and is not
  counted; the median of the rest is reported.
- Both: the glibc malloc settings of ``rljax/host_memory.py`` (freed memory stays in the process, so
  large buffers are not page-faulted in again on every call), applied first thing in each child as
  ``rljax train`` does; the TRL child imports only ``rljax.host_memory`` (no JAX) and skips them with
  ``--trl-default-malloc``.
- Each side runs in its own child process, one after the other, so the peak RSS of each is its own
  (rljax: one policy copy + a reference copy + AdamW state + XLA buffers; TRL: policy, reference
  model, AdamW, torch autograd buffers).
- FLOPs (useful work, counted on the real, unpadded tokens; padding to rljax's shape buckets is work
  done but not counted): sampling = prefill of each prompt + 63 one-token decode steps (blocks, the
  tied lm_head at each sampled position, attention over the context); a scoring forward = every
  prompt + completion token through the blocks, causal attention, the lm_head at the 64 completion
  positions; the update = 3 x that forward (backward ~ 2 x forward). Blocks cost 2 x their matmul
  parameters per token; attention 4 x heads x head_dim per key per layer. These are the workload's
  FLOPs, what TRL runs: rljax runs fewer, since a group's 4 rows share their prompt and its passes
  run the prompt once (the sampler's prefill: ``generate(prompt_group=)``; the reference and the
  update: ``RolloutBatch.prompt_group``, rljax.logprobs.completion_states, 25% fewer FLOPs in those
  passes here), so "% of peak" of the reference and the update counts the work avoided as done.
- Matmul peak: jitted float32 ``x @ w`` (``_common.matmul_gflops``, best of several bursts) at the
  decode shape 16x576x1536, the training shape 1024x576x1536 and 2048^3, measured in the rljax child
  before and after its steps; "% of peak" divides by the best of all of them. The TRL child measures
  torch's 1024x576x1536 and 2048^3 matmuls too, to show how loaded the machine was during its run.

Run (from the repository root; needs the `bench` extra: torch, accelerate, trl):

    python experiments/perf/grpo_step.py                         # both sides, 1 warm-up + 5 timed steps
    python experiments/perf/grpo_step.py --json runs/perf/grpo_step.json
    python experiments/perf/grpo_step.py --side rljax --steps 3
    python experiments/perf/grpo_step.py --smoke                 # rljax only, 8 tokens, 1 timed step
    python experiments/perf/grpo_step.py --side trl --trl-default-malloc   # TRL as it runs by default

Where JAX sees a GPU, the rljax side also runs there (its own child, float32) and the table gets a
row with its step time and MFU against a float32 matmul measured on that GPU in the same child.
This is a benchmark, not a test: on a shared CPU the numbers move by tens of percent between runs
and the two sides run one after the other, not interleaved; the load average is printed beside them.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # must precede the first torch import

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_NAME = "smollm2-135m-instruct"

# The workload, shared by both sides.
GROUP_SIZE = 4
PROMPTS_PER_STEP = 4
NEW_TOKENS = 64
KL_COEF = 0.04
TEMPERATURE = 1.0
LEARNING_RATE = 1e-6
GRAD_CLIP = 1.0
SEED = 0
TRAIN_SIZE = 256  # the addition prompts the iterator draws from
REWARD_NORMALIZE = 256.0  # reward = characters of the completion / 256

RLJAX_YAML = """
model: {{name: {model}, dtype: float32, lora_rank: null}}
data: {{task: addition, task_options: {{digits: 2}}, train_size: {train_size}, eval_size: 16, max_prompt_length: 128}}
sampling: {{max_new_tokens: {new_tokens}, temperature: {temperature}, top_k: null, top_p: 1.0, ignore_eos: true,
           engine: {engine}}}
algorithm: {{name: grpo, group_size: {group}, prompts_per_step: {prompts}, num_iterations: {num_iterations},
            mini_batches: {mini_batches}, micro_batch_size: null, kl_coef: {kl}, kl_estimator: k3,
            reduction: seq_mean_token_mean}}
optim: {{learning_rate: {lr}, grad_clip: {clip}, weight_decay: 0.0}}
train: {{steps: {steps}, seed: {seed}, run_dir: {run_dir}, progress: false}}
rewards: {{length: {{weight: 1.0, unit: chars, normalize: {norm}}}}}
"""


def _peak_rss_mib() -> float:
    # The same as _common.peak_rss_mib, which the TRL child cannot import without also importing JAX
    # (~170 MiB of RSS that TRL does not need).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def _load_average():
    return os.getloadavg() if hasattr(os, "getloadavg") else None


# ----------------------------------------------------------------------------- prompts and FLOPs
def step_examples(steps: int) -> list[list[dict]]:
    """The examples of each step, in the order rljax's ``OnlineTrainer`` draws them (no JAX needed)."""
    from rljax.data.batching import PromptIterator
    from rljax.data.tasks import make_task

    train = make_task("addition", split="train", size=TRAIN_SIZE, seed=SEED, digits=2)
    iterator = PromptIterator(train, PROMPTS_PER_STEP, seed=SEED)
    return [[train[i] for i in iterator.next_indices()] for _ in range(steps)]


def dims_from_hf(hf: dict) -> dict:
    heads = hf["num_attention_heads"]
    return dict(L=hf["num_hidden_layers"], D=hf["hidden_size"], H=heads, KVH=hf.get("num_key_value_heads", heads),
                hd=hf.get("head_dim") or hf["hidden_size"] // heads, F=hf["intermediate_size"], V=hf["vocab_size"])


def step_flops(dims: dict, prompt_lengths, completion_lengths) -> dict[str, float]:
    """Useful FLOPs of one GRPO step over rows of real prompt / completion lengths.

    sample: prefill + (n - 1) decode steps; score: one forward of prompt + completion with logits at
    the n completion positions; update: 3 x score (forward + backward).
    """
    L, D, H, KVH, hd, F, V = (dims[k] for k in ("L", "D", "H", "KVH", "hd", "F", "V"))
    blocks = 2 * L * (D * H * hd + 2 * D * KVH * hd + H * hd * D + 3 * D * F)
    lm_head = 2 * D * V
    attn_per_key = 4 * L * H * hd
    sample = score = 0.0
    for p, n in zip(map(int, prompt_lengths), map(int, completion_lengths)):
        sample += p * blocks + lm_head + attn_per_key * p * (p + 1) / 2
        for j in range(1, n):
            sample += blocks + lm_head + attn_per_key * (p + j)
        t = p + n
        score += t * blocks + attn_per_key * t * (t + 1) / 2 + n * lm_head
    return {"sample": sample, "ref": score, "update": 3.0 * score, "step": sample + 4.0 * score}


def _gflops(flops: dict, seconds: dict) -> dict:
    return {k: flops[k] / seconds[k] / 1e9 if seconds.get(k) else None for k in ("sample", "ref", "update", "step")}


# ----------------------------------------------------------------------------- rljax side
def run_rljax(args) -> dict:
    from rljax.host_memory import keep_host_memory

    keep_host_memory()  # before any JAX work, as `rljax train` does (rljax/host_memory.py)
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, HERE)
    from _common import environment, matmul_gflops, median, peak_rss_mib, thread_count

    from rljax import sampling
    from rljax.config import from_yaml
    from rljax.run_config import RunConfig
    from rljax.training import OnlineTrainer, online

    device = jax.devices()[0]
    platform = device.platform
    print(f"# rljax side on {device} ({platform}), cpu threads {thread_count()}, load average {_load_average()}",
          flush=True)

    def peaks(label):
        shapes = [(16, 576, 1536), (1024, 576, 1536), (2048, 2048, 2048)]
        if platform != "cpu":
            shapes.append((8192, 8192, 8192))
        out = {f"{r}x{k}x{n}": matmul_gflops(r, k, n, device=device, min_seconds=0.05 if args.smoke else 0.5,
                                             trials=3 if r * k * n >= 2048**3 else 5) for r, k, n in shapes}
        print(f"  matmul GFLOP/s ({label}): " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
        return out

    peaks_before = peaks("before")

    run_dir = tempfile.mkdtemp(prefix="rljax_grpo_step_")
    yaml_text = RLJAX_YAML.format(model=MODEL_NAME, train_size=TRAIN_SIZE, new_tokens=args.new_tokens,
                                  temperature=TEMPERATURE, group=GROUP_SIZE, prompts=PROMPTS_PER_STEP, kl=KL_COEF,
                                  lr=LEARNING_RATE, clip=GRAD_CLIP, steps=args.steps + 1, seed=SEED, run_dir=run_dir,
                                  norm=REWARD_NORMALIZE, num_iterations=args.num_iterations,
                                  mini_batches=args.mini_batches, engine=args.sampling_engine)
    cfg = from_yaml(RunConfig, yaml_text)
    t0 = time.perf_counter()
    trainer = OnlineTrainer(cfg, write_config=False)
    load_s = time.perf_counter() - t0
    print(f"  trainer built (model load, reference copy, AdamW state): {load_s:.1f}s", flush=True)

    mc = trainer.run.model_config
    dims = dict(L=mc.num_layers, D=mc.hidden_size, H=mc.num_heads, KVH=mc.num_kv_heads, hd=mc.head_dim,
                F=mc.intermediate_size, V=mc.vocab_size)
    steps = []
    for i in range(args.steps + 1):
        start = time.perf_counter()
        metrics = trainer.step_once()  # advances trainer.step
        wall = time.perf_counter() - start
        roll = trainer.last_rollouts
        prompt_lengths = roll.prompt_mask.sum(-1)
        completion_lengths = roll.completion_mask.sum(-1)
        if not (completion_lengths == args.new_tokens).all():
            raise RuntimeError(f"rljax step {i}: completion lengths {completion_lengths.tolist()}, "
                               f"expected all {args.new_tokens}")
        row = {"step": i, "warmup": i == 0, "wall_s": wall, "sample_s": metrics["time/sample_s"],
               "ref_s": metrics["time/ref_and_values_s"], "update_s": metrics["time/update_s"],
               "loss": metrics["loss"], "kl": metrics.get("kl/mean"), "grad_norm": metrics["grad_norm"],
               "prompt_width": int(roll.prompt_ids.shape[1]), "prompt_lengths": prompt_lengths.tolist(),
               "flops": step_flops(dims, prompt_lengths, completion_lengths), "load_average": _load_average()}
        steps.append(row)
        print(f"  step {i}{' (warm-up)' if i == 0 else ''}: {wall:.2f}s = sample {row['sample_s']:.2f} + "
              f"ref {row['ref_s']:.2f} + update {row['update_s']:.2f}; prompt width {row['prompt_width']} "
              f"(real {int(prompt_lengths.min())}-{int(prompt_lengths.max())}), loss {row['loss']:.4g}, "
              f"load {row['load_average'][0] if row['load_average'] else 'n/a'}", flush=True)

    peaks_after = peaks("after")
    timed = [s for s in steps if not s["warmup"]] or steps
    seconds = {"step": median([s["wall_s"] for s in timed]), "sample": median([s["sample_s"] for s in timed]),
               "ref": median([s["ref_s"] for s in timed]), "update": median([s["update_s"] for s in timed])}
    flops = {k: float(np.mean([s["flops"][k] for s in timed])) for k in ("sample", "ref", "update", "step")}
    all_peaks = {k: max(peaks_before[k], peaks_after[k]) for k in peaks_before}
    result = {
        "side": "rljax", "device": platform, "device_name": str(device), "steps": steps, "seconds": seconds,
        "flops": flops, "gflops": _gflops(flops, seconds), "matmul_gflops": all_peaks,
        "matmul_gflops_before": peaks_before, "matmul_gflops_after": peaks_after,
        "matmul_peak_gflops": max(all_peaks.values()), "load_s": load_s,
        "compiles": {"sampler_traces": sampling.trace_count(), "update": online.update_epochs._cache_size(),
                     "score_logprobs": online.score_logprobs._cache_size()},
        "peak_rss_mib": peak_rss_mib(), "environment": environment(), "malloc_settings": keep_host_memory(),
    }
    if platform != "cpu":
        stats = device.memory_stats() or {}
        result["device_peak_mib"] = stats.get("peak_bytes_in_use", 0) / 2**20
    return result


# ----------------------------------------------------------------------------- TRL side
def trl_settings(args, output_dir: str) -> dict:
    return dict(
        output_dir=output_dir, per_device_train_batch_size=GROUP_SIZE * PROMPTS_PER_STEP,
        num_generations=GROUP_SIZE, max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens}, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=KL_COEF, num_iterations=1, gradient_accumulation_steps=1, loss_type="grpo", scale_rewards="group",
        epsilon=0.2, learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=GRAD_CLIP, max_steps=args.steps + 1,
        use_vllm=False, bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=args.trl_gradient_checkpointing,
        shuffle_dataset=False, seed=SEED, report_to=[], logging_steps=1, save_strategy="no",
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"},
    )


def run_trl(args) -> dict:
    # The same glibc malloc settings the rljax child applies (rljax/host_memory.py; JAX-free), so both
    # sides run on the same allocator unless --trl-default-malloc: torch's large CPU tensors page-fault
    # through fresh mmaps as XLA's buffers did.
    from rljax.host_memory import keep_host_memory

    malloc_kept = False if args.trl_default_malloc else keep_host_memory()
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    print(f"# TRL side: torch {torch.__version__}, threads {threads}, rljax's malloc settings {malloc_kept}, "
          f"load average {_load_average()}", flush=True)

    def torch_matmul_gflops(rows, k, n, trials=3, min_seconds=0.5):
        x, w = torch.randn(rows, k), torch.randn(k, n)
        x @ w
        best = 0.0
        for _ in range(trials):
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < min_seconds or calls == 0:
                x @ w
                calls += 1
            best = max(best, 2.0 * rows * k * n * calls / (time.perf_counter() - start) / 1e9)
        return best

    def torch_peaks(label):
        out = {f"{r}x{k}x{n}": torch_matmul_gflops(r, k, n) for r, k, n in [(1024, 576, 1536), (2048, 2048, 2048)]}
        print(f"  torch matmul GFLOP/s ({label}): " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
        return out

    peaks_before = torch_peaks("before")
    with open(os.path.join(args.hf_dir, "config.json")) as f:
        dims = dims_from_hf(json.load(f))

    examples = [ex for step in step_examples(args.steps + 1) for ex in step]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": ex["prompt"]}]} for ex in examples])

    def length_reward(completions, **kwargs):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [len(t) / REWARD_NORMALIZE for t in texts]

    class TimedGRPOTrainer(GRPOTrainer):
        """Records the seconds of sampling and of the whole scoring (sampling + ref forward + rewards)."""

        timings: list[dict] = []

        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            self._sample_s = time.perf_counter() - start
            return out

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.timings.append({"sample_s": self._sample_s, "score_s": time.perf_counter() - start,
                                 "prompt_lengths": out["prompt_mask"].sum(-1).tolist(),
                                 "completion_lengths": out["completion_mask"].sum(-1).tolist()})
            return out

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.logs, self._start = [], [], None

        def on_step_begin(self, args_, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._start)
            i = len(self.seconds) - 1
            t = TimedGRPOTrainer.timings[i] if i < len(TimedGRPOTrainer.timings) else {}
            print(f"  step {i}{' (warm-up)' if i == 0 else ''}: {self.seconds[-1]:.2f}s "
                  f"(sample {t.get('sample_s', float('nan')):.2f}, scoring {t.get('score_s', float('nan')):.2f}), "
                  f"load {_load_average()[0] if _load_average() else 'n/a'}", flush=True)

        def on_log(self, args_, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    output_dir = tempfile.mkdtemp(prefix="trl_grpo_step_")
    settings = trl_settings(args, output_dir)
    print("  GRPOConfig(" + ", ".join(f"{k}={v!r}" for k, v in settings.items() if k != "output_dir") + ")",
          flush=True)
    timer = StepTimer()
    t0 = time.perf_counter()
    trainer = TimedGRPOTrainer(model=args.hf_dir, reward_funcs=[length_reward], args=GRPOConfig(**settings),
                               train_dataset=dataset, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # its per-step log dicts; the losses are kept in the JSON
    load_s = time.perf_counter() - t0
    print(f"  GRPOTrainer built (policy + reference from {args.hf_dir}): {load_s:.1f}s", flush=True)
    trainer.train()
    peaks_after = torch_peaks("after")

    if len(timer.seconds) != len(TimedGRPOTrainer.timings):
        raise RuntimeError(f"{len(timer.seconds)} timed steps but {len(TimedGRPOTrainer.timings)} generations")
    steps = []
    for i, (wall, t) in enumerate(zip(timer.seconds, TimedGRPOTrainer.timings)):
        if not all(n == args.new_tokens for n in t["completion_lengths"]):
            raise RuntimeError(f"TRL step {i}: completion lengths {t['completion_lengths']}, "
                               f"expected all {args.new_tokens}")
        steps.append({"step": i, "warmup": i == 0, "wall_s": wall, "sample_s": t["sample_s"],
                      "ref_s": t["score_s"] - t["sample_s"], "update_s": wall - t["score_s"],
                      "prompt_lengths": t["prompt_lengths"],
                      "flops": step_flops(dims, t["prompt_lengths"], t["completion_lengths"])})
    timed = [s for s in steps if not s["warmup"]] or steps
    med = lambda key: float(statistics.median([s[key] for s in timed]))
    seconds = {"step": med("wall_s"), "sample": med("sample_s"), "ref": med("ref_s"), "update": med("update_s")}
    flops = {k: float(statistics.fmean([s["flops"][k] for s in timed])) for k in ("sample", "ref", "update", "step")}
    import transformers
    import trl

    return {
        "side": "trl", "device": "cpu", "device_name": "cpu", "steps": steps, "seconds": seconds, "flops": flops,
        "gflops": _gflops(flops, seconds), "torch_matmul_gflops_before": peaks_before,
        "torch_matmul_gflops_after": peaks_after, "load_s": load_s, "settings": settings,
        "logs": [lg for lg in timer.logs if "loss" in lg], "peak_rss_mib": _peak_rss_mib(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "load_average": _load_average(), "malloc_settings": malloc_kept,
    }


# ----------------------------------------------------------------------------- parent
def ensure_hf_dir(path: str) -> str:
    """A Hugging Face directory of the registered GGUF (float32), written once by ``rljax convert``."""
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        print(f"converting {MODEL_NAME} to {path} (rljax convert)", flush=True)
        subprocess.run([sys.executable, "-m", "rljax", "convert", MODEL_NAME, path], check=True)
    return path


def gpu_available() -> bool:
    """Whether JAX sees a GPU, asked in a throwaway process (so this one does not take GPU memory)."""
    probe = "import jax\ntry:\n print(len(jax.devices('gpu')))\nexcept RuntimeError:\n print(0)"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
        return out.returncode == 0 and out.stdout.strip().splitlines()[-1:] not in ([], ["0"])
    except (subprocess.SubprocessError, OSError):
        return False


def run_child(args, side: str, platform: str = "cpu") -> dict:
    """Run one side in its own process (so its peak RSS is its own) and read back its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--child-out", out,
               "--steps", str(args.steps), "--new-tokens", str(args.new_tokens), "--hf-dir", args.hf_dir,
               "--num-iterations", str(args.num_iterations), "--mini-batches", str(args.mini_batches),
               "--sampling-engine", args.sampling_engine]
        if args.smoke:
            cmd.append("--smoke")
        if args.trl_gradient_checkpointing:
            cmd.append("--trl-gradient-checkpointing")
        env = dict(os.environ)
        if side == "trl" and args.trl_default_malloc:
            cmd.append("--trl-default-malloc")
            env["RLJAX_KEEP_HOST_MEMORY"] = "0"  # belt and braces: keep_host_memory() then does nothing
        if side == "rljax":
            env["JAX_PLATFORMS"] = platform
        else:
            env["JAX_PLATFORMS"] = "cpu"
            env["CUDA_VISIBLE_DEVICES"] = ""  # the TRL side is the CPU comparison
        subprocess.run(cmd, check=True, env=env)
        with open(out) as f:
            return json.load(f)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side, after one warm-up step")
    parser.add_argument("--side", choices=("both", "rljax", "trl"), default="both")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--num-iterations", type=int, default=1,
                        help="rljax only: passes over each batch of rollouts (algorithm.num_iterations)")
    parser.add_argument("--mini-batches", type=int, default=1,
                        help="rljax only: optimizer steps per pass (algorithm.mini_batches)")
    parser.add_argument("--sampling-engine", choices=("paged", "static"), default="paged",
                        help="rljax side: sampling.engine (paged: the rollout engine, the default; static: the "
                             "static-batch sampler)")
    parser.add_argument("--no-gpu", action="store_true", help="do not run the rljax side on a GPU even if JAX sees one")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL's default (recompute activations in the backward); off by default, like rljax")
    parser.add_argument("--trl-default-malloc", action="store_true",
                        help="run TRL on glibc's default malloc settings instead of the ones rljax applies")
    parser.add_argument("--hf-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "rljax", "perf",
                                                         f"{MODEL_NAME}-float32-hf"),
                        help="where the converted Hugging Face directory for TRL is cached")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="rljax only, 8 tokens, 1 timed step: a quick check")
    parser.add_argument("--child", choices=("rljax", "trl"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.new_tokens, args.side, args.no_gpu = 1, 8, "rljax", True
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if (args.num_iterations, args.mini_batches) != (1, 1) and args.side != "rljax" and not args.child:
        parser.error("--num-iterations / --mini-batches change the rljax side only: use --side rljax")
    return args


def _row(r: dict, peak: float | None) -> list:
    s, g = r["seconds"], r["gflops"]
    pct = lambda k: f"{100 * g[k] / peak:.0f}%" if peak and g.get(k) else "n/a"
    name = r["side"] + (f" ({r['device']})" if r["device"] != "cpu" else "")
    memory = f"{r['peak_rss_mib']:,.0f}"
    if r.get("device_peak_mib"):
        memory += f" (+{r['device_peak_mib']:,.0f} on device)"
    return [name, s["step"], s["sample"], s["ref"], s["update"],
            f"{g['sample']:.0f} / {g['ref']:.0f} / {g['update']:.0f} / {g['step']:.0f}",
            f"{pct('sample')} / {pct('ref')} / {pct('update')} / {pct('step')}", memory]


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        result = run_rljax(args) if args.child == "rljax" else run_trl(args)
        with open(args.child_out, "w") as f:
            json.dump(result, f, default=str)
        return result

    sys.path.insert(0, HERE)
    from _common import markdown_table, write_json

    print(f"# GRPO step benchmark: {MODEL_NAME} float32, {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} completions, "
          f"{args.new_tokens} new tokens (EOS ignored), kl_coef {KL_COEF}; "
          f"{args.num_iterations} pass(es) x {args.mini_batches} mini-batch(es) of updates; "
          f"rljax sampling.engine {args.sampling_engine}; 1 warm-up + {args.steps} timed steps per side; "
          f"cpu threads {os.cpu_count()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load average {_load_average()}", flush=True)
    results: dict = {"args": vars(args), "rows": []}
    if args.side in ("both", "trl"):
        ensure_hf_dir(args.hf_dir)
    if args.side in ("both", "rljax"):
        results["rows"].append(run_child(args, "rljax", "cpu"))
    if args.side in ("both", "trl"):
        results["rows"].append(run_child(args, "trl"))
    if args.side in ("both", "rljax") and not args.no_gpu and gpu_available():
        results["rows"].append(run_child(args, "rljax", "gpu"))

    cpu_rljax = next((r for r in results["rows"] if r["side"] == "rljax" and r["device"] == "cpu"), None)
    cpu_peak = cpu_rljax["matmul_peak_gflops"] if cpu_rljax else None
    table_rows = []
    for r in results["rows"]:
        peak = r.get("matmul_peak_gflops", cpu_peak)
        table_rows.append(_row(r, peak))
    headers = ["side", "s/step (median)", "sampling s", "ref + old log-probs s", "update s",
               "GFLOP/s sample / ref / update / step", "% of matmul peak sample / ref / update / step",
               "peak RSS MiB"]
    table = markdown_table(headers, table_rows)
    print("\n## results\n")
    print(table)
    trl_row = next((r for r in results["rows"] if r["side"] == "trl"), None)
    if cpu_rljax and trl_row:
        ratio = trl_row["seconds"]["step"] / cpu_rljax["seconds"]["step"]
        results["ratio_trl_over_rljax"] = ratio
        parts = ", ".join(f"{k} {trl_row['seconds'][k] / cpu_rljax['seconds'][k]:.2f}x"
                          for k in ("sample", "ref", "update"))
        update_pct = 100 * cpu_rljax["gflops"]["update"] / cpu_peak
        verdict = "faster" if ratio >= 1 else "slower"
        print(f"\nTRL s/step / rljax s/step = {ratio:.2f} (rljax {max(ratio, 1 / ratio):.2f}x {verdict} per step on "
              f"this CPU; by part: {parts})")
        ref_pct = 100 * cpu_rljax["gflops"]["ref"] / cpu_peak
        # issue 13 section 5: the update and the reference pass at >= 75% of the matmul peak XLA
        # reaches in the same run, so that rljax stays >= 1.4x faster than TRL on any host of this kind
        met = ratio >= 1.4 and update_pct >= 75 and ref_pct >= 75
        print(f"target (rljax >= 1.4x faster; update and reference >= 75% of the matmul peak): "
              f"{'met' if met else 'MISSED'} ({ratio:.2f}x; update at {update_pct:.0f}%, reference at "
              f"{ref_pct:.0f}% of {cpu_peak:.0f} GFLOP/s)")
        results["target_met"] = bool(met)
    for r in results["rows"]:
        if r["side"] == "rljax":
            print(f"rljax ({r['device']}) matmul GFLOP/s in its run (best of before/after): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in r["matmul_gflops"].items())
                  + f"; peak used for %: {r['matmul_peak_gflops']:.0f}; compiles: {r['compiles']}")
            print(f"  per-step seconds (warm-up first): {[round(s['wall_s'], 2) for s in r['steps']]}; "
                  f"FLOPs per step: " + ", ".join(f"{k} {v / 1e9:.0f} G" for k, v in r["flops"].items()))
        else:
            print(f"TRL torch matmul GFLOP/s before / after its run: "
                  + ", ".join(f"{k} {r['torch_matmul_gflops_before'][k]:.0f} / {r['torch_matmul_gflops_after'][k]:.0f}"
                              for k in r["torch_matmul_gflops_before"]))
            print(f"  per-step seconds (warm-up first): {[round(s['wall_s'], 2) for s in r['steps']]}")
    print("GFLOP/s are useful FLOPs (real tokens) / median seconds of each part; % of the best float32 matmul "
          "rljax's device reached in the same run. Peak RSS: each side's own process. The sides ran one after the "
          f"other on a shared machine (load average now {_load_average()}): expect +-20% or worse between runs.")
    results["table"] = table
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
