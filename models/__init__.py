"""Model families, one module each; `get_family` maps an architecture name to its module.

A family module provides ``param_specs(cfg, dtype)``, ``params_from_hf(tensors, cfg, dtype)``,
``forward(params, cfg, tokens, kv_cache, attn)`` and ``logits(params, cfg, hidden)``.
"""

from types import ModuleType

from jaxinfer.models import llama

_FAMILIES: dict[str, ModuleType] = {"llama": llama, "mistral": llama}


def get_family(architecture: str) -> ModuleType:
    try:
        return _FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {sorted(_FAMILIES)}"
        ) from None
