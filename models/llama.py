"""The Llama family: Llama 2 and 3.x (RoPE scaling llama3, linear, yarn), SmolLM2, TinyLlama,
and Mistral, whose ``sliding_window`` makes every layer attend to that many positions."""

from __future__ import annotations

from typing import Any, Optional

from jaxinfer.config import ModelConfig
from jaxinfer.models.transformer import forward, logits  # noqa: F401
from jaxinfer.models.weights_table import hf_tensor_shapes, param_specs, params_from_hf  # noqa: F401
from jaxinfer.models.hf_config import (
    common_fields,
    layer_type_fields,
    refuse,
    refuse_set,
    rope_fields,
    with_defaults,
)

MODEL_TYPES = ("llama", "mistral")

# transformers' LlamaConfig / MistralConfig defaults, for keys a config.json leaves out
DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                    rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False),
}


def config_from_hf(d: dict[str, Any], name: str) -> ModelConfig:
    arch = d.get("model_type") or "llama"
    d = with_defaults(d, DEFAULTS[arch])
    refuse_set(d, arch, {"attention_bias": False, "mlp_bias": False})
    if d.get("hidden_act", "silu") != "silu":
        raise refuse(arch, f"hidden_act {d['hidden_act']!r}")
    f = common_fields(d, arch, name)
    f.update(rope_fields(d, arch))
    window = d.get("sliding_window") if arch == "mistral" else None
    f.update(layer_type_fields(d, arch, f["num_layers"], window))
    return ModelConfig(**f)


def canonical_name(name: str) -> Optional[str]:
    """A checkpoint's tensor name in the decoder's canonical naming (Llama's own)."""
    return name


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face LlamaConfig dictionary of a Llama `cfg` (used to write test models)."""
    d = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
    }
    rs = cfg.rope_scaling
    if rs is not None:
        d["rope_scaling"] = {
            "rope_type": rs.rope_type,
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    return d
