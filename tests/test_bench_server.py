"""``jaxinfer bench --server``: the load generator against a real loopback server around the tiny model."""

from __future__ import annotations

import argparse
import io
import json

import pytest

import jaxinfer
from conftest import TINY, TINY_ENGINE, tiny_params
from jaxinfer.cli import bench
from jaxinfer.tools import serving
from jaxinfer.tools.serving import BenchConfig, GrpcBackend, run_benchmark, summarize, synthetic_workload
from jaxinfer.server import ServerConfig, ServerThread

ENGINE = TINY_ENGINE.replace(num_pages=256)


@pytest.fixture(scope="module")
def server():
    llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=ENGINE)
    with ServerThread(llm, ServerConfig(port=0)) as srv:
        yield srv
    llm.close()


class _Counting(GrpcBackend):
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


def test_bench_over_grpc_completes_every_request_with_its_length_and_ordered_percentiles(server):
    workload = synthetic_workload(16, (6, 24), (4, 12), TINY.vocab_size, seed=1)
    cfg = BenchConfig(request_rate=40.0, max_concurrency=4, warmup_requests=2, seed=1, progress=False)
    # polled often: the tiny model's requests are short, and the peaks must see one running
    backend = _Counting(server.address, poll_interval=0.005)
    result = run_benchmark(backend, workload, cfg, serving.warmup_workload(workload, 2, TINY.vocab_size, 1))
    assert backend.calls == 16 + 2 and backend.most_in_flight <= 4
    assert backend.client is None, "the channel is closed after the run"
    for req, res in zip(workload, result.results):
        assert res.ok, res.error
        assert res.output_len == req.output_len == res.expected_output_len
        assert res.prompt_len == len(req.prompt_ids)
        assert len(res.itl_s) == res.output_len - 1  # one token per streamed message
        assert 0 < res.ttft_s <= res.e2e_s
        # the client sees at least what the server measured, plus the network
        assert res.server["ttft_s"] <= res.ttft_s and res.server["e2e_s"] <= res.e2e_s
    s = summarize(result, {"backend": "grpc"})
    assert s["completed"] == 16 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.output_len for r in workload)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert d["min"] <= d["median"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    st = s["server_timings_ms"]
    for key in ("ttft", "tpot", "e2e", "queue"):
        assert st[key]["count"] == 16 and st[key]["median"] <= st[key]["p99"]
    assert s["engine"]["engine_steps"] > 0 and s["engine"]["peak_running"] >= 1
    table = serving.format_table(s)
    assert "Server-reported" in table and "grpc" in table
    assert json.loads(json.dumps(s))["completed"] == 16


def _bench_args(*argv):
    from jaxinfer.cli.main import build_parser

    return build_parser().parse_args(["bench", *argv])


def test_bench_command_with_server_fetches_model_info_and_prints_the_table(server, tmp_path):
    path = tmp_path / "out.json"
    args = _bench_args("--server", server.address, "--num-prompts", "6", "--input-len", "10", "--output-len", "5",
                       "--request-rate", "inf", "--max-concurrency", "3", "--no-progress", "--json", str(path))
    out = io.StringIO()
    assert bench.bench_command(args, out) == 0
    assert "Serving Benchmark Result" in out.getvalue()
    s = json.loads(path.read_text())
    assert s["completed"] == 6 and s["info"]["backend"] == "grpc" and s["info"]["model"] == server.llm.model_name
    assert s["total_output_tokens"] == 30 and s["info"]["max_num_seqs"] == ENGINE.max_num_seqs


@pytest.mark.parametrize("argv, needle", [
    (["--input-len", "200", "--output-len", "5"], "max_model_len"),  # checked against the server's context
    (["--max-num-seqs", "2"], "--max-num-seqs"),  # engine flags are the server's
])
def test_bench_server_refuses_what_cannot_work(server, argv, needle):
    args = _bench_args("--server", server.address, "--num-prompts", "2", "--no-progress", *argv)
    with pytest.raises(ValueError, match=needle):
        bench.bench_command(args, io.StringIO())


def test_bench_server_unreachable_fails_with_status_1(capsys):
    args = _bench_args("--server", "127.0.0.1:1", "--num-prompts", "1", "--no-progress")
    assert bench.bench_command(args, io.StringIO()) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert isinstance(args, argparse.Namespace)
