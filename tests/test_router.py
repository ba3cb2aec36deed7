"""Several engines behind sglang-router (PyPI ``sglang-router``): the engine's side of the router's contract.

Real processes on loopback: two ``jaxinfer serve`` replicas of a tiny random-weight model, and
``python -m sglang_router.launch_router`` in its plain mode in front of them.

* One replica behind the router: the router registers it with no warning (its probes, ``/health``,
  ``/server_info``, ``/model_info`` and two HTTP/2 gRPC health checks, are all answered; the worker's model id
  is the served name), and routes chat and completions from the ``openai`` client, streamed and not, to the
  replica's own answers; the replica logs no refused or invalid request.
* Both replicas behind ``cache_aware`` and behind ``round_robin``: both serve, and every greedy answer is
  the one a single engine gives (a replica asked directly).
* The gauges Kubernetes' Gateway API Inference Extension reads under vLLM's names are on /metrics, with
  values that follow the engine (a running request, KV pages in use).

Skipped where sglang-router is not installed (``pip install sglang-router``; the ``test`` extra has it).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router)")

import openai  # noqa: E402

from conftest import free_port, save_char_model  # noqa: E402

SERVE_ARGS = ["--engine-config", "cpu", "--max-model-len", "128", "--num-pages", "40", "--no-warmup", "--verbose"]
NUM_PAGES = 40



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-weight model with a character-level tokenizer and a chat template, saved as a directory."""
    return save_char_model(tmp_path_factory)

class Proc:
    """A child process whose output goes to a file (read at any time, never a full pipe)."""

    def __init__(self, argv, env=None):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return re.sub(r"\x1b\[[0-9;]*m", "", f.read())  # the router colours its lines

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _wait(what: str, ready, proc: Proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.alive(), f"{what} exited:\n{proc.output()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} not ready in {timeout:.0f} s:\n{proc.output()[-3000:]}"
        time.sleep(0.2)


def _get(url: str):
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


class Replica:
    def __init__(self, model_dir):
        self.http_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        argv = [sys.executable, "-m", "jaxinfer", "serve", "--model", str(model_dir), "--port", str(free_port()),
                "--http-port", str(self.http_port), *SERVE_ARGS]
        self.p = Proc(argv, env={"JAX_PLATFORMS": "cpu"})

    def ready(self) -> bool:
        r = _get(self.url + "/health")
        return r is not None and r.status_code == 200

    def metrics(self) -> dict:
        """{(name, labels): value} of the replica's /metrics."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
            if m:
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
        return out

    def requests_done(self) -> float:
        return sum(v for (name, _), v in self.metrics().items() if name == "jaxinfer:request_success_total")


class Router:
    def __init__(self, workers, policy: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(free_port()), "--policy", policy, "--health-check-interval-secs", "1",
                "--worker-urls", *[w.url for w in workers]]
        self.n = len(workers)
        self.p = Proc(argv)

    def ready(self) -> bool:
        r = _get(self.url + "/workers")
        if r is None or r.status_code != 200:
            return False
        workers = r.json().get("workers", [])
        return len(workers) == self.n and all(w.get("is_healthy") for w in workers)

    def workers(self) -> list:
        return httpx.get(self.url + "/workers", timeout=5).json()["workers"]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def complaints(self) -> list:
        return [line for line in self.p.output().splitlines() if re.search(r"\b(WARN|ERROR)\b", line)]


@pytest.fixture(scope="module")
def replicas(model_dir):
    reps = [Replica(model_dir), Replica(model_dir)]
    try:
        for i, r in enumerate(reps):
            _wait(f"replica {i}", r.ready, r.p)
        yield reps
    finally:
        for r in reps:
            r.p.stop()


def _router(workers, policy):
    router = Router(workers, policy)
    try:
        _wait(f"the router ({policy})", router.ready, router.p, timeout=60)
    except BaseException:
        router.p.stop()
        raise
    return router


PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "Numbers: 1, 2, 3,", "def main():\n    ",
           "Dear diary, today", "SELECT * FROM"]


def _chat(client, content, stream=False, max_tokens=8):
    """(text, [(token, logprob)]) of a greedy chat answer: the tiny model's text is short (most of its vocabulary
    decodes to nothing), its logprobs say which tokens it chose."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
              logprobs=True)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return choice.message.content, [(t.token, t.logprob) for t in choice.logprobs.content]
    text, tokens = "", []
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices:
            text += c.choices[0].delta.content or ""
            tokens += [(t.token, t.logprob) for t in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    return text, tokens


def _complete(client, prompt, stream=False, max_tokens=8):
    """(text, [(token, logprob)]) of a greedy completion."""
    kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1)
    if not stream:
        choice = client.completions.create(**kw).choices[0]
        return choice.text, list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs))
    text, tokens = "", []
    for c in client.completions.create(stream=True, **kw):
        if c.choices:
            text += c.choices[0].text
            if c.choices[0].logprobs:
                tokens += list(zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs))
    return text, tokens


