"""jaxinfer: an LLM inference engine on JAX.

Library use:

    import jaxinfer
    llm = jaxinfer.LLM("smollm2-135m-instruct")
    outs = llm.generate(["The KV cache is"], jaxinfer.SamplingParams(max_tokens=32, temperature=0.0))

Pure pieces for research code: `forward` / `logits` of a model family
(`jaxinfer.models`, one decoder for every family), the KV cache pytree (`init_cache`), the jitted
`prefill` and `decode_step`, and the sampler (`sample`). `InputProcessor` (as
``llm.processor``) is the one front door that turns a prompt, a conversation or
token ids into a validated request for every entry point. `save_model` writes a
parameter tree (with its config and tokenizer) as a directory `LLM` serves.
"""

from jaxinfer._version import __version__

# The names below load on first use, so `import jaxinfer` is quick and imports neither JAX nor grpc:
# the CLI shows its first line (and a "loading JAX" stage) instead of a silent terminal.
_LAZY = {
    "AttentionMetadata": "jaxinfer.ops.attention",
    "paged_attention": "jaxinfer.ops.attention",
    "save_model": "jaxinfer.loading.checkpoint",
    "EngineConfig": "jaxinfer.config",
    "GenerationDefaults": "jaxinfer.config",
    "ModelConfig": "jaxinfer.config",
    "RopeScaling": "jaxinfer.config",
    "cache_specs": "jaxinfer.ops.kv_cache",
    "init_cache": "jaxinfer.ops.kv_cache",
    "LLM": "jaxinfer.llm",
    "CompletionOutput": "jaxinfer.outputs",
    "Logprob": "jaxinfer.outputs",
    "RequestOutput": "jaxinfer.outputs",
    "StreamDelta": "jaxinfer.outputs",
    "InputProcessor": "jaxinfer.engine.processor",
    "SamplerState": "jaxinfer.ops.sampler",
    "SamplingMetadata": "jaxinfer.ops.sampler",
    "init_sampler_state": "jaxinfer.ops.sampler",
    "sample": "jaxinfer.ops.sampler",
    "SamplingParams": "jaxinfer.sampling_params",
    "StructuredOutputsParams": "jaxinfer.sampling_params",
    "decode_step": "jaxinfer.engine.step",
    "prefill": "jaxinfer.engine.step",
    "Client": "jaxinfer.server.client",
    "AsyncClient": "jaxinfer.server.client",
}

__all__ = [
    "__version__",
    "LLM",
    "InputProcessor",
    "save_model",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "StreamDelta",
    "Logprob",
    "ModelConfig",
    "EngineConfig",
    "GenerationDefaults",
    "RopeScaling",
    "AttentionMetadata",
    "paged_attention",
    "init_cache",
    "cache_specs",
    "SamplingMetadata",
    "SamplerState",
    "init_sampler_state",
    "sample",
    "prefill",
    "decode_step",
    "Client",
    "AsyncClient",
]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    try:  # a submodule, e.g. jaxinfer.models after a plain `import jaxinfer`
        return importlib.import_module(f"jaxinfer.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"jaxinfer.{name}":
            raise
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
