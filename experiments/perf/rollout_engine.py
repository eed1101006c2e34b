"""Rollout engine: continuous batching over a paged KV cache against the static sampler and `transformers`.

Question: when the completions of a batch have different lengths, as RL rollouts do, how many useful
tokens per second does ``rljax.inference.Engine`` produce next to today's static sampler
(``rljax.sampling.generate``, every row runs until the longest row of its batch finishes) and next
to transformers ``generate``, on the same machine and in the same run; how much KV memory does each
hold at its peak; and how close does the engine's decode step come to the host's memory bandwidth?

Workload: SmolLM2-135M-Instruct (the registered GGUF, dequantised to float32), 256 requests = 64
chat prompts (``sampler.py``'s: short arithmetic and everyday questions through the model's ChatML
template with a system prompt) x 4 samples, in request order (prompt-major, the 4 samples of a
prompt adjacent, as a GRPO group). Temperature 1, no top-k / top-p, EOS never stops a row. Two
target-length sets, each side generating exactly those lengths:

- heavy-tailed: one target per request drawn from a log-normal (median 64 tokens, sigma 1 in log
  space, rounded, cut to [1, 512]; numpy ``default_rng(0)``);
- uniform: 64 tokens for every request.

Sides, one process, in this order for each target set (heavy-tailed first):

- (a) engine: a fresh ``Engine(model, max_slots=64, page_size=16, num_pages=...)``, one ``generate``
  call over all 256 ``Request(max_tokens=target, stop_token_ids=(), seed=i)``; it must return
  exactly ``target`` tokens and ``finish_reason == "length"`` for each. Its page pool holds 64
  sequences of the longest prompt + the longest target (``pool_pages``): about the bytes of the
  static sampler's cache for its longest batch, so both sides get the same KV budget and no request is
  ever preempted (``--num-pages`` sets another).
- (b) static: ``rljax.sampling.generate`` in batches of 64 in request order (16 prompts x 4),
  ``SamplingConfig(max_new_tokens=max target of the batch, ignore_eos=True)``, ``prompt_group=4`` as
  the trainer calls it; each row runs to the batch maximum and only its target counts as useful.
- (c) transformers: ``generate`` in the same batches of 64 (each prompt repeated 4 times, left-padded),
  ``do_sample=True, temperature=1, top_k=0, top_p=1``, ``max_new_tokens = min_new_tokens =`` the
  batch maximum, under ``torch.inference_mode()`` with ``torch.set_num_threads(os.cpu_count())``.

The static and transformers batches alternate (static batch 1, transformers batch 1, static batch 2,
...), right after the engine's call, so load from other processes on a shared machine hits them alike.
Warm-ups are not timed but reported: the engine's is the same 256 requests (other seeds) through
another engine with the same pool, which compiles every program the timed engine runs (engines of
one shape share them; the decode step compiles per bucket of live pages, so a shorter warm-up would
leave compiles inside the timed call), while the timed engine starts with an empty prefix cache and
its own stats; the static sampler's programs (one per bucketed batch shape and batch maximum) are
compiled ahead of time (``jit.lower().compile()``, which fills the cache the call uses;
``sampling.trace_count()`` is checked, and a compile inside a timed call is reported); transformers
runs one 4-token ``generate`` at batch 64.

Metrics:

- useful tokens/s = sum of the targets / wall seconds of the side's calls (prefill included; for the
  engine, less the time the benchmark spends counting its pages).
- peak KV memory: engine = peak pages in use x page_size x KV bytes per token, the pages counted
  after each step as those the sequences hold (pages in use less those only the prefix cache holds;
  ``stats["peak_pages_in_use"]`` instead where the engine keeps that count); static =
  the largest batch's cache, padded batch x (bucketed prompt width + max_new_tokens) x KV bytes per
  token (what ``rljax.sampling`` allocates); transformers = batch x (prompt width + max_new_tokens)
  x KV bytes per token. KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x 4 (float32).
- host read bandwidth: the best of several jitted ``jnp.sum`` over a 1 GiB float32 array and of a
  numpy sum of it in one thread per CPU, measured at the start and at the end of the run (best of
  all). A numpy ``copyto`` of 1 GiB (read + write bytes / s, one thread) is reported beside it.
- decode bandwidth: a separate decode-only run per slot count (16 and 64): as many requests as
  slots, all with the first prompt and 128 tokens, through an engine with ``max_slots`` = that count
  (warmed up as above). From the engine's ``stats`` over that call: step time = ``decode_seconds /
  decode_steps``; bytes per step = the float32 weights a step reads (every matmul parameter of the
  blocks + the embedding / lm_head once) + ``live_kv_tokens_read x`` KV bytes per token ``/
  decode_steps``; bandwidth = bytes per step / step time, as % of the host read bandwidth.
- compute ceiling: what the same step could reach if its matmuls ran at the best float32 matmul
  rate measured in the run (any shape, 2048^3 included): FLOPs per step = 2 x slots x the weights a
  step reads (``decode_flops``), so the shortest step is FLOPs / that rate and the highest bandwidth
  (weight + KV bytes) / that step (``compute_ceiling_gbs``). A step with S rows does 2S/4 = S/2 FLOPs
  per float32 weight byte, so at 64 slots a CPU needs 32 x its read bandwidth in GFLOP/s (about 0.8
  TFLOP/s on a 25 GB/s host) to be bandwidth bound; below that the step is compute bound and its
  bandwidth fraction is capped by the ceiling, whatever the attention or the cache do.
- The last line's ``B%`` is the lower of the 16- and 64-slot decode percentages.

Run (from the repository root; needs the `bench` extra: torch, accelerate):

    python experiments/perf/rollout_engine.py                          # the workload above
    python experiments/perf/rollout_engine.py --json runs/perf/rollout_engine.json
    python experiments/perf/rollout_engine.py --skip-transformers      # engine and static sampler only
    python experiments/perf/rollout_engine.py --smoke --skip-transformers   # tiny random model

``--smoke`` builds a random tiny Llama in-process (``rljax.models.tiny``: 2 layers, hidden 64, byte
tokenizer) and runs 16 requests (4 prompts x 4) in batches of 8, targets of median 4 cut at 8,
uniform 8, decode at 4 and 8 slots: about a minute on an idle 2-core CPU, most of it compiling; it
checks the script, not the speed. ``OMP_WAIT_POLICY`` defaults to PASSIVE (set before torch loads;
an explicit setting wins), for the reason ``sampler.py`` gives. The last line printed is exactly:

    rollout engine vs static sampler: H.HHx useful tokens/s (heavy-tailed), U.UUx (uniform); decode at B% of memory bandwidth

This is a benchmark, not a test: on a shared CPU the numbers move by tens of percent between runs;
compare numbers from the same run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # must precede the first torch import

import argparse
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import (  # noqa: E402
    environment,
    markdown_table,
    matmul_peaks,
    peak_rss_mib,
    set_torch_threads,
    thread_count,
    write_json,
)
from sampler import MODEL_NAME, chat_prompts, encode_prompts, matmul_params_per_token  # noqa: E402

from rljax import sampling  # noqa: E402
from rljax.inference import Engine, Request  # noqa: E402
from rljax.buckets import bucket_length  # noqa: E402
from rljax.host_memory import keep_host_memory  # noqa: E402
from rljax.models import load  # noqa: E402
from rljax.models.config import ModelConfig  # noqa: E402
from rljax.models.registry import resolve  # noqa: E402

ENGINE_COUNTERS = ("decode_steps", "decode_seconds", "decode_tokens", "live_kv_tokens_read")


# ----------------------------------------------------------------------------- workload
def target_lengths(n: int, median: float, sigma: float, cut: int, seed: int = 0) -> np.ndarray:
    """``n`` lengths from a log-normal of ``median`` and log-space ``sigma``, rounded and cut to [1, cut]."""
    draws = np.random.default_rng(seed).lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(draws), 1, cut).astype(np.int64)


def kv_bytes_per_token(c: ModelConfig, bytes_per_value: int = 4) -> int:
    """Bytes of keys and values one token occupies in the cache across all layers."""
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * bytes_per_value


def decode_weight_bytes(c: ModelConfig, bytes_per_value: int = 4) -> int:
    """Bytes of weights one decode step reads: every matmul parameter of the blocks + the lm_head once."""
    return bytes_per_value * (matmul_params_per_token(c) + c.vocab_size * c.hidden_size)


def decode_flops(c: ModelConfig, slots: int) -> int:
    """Matmul FLOPs of one decode step over ``slots`` rows: 2 per multiply-add of every weight a step reads."""
    return 2 * slots * decode_weight_bytes(c, bytes_per_value=1)


def compute_ceiling_gbs(c: ModelConfig, slots: int, moved_bytes: float, gflops: float) -> float:
    """The highest GB/s a decode step moving ``moved_bytes`` can reach when its matmuls run at ``gflops``."""
    return moved_bytes / (decode_flops(c, slots) / (gflops * 1e9)) / 1e9


def call_stats(before: dict, after: dict, decode_tokens_range: tuple[int, int]) -> dict:
    """The engine's decode counters for one ``generate`` call, from ``stats`` before and after it.

    Works whether the engine's counters add up over its lifetime or restart with each call: the
    call's decode tokens lie in ``decode_tokens_range`` (its generated tokens, less up to one
    per request for the token each prefill samples), which tells the two apart as long as the
    calls before it decoded more than that range is wide.
    """
    lo, hi = decode_tokens_range
    diff = {k: after[k] - before.get(k, 0) for k in ENGINE_COUNTERS}
    if lo <= diff["decode_tokens"] <= hi:
        return diff
    if lo <= after["decode_tokens"] <= hi:
        return {k: after[k] for k in ENGINE_COUNTERS}
    raise RuntimeError(f"engine stats: decode_tokens {before.get('decode_tokens')} -> {after['decode_tokens']} "
                       f"for a call that decoded between {lo} and {hi} tokens")


# ----------------------------------------------------------------------------- bandwidth
def _best_gbs(fn, moved_bytes: int, trials: int) -> float:
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = max(best, moved_bytes / (time.perf_counter() - start) / 1e9)
    return best


def read_bandwidth(nbytes: int, trials: int) -> dict:
    """Host memory bandwidth in GB/s: jitted sum, threaded numpy sum, numpy copy (read + write bytes)."""
    out = {"jax_sum": _jax_sum_gbs(nbytes, trials)}
    a = np.ones(nbytes // 4, np.float32)
    chunks = np.array_split(a, thread_count())
    with ThreadPoolExecutor(len(chunks)) as pool:
        out["numpy_sum_threads"] = _best_gbs(lambda: list(pool.map(np.sum, chunks)), nbytes, trials)
    b = np.empty_like(a)
    out["numpy_copy"] = _best_gbs(lambda: np.copyto(b, a), 2 * nbytes, trials)
    out["read"] = max(out["jax_sum"], out["numpy_sum_threads"])
    return out


def _jax_sum_gbs(nbytes: int, trials: int) -> float:
    x = jax.block_until_ready(jnp.ones((nbytes // 4,), jnp.float32))
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    return _best_gbs(lambda: total(x), nbytes, trials)


# ----------------------------------------------------------------------------- sides
def pool_pages(prompts: list[list[int]], targets: np.ndarray, max_slots: int, page_size: int) -> int:
    """Pages for ``max_slots`` sequences of the longest prompt + the longest target, + the null page:
    the bytes of the static sampler's cache for one batch of that size, and no request is ever preempted."""
    longest = max(map(len, prompts)) + int(targets.max())
    return max_slots * -(-longest // page_size) + 1


def generate_tracking_peak(engine: Engine, requests: list[Request]) -> tuple[list, int, float]:
    """``engine.generate(requests)`` through the engine's ``submit`` / ``step``; also the peak over steps
    of the pages sequences hold (pages in use less those only the prefix cache holds: the cache keeps a
    finished sequence's pages until the pool runs short), and the seconds that count took."""
    ids = [engine.submit(r) for r in requests]
    done, peak, counting = {}, 0, 0.0
    while engine.has_work():
        for out in engine.step():
            done[out.request_id] = out
        start = time.perf_counter()
        peak = max(peak, engine.pool.in_use - engine.pool.cache.evictable())
        counting += time.perf_counter() - start
    done.update((out.request_id, out) for out in engine.pop_finished())
    return [done[i] for i in ids], peak, counting


def run_engine(model, prompts: list[list[int]], samples: int, targets: np.ndarray, *, max_slots: int,
               page_size: int, num_pages: int | None, seed0: int = 0) -> dict:
    """The requests through two engines of one shape: the first untimed (it compiles every program the
    second runs: engines with the same pool share their compiled programs), then the timed call on a
    fresh one (empty prefix cache, its stats this call's alone); every output checked."""
    num_pages = pool_pages(prompts, targets, max_slots, page_size) if num_pages is None else num_pages

    def requests(seed):
        return [Request(prompt_ids=list(prompts[i // samples]), max_tokens=int(t), temperature=1.0, top_p=1.0,
                        top_k=0, stop_token_ids=(), seed=seed + i) for i, t in enumerate(targets)]

    engine = Engine(model, max_slots=max_slots, page_size=page_size, num_pages=num_pages)
    start = time.perf_counter()
    engine.generate(requests(seed0 + 1_000_000))
    warmup_s = time.perf_counter() - start
    del engine
    engine = Engine(model, max_slots=max_slots, page_size=page_size, num_pages=num_pages)
    before = dict(engine.stats)
    start = time.perf_counter()
    outs, peak_pages, counting_s = generate_tracking_peak(engine, requests(seed0))
    seconds = time.perf_counter() - start - counting_s
    after = dict(engine.stats)
    for i, (out, t) in enumerate(zip(outs, targets)):
        if len(out.token_ids) != t or len(out.logprobs) != t or out.finish_reason != "length":
            raise RuntimeError(f"engine request {i}: {len(out.token_ids)} tokens ({out.finish_reason!r}), "
                               f"expected {t} ('length')")
    total = int(targets.sum())
    counters = call_stats(before, after, (total - len(targets), total))
    peak_pages = int(after.get("peak_pages_in_use", peak_pages))  # the engine's own count where it keeps one
    return {"seconds": seconds, "warmup_s": warmup_s, "useful_tokens": total, "generated_tokens": total,
            "num_pages": num_pages, "peak_pages": peak_pages,
            "peak_kv_bytes": peak_pages * int(after["page_size"]) * int(after["kv_bytes_per_token"]),
            "peak_counting_s": counting_s, "call_stats": counters, "stats": {k: _plain(v) for k, v in after.items()}}


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v


def static_batches(prompt_ids: np.ndarray, prompt_mask: np.ndarray, samples: int, targets: np.ndarray,
                   batch: int) -> list[dict]:
    """The static sampler's batches in request order: left-padded ids / mask (all-pad columns dropped)."""
    ids, mask = np.repeat(prompt_ids, samples, axis=0), np.repeat(prompt_mask, samples, axis=0)
    out = []
    for b0 in range(0, len(targets), batch):
        i, m = ids[b0:b0 + batch], mask[b0:b0 + batch]
        keep = m.any(axis=0)
        out.append({"ids": np.ascontiguousarray(i[:, keep]), "mask": np.ascontiguousarray(m[:, keep]),
                    "targets": targets[b0:b0 + batch], "new_tokens": int(targets[b0:b0 + batch].max())})
    return out


def static_config(new_tokens: int, pad_id: int) -> sampling.SamplingConfig:
    return sampling.SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                                   ignore_eos=True, pad_token_id=pad_id)


def compile_static(split, ids: np.ndarray, config: sampling.SamplingConfig, group: int) -> float:
    """Compile the program ``sampling.generate`` will run for ``ids`` (its bucketing); seconds taken."""
    graphdef, *states = split
    B, P = ids.shape
    B_b, P_b = bucket_length(B, 8), bucket_length(P, 16)
    group = group if group > 1 and B % group == 0 and B_b % group == 0 else 1
    zeros = jnp.zeros((B_b, P_b), jnp.int32)
    start = time.perf_counter()
    sampling._generate.lower(graphdef, tuple(states), zeros, zeros, jax.random.key(0), config, group).compile()
    return time.perf_counter() - start


def run_static_batch(split, batch: dict, samples: int, pad_id: int, key) -> dict:
    config = static_config(batch["new_tokens"], pad_id)
    B, N = len(batch["targets"]), batch["new_tokens"]
    traces = sampling.trace_count()
    start = time.perf_counter()
    out = jax.block_until_ready(sampling.generate(split, batch["ids"], batch["mask"], key, config,
                                                  prompt_group=samples))
    seconds = time.perf_counter() - start
    if out.tokens.shape != (B, N) or int(out.mask.sum()) != B * N:
        raise RuntimeError(f"static sampler generated {out.tokens.shape} with {int(out.mask.sum())} valid tokens, "
                           f"expected {(B, N)} all valid")
    return {"seconds": seconds, "compiled_in_call": sampling.trace_count() > traces}


def transformers_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def run_transformers_batch(model, batch: dict, pad_id: int, seed: int, new_tokens: int | None = None) -> float:
    import torch

    N = batch["new_tokens"] if new_tokens is None else new_tokens
    ids = torch.as_tensor(batch["ids"], dtype=torch.long)
    mask = torch.as_tensor(batch["mask"], dtype=torch.long)
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=N, min_new_tokens=N, pad_token_id=pad_id)
    seconds = time.perf_counter() - start
    if tuple(out.shape) != (ids.shape[0], ids.shape[1] + N):
        raise RuntimeError(f"transformers generated {tuple(out.shape)}, expected {(ids.shape[0], ids.shape[1] + N)}")
    return seconds


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (the static prompt_group)")
    parser.add_argument("--batch", type=int, default=64, help="static / transformers batch; the engine's max_slots")
    parser.add_argument("--median", type=float, default=64.0, help="median of the heavy-tailed targets")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-space sigma of the heavy-tailed targets")
    parser.add_argument("--cut", type=int, default=512, help="longest heavy-tailed target")
    parser.add_argument("--uniform", type=int, default=64, help="every request's target in the uniform set")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the targets")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="engine page pool (default: slots x pages of the longest request + 1, see pool_pages)")
    parser.add_argument("--decode-slots", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="size of the array the bandwidth reads")
    parser.add_argument("--bandwidth-trials", type=int, default=5)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny random model, 16 requests, batches of 8, decode at 4 and 8 slots: seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.batch, args.median, args.cut, args.uniform = 4, 8, 4.0, 8, 8
        args.decode_slots, args.decode_tokens, args.bandwidth_mib, args.bandwidth_trials = [4, 8], 16, 64, 3
    if args.batch % args.samples:
        parser.error(f"--batch ({args.batch}) must be a multiple of --samples ({args.samples}): "
                     "a batch holds whole prompt groups")
    if min(args.decode_tokens, args.uniform, args.cut) < 2 or args.median <= 0 or args.sigma < 0:
        parser.error("--decode-tokens, --uniform and --cut must be >= 2, --median > 0 and --sigma >= 0")
    return args


def main(argv=None) -> dict:
    keep_host_memory()  # before any JAX work (rljax/host_memory.py), as `rljax generate` does
    args = parse_args(argv)
    threads = thread_count()
    tmp = tempfile.mkdtemp(prefix="rollout_engine_") if args.smoke else None
    try:
        return _main(args, threads, tmp)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _main(args, threads, tmp) -> dict:
    if args.smoke:
        from rljax.models.tiny import make_tiny_model_dir

        model_path, model_name = make_tiny_model_dir(os.path.join(tmp, "tiny")), "tiny random Llama (smoke)"
    else:
        model_path, model_name = resolve(MODEL_NAME).path, MODEL_NAME
    n = args.prompts * args.samples
    print(f"# rollout engine benchmark: {model_name} float32, {args.prompts} prompts x {args.samples} samples, "
          f"batch / slots {args.batch}, cpu threads {threads}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
          flush=True)

    results = {"args": vars(args), "environment": environment(), "model": model_name, "threads": threads}
    bw_mib = args.bandwidth_mib
    print(f"\n## host read bandwidth ({bw_mib} MiB, best of {args.bandwidth_trials})", flush=True)
    bandwidth = [read_bandwidth(bw_mib << 20, args.bandwidth_trials)]
    print("  " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth[0].items()), flush=True)

    start = time.perf_counter()
    model, tokenizer = load(model_path, dtype=jnp.float32)
    print(f"rljax load: {time.perf_counter() - start:.1f}s", flush=True)
    cfg = model.config
    split = nnx.split(model)
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else cfg.eos_token_id)
    kvb = kv_bytes_per_token(cfg)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, chat_prompts(args.prompts, seed=args.seed))
    prompts = [row[m.astype(bool)].tolist() for row, m in zip(prompt_ids, prompt_mask)]
    print(f"prompts: {args.prompts}, {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
          f"KV bytes per token {kvb}; decode weight bytes per step {decode_weight_bytes(cfg) / 1e6:.1f} MB", flush=True)

    hf = None
    if not args.skip_transformers:
        set_torch_threads(threads)
        start = time.perf_counter()
        hf = transformers_model(model_path)
        print(f"transformers load: {time.perf_counter() - start:.1f}s", flush=True)

    peaks = matmul_peaks(sorted({16, args.batch}), d_model=cfg.hidden_size, d_ff=cfg.intermediate_size,
                         min_seconds=0.05 if args.smoke else 0.5)
    results["matmul_gflops"] = peaks
    print("matmul GFLOP/s: " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()), flush=True)

    workloads = {
        "heavy-tailed": target_lengths(n, args.median, args.sigma, args.cut, seed=args.seed),
        "uniform": np.full(n, args.uniform, np.int64),
    }
    results["workloads"] = {}
    for name, targets in workloads.items():
        results["workloads"][name] = _run_workload(args, name, targets, model, split, hf, prompts, prompt_ids,
                                                   prompt_mask, pad_id, kvb)

    results["decode"] = []
    for slots in args.decode_slots:  # every request the same prompt (prompt 0)
        print(f"\n## decode-only: {slots} slots, {slots} requests x {args.decode_tokens} tokens", flush=True)
        run = run_engine(model, [prompts[0]], slots, np.full(slots, args.decode_tokens, np.int64), max_slots=slots,
                         page_size=args.page_size, num_pages=args.num_pages)
        results["decode"].append(_decode_row(cfg, kvb, slots, run))
    print(f"\n## host read bandwidth again ({bw_mib} MiB)", flush=True)
    bandwidth.append(read_bandwidth(bw_mib << 20, args.bandwidth_trials))
    print("  " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth[1].items()), flush=True)
    read_gbs = max(b["read"] for b in bandwidth)
    results["bandwidth_gbs"] = {"start": bandwidth[0], "end": bandwidth[1], "read": read_gbs}
    best_gflops = max(results["matmul_gflops"].values())
    for row in results["decode"]:
        row["fraction_of_read_bandwidth"] = row["gbs"] / read_gbs
        row["compute_ceiling_gbs"] = compute_ceiling_gbs(cfg, row["slots"], row["weight_bytes"] + row["kv_bytes"],
                                                         best_gflops)
        row["compute_ceiling_fraction"] = min(row["compute_ceiling_gbs"] / read_gbs, 1.0)
    results["peak_rss_mib"] = peak_rss_mib()
    return _report(args, results)


