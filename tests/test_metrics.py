"""Prometheus metrics of the gRPC server: a real server on loopback, scraped over HTTP, parsed, counted.

The numbers are checked against what the test sent and against the engine's
own counters: every finished request is counted once under its finish reason
(the cancelled one too, although the engine finishes it after its call has
ended), each latency histogram holds one observation per request that has the
quantity (one per gap for ITL), and the token counters add up.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import jaxinfer
from conftest import TINY, TINY_ENGINE, tiny_params
from jaxinfer.server.client import Client, InvalidArgument, ResourceExhausted
from jaxinfer.server import ServerConfig, ServerThread

ENGINE = TINY_ENGINE.replace(num_pages=256)


@pytest.fixture(scope="module")
def llm():
    llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=ENGINE)
    yield llm
    llm.close()




def prompt(i: int, n: int) -> list:
    return [(11 * i + 5 * j + 3) % TINY.vocab_size for j in range(n)]


def scrape(url: str) -> dict:
    """{sample name: {frozenset(labels without model_name): value}} from one HTTP scrape."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out.setdefault(s.name, {})[frozenset(labels.items())] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m[name][frozenset(labels.items())]


def settle(llm, srv) -> None:
    deadline = time.time() + 10
    while srv.call(lambda: len(srv.servicer.active)) and time.time() < deadline:
        time.sleep(0.01)
    assert llm.wait_idle(10)


def test_preemptions_are_counted_as_the_scheduler_makes_them():
    """Four requests that need more pages than a small cache has: the scheduler preempts some, and the scraped
    counter is exactly its count (a counter that read 0, or anything else, fails)."""
    tight = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE.replace(num_pages=20))
    try:
        with ServerThread(tight, ServerConfig(port=0, metrics_port=0)) as srv:
            params = jaxinfer.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            outs = tight.generate([prompt(i, 15) for i in range(4)], params)  # ~35 tokens each, 19 pages of 4
            assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
            made = tight.engine.scheduler.num_preemptions
            assert made > 0
            assert value(scrape(srv.server.metrics_url), "jaxinfer:num_preemptions_total") == made
    finally:
        tight.close()


def test_metrics_are_off_by_default(llm):
    assert ServerConfig().metrics_port is None
    with ServerThread(llm, ServerConfig(port=0)) as srv:
        assert srv.server.metrics is None and srv.server.metrics_url is None


def test_scraped_counts_and_histograms_match_the_requests_sent(llm, slow_decode):
    engine = llm.engine
    gen0, finished0 = engine.stats.generation_tokens, dict(engine.stats.finished)
    t_start = time.time()
    with ServerThread(llm, ServerConfig(port=0, metrics_port=0)) as srv:
        url = srv.server.metrics_url
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        before = scrape(url)
        assert value(before, "jaxinfer:request_success_total", finished_reason="length") == 0
        assert value(before, "jaxinfer:num_requests_running") == 0

        lengths = {3: 5, 4: 7, 5: 9}  # prompt length -> max_tokens; finished by length
        with Client(srv.address, timeout=60) as client:
            for n_in, n_out in lengths.items():
                done = client.complete(prompt(n_in, n_in), max_tokens=n_out, temperature=0.0, ignore_eos=True)
                assert done.finish_reason == "length" and len(done.token_ids) == n_out
            # one cancelled mid-stream: the engine finishes it ("abort") after the call has ended
            pieces = client.generate(prompt(9, 6), max_tokens=60, temperature=0.0, ignore_eos=True)
            got = [next(pieces), next(pieces)]
            assert all(not p.finished for p in got)
            pieces.close()
            # one refused: an out-of-range token id never reaches the engine
            with pytest.raises(InvalidArgument):
                client.complete([TINY.vocab_size + 1], max_tokens=2)
        settle(llm, srv)
        m = scrape(url)

    aborted_tokens = engine.stats.generation_tokens - gen0 - sum(lengths.values())
    assert aborted_tokens >= 2
    assert engine.stats.finished.get("abort", 0) - finished0.get("abort", 0) == 1

    assert value(m, "jaxinfer:request_success_total", finished_reason="length") == 3
    assert value(m, "jaxinfer:request_success_total", finished_reason="abort") == 1
    assert value(m, "jaxinfer:request_success_total", finished_reason="stop") == 0
    assert value(m, "jaxinfer:request_success_total", finished_reason="error") == 0
    assert value(m, "jaxinfer:grpc_requests_rejected_total", reason="invalid_argument") == 1
    assert value(m, "jaxinfer:grpc_requests_rejected_total", reason="resource_exhausted") == 0
    assert value(m, "jaxinfer:prompt_tokens_total") == sum(lengths) + 6
    assert value(m, "jaxinfer:generation_tokens_total") == sum(lengths.values()) + aborted_tokens

    n_req = 4  # every finished request has a TTFT, queue, prefill, e2e and (>= 2 tokens) a TPOT
    gaps = sum(n - 1 for n in lengths.values()) + aborted_tokens - 1
    for name, count in (
        ("time_to_first_token_seconds", n_req),
        ("time_per_output_token_seconds", n_req),
        ("e2e_request_latency_seconds", n_req),
        ("request_queue_time_seconds", n_req),
        ("request_prefill_time_seconds", n_req),
        ("request_decode_time_seconds", n_req),
        ("inter_token_latency_seconds", gaps),
    ):
        full = f"jaxinfer:{name}"
        assert value(m, full + "_count") == count, name
        assert value(m, full + "_bucket", le="+Inf") == count, name
        buckets = sorted(((float(dict(k)["le"]), v) for k, v in m[full + "_bucket"].items()))
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), f"{name}: buckets are cumulative"
        # every request took time at each stage, and none longer than the test's run
        assert 0 < value(m, full + "_sum") <= count * (time.time() - t_start), name
    # decode steps were slowed to >= 20 ms, so gaps are that long on average (a gap can be shorter
    # when the engine reads two steps' tokens in one iteration, at the end of a request)
    assert value(m, "jaxinfer:inter_token_latency_seconds_sum") >= 0.02 * gaps * 0.5
    assert value(m, "jaxinfer:e2e_request_latency_seconds_sum") >= value(
        m, "jaxinfer:time_to_first_token_seconds_sum")

    # gauges, read from the engine at scrape time: all idle now
    assert value(m, "jaxinfer:num_requests_running") == 0
    assert value(m, "jaxinfer:num_requests_waiting") == 0
    assert value(m, "jaxinfer:grpc_requests_active") == 0
    assert 0 <= value(m, "jaxinfer:kv_cache_usage_perc") <= 1
    assert 0 <= value(m, "jaxinfer:prefix_cache_hit_rate") <= 1
    assert value(m, "jaxinfer:prefix_cache_hits_total") <= value(m, "jaxinfer:prefix_cache_queries_total")
    assert value(m, "jaxinfer:num_preemptions_total") == 0  # 256 pages: this workload never runs out

    # each step's floor over its measured time (`jaxinfer.engine.roofline`): a lower bound, so <= 1 per step
    for kind in ("prefill", "decode"):
        steps = value(m, "jaxinfer:step_roofline_fraction_count", kind=kind)
        assert steps >= 1, kind
        assert 0 < value(m, "jaxinfer:step_roofline_fraction_sum", kind=kind) <= steps, kind
        assert value(m, "jaxinfer:step_roofline_fraction_bucket", kind=kind, le="1.0") == steps, kind


