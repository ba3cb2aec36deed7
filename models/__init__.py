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
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from jaxinfer.models import gemma3, llama, mixtral, qwen
from jaxinfer.models.weights_table import ALL as WEIGHTS
from jaxinfer.ops.spec import register_family

_MODULES = (llama, qwen, gemma3, mixtral)

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
