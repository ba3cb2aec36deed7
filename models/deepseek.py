"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention and routed experts with shared ones.

As transformers computes them (``modeling_deepseek_v2.py``, ``modeling_deepseek_v3.py``), read into
`ModelConfig` fields the one decoder acts on:

- attention (`jaxinfer.models.transformer.latent_attention`): the query through ``q_a_proj`` -> RMSNorm ->
  ``q_b_proj`` (or one ``q_proj`` when ``q_lora_rank`` is null, as in V2-Lite), [nope | rope] per head;
  the key and value through one latent (``kv_a_proj_with_mqa``: ``kv_lora_rank`` values, RMSNorm'd, and a
  rotary key of ``qk_rope_head_dim`` shared by the heads), ``kv_b_proj`` up to each head's no-rope key and
  value. RoPE rotates the rotary dims only, in adjacent pairs (V2 always, V3 with ``rope_interleave``);
  with YaRN the softmax scale is ``(qk_nope + qk_rope) ** -0.5`` times ``mscale(factor, mscale_all_dim) ** 2``
  and cos/sin carry YaRN's attention factor (``mscale / mscale_all_dim``). The latent norms use epsilon 1e-6.
- experts (`jaxinfer.models.moe`): the first ``first_k_dense_replace`` layers are dense; the others route
  each token to ``num_experts_per_tok`` of ``n_routed_experts``, plus ``n_shared_experts`` x
  ``moe_intermediate_size`` of shared MLP every token runs. V2: softmax scores, top-k ("greedy") or top-k
  among the ``topk_group`` groups of ``n_group`` with the best expert ("group_limited_greedy"); weights
  never renormalised (transformers' V2 ignores ``norm_topk_prob``), times ``routed_scaling_factor``.
  V3 ("noaux_tc"): sigmoid scores; the choice adds ``e_score_correction_bias`` and takes groups by the sum of
  their best two; weights are the scores without the bias, renormalised with ``norm_topk_prob``, scaled.

Refused at load, in one line: biases on the projections, another activation, ``moe_layer_freq`` other than
1, another routing method or scoring function. V3 checkpoints' multi-token-prediction layers (past
``num_hidden_layers``) are skipped with a note (`jaxinfer.loading.weights`).
"""

from __future__ import annotations

from typing import Any, Optional

from jaxinfer.config import ModelConfig
from jaxinfer.models.transformer import forward, logits  # noqa: F401
from jaxinfer.models.weights_table import hf_tensor_shapes, param_specs, params_from_hf  # noqa: F401
from jaxinfer.models.hf_config import common_fields, refuse, refuse_set, rope_fields, with_defaults, yarn_mscale

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# transformers' DeepseekV2Config / DeepseekV3Config defaults, for keys a config.json leaves out
DEFAULTS = {
    "deepseek_v2": dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30,
                        num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                        rope_theta=10000.0, tie_word_embeddings=False, first_k_dense_replace=0, kv_lora_rank=512,
                        q_lora_rank=1536, n_group=None, n_routed_experts=64, n_shared_experts=2,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=1.0, topk_group=None,
                        topk_method="greedy", norm_topk_prob=False, v_head_dim=128, num_experts_per_tok=None,
                        moe_intermediate_size=1407, moe_layer_freq=1),
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                        num_attention_heads=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
                        rope_theta=10000.0, tie_word_embeddings=False, first_k_dense_replace=3, kv_lora_rank=512,
                        q_lora_rank=1536, n_group=8, n_routed_experts=256, n_shared_experts=1,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=2.5, topk_group=4,
                        topk_method="noaux_tc", norm_topk_prob=True, v_head_dim=128, num_experts_per_tok=8,
                        moe_intermediate_size=2048, moe_layer_freq=1, rope_interleave=True),
}

# (topk_method, scoring_func) each model type computes
_ROUTING = {"deepseek_v2": {"greedy": "softmax", "group_limited_greedy": "softmax"},
            "deepseek_v3": {"noaux_tc": "sigmoid"}}


def config_from_hf(d: dict[str, Any], name: str) -> ModelConfig:
    arch = d["model_type"]
    if "num_local_experts" in d and "n_routed_experts" not in d:
        d = {**d, "n_routed_experts": d["num_local_experts"]}
    d = with_defaults(d, DEFAULTS[arch])
    refuse_set(d, arch, {"attention_bias": False, "mlp_bias": False, "moe_layer_freq": 1})
    if d.get("hidden_act", "silu") != "silu":
        raise refuse(arch, f"hidden_act {d['hidden_act']!r}")
    method = d.get("topk_method") or ("noaux_tc" if arch == "deepseek_v3" else "greedy")
    if method not in _ROUTING[arch]:
        raise refuse(arch, f"topk_method {method!r} (supported: {', '.join(_ROUTING[arch])})")
    scoring = _ROUTING[arch][method]
    if d.get("scoring_func") not in (None, scoring):
        raise refuse(arch, f"scoring_func {d['scoring_func']!r} with topk_method {method!r}")
    heads = int(d["num_attention_heads"])
    # the un-absorbed view: every head its own key and value (of v_head_dim); transformers' head_dim is the
    # rotary dims, which `ModelConfig.rope_dim` gives
    f = common_fields({**d, "head_dim": int(d["v_head_dim"]), "num_key_value_heads": heads}, arch, name)
    f.update(rope_fields(d, arch))
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    experts = int(d.get("n_routed_experts") or 0)
    groups = int(d.get("n_group") or 1) if method != "greedy" else 1
    f.update(
        kv_lora_rank=int(d["kv_lora_rank"]),
        q_lora_rank=int(d.get("q_lora_rank") or 0),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        rope_interleave=bool(d.get("rope_interleave", True)) if arch == "deepseek_v3" else True,
        attention_mscale=yarn_mscale(rope) ** 2,
    )
    if experts:
        f.update(
            num_experts=experts,
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            norm_topk_prob=bool(d.get("norm_topk_prob")) if arch == "deepseek_v3" else False,
            dense_layers=tuple(range(min(int(d.get("first_k_dense_replace") or 0), f["num_layers"]))),
            shared_expert_intermediate_size=int(d.get("n_shared_experts") or 0) * int(d["moe_intermediate_size"]),
            router_scoring=scoring,
            router_bias=method == "noaux_tc",
            expert_groups=groups,
            topk_groups=int(d.get("topk_group") or 1) if groups > 1 else 1,
            group_scoring="top2_sum" if method == "noaux_tc" else "max",
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            router_logits_float32=True,
        )
    return ModelConfig(**f)


def canonical_name(name: str) -> Optional[str]:
    """DeepSeek's checkpoint names are the decoder's canonical ones for it (`jaxinfer.models.weights_table`)."""
    return name
