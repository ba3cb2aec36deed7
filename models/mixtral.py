"""Mixtral: Mistral attention with routed experts in every layer (`jaxinfer.models.moe`).

Its router takes the top-k of the softmax and renormalises them (``norm_topk_prob``), as
Qwen3-MoE does; only the tensor names differ (``block_sparse_moe``, experts' ``w1``/``w3``/``w2``
for gate/up/down), mapped here to the decoder's canonical names.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from jaxinfer.config import ModelConfig
from jaxinfer.models.transformer import forward, logits  # noqa: F401
from jaxinfer.models.weights_table import hf_tensor_shapes, param_specs, params_from_hf  # noqa: F401
from jaxinfer.models.hf_config import common_fields, layer_type_fields, refuse, rope_fields, with_defaults

MODEL_TYPES = ("mixtral",)

# transformers' MixtralConfig defaults, for keys a config.json leaves out
DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=1e6, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                sliding_window=None)


def config_from_hf(d: dict[str, Any], name: str) -> ModelConfig:
    arch = "mixtral"
    d = with_defaults(d, DEFAULTS)
    if d.get("hidden_act", "silu") != "silu":
        raise refuse(arch, f"hidden_act {d['hidden_act']!r}")
    f = common_fields(d, arch, name)
    f.update(rope_fields(d, arch))
    f.update(layer_type_fields(d, arch, f["num_layers"], d.get("sliding_window")))
    f.update(
        num_experts=int(d["num_local_experts"]),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["intermediate_size"]),
        norm_topk_prob=True,
    )
    return ModelConfig(**f)


_EXPERT = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def canonical_name(name: str) -> Optional[str]:
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}mlp.experts.{m.group(2)}.{_PROJ[m.group(3)]}.weight"
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
