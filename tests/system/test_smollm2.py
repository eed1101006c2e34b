"""The embedded SmolLM2-135M-Instruct GGUF, loaded by rljax, against transformers' own GGUF loading:
the config, every tensor, the logits and greedy generation (its tokenizer: tests/system/test_gguf.py)."""

import copy
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # minutes: reads the 135M GGUF three times (rljax's load, rljax's reader for the
# config and tensor comparisons, transformers' GGUF loading)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rljax.models import load  # noqa: E402
from rljax.models.registry import resolve  # noqa: E402
from rljax.sampling import SamplingConfig, generate  # noqa: E402

SYSTEM = "Answer the arithmetic question. Put the final number inside <answer></answer>."
QUESTIONS = ["What is 12+35?", "Name a colour.", "What is 7 times 8? Explain briefly."]


@pytest.fixture(scope="module")
def both():
    path = resolve("smollm2-135m-instruct").path
    ours, tokenizer = load("smollm2-135m-instruct")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    return ours, tokenizer, reference


def _prompts(tokenizer):
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in QUESTIONS
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _left_pad(rows, pad):
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


@pytest.fixture(scope="module")
def checkpoint():
    """rljax's reading of the file (``read_gguf``): its Hugging Face config and float32 tensors."""
    from rljax.models.gguf_io import read_gguf

    return read_gguf(resolve("smollm2-135m-instruct").path)


def test_config_matches_transformers_gguf_loading(checkpoint, both):
    ours, reference_config = checkpoint.hf_config, both[2].config.to_dict()
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["tie_word_embeddings"] is True  # the file has no output.weight
    for key in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
        "attention_bias", "mlp_bias", "rope_parameters",
    ):
        assert ours[key] == reference_config[key], key
    # transformers keeps the float32 value (9.99999974e-06); rljax gives the decimal it came from
    assert ours["rms_norm_eps"] == pytest.approx(reference_config["rms_norm_eps"], rel=1e-6)
    assert ours["rms_norm_eps"] == 1e-5
    assert ours["rope_theta"] == reference_config["rope_parameters"]["rope_theta"] == 100000.0
    assert transformers.AutoConfig.for_model(**ours).to_dict()["head_dim"] == 64  # loads as a transformers config


def test_weights_match_transformers_gguf_loading(checkpoint, both):
    ours, reference = checkpoint.state_dict, both[2].state_dict()
    # tied embeddings: rljax's tensors have no lm_head.weight; transformers' state dict lists the tied
    # tensor under both names
    assert reference["lm_head.weight"].data_ptr() == reference["model.embed_tokens.weight"].data_ptr()
    reference = {name: tensor.numpy() for name, tensor in reference.items() if name != "lm_head.weight"}
    assert set(ours) == set(reference)
    assert len(ours) == 2 + 9 * 30
    for name, array in ours.items():
        assert array.dtype == np.float32 and array.shape == reference[name].shape, name
        np.testing.assert_allclose(array, reference[name], rtol=0, atol=1e-6, err_msg=name)


def test_logits_match_transformers_gguf_loading(both):
    """Padded-batch logits against transformers' float32 and float64 forward passes.

    30 float32 layers accumulate rounding: transformers' own float32 logits sit ~6e-5 from its
    float64 logits (|logits| up to ~40). We require rljax to be as close to the float64 truth as
    transformers' float32 is, within a factor of 3, and within 2e-4 of transformers' float32.
    """
    ours, tokenizer, reference = both
    reference64 = copy.deepcopy(reference).double()
    rows = _prompts(tokenizer)
    ids, mask = _left_pad(rows, tokenizer.pad_token_id)
    logits = np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask)))
    for i, row in enumerate(rows):
        with torch.no_grad():
            ref32 = reference(torch.tensor([row])).logits[0].numpy()
            ref64 = reference64(torch.tensor([row])).logits[0].numpy()
        mine = logits[i, ids.shape[1] - len(row):]
        assert np.abs(mine - ref64).max() <= 3 * np.abs(ref32 - ref64).max()
        np.testing.assert_allclose(mine, ref32, atol=2e-4, rtol=0)


def test_greedy_generation_matches_transformers(both):
    ours, tokenizer, reference = both
    rows = _prompts(tokenizer)
    ids, mask = _left_pad(rows, tokenizer.pad_token_id)
    n = 24
    eos = tokenizer.eos_token_id
    out = generate(ours, ids, mask, jax.random.key(0),
                   SamplingConfig(max_new_tokens=n, temperature=0.0, stop_token_ids=(eos,), pad_token_id=eos))
    for i, row in enumerate(rows):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([row]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                     pad_token_id=eos)[0, len(row):].tolist()
        length = int(out.mask[i].sum())
        assert out.tokens[i, :length].tolist() == ref, tokenizer.decode(ref)


def test_generate_cli_runs_on_the_embedded_model():
    result = subprocess.run(
        [sys.executable, "-m", "rljax", "generate", "--prompt", "What is 12+35?", "--chat",
         "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=1800,  # a hang guard
    )
    assert result.returncode == 0, result.stderr
    assert "12 + 35" in result.stdout


def test_convert_writes_a_directory_transformers_and_rljax_load(tmp_path, both):
    ours, tokenizer, reference = both
    result = subprocess.run(
        [sys.executable, "-m", "rljax", "convert", "smollm2-135m-instruct", str(tmp_path)],
        capture_output=True, text=True, timeout=1800,  # a hang guard
    )
    assert result.returncode == 0, result.stderr
    row = _prompts(tokenizer)[0]
    again, again_tokenizer = load(str(tmp_path))
    assert again_tokenizer(tokenizer.decode(row), add_special_tokens=False)["input_ids"] == row
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray([row]))), np.asarray(ours(jnp.asarray([row]))))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor([row])).logits[0].numpy(),
                                   reference(torch.tensor([row])).logits[0].numpy(), atol=1e-5, rtol=0)
