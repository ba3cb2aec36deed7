"""The Qwen families: Qwen2 / Qwen2.5 (Q/K/V biases), Qwen3 (per-head Q/K norms, a head_dim of
its own) and Qwen3-MoE (Qwen3 attention with routed experts, `jaxinfer.models.moe`).

Sliding windows: only with ``use_sliding_window``, on the layers from ``max_window_layers`` on
(every layer for Qwen3-MoE; transformers' rules), or as the config's ``layer_types`` say.
"""

from __future__ import annotations

from typing import Any, Optional

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
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

MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")

# transformers' Qwen2Config / Qwen3Config / Qwen3MoeConfig defaults, for keys a config.json leaves out
_DENSE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
              max_window_layers=28)
DEFAULTS = {
    "qwen2": _DENSE,
    "qwen3": dict(_DENSE, head_dim=128),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, use_sliding_window=False,
                      sliding_window=4096, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=False, decoder_sparse_step=1),
}


def config_from_hf(d: dict[str, Any], name: str) -> ModelConfig:
    arch = d["model_type"]
    if arch == "qwen3_moe" and "num_experts" not in d and "num_local_experts" in d:
        d = {**d, "num_experts": d["num_local_experts"]}  # transformers 5 writes the latter
    d = with_defaults(d, DEFAULTS[arch])
    if arch != "qwen2":
        refuse_set(d, arch, {"attention_bias": False})
    if d.get("hidden_act", "silu") != "silu":
        raise refuse(arch, f"hidden_act {d['hidden_act']!r}")
    f = common_fields(d, arch, name)
    f.update(rope_fields(d, arch))
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if arch == "qwen3_moe":
        derived = None  # every layer slides (Qwen3-MoE has no max_window_layers)
    else:
        first_sliding = int(d.get("max_window_layers") or 0)
        derived = [SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(f["num_layers"])]
    f.update(layer_type_fields(d, arch, f["num_layers"], window, derived))
    f["attention_bias"] = arch == "qwen2"
    f["qk_norm"] = arch != "qwen2"
    if arch == "qwen3_moe":
        step = int(d.get("decoder_sparse_step") or 1)
        mlp_only = {int(i) for i in d.get("mlp_only_layers") or ()}
        f.update(
            num_experts=int(d["num_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            dense_layers=tuple(i for i in range(f["num_layers"]) if i in mlp_only or (i + 1) % step),
        )
    return ModelConfig(**f)


def canonical_name(name: str) -> Optional[str]:
    return name
