"""Conversions between the `jaxinfer.v1` messages and the library's own types.

Pure functions, no gRPC and no server state: sampling options to `SamplingParams`
(and a model's defaults back), chat input to messages and template variables,
an engine `StreamDelta` to a `GenerateResponse`, `RequestMetrics` to `Timings`.
Bad input raises ValueError with a message that names the field.
"""

from __future__ import annotations

from typing import Callable

from google.protobuf import json_format

from jaxinfer.metrics import RequestMetrics
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server import jaxinfer_pb2 as pb

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}

# SamplingOptions fields copied one-to-one onto SamplingParams when set.
_OPTIONAL_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "logprobs", "skip_special_tokens",
    "include_stop_str_in_output",
)


def sampling_params_from_proto(opts: pb.SamplingOptions, defaults: SamplingParams) -> SamplingParams:
    """The defaults in force (``defaults``: `LLM.get_default_sampling_params`) overridden by every field the
    client set; raises ValueError when out of range."""
    kw = {name: getattr(opts, name) for name in _OPTIONAL_SAMPLING if opts.HasField(name)}
    kw["max_tokens"] = opts.max_tokens if opts.HasField("max_tokens") else None
    kw["stop"] = list(opts.stop)
    kw["stop_token_ids"] = list(opts.stop_token_ids)
    if opts.logit_bias:
        kw["logit_bias"] = dict(opts.logit_bias)
    return defaults.clone(**kw)


def generation_defaults_to_proto(g) -> pb.SamplingOptions:
    """The sampling defaults in force (`GenerationDefaults`, `jaxinfer.loading.generation_config`), with any
    field they leave unset unset."""
    opts = pb.SamplingOptions()
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                       ("repetition_penalty", float)):
        v = getattr(g, name, None)
        if v is not None:
            setattr(opts, name, kind(v))
    return opts


def chat_input_from_proto(chat: pb.ChatInput) -> dict:
    """The chat input as `InputProcessor` keywords: messages, chat_template_kwargs, add_generation_prompt.

    Nothing is checked here: the processor checks roles, reserved template variables and
    lengths for every entry point alike.
    """
    kwargs = json_format.MessageToDict(chat.chat_template_kwargs) if chat.HasField("chat_template_kwargs") else {}
    kwargs = _whole_numbers_as_ints(kwargs)
    return {
        "messages": [{"role": m.role, "content": m.content} for m in chat.messages],
        "chat_template_kwargs": kwargs,
        "add_generation_prompt": chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
    }


def _whole_numbers_as_ints(x):
    """A protobuf Struct holds every number as a double; give templates back ``3``, not ``3.0``."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    if isinstance(x, dict):
        return {k: _whole_numbers_as_ints(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_whole_numbers_as_ints(v) for v in x]
    return x


def timings_to_proto(m: RequestMetrics) -> pb.Timings:
    s = m.summary()
    t = pb.Timings(
        tokenize_s=m.tokenize_s,
        template_tokens=m.template_tokens,
        user_tokens=m.user_tokens,
        prefill_chunks=s["prefill_chunks"],
        decode_steps=m.decode_steps,
    )
    for name in ("queue_s", "prefill_s", "ttft_s", "tpot_s", "itl_mean_s", "itl_p50_s", "itl_p99_s", "itl_max_s",
                 "e2e_s"):
        if s[name] is not None:
            setattr(t, name, s[name])
    return t


def stream_delta_to_proto(delta, token_str: Callable[[int], str]) -> pb.GenerateResponse:
    """One engine `StreamDelta` as a `GenerateResponse`; the last one also carries finish, usage and timings.

    ``token_str(token_id)`` spells the tokens reported with logprobs.
    """
    r = pb.GenerateResponse(request_id=delta.request_id, text=delta.text, token_ids=delta.token_ids)
    for lp in delta.logprobs or ():
        if lp is None:
            continue
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])
        r.logprobs.append(pb.TokenLogprob(
            token_id=int(lp.token_id), logprob=float(lp.logprob), token=token_str(int(lp.token_id)),
            top=[pb.TopLogprob(token_id=int(i), logprob=float(v), token=token_str(int(i))) for i, v in top],
        ))
    out = delta.output
    if out is not None:
        comp = out.outputs[0]
        r.finish_reason = FINISH_REASONS.get(comp.finish_reason, pb.FINISH_REASON_ERROR)
        if isinstance(comp.stop_reason, str):
            r.stop_string = comp.stop_reason
        elif comp.stop_reason is not None:
            r.stop_token_id = int(comp.stop_reason)
        u = out.usage
        r.usage.CopyFrom(pb.Usage(
            prompt_tokens=u["prompt_tokens"], cached_tokens=u["cached_tokens"],
            completion_tokens=u["completion_tokens"], total_tokens=u["total_tokens"],
        ))
        r.timings.CopyFrom(timings_to_proto(out.metrics))
    return r
