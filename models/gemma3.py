"""Gemma 3 (text): norms that scale by ``1 + weight`` and four of them per layer, per-head Q/K
norms, embeddings scaled by ``sqrt(hidden_size)``, GeGLU (tanh GELU), attention scaled by
``query_pre_attn_scalar ** -0.5``, and local layers (a sliding window, their own RoPE base)
interleaved with global ones (``layer_types``, or one global layer every ``sliding_window_pattern``).

Both text-only checkpoints (``gemma3_text``, Gemma3ForCausalLM) and the multimodal ones
(``gemma3`` with a ``text_config``) load: the language model's tensors are renamed to the
canonical names and the vision tower's are left out.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.models.transformer import forward, logits  # noqa: F401
from jaxinfer.models.weights_table import hf_tensor_shapes, param_specs, params_from_hf  # noqa: F401
from jaxinfer.models.hf_config import common_fields, layer_type_fields, refuse, refuse_set, rope_scaling_from, with_defaults

MODEL_TYPES = ("gemma3_text", "gemma3")

# transformers' Gemma3TextConfig defaults: a multimodal checkpoint's text_config keeps only the keys
# that differ from these (gemma-3-4b-it's has five), so they are part of reading it
DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                sliding_window=4096, max_position_embeddings=131072, rms_norm_eps=1e-6,
                rope_theta=1e6, rope_local_base_freq=1e4, tie_word_embeddings=True,
                hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None)


def config_from_hf(d: dict[str, Any], name: str) -> ModelConfig:
    multimodal = d.get("model_type") == "gemma3"
    if multimodal:
        if not isinstance(d.get("text_config"), dict):
            raise refuse("gemma3", "a multimodal config without text_config")
        d = {"model_type": "gemma3_text", **d["text_config"]}
    d = with_defaults(d, DEFAULTS)
    arch = "gemma3"
    refuse_set(d, arch, {"attention_bias": False, "attn_logit_softcapping": None,
                         "use_bidirectional_attention": False})
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise refuse(arch, f"hidden_activation {act!r}")
    f = common_fields(d, arch, name)
    f.update(_ropes(d, arch, f["max_position_embeddings"]))
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)  # transformers' default
    derived = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(f["num_layers"])]
    f.update(layer_type_fields(d, arch, f["num_layers"], d.get("sliding_window"), derived))
    f.update(
        qk_norm=True,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or f["head_dim"]),
        norm_weight_offset=1.0,
        sandwich_norms=True,
        embed_scale=float(f["hidden_size"]) ** 0.5,
        hidden_act="gelu_tanh",
        # Gemma3ForConditionalGeneration's head does not cap; Gemma3ForCausalLM's does, when set
        final_logit_softcap=(float(d["final_logit_softcapping"])
                             if d.get("final_logit_softcapping") and not multimodal else None),
    )
    return ModelConfig(**f)


def _ropes(d: dict[str, Any], arch: str, max_pos: int) -> dict[str, Any]:
    """Global layers: ``rope_theta`` with the config's scaling; local layers: their own base, unscaled."""
    rp = d.get("rope_parameters")
    top_orig = d.get("original_max_position_embeddings")
    if isinstance(rp, dict) and rp:  # transformers 5: one dict per layer type
        full, local = rp.get(FULL_ATTENTION) or {}, rp.get(SLIDING_ATTENTION) or {}
        if rope_scaling_from(arch, local, max_pos) is not None:
            raise refuse(arch, "RoPE scaling on sliding-window layers")
        return dict(
            rope_theta=float(full.get("rope_theta", 1e6)),
            rope_scaling=rope_scaling_from(arch, full, max_pos, top_orig),
            local_rope_theta=float(local.get("rope_theta", 1e4)),
        )
    return dict(
        rope_theta=float(d.get("rope_theta") or 1e6),
        rope_scaling=rope_scaling_from(arch, d.get("rope_scaling"), max_pos, top_orig),
        local_rope_theta=float(d.get("rope_local_base_freq") or 1e4),
    )


_MULTIMODAL_PREFIX = re.compile(r"^(?:language_model\.model\.|model\.language_model\.)")
_MULTIMODAL_HEAD = re.compile(r"^(?:language_model\.)lm_head\.")
_VISION = re.compile(r"^(?:model\.)?(?:vision_tower|multi_modal_projector)\.")


def canonical_name(name: str) -> Optional[str]:
    """Text-model tensors in canonical naming; None for the vision tower and projector."""
    if _VISION.match(name):
        return None
    if _MULTIMODAL_HEAD.match(name):
        return _MULTIMODAL_HEAD.sub("lm_head.", name)
    return _MULTIMODAL_PREFIX.sub("model.", name)
