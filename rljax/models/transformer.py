"""Decoder-only transformer of the Llama family (Llama, Mistral, Qwen2, Qwen3) in Flax NNX.

The layers' parameters are stacked along a leading ``layers`` axis and the blocks run under
``jax.lax.scan``. A full-sequence pass without a cache (training, scoring) unrolls that scan unless
``scan_layers`` is True: unrolled, the update is about 10% faster (the loop stacks every layer's
activations for the backward pass and slices its weights out each iteration) for a longer compile
(docs/performance.md#remat-and-scan). A rolled loop compiles as
fast for 30 layers as for one; set ``scan_layers=True`` (``load``, config ``model.scan_layers``)
for deep models whose compile time matters more. The KV-cached prefill always loops; decoding has
its own unrolled step over out-major weights (``decode_weights``). Every parameter carries logical
axis names (``Param.logical_axes``) that ``rljax.sharding`` maps to mesh axes.

Padding is on the left. Positions come from the attention mask (the first real token of a row is
position 0), and padded keys are masked out, so a padded row's logits equal those of the row alone.

The same code runs the full forward pass (training, scoring) and the KV-cached decode step
(sampling): ``forward`` with ``cache=None`` attends over its own keys; with a ``KVCache`` it writes
its keys and values at ``cache.index`` and attends over every valid slot up to its own.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models.config import ModelConfig, UnsupportedConfigError
from rljax.sharding import constrain

# Logical axes of the residual stream: pinning them keeps the batch split over the data axes
# inside a sharded step (XLA then gathers parameters, not activations). No-ops without a mesh.
_RESIDUAL = ("batch", "length", "act_embed")


# Projections LoRA can adapt, with their input and output axes (d model, n heads, k kv heads,
# h head dim, f MLP width).
LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

# Rematerialisation of the transformer blocks in training and scoring passes (``Transformer.remat``,
# config ``model.remat``): what the backward pass keeps of each block's forward pass. "none" keeps
# every intermediate; "block" keeps only each block's input and recomputes the rest (the least
# memory, one more forward pass of compute); "dots" also keeps the outputs of matmuls without batch
# dimensions (the weight projections), so only the cheap elementwise work and attention are redone.
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
_LORA_SPECS = {
    "wq": ("d", "nh"), "wk": ("d", "kh"), "wv": ("d", "kh"), "wo": ("nh", "d"),
    "w_gate": ("d", "f"), "w_up": ("d", "f"), "w_down": ("f", "d"),
}


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer, ``[L, B, S, KVH, hd]``; ``mask`` ``[B, S]`` marks valid slots.

    ``index`` is the slot the next forward pass writes to; slot order is time order.
    """

    keys: jax.Array
    values: jax.Array
    mask: jax.Array
    index: jax.Array  # int32 scalar

    @classmethod
    def empty(cls, config: ModelConfig, batch_size: int, max_length: int, dtype=jnp.float32) -> "KVCache":
        shape = (config.num_layers, batch_size, max_length, config.num_kv_heads, config.head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            mask=jnp.zeros((batch_size, max_length), jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )


@flax.struct.dataclass
class LayerKVCache:
    """The KV cache as one ``[B, S, KVH, hd]`` array per layer (tuples of length L); ``mask``/``index`` as
    :class:`KVCache`.

    The decode loop carries this form: each layer's arrays are whole buffers, so writing a step's
    keys is an in-place update and attention reads them where they lie. Slicing layer ``l`` out of
    the stacked ``[L, ...]`` arrays inside a loop costs XLA:CPU a copy of that slice every step.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    mask: jax.Array
    index: jax.Array

    @classmethod
    def from_stacked(cls, cache: "KVCache") -> "LayerKVCache":
        L = cache.keys.shape[0]
        return cls(tuple(cache.keys[l] for l in range(L)), tuple(cache.values[l] for l in range(L)),
                   cache.mask, cache.index)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Position ids ``[B, T]`` of a left-padded batch: 0 at each row's first real token."""
    return jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[hd/2]`` (float32), with linear or Llama-3 scaling as configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        # Mirrors transformers' _compute_llama3_parameters (modeling_rope_utils.py).
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype, *, length: int | None = None):
    """``(cos, sin)``, each ``[B, T, 1, hd]`` in ``dtype``, of the rotary angles ``positions ⊗ inv_freq``
    in Hugging Face's "rotate_half" layout (each half of ``hd`` repeats the ``hd/2`` frequencies).

    With ``length`` (a bound the caller guarantees: every position ``< length``), ``cos``/``sin`` are
    computed for positions ``0 .. length - 1`` and looked up per token. That is the training and
    scoring pass's case (positions counted from the mask, ``< T``), because on XLA:CPU,
    computed per token, ``cos``/``sin`` are fused into every consumer of the rotated ``q``/``k`` and
    evaluated again there, per head, per layer and in the backward pass (an ``optimization_barrier``
    does not stop it), while XLA does not fuse them into the operand of a gather (see
    docs/performance.md#rope-tables). The values are the same (an integer position's angle either way).
    """
    at = jnp.arange(length, dtype=jnp.float32) if length is not None else positions.astype(jnp.float32)
    freqs = jnp.asarray(inv_freq).reshape((1,) * at.ndim + (-1,))
    angles = at[..., None] * freqs  # [length, hd/2] or [B, T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    if length is not None:
        cos, sin = cos[positions], sin[positions]  # [B, T, hd]
    return cos[:, :, None, :], sin[:, :, None, :]


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding of ``x`` ``[B, T, N, hd]`` with :func:`rope_tables`' ``cos``/``sin`` ``[B, T, 1, hd]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 (float64 for float64 input), scaled by ``weight`` in the input dtype
    (as Hugging Face Llama)."""
    x32 = x.astype(_at_least_float32(x.dtype))
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return _lead(weight.astype(x.dtype), x.ndim) * normed.astype(x.dtype)


def _at_least_float32(dtype):
    """float32, or ``dtype`` if it is wider: float64 models (the tests' exact-equality checks) keep
    float64 through the steps that lift bfloat16 to float32."""
    return jnp.promote_types(dtype, jnp.float32)


def _lead(a: jax.Array, ndim: int) -> jax.Array:
    """``a`` with leading unit axes up to ``ndim`` (explicit broadcasting; rank promotion is an error)."""
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, init: str, fan_in: int | None = None) -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros" or rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        std = 0.02 if fan_in is None else 1.0 / math.sqrt(fan_in)
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class Transformer(nnx.Module):
    """A causal language model with an optional scalar value head on the final hidden state.

    Parameters (L layers, D model width, H/KVH query/key-value heads, hd head dim, F MLP width):
      embed [V, D]; layers.{attn_norm [L, D], wq [L, D, H, hd], wk/wv [L, D, KVH, hd],
      wo [L, H, hd, D], (bq [L, H, hd], bk/bv [L, KVH, hd]), (bo [L, D]), (q_norm/k_norm [L, hd]),
      mlp_norm [L, D], w_gate/w_up [L, D, F], w_down [L, F, D]}; final_norm [D]; lm_head [D, V]
      when untied; value_head {w [D], b [1]} when ``value_head=True`` (zero here; the loaders put in the
      checkpoint's head or a fresh normal(0.02) one, ``rljax.models.value_head``).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs | None = None,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        value_head: bool = False,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets: tuple[str, ...] = LORA_TARGETS,
        scan_layers: bool = False,
    ):
        self.config = config
        self.lora_scale = lora_alpha / lora_rank if lora_rank else 0.0
        self.dtype = dtype
        self.scan_layers = scan_layers  # static: a rolled layer loop in forward without a cache
        # static: completion log-probs over this many positions at a time (rljax.logprobs); None = all at once
        self.logits_chunk: int | None = None
        # static: rematerialisation of the blocks in passes without a cache (REMAT_POLICIES)
        self.remat: str = "none"
        # static: in passes without a cache, attention over this many queries at a time
        # (_chunked_causal_attention); None = every query at once
        self.attention_chunk: int | None = None
        c = config
        L, D, H, KVH, hd, F, V = (
            c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size,
        )
        p = lambda shape, axes, init="normal", fan_in=None: _param(rngs, shape, axes, param_dtype, init, fan_in)
        self.embed = p((V, D), ("vocab", "embed"))
        layers = {
            "attn_norm": p((L, D), ("layers", "norm"), "ones"),
            "wq": p((L, D, H, hd), ("layers", "embed", "heads", "head_dim"), fan_in=D),
            "wk": p((L, D, KVH, hd), ("layers", "embed", "kv_heads", "head_dim"), fan_in=D),
            "wv": p((L, D, KVH, hd), ("layers", "embed", "kv_heads", "head_dim"), fan_in=D),
            "wo": p((L, H, hd, D), ("layers", "heads", "head_dim", "embed"), fan_in=H * hd),
            "mlp_norm": p((L, D), ("layers", "norm"), "ones"),
            "w_gate": p((L, D, F), ("layers", "embed", "mlp"), fan_in=D),
            "w_up": p((L, D, F), ("layers", "embed", "mlp"), fan_in=D),
            "w_down": p((L, F, D), ("layers", "mlp", "embed"), fan_in=F),
        }
        if c.qkv_bias:
            layers["bq"] = p((L, H, hd), ("layers", "heads", "head_dim"), "zeros")
            layers["bk"] = p((L, KVH, hd), ("layers", "kv_heads", "head_dim"), "zeros")
            layers["bv"] = p((L, KVH, hd), ("layers", "kv_heads", "head_dim"), "zeros")
        if c.o_bias:
            layers["bo"] = p((L, D), ("layers", "embed"), "zeros")
        if c.qk_norm:
            layers["q_norm"] = p((L, hd), ("layers", "head_dim"), "ones")
            layers["k_norm"] = p((L, hd), ("layers", "head_dim"), "ones")
        if lora_rank:
            unknown = set(lora_targets) - set(LORA_TARGETS)
            if unknown:
                raise ValueError(f"unknown LoRA targets {sorted(unknown)}; choose from {LORA_TARGETS}")
            sizes = {"d": D, "n": H, "k": KVH, "h": hd, "f": F}
            names = {"d": "embed", "n": "heads", "k": "kv_heads", "h": "head_dim", "f": "mlp"}
            for name in lora_targets:
                ins, outs = _LORA_SPECS[name]
                fan_in = int(np.prod([sizes[a] for a in ins]))
                a_shape = (L, *[sizes[a] for a in ins], lora_rank)
                b_shape = (L, lora_rank, *[sizes[a] for a in outs])
                a = _param(rngs, a_shape, ("layers", *[names[x] for x in ins], "lora"), param_dtype, "normal", fan_in)
                b = _param(rngs, b_shape, ("layers", "lora", *[names[x] for x in outs]), param_dtype, "zeros")
                # LoRAParam, not Param: trainers select trainable weights by this type.
                layers[f"{name}_lora_a"] = nnx.LoRAParam(a[...], logical_axes=a.logical_axes)
                layers[f"{name}_lora_b"] = nnx.LoRAParam(b[...], logical_axes=b.logical_axes)
        self.layers = nnx.Dict(layers)
        self.final_norm = p((D,), ("norm",), "ones")
        self.lm_head = None if c.tie_word_embeddings else p((D, V), ("embed", "vocab"), fan_in=D)
        self.value_head = (
            nnx.Dict({"w": p((D,), ("embed",), "zeros"), "b": p((1,), ("unsharded",), "zeros")}) if value_head else None
        )

    # ------------------------------------------------------------------ public API
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Logits ``[B, T, V]`` (float32) of a left-padded batch."""
        hidden, _ = self.forward(input_ids, attention_mask)
        return self.logits(hidden)

    def forward(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final (normed) hidden states ``[B, T, D]`` and the updated cache (None without one).

        Without a cache the batch attends over itself (causal, padding masked). With a cache, its
        keys/values are written at slots ``cache.index .. cache.index + T`` and each query attends
        over the valid cache slots up to its own; ``positions`` then must be given by the caller
        (the sampler knows each row's length).

        ``segments`` ``[B, T]`` (int, passes without a cache): several sequences that share a prefix
        packed in one row (``rljax.logprobs.packed_completion_states``). Segment 0 is the shared
        prefix; a token of segment ``s > 0`` attends to earlier tokens of segment 0 and of ``s`` only,
        so each branch sees exactly what it would see alone after the prefix (its ``positions``
        must continue the prefix's).
        """
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((B, T), jnp.int32)
        attention_mask = attention_mask.astype(jnp.int32)
        rope_length = None  # positions counted from the mask are < T (rope_tables' bound)
        if positions is None:
            if cache is not None:
                raise ValueError("forward with a KV cache needs explicit positions")
            positions = positions_from_mask(attention_mask)
            rope_length = T
        if segments is not None and cache is not None:
            raise ValueError("segments are a setting of passes without a KV cache")
        total = T if cache is None else cache.keys.shape[2]
        if self.config.sliding_window is not None and total > self.config.sliding_window:
            raise UnsupportedConfigError(
                f"sequence/cache length {total} exceeds sliding_window={self.config.sliding_window}; "
                "sliding-window attention is not implemented"
            )
        x = constrain(self.embed[...].astype(self.dtype)[input_ids], _RESIDUAL)  # [B, T, D]
        rope = rope_tables(positions, rope_inverse_frequencies(self.config), self.dtype, length=rope_length)
        layers = {k: v[...] for k, v in self.layers.items()}
        if cache is None:
            key_mask = attention_mask
            query_slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
            block = lambda h, lp: self._block(h, lp, rope, None, None, key_mask, query_slots, 0,  # noqa: E731
                                              segments=segments)[0]
            if self.remat != "none":
                # the backward pass recomputes each block from its input, keeping only what the policy
                # saves. Unrolled, XLA would merge the recomputation with the forward pass (CSE) and
                # save nothing; a rolled loop cannot, and prevent_cse there only costs speed.
                block = jax.checkpoint(block, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan_layers)
            hidden, _ = jax.lax.scan(
                lambda h, lp: (block(h, lp), None),
                x,
                layers,
                unroll=1 if self.scan_layers else self.config.num_layers,
            )
            new_cache = None
        else:
            zero = jnp.zeros_like(cache.index)  # the index's int32, also under jax x64
            key_mask = jax.lax.dynamic_update_slice(cache.mask, attention_mask, (zero, cache.index))
            query_slots = jnp.broadcast_to(cache.index + jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))

            def step(carry, lp_and_layer):
                h, keys, values = carry
                lp, layer = lp_and_layer
                h, keys, values = self._block(h, lp, rope, keys, values, key_mask, query_slots, cache.index, layer)
                return (h, keys, values), None

            (hidden, keys, values), _ = jax.lax.scan(
                step, (x, cache.keys, cache.values), (layers, jnp.arange(self.config.num_layers, dtype=jnp.int32))
            )
            new_cache = KVCache(keys=keys, values=values, mask=key_mask, index=cache.index + T)
        hidden = rms_norm(hidden, self.final_norm[...], self.config.rms_norm_eps)
        return hidden, new_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Language-model logits ``[..., V]`` in float32 from final hidden states ``[..., D]``."""
        axes = _RESIDUAL if hidden.ndim == 3 else ("batch", "act_embed")
        hidden = constrain(hidden, axes)
        if self.lm_head is None:
            w = self.embed[...].astype(self.dtype)  # [V, D]
            out = jnp.einsum("...d,vd->...v", hidden, w)
        else:
            out = jnp.einsum("...d,dv->...v", hidden, self.lm_head[...].astype(self.dtype))
        return constrain(out.astype(_at_least_float32(out.dtype)), axes[:-1] + ("act_vocab",))

    def values(self, hidden: jax.Array) -> jax.Array:
        """Scalar value per position ``[..., ]`` (float32) from final hidden states."""
        if self.value_head is None:
            raise ValueError("this model was built without a value head (value_head=True)")
        w, b = self.value_head["w"][...], self.value_head["b"][...]
        f = _at_least_float32(hidden.dtype)
        return jnp.einsum("...d,d->...", hidden.astype(f), w.astype(f)) + b[0].astype(f)

    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        return KVCache.empty(self.config, batch_size, max_length, self.dtype)

    def decode_weights(self) -> dict:
        """The weights of :meth:`decode_step` and :meth:`decode_logits`, laid out for one-token matmuls.

        ``{"layers": [per-layer dicts], "head": [V, D]}``. Each layer's parameters are sliced out of
        the stacked ``[L, ...]`` arrays, and its projections are transposed to out-major ``[*out,
        *in]`` (cast to the compute dtype); ``head`` is the tied embedding itself, or the lm_head
        transposed. Build them once, outside a decode loop: inside ``lax.scan`` every layer's weights
        are copied out of the stack on every call, which on CPU costs about as much memory traffic as
        the matmuls. The slices were a copy already, so the transposed copies cost no more memory
        (one copy of the weights, of each device's shard under FSDP, during a generate call).
        Out-major because XLA:CPU's matmul library runs a one-token step's ``[B, in] @ [in, out]``
        slower than ``W[out, in] @ x[B, in]ᵀ`` (see :meth:`_proj` and docs/performance.md#out-major-decode-weights).
        """
        layers = {k: v[...] for k, v in self.layers.items()}
        out = []
        for l in range(self.config.num_layers):
            lp = {k: v[l] for k, v in layers.items()}
            for name, (ins, _) in _LORA_SPECS.items():
                w = lp[name].astype(self.dtype)
                lp[name] = w.transpose(*range(len(ins), w.ndim), *range(len(ins)))  # [*out, *in]
            out.append(lp)
        head = self.embed[...] if self.lm_head is None else self.lm_head[...].T
        return {"layers": out, "head": head.astype(self.dtype)}

    def decode_step(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        cache: LayerKVCache,
        weights: dict | None = None,
    ) -> tuple[jax.Array, LayerKVCache]:
        """One token per row through the layers, unrolled: hidden ``[B, 1, D]`` and the updated cache.

        ``input_ids``/``positions`` ``[B, 1]``. Same numbers as ``forward(input_ids, ones,
        positions=positions, cache=...)`` up to float32 rounding (the matmuls sum in another order);
        the layers run as a Python loop over ``weights`` (from :meth:`decode_weights`, built before the
        decode loop) and per-layer cache arrays.
        """
        B, T = input_ids.shape
        weights = self.decode_weights() if weights is None else weights
        x = constrain(self.embed[...].astype(self.dtype)[input_ids], _RESIDUAL)  # [B, T, D]
        rope = rope_tables(positions, rope_inverse_frequencies(self.config), self.dtype)
        zero = jnp.zeros_like(cache.index)  # the index's int32, also under jax x64
        key_mask = jax.lax.dynamic_update_slice(cache.mask, jnp.ones((B, T), jnp.int32), (zero, cache.index))
        query_slots = jnp.broadcast_to(cache.index + jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
        keys, values = [], []
        for lp, k, v in zip(weights["layers"], cache.keys, cache.values):
            x, k, v = self._block(x, lp, rope, k, v, key_mask, query_slots, cache.index, out_major=True)
            keys.append(k)
            values.append(v)
        hidden = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
        return hidden, LayerKVCache(tuple(keys), tuple(values), key_mask, cache.index + T)

    def decode_logits(self, hidden: jax.Array, weights: dict) -> jax.Array:
        """:meth:`logits` of one position per row, ``hidden`` ``[B, D]`` -> ``[B, V]`` float32, from
        :meth:`decode_weights`' out-major ``head``: ``(head @ hiddenᵀ)ᵀ`` (see :func:`_out_major_matmul`
        and docs/performance.md#out-major-decode-weights)."""
        hidden = constrain(hidden, ("batch", "act_embed"))
        out = _out_major_matmul(weights["head"], hidden)
        return constrain(out.astype(_at_least_float32(out.dtype)), ("batch", "act_vocab"))

    # ------------------------------------------------------------------ one block
    def _block(self, x, lp, rope, cache_keys, cache_values, key_mask, query_slots, write_index, layer=None,
               segments=None, out_major=False, attend=None):
        """Pre-norm attention + SwiGLU MLP. ``x`` [B, T, D]; ``lp`` this layer's parameters (projections
        out-major, from :meth:`decode_weights`, when ``out_major``). ``attend(q, k, v) -> (attn,
        cache_keys, cache_values)``, given, replaces the cache write and the attention (the paged KV
        cache of ``rljax.inference``): q ``[B, T, H, hd]`` and k, v ``[B, T, KVH, hd]`` after RoPE."""
        c, dt = self.config, self.dtype
        cast = lambda name: lp[name].astype(dt)
        x = constrain(x, _RESIDUAL)
        h = rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
        q = self._proj(h, lp, "wq", out_major)  # [B, T, H, hd]
        k = self._proj(h, lp, "wk", out_major)  # [B, T, KVH, hd]
        v = self._proj(h, lp, "wv", out_major)
        if c.qkv_bias:
            q, k, v = q + _lead(cast("bq"), 4), k + _lead(cast("bk"), 4), v + _lead(cast("bv"), 4)
        if c.qk_norm:
            q = rms_norm(q, lp["q_norm"], c.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        q = _apply_rope(q, *rope)
        k = _apply_rope(k, *rope)
        zero = jnp.zeros((), jnp.int32)
        if attend is not None:
            attn, cache_keys, cache_values = attend(q, k, v)
            return self._block_output(x, attn, lp, out_major), cache_keys, cache_values
        if cache_keys is None:
            all_k, all_v = k, v
        elif layer is None:  # this layer's own cache arrays [B, S, KVH, hd] (decode_step)
            start = (zero, write_index, zero, zero)
            cache_keys = jax.lax.dynamic_update_slice(cache_keys, k.astype(cache_keys.dtype), start)
            cache_values = jax.lax.dynamic_update_slice(cache_values, v.astype(cache_values.dtype), start)
            all_k, all_v = cache_keys, cache_values
        else:  # the stacked cache [L, B, S, KVH, hd]
            start = (layer, zero, write_index, zero, zero)
            cache_keys = jax.lax.dynamic_update_slice(cache_keys, k[None].astype(cache_keys.dtype), start)
            cache_values = jax.lax.dynamic_update_slice(cache_values, v[None].astype(cache_values.dtype), start)
            all_k, all_v = cache_keys[layer], cache_values[layer]  # [B, S, KVH, hd]
        if layer is None and cache_keys is not None and q.shape[1] == 1:
            attn = _attention_one_query(q, all_k.astype(dt), all_v.astype(dt), key_mask, query_slots)
        elif cache_keys is None and self.attention_chunk and q.shape[1] > self.attention_chunk:
            attn = _chunked_causal_attention(q, k, v, key_mask, self.attention_chunk, segments)
        else:
            attn = _attention(q, all_k.astype(dt), all_v.astype(dt), key_mask, query_slots,  # [B, T, H, hd]
                              segments, segments)
        return self._block_output(x, attn, lp, out_major), cache_keys, cache_values

    def _block_output(self, x, attn, lp, out_major):
        """The rest of a block after attention: output projection, residual, SwiGLU MLP, residual."""
        c = self.config
        out = self._proj(attn, lp, "wo", out_major)
        if c.o_bias:
            out = out + _lead(lp["bo"].astype(self.dtype), 3)
        x = x + out
        h = rms_norm(x, lp["mlp_norm"], c.rms_norm_eps)
        gate = self._proj(h, lp, "w_gate", out_major)
        up = self._proj(h, lp, "w_up", out_major)
        x = x + self._proj(jax.nn.silu(gate) * up, lp, "w_down", out_major)
        return constrain(x, _RESIDUAL)

    def _proj(self, x, lp, name, out_major=False):
        """``x @ W`` for projection ``name``, plus ``scale * (x @ A) @ B`` when it has LoRA weights.

        ``W`` is ``[*in, *out]``, or ``[*out, *in]`` when ``out_major`` (:meth:`decode_weights`)."""
        # One 2-D matmul [B*T, in] @ [in, out]: XLA:CPU runs the weight gradient of a 3-D einsum
        # (contracting over both B and T) through transposed copies, about 25% slower end to end.
        ins, outs = _LORA_SPECS[name]
        w = lp[name].astype(self.dtype)
        lead = x.shape[:2]
        if out_major:
            out_shape, in_shape = w.shape[:len(outs)], w.shape[len(outs):]
            x2 = x.reshape(-1, math.prod(in_shape))
            y = _out_major_matmul(w.reshape(math.prod(out_shape), -1), x2).reshape(*lead, *out_shape)
        else:
            in_shape, out_shape = w.shape[:len(ins)], w.shape[len(ins):]
            x2 = x.reshape(-1, math.prod(in_shape))
            y = (x2 @ w.reshape(math.prod(in_shape), -1)).reshape(*lead, *out_shape)
        if f"{name}_lora_a" in lp:
            a, b = lp[f"{name}_lora_a"].astype(self.dtype), lp[f"{name}_lora_b"].astype(self.dtype)
            low = x2 @ a.reshape(math.prod(in_shape), -1)  # [B*T, r]
            y = y + self.lora_scale * (low @ b.reshape(b.shape[0], -1)).reshape(*lead, *out_shape)
        return y


def _out_major_matmul(w: jax.Array, x: jax.Array) -> jax.Array:
    """``x @ wᵀ`` for ``w`` ``[out, in]`` and ``x`` ``[M, in]``, computed as ``(w @ xᵀ)ᵀ``.

    For the few rows of a decode step, XLA:CPU's matmul library (YNNPACK) runs ``w @ xᵀ`` about twice
    as fast as ``x @ w_in_out`` or ``x @ wᵀ`` (see docs/performance.md#out-major-decode-weights). The
    ``optimization_barrier`` keeps XLA from folding the final transpose into the dot's output layout,
    which turns it back into ``x @ wᵀ``; the transpose itself is of an ``[out, M]`` activation.
    """
    y = jax.lax.dot_general(w, x, (((1,), (1,)), ((), ())))  # [out, M]
    return jax.lax.optimization_barrier(y).T


def _attention(q, k, v, key_mask, query_slots, key_segments=None, query_segments=None):
    """Grouped-query causal attention over slots.

    q [B, T, H, hd]; k, v [B, S, KVH, hd]; key_mask [B, S] (1 = valid key); query_slots [B, T] (the
    slot each query sits in; it sees keys in slots <= its own). With ``key_segments`` [B, S] and
    ``query_segments`` [B, T], a query also sees only keys of segment 0 (a shared prefix) or of its
    own segment (``Transformer.forward``'s ``segments``). Softmax in float32.
    """
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    G = H // KVH
    visible = (key_mask[:, None, :] > 0) & (jnp.arange(S)[None, None, :] <= query_slots[:, :, None])  # [B, T, S]
    if key_segments is not None:
        kseg = key_segments[:, None, :]
        visible = visible & ((kseg == 0) | (kseg == query_segments[:, :, None]))
    # Head-major operands, [B, KVH, G*T, hd] and [B, KVH, S, hd], so both matmuls are plain batched
    # ones (batch dims leading, contracting the last dim) and each layout change moves whole
    # hd-vectors. Given "btkgh,bskh->bkgts" instead, XLA:CPU transposed q, k and the probabilities
    # element by element on its own (the timings: docs/performance.md#head-major-attention).
    qt = q.reshape(B, T, KVH, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KVH, G * T, hd)
    scores = jnp.einsum("bkmh,bksh->bkms", qt, k.transpose(0, 2, 1, 3)).reshape(B, KVH, G, T, S)
    f = _at_least_float32(scores.dtype)
    scores = jnp.where(visible[:, None, None], scores.astype(f) / math.sqrt(hd), jnp.finfo(f).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(B, KVH, G * T, S)
    out = jnp.einsum("bkms,bksh->bkmh", probs, v.transpose(0, 2, 1, 3))  # [B, KVH, G*T, hd]
    return out.reshape(B, KVH, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)


def _chunked_causal_attention(q, k, v, key_mask, chunk: int, segments=None):
    """:func:`_attention` of a pass without a cache (query ``t`` sees keys ``0..t``), ``chunk``
    queries at a time: the same numbers in ``O(chunk * T)`` memory instead of ``O(T^2)``.

    q [B, T, H, hd]; k, v [B, T, KVH, hd]; key_mask [B, T]; segments [B, T] or None (as
    :func:`_attention`'s). The chunks run one after another in a
    ``lax.map``, each over the full row of keys (the causal mask as in :func:`_attention`; T is padded
    to a multiple of ``chunk``, the padded queries dropped). A first version looped in Python with
    static key slices (half the work of a causal pass), but XLA kept every chunk's scores alive at
    once (about twice the temporaries; docs/performance.md#chunked-attention).
    Each chunk is a ``jax.checkpoint``: a backward pass keeps its inputs and recomputes its
    ``[B, H, chunk, T]`` scores, so no chunk's scores outlive it (without it the gradient would save
    every chunk's softmax, ``O(T^2)`` again).

    Why: the dense scores are ``B * H * T^2`` float32, the largest activation of a long pass once
    the logits are chunked (``model.logits_chunk``): 16 rows x 9 heads x 2112^2 x 4 bytes = 2.6 GB
    per layer for SmolLM2 at 2048 completion tokens (experiments/results/memory_scaling.md). This is
    the query-chunked form of memory-efficient attention (Rabe & Staats 2021, arXiv:2112.05682),
    without their key chunking: a chunk holds a full row of keys.
    """
    B, T, H, hd = q.shape
    n = -(-T // chunk)
    pad = n * chunk - T  # a short last chunk: padded queries, dropped below
    qs = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, n, chunk, H, hd).swapaxes(0, 1)
    slots = jnp.broadcast_to(jnp.arange(n * chunk, dtype=jnp.int32).reshape(n, 1, chunk), (n, B, chunk))
    if segments is None:
        block = jax.checkpoint(lambda qc, sc: _attention(qc, k, v, key_mask, sc))
        out = jax.lax.map(lambda xs: block(*xs), (qs, slots))  # [n, B, chunk, H, hd], one chunk after another
    else:
        segs = jnp.pad(segments, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)  # [n, B, chunk]
        block = jax.checkpoint(lambda qc, sc, gc: _attention(qc, k, v, key_mask, sc, segments, gc))
        out = jax.lax.map(lambda xs: block(*xs), (qs, slots, segs))
    return out.swapaxes(0, 1).reshape(B, n * chunk, H, hd)[:, :T]


def _attention_one_query(q, k, v, key_mask, query_slots):
    """:func:`_attention` for one query per row (T = 1), as multiply-and-reduce instead of dots.

    With T = 1 the dots are B * KVH tiny ``[G, hd] x [hd, S]`` products, which XLA:CPU runs through
    transposed copies of the cache; elementwise products reduced over ``hd`` and ``S`` read the cache
    in place. (Use it only on per-layer cache arrays: fused with a slice of the stacked cache inside
    a scan, XLA copied the whole cache every layer.)
    """
    B, T, H, hd = q.shape
    S, KVH = k.shape[1], k.shape[2]
    qg = q.reshape(B, 1, KVH, H // KVH, hd)
    f = _at_least_float32(q.dtype)
    scores = jnp.sum(qg * k[:, :, :, None, :], axis=-1).astype(f) / math.sqrt(hd)  # [B, S, KVH, G]
    visible = (key_mask > 0) & (jnp.arange(S)[None, :] <= query_slots)  # [B, S]
    scores = jnp.where(visible[:, :, None, None], scores, jnp.finfo(f).min)
    probs = jax.nn.softmax(scores, axis=1).astype(v.dtype)  # over S
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1)  # [B, KVH, G, hd]
    return out.reshape(B, T, H, hd)


def init_model(config: ModelConfig, *, seed: int = 0, **kwargs) -> Transformer:
    """A randomly initialised model (tests and from-scratch experiments); kwargs as :class:`Transformer`."""
    return Transformer(config, rngs=nnx.Rngs(params=seed), **kwargs)


def abstract_model(config: ModelConfig, **kwargs) -> Transformer:
    """The model's structure with ``jax.ShapeDtypeStruct`` leaves: allocates nothing."""
    return nnx.eval_shape(lambda: init_model(config, **kwargs))
