"""Prefill/decode disaggregation (`jaxinfer.engine.kv_transfer`): two engines in this process, each with
its own real transfer server on loopback, the prefill one with its HTTP bootstrap channel.

What goes through prefill -> decode must equal one engine's output token for token and logprob for
logprob; every fault ends with no page held on either side."""

import json
import threading
import time

import pytest

import jaxinfer
from conftest import TINY, TINY_ENGINE, char_tokenizer, tiny_params
from jaxinfer import SamplingParams
from jaxinfer.engine.kv_transfer import KVTransferParams, error_status


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tok = char_tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE)
    params = tiny_params()

    def make(**kw):
        return jaxinfer.LLM.from_params(TINY, params, tokenizer=tok, engine_config=TINY_ENGINE, **kw)

    single = make()
    prefill = make(kv_transfer_config={"role": "prefill", "bootstrap_port": 0, "timeout_s": 3.0})
    decode = make(kv_transfer_config={"role": "decode", "timeout_s": 20.0})
    yield single, prefill, decode
    for llm in (single, prefill, decode):
        llm.close()


@pytest.fixture(scope="module")
def impatient(engines):
    """A decode engine that waits 1.5 s for a transfer (an unknown room fails after that long)."""
    llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE,
                                   kv_transfer_config={"role": "decode", "timeout_s": 1.5})
    yield llm
    llm.close()


def _gone_room(prefill) -> int:
    """A room the prefill engine held and let go (acknowledged): asking for it again is a 410."""
    import http.client

    room = next(_rooms)
    prefill.generate([[9, 9, 9]], SamplingParams(max_tokens=2), kv_transfer_params={"bootstrap_room": room})
    conn = http.client.HTTPConnection("127.0.0.1", prefill.engine.kv.bootstrap_port, timeout=10)
    conn.request("POST", f"/v1/kv/{room}/0/ack")
    assert conn.getresponse().status == 200
    conn.close()
    _settled(prefill)
    return room


_rooms = iter(range(1000, 10**6))


def _disaggregated(prefill, decode, prompt, sp, room=None, decode_first=True):
    """The prompt through the prefill engine, then the decode engine (started first: the router sends both at
    once); returns (prefill output, decode output)."""
    room = next(_rooms) if room is None else room
    port = prefill.engine.kv.bootstrap_port
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("d", decode.generate(
        [prompt], sp, kv_transfer_params={"bootstrap_host": "127.0.0.1", "bootstrap_port": port,
                                          "bootstrap_room": room})[0]))
    if decode_first:
        t.start()
        time.sleep(0.05)
    p = prefill.generate([prompt], sp, kv_transfer_params={"bootstrap_room": room})[0]
    if not decode_first:
        t.start()
    t.join(30)
    return p, out["d"]


