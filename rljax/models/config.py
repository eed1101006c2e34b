"""Model hyperparameters, read from and written to Hugging Face ``config.json`` dictionaries.

One frozen dataclass covers the Llama / Mistral / Qwen2 / Qwen3 family. A config feature rljax does
not implement is rejected here, by name, instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljax.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedConfigError(UserError):
    """A Hugging Face config asks for a feature rljax does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is "default", "linear" or "llama3"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of the Llama family."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projection biases (Qwen2; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # output projection bias (Llama/Qwen3 with attention_bias; never Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral; only sequences within the window are supported
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # a list given is kept as a tuple
    pad_token_id: int | None = None

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):
            # Llama 3 lists several; a tuple keeps the config hashable (the model's graph is a static
            # argument of every jitted step)
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.model_type in ("llama", "qwen3") and self.qkv_bias != self.o_bias:
            raise UnsupportedConfigError(f"{self.model_type} has one attention_bias flag for q/k/v and o")
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise UnsupportedConfigError("qwen2 always has q/k/v biases and no o_proj bias")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"model_type {self.model_type!r} is not supported; rljax implements {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope_scaling.rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedConfigError(
                f"rope_scaling type {self.rope_scaling.rope_type!r} is not implemented (default, linear, llama3 are)"
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ------------------------------------------------------------------ Hugging Face round trip
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` dictionary (transformers 4 and 5 layouts)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"config.json model_type {model_type!r} is not supported; rljax implements {SUPPORTED_MODEL_TYPES}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("mlp_bias", False):
            raise UnsupportedConfigError("mlp_bias=True is not supported")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedConfigError("pretraining_tp > 1 is not supported")
        # transformers 5 keeps RoPE settings under rope_parameters; older files use rope_theta/rope_scaling.
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type") or legacy_scaling.get("rope_type") or legacy_scaling.get("type") or "default"
        source = rope if rope.get("rope_type") else legacy_scaling
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(source.get("factor", 1.0)),
            low_freq_factor=float(source.get("low_freq_factor", 1.0)),
            high_freq_factor=float(source.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(source.get("original_max_position_embeddings", 8192)),
        )
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        if (rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0) != 1.0:
            raise UnsupportedConfigError("partial_rotary_factor != 1 is not supported")
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        elif model_type == "mistral":
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            sliding_window = None
        if model_type == "qwen2" and hf.get("layer_types") and any(t != "full_attention" for t in hf["layer_types"]):
            raise UnsupportedConfigError("qwen2 layer_types with sliding attention are not supported")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dictionary that ``transformers.AutoConfig`` reads back to this model."""
        rope_parameters: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": self.rope_scaling.rope_type}
        if self.rope_scaling.rope_type in ("linear", "llama3"):
            rope_parameters["factor"] = self.rope_scaling.factor
        if self.rope_scaling.rope_type == "llama3":
            rope_parameters.update(
                low_freq_factor=self.rope_scaling.low_freq_factor,
                high_freq_factor=self.rope_scaling.high_freq_factor,
                original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings,
            )
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": "float32",
        }
        if self.rope_scaling.rope_type != "default":
            hf["rope_scaling"] = dict(rope_parameters)
        if self.model_type in ("llama", "qwen3"):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = False
        if self.model_type == "mistral":
            hf["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen2", "qwen3"):
            hf["use_sliding_window"] = False
            hf["sliding_window"] = None
        return hf
