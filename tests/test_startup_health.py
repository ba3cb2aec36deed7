"""Start-up you can watch: `serve` answers health while it loads, and the library shows its stages.

* ``jaxinfer serve`` (a real process, a tiny random-weight model on loopback): HTTP ``/health`` is 503
  ``{"status": "loading", "stage": ...}`` within 200 ms of the port being bound, gRPC health NOT_SERVING,
  then 200 and SERVING once the model is ready; a SIGTERM while loading ends the process at once.
* `JaxinferServer` without a model (in process): the stage running now is what /health and a refused
  gRPC call name, with its count; once the model is attached both protocols serve it.
* ``jaxinfer.LLM(...)`` in a script: stage lines on stderr by default, none with ``progress=False``, none
  when the script has set up logging (the records go to its handlers instead).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import jaxinfer
from conftest import free_port, save_char_model
from jaxinfer import progress
from jaxinfer.server import ServerConfig
from jaxinfer.server.client import Client, Unavailable
from jaxinfer.server.server import JaxinferServer

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random-weight model with a character-level tokenizer, saved as a model directory."""
    return save_char_model(tmp_path_factory, chat_template=None)


def _serve(model_dir, grpc_port: int, http_port: int) -> subprocess.Popen:
    args = ["serve", "--model", str(model_dir), "--port", str(grpc_port), "--http-port", str(http_port),
            "--engine-config", "cpu", "--max-model-len", "48", "--num-pages", "8", "--no-warmup"]
    return subprocess.Popen([sys.executable, "-m", "jaxinfer", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def _first_health(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> tuple:
    """Poll until the port accepts a connection (it is bound), then ask /health on that connection.

    Returns (seconds from the accepted connection to the whole answer, status code, JSON body).
    """
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the HTTP port was never bound"
        sock = socket.socket()
        try:
            sock.connect(("127.0.0.1", port))
            break
        except OSError:
            sock.close()
            time.sleep(0.002)
    with sock:
        t0 = time.monotonic()
        sock.settimeout(10)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        took = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    return took, int(head.split()[1]), json.loads(body)


def test_serve_answers_health_503_loading_at_once_then_200_and_grpc_serving_once_ready(tiny_dir):
    grpc_port, http_port = free_port(), free_port()
    proc = _serve(tiny_dir, grpc_port, http_port)
    url = f"http://127.0.0.1:{http_port}"
    try:
        took, status, body = _first_health(http_port, proc)
        assert status == 503 and body["status"] == "loading", body
        assert took < 0.2, f"/health took {took * 1000:.0f} ms after the port was bound"
        with Client(f"127.0.0.1:{grpc_port}", timeout=10) as c:
            assert c.health() == "NOT_SERVING"  # the loading lasts seconds (JAX alone), so this is still it
            assert c.health("jaxinfer.v1.Generation") == "NOT_SERVING"
            with pytest.raises(Unavailable, match="loading its model"):
                c.model_info()
            refused = httpx.get(url + "/v1/models", timeout=10)
            assert refused.status_code == 503 and "loading its model" in refused.json()["error"]["message"]
            stages = [body["stage"]]
            deadline = time.monotonic() + 120
            while True:
                r = httpx.get(url + "/health", timeout=10)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["status"] == "loading", r.text
                stages.append(r.json()["stage"])
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.02)
            assert r.json() == {"status": "ok"}
            assert c.health() == "SERVING" and c.health("jaxinfer.v1.Generation") == "SERVING"
            assert c.model_info()["name"] == "tiny"
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["tiny"]
        # the stages are the start's own (jaxinfer.progress), not only the server's fallback
        assert all(isinstance(s, str) and s for s in stages), stages
        assert any(s.startswith(("loading the engine", "restoring tiny", "resolving model")) for s in stages), stages
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "- ready" in out and out.rstrip().endswith("jaxinfer: server stopped"), out
        # the ports are said as soon as they answer (--port 0 users learn them before the model is ready)
        assert f"listening on 127.0.0.1:{grpc_port} (gRPC) and http://127.0.0.1:{http_port} (HTTP" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_stopped_while_loading_exits_at_once(tiny_dir):
    grpc_port, http_port = free_port(), free_port()
    proc = _serve(tiny_dir, grpc_port, http_port)
    try:
        _, status, body = _first_health(http_port, proc)
        assert status == 503 and body["status"] == "loading"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 10  # not after the load and the compiles
        assert proc.returncode == 130, err
        assert "jaxinfer: stopped while loading the model" in err and "- ready" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- #
# The server without a model, in process: the stage it names, then the model attached
# --------------------------------------------------------------------------- #


@pytest.fixture()
def on_loop():
    """Run coroutines on an event loop in a background thread (the server's), from the test's thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    yield lambda coro, timeout=60: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_a_server_without_its_model_names_the_running_stage_then_serves_the_attached_model(on_loop, tiny_llm):
    async def make():
        server = JaxinferServer(None, ServerConfig(port=0, http_port=0))
        await server.start()
        return server

    server = on_loop(make())
    try:
        url = server.http_url
        idle = httpx.get(url + "/health", timeout=10)
        assert idle.status_code == 503
        assert idle.json()["status"] == "loading" and idle.json()["stage"] == "loading the model"
        with Client(f"127.0.0.1:{server.port}", timeout=10) as c:
            with progress.stage("compiling programs", total=4, unit="program") as s:
                s.update()
                body = httpx.get(url + "/health", timeout=10).json()
                assert (body["stage"], body["done"], body["total"]) == ("compiling programs", 1, 4), body
                with pytest.raises(Unavailable, match=r"loading its model \(compiling programs\)"):
                    list(c.generate([1, 2, 3], max_tokens=2))
                completion = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
                assert completion.status_code == 503 and completion.headers["retry-after"] == "1"
                assert "loading its model (compiling programs)" in completion.json()["error"]["message"]
            assert c.health() == "NOT_SERVING"
            on_loop(server.attach(tiny_llm))
            assert c.health() == "SERVING"
            assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
            params = jaxinfer.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            want = tiny_llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
            got = [t for piece in c.generate([1, 2, 3], max_tokens=4, temperature=0, ignore_eos=True)
                   for t in piece.token_ids]
            assert got == want
    finally:
        on_loop(server.shutdown(0))


# --------------------------------------------------------------------------- #
# The library: stage lines on a terminal by default, none with progress=False or with logging set up
# --------------------------------------------------------------------------- #

_LOAD = "jaxinfer.LLM({model!r}, engine_config='cpu', max_model_len=48, num_pages=8{extra}).close()\n"
_MARK = "sys.stderr.write('<next>\\n'); sys.stderr.flush()\n"
_SCRIPTS = {
    # a script in a terminal: the CLI's lines and bars; then progress=False: none
    "terminal": "import sys, jaxinfer\n" + _LOAD.format(model="{model}", extra="") + _MARK
                + _LOAD.format(model="{model}", extra=", progress=False"),
    # in a terminal, with the script's logging at INFO: the stages are its log lines, not written twice
    "logging": "import logging, sys\n"
               "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='LOG %(name)s: %(message)s')\n"
               "import jaxinfer\n" + _LOAD.format(model="{model}", extra=""),
    # stderr a pipe (a log, a capture): nothing, as the CLI without --verbose; then progress=True: plain lines
    "pipe": "import sys, jaxinfer\n" + _LOAD.format(model="{model}", extra="") + _MARK
            + _LOAD.format(model="{model}", extra=", progress=True"),
}


def _run(script: str, terminal: bool) -> tuple:
    """(exit status, stdout, stderr) of ``python -c script``, its stderr a pseudo-terminal or a pipe."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if not terminal:
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180)
        return p.returncode, p.stdout, p.stderr
    master, slave = os.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=slave, env=env)
        os.close(slave)
        out = []
        reader = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
        reader.start()
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        p.wait(timeout=180)
        reader.join(30)
    finally:
        os.close(master)
    return p.returncode, out[0].decode(), b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_the_library_shows_its_stages_in_a_terminal_unless_told_not_to_or_logging_has_them(tiny_dir):
    results = {}

    def run(name):
        results[name] = _run(_SCRIPTS[name].format(model=str(tiny_dir)), terminal=name != "pipe")

    threads = [threading.Thread(target=run, args=(name,)) for name in _SCRIPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert {name: r[0] for name, r in results.items()} == {"terminal": 0, "logging": 0, "pipe": 0}, results

    _, out, err = results["terminal"]
    default, _, silenced = err.partition("<next>\n")
    closing = [line.split("\r")[-1] for line in default.splitlines()]  # a line's last frame: what stays
    assert any(line.startswith("jaxinfer: resolving model ") for line in closing), default
    assert any(re.match(r"jaxinfer: restoring tiny .* \.\.\. \d+\.\ds$", line) for line in closing), default
    assert any(line.startswith("jaxinfer: model tiny: llama") for line in closing), default
    assert "jaxinfer" not in silenced, silenced
    assert out == ""

    _, out, err = results["logging"]
    assert "jaxinfer" not in err, err
    assert "LOG jaxinfer: resolving model " in out and "LOG jaxinfer: restoring tiny" in out, out

    _, out, err = results["pipe"]
    quiet, _, shown = err.partition("<next>\n")
    assert "jaxinfer" not in quiet, quiet
    assert "\r" not in shown and re.search(r"^jaxinfer: restoring tiny .* \.\.\. \d+\.\ds$", shown, re.M), shown


def test_the_library_rule_shows_the_stages_once_and_not_against_the_users_logging(monkeypatch):
    import logging

    class Terminal:
        def isatty(self):
            return True

        def write(self, text):
            return len(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress.library_shows()  # a file or a pipe: nothing, as the CLI without --verbose
    monkeypatch.setattr(sys, "stderr", Terminal())
    root, logger = logging.getLogger(), logging.getLogger("jaxinfer")
    saved = (root.level, list(root.handlers), logger.level, list(logger.handlers))
    root.handlers, logger.handlers = [], []  # pytest's own capture handlers aside
    root.setLevel(logging.WARNING)  # setLevel, not assignment: it clears the loggers' cached levels
    logger.setLevel(logging.NOTSET)
    try:
        assert progress.library_shows()  # no logging set up
        root.handlers = [logging.NullHandler()]
        assert progress.library_shows()  # a handler at the default WARNING (absl installs one) shows no INFO
        root.setLevel(logging.INFO)
        assert not progress.library_shows()  # basicConfig(level=INFO): the stages are the log's lines
        root.handlers[0].setLevel(logging.WARNING)
        assert progress.library_shows()  # ... unless that handler drops INFO
        root.handlers, root.level = [], logging.WARNING
        logger.setLevel(logging.WARNING)
        assert not progress.library_shows()  # silenced on purpose
        logger.setLevel(logging.INFO)
        assert progress.library_shows()  # INFO, but nowhere to go: shown
        logging.disable(logging.INFO)
        assert not progress.library_shows()
    finally:
        logging.disable(logging.NOTSET)
        root.setLevel(saved[0])
        root.handlers = saved[1]
        logger.setLevel(saved[2])
        logger.handlers = saved[3]
    monkeypatch.setattr(progress, "_show", None)
    monkeypatch.setattr(progress, "_live", progress._live)
    progress.configure(show=True)
    assert progress.showing()  # an explicit setting (the CLI's, progress=True) wins over the rule
    with pytest.raises(ValueError, match="progress must be True, False or None"):
        jaxinfer.LLM("unused", progress="yes")
