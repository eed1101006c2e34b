"""Attention over a paged KV cache: the KV write and ragged paged attention of the rollout engine.

The layout (one layer):

- ``k_pages`` ``[N, KVH, hd, page_size]`` and ``v_pages`` ``[N, KVH, page_size, hd]``: the page pools
  (:func:`pool_shapes`; :func:`to_pools` builds them from token-major ``[N, page_size, KVH, hd]``
  pages). Keys are stored transposed within a page so that both products of a decode step are
  batched matmuls on the gathered pages as they are, with no transposed copy (on CPU about a
  quarter of the attention's time; docs/paged-attention.md has the measurements). Page 0 is the
  null page: it is never given to a sequence, padded page-table entries point at it, and nothing
  read from it reaches an output.
- ``q`` ``[R, T, H, hd]`` (``H = KVH * G``, grouped-query heads): R rows of up to T query tokens
  (T = 1 in a decode step, T > 1 for a prefill chunk). Row r's query t sits at position
  ``q_start[r] + t`` for ``t < q_len[r]``; the others are padding (their output is 0).
- ``page_table`` ``[R, P]`` int32: position p of row r lives in page ``page_table[r, p // page_size]``
  at offset ``p % page_size``; entries past the row's pages are 0.
- ``kv_len`` ``[R]`` int32: the keys row r has after this step's write (``q_start + q_len``); a row
  with ``kv_len == 0`` is an idle slot (output 0).

Attention is causal (the query at position p sees keys at positions ``<= p`` and ``< kv_len``), with
the numerics of ``rljax.models.transformer._attention``: scores scaled by ``1/sqrt(hd)`` and
softmaxed in float32 or wider (float64 stays float64), masked with ``finfo.min``. So the engine's
logits equal the dense forward pass's.

Why several paths: a page pool is read through a gather, and what a gather costs depends on how
many pages it reads. ``impl="dense"`` gathers each row's P pages (work ∝ R × P × page_size: the
caller keeps P bucketed to the longest live row); ``impl="ragged"`` (T = 1) gathers only the live
(row, page) pairs and combines them with a segment softmax over rows (work ∝ the live tokens, not
R × the longest row); ``impl="pallas"`` calls JAX's TPU kernel. docs/paged-attention.md has the
measurements behind the default.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from rljax.models.transformer import _at_least_float32

IMPLS = ("auto", "dense", "ragged", "pallas")

# The logical axes of both pools (rljax.sharding): split over the mesh as the model's KV heads are.
POOL_AXES = (None, "kv_heads", None, None)


def pool_shapes(num_pages: int, page_size: int, kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
    """The shapes of one layer's key and value pools: ``[N, KVH, hd, page_size]``, ``[N, KVH, page_size, hd]``."""
    return (num_pages, kv_heads, head_dim, page_size), (num_pages, kv_heads, page_size, head_dim)


def to_pools(k_tokens, v_tokens):
    """Key and value pools from token-major pages ``[N, page_size, KVH, hd]`` (page n, offset p)."""
    return k_tokens.transpose(0, 2, 3, 1), v_tokens.transpose(0, 2, 1, 3)


def token_major(k_pages, v_pages):
    """The inverse of :func:`to_pools`: both pools as ``[..., page_size, KVH, hd]`` (leading page axes kept)."""
    n = k_pages.ndim
    k = jnp.moveaxis(k_pages, n - 1, n - 3)  # [..., ps, KVH, hd]
    v = jnp.swapaxes(v_pages, n - 3, n - 2)
    return k, v


