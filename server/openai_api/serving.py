"""The chat and completion handlers: an OpenAI request -> `SamplingParams` + engine requests -> a body or SSE.

    serving = OpenAIServing(llm, servicer, served_model_name="smollm2-135m-instruct")
    body_or_chunks = await serving.chat(ChatCompletionRequest(...), disconnected)

Every request goes through the library's one front door (`LLM.make_requests`:
the chat template, tokenization, the checks and their wording), so a bad field
gets the same one-line message as over gRPC and from the library. The engine
requests of an HTTP call are registered in the gRPC servicer's ``active`` map,
so admission control (``--max-waiting``), draining and the shutdown's grace
period count both protocols together.

``n`` choices: the prompt is prefilled once and the children fork from it
(`LLM.submit_group`); choice i samples with ``seed + i`` when a seed is given.
Several prompts to /v1/completions: choice ``prompt_index * n + i``, as OpenAI
numbers them.

Streaming (Server-Sent Events, ``data: {json}`` then ``data: [DONE]``): chat
sends the role first, then content (or ``reasoning_content`` / ``tool_calls``
deltas), then one chunk per choice with its ``finish_reason``, then, with
``stream_options.include_usage``, one chunk with ``choices: []`` and the usage.
A client that goes away mid-stream has its requests aborted at once (their KV
pages return at the next engine step).

Structured output (`structured_outputs`, vLLM's names): ``response_format``
(``json_schema`` -> its ``schema``; ``json_object``; ``text`` -> none), the body
extra ``structured_outputs`` (`StructuredOutputsParams`' fields), or vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (with
``guided_whitespace_pattern``), on both endpoints; one per request (two is a 400
naming both). ``tool_choice`` "required" or a named function is a constraint too
(`forced_tool_calls`): a named function's output is its arguments, validated by
its ``parameters`` schema; "required" is a JSON array of ``{"name", "parameters"}``
calls, each name with its own tool's schema. Both are read back as tool calls
without a tool parser (finish_reason "tool_calls" when the output is complete)
and streamed as OpenAI's ``delta.tool_calls``, each call in one piece once its
arguments are whole. No call whose arguments do not parse is ever returned: an
output cut by ``max_tokens`` inside its first call comes back as content with
finish_reason "length" (as vLLM answers), and a later call cut short is left
out (the calls before it stay, finish_reason "length"). A constraint the library refuses, or that does not
compile, is a 400 whose ``param`` is the body field it came from. A choice whose
grammar fails mid-generation (no token allowed, min_tokens past the grammar's
end) ends with finish_reason "error" and its reason in the choice's ``error``
(the final chunk's, when streamed): the response is still a 200 that every
client parses, and the other choices keep their answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from jaxinfer.engine.kv_transfer import KVTransferParams, error_status
from jaxinfer.metrics import RequestMetrics
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams
from jaxinfer.server.openai_api.errors import APIError, bad_request, unsupported
from jaxinfer.server.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from jaxinfer.server.openai_api.reasoning import get_reasoning_parser
from jaxinfer.server.openai_api.tool_parsers import (
    ToolCall,
    chain,
    get_tool_parser,
    make_tool_call_id,
    parse_whole,
    tool_parser_for,
)
from jaxinfer.text.tokenizer import bytes_to_unicode

log = logging.getLogger("jaxinfer.server.http")

# Request fields whose names start the library's error messages (``top_p must be in (0, 1], got 1.5.``).
_FIELDS = (
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
    "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "stop_token_ids", "priority", "chat_template_kwargs", "tools", "echo",
    "prompt_logprobs", "structured_outputs",
)
# Fields copied one-to-one onto SamplingParams when the body sets them (the rest take the defaults in force:
# `OpenAIServing.sampling_defaults`).
_DIRECT = (
    "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "n",
)
# The fields a generation config sets (jaxinfer.loading.generation_config.SAMPLING_FIELDS).
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class HttpCall:
    """One engine request of an HTTP call, as the servicer's ``active`` map holds calls (abort, ended, finished)."""

    __slots__ = ("stream", "prompt_len", "finished", "_ended")

    def __init__(self, stream, prompt_len: int):
        self.stream = stream
        self.prompt_len = prompt_len
        self.finished = asyncio.Event()
        self._ended = False

    def abort(self) -> None:
        self.stream.abort()

    def ended(self) -> bool:
        return self._ended

    def end(self) -> None:
        self._ended = True
        self.finished.set()


