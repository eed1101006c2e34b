"""A tiny byte-level model directory (random Llama + ChatML tokenizer) for fast end-to-end tests."""

import os

from rljax.models.config import ModelConfig
from rljax.models.hf_io import save_hf_dir
from rljax.models.transformer import init_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
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


def make_tiny_model_dir(path, *, seed=0, layers=2, hidden=64):
    tokenizer = tiny_tokenizer()
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    save_hf_dir(str(path), init_model(config, seed=seed), tokenizer)
    return os.fspath(path)
