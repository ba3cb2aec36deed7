"""The sampling defaults in force: what fills every sampling field a request leaves unset.

One choice for every entry point (the library, ``generate``, ``chat``, gRPC and the OpenAI
HTTP API), made once when the model is loaded, as vLLM's ``--generation-config`` does:

    auto   the model's own generation config (``generation_config.json``, a GGUF's
           ``general.sampling.*``); a model that sets no temperature gets temperature
           0.2 and top-p 0.9 (`FALLBACK`: small models ramble at 1.0; what SmolLM2's
           authors suggest)
    vllm   the engine's neutral defaults, the model's ignored: temperature 1.0, top-p 1.0,
           no top-k, min-p or repetition penalty (OpenAI's and vLLM's meaning of an unset field)
    PATH   a directory holding a ``generation_config.json``, or such a file itself

The model's end-of-sequence tokens are the model's whichever is chosen: they say where
its turns end, not how to sample. `resolve_generation_config` gives the defaults with
every sampling field set, so what a request gets is never left to a later layer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

from jaxinfer.config import GenerationDefaults

__all__ = ["GENERATION_CONFIG_MODES", "FALLBACK", "NEUTRAL", "SAMPLING_FIELDS", "read_generation_config",
           "resolve_generation_config", "describe_generation"]

GENERATION_CONFIG_MODES = ("auto", "vllm")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# vLLM's (and SamplingParams') neutral values: nothing reshapes the model's distribution
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# `auto` for a model that ships no temperature (its other unset fields stay neutral)
FALLBACK = {"temperature": 0.2, "top_p": 0.9}


def read_generation_config(path) -> GenerationDefaults:
    """The ``GenerationDefaults`` of a ``generation_config.json`` file, or of the one in a directory.

    Raises ValueError with one line naming the path when there is none or it is not a JSON object.
    """
    p = Path(path).expanduser()
    f = p / "generation_config.json" if p.is_dir() else p
    if not f.is_file():
        where = f"{p} holds no generation_config.json" if p.is_dir() else f"{p} does not exist"
        raise ValueError(f"--generation-config: {where} (give auto, vllm, or a directory or file with a "
                         "generation_config.json).")
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--generation-config: cannot read {f}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"--generation-config: {f} is not a JSON object.")
    try:
        return GenerationDefaults.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--generation-config: {f}: {e}") from None


def _filled(g: GenerationDefaults, fill: dict) -> GenerationDefaults:
    """`g` with each unset sampling field taken from `fill`, then from `NEUTRAL`."""
    values = {}
    for name in SAMPLING_FIELDS:
        v = getattr(g, name)
        values[name] = v if v is not None else fill.get(name, NEUTRAL[name])
    return replace(g, **values)


def resolve_generation_config(spec: Optional[str], model: GenerationDefaults) -> GenerationDefaults:
    """The defaults in force for `spec` ("auto", "vllm" or a path; None is "auto") and the model's own
    `model` defaults: every sampling field set, the model's end-of-sequence tokens kept."""
    spec = "auto" if spec is None else str(spec)
    if spec == "auto":
        return _filled(model, FALLBACK if model.temperature is None else {})
    if spec == "vllm":
        return _filled(replace(model, **{name: None for name in SAMPLING_FIELDS}), {})
    other = read_generation_config(spec)
    own = {name: getattr(other, name) for name in SAMPLING_FIELDS}
    return _filled(replace(model, **own, max_new_tokens=other.max_new_tokens), {})


def describe_generation(spec: Optional[str], model: GenerationDefaults) -> str:
    """One line for the load line: where the defaults in force come from, and their values."""
    spec = "auto" if spec is None else str(spec)
    g = resolve_generation_config(spec, model)
    if spec == "auto":
        source = ("the model's" if model.temperature is not None else
                  "jaxinfer's for a model that sets no temperature") + " (--generation-config auto)"
    elif spec == "vllm":
        source = "neutral (--generation-config vllm)"
    else:
        source = f"from {spec}"
    shown = [n for n in SAMPLING_FIELDS if n in ("temperature", "top_p") or getattr(g, n) != NEUTRAL[n]]
    values = ", ".join(f"{n.replace('_', '-')} {getattr(g, n)}" for n in shown)
    return f"sampling defaults {source}: {values}"