def _settled(*llms, timeout=5.0):
    """Every engine idle with no page referenced (held transfers included), within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for llm in llms:
                assert llm.wait_idle(timeout=2.0)
                llm.engine.allocator.check_all_free()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _same(ref, got):
    assert len(ref.outputs) == len(got.outputs)
    for a, b in zip(ref.outputs, got.outputs):
        assert b.error is None, b.error
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason
        if a.logprobs is not None:
            assert [(x.token_id, x.logprob, x.top) for x in b.logprobs] == [(x.token_id, x.logprob, x.top)
                                                                            for x in a.logprobs]


LONG = "the quick brown fox jumps over the lazy dog; " * 2  # 90 tokens: chunked (16 a chunk)


@pytest.mark.parametrize("prompt, sp", [
    ("Hello there", SamplingParams(max_tokens=10, temperature=0.0, logprobs=3)),
    (LONG, SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)),
    ("seeded sampling", SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7, logprobs=1)),
    ("two choices", SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2, logprobs=2)),
], ids=["greedy-short", "greedy-chunked-long", "seeded", "n2"])
def test_prefill_then_decode_equals_one_engine(engines, prompt, sp):
    single, prefill, decode = engines
    ref = single.generate([prompt], sp)[0]
    p, d = _disaggregated(prefill, decode, prompt, sp)
    assert [c.token_ids for c in p.outputs] == [c.token_ids[:1] for c in ref.outputs]  # the prefill: 1 token
    _same(ref, d)
    _settled(prefill, decode)


def test_stop_string_and_prefix_hits_on_both_sides(engines):
    single, prefill, decode = engines
    prompt = LONG + "stop"
    free = single.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].text
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, stop=[free[-1]])  # its second token
    ref = single.generate([prompt], sp)[0]
    assert ref.outputs[0].finish_reason == "stop"
    _same(ref, _disaggregated(prefill, decode, prompt, sp)[1])
    hits = prefill.engine.allocator.hits, decode.engine.allocator.hits
    # the same prompt again: the prefill side computes from its prefix cache; the decode side had the pulled
    # pages named and finds them (it pulls the whole prompt all the same)
    p, d = _disaggregated(prefill, decode, prompt, sp, decode_first=False)
    _same(ref, d)
    assert p.metrics.cached_tokens > 0 and prefill.engine.allocator.hits > hits[0]
    assert decode.engine.allocator.lookup(_hashes(decode, prompt))
    _settled(prefill, decode)


def _hashes(llm, prompt):
    from jaxinfer.engine.prefix_cache import extend_hashes

    ids = llm.make_request(prompt).prompt_ids
    return extend_hashes([], ids, llm.engine_config.page_size)[:1]


def test_unknown_room_fails_the_request_and_frees_its_pages(engines, impatient):
    _, prefill, _ = engines
    decode = impatient
    t0 = time.monotonic()
    out = decode.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0),
                          kv_transfer_params={"bootstrap_host": "127.0.0.1",
                                              "bootstrap_port": prefill.engine.kv.bootstrap_port,
                                              "bootstrap_room": "no-such-room"})[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "error" and error_status(comp.error) == 404, comp.error
    assert "unknown transfer id no-such-room/0" in comp.error
    assert time.monotonic() - t0 < 5
    _settled(prefill, decode)


def test_a_transfer_nobody_takes_is_freed_at_the_timeout_and_then_gone(engines):
    _, prefill, decode = engines
    room = next(_rooms)
    prefill.generate(["held for nobody"], SamplingParams(max_tokens=4, temperature=0.0),
                     kv_transfer_params={"bootstrap_room": room})
    n, pages = prefill.engine.kv.held()
    assert n == 1 and pages == 4 and prefill.engine.allocator.num_used == 4
    assert "KV held 1 (4 pages)" in prefill.engine.kv.stats_suffix()
    from jaxinfer.engine.kv_transfer import transfer_metrics

    metrics = {name: (kind, value) for kind, name, _, value in transfer_metrics(prefill.engine)}
    assert metrics["kv_transfers_held"] == ("gauge", 1) and metrics["kv_transfer_pages_held"] == ("gauge", 4)
    _settled(prefill, timeout=6.0)  # 3 s
    assert prefill.engine.kv.held() == (0, 0) and prefill.engine.kv.expired >= 1
    out = decode.generate(["held for nobody"], SamplingParams(max_tokens=4, temperature=0.0),
                          kv_transfer_params={"bootstrap_host": "127.0.0.1",
                                              "bootstrap_port": prefill.engine.kv.bootstrap_port,
                                              "bootstrap_room": room})[0]
    assert error_status(out.outputs[0].error) == 410 and "expired" in out.outputs[0].error
    _settled(prefill, decode)


def test_a_decode_client_that_walks_away_frees_both_sides_at_once(engines):
    _, prefill, decode = engines
    room = next(_rooms)
    sp = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    prefill.generate(["walk away"], sp, kv_transfer_params={"bootstrap_room": room})
    assert prefill.engine.kv.held()[0] == 1
    req = decode.make_request("walk away", sp, kv_transfer_params={
        "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.engine.kv.bootstrap_port, "bootstrap_room": room})
    stream = decode.submit(req)
    next(iter(stream))  # the first token (the prefill's)
    stream.abort()
    _settled(prefill, decode, timeout=2.0)  # well before the prefill side's 3 s timeout


def test_an_unreachable_prefill_server_fails_the_request(engines):
    import socket

    _, _, decode = engines
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    out = decode.generate(["gone"], SamplingParams(max_tokens=4),
                          kv_transfer_params={"bootstrap_host": "127.0.0.1", "bootstrap_port": port,
                                              "bootstrap_room": 1})[0]
    assert error_status(out.outputs[0].error) == 502, out.outputs[0].error
    _settled(decode)


def test_a_different_page_size_is_refused_in_one_line(engines):
    import dataclasses

    _, prefill, _ = engines
    other = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=dataclasses.replace(TINY_ENGINE, page_size=8),
                                     kv_transfer_config={"role": "decode"})
    try:
        out = other.generate([[5, 6, 7]], SamplingParams(max_tokens=2),
                             kv_transfer_params={"bootstrap_host": "127.0.0.1",
                                                 "bootstrap_port": prefill.engine.kv.bootstrap_port,
                                                 "bootstrap_room": 9})[0]
        err = out.outputs[0].error
        assert err == (f"KV transfer 409: refusing KV from 127.0.0.1:{prefill.engine.kv.bootstrap_port}: "
                       "page size 4 there, 8 here")
        _settled(other)
    finally:
        other.close()


def test_warmup_compiles_the_transfer_programs_for_every_page_count(engines):
    _, prefill, decode = engines
    assert prefill.engine.kv.warmup() == decode.engine.kv.warmup() == 6  # 1..32 pages: 128 tokens of 4
    _settled(prefill, decode)


def test_transfer_params_from_sglang_and_vllm_fields():
    assert KVTransferParams.of(None) is None
    p = KVTransferParams.of(bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=2**63 + 5)
    assert (p.host, p.port, p.room) == ("10.0.0.1", 8998, str(2**63 + 5))
    v = KVTransferParams.of({"remote_host": "h", "remote_port": 1234, "transfer_id": "abc"})
    assert (v.host, v.port, v.room) == ("h", 1234, "abc")
    with pytest.raises(ValueError, match="need a bootstrap_room"):
        KVTransferParams.of(bootstrap_host="h", bootstrap_port=1)
    with pytest.raises(ValueError, match="kv_transfer_config role"):
        jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE,
                                 kv_transfer_config={"role": "both"})


# -- over HTTP: the body fields sglang-router's PD mode adds, sent to both servers at once ----------------


@pytest.fixture(scope="module")
def http_pair(engines):
    from jaxinfer.server import ServerConfig, ServerThread

    _, prefill, decode = engines
    with ServerThread(prefill, ServerConfig(port=0, http_port=0)) as p, \
            ServerThread(decode, ServerConfig(port=0, http_port=0)) as d:
        yield p, d


def _both(http_pair, path, body, room, port=None):
    """POST the body with SGLang's bootstrap fields to the prefill and the decode server at once (as the router
    does); the two responses (httpx), the decode one read as text for a stream."""
    import httpx

    p, d = http_pair
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port or p.llm.engine.kv.bootstrap_port,
              "bootstrap_room": room}
    out = {}

    def send(name, url):
        out[name] = httpx.post(url + path, json={**body, **fields}, timeout=30)

    threads = [threading.Thread(target=send, args=("d", d.http_url)), threading.Thread(target=send, args=("p", p.http_url))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out["p"], out["d"]


def test_http_completion_and_chat_through_prefill_and_decode_servers(engines, http_pair):
    single = engines[0]
    body = {"model": single.model_name, "prompt": LONG, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    ref = single.generate([LONG], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2))[0].outputs[0]
    p, d = _both(http_pair, "/v1/completions", body, next(_rooms))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert p.json()["usage"]["completion_tokens"] == 1
    choice = d.json()["choices"][0]
    assert choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
    assert choice["logprobs"]["token_logprobs"] == [lp.logprob for lp in ref.logprobs]
    # streamed, on the chat endpoint
    chat = {"model": single.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "temperature": 0, "stream": True}
    p, d = _both(http_pair, "/v1/chat/completions", chat, next(_rooms))
    assert p.status_code == 200 and d.status_code == 200
    assert d.text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[6:]) for line in d.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    want = single.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert text == want.outputs[0].text and chunks[-1]["choices"][0]["finish_reason"] == "length"
    _settled(*(srv.llm for srv in http_pair))


def test_http_a_room_gone_is_a_410_for_that_request(engines, http_pair):
    import httpx

    p, d = http_pair
    room = _gone_room(p.llm)
    body = {"model": engines[0].model_name, "prompt": "x", "max_tokens": 3,
            "kv_transfer_params": {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.llm.engine.kv.bootstrap_port,
                                   "bootstrap_room": room}}
    r = httpx.post(d.http_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 410 and f"transfer {room}/0 is gone (acknowledged)" in r.json()["error"]["message"]
    bad = httpx.post(d.http_url + "/v1/completions", json={**body, "kv_transfer_params": None,
                                                          "bootstrap_room": [1, 2]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bootstrap_room"
    _settled(p.llm, d.llm)


def test_grpc_kv_transfer_field_and_a_room_gone_is_not_found(engines, http_pair):
    import grpc

    from jaxinfer.server import jaxinfer_pb2 as pb
    from jaxinfer.server import jaxinfer_pb2_grpc as pb_grpc

    single = engines[0]
    p, d = http_pair
    port = p.llm.engine.kv.bootstrap_port
    room = str(next(_rooms))
    sampling = pb.SamplingOptions(max_tokens=6, temperature=0.0)

    def call(srv, kv):
        with grpc.insecure_channel(srv.address) as ch:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 1, 4, 1, 5, 9, 2, 6]), sampling=sampling, kv_transfer=kv)
            return [tok for m in pb_grpc.GenerationStub(ch).Generate(req, timeout=30) for tok in m.token_ids]

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("d", call(d, pb.KVTransfer(
        bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=room))))
    t.start()
    assert len(call(p, pb.KVTransfer(bootstrap_room=room))) == 1
    t.join(30)
    want = single.generate([[3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out["d"] == want.outputs[0].token_ids
    gone = _gone_room(p.llm)
    with pytest.raises(grpc.RpcError) as e:
        call(d, pb.KVTransfer(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=str(gone)))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and f"transfer {gone}/0 is gone" in e.value.details()
    _settled(p.llm, d.llm)


def test_latent_layout_in_bfloat16_through_prefill_and_decode():
    """DeepSeek's latent (MLA) cache, one entry a token shared by all heads, in bfloat16: the same tokens and
    logprobs as one engine."""
    import dataclasses

    from conftest import FIXTURES

    engine = dataclasses.replace(TINY_ENGINE, kv_cache_dtype="bfloat16")
    path = f"{FIXTURES}/families/deepseek_v2"
    llms = [jaxinfer.LLM(path, engine_config=engine, progress=False, **kw) for kw in (
        {}, {"kv_transfer_config": {"role": "prefill", "bootstrap_port": 0}},
        {"kv_transfer_config": {"role": "decode"}})]
    try:
        single, prefill, decode = llms
        assert prefill.runner.kv_cache[0].shape[2] == 1 and prefill.runner.kv_cache[0].dtype == "bfloat16"
        prompt = list(range(3, 40))
        sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
        _same(single.generate([prompt], sp)[0], _disaggregated(prefill, decode, prompt, sp)[1])
        _settled(prefill, decode)
    finally:
        for llm in llms:
            llm.close()


_PREFILL_PROCESS = """
import sys, time
sys.path.insert(0, {tests!r})
import jaxinfer
from conftest import TINY, TINY_ENGINE, tiny_params
llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE,
                               kv_transfer_config={{"role": "prefill", "bootstrap_port": 0}})
