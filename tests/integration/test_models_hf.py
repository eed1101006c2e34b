"""Logit parity with the transformers (torch) implementation, and the export round trip.

For each supported family a tiny random model is built with transformers, saved, and loaded by
rljax; a left-padded batch must give, row by row, the logits transformers gives for each row alone.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rljax.models.config import ModelConfig, UnsupportedConfigError  # noqa: E402
from rljax.models.hf_io import load_hf_dir, save_hf_dir  # noqa: E402

_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, rope_theta=10000.0, tie_word_embeddings=False),
    "llama_tied_llama3rope": lambda: transformers.LlamaConfig(
        **_COMMON,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama_bias": lambda: transformers.LlamaConfig(**_COMMON, attention_bias=True),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=64),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False),
}


def _torch_model(hf_config):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # non-trivial norm weights
            else:
                p.copy_(0.2 * torch.randn_like(p))  # biases too, so a dropped bias shows
    return model


def _rows():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 97, size=n).tolist() for n in (9, 5, 1, 7)]


def _left_pad(rows):
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def _reference_logits(torch_model, row):
    with torch.no_grad():
        return torch_model(torch.tensor([row])).logits[0].numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers_on_padded_batch(family, tmp_path):
    torch_model = _torch_model(FAMILIES[family]())
    torch_model.save_pretrained(tmp_path)
    model = load_hf_dir(str(tmp_path))
    rows = _rows()
    ids, mask = _left_pad(rows)
    logits = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    width = ids.shape[1]
    for i, row in enumerate(rows):
        ours = logits[i, width - len(row):]
        np.testing.assert_allclose(ours, _reference_logits(torch_model, row), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_export_round_trip_loads_in_transformers(family, tmp_path):
    torch_model = _torch_model(FAMILIES[family]())
    torch_model.save_pretrained(tmp_path / "src")
    model = load_hf_dir(str(tmp_path / "src"))
    save_hf_dir(str(tmp_path / "out"), model)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    row = _rows()[0]
    np.testing.assert_allclose(
        _reference_logits(reloaded, row), _reference_logits(torch_model, row), atol=1e-5, rtol=0
    )
    # And back into rljax: identical parameters.
    again = load_hf_dir(str(tmp_path / "out"))
    ids = jnp.asarray([row])
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))


def test_value_head_round_trip(tmp_path):
    torch_model = _torch_model(FAMILIES["llama"]())
    torch_model.save_pretrained(tmp_path / "src")
    model = load_hf_dir(str(tmp_path / "src"), value_head=True)
    hidden, _ = model.forward(jnp.asarray([[1, 2, 3]]))
    np.testing.assert_array_equal(np.asarray(model.values(hidden)), 0.0)  # initialised to zero
    model.value_head["w"][...] = jnp.arange(64, dtype=jnp.float32) / 64
    save_hf_dir(str(tmp_path / "out"), model)
    again = load_hf_dir(str(tmp_path / "out"), value_head=True)
    np.testing.assert_array_equal(np.asarray(again.values(hidden)), np.asarray(model.values(hidden)))


def test_bfloat16_compute_is_close_to_float32(tmp_path):
    torch_model = _torch_model(FAMILIES["llama"]())
    torch_model.save_pretrained(tmp_path)
    f32 = load_hf_dir(str(tmp_path))
    bf16 = load_hf_dir(str(tmp_path), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    assert bf16.layers["wq"][...].dtype == jnp.bfloat16
    ids = jnp.asarray([_rows()[0]])
    a, b = np.asarray(f32(ids)), np.asarray(bf16(ids))
    assert b.dtype == np.float32
    # bfloat16 has 8 bits of mantissa: logits of magnitude ~10 agree to a few tenths, not 1e-4.
    assert np.abs(a - b).max() < 0.5 and np.abs(a - b).max() > 0


def test_sliding_window_beyond_window_is_an_error(tmp_path):
    cfg = transformers.MistralConfig(**_COMMON, sliding_window=4)
    _torch_model(cfg).save_pretrained(tmp_path)
    model = load_hf_dir(str(tmp_path))
    model(jnp.asarray([[1, 2, 3, 4]]))  # within the window: fine
    with pytest.raises(UnsupportedConfigError, match="sliding_window"):
        model(jnp.asarray([[1, 2, 3, 4, 5]]))


def test_unsupported_configs_are_named():
    base = FAMILIES["llama"]().to_dict()
    with pytest.raises(UnsupportedConfigError, match="model_type 'gpt2'"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedConfigError, match="hidden_act"):
        ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedConfigError, match="yarn"):
        ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})


def test_config_round_trip_through_transformers():
    for make in FAMILIES.values():
        cfg = ModelConfig.from_hf_dict(make().to_dict())
        again = ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
        assert again == cfg
        # transformers reads what we write.
        tcfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
        assert ModelConfig.from_hf_dict(tcfg.to_dict()) == cfg


@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast"])  # saved; Llama 3's
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_directorys_tokenizer_is_the_one_autotokenizer_loads(family, tokenizer_class, tmp_path):
    # rljax.models.hf_io.load_hf_tokenizer skips AutoTokenizer (whose module imports torch) where
    # AutoTokenizer would build the plain tokenizers backend; it must then be that class, with the same
    # ids, special tokens and chat template. qwen2 is the type where transformers picks a class of its own.
    from rljax.models.hf_io import _plain_backend, load_hf_tokenizer
    from rljax.models.tiny import byte_tokenizer

    FAMILIES[family]().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "TokenizersBackend"
    tokenizer_config["tokenizer_class"] = tokenizer_class
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    ours, theirs = load_hf_tokenizer(str(tmp_path)), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(theirs)
    assert _plain_backend(str(tmp_path)) == (type(theirs) is transformers.PreTrainedTokenizerFast) == (family != "qwen2")
    text = "<|im_start|>user\n2+3= é\n<|im_end|>"
    assert ours.encode(text) == theirs.encode(text) and ours.decode(ours.encode(text)) == text
    chat = [{"role": "user", "content": "2+3="}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.pad_token_id,
                                                                           theirs.bos_token_id) == (2, 2, 1)
