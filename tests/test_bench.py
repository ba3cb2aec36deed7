"""The serving benchmark (``jaxinfer bench``): statistics, arrivals, workloads, and a real run;
the peer benchmarks under ``benchmarks/`` import and parse their flags."""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import pytest

from jaxinfer.tools import serving
from jaxinfer.tools.serving import (
    BenchConfig,
    LibraryBackend,
    Progress,
    RequestResult,
    arrival_offsets,
    parse_range,
    run_benchmark,
    summarize,
    synthetic_workload,
)
from jaxinfer.stats import describe, median, percentile

from conftest import TINY, TINY_ENGINE, tiny_params

CMD = [sys.executable, "-m", "jaxinfer"]


# --------------------------------------------------------------------------- #
# Statistics (jaxinfer.stats, the one copy every benchmark reports with)
# --------------------------------------------------------------------------- #


def test_percentile_interpolates_linearly_between_ranks():
    xs = list(range(1, 11))  # 1..10
    assert percentile(xs, 0) == 1
    assert percentile(xs, 100) == 10
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 50) == 2  # order of the input does not matter
    assert percentile([None, 4.0, None, 2.0], 50) == pytest.approx(3.0)  # None (not measured) is left out
    assert percentile([None], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)
    with pytest.raises(ValueError):
        percentile(xs, -1)


def test_median_averages_the_middle_pair_and_ignores_none():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == pytest.approx(2.5)
    assert median(x for x in (5.0, None, 7.0)) == pytest.approx(6.0)  # any iterable
    assert median([]) is None and median([None]) is None


def test_describe_reports_mean_median_tail_and_scale():
    d = describe([0.001, 0.002, 0.003, 0.004], scale=1e3)  # seconds -> ms
    assert d["count"] == 4
    assert d["mean"] == pytest.approx(2.5)
    assert d["median"] == pytest.approx(2.5)
    assert d["p90"] == pytest.approx(3.7)
    assert d["p99"] == pytest.approx(3.97)
    assert d["min"] == pytest.approx(1.0) and d["max"] == pytest.approx(4.0)
    assert d["std"] == pytest.approx(statistics.pstdev([1, 2, 3, 4]))
    empty = describe([None, None])
    assert empty["count"] == 0 and empty["mean"] is None and empty["p99"] is None


def test_the_serving_report_uses_the_shared_statistics():
    from jaxinfer import stats

    assert serving.describe is stats.describe  # one copy, not a benchmark's own
    assert not hasattr(serving, "percentile")


def test_summarize_counts_throughput_and_pools_inter_token_gaps():
    results = [
        RequestResult(True, prompt_len=10, output_len=3, ttft_s=0.1, tpot_s=0.02, itl_s=[0.01, 0.03], e2e_s=0.14),
        RequestResult(True, prompt_len=20, output_len=2, ttft_s=0.3, tpot_s=0.05, itl_s=[0.05], e2e_s=0.35),
        RequestResult(False, prompt_len=5, error="boom"),
    ]
    bench = serving.BenchmarkResult(results, duration_s=2.0, counters={"preemptions": 1, "prefix_queries": 4,
                                                                       "prefix_hits": 1}, peaks={"kv_usage": 0.5},
                                    config=BenchConfig())
    s = summarize(bench)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    assert s["itl_ms"]["count"] == 3  # every gap of every request, pooled
    assert s["itl_ms"]["mean"] == pytest.approx(30.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["engine"] == {"preemptions": 1, "prefix_cache_hit_rate": 0.25, "peak_kv_usage": 0.5}
    table = serving.format_table(s)
    assert "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table and "Failed requests:" in table


# --------------------------------------------------------------------------- #
# Arrivals and workloads
# --------------------------------------------------------------------------- #


def test_poisson_arrivals_are_seeded_and_average_one_over_rate():
    a = arrival_offsets(20000, rate=5.0, seed=3)
    assert a == arrival_offsets(20000, rate=5.0, seed=3)
    assert a != arrival_offsets(20000, rate=5.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.05)


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    a = arrival_offsets(20000, 5.0, seed=1, burstiness=4.0)
    regular = [y - x for x, y in zip(a, a[1:])]
    assert statistics.fmean(regular) == pytest.approx(0.2, rel=0.03)
    assert statistics.pstdev(regular) == pytest.approx(0.1, rel=0.05)  # mean / sqrt(shape)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused():
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="request rate"):
            arrival_offsets(4, bad)


