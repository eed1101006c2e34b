"""Sampler throughput: rljax's jitted KV-cache sampler against `transformers` `generate` (torch).

Question: how fast does `rljax.sampling.generate` produce completions, next to the reference
implementation most users would otherwise reach for, on the same machine and in the same run?

Setup (the issue's wording): SmolLM2-135M-Instruct (the registered GGUF, dequantised to float32),
batches of 16 and 64 chat prompts (short arithmetic and everyday questions through the model's
ChatML template with a system prompt, left-padded), exactly 64 new tokens per row (EOS ignored),
temperature 1, no top-k/top-p. Both sides get the same token ids. After a warm-up (rljax: the
compile; transformers: a short generate at the same batch size) the repeats alternate
rljax / transformers, so load from other processes on a shared machine hits both alike; the median
is reported.

- rljax: `generate(..., SamplingConfig(max_new_tokens=N, temperature=1.0, ignore_eos=True))` on the
  `(graphdef, state)` split, timed until `block_until_ready`. Its prefill alone (the same call with
  `max_new_tokens=1`) is timed too, which splits the total into prefill and per-step decode time.
- transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)`,
  `generate(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=N, min_new_tokens=N)`
  under `torch.inference_mode()`, with `torch.set_num_threads(os.cpu_count())`, the thread count
  XLA's CPU backend uses. (`min_new_tokens` masks EOS, so every row is exactly N tokens long.)
- FLOPs: the model's forward FLOPs for the real (unpadded) tokens: 2 x matmul parameters per token
  (the tied lm_head counted once per sampled token, as both implementations compute logits only at
  the last position), plus 4 x heads x head_dim x context per layer for attention scores and values.
  rljax's padding to bucket sizes is work it does but not useful FLOPs, so it is not counted.
- Matmul peak: a jitted float32 `[rows, 576] @ [576, 1536]` at each decode batch size and a
  2048^3 one, measured in this run on the same device (best of several bursts).

`OMP_WAIT_POLICY` defaults to PASSIVE here (set before torch loads; an explicit setting wins):
with torch's default (spinning) OpenMP workers, a 2-core machine shared with other processes made
torch's decode-shape matmuls about 5-10x slower (14 vs 80 GFLOP/s), which would flatter rljax.

Run (from the repository root; needs the `bench` extra: torch, accelerate):

    python experiments/perf/sampler.py                      # batch 16 and 64, 64 tokens, 3 repeats
    python experiments/perf/sampler.py --json runs/perf/sampler.json
    python experiments/perf/sampler.py --smoke --skip-transformers   # seconds; for tests

Where JAX sees a GPU, rljax (and transformers, when torch has CUDA) also runs there and the table
has a row per device. This is a benchmark, not a test: on a shared CPU the numbers move by tens of
percent between runs; compare numbers from the same run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # must precede the first torch import

import argparse
import dataclasses
import importlib
import random
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    environment,
    markdown_table,
    matmul_peaks,
    median,
    peak_rss_mib,
    set_torch_threads,
    thread_count,
    time_call,
    write_json,
)

from rljax.buckets import bucket_length  # noqa: E402
from rljax.host_memory import keep_host_memory  # noqa: E402
from rljax.models import load  # noqa: E402
from rljax.models.config import ModelConfig  # noqa: E402
from rljax.models.registry import resolve  # noqa: E402

MODEL_NAME = "smollm2-135m-instruct"
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and show your reasoning."


# ----------------------------------------------------------------------------- prompts
def chat_prompts(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` varied short chat conversations (system + user), fixed by ``seed``."""
    rng = random.Random(seed)
    things = ["apples", "books", "marbles", "coins", "pencils", "stickers"]
    names = ["Ann", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]
    templates = [
        lambda: f"What is {rng.randint(2, 99)} + {rng.randint(2, 99)}?",
        lambda: f"Compute {rng.randint(2, 30)} * {rng.randint(2, 30)}.",
        lambda: f"What is {rng.randint(50, 500)} minus {rng.randint(1, 49)}?",
        lambda: (f"{rng.choice(names)} has {rng.randint(3, 40)} {rng.choice(things)} and gives away "
                 f"{rng.randint(1, 3)}. How many are left?"),
        lambda: f"Is {rng.randint(10, 200)} a prime number?",
        lambda: f"What is {rng.randint(1, 9)}/{rng.randint(2, 9)} as a decimal?",
        lambda: f"Round {rng.uniform(1, 100):.3f} to one decimal place.",
        lambda: f"Give me a synonym for '{rng.choice(['happy', 'fast', 'big', 'quiet', 'smart'])}'.",
        lambda: f"Name a country whose name starts with the letter {rng.choice('ABCEGIKMNPST')}.",
        lambda: f"What is the square of {rng.randint(2, 25)}?",
    ]
    return [
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": templates[i % len(templates)]()}]
        for i in range(n)
    ]


