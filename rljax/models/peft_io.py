"""rljax LoRA adapters -> a PEFT adapter directory, without torch or peft.

The directory holds ``adapter_config.json`` and ``adapter_model.safetensors``, as
``peft.PeftModel.save_pretrained`` writes them, so ``PeftModel.from_pretrained(base, directory)``
on the Hugging Face base model gives the logits of rljax's adapted model.

The two agree on the update (arXiv:2106.09685): rljax computes ``x @ W + (alpha / r) · (x @ A) @ B``
with ``W [in, out]``, ``A [in, r]``, ``B [r, out]``; PEFT computes ``x W_t^T + (lora_alpha / r) ·
x A_p^T B_p^T`` with torch's ``W_t [out, in]``, ``A_p [r, in]`` (``lora_A.weight``), ``B_p [out, r]``
(``lora_B.weight``). So ``A_p = A^T``, ``B_p = B^T`` (rljax's multi-axis ``in`` / ``out``, such as
``[heads, head_dim]``, flattened in the order ``rljax.models.hf_io`` flattens the base weights)
and the scale is the same ``lora_alpha / r`` (PEFT's default, ``use_rslora: false``).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
from flax import nnx

from rljax.models.transformer import LORA_TARGETS, Transformer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# rljax's projection -> the Hugging Face module it adapts (PEFT's target_modules names)
HF_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
              "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def peft_state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """The model's adapters under PEFT's saved names (``base_model.model.model.layers.{i}.
    self_attn.q_proj.lora_A.weight`` ``[r, in]``, ``...lora_B.weight`` ``[out, r]``), float32."""
    layers = nnx.to_pure_dict(nnx.state(model))["layers"]
    out: dict[str, np.ndarray] = {}
    for name in LORA_TARGETS:
        if f"{name}_lora_a" not in layers:
            continue
        a = np.asarray(layers[f"{name}_lora_a"], np.float32)  # [L, *in, r]
        b = np.asarray(layers[f"{name}_lora_b"], np.float32)  # [L, r, *out]
        r = a.shape[-1]
        for i in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{HF_MODULES[name]}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    return out


def save_peft_adapter(directory: str, model: Transformer, *, lora_alpha: float, base_model: str) -> None:
    """Write ``model``'s LoRA adapters as a PEFT adapter directory (``task_type: CAUSAL_LM``).

    ``lora_alpha`` is the run's ``model.lora_alpha`` (it must give the model's scale, ``alpha / r``);
    ``base_model`` goes to ``base_model_name_or_path`` (PEFT loads the base from it only when asked
    to; ``PeftModel.from_pretrained(base, directory)`` takes the base as given). A value head is not
    an adapter: it stays in the merged model directory's ``value_head.safetensors``.
    """
    from safetensors.numpy import save_file

    tensors = peft_state_dict(model)
    if not tensors:
        raise ValueError("the model has no LoRA adapters to write (model.lora_rank is null)")
    targets = [n for n in LORA_TARGETS if f"base_model.model.model.layers.0.{HF_MODULES[n]}.lora_A.weight" in tensors]
    r = next(iter(tensors.values())).shape[0]
    if not math.isclose(lora_alpha / r, model.lora_scale, rel_tol=1e-12):
        raise ValueError(f"lora_alpha={lora_alpha} with rank {r} gives scale {lora_alpha / r}, "
                         f"but the model's LoRA scale is {model.lora_scale}")
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": r, "lora_alpha": lora_alpha, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "target_modules": [HF_MODULES[n].split(".")[-1] for n in targets], "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "HF_MODULES", "peft_state_dict", "save_peft_adapter"]
