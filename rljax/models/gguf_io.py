"""Import a GGUF checkpoint (llama.cpp's file format) as a Hugging Face config, state dict and tokenizer.

`read_gguf(path)` turns one `.gguf` file into what a Hugging Face model directory would hold:

- `hf_config`: the `config.json` dict (Llama, Qwen2 or Qwen3 layout),
- `state_dict`: float32 numpy arrays under Hugging Face names, in torch layout (`[out, in]`),
- `tokenizer`: a `transformers.PreTrainedTokenizerFast` with the file's chat template,

so the rest of rljax loads a GGUF through the same path as a safetensors checkpoint.

What llama.cpp's `convert_hf_to_gguf.py` changed, and how it is undone here:

- Tensor names (`blk.3.attn_q.weight`) are mapped back to Hugging Face names (`_LAYER_NAMES`).
- Dimensions are listed fastest-moving first (`ne0` = the input width); reversed, they are torch's order.
- Weights may be quantised (Q4_1, Q8_0, K-quants, ...): `gguf.quants.dequantize` unpacks them to float32.
- For the `llama` architecture the rows of `q_proj` and `k_proj` are permuted per head, from
  Hugging Face's "first half / second half" RoPE layout to llama.cpp's interleaved pairs
  (`LlamaModel.permute`); `unpermute_rope_rows` applies the inverse. Qwen2/Qwen3 files are not permuted.

The tokenizer is built with the `tokenizers` library from the vocabulary, merges and token types in
the metadata. For a byte-level BPE vocabulary (`tokenizer.ggml.model == "gpt2"`) the text is split
before BPE the way llama.cpp splits it for the file's `tokenizer.ggml.pre` type, which is how the
model's own tokenizer was trained (see `_byte_level_pre_tokenizer`). This module never imports torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np

from rljax.models.finite import require_finite

__all__ = [
    "GGUFCheckpoint",
    "SUPPORTED_ARCHITECTURES",
    "read_gguf",
    "read_gguf_metadata",
    "hf_config_from_gguf_metadata",
    "tokenizer_from_gguf_metadata",
    "unpermute_rope_rows",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# Metadata arrays too long to be worth keeping on `GGUFCheckpoint.metadata`: the tokenizer holds them.
_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.precompiled_charsmap",
)

# llama.cpp's token types (gguf.TokenType): 3 is CONTROL (special, like `<|im_end|>`), 4 USER_DEFINED.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# `blk.{i}.<gguf suffix>` -> `model.layers.{i}.<hf suffix>`
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")

_HF_MODEL = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """One GGUF file, converted to what a Hugging Face model directory holds.

    Attributes:
        hf_config: the `config.json` dict for this model (transformers 5 layout, with `rope_parameters`
            and, for older readers, a top-level `rope_theta`).
        state_dict: Hugging Face parameter name -> float32 array in torch layout (`[out, in]` for a
            linear weight, `[vocab, hidden]` for the embedding). `lm_head.weight` only when untied.
        tokenizer: a `transformers.PreTrainedTokenizerFast` with the file's chat template.
        path: the file read.
        metadata: the file's metadata, less the tokenizer's long arrays (tokens, merges, types, scores).
    """

    hf_config: dict
    state_dict: dict[str, np.ndarray]
    tokenizer: Any
    path: str = ""
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read a GGUF file into a Hugging Face config, a float32 state dict and a tokenizer.

    The file is memory-mapped (`gguf.GGUFReader`); each tensor is dequantised once, straight into
    its float32 array. Supports the `llama` (also Mistral, which llama.cpp writes as `llama`),
    `qwen2` and `qwen3` architectures.

    Raises:
        ValueError: for another architecture, a tensor this reader does not know, RoPE scaling it
            cannot express (a `rope_freqs.weight` tensor, YaRN), or a tensor holding NaN or inf.
    """
    path = os.fspath(path)
    reader = _Reader(path)
    metadata = _reader_metadata(reader)
    tensor_names = tuple(tensor.name for tensor in reader.tensors)
    hf_config = hf_config_from_gguf_metadata(metadata, tensor_names)

    permute_rope = metadata["general.architecture"] == "llama"
    n_heads = hf_config["num_attention_heads"]
    n_kv_heads = hf_config["num_key_value_heads"]

    state_dict = {}
    for tensor in reader.tensors:
        hf_name = _hf_tensor_name(tensor.name)
        # GGUF lists dimensions fastest-moving first; torch lists them slowest first.
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if permute_rope and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = unpermute_rope_rows(weights, n_heads)
        elif permute_rope and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = unpermute_rope_rows(weights, n_kv_heads)
        # Never a view into the memory-mapped file (F32 tensors dequantise to one): a fresh,
        # writable, contiguous float32 array, copied only where it is not one already.
        if np.may_share_memory(weights, tensor.data):
            weights = weights.copy()
        state_dict[hf_name] = require_finite(np.ascontiguousarray(weights, dtype=np.float32), tensor=tensor.name,
                                             source=path)

    tokenizer = tokenizer_from_gguf_metadata(metadata, name_or_path=path)
    kept = {key: value for key, value in metadata.items() if key not in _TOKENIZER_ARRAYS}
    return GGUFCheckpoint(hf_config, state_dict, tokenizer, path, kept)


