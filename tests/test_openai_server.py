"""The OpenAI-compatible HTTP API, end to end: the real `openai` client (and raw HTTP where the wire matters)
against a real server on loopback, on tiny models.

One module-scoped server per model pays the start-up once; tests that must stop a server start their own.
Modelled on what vLLM's tests/entrypoints/openai and llama.cpp's tools/server/tests check: every endpoint
streamed and not, the usage chunk, logprobs in both formats, n, seeds, stop strings, every error status, a
client that goes away mid-stream, auth, SIGTERM with streams in flight on both protocols, and tool calls and
reasoning from a model whose output is forced. After each test the engine holds no request and no KV page.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

import jaxinfer
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server import ServerConfig, ServerThread
from jaxinfer.server.client import Client, Unauthenticated
from openai_models import REASONING, SCRIPT_TEXT, TOOL_ARGS, forced_llm, sp_llm, weather_tool

MSG = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    llm = sp_llm(tmp_path_factory.mktemp("sp"))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(llm, ServerConfig(port=0, http_port=0)) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def _nothing_left_behind(request):
    yield
    for name in ("server", "tools_server"):
        if name in request.fixturenames:
            srv = request.getfixturevalue(name)
            assert_all_free(srv.llm, srv)


def assert_all_free(llm, server=None):
    if server is not None:
        deadline = time.time() + 10
        while server.call(lambda: len(server.servicer.active)) and time.time() < deadline:
            time.sleep(0.01)
        assert server.call(lambda: len(server.servicer.active)) == 0
    assert llm.wait_idle(10)
    assert llm.engine.stats.snapshot()["running"] == 0
    llm.engine.allocator.check_all_free()


def sse_events(response) -> list:
    """The ``data:`` payloads of a streamed response, in order (``[DONE]`` kept as the string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def greedy(max_tokens: int = 12) -> dict:
    return dict(temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True})


# --------------------------------------------------------------------------- #
# Endpoints, streamed and not
# --------------------------------------------------------------------------- #


def test_models_lists_the_served_model(oai, llm):
    models = oai.models.list().data
    assert [m.id for m in models] == [llm.model_name]
    assert models[0].max_model_len == llm.max_model_len
    assert oai.models.retrieve(llm.model_name).id == llm.model_name
    assert oai.completions.create(model=llm.model_name.upper(), prompt="hi", max_tokens=1).model == llm.model_name


def test_served_model_name_is_the_only_name(llm):
    with ServerThread(llm, ServerConfig(port=0, http_port=0, served_model_name="my-model")) as srv:
        with openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0) as c:
            assert [m.id for m in c.models.list().data] == ["my-model"]
            assert c.completions.create(model="my-model", prompt="hi", max_tokens=1).model == "my-model"
            with pytest.raises(openai.NotFoundError, match="my-model"):
                c.completions.create(model=llm.model_name, prompt="hi", max_tokens=1)


