"""Seeds as a vmap axis: is one jitted, vmapped update over S seeds faster than S updates in a row?

Question (issue 15 section 5): purejaxrl runs the seeds of one setting as one program
(``jax.vmap`` over seeds of the whole update). Would ``rljax sweep`` gain from running the seeds of
one setting that way on this CPU? Measured on the update alone (loss + gradient + AdamW: the part
that vmaps without changing the sampler), for two shapes:

- ``tiny``: the random tiny Llama of the tests (2 layers, hidden 64; rljax.models.tiny), LoRA rank 16.
- ``main``: the main job's model, SmolLM2-135M-Instruct (float32) with LoRA rank 16 (alpha 32), a
  batch like the main job's update: 16 sequences x 150 tokens (64 prompt + 86 completion).

Both run GRPO's loss (``rljax.algorithms.grpo.loss``: clipped surrogate, ``seq_mean_token_mean``)
through ``rljax.update.apply_update`` with AdamW, on random token ids, log-probs and advantages
(the cost of an update does not depend on the values). Each seed has its own LoRA initialisation,
AdamW state and batch; the frozen base weights are shared (``in_axes=None``).

- sequential: one jitted update called once per seed (what S separate runs do), S calls.
- vmapped: ``jax.jit(jax.vmap(update, in_axes=(0, None, 0, 0)))``, one call for all S seeds.

The first call of each is a warm-up (the compile) and is not counted; the median of ``--repeats``
timed calls is reported, sequential and vmapped interleaved so the machine's load hits both alike.
The ratio is sequential / vmapped seconds for all S seeds (> 1: vmapped is faster).

Run (from the repository root):

    nice -n 10 python experiments/perf/vmap_seeds.py                 # both shapes, 3 seeds
    python experiments/perf/vmap_seeds.py --shapes tiny --seeds 3 --repeats 5

Measured (2026-11-24, 2-core CPU shared with five other jobs, load average ~20, 23 GB RAM shared):

    tiny, 3 seeds, 5 repeats: sequential 0.385 s, vmapped 0.765 s (sequential / vmapped 0.50);
                              first calls (compiles) 51 s and 56 s
    main: killed by the out-of-memory killer before any timing (4.6 GB resident with 3 seeds,
          8.2 GB with --seeds 2 --repeats 1): not measured on this machine

So vmapping seeds is not built into ``rljax sweep``: slower for the tiny model, and for the main
job's model S seeds' activations at once do not fit beside the other jobs here.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from rljax.algorithms import policy_gradient as pg  # noqa: E402
from rljax.algorithms import grpo  # noqa: E402
from rljax.batches import RolloutBatch  # noqa: E402
from rljax.models import load  # noqa: E402
from rljax.models.lora import add_lora, lora_trainable  # noqa: E402
from rljax.tools.reporting import markdown_table  # noqa: E402
from rljax.update import apply_update  # noqa: E402

SHAPES = {"tiny": dict(rows=16, prompt=32, completion=32), "main": dict(rows=16, prompt=64, completion=86)}


def _model(shape: str):
    if shape == "tiny":
        from rljax.models.tiny import make_tiny_model_dir

        path = make_tiny_model_dir(os.path.join(tempfile.mkdtemp(), "tiny"))
        model, _ = load(path)
    else:
        model, _ = load("smollm2-135m-instruct")
    return model


def _batch(rng: np.random.Generator, vocab: int, rows: int, prompt: int, completion: int) -> RolloutBatch:
    lengths = rng.integers(completion // 2, completion + 1, size=rows)
    mask = (np.arange(completion)[None, :] < lengths[:, None]).astype(np.int32)
    return RolloutBatch(
        prompt_ids=jnp.asarray(rng.integers(3, vocab, (rows, prompt)), jnp.int32),
        prompt_mask=jnp.ones((rows, prompt), jnp.int32),
        completion_ids=jnp.asarray(rng.integers(3, vocab, (rows, completion)), jnp.int32),
        completion_mask=jnp.asarray(mask), loss_mask=jnp.asarray(mask),
        old_logprobs=jnp.asarray(-rng.exponential(1.0, (rows, completion)), jnp.float32),
        scores=jnp.asarray(rng.random(rows), jnp.float32), row_mask=jnp.ones(rows, bool),
        finished=jnp.ones(rows, bool),
        advantages=jnp.asarray(rng.standard_normal((rows, 1)) * mask, jnp.float32))


def measure(shape: str, seeds: int, repeats: int) -> dict:
    base = _model(shape)
    cfg = grpo.GRPOConfig(group_size=4, prompts_per_step=4)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(2e-4))
    graphdef, frozen = None, None
    params, opt_states, batches = [], [], []
    rng = np.random.default_rng(0)
    for s in range(seeds):
        model = add_lora(base, rank=16, alpha=32.0, seed=s)
        graphdef, p, frozen = nnx.split(model, lora_trainable(), ...)
        params.append(p)
        opt_states.append(optimizer.init(p))
        batches.append(_batch(rng, base.config.vocab_size, **SHAPES[shape]))

    def update(p, fz, opt_state, batch):
        totals = pg.totals(batch)
        loss_fn = lambda m, b, **t: grpo.loss(m, b, cfg, temperature=1.0, **t)  # noqa: E731
        new_p, new_o, metrics = apply_update(graphdef, p, fz, opt_state, batch, loss_fn=loss_fn, totals=totals,
                                             optimizer=optimizer, num_micro=1)
        return new_p, new_o, metrics["loss"]

    one = jax.jit(update)
    many = jax.jit(jax.vmap(update, in_axes=(0, None, 0, 0)))
    stack = lambda xs: jax.tree.map(lambda *leaves: jnp.stack(leaves), *xs)  # noqa: E731
    sp, so, sb = stack(params), stack(opt_states), stack(batches)

    def sequential():
        return [one(params[s], frozen, opt_states[s], batches[s]) for s in range(seeds)]

    def vmapped():
        return many(sp, frozen, so, sb)

    compile_s = {}
    for name, fn in (("sequential", sequential), ("vmapped", vmapped)):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        compile_s[name] = time.perf_counter() - t
    # the same losses both ways: the vmapped program computes what the S runs would
    seq_loss = np.asarray([out[2] for out in sequential()])
    np.testing.assert_allclose(np.asarray(vmapped()[2]), seq_loss, rtol=2e-4, atol=1e-6)
    times = {"sequential": [], "vmapped": []}
    for _ in range(repeats):
        for name, fn in (("sequential", sequential), ("vmapped", vmapped)):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    seq, vm = float(np.median(times["sequential"])), float(np.median(times["vmapped"]))
    return {"shape": shape, "seeds": seeds, "tokens_per_seed": SHAPES[shape]["rows"] * (SHAPES[shape]["prompt"] +
            SHAPES[shape]["completion"]), "sequential_s": seq, "vmapped_s": vm, "ratio": seq / vm,
            "first_call_s": compile_s, "times": times, "load_average": os.getloadavg()}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,main", help="comma-separated: tiny, main (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = []
    for shape in args.shapes.split(","):
        r = measure(shape, args.seeds, args.repeats)
        results.append(r)
        print(f"# {shape}: sequential {r['sequential_s']:.3f} s, vmapped {r['vmapped_s']:.3f} s for {args.seeds} seeds "
              f"(ratio {r['ratio']:.2f}); first calls {r['first_call_s']}; load {r['load_average']}", flush=True)
    print(markdown_table(["shape", "seeds", "tokens/seed", "sequential s", "vmapped s", "sequential / vmapped"],
                         [[r["shape"], r["seeds"], r["tokens_per_seed"], r["sequential_s"], r["vmapped_s"], r["ratio"]]
                          for r in results]))
    return results


if __name__ == "__main__":
    main()
