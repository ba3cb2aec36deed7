"""Pydantic models of OpenAI's request bodies (with vLLM's extra sampling fields) and of its responses.

Requests: `ChatCompletionRequest`, `CompletionRequest`, `TokenizeRequest`,
`DetokenizeRequest`. Their fields keep OpenAI's names and meanings; the
sampling fields vLLM adds to the body (``top_k``, ``min_p``, ``ignore_eos``...)
are accepted too. A field this server does not know is ignored, as vLLM does,
and logged at DEBUG (`unknown_fields`); a known field whose value it does not
support yet is refused by the handler with a 400 naming it.

Only the shapes and types are checked here; ranges and limits are checked by
the library (`SamplingParams`, the input processor), so the messages are the
same as the library's and the gRPC service's.

Responses are built as plain dicts by `jaxinfer.server.openai_api.serving`
(exactly OpenAI's shapes, nothing extra), which is cheaper per streamed chunk
than a model per chunk.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _surrogate_at(value, path: str = "") -> Optional[str]:
    """The path of the first string holding a lone surrogate (JSON's ``\\ud800`` escapes allow them), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the body"
    elif isinstance(value, dict):
        for k, v in value.items():
            where = _surrogate_at(k, path or "a key") or _surrogate_at(v, f"{path}.{k}" if path else str(k))
            if where:
                return where
    elif isinstance(value, list):
        for i, v in enumerate(value):
            where = _surrogate_at(v, f"{path}[{i}]")
            if where:
                return where
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data):
        where = _surrogate_at(data)
        if where:
            raise ValueError(f"{where} is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff).")
        return data

    def unknown_fields(self) -> list:
        return sorted(self.model_extra or ())


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class _Sampling(_Body):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted, ignored
    response_format: Optional[dict[str, Any]] = None
    # vLLM's extra parameters
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    priority: int = 0
    prompt_logprobs: Optional[int] = None  # the response's prompt_logprobs (vLLM's shape); not with stream
    # Structured output (vLLM's names; serving.py turns them into one StructuredOutputsParams): the body
    # extra ``structured_outputs`` ({json | json_object | regex | choice | grammar, disable_any_whitespace,
    # whitespace_pattern}), and vLLM's older guided_* fields. ``response_format`` (above) is OpenAI's.
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[None, str, dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    # Prefill/decode disaggregation (`jaxinfer.engine.kv_transfer`): SGLang's fields, which sglang-router's PD
    # mode adds to the body it sends both workers (one value, or one per prompt of a batch), and vLLM's
    # ``kv_transfer_params``; serving.py turns them into one `KVTransferParams` per prompt.
    bootstrap_host: Union[None, str, list[Optional[str]]] = None
    bootstrap_port: Union[None, int, list[Optional[int]]] = None
    bootstrap_room: Union[None, int, str, list[Union[None, int, str]]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Union[None, str, list[TextPart]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None  # newer vLLM's name for reasoning_content


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[None, str, dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM's chat extras
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a ``prompt`` or chat ``messages``."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]