class OpenAIServing:
    """The handlers of /v1/chat/completions and /v1/completions over one `LLM` and the gRPC servicer's bookkeeping."""

    def __init__(self, llm, servicer, *, served_model_name: Optional[str] = None, model_aliases: tuple = (),
                 tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None):
        self.llm = llm
        self.servicer = servicer
        self.model_name = served_model_name or llm.model_name
        # Without a served name, the names a user may know the model by work too: the one it was loaded by
        # (serve --model), its source file, its own name in any case.
        self._names = {self.model_name}
        if not served_model_name:
            source = getattr(llm, "model_source", None)
            self._names |= {a for a in model_aliases if a} | ({str(source.path)} if source is not None else set())
            self._names |= {n.lower() for n in self._names}
        self.created = int(time.time())
        self.tool_parser_name = tool_call_parser
        self.reasoning_parser_name = reasoning_parser
        self._tool_parser = None
        self._reasoning_parser = None
        self._token_bytes: dict = {}
        tok = llm.tokenizer
        if tool_call_parser is None and tok is not None:  # the family's own format, read from its template
            self.tool_parser_name = tool_parser_for(llm.model_config.architecture or "", tok.chat_template)
        if self.tool_parser_name:
            self._tool_parser = get_tool_parser(self.tool_parser_name, tok)
        if reasoning_parser:
            self._reasoning_parser = get_reasoning_parser(reasoning_parser, tok)

    # -- checks shared by every endpoint ------------------------------------------------

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self._names and name.lower() not in self._names:
            raise APIError(404, f"The model `{name}` does not exist: this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def check_serving(self) -> None:
        if self.servicer.draining:
            self.servicer._rejected("shutting_down")
            raise APIError(503, "the server is shutting down and accepts no new requests.")

    def check_capacity(self, n: int) -> None:
        cap = self.servicer._capacity()
        if cap is not None and n > cap:  # could never be admitted: not a 429 to retry
            raise APIError(400, f"this request asks for {n} choices, more than the server ever runs at once: "
                           f"{cap} (max_num_seqs + max_waiting).", param="n")
        message = self.servicer.capacity_refusal(n)
        if message is not None:
            self.servicer.rejected += 1
            self.servicer._rejected("resource_exhausted")
            raise APIError(429, message, code="rate_limit_exceeded")

    # -- sampling parameters ------------------------------------------------------------

    def sampling_params(self, body, *, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None,
                        structured: Optional["Structured"] = None) -> SamplingParams:
        """The sampling defaults in force (`sampling_defaults`) overridden by every field the body sets; 400 when
        out of range."""
        kw = {name: getattr(body, name) for name in _DIRECT if getattr(body, name) is not None}
        kw["max_tokens"] = max_tokens  # None: the rest of the context (as vLLM), never SamplingParams' 16
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        kw["stop_token_ids"] = list(body.stop_token_ids or [])
        kw["logprobs"] = logprobs
        kw["prompt_logprobs"] = prompt_logprobs
        if body.logit_bias:
            kw["logit_bias"] = dict(body.logit_bias)
        if structured is not None:
            kw["structured_outputs"] = structured.params
        try:
            return self.llm.get_default_sampling_params().clone(**kw)
        except (ValueError, TypeError) as e:
            raise bad_request(e, _FIELDS) from None

    def sampling_defaults(self) -> dict:
        """What a sampling field the body leaves unset takes, and where that comes from (``generation_config``:
        "auto", "vllm", a path, or None for a model wrapped in memory): the extra ``sampling_defaults`` of
        a /v1/models card, as vLLM's ``--generation-config`` chooses them."""
        d = self.llm.get_default_sampling_params()
        return {"generation_config": getattr(self.llm, "generation_config", None),
                **{name: getattr(d, name) for name in _DEFAULTED}}

    # -- engine requests ----------------------------------------------------------------

    async def _make(self, prompt, params, arrival: float, rid: str, priority: int,
                    structured: Optional["Structured"] = None, **chat) -> list:
        """The choices' engine requests, built in the servicer's threads (template + tokenizer off the loop);
        the constraint is compiled there too (a 400 naming the body field it came from when it does not)."""

        def build():
            return self.llm.make_requests(prompt, params, request_id=rid, priority=priority,
                                          metrics=RequestMetrics(arrival_time=arrival), **chat)

        try:
            return await self.servicer._in_pool(build)
        except (ValueError, UnicodeError) as e:
            self.servicer._rejected("invalid_argument")
            err = bad_request(e, _FIELDS)
            if structured is not None and err.message.startswith("structured"):
                raise structured.refusal(err.message) from None
            raise err from None

    def _submit(self, groups: list) -> list:
        """Admit and submit every group of choices at once; returns the calls in choice order."""
        self.check_serving()  # again: shutdown may have begun while the prompts were tokenized
        self.check_capacity(sum(len(g) for g in groups))
        calls = []
        try:
            for reqs in groups:
                for req, stream in zip(reqs, self.llm.submit_group(reqs)):
                    calls.append(HttpCall(stream, len(req.prompt_ids)))
                    self.servicer.active[stream.request_id] = calls[-1]
        except BaseException as e:
            self._release(calls)
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param="request_id") from None
            raise
        self.servicer.idle.clear()
        return calls

    def _release(self, calls: list) -> None:
        """The HTTP call is over: abort whatever has not finished and unregister every request."""
        s = self.servicer
        for c in calls:
            if c.stream.output is None:
                c.abort()
            if s.active.get(c.stream.request_id) is c:
                del s.active[c.stream.request_id]
            c.end()
            if s.metrics is not None:
                s.metrics.on_call_end(c.stream)
        if not s.active:
            s.idle.set()

    def _failure(self, output) -> Optional[APIError]:
        """Why a finished choice is an error instead of an answer: the engine failed it (500), or the shutdown
        aborted it after its grace period (503, the gRPC status's HTTP twin); else None."""
        reason = output.outputs[0].finish_reason
        status = error_status(output.outputs[0].error) if reason == "error" else None
        if status is not None:  # its KV transfer failed (unknown or expired transfer id, prefill gone): the router's cue
            return APIError(status if 400 <= status < 600 and status != 499 else 502, output.outputs[0].error)
        if reason == "error" and not output.outputs[0].error:  # with a message: the choice says it (not a failure)
            return APIError(500, "the engine failed this request.")
        if reason == "abort" and self.servicer.abort_message is not None:
            return APIError(503, self.servicer.abort_message)
        return None

    async def _whole(self, calls: list, disconnected) -> list:
        """Every choice's final output (not streamed); the call is released either way; raises a failure."""
        try:
            outputs = await _collect(calls, disconnected)
        finally:
            self._release(calls)
        errors = [e for e in map(self._failure, outputs) if e is not None]
        if errors:
            raise min(errors, key=lambda e: e.status)  # a shutdown's 503 before an engine's 500
        return outputs

    # -- /v1/chat/completions --------------------------------------------------------------

    def _check_body(self, body) -> None:
        """What both endpoints check first: serving, the model's name, stream options, unsupported formats."""
        self.check_serving()
        self.check_model(body.model)
        _check_stream_options(body)
        _log_unknown(body)

    def _chat_inputs(self, body: ChatCompletionRequest) -> dict:
        choice = body.tool_choice
        if not isinstance(choice, dict) and choice not in (None, "auto", "none", "required"):
            raise unsupported("tool_choice", f"must be \"auto\", \"none\", \"required\" or a named function, got "
                              f"{choice!r}.")
        if body.tools and choice in (None, "auto") and self._tool_parser is None:
            raise APIError(400, "tools with tool_choice \"auto\" need a tool-call parser for this model: start the "
                           "server with --tool-call-parser (hermes, llama3_json, mistral), or send tool_choice "
                           "\"none\".", param="tool_choice")
        messages = [_message_dict(i, m) for i, m in enumerate(body.messages)]
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:
            kwargs["tools"] = body.tools
        add_generation_prompt = body.add_generation_prompt
        if body.continue_final_message and "add_generation_prompt" not in body.model_fields_set:
            add_generation_prompt = False  # vLLM's rule: continuing the last message implies no new turn
        return {"messages": messages, "chat_template_kwargs": kwargs, "add_generation_prompt": add_generation_prompt,
                "continue_final_message": body.continue_final_message}

    async def chat(self, body: ChatCompletionRequest, disconnected: Callable[[], Awaitable[None]]):
        """A chat completion: the response dict, or an async iterator of SSE bytes when ``stream``."""
        arrival = time.perf_counter()
        self._check_body(body)
        chat = self._chat_inputs(body)
        forced = forced_tool_calls(body)
        structured = structured_outputs(body, forced)
        self.check_capacity(max(1, body.n))  # before tokenizing: a full server says so at once
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        _refuse_streamed_prompt_logprobs(body)
        params = self.sampling_params(body, max_tokens=max_tokens, logprobs=logprobs,
                                      prompt_logprobs=body.prompt_logprobs, structured=structured)
        parse_tools = bool(body.tools) and body.tool_choice in (None, "auto")  # "required", named: no parser
        if self._keeps_special_tokens(parse_tools):  # the parser's markers are special tokens: keep them in the text
            params = params.clone(skip_special_tokens=False)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        transfer = _transfers(body, 1)[0]
        try:
            reqs = await self._make(None, params, arrival, rid, body.priority, structured, kv_transfer_params=transfer,
                                    **chat)
        except APIError as e:  # chat's names for what the library calls logprobs and the prompt
            e.param = {"logprobs": "top_logprobs", "prompt": "messages"}.get(e.param, e.param)
            raise
        prompt_text = reqs[0].prompt  # the rendered conversation: whether the output starts inside <think>
        calls = self._submit([reqs])
        if body.stream:
            return self._chat_stream(body, rid, calls, parse_tools, prompt_text, disconnected, forced)
        outputs = await self._whole(calls, disconnected)
        choices = [self._chat_choice(i, o, parse_tools, logprobs, prompt_text, forced) for i, o in enumerate(outputs)]
        answer = {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
            "choices": choices, "usage": _usage(outputs, len(reqs)), "system_fingerprint": None,
        }
        if body.prompt_logprobs is not None:  # vLLM's extra, beside the choices
            answer["prompt_logprobs"] = self._prompt_logprobs(outputs[0].prompt_logprobs, body.prompt_logprobs)
        self._transfer_answer(answer, transfer)
        return answer

    def _keeps_special_tokens(self, parse_tools: bool) -> bool:
        parsers = [self._reasoning_parser] + ([self._tool_parser] if parse_tools else [])
        return any(p is not None and p.keeps_special_tokens() for p in parsers)

    def _chat_choice(self, index: int, out, parse_tools: bool, logprobs: Optional[int], prompt_text,
                     forced: Optional["ForcedToolCalls"] = None) -> dict:
        comp = out.outputs[0]
        if forced is not None:  # the whole output is the calls' JSON (the constraint held from the first token)
            reasoning, (calls, content) = None, forced.parse(comp.text)
        else:
            reasoning, content, calls = self._parse_whole(comp.text, parse_tools, prompt_text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = [_tool_call_dict(c) for c in calls]
        finish = "tool_calls" if calls and comp.finish_reason == "stop" else comp.finish_reason
        return _with_error({
            "index": index, "message": message,
            "logprobs": {"content": self._chat_logprobs(comp.logprobs or [], logprobs)} if logprobs is not None
            else None,
            "finish_reason": finish, "stop_reason": comp.stop_reason,
        }, comp)

    def _parse_whole(self, text: str, parse_tools: bool, prompt_text: Optional[str]):
        """(reasoning, content, tool calls) of a whole output; content None when the output is only calls."""
        reasoning, content, calls = parse_whole(text, self._reasoning_parser,
                                                self._tool_parser if parse_tools else None, prompt_text=prompt_text)
        return reasoning, (content or None) if calls else (content or ""), calls

    def token_bytes(self, token_id: int) -> list:
        """The UTF-8 bytes a token stands for: its own byte for a byte piece (``<0xE6>``, byte-level BPE's
        ``æ``), where decoding it alone gives only a replacement character."""
        b = self._token_bytes.get(token_id)
        if b is None:
            text = self.servicer._token_str(token_id)
            b = list(text.encode("utf-8"))
            if "\ufffd" in text and self.llm.tokenizer is not None:
                piece = self.llm.tokenizer.convert_ids_to_tokens([token_id])[0] or ""
                raw = _piece_bytes(piece)
                if raw is not None:
                    b = list(raw)
            self._token_bytes[token_id] = b
        return b

    def _chat_logprobs(self, lps: list, top: Optional[int]) -> list:
        token_str = self.servicer._token_str
        out = []
        for lp in lps:
            if lp is None:
                continue
            tid = int(lp.token_id)
            alts = sorted(lp.top.items(), key=lambda kv: -kv[1])[: top or 0]
            out.append({
                "token": token_str(tid), "logprob": float(lp.logprob), "bytes": self.token_bytes(tid),
                "top_logprobs": [
                    {"token": token_str(int(i)), "logprob": float(v), "bytes": self.token_bytes(int(i))}
                    for i, v in alts
                ],
            })
        return out

    async def _chat_stream(self, body: ChatCompletionRequest, rid: str, calls: list, parse_tools: bool,
                           prompt_text: Optional[str], disconnected,
                           forced: Optional["ForcedToolCalls"] = None) -> AsyncIterator[bytes]:
        created = int(time.time())
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        streamers = [forced.streamer() if forced is not None else self._chat_streamer(parse_tools, prompt_text)
                     for _ in calls]
        tools_called = [False] * len(calls)
        n_tokens = [0] * len(calls)

        def chunk(index: int, delta: dict, finish=None, stop_reason=None, lps=None, usage=None, comp=None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
                _with_error(choice, comp)
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                   "choices": [choice]}
            if include_usage or continuous:
                obj["usage"] = usage
            return _sse(obj)

        def running_usage(i: int) -> Optional[dict]:
            if not continuous:
                return None
            p = calls[i].prompt_len
            return {"prompt_tokens": p, "completion_tokens": n_tokens[i], "total_tokens": p + n_tokens[i]}

        outputs = [None] * len(calls)
        try:
            for i in range(len(calls)):
                yield chunk(i, {"role": "assistant", "content": ""}, usage=running_usage(i))
            async for i, delta in _merged(calls, disconnected):
                n_tokens[i] += len(delta.token_ids)
                piece = _feed(streamers[i], delta.text)
                lps = None
                if logprobs is not None and delta.logprobs:
                    lps = {"content": self._chat_logprobs(delta.logprobs, logprobs)}
                if delta.output is not None:
                    tail = _finish(streamers[i])
                    piece = _merge_delta(piece, tail)
                if piece.get("tool_calls"):
                    tools_called[i] = True
                if piece or lps:
                    if not piece:
                        piece = {"content": ""}
                    yield chunk(i, piece, lps=lps, usage=running_usage(i))
                if delta.output is not None:
                    outputs[i] = delta.output
                    comp = delta.output.outputs[0]
                    err = self._failure(delta.output)
                    if err is not None:
                        yield _sse(err.body())
                        continue
                    finish = "tool_calls" if tools_called[i] and comp.finish_reason == "stop" else comp.finish_reason
                    yield chunk(i, {}, finish=finish, stop_reason=comp.stop_reason, usage=running_usage(i), comp=comp)
            if include_usage and all(o is not None for o in outputs):
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                            "choices": [], "usage": _usage(outputs, len(calls))})
            yield SSE_DONE
        except _EngineFailed as e:
            yield _sse(APIError(500, str(e)).body())
            yield SSE_DONE
        finally:
            self._release(calls)

    def _chat_streamer(self, parse_tools: bool, prompt_text: Optional[str]):
        """What turns one choice's text deltas into content / reasoning / tool-call deltas (None: text is content)."""
        r = self._reasoning_parser.streamer(prompt_text) if self._reasoning_parser is not None else None
        t = self._tool_parser.streamer() if (parse_tools and self._tool_parser is not None) else None
        return None if r is None and t is None else chain(r, t)

    # -- /v1/completions -------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, disconnected: Callable[[], Awaitable[None]]):
        arrival = time.perf_counter()
        self._check_body(body)
        if body.suffix:
            raise unsupported("suffix", "is not supported.")
        if body.best_of is not None and body.best_of != body.n:
            raise unsupported("best_of", f"is not supported (got {body.best_of}); use n.")
        _refuse_streamed_prompt_logprobs(body)
        structured = structured_outputs(body)
        prompts = _prompt_list(body.prompt)
        self.check_capacity(len(prompts) * max(1, body.n))
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
        params = self.sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                      prompt_logprobs=prompt_logprobs, structured=structured)
        rid = f"cmpl-{uuid.uuid4().hex}"
        groups = []
        transfers = _transfers(body, len(prompts))
        for k, p in enumerate(prompts):
            groups.append(await self._make(p, params, arrival, rid if len(prompts) == 1 else f"{rid}-p{k}",
                                           body.priority, structured, kv_transfer_params=transfers[k]))
        calls = self._submit(groups)
        n = len(groups[0])
        echoes = [self._echo_text(g[0]) if body.echo else "" for g in groups]
        if body.stream:
            prompt_ids = [g[0].prompt_ids for g in groups]
            return self._completion_stream(body, rid, calls, n, echoes, prompt_ids, disconnected)
        outputs = await self._whole(calls, disconnected)
        choices = []
        for i, out in enumerate(outputs):
            comp = out.outputs[0]
            echo = echoes[i // n]
            lps = None
            if body.logprobs is not None:
                lps = self._completion_logprobs(comp.logprobs or [], body.logprobs, len(echo))
                if body.echo:
                    lps = _join_logprobs(self._echo_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                             body.logprobs), lps)
            choice = _with_error({"index": i, "text": echo + comp.text, "logprobs": lps,
                                  "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}, comp)
            if body.prompt_logprobs is not None:  # vLLM's extra, in each choice
                choice["prompt_logprobs"] = self._prompt_logprobs(out.prompt_logprobs, body.prompt_logprobs)
            choices.append(choice)
        usage = _usage_groups(outputs, n)
        answer = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                  "choices": choices, "usage": usage, "system_fingerprint": None}
        self._transfer_answer(answer, transfers[0] if len(transfers) == 1 else None)
        return answer

    def _transfer_answer(self, answer: dict, transfer) -> None:
        """A prefill server's answer names the transfer it holds (vLLM's ``kv_transfer_params``): what a
        proxy passes to the decode server's request."""
        kv = self.llm.engine.kv
        if transfer is not None and kv is not None and kv.role == "prefill":
            answer["kv_transfer_params"] = kv.response_params(transfer)

    def _echo_text(self, req) -> str:
        if req.prompt is not None:
            return req.prompt
        tok = self.llm.tokenizer
        return tok.decode(req.prompt_ids, skip_special_tokens=False) if tok is not None else ""

    def _echo_logprobs(self, prompt_ids: list, plps: Optional[list], top: Optional[int]) -> dict:
        """The echoed prompt's part of a completion's logprobs (OpenAI's format, as vLLM fills it): every
        prompt token, the first with null logprob and null top_logprobs (nothing precedes it)."""
        token_str = self.servicer._token_str
        plps = plps if plps is not None else [None] * len(prompt_ids)
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tid, lp in zip(prompt_ids, plps):
            s = token_str(int(tid))
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_finite(lp.logprob))
            tops.append({} if top else None)
            for i, v in list(lp.top.items())[: top or 0]:  # tokens that read the same share a key: the likeliest
                tops[-1].setdefault(token_str(int(i)), _finite(v))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, plps: Optional[list], k: int) -> Optional[list]:
        """vLLM's ``prompt_logprobs``: per prompt token null (the first) or {token id: {logprob, rank,
        decoded_token}} holding the token itself and the ``k`` likeliest at its position."""
        if plps is None:
            return None
        token_str = self.servicer._token_str
        out: list = []
        for lp in plps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                        "decoded_token": token_str(int(lp.token_id))}}
            for rank, (tid, v) in enumerate(list(lp.top.items())[:k], start=1):
                entry.setdefault(str(int(tid)), {"logprob": _finite(v), "rank": rank,
                                                 "decoded_token": token_str(int(tid))})
            out.append(entry)
        return out

    def _completion_logprobs(self, lps: list, top: Optional[int], offset: int) -> dict:
        token_str = self.servicer._token_str
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            if lp is None:
                continue
            s = token_str(int(lp.token_id))
            tokens.append(s)
            token_lps.append(float(lp.logprob))
            alts = sorted(lp.top.items(), key=lambda kv: -kv[1])[: top or 0]
            tops.append({} if top else None)
            for i, v in alts:  # tokens that read the same share a key: keep the likeliest
                tops[-1].setdefault(token_str(int(i)), float(v))
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _completion_stream(self, body: CompletionRequest, rid: str, calls: list, n: int, echoes: list,
                                 prompt_ids: list, disconnected) -> AsyncIterator[bytes]:
        created = int(time.time())
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        offsets = [len(echoes[i // n]) for i in range(len(calls))]
        n_tokens = [0] * len(calls)
        outputs = [None] * len(calls)

        def chunk(index, text, lps=None, finish=None, stop_reason=None, comp=None) -> bytes:
            choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
                _with_error(choice, comp)
            obj = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [choice]}
            if include_usage or continuous:
                obj["usage"] = None
                if continuous:
                    p = calls[index].prompt_len
                    obj["usage"] = {"prompt_tokens": p, "completion_tokens": n_tokens[index],
                                    "total_tokens": p + n_tokens[index]}
            return _sse(obj)

        # echo with logprobs: the prompt's chunk waits for its logprobs, which come with the first token
        echo_later = body.echo and body.logprobs is not None
        try:
            if any(echoes) and not echo_later:
                for i in range(len(calls)):
                    yield chunk(i, echoes[i // n])
            async for i, delta in _merged(calls, disconnected):
                if echo_later and delta.prompt_logprobs is not None:
                    yield chunk(i, echoes[i // n],
                                self._echo_logprobs(prompt_ids[i // n], delta.prompt_logprobs, body.logprobs))
                n_tokens[i] += len(delta.token_ids)
                lps = None
                if body.logprobs is not None and delta.logprobs:
                    lps = self._completion_logprobs(delta.logprobs, body.logprobs, offsets[i])
                    offsets[i] = lps["text_offset"][-1] + len(lps["tokens"][-1]) if lps["tokens"] else offsets[i]
                if delta.output is None:
                    if delta.text or lps:
                        yield chunk(i, delta.text, lps)
                    continue
                outputs[i] = delta.output
                comp = delta.output.outputs[0]
                err = self._failure(delta.output)
                if err is not None:
                    yield _sse(err.body())
                    continue
                yield chunk(i, delta.text, lps, finish=comp.finish_reason, stop_reason=comp.stop_reason, comp=comp)
            if include_usage and all(o is not None for o in outputs):
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                            "choices": [], "usage": _usage_groups(outputs, n)})
            yield SSE_DONE
        except _EngineFailed as e:
            yield _sse(APIError(500, str(e)).body())
            yield SSE_DONE
        finally:
            self._release(calls)


# --------------------------------------------------------------------------- #
# Structured output: the body's constraint fields -> one StructuredOutputsParams
# --------------------------------------------------------------------------- #


class Structured:
    """A request's constraint and where in the body it came from, so a refusal names that field."""

    __slots__ = ("params", "param", "path")

    def __init__(self, params: StructuredOutputsParams, param: str, path: str):
        self.params = params
        self.param = param  # the error's ``param``: the top-level body field
        self.path = path  # what a message names: ``response_format.json_schema.schema``, ``guided_regex``...

    def refusal(self, message: str) -> APIError:
        """A 400 for the library's message about this constraint (it says ``structured_outputs.<kind>``: when
        the body said it another way, the message starts with the body's own field)."""
        if self.path != "structured_outputs":
            message = f"{self.path}: {message}"
        return APIError(400, message, param=self.param)


# vLLM's older body fields, each one kind of StructuredOutputsParams.
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))


def structured_outputs(body, forced: Optional["ForcedToolCalls"] = None) -> Optional[Structured]:
    """The request's one constraint: ``response_format``, the body extra ``structured_outputs``, a ``guided_*``
    field, or the tool call that ``tool_choice`` forces; None without one. Two of them is a 400 naming both;
    a constraint the library refuses is a 400 naming the field it came from."""
    found = []  # (what to call it, param, path, StructuredOutputsParams fields)
    if body.response_format is not None:
        fmt = _response_format(body.response_format)
        if fmt is not None:
            found.append(("response_format",) * 2 + fmt)
    if body.structured_outputs is not None:
        found.append(("structured_outputs",) * 3 + (dict(body.structured_outputs),))
    for name, kind in _GUIDED:
        value = getattr(body, name)
        if value is not None:
            found.append((name,) * 3 + ({kind: value},))
    if forced is not None:
        found.append((f"tool_choice {forced.label}", "tools", forced.path, {"json": forced.schema}))
    if not found:
        return None
    if len(found) > 1:
        names = [f[0] for f in found]
        raise APIError(400, f"{' and '.join(names)} each constrain the output; give only one of them.",
                       param=found[0][1])
    _, param, path, fields = found[0]
    if body.guided_whitespace_pattern is not None and "whitespace_pattern" not in fields:
        fields["whitespace_pattern"] = body.guided_whitespace_pattern
    try:
        params = StructuredOutputsParams.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise Structured(None, param, path).refusal(str(e)) from None
    return Structured(params, param, path)


def _response_format(fmt: dict) -> Optional[tuple]:
    """OpenAI's response_format as (path, StructuredOutputsParams fields); None for ``{"type": "text"}``."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("response_format", {"json_object": True})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format.json_schema is required with type \"json_schema\": "
                           "{\"name\": ..., \"schema\": {...}, \"strict\": true}.", param="response_format")
        if spec.get("schema") is None:
            raise APIError(400, "response_format.json_schema.schema is required: the JSON Schema the output must "
                           "validate against.", param="response_format")
        # name, description and strict are accepted; the schema is always enforced (strict or not)
        return ("response_format.json_schema.schema", {"json": spec["schema"]})
    raise APIError(400, f"response_format.type must be \"text\", \"json_object\" or \"json_schema\", got "
                   f"{json.dumps(kind)}.", param="response_format")


# --------------------------------------------------------------------------- #
# tool_choice "required" or a named function: the output is constrained to the calls
# --------------------------------------------------------------------------- #

# A tool without parameters takes none: its arguments are ``{}`` (vLLM's empty object also allows any property).
_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _offered_functions(tools: Optional[list]) -> list:
    """(name, parameters schema) of each tool offered."""
    out = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"parameters\": {...}}}.", param="tools")
        params = fn.get("parameters")
        if params is None or params == {}:  # as vLLM reads it: no parameters
            params = _EMPTY_PARAMETERS
        elif not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object, got "
                           f"{type(params).__name__}.", param="tools")
        out.append((fn["name"], params))
    return out


def forced_tool_calls(body) -> Optional["ForcedToolCalls"]:
    """What ``tool_choice`` forces, as vLLM does: a named function's arguments (its parameters' schema), or for
    "required" a JSON array (at least one item; one at most with ``parallel_tool_calls: false``) of
    ``{"name": <a tool's name>, "parameters": <that tool's arguments>}``, each name paired with its own schema.
    None for "auto", "none" or no tool_choice."""
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    functions = _offered_functions(body.tools)
    if not functions:
        raise APIError(400, f"tool_choice {json.dumps(choice)} needs tools: the request offers none.",
                       param="tool_choice")
    if choice == "required":
        defs: dict = {}
        items = []
        for i, (name, params) in enumerate(functions):
            params = dict(params)
            for key in ("$defs", "definitions"):  # their $refs point at the root: lift them to the array's
                for d, schema in (params.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(d, schema) != schema:
                        raise APIError(400, f"tools[{i}].function.parameters.{key}.{d} differs from another "
                                       f"tool's {key}.{d}: with tool_choice \"required\" they share one schema.",
                                       param="tools")
            items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                           "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ForcedToolCalls(None, schema, "tools", '"required"')
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)[:80]}.", param="tool_choice")
    for i, (offered, params) in enumerate(functions):
        if offered == name:
            return ForcedToolCalls(name, params, f"tools[{i}].function.parameters", json.dumps(name))
    raise APIError(400, f"tool_choice names the function {json.dumps(name)}, which is not among the tools offered "
                   f"({', '.join(json.dumps(n) for n, _ in functions)}).", param="tool_choice")


class ForcedToolCalls:
    """A forced call's output read back without a tool parser: a named function's output is its arguments; a
    "required" output is the array of calls, read as it grows (`_CallsReader`), so streamed arguments are the
    model's own text, the same as the whole response's."""

    def __init__(self, name: Optional[str], schema: dict, path: str, label: str):
        self.name = name  # the named function; None: "required"
        self.schema = schema
        self.path = path  # where the schema came from, for errors
        self.label = label

    def parse(self, text: str) -> tuple:
        """(tool calls, content) of a whole output: the calls whose name was read and whose arguments are whole
        JSON, content None; when there is none (an output cut by max_tokens inside its first call), no call and
        the text as content. A later call cut short is left out: no call's arguments ever fail to parse."""
        if self.name is not None:
            named = [(self.name, text)]
        else:
            reader = _CallsReader()
            reader.feed(text)
            named = [(name, "".join(args)) for name, args in reader.calls]
        calls = [ToolCall(make_tool_call_id(), name, args) for name, args in named
                 if name and _whole_arguments(args, final=True)]
        return (calls, None) if calls else ([], text)

    def streamer(self) -> "_ForcedStream":
        return _ForcedStream(self.name)


def _whole_arguments(text: str, final: bool) -> bool:
    """Whether a forced call's arguments are whole JSON: while streaming, a closed object, array or string (a
    number could still grow); at the end of the output, any JSON value."""
    if not final and text.rstrip()[-1:] not in ("}", "]", '"'):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return final or isinstance(value, (dict, list, str))


class _ForcedStream:
    """One streamed choice of a forced call: OpenAI's ``delta.tool_calls`` pieces, each call whole once its
    arguments are (index, id, type, name and the arguments as the model wrote them; whitespace after them
    follows as an arguments piece), so a call cut short by max_tokens is never sent. An output that ends with
    no whole call (cut inside its first) ends as content; a later call cut short is left out: the same calls
    and content as the whole response (`ForcedToolCalls.parse`)."""

    def __init__(self, name: Optional[str]):
        self.name = name
        self.reader = None if name is not None else _CallsReader()
        self.args: list = []  # the named function's arguments so far
        self.taken: list = []  # per call sent: how many of its argument pieces went out

    def _delta(self, final: bool) -> dict:
        out = []
        calls = [(self.name, self.args)] if self.reader is None else self.reader.calls
        for index, (name, args) in enumerate(calls):
            if index == len(self.taken):  # not sent yet: it goes out whole, with its id and name
                if not name or not _whole_arguments("".join(args), final):
                    break
                self.taken.append(len(args))
                out.append({"index": index, "id": make_tool_call_id(), "type": "function",
                            "function": {"name": name, "arguments": "".join(args)}})
            elif len(args) > self.taken[index]:
                piece = "".join(args[self.taken[index]:])
                self.taken[index] = len(args)
                out.append({"index": index, "function": {"arguments": piece}})
        if out:
            return {"tool_calls": out}
        if final and not self.taken:
            text = "".join(self.args if self.reader is None else self.reader.text)
            return {"content": text} if text else {}
        return {}

    def feed(self, text: str) -> dict:
        if not text:
            return {}
        if self.reader is None:
            self.args.append(text)
        else:
            self.reader.feed(text)
        return self._delta(False)

    def finish(self) -> dict:
        return self._delta(True)


class _CallsReader:
    """Reads ``[{"name": "...", "parameters": {...}}, ...]`` as it grows (whitespace wherever JSON allows it,
    keys in any order): each call's name, and its parameters' JSON text exactly as written."""

    _WS = " \t\r\n"

    def __init__(self):
        self.calls: list = []  # [name or None, [characters of the parameters' text]]
        self.text: list = []  # everything fed
        self._depth = 0  # 0: before the array, 1: in it, 2: in a call's object, -1: after the array
        self._state = "key"  # in a call's object: key, colon, value, name (its string), next
        self._key: Optional[str] = None
        self._string: Optional[list] = None  # the raw characters of a key or a name being read
        self._escaped = False
        self._value: Optional[str] = None  # a value being read: "parameters" (kept) or "skip"
        self._nesting = 0
        self._in_string = False

    def feed(self, text: str) -> None:
        self.text.append(text)
        for c in text:
            self._char(c)

    def _char(self, c: str) -> None:
        if self._value is not None and not self._value_char(c):
            return  # else c ended a bare value (a number, true...) and belongs to the object
        if self._string is not None:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                text = _json_string("".join(self._string))
                self._string = None
                if self._state == "key":
                    self._key, self._state = text, "colon"
                else:
                    self.calls[-1][0], self._state = text, "next"
                return
            self._string.append(c)
            return
        if self._depth == 0:
            self._depth = 1 if c == "[" else 0
        elif self._depth == 1:
            if c == "{":
                self._depth, self._state = 2, "key"
                self.calls.append([None, []])
            elif c == "]":
                self._depth = -1
        elif self._depth == 2 and c not in self._WS:
            if self._state == "key" and c == '"':
                self._string = []
            elif self._state == "colon" and c == ":":
                self._state = "value"
            elif self._state == "value":
                if self._key == "name" and c == '"':
                    self._string, self._state = [], "name"
                else:
                    self._value, self._nesting, self._in_string = (
                        "parameters" if self._key == "parameters" else "skip"), 0, False
                    self._value_char(c)
            elif self._state == "next":
                if c == ",":
                    self._state = "key"
                elif c == "}":
                    self._depth = 1

    def _value_char(self, c: str) -> bool:
        """Take one character of the value being read; True when the value had ended before it."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
            self._keep(c)
            if not self._in_string and self._nesting == 0:
                self._value, self._state = None, "next"
            return False
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._nesting += 1
        elif c in "}]" or (self._nesting == 0 and (c == "," or c in self._WS)):
            if self._nesting == 0:
                self._value, self._state = None, "next"
                return True
            self._nesting -= 1
            self._keep(c)
            if self._nesting == 0:
                self._value, self._state = None, "next"
            return False
        self._keep(c)
        return False

    def _keep(self, c: str) -> None:
        if self._value == "parameters":
            self.calls[-1][1].append(c)


def _json_string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def _with_error(choice: dict, comp) -> dict:
    """A choice that ended with finish_reason "error" and a reason (a grammar that allows no token, for one)
    carries the reason as ``error``: the response still parses, the other choices keep their answers."""
    if comp is not None and comp.finish_reason == "error" and comp.error:
        choice["error"] = comp.error
    return choice


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


class _EngineFailed(Exception):
    pass


def _refuse_streamed_prompt_logprobs(body) -> None:
    """vLLM's rule: prompt_logprobs are not streamed (completions stream an echoed prompt's logprobs instead)."""
    if body.stream and body.prompt_logprobs is not None:
        raise unsupported("prompt_logprobs", "is not available when stream is true (as in vLLM); with /v1/completions, "
                          "echo with logprobs streams the prompt tokens' logprobs.")


def _finite(x: float) -> float:
    """A logprob JSON can carry: -inf (a token the model rules out) as vLLM writes it, -9999.0."""
    return max(float(x), -9999.0)


def _join_logprobs(first: dict, then: dict) -> dict:
    """Two pieces of a completion's logprobs (OpenAI's format) one after the other."""
    return {key: first[key] + then[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(piece: str) -> Optional[bytes]:
    """The bytes of a byte-fallback piece (``<0xE6>``) or of a byte-level BPE piece (GPT-2's byte alphabet)."""
    m = _BYTE_PIECE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    decoder = _BYTE_DECODER or _BYTE_DECODER.update({c: b for b, c in bytes_to_unicode().items()}) or _BYTE_DECODER
    try:
        return bytes(decoder[c] for c in piece)
    except KeyError:
        return None


_BYTE_DECODER: dict = {}


def _check_stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream set to true.", param="stream_options")


def _log_unknown(body) -> None:
    extra = body.unknown_fields()
    if extra:
        log.debug("ignored unknown request fields: %s", ", ".join(extra))


def _message_dict(i: int, m) -> dict:
    """One chat message as the chat template reads it (text parts joined; tool-call arguments as objects)."""
    d: dict[str, Any] = {"role": m.role}
    content = m.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{i}].content[{j}]: parts of type {part.type!r} are not supported: "
                               "this model reads text only (type 'text' with a 'text' field).", param="messages")
            texts.append(part.text)
        content = "".join(texts)
    d["content"] = content
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        d["reasoning_content"] = reasoning
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, f"messages[{i}].tool_calls[{j}] must have a function with a name.",
                               param="messages")
            args = fn.get("arguments")
            if isinstance(args, str):  # templates index the arguments as an object, as transformers hands them
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON.",
                                   param="messages") from None
            calls.append({**call, "function": {**fn, "arguments": args}})
        d["tool_calls"] = calls
    return d