def read_gguf_metadata(path: str | os.PathLike) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`(metadata, tensor_names)` of a GGUF file, without dequantising any tensor.

    Metadata values are plain Python: str, int, float, bool, or lists of those. Float32 values are
    given as the shortest decimal that round-trips in float32 (`1e-05`, not `9.99999974e-06`).
    """
    reader = _Reader(os.fspath(path))
    return _reader_metadata(reader), tuple(tensor.name for tensor in reader.tensors)


def unpermute_rope_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a q/k projection (weight `[out, in]` or bias `[out]`).

    llama.cpp stores each head's rows as interleaved rotary pairs; Hugging Face stores the first
    halves of the pairs, then the second halves. llama.cpp's `permute` is
    `w.reshape(n_heads, 2, rows_per_head // 2, ...).swapaxes(1, 2)`; this is its inverse. Pass the
    number of query heads for `q_proj` and of key/value heads for `k_proj`.
    """
    rows = weights.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"Cannot un-permute {rows} rows into {n_heads} heads of rotary pairs.")
    half_head = rows // n_heads // 2
    return weights.reshape(n_heads, half_head, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def hf_config_from_gguf_metadata(metadata: Mapping[str, Any], tensor_names: tuple[str, ...]) -> dict:
    """The Hugging Face `config.json` dict for a GGUF file with this metadata and these tensors."""
    arch = metadata["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; rljax reads {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Mistral files are written as 'llama')."
        )

    def key(name: str, default: Any = dataclasses.MISSING) -> Any:
        full = f"{arch}.{name}"
        if full in metadata:
            return metadata[full]
        if default is dataclasses.MISSING:
            raise ValueError(f"GGUF file of architecture {arch!r} has no {full!r} in its metadata.")
        return default

    hidden_size = key("embedding_length")
    n_heads = key("attention.head_count")
    n_kv_heads = key("attention.head_count_kv", n_heads)
    if isinstance(n_heads, list) or isinstance(n_kv_heads, list):
        raise ValueError("GGUF files with a per-layer number of attention heads are not supported.")
    # llama.cpp writes the head width as `attention.key_length` when it is not hidden_size / n_heads;
    # for llama it also writes the rotary width, which equals the head width there.
    head_dim = key("attention.key_length", None)
    if head_dim is None and arch == "llama":
        head_dim = key("rope.dimension_count", None)
    if head_dim is None:
        head_dim = hidden_size // n_heads

    tensor_set = set(tensor_names)
    for name in tensor_names:
        _hf_tensor_name(name)  # fails early, naming the tensor, on anything not mapped
    vocab_size = key("vocab_size", None)
    if vocab_size is None:
        vocab_size = len(metadata["tokenizer.ggml.tokens"])

    model_type, architecture_class = _HF_MODEL[arch]
    config = {
        "architectures": [architecture_class],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden_size),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": int(n_heads),
        "num_key_value_heads": int(n_kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_parameters": _rope_parameters(arch, key, tensor_set),
        # llama.cpp writes `output.weight` only when the output projection is not the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_set,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        # transformers 5 writes `dtype`; it reads an older file's `torch_dtype` only when `dtype` is absent.
        "dtype": "float32",
    }
    if arch != "qwen2":  # Qwen2 always has q/k/v biases (and no o bias): its config has no such flag
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_set
    if arch == "llama":
        config.update(mlp_bias="blk.0.ffn_up.bias" in tensor_set, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], name_or_path: str = ""):
    """A `transformers.PreTrainedTokenizerFast` built from a GGUF file's tokenizer metadata.

    Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are built here with the
    `tokenizers` library. Others (sentencepiece `"llama"`, ...) go through transformers' own GGUF
    converter, which needs no torch either. The chat template, the special tokens and whether a BOS
    token is prepended all come from the file.
    """
    from transformers import PreTrainedTokenizerFast

    tokens = list(metadata["tokenizer.ggml.tokens"])
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [])
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model == "gpt2":
        backend = _byte_level_bpe(metadata)
    else:
        backend = _transformers_gguf_tokenizer(metadata)

    def token(id_key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{id_key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    # llama.cpp prepends BOS to a sentencepiece vocabulary unless the file says otherwise.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    kwargs = dict(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
        name_or_path=name_or_path,
    )
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    tokenizer = PreTrainedTokenizerFast(**{key: value for key, value in kwargs.items() if value is not None})

    # Control tokens (`<|im_end|>`) are special: matched whole, skipped by `decode(skip_special_tokens=True)`.
    # User-defined ones (`<think>`) are matched whole too, as llama.cpp does, but are ordinary text.
    control, user_defined = _added_tokens(tokens, token_types, byte_level=tokenizer_model == "gpt2")
    if control:
        tokenizer.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    vocab = tokenizer.get_vocab()
    user_defined = [added for added in user_defined if added.content in vocab]
    if user_defined:
        tokenizer.add_tokens(user_defined)
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Metadata


class _Reader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain-ndarray view of its memory map.

    The reader slices its `np.memmap` once per string of the vocabulary and merges (~200k slices
    here), and every `np.memmap` slice pays for `__array_finalize__`; a base-class view of the same
    mapping reads the same bytes in about a third of the time.
    """

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = np.asarray(value)  # same memory, still mapped, minus the np.memmap subclass


def _reader_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    from gguf import GGUFValueType

    metadata = {}
    for name, field in reader.fields.items():
        value = field.contents()
        element_type = field.types[-1] if field.types else None
        if element_type == GGUFValueType.FLOAT32:
            value = [_float32(v) for v in value] if isinstance(value, list) else _float32(value)
        metadata[name] = value
    return metadata


def _float32(value: float) -> float:
    # str(np.float32) is the shortest decimal that reads back as the same float32.
    return float(str(np.float32(value)))


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "This GGUF file holds `rope_freqs.weight` (Llama 3.1-style RoPE frequency scaling), which "
            "rljax's GGUF import does not support; load the Hugging Face checkpoint instead."
        )
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in rljax's GGUF import.")


def _rope_parameters(arch: str, key, tensor_set: set[str]) -> dict:
    rope = {"rope_theta": float(key("rope.freq_base", 10000.0)), "rope_type": "default"}
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif scaling not in ("none", None):
        raise ValueError(f"GGUF RoPE scaling {scaling!r} ({arch}) is not supported by rljax's GGUF import.")
    return rope


# ----------------------------------------------------------------------------------------------
# Tokenizer

# llama.cpp's pre-tokenizer families for byte-level BPE (llama-vocab.cpp, `tokenizer.ggml.pre`).
# Each maps to a `tokenizers` pre-tokenizer that splits text the same way.
_GPT2_PRE = ("gpt2", "mpt", "olmo", "jais", "trillion", "default")
# starcoder family: every digit on its own ("\p{N}"), then the GPT-2 split. SmolLM's own
# `tokenizer.json` does the same with `Digits(individual_digits=True)` + `ByteLevel`.
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "stablelm2")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre_type: str | None):
    from tokenizers import Regex, pre_tokenizers

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type is None or pre_type in _GPT2_PRE:
        return gpt2
    if pre_type in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    split = _LLAMA3_SPLIT if pre_type in _LLAMA3_PRE else _QWEN2_SPLIT if pre_type in _QWEN2_PRE else None
    if split is None:
        split = _transformers_pre_tokenizer_split(pre_type)
    if split is None:
        warnings.warn(
            f"GGUF pre-tokenizer {pre_type!r} is unknown to rljax; splitting text the GPT-2 way, which may "
            "tokenize some text differently from llama.cpp.",
            stacklevel=3,
        )
        return gpt2
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _transformers_pre_tokenizer_split(pre_type: str) -> str | None:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return None
    return GGUF_PRE_TOKENIZER_SPLITS.get(pre_type)


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte] = chr(256 + extra)
            extra += 1
    return alphabet


def _byte_level_bpe(metadata: Mapping[str, Any]):
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    tokens = metadata["tokenizer.ggml.tokens"]
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Every BPE token is written in the byte alphabet; one that is not (rare, e.g. a special token
    # with a literal space) is re-spelled so it can still be looked up. A string listed twice maps
    # to its last id, as in llama.cpp's `token_to_id`.
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= spelled:
            token = "".join(alphabet[byte] for byte in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges") or []]

    backend = Tokenizer(
        BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    backend.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()

    return backend


def _added_tokens(tokens, token_types, *, byte_level: bool):
    """`(control, user_defined)` tokens of the vocabulary, as `AddedToken`s."""
    from tokenizers import AddedToken

    spelled = set(_byte_alphabet().values()) if byte_level else None
    # A byte-level "control" token spelled outside the byte alphabet is a llama.cpp mislabel; adding
    # it would grow the vocabulary past the embedding, so it is left out (as transformers does).
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types)
        if token_type == _TOKEN_TYPE_CONTROL and (spelled is None or set(token) <= spelled)
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _TOKEN_TYPE_USER_DEFINED
    ]
    return control, user_defined


def _transformers_gguf_tokenizer(metadata: Mapping[str, Any]):
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError as error:
        raise ValueError(
            f"GGUF tokenizer model {metadata.get('tokenizer.ggml.model')!r} needs transformers' GGUF tokenizer "
            "converter (transformers >= 5), which could not be imported; only byte-level BPE ('gpt2') "
            "vocabularies are built by rljax itself."
        ) from error
    tokenizer_dict = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in metadata
    }
    backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return backend
