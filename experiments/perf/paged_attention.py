"""One decode step's attention over a paged KV cache: which path is faster on this CPU?

Question: for the rollout engine's decode step (one query per row), is gathering each row's
``P = max pages`` pages (``impl="dense"``) or only the live (row, page) pairs with a segment softmax
(``impl="ragged"``) faster, and how do both compare with today's static sampler, which attends over
a padded cache of ``prompt width + max_new_tokens`` slots (``_attention_one_query``)?

Shapes: SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64), one layer, float32,
64 rows whose lengths are drawn from a log-normal (median 64 tokens, sigma 1 in log space, cut at
512; seed 0), page size 16; the padded cache is 576 slots (the issue's 64-token prompt + 512).
Also the KV write (``write_kv``) into a donated pool of two sizes: an in-place scatter costs the
same for both, a copy of the pool grows with it.

``--lengths R:T`` replaces the log-normal lengths by R rows of T keys each (the padded cache is then
T + 33 slots, a 32-token generation's cache as the static sampler buckets it, unless ``--padded``
says otherwise). Each program is jitted and warmed up; the median of ``--repeats`` timed calls is
reported, the paths interleaved so the machine's load hits all alike. The ragged path runs at the
exact live-page count, at the engine's bucket (``live_pages_bucket``) and at two coarser ones.

    python experiments/perf/paged_attention.py --repeats 50
    python experiments/perf/paged_attention.py --lengths 64:144 --repeats 40
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.inference.attention import pool_shapes, ragged_paged_attention, to_pools, write_kv
from rljax.inference.engine import live_pages_bucket
from rljax.models.transformer import _attention_one_query

PS, KVH, HD, H = 16, 3, 64, 9


def lengths(spec: str, seed: int = 0) -> np.ndarray:
    """``"heavy"``: 64 log-normal lengths (median 64, sigma 1, cut at 512); ``"R:T"``: R rows of T."""
    if spec != "heavy":
        rows, keys = (int(x) for x in spec.split(":"))
        return np.full(rows, keys, np.int32)
    rng = np.random.default_rng(seed)
    return np.clip(np.round(np.exp(rng.normal(np.log(64), 1.0, size=64))), 1, 512).astype(np.int32)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--lengths", default="heavy", help="'heavy' (log-normal) or R:T (R rows of T keys)")
    parser.add_argument("--padded", type=int, default=None, help="slots of the static sampler's padded cache")
    args = parser.parse_args()
    kv_len = lengths(args.lengths)
    R = len(kv_len)
    PADDED = args.padded or (576 if args.lengths == "heavy" else int(kv_len.max()) + 33)
    pages = -(-kv_len // PS)
    P, live = int(pages.max()), int(pages.sum())
    N = 1 + live
    rng = np.random.default_rng(1)
    ids = rng.permutation(np.arange(1, N)).astype(np.int32)
    table = np.zeros((R, P), np.int32)
    for r, start in enumerate(np.cumsum(pages) - pages):
        table[r, :pages[r]] = ids[start:start + pages[r]]
    f = jnp.float32
    k_pages, v_pages = to_pools(*(jnp.asarray(rng.normal(size=(N, PS, KVH, HD)), f) for _ in range(2)))
    q = jnp.asarray(rng.normal(size=(R, 1, H, HD)), f)
    kv = jnp.asarray(kv_len)
    q_start, q_len = kv - 1, jnp.ones(R, jnp.int32)
    k_pad = jnp.asarray(rng.normal(size=(R, PADDED, KVH, HD)), f)
    v_pad = jnp.asarray(rng.normal(size=(R, PADDED, KVH, HD)), f)
    key_mask = (jnp.arange(PADDED)[None] < kv[:, None]).astype(jnp.int32)
    print(f"rows {R}, lengths median {int(np.median(kv_len))} max {kv_len.max()} total {kv_len.sum()}; "
          f"pages: max per row {P}, live {live}; padded cache {PADDED}")

    attend = jax.jit(ragged_paged_attention, static_argnames=("live_pages", "impl"))
    calls = {
        f"dense gather, P = {P}": lambda: attend(q, k_pages, v_pages, jnp.asarray(table), kv, q_start, q_len,
                                                 impl="dense"),
        f"ragged, live_pages = {live}": lambda: attend(q, k_pages, v_pages, jnp.asarray(table), kv, q_start, q_len,
                                                       live_pages=live, impl="ragged"),
        **{f"ragged, live_pages = {b} (bucketed)": functools.partial(
            attend, q, k_pages, v_pages, jnp.asarray(table), kv, q_start, q_len, live_pages=b, impl="ragged")
           for b in sorted({live_pages_bucket(live), -(-live // 64) * 64, -(-live // 256) * 256} - {live})},
        f"padded {PADDED}-slot cache (_attention_one_query)": functools.partial(
            jax.jit(_attention_one_query), q, k_pad, v_pad, key_mask, q_start[:, None]),
    }
    ref = calls[f"dense gather, P = {P}"]()
    for name, call in calls.items():
        out = jax.block_until_ready(call())
        if "padded" not in name:
            assert np.allclose(out, ref, atol=1e-5), name
    times = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name:55s} {1e3 * statistics.median(ts):8.3f} ms (median of {len(ts)})")

    # The KV write into a donated pool: in place, the time does not grow with the pool.
    write = jax.jit(write_kv, donate_argnums=(0, 1))
    k_new = jnp.asarray(rng.normal(size=(R, 1, KVH, HD)), f)
    for pool_pages in (1024, 16384):
        pools = [jnp.zeros(shape, f) for shape in pool_shapes(pool_pages, PS, KVH, HD)]
        wtable = jnp.asarray(np.arange(R * P, dtype=np.int32).reshape(R, P) % (pool_pages - 1) + 1)
        ts = []
        for i in range(args.repeats + 1):
            start = time.perf_counter()
            pools = jax.block_until_ready(write(*pools, k_new, k_new, wtable, q_start, q_len))
            ts.append(time.perf_counter() - start)
        mib = 2 * pools[0].nbytes / 2**20
        print(f"write_kv, donated pools of {pool_pages} pages ({mib:.0f} MiB): "
              f"{1e3 * statistics.median(ts[1:]):.3f} ms (median of {args.repeats})")


if __name__ == "__main__":
    main()