def test_gauges_show_running_requests_and_servers_keep_separate_registries(llm, slow_decode):
    """Two servers on one engine: each counts only its own calls; admission refusals are counted by reason."""
    cfg = ServerConfig(port=0, metrics_port=0, max_waiting=0)  # at most max_num_seqs calls in flight
    with ServerThread(llm, cfg) as a, ServerThread(llm, ServerConfig(port=0, metrics_port=0)) as b:
        assert a.server.metrics.registry is not b.server.metrics.registry
        with Client(a.address, timeout=60) as client:
            streams = [client.generate(prompt(i, 5), max_tokens=40, temperature=0.0, ignore_eos=True)
                       for i in range(ENGINE.max_num_seqs)]
            for s in streams:
                next(s)  # each is running now
            m = scrape(a.server.metrics_url)
            assert value(m, "jaxinfer:num_requests_running") == ENGINE.max_num_seqs
            assert value(m, "jaxinfer:grpc_requests_active") == ENGINE.max_num_seqs
            assert value(m, "jaxinfer:kv_cache_usage_perc") > 0
            with pytest.raises(ResourceExhausted):
                client.complete(prompt(99, 5), max_tokens=2)
            for s in streams:
                s.close()
        settle(llm, a)
        ma, mb = scrape(a.server.metrics_url), scrape(b.server.metrics_url)
    assert value(ma, "jaxinfer:grpc_requests_rejected_total", reason="resource_exhausted") == 1
    assert value(ma, "jaxinfer:request_success_total", finished_reason="abort") == ENGINE.max_num_seqs
    assert value(mb, "jaxinfer:request_success_total", finished_reason="abort") == 0
    assert value(mb, "jaxinfer:grpc_requests_rejected_total", reason="resource_exhausted") == 0


def test_unauthenticated_calls_are_counted(llm, tmp_path):
    cfg = ServerConfig(port=0, metrics_port=0, auth_token="s3cret")
    with ServerThread(llm, cfg) as srv:
        with Client(srv.address, timeout=30) as client:
            with pytest.raises(Exception):
                client.complete(prompt(1, 4), max_tokens=2)
        with Client(srv.address, token="s3cret", timeout=30) as client:
            assert client.complete(prompt(1, 4), max_tokens=2, ignore_eos=True).finish_reason == "length"
        settle(llm, srv)
        m = scrape(srv.server.metrics_url)
    assert value(m, "jaxinfer:grpc_requests_rejected_total", reason="unauthenticated") == 1
    assert value(m, "jaxinfer:request_success_total", finished_reason="length") == 1


def test_serve_flag_sets_the_metrics_port():
    import argparse

    from jaxinfer.cli.serve import add_serve_arguments, server_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert server_config_from_args(p.parse_args([])).metrics_port is None
    cfg = server_config_from_args(p.parse_args(["--metrics-port", "9091"]))
    assert cfg.metrics_port == 9091 and cfg.metrics_host is None and cfg.host == "127.0.0.1"
    with pytest.raises(SystemExit):
        p.parse_args(["--metrics-port", "70000"])
