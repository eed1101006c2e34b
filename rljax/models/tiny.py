"""Tiny models built from nothing: a byte-level ChatML tokenizer and a random Llama directory.

For tests and for reproductions that pretrain their own small policy (no download anywhere):
``byte_tokenizer()`` covers every byte (so any text round-trips) plus ``<|endoftext|>``,
``<|im_start|>`` and ``<|im_end|>`` (EOS and padding), with a ChatML chat template;
``make_tiny_model_dir(path, ...)`` writes a Hugging Face directory (config, safetensors,
tokenizer) of a randomly initialised Llama that :func:`rljax.models.load` and every trainer accept.
"""

from __future__ import annotations

import os

from rljax.models.config import ModelConfig
from rljax.models.hf_io import save_hf_dir
from rljax.models.transformer import init_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per byte, 259 tokens in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    return fast


def tiny_config(vocab_size: int, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                intermediate: int | None = None) -> ModelConfig:
    """The ``ModelConfig`` :func:`make_tiny_model_dir` writes (tied embeddings, MLP twice the width,
    special ids of :func:`byte_tokenizer`): its shapes alone, e.g. for ``rljax plan``."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                       tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=2)


BYTE_VOCAB_SIZE = 259  # len(byte_tokenizer()): 256 bytes + 3 special tokens


def make_tiny_model_dir(path, *, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
                        kv_heads: int = 2, intermediate: int | None = None, value_head: bool = False,
                        tokenizer=None) -> str:
    """Write a random tiny Llama (tied embeddings) to ``path``; returns the path.

    ``tokenizer``: :func:`byte_tokenizer` by default; another must keep its special ids 0-2
    (``<|endoftext|>``, ``<|im_start|>`` = BOS, ``<|im_end|>`` = EOS and padding).
    """
    tokenizer = byte_tokenizer() if tokenizer is None else tokenizer
    config = tiny_config(len(tokenizer), layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                         intermediate=intermediate)
    save_hf_dir(str(path), init_model(config, seed=seed, value_head=value_head), tokenizer)
    return os.fspath(path)