def _prompt_list(prompt) -> list:
    """/v1/completions' prompt forms as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty: a string, a list of strings, token ids or lists of them.",
                       param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    for p in prompt:
        if not p and not isinstance(p, str):
            raise APIError(400, "prompt must not contain an empty list of token ids.", param="prompt")
    return [p if isinstance(p, str) else list(p) for p in prompt]


def _tool_call_dict(c) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _usage(outputs: list, n: int) -> dict:
    """One prompt's usage: its tokens once, every choice's completion tokens."""
    first = outputs[0]
    prompt = len(first.prompt_token_ids)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = first.metrics.cached_tokens if first.metrics is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(cached or 0)}}


def _usage_groups(outputs: list, n: int) -> dict:
    """Several prompts of n choices each: every prompt counted once."""
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}}
    for k in range(0, len(outputs), n):
        u = _usage(outputs[k:k + n], n)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[key] += u[key]
        total["prompt_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
    return total


def _feed(streamer, text: str) -> dict:
    if streamer is None:
        return {"content": text} if text else {}
    if isinstance(streamer, _ForcedStream):
        return streamer.feed(text)
    return _delta_dict(streamer.feed(text)) if text else {}


def _finish(streamer) -> dict:
    if isinstance(streamer, _ForcedStream):
        return streamer.finish()
    return {} if streamer is None else _delta_dict(streamer.finish())


def _delta_dict(d) -> dict:
    out: dict[str, Any] = {}
    if d.reasoning:
        out["reasoning_content"] = out["reasoning"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        calls = []
        for c in d.tool_calls:
            item: dict[str, Any] = {"index": c.index}
            if c.id is not None:
                item["id"] = c.id
                item["type"] = "function"
            fn: dict[str, Any] = {}
            if c.name is not None:
                fn["name"] = c.name
            fn["arguments"] = c.arguments
            item["function"] = fn
            calls.append(item)
        out["tool_calls"] = calls
    return out


def _merge_delta(a: dict, b: dict) -> dict:
    if not b:
        return a
    if not a:
        return b
    out = dict(a)
    for key in ("reasoning_content", "reasoning", "content"):
        if key in b:
            out[key] = out.get(key, "") + b[key]
    if "tool_calls" in b:
        out["tool_calls"] = out.get("tool_calls", []) + b["tool_calls"]
    return out


def _transfers(body, count: int) -> list:
    """One `KVTransferParams` (or None) per prompt, from SGLang's bootstrap_host/port/room (a value, or a list
    with one per prompt, as sglang-router sends a batch) or vLLM's kv_transfer_params; a 400 when malformed."""
    host, port, room = body.bootstrap_host, body.bootstrap_port, body.bootstrap_room
    try:
        if body.kv_transfer_params:
            if room is not None:
                raise ValueError("bootstrap_room and kv_transfer_params are two spellings of one thing: send one.")
            if count > 1:
                raise ValueError(f"kv_transfer_params names one transfer; this request has {count} prompts.")
            return [KVTransferParams.of(body.kv_transfer_params)]
        if isinstance(room, list):
            if len(room) != count:
                raise ValueError(f"bootstrap_room has {len(room)} entries for {count} prompts.")
            hosts = host if isinstance(host, list) else [host] * count
            ports = port if isinstance(port, list) else [port] * count
            if len(hosts) != count or len(ports) != count:
                raise ValueError(f"bootstrap_host and bootstrap_port need one entry per prompt ({count}).")
            return [KVTransferParams.of(bootstrap_host=h, bootstrap_port=p, bootstrap_room=r)
                    for h, p, r in zip(hosts, ports, room)]
        if isinstance(host, list) or isinstance(port, list):
            raise ValueError("bootstrap_host and bootstrap_port are lists only with a list of bootstrap_room.")
        if room is not None and count > 1:
            raise ValueError(f"one bootstrap_room for {count} prompts: send a list, one room per prompt.")
        return [KVTransferParams.of(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)] * count
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param="kv_transfer_params" if body.kv_transfer_params else "bootstrap_room")


