"""LoRA adapters: a fresh adapter changes nothing, merging equals the adapted forward, only adapters train."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.hf_io import load_hf_dir, save_hf_dir
from rljax.models.lora import add_lora, lora_trainable, zero_adapters
from rljax.models.transformer import init_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)
IDS = jnp.asarray([[3, 4, 5, 6, 7]])


def _randomise_b(model, seed=1):
    key = jax.random.key(seed)
    for i, (name, var) in enumerate(sorted(model.layers.items())):
        if name.endswith("_lora_b"):
            var[...] = 0.1 * jax.random.normal(jax.random.fold_in(key, i), var[...].shape)


def test_fresh_adapters_leave_the_model_unchanged():
    base = init_model(CFG, seed=0)
    adapted = add_lora(base, rank=4, alpha=8.0, targets=("wq", "wv", "wo", "w_down"))
    np.testing.assert_array_equal(np.asarray(adapted(IDS)), np.asarray(base(IDS)))
    assert adapted.layers["wq_lora_a"][...].shape == (2, 32, 4)
    assert adapted.layers["wq_lora_b"][...].shape == (2, 4, 4, 8)
    assert adapted.layers["wo_lora_a"][...].shape == (2, 4, 8, 4)
    assert adapted.layers["wo_lora_b"][...].shape == (2, 4, 32)
    assert isinstance(adapted.layers["wq_lora_a"], nnx.LoRAParam)


def test_merge_on_export_equals_adapted_forward(tmp_path):
    adapted = add_lora(init_model(CFG, seed=0), rank=4, alpha=8.0)
    _randomise_b(adapted)
    before = np.asarray(adapted(IDS))
    assert np.abs(before - np.asarray(init_model(CFG, seed=0)(IDS))).max() > 1e-3  # the adapter matters
    save_hf_dir(str(tmp_path), adapted)
    np.testing.assert_allclose(np.asarray(load_hf_dir(str(tmp_path))(IDS)), before, atol=1e-5, rtol=0)


def test_trainable_filter_and_reference_by_zeroing_b():
    base = init_model(CFG, seed=0, value_head=True)
    adapted = add_lora(base, rank=2, targets=("wq",))
    _randomise_b(adapted)
    graphdef, trainable, frozen = nnx.split(adapted, lora_trainable(), ...)
    names = {"/".join(str(getattr(p, "key", p)) for p in path) for path, _ in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(trainable))}
    assert names == {"layers/wq_lora_a", "layers/wq_lora_b", "value_head/w", "value_head/b"}
    reference = nnx.merge(graphdef, zero_adapters(trainable), frozen)
    np.testing.assert_array_equal(np.asarray(reference(IDS)), np.asarray(base(IDS)))
