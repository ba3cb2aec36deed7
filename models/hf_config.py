"""Reading a Hugging Face ``config.json`` into `ModelConfig`: the parts every family shares.

Two generations of config files exist on the hub and both are read: transformers 4
writes ``rope_theta`` and ``rope_scaling`` at the top level; transformers 5 writes
``rope_parameters`` (one dict, or one per layer type for Gemma 3). Anything a family
does not implement is refused here, at load, with one line naming the feature.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ROPE_TYPES, RopeScaling


class UnsupportedFeature(ValueError):
    """A config asks for something the engine does not implement."""


def refuse(arch: str, feature: str) -> UnsupportedFeature:
    return UnsupportedFeature(f"{arch}: unsupported config feature: {feature}")


def with_defaults(d: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`d` with the keys it lacks taken from `defaults`: the family's transformers config class
    defaults, which transformers applies to a ``config.json`` that leaves a key out (Gemma 3's
    multimodal ``text_config`` keeps only the keys that differ from them)."""
    return {**defaults, **d}


def common_fields(d: dict[str, Any], arch: str, name: str) -> dict[str, Any]:
    """The Llama-shaped fields of `ModelConfig` from a config dict (rope handled by `rope_fields`)."""
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    if float(d.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise refuse(arch, f"partial_rotary_factor {d['partial_rotary_factor']}")
    return dict(
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d.get("intermediate_size") or 0),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
        rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        architecture=arch,
        name=name,
    )


def rope_scaling_from(arch: str, p: Optional[dict[str, Any]], max_pos: int,
             top_orig: Optional[int] = None) -> Optional[RopeScaling]:
    """A rope_scaling / rope_parameters dict -> RopeScaling (None for default RoPE).

    The original context of llama3 and yarn scaling is, as transformers reads it, a top-level
    ``original_max_position_embeddings`` (`top_orig`) first, then the dict's, then the context.
    """
    if not p:
        return None
    rtype = p.get("rope_type", p.get("type")) or "default"
    if rtype == "default":
        return None
    if rtype not in ROPE_TYPES:
        raise refuse(arch, f"rope scaling type {rtype!r} (supported: default, {', '.join(ROPE_TYPES)})")
    factor = p.get("factor")
    if rtype == "linear":
        return RopeScaling(rope_type="linear", factor=float(factor))
    orig = int(top_orig or p.get("original_max_position_embeddings") or max_pos)
    if rtype == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(factor),
            low_freq_factor=float(p["low_freq_factor"]),
            high_freq_factor=float(p["high_freq_factor"]),
            original_max_position_embeddings=orig,
        )
    # yarn, as transformers' _compute_yarn_parameters reads it
    factor = float(factor) if factor is not None else max_pos / orig

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        attention_factor=float(attention_factor),
        truncate=bool(p.get("truncate", True)),
    )


def mscale_of(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale for a context stretched ``scale`` times (transformers' ``get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_mscale(p: Optional[dict[str, Any]]) -> float:
    """DeepSeek's factor on the softmax scale's square root: ``mscale(factor, mscale_all_dim)`` for a scaled
    RoPE with ``mscale_all_dim`` set, else 1 (transformers' ``yarn_apply_mscale``)."""
    p = p or {}
    rtype = p.get("rope_type", p.get("type")) or "default"
    m_all = p.get("mscale_all_dim") or 0
    return mscale_of(float(p["factor"]), m_all) if rtype != "default" and m_all else 1.0


def rope_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` from either config generation (one RoPE for every layer)."""
    max_pos = int(d.get("max_position_embeddings") or 4096)
    top_orig = d.get("original_max_position_embeddings")
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        raise refuse(arch, "per-layer-type rope_parameters")
    if isinstance(rp, dict) and rp:
        theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
        return dict(rope_theta=float(theta), rope_scaling=rope_scaling_from(arch, rp, max_pos, top_orig))
    return dict(
        rope_theta=float(d.get("rope_theta") or 10000.0),
        rope_scaling=rope_scaling_from(arch, d.get("rope_scaling"), max_pos, top_orig),
    )


def layer_type_fields(d: dict[str, Any], arch: str, num_layers: int, window: Optional[int],
                      derived: Optional[list[str]] = None) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types``: no window, full attention everywhere; else the
    config's own list when it has one, else `derived` (the family's rule), else every layer sliding."""
    if not window:
        return dict(sliding_window=None, layer_types=())
    types = d.get("layer_types") or derived
    if types is None:
        return dict(sliding_window=int(window), layer_types=())
    types = tuple(types)
    if len(types) != num_layers:
        raise refuse(arch, f"layer_types of length {len(types)} for {num_layers} layers")
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise refuse(arch, f"layer types {unknown}")
    if SLIDING_ATTENTION not in types:
        return dict(sliding_window=None, layer_types=())
    return dict(sliding_window=int(window), layer_types=types)


def refuse_set(d: dict[str, Any], arch: str, keys: dict[str, Any]) -> None:
    """Refuse every key of `keys` whose value in `d` is set and differs from the allowed value."""
    for key, allowed in keys.items():
        v = d.get(key)
        if v not in (None, allowed) and not (allowed is False and v == 0):
            raise refuse(arch, f"{key}={v!r}")
