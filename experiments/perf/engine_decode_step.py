"""The rollout engine's decode step beside the static sampler's, same process, same prompts and lengths.

    PYTHONPATH=$PWD python experiments/perf/engine_decode_step.py --rows 16 64 [--steps 64]

For each row count: the static sampler's per-step time ``(generate(N = steps + 1) - generate(N =
1)) / steps`` (prefill cancels), the engine's decode step (``stats["decode_seconds"] /
stats["decode_steps"]`` over the same ``steps`` steps after the same prompts), and the engine's step
with attention and the KV write stubbed out (what the rest of the step costs). Beside them: the host's
read bandwidth (a jitted sum of a 1 GB array), the float32 matmul GFLOP/s at the decode's shapes, and
each step's achieved bandwidth, ``(weight bytes + live KV bytes) / step time`` (live KV: the keys and
values of the tokens in flight, what the engine reads; the static sampler reads its padded cache).

What the step's time goes to (docs/paged-attention.md has the numbers): at 16 rows, the projections'
matmuls (XLA:CPU's ``[R, 576] x [576, n]`` runs at tens of GFLOP/s here, reading the weights at
the matmul's rate, not the memory's); attention is a few percent. At 64 rows, the matmuls (2 x 64
rows x 135M parameters = 17 GFLOP a step: compute bound) and still a large share for the ragged
attention. The engine's per-call bookkeeping outside ``decode_seconds`` is not counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from _common import matmul_gflops  # noqa: E402

from rljax.inference import Engine, Request, model_step  # noqa: E402
from rljax.models import load  # noqa: E402
from rljax.sampling import SamplingConfig, generate  # noqa: E402


def host_bandwidth(gb: float = 1.0) -> float:
    """Best GB/s of a jitted sum over a ``gb`` GB float32 array (three tries)."""
    x = jnp.ones(int(gb * 2**30) // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    jax.block_until_ready(total(x))
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(total(x))
        best = max(best, x.nbytes / (time.perf_counter() - t) / 1e9)
    del x
    return best


def static_step(model, prompts, steps: int) -> float:
    """Seconds per decode step of ``rljax.sampling.generate`` (its prefill cancels out)."""
    ids = np.asarray(prompts, np.int32)
    mask = np.ones_like(ids)
    times = {}
    for n in (1, steps + 1):
        config = SamplingConfig(max_new_tokens=n, ignore_eos=True)
        run = lambda: jax.block_until_ready(generate(model, ids, mask, jax.random.key(0), config).tokens)  # noqa: E731
        run()  # compile
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t)
        times[n] = best
    return (times[steps + 1] - times[1]) / steps


def engine_step(model, prompts, steps: int, *, stub: bool = False) -> tuple[float, float]:
    """Seconds per engine decode step over the first ``steps`` steps after the prompts' prefill, and
    the mean live KV tokens per step. ``stub``: attention and the KV write replaced by identities."""
    saved = model_step.ragged_paged_attention, model_step.write_kv
    if stub:
        model_step.ragged_paged_attention = lambda q, *a, **k: q
        model_step.write_kv = lambda kp, vp, *a: (kp, vp)
    model_step.decode.clear_cache()
    try:
        S, ctx = len(prompts), len(prompts[0])
        eng = Engine(model, max_slots=S, page_size=16, num_pages=S * ((ctx + steps + 16) // 16 + 1) + 1)
        for round_ in range(2):  # the first round compiles every program this run needs
            for i, p in enumerate(prompts):
                eng.submit(Request(prompt_ids=list(p), max_tokens=steps + 1, seed=i))
            while any(s is not None and s.state != "decode" for s in eng._slots) or eng._waiting:
                eng.step()
            eng.stats.update(decode_seconds=0.0, decode_steps=0, live_kv_tokens_read=0)
            while eng.has_work():
                eng.step()
        return (eng.stats["decode_seconds"] / eng.stats["decode_steps"],
                eng.stats["live_kv_tokens_read"] / eng.stats["decode_steps"])
    finally:
        model_step.ragged_paged_attention, model_step.write_kv = saved
        model_step.decode.clear_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--no-stub", action="store_true")
    parser.add_argument("--no-static", action="store_true")
    args = parser.parse_args()
    model, _ = load("smollm2-135m-instruct", dtype=jnp.float32)
    cfg = model.config
    graphdef, *states = nnx.split(model)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model_step.decode_weights(graphdef, tuple(states))))
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    bw = host_bandwidth()
    print(f"load average {os.getloadavg()}; host read bandwidth {bw:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB "
          f"read per step; KV {kv_bytes_per_token} bytes/token", flush=True)
    rng = np.random.default_rng(0)
    for R in args.rows:
        prompts = rng.integers(100, 40000, size=(R, args.prompt)).tolist()
        gf = {n: matmul_gflops(R, cfg.hidden_size, n, min_seconds=0.2, trials=3) for n in (cfg.intermediate_size, cfg.vocab_size)}
        flops = 2 * R * weight_bytes / 4
        row = {}
        if not args.no_static:
            row["static sampler"] = (static_step(model, prompts, args.steps), R * (args.prompt + args.steps / 2))
        row["engine"] = engine_step(model, prompts, args.steps)
        if not args.no_stub:
            row["engine, attention stubbed"] = engine_step(model, prompts, args.steps, stub=True)
        print(f"rows {R}: matmul [{R}, {cfg.hidden_size}] x [{cfg.hidden_size}, n]: "
              + ", ".join(f"n={n}: {g:.0f} GFLOP/s" for n, g in gf.items())
              + f"; the step's matmuls are {flops / 1e9:.1f} GFLOP ({flops / 1e9 / max(gf.values()):.3f} s at the best rate); "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        for name, (sec, live) in row.items():
            moved = weight_bytes + live * kv_bytes_per_token
            print(f"  {name:28s} {sec * 1e3:8.1f} ms/step   {moved / sec / 1e9:5.2f} GB/s "
                  f"({100 * moved / sec / 1e9 / bw:4.1f}% of read bandwidth; live KV {live:.0f} tokens)", flush=True)


if __name__ == "__main__":
    main()