def test_synthetic_workload_is_seeded_in_range_and_avoids_special_tokens():
    w = synthetic_workload(50, (5, 9), (2, 4), vocab_size=1000, seed=1)
    assert [r.prompt_ids for r in w] == [r.prompt_ids for r in synthetic_workload(50, (5, 9), (2, 4), 1000, 1)]
    assert all(5 <= len(r.prompt_ids) <= 9 and 2 <= r.output_len <= 4 for r in w)
    ids = [t for r in w for t in r.prompt_ids]
    assert min(ids) >= 100 and max(ids) < 900
    assert parse_range("3:7", "x") == (3, 7) and parse_range("4", "x") == (4, 4)
    for bad in ("7:3", "0:2", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--input-len-range"):
            parse_range(bad, "--input-len-range")


def test_dataset_reads_strings_and_objects_and_names_a_bad_entry():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.json")
        with open(path, "w") as f:
            json.dump(["hello", {"prompt": "world", "output_len": 5}], f)
        assert serving.read_dataset(path) == [("hello", None), ("world", 5)]
        with open(path, "w") as f:
            json.dump(["ok", {"prompt": "x", "output_len": 0}], f)
        with pytest.raises(ValueError, match="entry 1: output_len"):
            serving.read_dataset(path)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_redraws_one_line_and_ends_it():
    buf = _Terminal()
    p = Progress(2, stream=buf)
    p.update(True)
    p.update(False)
    p.close()
    text = buf.getvalue()
    assert text.startswith("\r") and text.count("\n") == 1 and text.endswith("\n")
    assert "2/2 requests, 1 failed" in text.rsplit("\r", 1)[1]


def test_progress_in_a_log_writes_whole_lines_never_carriage_returns():
    buf = io.StringIO()  # not a terminal
    p = Progress(50, stream=buf, every=3600.0)
    for i in range(50):
        p.update(i % 10 != 0)
        p.refresh()  # as the gauge sampler calls it, many times a second
    p.close()
    p.close()  # closing twice writes nothing more
    lines = buf.getvalue().split("\n")
    assert "\r" not in buf.getvalue() and lines[-1] == ""
    assert lines[:-1] == ["bench: 50 requests ...", lines[1]] and lines[1].startswith("bench: 50/50 requests, 5 failed, ")
    assert lines[1].endswith(", done")

    buf = io.StringIO()
    p = Progress(3, stream=buf, every=0.0)  # a line at every refresh past the interval
    for _ in range(3):
        p.update()
    p.close()
    assert [ln.split(",")[0] for ln in buf.getvalue().splitlines()] == [
        "bench: 3 requests ...", "bench: 1/3 requests", "bench: 2/3 requests", "bench: 3/3 requests",
        "bench: 3/3 requests"]


# --------------------------------------------------------------------------- #
# End to end through the real engine (tiny random-weight model)
# --------------------------------------------------------------------------- #


class _CountingBackend(LibraryBackend):
    """The library backend, recording the most requests it ever had in flight."""

    def __init__(self, llm):
        super().__init__(llm)
        self.in_flight = self.most_in_flight = self.calls = 0

    async def run_one(self, prompt_ids, params):
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await super().run_one(prompt_ids, params)
        finally:
            self.in_flight -= 1


def test_bench_run_through_the_engine_completes_every_request_exactly():
    import jaxinfer

    llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE)
    backend = _CountingBackend(llm)
    try:
        workload = synthetic_workload(12, (6, 20), (3, 8), TINY.vocab_size, seed=0)
        cfg = BenchConfig(request_rate=200.0, max_concurrency=3, warmup_requests=2, seed=0, progress=False)
        warm = serving.warmup_workload(workload, 2, TINY.vocab_size, 0)
        result = run_benchmark(backend, workload, cfg, warm)
        assert llm.wait_idle(10)
    finally:
        llm.close()

    assert len(result.results) == 12
    for req, res in zip(workload, result.results):
        assert res.ok, res.error
        assert res.output_len == req.output_len == res.expected_output_len
        assert res.prompt_len == len(req.prompt_ids)
        assert len(res.itl_s) == res.output_len - 1
        assert 0 < res.ttft_s <= res.e2e_s
    assert backend.calls == 12 + 2  # warm-up requests ran, but are not in the results
    assert backend.most_in_flight == 3  # the concurrency cap held, and was reached

    s = summarize(result, {"backend": "library", "model": "tiny"})
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.output_len for r in workload)
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert s["total_token_throughput"] > s["output_throughput"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert d["min"] <= d["median"] <= d["p90"] <= d["p99"] <= d["max"], (key, d)
    assert s["itl_ms"]["count"] == sum(r.output_len - 1 for r in workload)
    assert s["engine"]["preemptions"] >= 0 and 0 < s["engine"]["peak_kv_usage"] <= 1
    again = json.loads(json.dumps(s))
    assert again["completed"] == 12 and len(again["requests"]) == 12
    assert "Serving Benchmark Result" in serving.format_table(s)


# --------------------------------------------------------------------------- #
# Command line (no model is loaded)
# --------------------------------------------------------------------------- #


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.run(CMD + list(args), capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--num-prompts", "0"], "--num-prompts"),
        (["--input-len", "8", "--input-len-range", "4:8"], "not both"),
        (["--request-rate", "0"], "--request-rate"),
        (["--input-len-range", "9:3"], "--input-len-range"),
    ],
)
def test_bench_bad_arguments_exit_2_with_one_line(args, needle):
    p = _run_cli("bench", *args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxinfer: error: "), p.stderr
    assert needle in lines[0], lines[0]


# --------------------------------------------------------------------------- #
# The peer benchmarks (top-level benchmarks/, not installed)
# --------------------------------------------------------------------------- #


def test_peer_benchmarks_import_without_transformers_and_parse_their_flags(capsys):
    # importing them loads neither torch nor transformers: only hf_peer.py does, in its own process
    before = {m for m in ("torch", "transformers") if m in sys.modules}
    from benchmarks import bench_figures, core, engine

    assert {m for m in ("torch", "transformers") if m in sys.modules} == before
    assert core.parse_args(["--no-hf", "--repeats", "2"]).repeats == 2
    a = engine.parse_args(["--quick", "--no-hf"])
    assert a.rounds == 2 and a.no_hf
    assert core.HF_PEER.is_file() and core.HF_PEER.parent.name == "benchmarks"
    assert core.median is engine.median is median  # the shared statistics, not a copy
    with pytest.raises(SystemExit) as e:
        bench_figures.main(["--help"])
    assert e.value.code == 0 and "python -m benchmarks.bench_figures" in capsys.readouterr().out
    from benchmarks import http_vs_grpc

    with pytest.raises(SystemExit) as e:
        http_vs_grpc.main(["--help"])
    assert e.value.code == 0 and "--output-len-range" in capsys.readouterr().out


@pytest.mark.parametrize("name,flag", [("moe", "--expert-size"), ("tensor_parallel", "--devices"),
                                       ("matmul_kernel", "--head-rows"), ("protocol_overhead", "--skip"),
                                       ("http_vs_grpc", "--serve-arg"), ("bench_figures", "--rates")])
def test_every_benchmark_speaks_the_harness_flags(name, flag, capsys):
    # each benchmark's main is the harness's run: its own flags, and --json for every figure
    import importlib

    mod = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"python -m benchmarks.{name}" in out and flag in out and "--json FILE" in out


def test_the_peer_benchmarks_are_not_installed():
    tomllib = pytest.importorskip("tomllib")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    shipped = set(setuptools["packages"]) | set(setuptools.get("package-dir", {}))
    assert "jaxinfer.tools" in shipped  # jaxinfer bench and the start-up benchmark ship
    assert not any(p == "benchmarks" or p.startswith("benchmarks.") for p in shipped)


# --------------------------------------------------------------------------- #
# What bench writes on stderr while it starts: a log vs a terminal (issue 19)
# --------------------------------------------------------------------------- #

# 4 batch rows and 2 chunk lengths: few programs, compiled in seconds on two cores
_SMALL_ENGINE = {"page_size": 4, "num_pages": 64, "max_num_seqs": 2, "max_num_batched_tokens": 16,
                 "batch_buckets": [1, 2], "chunk_buckets": [16], "page_buckets": [4, 8], "dtype": "float32",
                 "name": "small"}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    import jaxinfer

    root = tmp_path_factory.mktemp("bench-model")
    (root / "engine.json").write_text(json.dumps(_SMALL_ENGINE))
    jaxinfer.save_model(root / "tiny", TINY, tiny_params())
    return root


def _bench_local_argv(root) -> list:
    return ["bench", "--model", str(root / "tiny"), "--engine-config", str(root / "engine.json"),
            "--num-prompts", "4", "--input-len", "12", "--output-len", "3", "--max-concurrency", "2"]


@pytest.mark.slow
def test_bench_in_a_log_says_when_compiling_starts_and_ends_and_draws_no_bar(tiny_model_dir):
    p = _run_cli(*_bench_local_argv(tiny_model_dir))
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(("jaxinfer: ", "bench: "))]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("jaxinfer: compiling the engine's programs")]
    ends = [i for i, ln in enumerate(lines) if " programs ready in " in ln]
    ready = [i for i, ln in enumerate(lines) if ln.startswith("jaxinfer: ready in ")]
    bench = [i for i, ln in enumerate(lines) if ln.startswith("bench: ")]
    assert len(starts) == len(ends) == len(ready) == 1, p.stderr
    assert starts[0] < ends[0] < ready[0] < bench[0], p.stderr
    assert lines[bench[0]] == "bench: 4 requests ..." and lines[bench[-1]].startswith("bench: 4/4 requests, ")
    assert "Successful requests:" in p.stdout

    quiet = _run_cli(*_bench_local_argv(tiny_model_dir), "--quiet", "--no-progress")
    assert quiet.returncode == 0 and "jaxinfer: " not in quiet.stderr and "bench: " not in quiet.stderr, quiet.stderr


@pytest.mark.slow
def test_bench_on_a_terminal_closes_the_start_with_a_ready_line(tiny_model_dir):
    import pty
    import threading

    master, slave = pty.openpty()
    env = dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="100")
    proc = subprocess.Popen(CMD + _bench_local_argv(tiny_model_dir), stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    chunks: list = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the other end is closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=300)
    reader.join(10)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")  # the terminal's own line endings
    assert proc.returncode == 0, err
    lines = err.split("\n")
    ready = [i for i, ln in enumerate(lines) if ln.startswith("jaxinfer: ready in ")]
    assert len(ready) == 1, err
    assert any("compiling programs" in ln for ln in lines[:ready[0]]), err  # the compile stage showed itself
    bar = lines[ready[0] + 1:]
    assert any("bench [" in ln and "\r" in ln for ln in bar), err  # the bar is redrawn in place
    last = [ln for ln in bar if "bench [" in ln][-1]
    assert last.rsplit("\r", 1)[1].startswith("bench [" + "#" * 30 + "] 4/4 requests"), err
    assert b"Successful requests:" in out