print(llm.engine.kv.bootstrap_port, flush=True)
time.sleep(120)
"""


def test_a_prefill_process_killed_while_decode_waits_fails_that_request_only(engines):
    import os
    import subprocess
    import sys

    _, _, decode = engines
    code = _PREFILL_PROCESS.format(tests=os.path.dirname(__file__))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("d", decode.generate(
            [[7, 8, 9, 10, 11]], SamplingParams(max_tokens=4),
            kv_transfer_params={"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5})[0]))
        t.start()
        deadline = time.monotonic() + 5
        while not decode.engine.kv.asking and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.engine.kv.asking  # waiting for the prefill side to have its KV ...
        assert decode.engine.allocator.num_used == 0  # ... without holding a page or a slot meanwhile
        time.sleep(0.3)
        proc.kill()
        t.join(10)
        assert error_status(out["d"].outputs[0].error) == 502, out["d"].outputs[0].error
        _settled(decode)
        # and it still serves
        assert decode.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"
    finally:
        proc.kill()
        proc.wait()


def test_http_vllm_contract_the_prefill_answer_names_the_transfer(engines, http_pair):
    """vLLM's proxy contract: the prefill request says do_remote_decode, its answer carries kv_transfer_params,
    and those go into the decode request as they are."""
    import httpx

    single = engines[0]
    p, d = http_pair
    body = {"model": single.model_name, "prompt": "a proxy in front", "max_tokens": 7, "temperature": 0}
    first = httpx.post(p.http_url + "/v1/completions", timeout=30,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["bootstrap_port"] == p.llm.engine.kv.bootstrap_port
    r = httpx.post(d.http_url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=30)
    want = single.generate(["a proxy in front"], SamplingParams(max_tokens=7, temperature=0.0))[0].outputs[0]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
    _settled(p.llm, d.llm)


def test_penalties_are_computed_on_the_decode_side_and_the_prefill_side_lets_go(engines):
    """A request with penalties needs its token history from position 0: the decode engine prefills it itself
    (the same output) and acknowledges the prefill side at once."""
    single, prefill, decode = engines
    sp = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, logprobs=1)
    _same(single.generate(["penalised"], sp)[0], _disaggregated(prefill, decode, "penalised", sp)[1])
    _settled(prefill, decode, timeout=2.0)  # before the 3 s hold timeout


def test_serve_flags_make_the_kv_transfer_config():
    import argparse

    from jaxinfer.cli.serve import add_serve_arguments, kv_transfer_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9001",
                              "--disaggregation-timeout", "12", "--host", "0.0.0.0"])
    assert kv_transfer_config(args) == {"role": "prefill", "bootstrap_host": "0.0.0.0", "bootstrap_port": 9001,
                                        "timeout_s": 12.0, "transfer_host": "0.0.0.0"}
    assert kv_transfer_config(parser.parse_args([])) is None


def test_the_bootstrap_channel_gives_a_transfer_to_one_taker_and_frees_it_on_ack(engines):
    import http.client

    _, prefill, _ = engines
    kv = prefill.engine.kv
    room = next(_rooms)
    prefill.generate([[4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0.0),
                     kv_transfer_params={"bootstrap_room": room})

    def ask(method, path):
        conn = http.client.HTTPConnection("127.0.0.1", kv.bootstrap_port, timeout=10)
        conn.request(method, path)
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        return r.status, body

    status, info = ask("GET", "/v1/kv/info")
    assert status == 200 and info == {"role": "prefill", "page_size": 4, "tp": 1, "dtype": "float32", "layers": 2,
                                      "entry": [4, 4, 16]}
    status, meta = ask("GET", f"/v1/kv/{room}/0")
    assert status == 200 and meta["num_tokens"] == 6 and meta["num_pages"] == 2 and meta["padded_pages"] == 2
    assert ask("GET", f"/v1/kv/{room}/0")[0] == 409  # one taker
    assert ask("POST", f"/v1/kv/{room}/0/ack")[0] == 200
    _settled(prefill, timeout=2.0)
    assert ask("GET", f"/v1/kv/{room}/0") == (410, {"error": f"transfer {room}/0 is gone (acknowledged)"})
    with pytest.raises(ValueError, match=f"cannot serve the KV bootstrap channel on 127.0.0.1:{kv.bootstrap_port}"):
        jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE,
                                 kv_transfer_config={"role": "prefill", "bootstrap_port": kv.bootstrap_port})


def test_a_different_tensor_parallel_size_is_refused_in_one_line(engines, impatient):
    """The layouts are compared before any pull (here the decode side says it has 2-way TP)."""
    _, prefill, _ = engines
    kv = impatient.engine.kv
    saved = dict(kv.layout)
    kv.layout["tp"] = 2
    kv._checked.clear()
    try:
        out = impatient.generate([[5, 6, 7]], SamplingParams(max_tokens=2),
                                 kv_transfer_params={"bootstrap_host": "127.0.0.1",
                                                     "bootstrap_port": prefill.engine.kv.bootstrap_port,
                                                     "bootstrap_room": 3})[0]
    finally:
        kv.layout.clear()
        kv.layout.update(saved)
        kv._checked.clear()
    assert out.outputs[0].error == (f"KV transfer 409: refusing KV from 127.0.0.1:{prefill.engine.kv.bootstrap_port}: "
                                    "tensor-parallel size 1 there, 2 here")
    _settled(prefill, impatient)