def _run_workload(args, name, targets, model, split, hf, prompts, prompt_ids, prompt_mask, pad_id, kvb) -> dict:
    useful = int(targets.sum())
    batches = static_batches(prompt_ids, prompt_mask, args.samples, targets, args.batch)
    print(f"\n## {name}: {len(targets)} requests, targets {targets.min()}-{targets.max()} "
          f"(median {np.median(targets):.0f}, mean {targets.mean():.1f}), {useful} useful tokens; "
          f"static batch maxima {[b['new_tokens'] for b in batches]}", flush=True)
    out = {"targets": targets.tolist(), "useful_tokens": useful, "load_average": os.getloadavg(), "sides": {}}

    run = run_engine(model, prompts, args.samples, targets, max_slots=args.batch, page_size=args.page_size,
                     num_pages=args.num_pages)
    c, st = run["call_stats"], run["stats"]
    print(f"  engine: warm-up {run['warmup_s']:.1f}s; {run['seconds']:.2f}s, {useful / run['seconds']:.1f} "
          f"useful tok/s; {c['decode_steps']} decode steps, {c['decode_seconds']:.2f}s decoding, "
          f"{st.get('prefill_seconds', 0.0):.2f}s prefilling; peak KV {run['peak_kv_bytes'] / 2**20:.1f} MiB "
          f"({run['peak_pages']} of {run['num_pages']} pages)", flush=True)
    out["sides"]["engine"] = run

    compile_s, programs = 0.0, {}
    for b in batches:  # one program per (bucketed batch, bucketed prompt width, max_new_tokens)
        programs.setdefault((bucket_length(b["ids"].shape[0], 8), bucket_length(b["ids"].shape[1], 16),
                             b["new_tokens"]), b)
    for b in programs.values():
        compile_s += compile_static(split, b["ids"], static_config(b["new_tokens"], pad_id), args.samples)
    static = {"seconds": 0.0, "warmup_s": compile_s, "batch_seconds": [], "compiled_in_call": False,
              "batch_new_tokens": [b["new_tokens"] for b in batches],
              "batch_prompt_widths": [int(b["ids"].shape[1]) for b in batches],
              "useful_tokens": useful, "generated_tokens": sum(len(b["targets"]) * b["new_tokens"] for b in batches),
              "peak_kv_bytes": max(bucket_length(len(b["targets"]), 8)
                                   * (bucket_length(b["ids"].shape[1], 16) + b["new_tokens"]) for b in batches) * kvb}
    print(f"  static: compile {compile_s:.1f}s ({len(programs)} programs)", flush=True)
    hf_side = None
    if hf is not None:
        hf_side = {"seconds": 0.0, "batch_seconds": [], "useful_tokens": useful,
                   "generated_tokens": static["generated_tokens"],
                   "peak_kv_bytes": kvb * max(len(b["targets"]) * (b["ids"].shape[1] + b["new_tokens"])
                                              for b in batches)}
        hf_side["warmup_s"] = run_transformers_batch(hf, batches[0], pad_id, 0, new_tokens=4)
        print(f"  transformers: warm-up {hf_side['warmup_s']:.1f}s", flush=True)
    for i, batch in enumerate(batches):
        run = run_static_batch(split, batch, args.samples, pad_id, jax.random.key(1000 + i))
        static["batch_seconds"].append(run["seconds"])
        static["compiled_in_call"] |= run["compiled_in_call"]
        line = f"  batch {i} ({batch['new_tokens']} tokens): static {run['seconds']:.2f}s"
        if hf_side is not None:
            seconds = run_transformers_batch(hf, batch, pad_id, 1000 + i)
            hf_side["batch_seconds"].append(seconds)
            line += f", transformers {seconds:.2f}s"
        print(line, flush=True)
    static["seconds"] = sum(static["batch_seconds"])
    if static["compiled_in_call"]:
        print("  NOTE: the static sampler compiled inside a timed call (the ahead-of-time compile missed)", flush=True)
    out["sides"]["static"] = static
    if hf_side is not None:
        hf_side["seconds"] = sum(hf_side["batch_seconds"])
        out["sides"]["transformers"] = hf_side
    for side in out["sides"].values():
        side["useful_tokens_per_s"] = useful / side["seconds"]
    for side in out["sides"].values():
        side["vs_static"] = side["useful_tokens_per_s"] / static["useful_tokens_per_s"]  # static: 1.0
    return out