def _direct(replica) -> openai.OpenAI:
    return openai.OpenAI(base_url=replica.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_the_router_registers_one_replica_without_a_warning_and_routes_chat_and_completions(replicas):
    rep = replicas[0]
    mark = len(rep.p.output())  # the replica's log from here on: what the router (and this test) sent
    router = _router([rep], "cache_aware")
    try:
        (worker,) = router.workers()
        # what /server_info and /model_info said: the served name is the worker's model id
        assert worker["model_id"] == "tiny" and worker["connection_mode"] == "HTTP", worker
        assert worker["metadata"]["model_path"] and worker["metadata"]["disaggregation_mode"] == "null", worker
        via, direct = router.client(), _direct(rep)
        for stream in (False, True):
            want = _chat(direct, PROMPTS[0])
            assert len(want[1]) == 8 and _chat(via, PROMPTS[0], stream=stream) == want
            want = _complete(direct, PROMPTS[1])
            assert len(want[1]) == 8 and _complete(via, PROMPTS[1], stream=stream) == want
        time.sleep(1.5)  # a periodic health check (every second here) in the logs too
        assert router.complaints() == [], "\n".join(router.complaints())
    finally:
        router.p.stop()
    out = rep.p.output()[mark:]
    assert "Invalid HTTP request" not in out, out[-3000:]
    # every request the router sent was answered (the access log: --verbose)
    access = re.findall(r'"(GET|POST) (\S+) HTTP/[\d.]+" (\d{3})', out)
    assert any(path == "/server_info" for _, path, _ in access), out[-3000:]
    assert [a for a in access if int(a[2]) >= 400] == [], out[-3000:]


def test_the_http_port_answers_an_http2_client_with_goaway_http_1_1_required(replicas):
    """What the router's gRPC probes get (HTTP/2 with prior knowledge): the server's SETTINGS, then GOAWAY
    with HTTP_1_1_REQUIRED (0xd) and a reason, then the connection closes."""
    with socket.create_connection(("127.0.0.1", replicas[0].http_port), timeout=5) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    frames = []
    while data:
        n = int.from_bytes(data[:3], "big")
        frames.append((data[3], data[9:9 + n]))
        data = data[9 + n:]
    assert [kind for kind, _ in frames] == [0x4, 0x7], frames
    goaway = frames[1][1]
    assert int.from_bytes(goaway[4:8], "big") == 0xD and b"HTTP/1.1" in goaway[8:], goaway


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_two_replicas_behind_the_router_both_serve_the_single_engines_answers(replicas, policy):
    direct = _direct(replicas[0])
    want = {p: _complete(direct, p) for p in PROMPTS}
    router = _router(replicas, policy)
    try:
        before = [r.requests_done() for r in replicas]
        via = router.client()
        # at once: cache_aware sends a prompt that matches no worker's history to the least loaded worker (the
        # first, on a tie), so prompts sent one after another would all go to one replica
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = {p: pool.submit(_complete, via, p, i % 2 == 1) for i, p in enumerate(PROMPTS)}
        got = {p: f.result() for p, f in futures.items()}
        assert got == want and all(len(tokens) == 8 for _, tokens in want.values())
        served = [r.requests_done() - b for r, b in zip(replicas, before)]
        assert sum(served) == len(PROMPTS) and min(served) >= 1, served
        assert router.complaints() == [], "\n".join(router.complaints())
    finally:
        router.p.stop()


def test_the_gateway_gauges_follow_the_engine_under_vllms_names(replicas):
    rep = replicas[1]
    labels = '{model_name="tiny"}'
    idle = rep.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert (name, labels) in idle, sorted(k for k in idle if k[0].startswith("vllm:"))
    assert idle[("vllm:num_requests_running", labels)] == 0 and idle[("vllm:num_requests_waiting", labels)] == 0
    config = [k for k in idle if k[0] == "vllm:cache_config_info"]
    assert len(config) == 1 and idle[config[0]] == 1.0, config
    assert 'block_size="16"' in config[0][1] and f'num_gpu_blocks="{NUM_PAGES - 1}"' in config[0][1], config
    # the same numbers as ours, from the same registry
    assert idle[("vllm:kv_cache_usage_perc", labels)] == idle[("jaxinfer:kv_cache_usage_perc", labels)]

    stream = _direct(rep).completions.create(model="tiny", prompt="x" * 20, max_tokens=100, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the request is running now, with 100 tokens to go
    busy = rep.metrics()
    for _ in chunks:
        pass
    assert busy[("vllm:num_requests_running", labels)] == 1, busy
    assert 0 < busy[("vllm:kv_cache_usage_perc", labels)] <= 1
    assert busy[("vllm:gpu_cache_usage_perc", labels)] == busy[("vllm:kv_cache_usage_perc", labels)]
    after = rep.metrics()
    assert after[("vllm:num_requests_running", labels)] == 0 and after[("vllm:num_requests_waiting", labels)] == 0


def _as_float32(answer):
    """(text, [(token, float32 logprob)]): the engine's logprobs are float32; the router's PD path re-encodes
    the decode server's JSON numbers, which can move the last of their 17 digits (the same float32 either way)."""
    import numpy as np

    text, tokens = answer
    return text, [(t, np.float32(lp)) for t, lp in tokens]


class PDRouter(Router):
    """launch_router in its PD mode: the prefill server with its bootstrap port, the decode server."""

    def __init__(self, prefill, decode, bootstrap_port: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(free_port()), "--pd-disaggregation", "--health-check-interval-secs", "1",
                "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url]
        self.n = 2
        self.p = Proc(argv)


class RoleServer(Replica):
    def __init__(self, model_dir, *role):
        self.http_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        argv = [sys.executable, "-m", "jaxinfer", "serve", "--model", str(model_dir), "--port", str(free_port()),
                "--http-port", str(self.http_port), *SERVE_ARGS, *role]
        self.p = Proc(argv, env={"JAX_PLATFORMS": "cpu"})


def test_prefill_and_decode_servers_behind_the_router_give_the_single_engines_answers(model_dir, replicas):
    """launch_router --pd-disaggregation over a jaxinfer prefill server and a jaxinfer decode server: the openai
    client's chat and completions, streamed and not, are a single engine's answers token for token and logprob
    for logprob, the KV having moved from the prefill server to the decode server; both end with no KV held."""
    bootstrap = free_port()
    prefill = RoleServer(model_dir, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                         str(bootstrap))
    decode = RoleServer(model_dir, "--disaggregation-mode", "decode")
    router = None
    try:
        _wait("the prefill server", prefill.ready, prefill.p)
        _wait("the decode server", decode.ready, decode.p)
        router = PDRouter(prefill, decode, bootstrap)
        _wait("the PD router", router.ready, router.p, timeout=60)
        direct, via = _direct(replicas[0]), router.client()
        for stream in (False, True):
            want = _chat(direct, PROMPTS[2])
            assert len(want[1]) == 8 and _as_float32(_chat(via, PROMPTS[2], stream=stream)) == _as_float32(want)
            want = _complete(direct, PROMPTS[3])
            assert len(want[1]) == 8 and _as_float32(_complete(via, PROMPTS[3], stream=stream)) == _as_float32(want)
        pulled = decode.metrics()
        assert sum(v for (name, _), v in pulled.items() if name == "jaxinfer:kv_transfers_total") >= 4, \
            sorted(k for k in pulled if "kv_transfer" in k[0])
        deadline = time.monotonic() + 30  # acknowledged transfers are let go on the prefill side
        while any(v for (name, _), v in prefill.metrics().items() if name == "jaxinfer:kv_transfer_pages_held"):
            assert time.monotonic() < deadline, "the prefill server still holds KV pages"
            time.sleep(0.2)
    finally:
        for p in ([router.p] if router else []) + [prefill.p, decode.p]:
            p.stop()
