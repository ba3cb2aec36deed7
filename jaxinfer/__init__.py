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
from jaxinfer.attention import AttentionMetadata, paged_attention
from jaxinfer.checkpoint import save_model
from jaxinfer.config import EngineConfig, GenerationDefaults, ModelConfig, RopeScaling
from jaxinfer.kv_cache import cache_specs, init_cache
from jaxinfer.llm import LLM
from jaxinfer.outputs import CompletionOutput, Logprob, RequestOutput, StreamDelta
from jaxinfer.processor import InputProcessor
from jaxinfer.sampler import SamplerState, SamplingMetadata, init_sampler_state, sample
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step import decode_step, prefill

__all__ = [
    "__version__",
    "LLM",
    "InputProcessor",
    "save_model",
    "SamplingParams",
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
    # The gRPC clients load on first use, so `import jaxinfer` does not import grpc.
    if name in ("Client", "AsyncClient"):
        from jaxinfer.server import client

        return getattr(client, name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