def _decode_row(cfg, kvb, slots, run) -> dict:
    c = run["call_stats"]
    steps = max(int(c["decode_steps"]), 1)
    step_s = c["decode_seconds"] / steps
    weights = decode_weight_bytes(cfg)
    kv = c["live_kv_tokens_read"] * kvb / steps
    row = {"slots": slots, "decode_steps": steps, "step_ms": 1e3 * step_s, "weight_bytes": weights, "kv_bytes": kv,
           "gbs": (weights + kv) / step_s / 1e9, "tokens_per_step": c["decode_tokens"] / steps,
           "call_stats": c, "warmup_s": run["warmup_s"]}
    print(f"  {steps} steps, {row['step_ms']:.1f} ms/step, {row['tokens_per_step']:.1f} tokens/step, "
          f"{weights / 1e6:.0f} MB weights + {kv / 1e6:.1f} MB KV per step: {row['gbs']:.1f} GB/s", flush=True)
    return row


def _report(args, results) -> dict:
    print("\n## results\n")
    rows = []
    for name, w in results["workloads"].items():
        for side, r in w["sides"].items():
            rows.append([name, side, w["useful_tokens"], r["generated_tokens"], r["seconds"], r["useful_tokens_per_s"],
                         f"{r['vs_static']:.2f}x", r["peak_kv_bytes"] / 2**20, r["warmup_s"]])
    table = markdown_table(["targets", "side", "useful tokens", "generated tokens", "wall s", "useful tok/s",
                            "vs static", "peak KV MiB", "warm-up / compile s (not timed)"], rows)
    print(table)
    bw = results["bandwidth_gbs"]
    decode_table = None
    if results["decode"]:
        print()
        decode_table = markdown_table(
            ["slots", "decode steps", "ms/step", "tokens/step", "weight MB/step", "KV MB/step", "GB/s",
             "% of read bandwidth", "compute ceiling (% of read bandwidth)"],
            [[d["slots"], d["decode_steps"], d["step_ms"], d["tokens_per_step"], d["weight_bytes"] / 1e6,
              d["kv_bytes"] / 1e6, d["gbs"], f"{100 * d['fraction_of_read_bandwidth']:.0f}%",
              f"{100 * d['compute_ceiling_fraction']:.0f}%"]
             for d in results["decode"]],
        )
        print(decode_table)
    print(f"\nhost read bandwidth: {bw['read']:.1f} GB/s (best of jitted sum and {results['threads']}-thread "
          f"numpy sum, start and end); jitted sum {bw['start']['jax_sum']:.1f} / {bw['end']['jax_sum']:.1f} GB/s, "
          f"numpy copy "
          f"(read + write) {bw['start']['numpy_copy']:.1f} / {bw['end']['numpy_copy']:.1f} GB/s (start / end)")
    print("matmul GFLOP/s (same run): " + ", ".join(f"{k} {v:.0f}" for k, v in results["matmul_gflops"].items()))
    print(f"peak RSS: {results['peak_rss_mib']:.0f} MiB; "
          f"load average at start {results['environment']['load_average']}")
    results["table"], results["decode_table"] = table, decode_table
    ratio = {k: w["sides"]["engine"]["vs_static"] for k, w in results["workloads"].items()}
    decode_pct = 100 * min(d["fraction_of_read_bandwidth"] for d in results["decode"])
    last = (f"rollout engine vs static sampler: {ratio['heavy-tailed']:.2f}x useful tokens/s (heavy-tailed), "
            f"{ratio['uniform']:.2f}x (uniform); decode at {decode_pct:.0f}% of memory bandwidth")
    results["last_line"] = last
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    print(last)
    return results


if __name__ == "__main__":
    main()
