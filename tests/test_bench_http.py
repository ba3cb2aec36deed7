"""``jaxinfer bench --base-url``: the load generator against a real OpenAI-compatible server on loopback
(`ServerThread` with its HTTP port, a tiny random-weight model with a real SentencePiece tokenizer)."""

from __future__ import annotations

import io
import json

import jax
import pytest

import jaxinfer
from conftest import TINY_ENGINE
from jaxinfer.cli import bench
from jaxinfer.tools import serving
from jaxinfer.tools.serving import (
    CHAT_COMPLETIONS,
    BenchConfig,
    OpenAIBackend,
    run_benchmark,
    summarize,
    synthetic_workload,
)
from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.server import ServerConfig, ServerThread
from jaxinfer.ops.spec import init_random
from jaxinfer.text.tokenizer import load_tokenizer
from test_tokenizer import train_tiny_sentencepiece

TOKEN = "bench-secret"
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
ENGINE = TINY_ENGINE.replace(num_pages=256)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm")
    (path / "tokenizer.model").write_bytes(train_tiny_sentencepiece())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, name="tiny")
    params = init_random(llama.param_specs(cfg), jax.random.key(0), scale=0.3)
    llm = jaxinfer.LLM.from_params(cfg, params, tokenizer=tok, engine_config=ENGINE, name="tiny-bench")
    with ServerThread(llm, ServerConfig(port=0, http_port=0, auth_token=TOKEN)) as srv:
        yield srv
    llm.close()


class _Counting(OpenAIBackend):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.in_flight = self.most_in_flight = self.calls = 0

    async def run_one(self, prompt_ids, params):
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await super().run_one(prompt_ids, params)
        finally:
            self.in_flight -= 1


def _engine_idle(srv) -> bool:
    return srv.llm.wait_idle(10) and srv.llm.engine.allocator.usage() == 0


def test_bench_over_http_completes_every_request_with_its_length_and_ordered_percentiles(server):
    vocab = server.llm.model_config.vocab_size
    workload = synthetic_workload(16, (6, 24), (4, 12), vocab, seed=1)
    cfg = BenchConfig(request_rate=40.0, max_concurrency=4, warmup_requests=2, seed=1, progress=False)
    # polled often: the tiny model's requests are short, and the peaks must see one running
    backend = _Counting(server.http_url, server.llm.model_name, api_key=TOKEN, poll_interval=0.005)
    result = run_benchmark(backend, workload, cfg, serving.warmup_workload(workload, 2, vocab, 1))
    assert backend.calls == 16 + 2 and backend.most_in_flight <= 4
    assert backend.client is None, "the HTTP client is closed after the run"
    for req, res in zip(workload, result.results):
        assert res.ok, res.error
        # the usage chunk's counts: every token asked for (ignore_eos), the prompt as sent (token ids)
        assert res.output_len == req.output_len == res.expected_output_len
        assert res.prompt_len == len(req.prompt_ids)
        assert 0 < res.ttft_s <= res.e2e_s
        assert len(res.itl_s) <= res.output_len - 1  # one gap per text chunk after the first
    s = summarize(result, {"backend": "openai", "server": server.http_url + "/v1/completions"})
    assert s["completed"] == 16 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.output_len for r in workload)
    assert s["total_input_tokens"] == sum(len(r.prompt_ids) for r in workload)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert d["count"] > 0 and d["min"] <= d["median"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    # the engine's gauges came from the server's Prometheus /metrics, sampled during the run
    assert s["engine"]["peak_running"] >= 1 and 0 < s["engine"]["peak_kv_usage"] <= 1
    table = serving.format_table(s)
    assert "openai" in table and server.http_url in table
    assert _engine_idle(server)


def _bench_args(*argv):
    from jaxinfer.cli.main import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_bench_command_with_base_url_finds_the_model_and_the_vocabulary_and_prints_the_table(server, tmp_path):
    path = tmp_path / "out.json"
    args = _bench_args("--base-url", server.http_url + "/v1", "--api-key", TOKEN, "--num-prompts", "6",
                       "--input-len", "10", "--output-len", "5", "--max-concurrency", "3", "--no-progress",
                       "--json", str(path))
    out = io.StringIO()
    assert bench.bench_command(args, out) == 0
    assert "Serving Benchmark Result" in out.getvalue() and server.http_url in out.getvalue()
    s = json.loads(path.read_text())
    info = s["info"]
    assert info["backend"] == "openai" and info["server"] == server.http_url + "/v1/completions"
    assert info["model"] == server.llm.model_name  # the first (only) entry of GET /v1/models
    assert info["vocab_size"] == server.llm.model_config.vocab_size, info  # told or found by bisection
    assert info["prompts"] == "token ids" and info["max_model_len"] == server.llm.max_model_len
    assert s["completed"] == 6 and s["total_output_tokens"] == 30 and s["total_input_tokens"] == 60


@pytest.mark.parametrize("extra", [
    ["--endpoint", CHAT_COMPLETIONS],  # text from the server's /detokenize, in one user message
    ["--prompt-format", "text", "--tokenizer", "LOCAL"],  # text from a local tokenizer, to /v1/completions
])
def test_bench_sends_text_where_asked_and_counts_the_server_s_tokens(server, tokenizer_dir, extra, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)  # the key from the environment, as the openai SDK reads it
    extra = [str(tokenizer_dir) if a == "LOCAL" else a for a in extra]
    path = tmp_path / "out.json"
    args = _bench_args("--base-url", server.http_url, "--num-prompts", "4", "--input-len", "12", "--output-len", "6",
                       "--no-progress", "--json", str(path), *extra)
    assert bench.bench_command(args, io.StringIO()) == 0
    s = json.loads(path.read_text())
    assert s["completed"] == 4 and s["total_output_tokens"] == 24, s["errors"]
    assert s["info"]["prompts"].startswith("text")
    for r in s["requests"]:
        assert r["ok"] and r["output_len"] == 6
        assert r["prompt_len"] > 0 and r["ttft_ms"] > 0  # the prompt's length as the server tokenized it
    if "--endpoint" in extra:  # the chat template wraps each prompt: more tokens than the text alone
        assert all(r["prompt_len"] > 12 for r in s["requests"]), [r["prompt_len"] for r in s["requests"]]
    assert _engine_idle(server)


def test_bench_base_url_errors_are_one_line(server, capsys):
    from jaxinfer.cli.main import main

    def run(*argv):
        code = main(["bench", "--num-prompts", "1", "--no-progress", *argv])
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("jaxinfer: error: "), err
        return code, lines[0]

    code, line = run("--base-url", "http://127.0.0.1:1")  # nothing listens there
    assert code == 1 and "nothing answered at http://127.0.0.1:1" in line
    code, line = run("--base-url", "localhost:8000")  # not a URL
    assert code == 2 and "--base-url" in line
    code, line = run("--base-url", server.http_url, "--api-key", "wrong")
    assert code == 1 and "HTTP 401" in line
    code, line = run("--base-url", server.http_url, "--api-key", TOKEN, "--model", "nope")
    assert code == 1 and "'tiny-bench'" in line and "'nope'" in line  # names what the server serves
    code, line = run("--base-url", server.http_url, "--max-num-seqs", "2")
    assert code == 2 and "--max-num-seqs" in line
    code, line = run("--server", "localhost:1", "--base-url", server.http_url)
    assert code == 2 and "not both" in line
    code, line = run("--api-key", "x")  # an HTTP flag without --base-url
    assert code == 2 and "--api-key" in line
