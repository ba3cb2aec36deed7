"""Model families, one module each, all running the one decoder (`jaxinfer.models.decoder`).

A family module provides ``MODEL_TYPES`` (the Hugging Face ``model_type`` values it reads),
``config_from_hf(config_dict, name) -> ModelConfig`` (its ``config.json``, unsupported
features refused at load), ``canonical_name(tensor_name)`` (its checkpoint naming -> the
decoder's; None for tensors that are not part of the language model), and the model
contract: ``param_specs(cfg, dtype)``, ``hf_tensor_shapes(cfg)``,
``params_from_hf(tensors, cfg, dtype)``, ``forward(params, cfg, tokens, kv_cache, attn)``
and ``logits(params, cfg, hidden)``. What differs between families is data in
`ModelConfig`, so the contract functions are the decoder's.

``ModelConfig.architecture`` names the family of a loaded model (a key of `FAMILIES`).

The parameter tree is typed (`jaxinfer.models.weights_table`): `Params` (``embed``, ``final_norm``,
``lm_head``, ``layers``) of `Layer` blocks (``attention``: `Attention`, ``norms``: `Norms`, ``mlp``:
`DenseMLP` or `RoutedMLP`), re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any

import jax

from jaxinfer.models import deepseek, gemma3, llama, mixtral, qwen
from jaxinfer.models.weights_table import ALL as WEIGHTS
from jaxinfer.models.weights_table import Attention, DenseMLP, LatentAttention, Layer, Norms, Params, RoutedMLP
from jaxinfer.ops.spec import is_spec, register_family

__all__ = ["Attention", "DenseMLP", "FAMILIES", "LatentAttention", "Layer", "Norms", "Params", "RoutedMLP", "active_params",
           "config_from_hf", "describe", "get_family", "num_params"]

_MODULES = (llama, qwen, gemma3, mixtral, deepseek)

# model_type -> family module; also the architecture names a ModelConfig carries.
FAMILIES: dict[str, ModuleType] = {t: m for m in _MODULES for t in m.MODEL_TYPES}

# ops reaches a model's spec tree and weights through this registry (it never imports models)
for _arch, _module in FAMILIES.items():
    register_family(_arch, _module.param_specs, WEIGHTS)


def get_family(architecture: str) -> ModuleType:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


def config_from_hf(d: dict[str, Any], name: str = "model"):
    """A Hugging Face ``config.json`` dict -> `ModelConfig`, read by the family of its ``model_type``."""
    model_type = (d.get("model_type") or "llama").lower()
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type].config_from_hf({**d, "model_type": model_type}, name)


def num_params(cfg) -> int:
    """Parameters in the model ``cfg`` (every expert counted): the float tree's, however the weights are
    stored (an int4 tree's packed nibbles, scales and offsets are not parameters of the model)."""
    logical = dataclasses.replace(cfg, quant="") if cfg.quant else cfg
    specs = get_family(cfg.architecture).param_specs(logical)
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))


def active_params(cfg) -> int:
    """Parameters one token runs through: a MoE layer counts only its top-k experts."""
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.num_experts - cfg.num_experts_per_tok
    moe_layers = sum(cfg.is_moe_layer(li) for li in range(cfg.num_layers))
    return num_params(cfg) - moe_layers * idle * per_expert


def describe(cfg) -> str:
    """One line naming the family and its size, e.g.
    ``qwen3_moe, 4 layers, 1.2M parameters (0.4M active, 8 experts, top 2)``."""

    def millions(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"

    text = f"{cfg.architecture}, {cfg.num_layers} layers, {millions(num_params(cfg))} parameters"
    extra = []
    if cfg.num_experts:
        extra.append(f"{millions(active_params(cfg))} active, {cfg.num_experts} experts, top {cfg.num_experts_per_tok}")
    if cfg.latent:
        extra.append(f"latent attention: {cfg.kv_lora_rank} + {cfg.qk_rope_head_dim} cached a token")
    if cfg.shared_expert_intermediate_size:
        extra.append(f"shared experts of {cfg.shared_expert_intermediate_size}")
    if cfg.sliding_window:
        n = sum(bool(cfg.layer_window(li)) for li in range(cfg.num_layers))
        extra.append(f"sliding window {cfg.sliding_window} on {n} of {cfg.num_layers} layers")
    return text + (f" ({'; '.join(extra)})" if extra else "")