def encode_prompts(tokenizer, conversations) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ``input_ids``, ``attention_mask`` ``[B, P]`` (int32) through the chat template."""
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, padding=True, return_tensors="np", add_special_tokens=False)
    return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


# ----------------------------------------------------------------------------- FLOPs
def matmul_params_per_token(c: ModelConfig) -> int:
    """Weights a token multiplies in the transformer blocks (q, k, v, o, gate, up, down)."""
    D, H, KVH, hd, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    return c.num_layers * (D * H * hd + 2 * D * KVH * hd + H * hd * D + 3 * D * F)


def generation_flops(c: ModelConfig, prompt_lengths, new_tokens: int) -> dict[str, float]:
    """Forward FLOPs of prefilling each prompt and sampling ``new_tokens`` per row.

    Prefill runs every real prompt token through the blocks and the lm_head at the last one; each
    of the ``new_tokens - 1`` decode steps runs one token through the blocks and the lm_head.
    Attention for a query over ``ctx`` keys costs ``4 * heads * head_dim * ctx`` per layer
    (scores and the weighted sum of values, 2 FLOPs per multiply-add).
    """
    blocks = 2 * matmul_params_per_token(c)
    lm_head = 2 * c.hidden_size * c.vocab_size
    attn_per_key = 4 * c.num_layers * c.num_heads * c.head_dim
    prefill = decode = 0.0
    for p in map(int, prompt_lengths):
        prefill += p * blocks + lm_head + attn_per_key * p * (p + 1) / 2
        for j in range(1, new_tokens):
            decode += blocks + lm_head + attn_per_key * (p + j)
    return {"prefill": prefill, "decode": decode, "total": prefill + decode,
            "per_token_no_attention": float(blocks + lm_head)}


# ----------------------------------------------------------------------------- the two samplers
@dataclasses.dataclass
class Case:
    device: str
    batch: int
    input_ids: np.ndarray
    attention_mask: np.ndarray


def rljax_sampler(model, new_tokens: int, sampling_module: str = "rljax.sampling"):
    """A callable ``(ids, mask, key) -> SampleOutput`` on the model's ``(graphdef, state)`` split.

    ``sampling_module`` names a module with rljax.sampling's ``generate`` and ``SamplingConfig``
    (a patched copy on ``PYTHONPATH`` can be measured against transformers the same way).
    """
    sampling = importlib.import_module(sampling_module)
    split = nnx.split(model)
    config = sampling.SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True,
                                     pad_token_id=int(model.config.pad_token_id or 0))

    def run(ids, mask, key):
        return sampling.generate(split, ids, mask, key, config)

    return run


def transformers_model(device: str):
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve(MODEL_NAME).path
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.to(device).eval()


def transformers_sampler(model, new_tokens: int, pad_token_id: int, device: str):
    import torch

    def run(ids, mask, seed, new_tokens=new_tokens):
        torch.manual_seed(seed)
        input_ids = torch.as_tensor(ids, dtype=torch.long, device=device)
        attention_mask = torch.as_tensor(mask, dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_token_id,
            )
        if device != "cpu":
            torch.cuda.synchronize()
        if out.shape != (ids.shape[0], ids.shape[1] + new_tokens):
            raise RuntimeError(f"transformers generated {tuple(out.shape)}, expected "
                               f"{(ids.shape[0], ids.shape[1] + new_tokens)}")
        return out

    return run


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="do not time rljax's prefill alone (saves a compile and a few prefills)")
    parser.add_argument("--devices", nargs="+", default=None,
                        help="JAX platforms to run rljax on (default: cpu, and gpu where JAX sees one)")
    parser.add_argument("--sampling-module", default="rljax.sampling",
                        help="module providing generate/SamplingConfig (to measure a patched copy)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="batch 2, 4 tokens, 1 repeat: runs in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.new_tokens, args.repeats = [2], 4, 1
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (one prefill token and at least one decode step)")
    return args


def _platforms(requested):
    if requested:
        return requested
    platforms = ["cpu"]
    try:
        if jax.devices("gpu"):
            platforms.append("gpu")
    except RuntimeError:
        pass
    return platforms


def main(argv=None) -> dict:
    keep_host_memory()  # before any JAX work (rljax/host_memory.py), as `rljax generate` does
    args = parse_args(argv)
    threads = thread_count()
    print(f"# sampler benchmark: {MODEL_NAME} float32, new tokens {args.new_tokens}, batches {args.batch_sizes}, "
          f"repeats {args.repeats}, cpu threads {threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"sampler {args.sampling_module}", flush=True)
    t0 = time.perf_counter()
    model, tokenizer = load(MODEL_NAME, dtype=jax.numpy.float32)
    print(f"rljax load: {time.perf_counter() - t0:.1f}s", flush=True)
    cfg = model.config
    conversations = chat_prompts(max(args.batch_sizes))
    all_ids, all_mask = encode_prompts(tokenizer, conversations)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else cfg.eos_token_id)

    hf_model = None
    if not args.skip_transformers:
        set_torch_threads(threads)
        t0 = time.perf_counter()
        hf_model = transformers_model("cpu")
        print(f"transformers load: {time.perf_counter() - t0:.1f}s", flush=True)

    results = {"args": vars(args), "environment": environment(), "model": MODEL_NAME, "threads": threads,
               "rows": [], "matmul_gflops": {}}
    for platform in _platforms(args.devices):
        device = jax.devices(platform)[0]
        torch_device = "cpu" if platform == "cpu" else "cuda"
        hf_run = None
        if hf_model is not None:
            import torch

            if torch_device == "cpu" or torch.cuda.is_available():
                hf_run = transformers_sampler(hf_model.to(torch_device), args.new_tokens, pad_id, torch_device)
        with jax.default_device(device):
            graphdef, state = nnx.split(model)
            model_on_device = nnx.merge(graphdef, jax.device_put(state, device))
            sample = rljax_sampler(model_on_device, args.new_tokens, args.sampling_module)
            prefill_only = rljax_sampler(model_on_device, 1, args.sampling_module)
            print(f"\n## device {device} — measuring matmul peaks", flush=True)
            peaks = matmul_peaks(args.batch_sizes, d_model=cfg.hidden_size, d_ff=cfg.intermediate_size,
                                 device=device, min_seconds=0.05 if args.smoke else 0.5)
            results["matmul_gflops"][platform] = peaks
            print("  " + ", ".join(f"{k}: {v:.1f} GFLOP/s" for k, v in peaks.items()), flush=True)
            for batch in args.batch_sizes:
                ids, mask = all_ids[:batch], all_mask[:batch]
                keep = mask.any(axis=0)  # drop columns that are padding in every row of this batch
                ids, mask = np.ascontiguousarray(ids[:, keep]), np.ascontiguousarray(mask[:, keep])
                row = _bench_batch(args, cfg, platform, device, batch, ids, mask, sample, prefill_only, hf_run, peaks)
                results["rows"].append(row)
        if hf_model is not None and torch_device != "cpu":
            hf_model.to("cpu")
    results["peak_rss_mib"] = peak_rss_mib()

    print("\n## results\n")
    table = markdown_table(
        ["device", "batch", "rljax tok/s", "transformers tok/s", "ratio", "rljax GFLOP/s", "% of decode-shape matmul peak"],
        [[r["device"], r["batch"], r["rljax_tokens_per_s"],
          r["transformers_tokens_per_s"] if r["transformers_tokens_per_s"] is not None else "n/a",
          f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a",
          r["rljax_gflops"], f"{100 * r['rljax_fraction_of_decode_peak']:.0f}%"] for r in results["rows"]],
    )
    print(table)
    if not args.no_breakdown:
        print()
        print(markdown_table(
            ["device", "batch", "prompt len (padded)", "rljax prefill s", "rljax decode ms/step",
             "rljax decode GFLOP/s", "rljax first call s (compile)", "CPU-s rljax / transformers"],
            [[r["device"], r["batch"], f"{r['prompt_length']} ({r['prompt_length_bucketed']})",
              r["rljax_prefill_s"], 1e3 * r["rljax_decode_s_per_step"], r["rljax_decode_gflops"],
              r["rljax_first_call_s"],
              f"{median(r['rljax_cpu_seconds']):.1f} / "
              + (f"{median(r['transformers_cpu_seconds']):.1f}" if r["transformers_cpu_seconds"] else "n/a")]
             for r in results["rows"]],
        ))
    peak_text = "; ".join(f"{p}: " + ", ".join(f"{k} {v:.0f}" for k, v in m.items())
                          for p, m in results["matmul_gflops"].items())
    print(f"\nmatmul GFLOP/s (same run): {peak_text}")
    print(f"peak RSS: {results['peak_rss_mib']:.0f} MiB (whole process: both models loaded)")
    print(f"medians of {args.repeats} interleaved repeats; load average at start "
          f"{results['environment']['load_average']}")
    results["table"] = table
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    return results


def _bench_batch(args, cfg, platform, device, batch, ids, mask, sample, prefill_only, hf_run, peaks) -> dict:
    N = args.new_tokens
    prompt_lengths = mask.sum(axis=1)
    flops = generation_flops(cfg, prompt_lengths, N)
    print(f"\n### {platform} batch {batch}: prompt lengths {prompt_lengths.min()}-{prompt_lengths.max()} "
          f"(padded to {ids.shape[1]}), {flops['total'] / 1e9:.1f} GFLOP per call", flush=True)

    first_call_s, out = time_call(lambda: sample(ids, mask, jax.random.key(0)))
    if out.tokens.shape != (batch, N) or int(out.mask.sum()) != batch * N:
        raise RuntimeError(f"rljax generated {out.tokens.shape} with {int(out.mask.sum())} valid tokens, "
                           f"expected {(batch, N)} all valid")
    print(f"  rljax warm-up (compile + run): {first_call_s:.1f}s", flush=True)
    if not args.no_breakdown:
        time_call(lambda: prefill_only(ids, mask, jax.random.key(0)))
    if hf_run is not None:
        warm_s, _ = time_call(lambda: hf_run(ids, mask, 0, new_tokens=min(N, 4)))
        print(f"  transformers warm-up: {warm_s:.1f}s", flush=True)

    rl_times, hf_times, prefill_times, rl_cpu, hf_cpu = [], [], [], [], []
    for rep in range(args.repeats):
        cpu0 = time.process_time()
        seconds, _ = time_call(lambda: sample(ids, mask, jax.random.key(rep + 1)))
        rl_cpu.append(time.process_time() - cpu0)
        rl_times.append(seconds)
        line = f"  repeat {rep}: rljax {seconds:.2f}s ({batch * N / seconds:.1f} tok/s)"
        if not args.no_breakdown:
            seconds, _ = time_call(lambda: prefill_only(ids, mask, jax.random.key(rep + 1)))
            prefill_times.append(seconds)
            line += f", rljax prefill {seconds:.2f}s"
        if hf_run is not None:
            start, cpu0 = time.perf_counter(), time.process_time()
            hf_run(ids, mask, rep + 1)
            seconds = time.perf_counter() - start
            hf_cpu.append(time.process_time() - cpu0)
            hf_times.append(seconds)
            line += f", transformers {seconds:.2f}s ({batch * N / seconds:.1f} tok/s)"
        print(line, flush=True)

    rl_s = median(rl_times)
    hf_s = median(hf_times) if hf_times else None
    gflops = flops["total"] / rl_s / 1e9
    decode_peak = peaks[f"{batch}x{cfg.hidden_size}x{cfg.intermediate_size}"]
    row = {
        "device": platform,
        "device_name": str(device),
        "batch": batch,
        "new_tokens": N,
        "prompt_length": int(ids.shape[1]),
        "prompt_length_bucketed": bucket_length(int(ids.shape[1]), 16),  # what rljax.sampling pads to
        "rljax_seconds": rl_times,
        "transformers_seconds": hf_times,
        # process CPU seconds (all threads) per repeat: less sensitive than wall time to other
        # processes on a shared machine, but counts spin-waiting threads
        "rljax_cpu_seconds": rl_cpu,
        "transformers_cpu_seconds": hf_cpu,
        "rljax_first_call_s": first_call_s,
        "rljax_tokens_per_s": batch * N / rl_s,
        "transformers_tokens_per_s": batch * N / hf_s if hf_s else None,
        "ratio": hf_s / rl_s if hf_s else None,
        "flops": flops,
        "rljax_gflops": gflops,
        "transformers_gflops": flops["total"] / hf_s / 1e9 if hf_s else None,
        "rljax_fraction_of_decode_peak": gflops / decode_peak,
        "rljax_prefill_seconds": prefill_times,
        "rljax_prefill_s": None,
        "rljax_decode_s_per_step": None,
        "rljax_decode_gflops": None,
    }
    if prefill_times:
        prefill_s = median(prefill_times)
        decode_s = max(rl_s - prefill_s, 1e-9)
        row.update(rljax_prefill_s=prefill_s, rljax_decode_s_per_step=decode_s / (N - 1),
                   rljax_decode_gflops=flops["decode"] / decode_s / 1e9)
    return row


if __name__ == "__main__":
    main()
