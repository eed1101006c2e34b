"""Paged KV write and ragged paged attention (rljax.inference.attention) against dense attention.

The reference is the model's own ``_attention`` over each row's keys laid out densely (zeros past
the row's length); the pools hold NaN wherever nothing was written (page 0, unused pages, slots past
a row's length), so a read of anything but a row's live keys shows up as NaN in an output.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.inference.attention import (_pallas_kv_heads, _pallas_layout, _pallas_unpack, pool_shapes,
                                      ragged_paged_attention, to_pools, token_major, write_kv)
from rljax.models.transformer import _attention

PS = 4  # page size


def _case(kv_len, q_len, *, T, KVH=2, G=3, hd=8, seed=0, dtype=np.float32, fill=np.nan, spare_pages=3):
    """Random pools (shuffled page ids, ``fill`` where nothing was written), queries and the dense
    per-row keys and values the pools hold."""
    rng = np.random.default_rng(seed)
    kv_len, q_len = np.asarray(kv_len, np.int32), np.asarray(q_len, np.int32)
    R = len(kv_len)
    pages = -(-kv_len // PS)
    P = int(pages.max()) + 1  # one padded column at least
    N = 1 + int(pages.sum()) + spare_pages
    ids = rng.permutation(np.arange(1, N)).astype(np.int32)
    table = np.zeros((R, P), np.int32)
    for r, start in enumerate(np.cumsum(pages) - pages):
        table[r, :pages[r]] = ids[start:start + pages[r]]
    S = P * PS
    live = (np.arange(S)[None, :] < kv_len[:, None])[:, :, None, None]
    k_rows = np.where(live, rng.normal(size=(R, S, KVH, hd)), 0).astype(dtype)
    v_rows = np.where(live, rng.normal(size=(R, S, KVH, hd)), 0).astype(dtype)
    k_pages = np.full((N, PS, KVH, hd), fill, dtype)
    v_pages = np.full((N, PS, KVH, hd), fill, dtype)
    for r in range(R):
        for p in range(kv_len[r]):
            k_pages[table[r, p // PS], p % PS] = k_rows[r, p]
            v_pages[table[r, p // PS], p % PS] = v_rows[r, p]
    q = (2 * rng.normal(size=(R, T, KVH * G, hd))).astype(dtype)
    k_pages, v_pages = to_pools(k_pages, v_pages)
    arrays = dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=table, kv_len=kv_len,
                  q_start=kv_len - q_len, q_len=q_len)
    return {name: jnp.asarray(a) for name, a in arrays.items()}, jnp.asarray(k_rows), jnp.asarray(v_rows)


@jax.jit  # one program per case's shapes, not ~20 eager ones (the reference is compared to a tolerance)
def _dense(case, k_rows, v_rows):
    """``_attention`` over the dense per-row keys; padding queries 0."""
    T, S = case["q"].shape[1], k_rows.shape[1]
    key_mask = (jnp.arange(S)[None, :] < case["kv_len"][:, None]).astype(jnp.int32)
    slots = case["q_start"][:, None] + jnp.arange(T)[None, :]
    out = _attention(case["q"], k_rows, v_rows, key_mask, slots)
    return jnp.where((jnp.arange(T)[None, :] < case["q_len"][:, None])[:, :, None, None], out, 0)


def _attend(case, jit, **kw):
    fn = jax.jit(ragged_paged_attention, static_argnames=("live_pages", "impl")) if jit else ragged_paged_attention
    names = ("q", "k_pages", "v_pages", "page_table", "kv_len", "q_start", "q_len")
    return fn(*(case[n] for n in names), **kw)


def _close(out, ref, tol):
    """Equal to ``tol`` relative to the largest value (outputs are averages of values)."""
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.isfinite(out).all()
    scale = max(float(np.abs(ref).max()), 1.0)
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol * scale)


# Decode rows: idle, one key, one short of a page, exactly one and three pages, one past a page.
DECODE_LENS = [0, 1, PS - 1, PS, 3 * PS, PS + 1, 2 * PS + 3, 0, 7]


def _decode_lens():
    kv_len = np.array(DECODE_LENS)
    return kv_len, np.minimum(kv_len, 1)


def _live_pages(kv_len):
    return int((-(-np.asarray(kv_len) // PS)).sum())


@pytest.mark.parametrize("impl,extra", [("dense", None), ("ragged", 0), ("ragged", 5)],
                         ids=["dense", "ragged-exact", "ragged-padded-pairs"])
@pytest.mark.parametrize("G,jit", [(3, False), (3, True), (1, True)], ids=["gqa-eager", "gqa-jit", "mha-jit"])
def test_decode_equals_dense_attention(jit, impl, extra, G):
    kv_len, q_len = _decode_lens()
    case, k_rows, v_rows = _case(kv_len, q_len, T=1, G=G)
    kw = {"impl": impl} if extra is None else {"impl": impl, "live_pages": _live_pages(kv_len) + extra}
    out = _attend(case, jit, **kw)
    assert out.shape == case["q"].shape and out.dtype == jnp.float32
    _close(out, _dense(case, k_rows, v_rows), 1e-5)
    idle = np.asarray(kv_len) == 0
    assert (np.asarray(out)[idle] == 0).all()


def test_auto_picks_ragged_for_decode_and_dense_otherwise():
    kv_len, q_len = _decode_lens()
    case, _, _ = _case(kv_len, q_len, T=1)
    live = _live_pages(kv_len)
    np.testing.assert_array_equal(_attend(case, False, live_pages=live),
                                  _attend(case, False, live_pages=live, impl="ragged"))
    np.testing.assert_array_equal(_attend(case, False), _attend(case, False, impl="dense"))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_prefill_chunk_equals_dense_causal_attention(jit):
    # Rows: a first chunk, a later chunk (q_start > 0) ending on a page boundary, a partial chunk,
    # one query, an idle slot, a chunk crossing two page boundaries.
    kv_len = [5, 3 * PS, 9, 6, 0, 2 * PS + 5]
    q_len = [5, 5, 2, 1, 0, 5]
    case, k_rows, v_rows = _case(kv_len, q_len, T=5)
    out = _attend(case, jit)
    _close(out, _dense(case, k_rows, v_rows), 1e-5)
    assert (np.asarray(out)[np.arange(5)[None, :] >= np.asarray(q_len)[:, None]] == 0).all()


@pytest.mark.parametrize("T,impl", [(1, "dense"), (1, "ragged"), (4, "dense")])
def test_float64_is_exactly_dense_attention(T, impl):
    with jax.enable_x64(True):
        kv_len = np.array([0, 1, PS, 2 * PS + 1, 3 * PS - 1, 6])
        q_len = np.minimum(kv_len, T)
        case, k_rows, v_rows = _case(kv_len, q_len, T=T, dtype=np.float64, seed=3)
        kw = {"live_pages": _live_pages(kv_len) + 2} if impl == "ragged" else {}
        out = _attend(case, True, impl=impl, **kw)
        assert out.dtype == jnp.float64
        _close(out, _dense(case, k_rows, v_rows), 1e-12)


@pytest.mark.parametrize("T,impl", [(1, "dense"), (1, "ragged"), (5, "dense")])
def test_bfloat16_stays_bfloat16_and_within_its_rounding(T, impl):
    kv_len = np.array([0, 1, PS, 2 * PS + 1, 3 * PS - 1, 6])
    case, k_rows, v_rows = _case(kv_len, np.minimum(kv_len, T), T=T, seed=4)
    half = {n: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for n, a in case.items()}
    kw = {"live_pages": _live_pages(kv_len)} if impl == "ragged" else {}
    out = _attend(half, True, impl=impl, **kw)
    assert out.dtype == jnp.bfloat16
    _close(out.astype(jnp.float32), _dense(case, k_rows, v_rows), 1e-2)  # bfloat16 keeps 8 bits


@pytest.mark.parametrize("impl", ["dense", "ragged"])
def test_garbage_in_unwritten_slots_does_not_reach_the_output(impl):
    kv_len, q_len = _decode_lens()
    kw = {"live_pages": _live_pages(kv_len) + 3} if impl == "ragged" else {}
    outs = [_attend(_case(kv_len, q_len, T=1, fill=fill)[0], True, impl=impl, **kw) for fill in (0.0, np.nan, 1e30)]
    for out in outs:
        assert np.isfinite(np.asarray(out)).all()
        np.testing.assert_array_equal(out, outs[0])


def test_write_kv_writes_each_row_to_its_own_pages_and_drops_padding():
    rng = np.random.default_rng(5)
    R, T, KVH, hd, P, N = 4, 6, 2, 3, 5, 24
    table = np.zeros((R, P), np.int32)
    ids = rng.permutation(np.arange(1, N))
    q_start = np.array([0, PS - 2, 7, 2 * PS], np.int32)
    q_len = np.array([6, 4, 0, 1], np.int32)
    for r in range(R):  # the pages each row holds after the write (no more)
        n = -(-(q_start[r] + q_len[r]) // PS)
        table[r, :n] = ids[5 * r:5 * r + n]
    pools = [rng.normal(size=(N, PS, KVH, hd)).astype(np.float32) for _ in range(2)]  # token-major
    new = [rng.normal(size=(R, T, KVH, hd)).astype(np.float32) for _ in range(2)]
    expected = [p.copy() for p in pools]
    for r in range(R):
        for t in range(q_len[r]):
            pos = q_start[r] + t
            for e, n_ in zip(expected, new):
                e[table[r, pos // PS], pos % PS] = n_[r, t]
    args = (jnp.asarray(table), jnp.asarray(q_start), jnp.asarray(q_len))
    eager = write_kv(*to_pools(*map(jnp.asarray, pools)), *map(jnp.asarray, new), *args)
    jitted = jax.jit(write_kv, donate_argnums=(0, 1))(*to_pools(*map(jnp.asarray, pools)), *map(jnp.asarray, new), *args)
    for got in (eager, jitted):
        for g, e in zip(token_major(*got), expected):
            np.testing.assert_array_equal(g, e)  # every other slot, page 0 included, unchanged


def test_write_kv_into_donated_pools_copies_no_pool():
    """In place: with the pools donated the compiled program aliases them to its outputs and holds
    no copy of a pool; without donation XLA must copy both (so the check can see a copy)."""
    k_pool, v_pool = (jax.ShapeDtypeStruct(shape, jnp.float32) for shape in pool_shapes(64, PS, 2, 8))
    new = jax.ShapeDtypeStruct((3, 2, 2, 8), jnp.float32)
    rows = jax.ShapeDtypeStruct((3,), jnp.int32)
    args = (k_pool, v_pool, new, new, jax.ShapeDtypeStruct((3, 4), jnp.int32), rows, rows)
    pool_copies = lambda hlo: [line for line in hlo.splitlines()
                               if "copy(" in line and ("f32[64,2,8,4]" in line or "f32[64,2,4,8]" in line)]
    donated = jax.jit(write_kv, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    assert pool_copies(donated) == [] and "input_output_alias" in donated
    assert len(pool_copies(jax.jit(write_kv).lower(*args).compile().as_text())) == 2


def test_chunked_prefill_then_decode_through_write_kv_equals_dense_causal_attention():
    """The engine's sequence of calls: two prefill chunks and a decode step written with write_kv
    and attended, against one dense causal pass over the whole sequence."""
    rng = np.random.default_rng(7)
    R, KVH, G, hd, T = 3, 2, 2, 4, 4
    lens = np.array([9, 4, 6])  # tokens per row: prompt chunks of T, then one decode token
    L = int(lens.max())
    k_all, v_all = (jnp.asarray(rng.normal(size=(R, L, KVH, hd)), jnp.float32) for _ in range(2))
    q_all = jnp.asarray(2 * rng.normal(size=(R, L, KVH * G, hd)), jnp.float32)
    N, P = 16, -(-L // PS)
    table = jnp.asarray(rng.permutation(np.arange(1, N))[:R * P].reshape(R, P).astype(np.int32))
    pools = [jnp.full(shape, jnp.nan, jnp.float32) for shape in pool_shapes(N, PS, KVH, hd)]
    write, attend = jax.jit(write_kv), jax.jit(ragged_paged_attention, static_argnames=("live_pages", "impl"))
    outs = np.zeros((R, L, KVH * G, hd), np.float32)
    starts = [0, T, 2 * T]  # two chunks of T, then one token (rows shorter than a step sit idle)
    for step, start in enumerate(starts):
        width = T if step < 2 else 1
        q_start = jnp.full(R, start, jnp.int32)
        q_len = jnp.asarray(np.clip(lens - start, 0, width).astype(np.int32))
        kv_len = jnp.where(q_len > 0, q_start + q_len, 0)
        sl = lambda a: jnp.pad(a, ((0, 0), (0, 3 * T), (0, 0), (0, 0)))[:, start:start + width]
        pools = write(*pools, sl(k_all), sl(v_all), table, q_start, q_len)
        kw = {"live_pages": R * P} if width == 1 else {}
        out = np.asarray(attend(sl(q_all), *pools, table, kv_len, q_start, q_len, **kw))
        for r in range(R):
            outs[r, start:start + int(q_len[r])] = out[r, :int(q_len[r])]
    key_mask = (jnp.arange(L)[None, :] < lens[:, None]).astype(jnp.int32)
    ref = np.asarray(_attention(q_all, k_all, v_all, key_mask, jnp.broadcast_to(jnp.arange(L), (R, L))))
    ref = np.where((np.arange(L)[None, :] < lens[:, None])[:, :, None, None], ref, 0)
    _close(outs, ref, 1e-5)


@pytest.mark.parametrize("KVH", [2, 3])  # 3 KV heads (SmolLM2) are padded to 4 for the kernel
def test_the_tpu_kernel_layout_gives_the_kernel_reference_the_same_attention(KVH):
    """The conversion for JAX's TPU kernel, checked through the kernel's own pure-JAX reference
    (``ref_ragged_paged_attention``, same argument layout); the kernel itself needs a TPU."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    kv_len = [3 * PS, 0, 9, 1]
    q_len = [5, 0, 2, 1]
    case, k_rows, v_rows = _case(kv_len, q_len, T=5, KVH=KVH, fill=0.0)  # the reference reads whole pages
    names = ("q", "k_pages", "v_pages", "page_table", "kv_len", "q_len")
    args, token = _pallas_layout(*(case[n] for n in names))
    R, T, H, hd = case["q"].shape
    packed = ref_ragged_paged_attention(*args, sm_scale=1.0 / np.sqrt(hd))  # [sum(q_len), H', hd]
    packed = jnp.concatenate([packed, jnp.zeros((R * T - packed.shape[0], *packed.shape[1:]))])
    out = _pallas_unpack(packed, token, (R, T, H, hd), KVH)
    valid = (np.arange(T)[None, :] < np.asarray(q_len)[:, None])[:, :, None, None]
    _close(jnp.where(valid, out, 0), _dense(case, k_rows, v_rows), 1e-5)


def test_tpu_kernel_head_padding():
    assert [_pallas_kv_heads(n, jnp.float32) for n in (1, 2, 3, 4, 5, 8, 12)] == [1, 2, 4, 4, 8, 8, 12]
    assert [_pallas_kv_heads(n, jnp.bfloat16) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def test_bad_arguments_are_named():
    kv_len, q_len = _decode_lens()
    case, _, _ = _case(kv_len, q_len, T=1)
    with pytest.raises(ValueError, match="impl must be one of"):
        _attend(case, False, impl="flash")
    with pytest.raises(ValueError, match="live_pages"):
        _attend(case, False, impl="ragged")
    case2, _, _ = _case([5], [2], T=2)
    with pytest.raises(ValueError, match="T = 1"):
        _attend(case2, False, impl="ragged", live_pages=2)
    with pytest.raises(ValueError, match="KV heads"):
        ragged_paged_attention(case["q"][..., :5, :], *(case[n] for n in ("k_pages", "v_pages", "page_table",
                                                                          "kv_len", "q_start", "q_len")))