def test_chat_gives_the_librarys_tokens_streamed_or_not(oai, llm):
    want = llm.chat(MSG, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    r = oai.chat.completions.create(model=llm.model_name, messages=MSG, **greedy())
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12

    chunks = list(oai.chat.completions.create(model=llm.model_name, messages=MSG, stream=True, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_stream_ends_with_the_usage_chunk_then_done(server, llm):
    body = {"model": llm.model_name, "messages": MSG, "stream": True, "temperature": 0, "max_tokens": 7,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert all(e["usage"] is None for e in events[:-2])  # every other chunk says null, as OpenAI's do
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_completions_stream_equals_non_stream_and_counts_continuously(server, oai, llm):
    r = oai.completions.create(model=llm.model_name, prompt="hello jax", **greedy())
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    body = {"model": llm.model_name, "prompt": "hello jax", "stream": True, "temperature": 0, "max_tokens": 12,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.http_url + "/v1/completions", json=body, timeout=60) as resp:
        events = sse_events(resp)
    text_chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in text_chunks) == r.choices[0].text
    counts = [e["usage"]["completion_tokens"] for e in text_chunks]
    assert counts == sorted(counts) and counts[-1] == 12
    assert events[-2]["usage"]["completion_tokens"] == 12


def test_prompt_forms_of_completions(oai, llm):
    ids = llm.tokenizer.encode("hello jax")
    by_text = oai.completions.create(model=llm.model_name, prompt="hello jax", **greedy())
    by_ids = oai.completions.create(model=llm.model_name, prompt=ids, **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    other = llm.tokenizer.encode("page cache")
    both = oai.completions.create(model=llm.model_name, prompt=[ids, other], **greedy())
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + len(other)
    texts = oai.completions.create(model=llm.model_name, prompt=["hello jax", "page cache"], **greedy())
    assert [c.text for c in texts.choices] == [c.text for c in both.choices]
    echo = oai.completions.create(model=llm.model_name, prompt="hello jax", echo=True, **greedy())
    assert echo.choices[0].text == "hello jax" + by_text.choices[0].text


def test_max_tokens_absent_is_the_rest_of_the_context(oai, llm):
    r = oai.completions.create(model=llm.model_name, prompt="hello", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == llm.max_model_len - r.usage.prompt_tokens
    assert r.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- #
# Logprobs, n, seeds, stops, logit bias
# --------------------------------------------------------------------------- #


def test_chat_logprobs_are_the_librarys_in_openai_format(oai, llm):
    want = llm.chat(MSG, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))[0].outputs[0]
    r = oai.chat.completions.create(model=llm.model_name, messages=MSG, logprobs=True, top_logprobs=3,
                                    **greedy(6))
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for got, lp in zip(content, want.logprobs):
        assert got.logprob == pytest.approx(lp.logprob, abs=1e-5)
        assert len(got.top_logprobs) == 3 and got.top_logprobs[0].logprob >= got.top_logprobs[-1].logprob
        if "\ufffd" not in got.token:
            assert bytes(got.bytes).decode("utf-8") == got.token
    text = bytes(b for t in content for b in t.bytes).decode("utf-8", "replace")
    assert text == r.choices[0].message.content  # the tokens' bytes add up to the answer
    stream = list(oai.chat.completions.create(model=llm.model_name, messages=MSG, stream=True, logprobs=True,
                                              top_logprobs=3, **greedy(6)))
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == [t.logprob for t in content]


def test_completions_logprobs_format(oai, llm):
    r = oai.completions.create(model=llm.model_name, prompt="hello jax", logprobs=2, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    for i in range(11):
        assert lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i])
    if "\ufffd" not in r.choices[0].text:  # (a byte piece alone reads as U+FFFD)
        assert "".join(lp.tokens) == r.choices[0].text  # each token spelled as it reads in the text
    # greedy: the drawn token is the most likely one (tokens that read the same share a key, so 1 or 2 keys)
    assert all(1 <= len(t) <= 2 and max(t.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
               for i, t in enumerate(lp.top_logprobs))


def test_completions_echo_with_logprobs_scores_the_prompt_then_the_completion(server, oai, llm):
    """As vLLM answers it: the prompt's tokens first (the first with null logprob and top_logprobs), then the
    completion's, each the library's own prompt logprob / drawn-token logprob; streamed, the same numbers."""
    want = llm.generate(["hello jax"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2,
                                                      prompt_logprobs=2))[0]
    p = len(want.prompt_token_ids)
    r = oai.completions.create(model=llm.model_name, prompt="hello jax", echo=True, logprobs=2, **greedy(5))
    choice = r.choices[0]
    assert choice.text == "hello jax" + want.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == p + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:p] == pytest.approx([x.logprob for x in want.prompt_logprobs[1:]], abs=1e-6)
    assert lp.token_logprobs[p:] == pytest.approx([x.logprob for x in want.outputs[0].logprobs], abs=1e-6)
    for i in range(1, p):  # the top alternatives at each prompt position, as for drawn tokens
        assert 1 <= len(lp.top_logprobs[i]) <= 2 and max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i]
    assert lp.text_offset[:p] == sorted(lp.text_offset[:p]) and lp.text_offset[p] == len("hello jax")
    body = {"model": llm.model_name, "prompt": "hello jax", "echo": True, "logprobs": 2, "stream": True,
            "temperature": 0, "max_tokens": 5, "ignore_eos": True}
    with httpx.stream("POST", server.http_url + "/v1/completions", json=body, timeout=60) as resp:
        events = [e for e in sse_events(resp)[:-1] if e["choices"]]
    assert events[0]["choices"][0]["text"] == "hello jax"  # the echo comes first, with the prompt's logprobs
    assert "".join(e["choices"][0]["text"] for e in events) == choice.text
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert sum((s["token_logprobs"] for s in streamed), []) == lp.token_logprobs
    assert sum((s["tokens"] for s in streamed), []) == lp.tokens


def test_prompt_logprobs_field_on_both_endpoints_in_vllms_shape(server, llm):
    """vLLM's extra request field: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} with the token itself and the k likeliest; in each choice for completions, beside the
    choices for chat."""
    want = llm.generate(["hello jax"], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    body = {"model": llm.model_name, "prompt": "hello jax", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    r = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60).json()
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids) == r["usage"]["prompt_tokens"]
    for entry, lp in zip(got[1:], want.prompt_logprobs[1:]):
        own = entry[str(lp.token_id)]
        assert own["logprob"] == pytest.approx(lp.logprob, abs=1e-6) and own["rank"] == lp.rank >= 1
        assert own["decoded_token"] == llm.tokenizer.token_text(lp.token_id)
        assert 1 <= len(entry) <= 2 and any(v["rank"] == 1 for v in entry.values())
    plain = httpx.post(server.http_url + "/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert "prompt_logprobs" not in plain["choices"][0]  # only when asked: OpenAI's shape otherwise
    chat = {"model": llm.model_name, "messages": MSG, "max_tokens": 2, "prompt_logprobs": 0}
    c = httpx.post(server.http_url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in c["prompt_logprobs"][1:])  # k = 0: the token's own only
    refused = httpx.post(server.http_url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_n_choices_are_reproducible_and_each_is_seed_plus_index(oai, llm):
    kw = dict(model=llm.model_name, messages=MSG, n=3, seed=7, temperature=1.0, max_tokens=10,
              extra_body={"ignore_eos": True})
    first = oai.chat.completions.create(**kw)
    again = oai.chat.completions.create(**kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # the choices differ
    for i in range(3):
        one = llm.chat(MSG, SamplingParams(temperature=1.0, max_tokens=10, seed=7 + i, ignore_eos=True))[0]
        assert one.text == texts[i]
    assert first.usage.completion_tokens == 30
    streamed = list(oai.chat.completions.create(stream=True, **kw))
    by_choice = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
                 for i in range(3)]
    assert by_choice == texts


def test_stop_strings_end_the_text_before_them(oai, llm):
    full = oai.completions.create(model=llm.model_name, prompt="hello jax", **greedy(20))
    text = full.choices[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip())
    r = oai.completions.create(model=llm.model_name, prompt="hello jax", stop=[stop, "zzz"], **greedy(20))
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop


def test_logit_bias_forces_a_token(oai, llm):
    token = llm.tokenizer.encode("cache", add_special_tokens=False)[0]
    r = oai.completions.create(model=llm.model_name, prompt="hello", logit_bias={str(token): 100}, logprobs=0,
                               **greedy(5))
    assert r.choices[0].text == llm.tokenizer.decode([token] * 5)


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("body, status, param, words", [
    ('{"messages": [', 400, None, "not valid JSON"),
    ("[1, 2]", 400, None, "JSON object"),
    ('{"model": "tiny-chat"}', 400, "messages", "messages is required"),
    ('{"messages": 3}', 400, "messages", "valid list"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400, "temperature", "number"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', 400, "top_p", "top_p must be in (0, 1]"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', 400, "max_tokens",
     "maximum context length"),
    ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None, "lone surrogate"),
    ('{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}', 400, None, "lone surrogate"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}}', 400,
     "stream_options", "stream set to true"),
    ('{"messages": [{"role": "user", "content": "hi"}], "n": 0}', 400, "n", "n must be"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}', 400, "top_logprobs", "logprobs"),
    ('{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 99}', 400, "top_logprobs",
     "max allowed"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stop": ["a", ""]}', 400, "stop", "stop strings"),
    ('{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}', 400, "logit_bias", "99999"),
    ('{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}', 400,
     "response_format", "response_format.json_schema is required"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": [], "tool_choice": "required"}', 400, "tool_choice",
     "needs tools"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400,
     "messages", "text only"),
    ('{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "model", "does not exist"),
])
def test_bad_chat_requests_get_an_openai_error_naming_the_field(server, body, status, param, words):
    r = httpx.post(server.http_url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"] and "\n" not in err["message"] and "Traceback" not in err["message"]
    assert err["param"] == param


@pytest.mark.parametrize("body, words", [
    ({"prompt": []}, "must not be empty"),
    ({"prompt": [[1, 2], "mixed"]}, "none of the accepted types"),
    ({"prompt": "hi", "stream": True, "prompt_logprobs": 1}, "not available when stream is true"),
    ({"prompt": "hi", "prompt_logprobs": 99}, "prompt_logprobs must be at most"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format.json_schema is required"),
    ({"prompt": [1, 2, 99999]}, "out of range"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1"),
])
def test_bad_completion_requests_are_400(server, body, words):
    r = httpx.post(server.http_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_the_openai_client_raises_its_own_exceptions(oai, llm):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="temperature must be non-negative"):
        oai.chat.completions.create(model=llm.model_name, messages=MSG, temperature=-1)


def test_unknown_fields_are_ignored_and_unknown_routes_are_404(server, oai, llm):
    r = oai.chat.completions.create(model=llm.model_name, messages=MSG, max_tokens=2,
                                    extra_body={"frobnicate": 1, "user": "someone"})
    assert r.choices[0].message.content is not None
    r = httpx.get(server.http_url + "/v1/nothing-here")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]


def test_a_bad_request_leaves_the_others_unharmed(server, llm):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0) as ac:
            good = [ac.chat.completions.create(model=llm.model_name, messages=MSG, **greedy()) for _ in range(3)]
            bad = [ac.chat.completions.create(model=llm.model_name, messages=MSG, extra_body={"top_k": -5})
                   for _ in range(3)]
            return await asyncio.gather(*good, *bad, return_exceptions=True)

    results = asyncio.run(run())
    assert all(r.choices[0].finish_reason == "length" for r in results[:3])
    assert all(isinstance(r, openai.BadRequestError) for r in results[3:])


# --------------------------------------------------------------------------- #
# Disconnects, admission, auth, health, metrics, tokenize
# --------------------------------------------------------------------------- #




def _aborted(llm) -> int:
    return llm.engine.stats.snapshot()["finished"].get("abort", 0)


def test_a_client_that_leaves_mid_stream_has_its_request_aborted(server, llm, slow_decode):
    aborted = _aborted(llm)
    body = {"model": llm.model_name, "messages": MSG, "stream": True, "max_tokens": 100, "ignore_eos": True}
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    deadline = time.time() + 5
    while llm.engine.stats.snapshot()["running"] and time.time() < deadline:
        time.sleep(0.01)
    assert llm.engine.stats.snapshot()["running"] == 0 and _aborted(llm) == aborted + 1


def test_a_client_that_leaves_a_whole_answer_has_its_choices_aborted(server, llm, slow_decode):
    aborted = _aborted(llm)
    body = {"model": llm.model_name, "messages": MSG, "n": 2, "max_tokens": 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.time() + 5
    while _aborted(llm) < aborted + 2 and time.time() < deadline:
        time.sleep(0.01)
    assert _aborted(llm) == aborted + 2


def test_the_body_limit_holds_for_chunked_uploads(llm):
    with ServerThread(llm, ServerConfig(port=0, http_port=0, max_message_bytes=4096)) as srv:
        body = json.dumps({"prompt": "hello " * 2000, "max_tokens": 1}).encode()

        def chunks():
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]

        for content in (body, chunks()):
            r = httpx.post(srv.http_url + "/v1/completions", content=content,
                           headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"]["message"]
        assert httpx.post(srv.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_admission_refuses_with_429_counting_both_protocols(llm, slow_decode):
    cap = llm.engine_config.max_num_seqs  # max_waiting 0: the batch's rows only
    with ServerThread(llm, ServerConfig(port=0, http_port=0, max_waiting=0)) as srv:
        with Client(srv.address, timeout=60) as grpc_client:
            held = [iter(grpc_client.generate("hello", max_tokens=60, ignore_eos=True)) for _ in range(cap)]
            for it in held:
                next(it)  # each call is in flight
            r = httpx.post(srv.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 429, r.text
            assert f"the most allowed is {cap}" in r.json()["error"]["message"]
            # more choices than the server ever admits is bad input, not a 429 to retry forever
            r = httpx.post(srv.http_url + "/v1/completions", json={"prompt": "hi", "n": cap + 1}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            for it in held:
                it.close()
        assert_all_free(llm, srv)


def test_auth_guards_both_protocols_and_leaves_health_and_metrics_open(llm):
    with ServerThread(llm, ServerConfig(port=0, http_port=0, auth_token="s3cret")) as srv:
        url = srv.http_url
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0) as ok:
            assert ok.completions.create(model=llm.model_name, prompt="hi", max_tokens=2).choices
        with openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with Client(srv.address, timeout=30) as c:
            with pytest.raises(Unauthenticated):
                list(c.generate("hi", max_tokens=2))


def test_cors_only_for_the_allowed_origins_and_on_refusals_too(llm):
    cfg = ServerConfig(port=0, http_port=0, allowed_origins=("http://ui.test",), auth_token="s3cret")
    with ServerThread(llm, cfg) as srv:
        pre = {"Origin": "http://ui.test", "Access-Control-Request-Method": "POST"}
        r = httpx.options(srv.http_url + "/v1/chat/completions", headers=pre)
        assert r.headers.get("access-control-allow-origin") == "http://ui.test"
        r = httpx.options(srv.http_url + "/v1/chat/completions", headers=dict(pre, Origin="http://evil.test"))
        assert "access-control-allow-origin" not in r.headers
        r = httpx.get(srv.http_url + "/v1/models", headers={"Origin": "http://ui.test"})
        assert r.status_code == 401 and r.headers.get("access-control-allow-origin") == "http://ui.test"


def test_tokenize_and_detokenize(server, llm):
    r = httpx.post(server.http_url + "/tokenize", json={"prompt": "hello jax", "return_token_strs": True}).json()
    assert r["tokens"] == llm.tokenizer.encode("hello jax") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == llm.max_model_len and len(r["token_strs"]) == r["count"]
    chat = httpx.post(server.http_url + "/tokenize", json={"messages": MSG}).json()
    assert chat["tokens"] == llm.make_request(None, SamplingParams(max_tokens=1), messages=MSG).prompt_ids
    back = httpx.post(server.http_url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == llm.tokenizer.decode(r["tokens"])
    bad = httpx.post(server.http_url + "/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and "tokens[1]" in bad.json()["error"]["message"]


def test_continue_final_message_ends_the_prompt_inside_the_last_message(server, oai, llm):
    talk = MSG + [{"role": "assistant", "content": "hello jax"}]
    r = httpx.post(server.http_url + "/tokenize", json={"messages": talk, "continue_final_message": True}).json()
    text = llm.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    assert text.endswith("hello jax") and text.count("hello jax") == 1
    got = oai.chat.completions.create(model=llm.model_name, messages=talk, extra_body={
        "continue_final_message": True, "ignore_eos": True}, temperature=0, max_tokens=5)
    want = llm.generate([r["tokens"]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert got.choices[0].message.content == want.text
    both = httpx.post(server.http_url + "/v1/chat/completions", json={
        "messages": talk, "continue_final_message": True, "add_generation_prompt": True})
    assert both.status_code == 400 and "cannot both be true" in both.json()["error"]["message"]


def test_health_and_metrics_on_the_http_port(server, oai, llm):
    assert httpx.get(server.http_url + "/health").status_code == 200

    def finished() -> float:
        text = httpx.get(server.http_url + "/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("jaxinfer:request_success_total{")
                    and 'finished_reason="length"' in x)
        return float(line.rsplit(" ", 1)[1])

    before = finished()
    oai.completions.create(model=llm.model_name, prompt="hi", **greedy(3))
    assert finished() == before + 1


# --------------------------------------------------------------------------- #
# One request, four entry points
# --------------------------------------------------------------------------- #


def test_one_greedy_request_gives_one_text_through_http_grpc_cli_and_library(server, oai, llm, tmp_path, capsys):
    from conftest import tiny_params
    from jaxinfer.cli.main import main
    from jaxinfer.server.client import Client as GrpcClient

    params = SamplingParams(temperature=0, max_tokens=10)
    library = llm.chat(MSG, params)[0].text
    http = oai.chat.completions.create(model=llm.model_name, messages=MSG, temperature=0, max_tokens=10)
    with GrpcClient(server.address, timeout=60) as c:
        grpc_text = "".join(p.text for p in c.generate(MSG, temperature=0, max_tokens=10))
    flags = ["--temperature", "0", "--max-tokens", "10", "--quiet", "hello world"]
    assert main(["generate", "--server", server.address, *flags]) == 0
    cli_remote = capsys.readouterr().out
    # the same weights saved and loaded by `jaxinfer generate --model DIR`, in this process's own engine
    jaxinfer.save_model(tmp_path / "tiny", llm.model_config, tiny_params(), llm.tokenizer)
    assert main(["generate", "--model", str(tmp_path / "tiny"), "--dtype", "float32", "--no-model-cache", *flags]) == 0
    cli_local = capsys.readouterr().out
    assert http.choices[0].message.content == grpc_text == library == cli_remote[:-1] == cli_local[:-1]


# --------------------------------------------------------------------------- #
# Tool calls and reasoning, from a model whose output is forced
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tools_llm(tmp_path_factory):
    llm = forced_llm(tmp_path_factory.mktemp("forced"))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def tools_server(tools_llm):
    with ServerThread(tools_llm, ServerConfig(port=0, http_port=0, reasoning_parser="qwen3")) as srv:
        yield srv


def _tools_client(srv):
    return openai.OpenAI(base_url=srv.http_url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_tool_calls_and_reasoning_whole(tools_server, tools_llm):
    with _tools_client(tools_server) as c:
        r = c.chat.completions.create(model=tools_llm.model_name, messages=[{"role": "user", "content": "Paris?"}],
                                      tools=[weather_tool()], max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == TOOL_ARGS
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert choice.message.model_extra["reasoning"] == REASONING


def test_tool_calls_and_reasoning_streamed(tools_server, tools_llm):
    with _tools_client(tools_server) as c:
        chunks = list(c.chat.completions.create(model=tools_llm.model_name, stream=True, tools=[weather_tool()],
                                                messages=[{"role": "user", "content": "Paris?"}], max_tokens=40))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert reasoning == REASONING
    assert {tc.index for tc in calls} == {0} and calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == TOOL_ARGS
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_no_tools_give_the_raw_text(tools_server, tools_llm):
    with _tools_client(tools_server) as c:
        none = c.chat.completions.create(model=tools_llm.model_name, messages=[{"role": "user", "content": "x"}],
                                         tools=[weather_tool()], tool_choice="none", max_tokens=40)
    msg = none.choices[0].message
    assert not msg.tool_calls and none.choices[0].finish_reason == "stop"
    assert msg.content == SCRIPT_TEXT.split("</think>\n\n", 1)[1]  # reasoning split off, the call left as text


def test_a_conversation_with_a_tool_result_renders(tools_server, tools_llm):
    history = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "thinking",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(TOOL_ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    with _tools_client(tools_server) as c:
        r = c.chat.completions.create(model=tools_llm.model_name, messages=history, tools=[weather_tool()],
                                      max_tokens=40)
    assert r.choices[0].finish_reason == "tool_calls"
    prompt = httpx.post(tools_server.http_url + "/tokenize", json={"messages": history, "tools": [weather_tool()]})
    text = tools_llm.tokenizer.decode(prompt.json()["tokens"], skip_special_tokens=False)
    assert '"arguments": {"city": "Paris"' in text and "18 degrees" in text


def test_tools_need_a_parser(server, llm):
    r = httpx.post(server.http_url + "/v1/chat/completions",
                   json={"messages": MSG, "tools": [weather_tool()]}, timeout=30)
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- #
# The serve process: SIGTERM drains both protocols; a busy port fails fast
# --------------------------------------------------------------------------- #

_SERVE_SCRIPT = """
import sys, pathlib, tempfile
sys.path.insert(0, {tests!r})
from openai_models import sp_llm
from jaxinfer.server import ServerConfig, serve
llm = sp_llm(pathlib.Path(tempfile.mkdtemp()))
real = llm.runner.step
def slow(decodes, chunks):
    import time; time.sleep(0.02 if decodes else 0); return real(decodes, chunks)
llm.runner.step = slow
serve(llm, ServerConfig(port=0, http_port=0, grace_period=20),
      ready=lambda s: print("READY", s.port, s.http_port, flush=True))
llm.close()
print("STOPPED", flush=True)
"""


@pytest.mark.slow
def test_sigterm_drains_streams_on_both_protocols():
    script = _SERVE_SCRIPT.format(tests=os.path.dirname(__file__))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        grpc_port, http_port = map(int, line.split()[1:])
        url = f"http://127.0.0.1:{http_port}"
        body = {"messages": MSG, "stream": True, "max_tokens": 25, "ignore_eos": True}
        with Client(f"localhost:{grpc_port}", timeout=60) as c, \
                httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as http:
            it = iter(c.generate("hello", max_tokens=25, temperature=0, ignore_eos=True))
            got = list(next(it).token_ids)
            lines = http.iter_lines()
            first = next(x for x in lines if x.startswith("data: "))
            proc.send_signal(15)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            for piece in it:
                got += piece.token_ids
            events = [first] + [x for x in lines if x.startswith("data: ")]
        assert len(got) == 25 and piece.finish_reason == "length"
        finish = [json.loads(e[6:]) for e in events if e != "data: [DONE]"][-1]
        assert finish["choices"][0]["finish_reason"] == "length" and events[-1] == "data: [DONE]"
        assert proc.wait(30) == 0
        assert "STOPPED" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_serve_on_a_busy_port_fails_in_one_line_before_loading(flag):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["serve", "--model", "/nonexistent/model.gguf", "--port", "0", "--http-port", "0", flag, str(port)]
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "jaxinfer", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfer: error: cannot serve on 127.0.0.1")
    assert "in use" in err[0] and time.time() - t0 < 60