async def _watch(disconnected, calls: list) -> None:
    """Abort every request of the call as soon as the client goes away."""
    await disconnected()
    for c in calls:
        c.abort()


async def _collect(calls: list, disconnected) -> list:
    """Every choice's final RequestOutput (non-streaming); aborts them all if the client disconnects first."""

    async def result(c):
        async for _ in c.stream:
            pass
        return c.stream.output

    watcher = asyncio.ensure_future(_watch(disconnected, calls))
    try:
        return list(await asyncio.gather(*(result(c) for c in calls)))
    except RuntimeError as e:  # the engine failed
        raise APIError(500, str(e)) from None
    finally:
        watcher.cancel()


async def _merged(calls: list, disconnected) -> AsyncIterator[tuple]:
    """(choice index, StreamDelta) from every choice's stream as they arrive, in order within a choice."""
    if len(calls) == 1:
        watcher = asyncio.ensure_future(_watch(disconnected, calls))
        try:
            async for delta in calls[0].stream:
                yield 0, delta
        except RuntimeError as e:
            raise _EngineFailed(str(e)) from None
        finally:
            watcher.cancel()
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, c):
        try:
            async for delta in c.stream:
                q.put_nowait((i, delta))
        except RuntimeError as e:
            q.put_nowait((i, _EngineFailed(str(e))))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(calls)]
    watcher = asyncio.ensure_future(_watch(disconnected, calls))
    left = len(calls)
    try:
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, _EngineFailed):
                raise item
            else:
                yield i, item
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()