def write_kv(k_pages, v_pages, k_new, v_new, page_table, q_start, q_len):
    """Scatter this step's keys and values ``[R, T, KVH, hd]`` into the pools at positions
    ``q_start + t``; padding tokens (``t >= q_len``) are dropped.

    Returns the new ``(k_pages, v_pages)``. One scatter per pool (``.at[page, ..., offset, ...].set``),
    so a jitted caller that donates the pools updates them in place instead of copying them.
    """
    N, KVH, hd, ps = _check_pool(k_pages, v_pages)
    R, T = k_new.shape[:2]
    if k_new.shape != (R, T, KVH, hd) or v_new.shape != k_new.shape:
        raise ValueError(f"write_kv: k_new {k_new.shape} and v_new {v_new.shape} must both be "
                         f"[R, T, KVH, hd] = [R, T, {KVH}, {hd}]")
    if page_table.shape[0] != R or q_start.shape != (R,) or q_len.shape != (R,):
        raise ValueError(f"write_kv: page_table {page_table.shape}, q_start {q_start.shape} and "
                         f"q_len {q_len.shape} must have R = {R} rows")
    P = page_table.shape[1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    pos = q_start[:, None] + t  # [R, T]
    page = jnp.take_along_axis(page_table, jnp.clip(pos // ps, 0, P - 1), axis=1)
    page = jnp.where(t < q_len[:, None], page, N).reshape(R * T)  # N: out of range, dropped
    offset = (pos % ps).reshape(R * T)
    k = k_new.reshape(R * T, KVH, hd).astype(k_pages.dtype)
    v = v_new.reshape(R * T, KVH, hd).astype(v_pages.dtype)
    return (k_pages.at[page, :, :, offset].set(k, mode="drop"),
            v_pages.at[page, :, offset, :].set(v, mode="drop"))


def ragged_paged_attention(q, k_pages, v_pages, page_table, kv_len, q_start, q_len, *,
                           live_pages: int | None = None, impl: str = "auto"):
    """Causal grouped-query attention of ``q`` ``[R, T, H, hd]`` over the paged keys and values;
    returns ``[R, T, H, hd]`` in ``q``'s dtype (0 for padding queries and idle rows).

    ``live_pages`` (static): an upper bound on ``sum_r ceil(kv_len[r] / page_size)``, needed by the
    ragged decode path (T = 1); the caller buckets it so few programs compile. A bound that is too
    small silently drops the last rows' pages. ``impl``: ``"dense"``, ``"ragged"``, ``"pallas"`` (the
    TPU kernel), or ``"auto"``: pallas on TPU, ragged for T = 1 with ``live_pages``, else dense.
    """
    R, T, H, hd = q.shape
    _, KVH, pool_hd, _ = _check_pool(k_pages, v_pages)
    if pool_hd != hd or H % KVH:
        raise ValueError(f"ragged_paged_attention: q heads {H} x {hd} do not fit the pool's "
                         f"{KVH} KV heads x {pool_hd} (H must be a multiple of KVH)")
    if page_table.shape[0] != R or kv_len.shape != (R,) or q_start.shape != (R,) or q_len.shape != (R,):
        raise ValueError(f"ragged_paged_attention: page_table {page_table.shape}, kv_len {kv_len.shape}, "
                         f"q_start {q_start.shape} and q_len {q_len.shape} must have R = {R} rows")
    if impl not in IMPLS:
        raise ValueError(f"ragged_paged_attention: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if jax.default_backend() == "tpu":
            impl = "pallas"
        else:
            impl = "ragged" if T == 1 and live_pages is not None else "dense"
    if impl == "ragged":
        if T != 1 or live_pages is None:
            raise ValueError(f"ragged_paged_attention: impl='ragged' is the decode path: it needs T = 1 "
                             f"(got {T}) and a static live_pages bound (got {live_pages})")
        out = _ragged_decode(q, k_pages, v_pages, page_table, kv_len, q_start, live_pages)
    elif impl == "pallas":
        out = _pallas(q, k_pages, v_pages, page_table, kv_len, q_len)
    else:
        out = _dense_gather(q, k_pages, v_pages, page_table, kv_len, q_start)
    valid = jnp.arange(T)[None, :] < q_len[:, None]
    return jnp.where(valid[:, :, None, None], out, 0).astype(q.dtype)


def _check_pool(k_pages, v_pages) -> tuple[int, int, int, int]:
    """``(N, KVH, hd, page_size)`` of a pair of pools (:func:`pool_shapes`), or a ValueError."""
    N, KVH, hd, ps = k_pages.shape if k_pages.ndim == 4 else (-1,) * 4
    if k_pages.ndim != 4 or v_pages.shape != (N, KVH, ps, hd):
        raise ValueError(f"paged attention: k_pages {k_pages.shape} and v_pages {v_pages.shape} must be "
                         f"[num_pages, KVH, hd, page_size] and [num_pages, KVH, page_size, hd]")
    return N, KVH, hd, ps


def _dense_gather(q, k_pages, v_pages, page_table, kv_len, q_start):
    """Each row's P pages gathered into ``[R, P * page_size]`` keys, attended with a position mask."""
    R, T, H, hd = q.shape
    _, KVH, _, ps = k_pages.shape
    G, S = H // KVH, page_table.shape[1] * ps
    k_rows, v_rows = token_major(k_pages[page_table], v_pages[page_table])  # [R, P, ps, KVH, hd]
    key_pos = jnp.arange(S, dtype=jnp.int32)
    in_row = key_pos[None, :] < kv_len[:, None]  # [R, S]
    visible = in_row[:, None, :] & (key_pos[None, None, :] <= (q_start[:, None] + jnp.arange(T)[None, :])[:, :, None])
    f = _at_least_float32(q.dtype)
    if T == 1:  # as _attention_one_query: multiply-and-reduce reads the gathered pages in place
        k = k_rows.reshape(R, S, KVH, hd)
        v = jnp.where(in_row[:, :, None, None], v_rows.reshape(R, S, KVH, hd), 0)  # NaN-safe
        scores = jnp.sum(q.reshape(R, 1, KVH, G, hd) * k[:, :, :, None, :], axis=-1)  # [R, S, KVH, G]
        scores = jnp.where(visible[:, 0, :, None, None], scores.astype(f) / math.sqrt(hd), jnp.finfo(f).min)
        probs = jax.nn.softmax(scores, axis=1).astype(v.dtype)
        return jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1).reshape(R, 1, H, hd)
    # Head-major gathers, [R, KVH, S, hd], so both products are plain batched matmuls (as _attention).
    k = k_rows.transpose(0, 3, 1, 2, 4).reshape(R, KVH, S, hd)
    v = v_rows.transpose(0, 3, 1, 2, 4).reshape(R, KVH, S, hd)
    v = jnp.where(in_row[:, None, :, None], v, 0)  # unwritten slots may hold anything, NaN included
    qt = q.reshape(R, T, KVH, G, hd).transpose(0, 2, 3, 1, 4).reshape(R, KVH, G * T, hd)
    scores = jnp.einsum("bkmh,bksh->bkms", qt, k).reshape(R, KVH, G, T, S)
    scores = jnp.where(visible[:, None, None], scores.astype(f) / math.sqrt(hd), jnp.finfo(f).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(R, KVH, G * T, S)
    out = jnp.einsum("bkms,bksh->bkmh", probs, v)
    return out.reshape(R, KVH, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(R, T, H, hd)


def _ragged_decode(q, k_pages, v_pages, page_table, kv_len, q_start, live_pages: int):
    """One query per row over only the live (row, page) pairs, combined by a segment softmax.

    The pairs are row-major: pair j belongs to the row whose page range (a cumulative sum of pages
    per row) holds j; pairs past the total point at page 0 and at row R, which every segment
    reduction drops. In the pools' layout both products are plain batched matmuls over the
    (pair, KV head) batch, with no transposed copy of the gathered pages: the scores
    ``[G, hd] x [hd, page_size]`` against the transposed keys, the mix ``[G, page_size] x [page_size, hd]``.
    """
    R, _, H, hd = q.shape
    _, KVH, _, ps = k_pages.shape
    G, P = H // KVH, page_table.shape[1]
    pages = jnp.minimum((kv_len + ps - 1) // ps, P)  # [R]
    ends = jnp.cumsum(pages)
    j = jnp.arange(live_pages, dtype=jnp.int32)
    row = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)  # R for the padding pairs
    live = row < R
    r = jnp.minimum(row, R - 1)
    index = j - (ends[r] - pages[r])  # page number within its row
    page = jnp.where(live, page_table[r, jnp.clip(index, 0, P - 1)], 0)
    key_pos = index[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, :]  # [L, ps]
    visible = (live[:, None] & (key_pos < kv_len[r][:, None]) & (key_pos <= q_start[r][:, None]))[:, None, None, :]
    f = _at_least_float32(q.dtype)
    k = k_pages[page]  # [L, KVH, hd, ps]
    v = jnp.where(jnp.swapaxes(visible, -1, -2), v_pages[page], 0)  # [L, KVH, ps, hd]; the pool may hold NaN
    qg = q[r, 0].reshape(live_pages, KVH, G, hd)
    scores = jnp.einsum("lkgh,lkhp->lkgp", qg, k, preferred_element_type=f) / math.sqrt(hd)  # [L, KVH, G, ps]
    scores = jnp.where(visible, scores, jnp.finfo(f).min)
    top = jax.ops.segment_max(jnp.max(scores, axis=-1), row, R, indices_are_sorted=True)  # [R, KVH, G]
    weights = jnp.where(visible, jnp.exp(scores - top[r][..., None]), 0)
    total = jax.ops.segment_sum(jnp.sum(weights, axis=-1), row, R, indices_are_sorted=True)
    mixed = jnp.einsum("lkgp,lkph->lkgh", weights, v.astype(f))  # [L, KVH, G, hd]
    out = jax.ops.segment_sum(mixed, row, R, indices_are_sorted=True)  # [R, KVH, G, hd]
    out = out / jnp.where(total > 0, total, 1)[..., None]
    return out.reshape(R, 1, H, hd)


def _pallas(q, k_pages, v_pages, page_table, kv_len, q_len):
    """JAX's TPU kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) on this layout."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    R, T, _, hd = q.shape
    args, token = _pallas_layout(q, k_pages, v_pages, page_table, kv_len, q_len)
    # Off a TPU (interpret mode, or compiling for a TPU target from a CPU host) the kernel's table of
    # tuned block sizes cannot look up the chip: small blocks.
    blocks = {} if jax.default_backend() == "tpu" else dict(
        num_kv_pages_per_block=min(page_table.shape[1], 8), num_queries_per_block=min(R * T, 8))
    packed = rpa.ragged_paged_attention(*args, sm_scale=1.0 / math.sqrt(hd), **blocks)
    return _pallas_unpack(packed, token, q.shape, k_pages.shape[2])


def _pallas_kv_heads(kv_heads: int, dtype) -> int:
    """The fewest KV heads, at least ``kv_heads``, whose interleaved K/V pool the kernel tiles: the
    combined heads over the dtype's packing (1 for float32, 2 for bfloat16) must be 1, 2, 4 or a
    multiple of 8 (so SmolLM2's 3 KV heads are padded to 4)."""
    packing = max(4 // jnp.dtype(dtype).itemsize, 1)
    n = kv_heads
    while (2 * n) % packing or not ((m := 2 * n // packing) in (1, 2, 4) or m % 8 == 0):
        n += 1
    return n


def _pallas_layout(q, k_pages, v_pages, page_table, kv_len, q_len):
    """The TPU kernel's arguments ``(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)``
    for this layout, and each ``(r, t)``'s token in the kernel's packed output ``[R * T]``.

    The kernel takes the live queries packed row after row (``cu_q_lens``), queries at the last
    ``q_len`` positions of each row (``kv_len - q_len + t``, which is ``q_start + t`` here), and one
    pool with K and V heads interleaved (``[N, page_size, 2 * KVH, hd]``, K at even heads), the KV
    heads padded with zeros to a count it tiles (:func:`_pallas_kv_heads`; the extra query heads are
    zeros too, dropped by :func:`_pallas_unpack`) and the head dim padded with zeros to a multiple of
    128 (its softmax statistics are 128 lanes wide; zeros change no score). The padded, interleaved
    pool is built on every call, a copy of both pools that an engine on TPU avoids by storing its
    pool that way.
    """
    R, T, H, hd = q.shape
    N, KVH, _, ps = k_pages.shape
    k_pages, v_pages = token_major(k_pages, v_pages)  # [N, ps, KVH, hd]
    G, kvh, hdp = H // KVH, _pallas_kv_heads(KVH, k_pages.dtype), -(-hd // 128) * 128
    pad = ((0, 0),) * 2 + ((0, kvh - KVH), (0, hdp - hd))
    kv = jnp.stack([jnp.pad(k_pages, pad), jnp.pad(v_pages, pad)], axis=3).reshape(N, ps, 2 * kvh, hdp)
    q = jnp.pad(q.reshape(R * T, KVH, G, hd), ((0, 0), (0, kvh - KVH), (0, 0), (0, hdp - hd)))
    q = q.reshape(R * T, kvh * G, hdp)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_len).astype(jnp.int32)])  # [R + 1]
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    live = t < q_len[:, None]
    token = jnp.where(live, starts[:-1, None] + t, R * T).reshape(R * T)  # R * T: out of range, dropped
    flat = jnp.zeros_like(q).at[token].set(q, mode="drop")
    args = (flat, kv, kv_len.astype(jnp.int32), page_table.astype(jnp.int32), starts, jnp.array([R], jnp.int32))
    return args, jnp.where(live.reshape(R * T), token, 0)


def _pallas_unpack(packed, token, shape, kv_heads: int):
    """The kernel's packed output ``[R * T, kvh * G, hdp]`` back to ``shape`` ``[R, T, H, hd]``
    (padding queries read token 0; the caller masks them)."""
    R, T, H, hd = shape
    G = H // kv_heads
    out = packed[token].reshape(R, T, -1, G, packed.shape[-1])[:, :, :kv_heads, :, :hd]
    return out.reshape(R, T, H, hd)
