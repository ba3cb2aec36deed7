"""Serving benchmark: a load generator in the style of vLLM's ``bench serve``.

    jaxinfer bench --num-prompts 64 --input-len 128 --output-len 32 --request-rate 4
    jaxinfer bench --dataset prompts.json --max-concurrency 8 --json result.json

The pieces are kept apart so the same driver can run over other transports:

* a **workload** (`synthetic_workload`, `load_dataset`): token-id prompts and
  the exact number of tokens each must produce (``ignore_eos``);
* **arrivals** (`arrival_offsets`): when each request is sent, from a seeded
  Poisson (or gamma, for burstiness) process, or all at once;
* a **backend** (`Backend.run_one`): sends one request and reports its
  `RequestResult`. `LibraryBackend` drives an in-process `LLM` through the
  engine's async streams and takes TTFT / ITL / TPOT from the engine's own
  `RequestMetrics`; a gRPC backend plugs in the same way;
* the **driver** (`run_benchmark`): paces arrivals, caps concurrency, samples
  engine gauges, and returns a `BenchmarkResult`;
* the **report** (`summarize`, `format_table`): throughputs and
  mean / median / p90 / p99 of every latency, as a table or JSON.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from jaxinfer.sampling_params import SamplingParams

# Random prompt ids stay this far from both ends of the vocabulary: special and
# control tokens live there in most tokenizers.
SPECIAL_TOKEN_MARGIN = 100


# --------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------- #


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), interpolating linearly between ranks (numpy's default).

    None for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}.")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: Sequence[float], scale: float = 1.0) -> dict:
    """mean, median, p90, p99, std, min, max and count of `values`, each times `scale`.

    Every figure is None (count 0) when there are no values.
    """
    xs = [float(v) * scale for v in values if v is not None]
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None, "min": None, "max": None,
                "count": 0}
    return {
        "mean": statistics.fmean(xs),
        "median": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "std": statistics.pstdev(xs),
        "min": min(xs),
        "max": max(xs),
        "count": len(xs),
    }


# --------------------------------------------------------------------------- #
# Arrivals
# --------------------------------------------------------------------------- #


def arrival_offsets(n: int, rate: float, seed: int = 0, burstiness: float = 1.0) -> list:
    """When each of `n` requests is sent, in seconds after the start (the first at 0).

    Gaps between requests are drawn from a gamma distribution with mean ``1/rate``
    and shape `burstiness`: 1 is a Poisson process (exponential gaps), below 1 is
    burstier, above 1 more regular. ``rate = inf`` sends everything at once.
    Seeded, so a run's schedule is reproducible.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}.")
    if not rate > 0:
        raise ValueError(f"request rate must be positive (or inf), got {rate}.")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}.")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


# --------------------------------------------------------------------------- #
# Workload
# --------------------------------------------------------------------------- #


@dataclass
class BenchRequest:
    prompt_ids: list
    output_len: int


def parse_range(text: str, what: str) -> tuple:
    """``"LO:HI"`` -> (LO, HI), integers with 1 <= LO <= HI; a single ``"N"`` is (N, N)."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"{what} must be LO:HI (two integers), got {text!r}.") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{what} must satisfy 1 <= LO <= HI, got {text!r}.")
    return lo, hi


def random_token_ids(rng: random.Random, n: int, vocab_size: int) -> list:
    """`n` ids away from the vocabulary's ends (special tokens), or anywhere in a tiny one."""
    m = SPECIAL_TOKEN_MARGIN if vocab_size > 4 * SPECIAL_TOKEN_MARGIN else 0
    return [rng.randrange(m, vocab_size - m) for _ in range(n)]


def synthetic_workload(
    n: int, input_len: tuple, output_len: tuple, vocab_size: int, seed: int = 0
) -> list:
    """`n` requests of random token ids; lengths uniform in the inclusive (lo, hi) ranges."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        out.append(BenchRequest(random_token_ids(rng, n_in, vocab_size), n_out))
    return out


def read_dataset(path: str) -> list:
    """A JSON list of prompts: strings, or objects ``{"prompt": str, "output_len": int}``.

    Returns ``[(prompt, output_len or None)]``; ValueError naming the entry when malformed.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset {path} is not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"dataset {path} must be a non-empty JSON list of prompts.")
    out = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            prompt, n_out = item, None
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompt, n_out = item["prompt"], item.get("output_len")
            if n_out is not None and (isinstance(n_out, bool) or not isinstance(n_out, int) or n_out < 1):
                raise ValueError(f"dataset {path} entry {i}: output_len must be a positive integer, got {n_out!r}.")
        else:
            raise ValueError(
                f"dataset {path} entry {i} must be a string or an object with a string \"prompt\", got {item!r:.60}."
            )
        if not prompt:
            raise ValueError(f"dataset {path} entry {i}: the prompt is empty.")
        out.append((prompt, n_out))
    return out


def dataset_workload(entries: list, tokenize, default_output_len: int) -> list:
    """Tokenize `read_dataset` entries; entries without an output_len get the default."""
    return [BenchRequest(list(tokenize(p)), n if n is not None else default_output_len) for p, n in entries]


def check_workload_fits(workload: list, max_model_len: int) -> None:
    """Every request's prompt plus output must fit the context; ValueError naming the worst one."""
    worst = max(workload, key=lambda r: len(r.prompt_ids) + r.output_len)
    total = len(worst.prompt_ids) + worst.output_len
    if total > max_model_len:
        raise ValueError(
            f"a request needs {total} tokens ({len(worst.prompt_ids)} prompt + {worst.output_len} output), "
            f"but the context length (max_model_len) is {max_model_len}; use shorter lengths or raise "
            f"--max-model-len."
        )


# --------------------------------------------------------------------------- #
# Backends
# --------------------------------------------------------------------------- #


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; arrival is when it was sent."""

    ok: bool
    prompt_len: int
    output_len: int = 0  # tokens actually produced
    expected_output_len: int = 0
    arrival_time: float = 0.0  # time.perf_counter() at send
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    itl_s: list = field(default_factory=list)
    e2e_s: Optional[float] = None
    queue_s: Optional[float] = None
    cached_tokens: int = 0
    error: str = ""

    def to_dict(self) -> dict:
        def ms(x):
            return None if x is None else x * 1e3

        return {
            "ok": self.ok,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "expected_output_len": self.expected_output_len,
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s),
            "e2e_ms": ms(self.e2e_s),
            "queue_ms": ms(self.queue_s),
            "cached_tokens": self.cached_tokens,
            "error": self.error,
        }


class Backend:
    """Sends requests somewhere and measures them. Subclass for each transport.

    `run_one` must not raise for a failed request: it returns a result with
    ``ok=False`` and the error, so one failure does not stop the run.
    """

    name = "backend"

    async def run_one(self, prompt_ids: list, params: SamplingParams) -> RequestResult:
        raise NotImplementedError

    def counters(self) -> dict:
        """Cumulative engine counters (diffed around the measured run); {} when unknown."""
        return {}

    def gauges(self) -> dict:
        """Instantaneous engine gauges (sampled during the run for their peaks); {} when unknown."""
        return {}


class LibraryBackend(Backend):
    """An in-process `jaxinfer.LLM`: requests go through ``LLM.submit`` and its async stream.

    Latencies are the engine's own `RequestMetrics`, with the arrival stamped
    at submit time.
    """

    name = "library"

    def __init__(self, llm):
        self.llm = llm

    async def run_one(self, prompt_ids: list, params: SamplingParams) -> RequestResult:
        from jaxinfer.metrics import RequestMetrics

        n_out = params.max_tokens or 0
        arrival = time.perf_counter()
        try:
            metrics = RequestMetrics(arrival_time=arrival)
            metrics.user_tokens = len(prompt_ids)
            request = self.llm.make_request(list(prompt_ids), params, metrics=metrics)
            stream = self.llm.submit(request)
            async for _ in stream:
                pass
            out = stream.output
        except Exception as e:  # one failed request is a data point, not the end of the run
            return RequestResult(False, len(prompt_ids), expected_output_len=n_out, arrival_time=arrival,
                                 error=f"{type(e).__name__}: {e}")
        comp = out.outputs[0]
        m = out.metrics
        ok = comp.finish_reason not in (None, "abort", "error")
        return RequestResult(
            ok=ok,
            prompt_len=len(prompt_ids),
            output_len=len(comp.token_ids),
            expected_output_len=n_out,
            arrival_time=arrival,
            ttft_s=m.ttft_s,
            tpot_s=m.tpot_s,
            itl_s=m.itl_s,
            e2e_s=m.e2e_s,
            queue_s=m.queue_s,
            cached_tokens=m.cached_tokens,
            error="" if ok else f"finished with {comp.finish_reason!r}",
        )

    def counters(self) -> dict:
        e = self.llm.engine
        return {
            "preemptions": e.stats.preemptions,
            "prefix_queries": e.allocator.queries,
            "prefix_hits": e.allocator.hits,
            "engine_steps": e.stats.steps,
        }

    def gauges(self) -> dict:
        e = self.llm.engine
        return {
            "kv_usage": e.allocator.usage(),
            "running": e.scheduler.num_running,
            "waiting": e.scheduler.num_waiting,
        }


# --------------------------------------------------------------------------- #
# Progress
# --------------------------------------------------------------------------- #


class Progress:
    """A one-line progress bar on a stream: ``bench [####....] 7/16 requests, 3.2s``."""

    def __init__(self, total: int, label: str = "bench", stream=None, enabled: bool = True, width: int = 30):
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.failed = 0
        self._t0 = time.perf_counter()
        self._last = 0.0
        # a terminal redraws in place; a log file gets a line at most every few seconds
        isatty = getattr(self.stream, "isatty", None)
        self._every = 0.1 if isatty is not None and isatty() else 5.0

    def update(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self.refresh(force=self.done == self.total)

    def refresh(self, force: bool = False) -> None:
        """Redraw (the elapsed time moves even when no request finished), throttled."""
        now = time.perf_counter()
        if force or now - self._last >= self._every:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // max(self.total, 1)
        fail = f", {self.failed} failed" if self.failed else ""
        self.stream.write(
            f"\r{self.label} [{'#' * filled:<{self.width}}] {self.done}/{self.total} requests{fail}, "
            f"{now - self._t0:.1f}s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------- #
# Driver
# --------------------------------------------------------------------------- #


@dataclass
class BenchConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    warmup_requests: int = 0
    temperature: float = 0.0
    seed: int = 0
    progress: bool = True
    gauge_interval_s: float = 0.02


@dataclass
class BenchmarkResult:
    results: list  # RequestResult, in workload order
    duration_s: float
    counters: dict  # engine counters over the measured run
    peaks: dict  # the highest value of each gauge seen during the run
    config: BenchConfig


def sampling_params_for(req: BenchRequest, cfg: BenchConfig, index: int) -> SamplingParams:
    kw: dict[str, Any] = dict(max_tokens=req.output_len, ignore_eos=True, temperature=cfg.temperature)
    if cfg.temperature > 0:
        kw["seed"] = cfg.seed + index
    return SamplingParams(**kw)


async def _run_all(backend: Backend, workload: list, cfg: BenchConfig, offsets: list, progress: Progress) -> list:
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async def one(i: int, req: BenchRequest) -> RequestResult:
        params = sampling_params_for(req, cfg, i)
        if sem is None:
            res = await backend.run_one(req.prompt_ids, params)
        else:
            async with sem:
                res = await backend.run_one(req.prompt_ids, params)
        progress.update(res.ok)
        return res

    t0 = time.perf_counter()
    tasks = []
    for i, (req, at) in enumerate(zip(workload, offsets)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, req)))
    return await asyncio.gather(*tasks)


async def _sample_gauges(backend: Backend, peaks: dict, interval: float, progress: Progress) -> None:
    while True:
        progress.refresh()
        for k, v in backend.gauges().items():
            if v is not None and (k not in peaks or v > peaks[k]):
                peaks[k] = v
        await asyncio.sleep(interval)


async def run_benchmark_async(backend: Backend, workload: list, cfg: BenchConfig,
                              warmup: Optional[list] = None) -> BenchmarkResult:
    """Run `warmup` (unmeasured, all at once within the concurrency cap), then `workload` as measured."""
    if not workload:
        raise ValueError("the workload is empty: there is nothing to benchmark.")
    if warmup:
        p = Progress(len(warmup), "warm-up", enabled=cfg.progress)
        await _run_all(backend, warmup, cfg, [0.0] * len(warmup), p)
        p.close()
    offsets = arrival_offsets(len(workload), cfg.request_rate, cfg.seed, cfg.burstiness)
    before = backend.counters()
    peaks: dict = {}
    progress = Progress(len(workload), "bench", enabled=cfg.progress)
    sampler = asyncio.create_task(_sample_gauges(backend, peaks, cfg.gauge_interval_s, progress))
    t0 = time.perf_counter()
    try:
        results = await _run_all(backend, workload, cfg, offsets, progress)
    finally:
        duration = time.perf_counter() - t0
        sampler.cancel()
        try:
            await sampler
        except asyncio.CancelledError:
            pass
        progress.close()
    after = backend.counters()
    counters = {k: after[k] - before.get(k, 0) for k in after}
    return BenchmarkResult(list(results), duration, counters, peaks, cfg)


def run_benchmark(backend: Backend, workload: list, cfg: BenchConfig, warmup: Optional[list] = None) -> BenchmarkResult:
    return asyncio.run(run_benchmark_async(backend, workload, cfg, warmup))


def warmup_workload(workload: list, k: int, vocab_size: int, seed: int) -> list:
    """`k` requests shaped like the workload's first ones but with fresh random ids,
    so warming up leaves nothing in the prefix cache that the measured run could reuse."""
    rng = random.Random(seed ^ 0x5EED)
    return [
        BenchRequest(random_token_ids(rng, len(workload[i % len(workload)].prompt_ids), vocab_size),
                     workload[i % len(workload)].output_len)
        for i in range(k)
    ]


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def summarize(bench: BenchmarkResult, info: Optional[dict] = None) -> dict:
    """Every reported figure as one JSON-able dict (latencies in milliseconds)."""
    ok = [r for r in bench.results if r.ok]
    dur = bench.duration_s
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_len for r in ok)
    cfg = bench.config
    c = bench.counters
    engine: dict[str, Any] = {}
    if "preemptions" in c:
        engine["preemptions"] = c["preemptions"]
    if "prefix_queries" in c:
        q = c["prefix_queries"]
        engine["prefix_cache_hit_rate"] = c.get("prefix_hits", 0) / q if q else 0.0
    if "engine_steps" in c:
        engine["engine_steps"] = c["engine_steps"]
    if "kv_usage" in bench.peaks:
        engine["peak_kv_usage"] = bench.peaks["kv_usage"]
    if "running" in bench.peaks:
        engine["peak_running"] = bench.peaks["running"]
    if "waiting" in bench.peaks:
        engine["peak_waiting"] = bench.peaks["waiting"]
    failed = [r for r in bench.results if not r.ok]
    return {
        "info": dict(info or {}),
        "config": {
            "num_prompts": len(bench.results),
            "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
            "burstiness": cfg.burstiness,
            "max_concurrency": cfg.max_concurrency,
            "warmup_requests": cfg.warmup_requests,
            "temperature": cfg.temperature,
            "seed": cfg.seed,
        },
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "duration_s": dur,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur if dur > 0 else 0.0,
        "output_throughput": n_out / dur if dur > 0 else 0.0,
        "total_token_throughput": (n_in + n_out) / dur if dur > 0 else 0.0,
        "ttft_ms": describe([r.ttft_s for r in ok], 1e3),
        "tpot_ms": describe([r.tpot_s for r in ok], 1e3),
        "itl_ms": describe([g for r in ok for g in r.itl_s], 1e3),
        "e2e_ms": describe([r.e2e_s for r in ok], 1e3),
        "engine": engine,
        "requests": [r.to_dict() for r in bench.results],
    }


def format_table(s: dict) -> str:
    """The summary as a readable table (vLLM's ``bench serve`` layout)."""
    width = 50
    rows: list[str] = []

    def title(text: str, fill: str = "-") -> None:
        rows.append(f" {text} ".center(width, fill))

    def row(name: str, value) -> None:
        if value is None:
            v = "-"
        elif isinstance(value, float):
            v = f"{value:.2f}"
        else:
            v = str(value)
        rows.append(f"{name:<{width - 12}}{v:>12}")

    title("Serving Benchmark Result", "=")
    for k, label in (("backend", "Backend"), ("model", "Model")):
        if k in s["info"]:
            rows.append(f"{label + ':':<20}{str(s['info'][k]):>{width - 20}}")
    cfg = s["config"]
    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Request rate configured (req/s):", cfg["request_rate"])
    row("Maximum request concurrency:", cfg["max_concurrency"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for key, name, abbr in (
        ("ttft_ms", "Time to First Token", "TTFT"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl_ms", "Inter-token Latency", "ITL"),
        ("e2e_ms", "End-to-end Latency", "E2EL"),
    ):
        d = s[key]
        title(name)
        row(f"Mean {abbr} (ms):", d["mean"])
        row(f"Median {abbr} (ms):", d["median"])
        row(f"P90 {abbr} (ms):", d["p90"])
        row(f"P99 {abbr} (ms):", d["p99"])
    e = s["engine"]
    if e:
        title("Engine")
        if "preemptions" in e:
            row("Preemptions:", e["preemptions"])
        if "prefix_cache_hit_rate" in e:
            row("Prefix cache hit rate (%):", 100 * e["prefix_cache_hit_rate"])
        if "peak_kv_usage" in e:
            row("Peak KV cache usage (%):", 100 * e["peak_kv_usage"])
        if "peak_running" in e:
            row("Peak running requests:", e["peak_running"])
        if "peak_waiting" in e:
            row("Peak waiting requests:", e["peak_waiting"])
        if "engine_steps" in e:
            row("Engine steps:", e["engine_steps"])
    rows.append("=" * width)
    if s["errors"]:
        rows.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(rows)


# --------------------------------------------------------------------------- #
# Command line (``jaxinfer bench``; the parser lives in jaxinfer.cli)
# --------------------------------------------------------------------------- #

DEFAULT_NUM_PROMPTS = 100
DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 64


def _check_args(args) -> tuple:
    """Everything that can be checked without loading the model; returns (input, output) length ranges."""
    if args.dataset is not None and (args.input_len is not None or args.input_len_range is not None):
        raise ValueError("--dataset gives the prompts; drop --input-len / --input-len-range.")
    if args.input_len is not None and args.input_len_range is not None:
        raise ValueError("give --input-len or --input-len-range, not both.")
    if args.output_len is not None and args.output_len_range is not None:
        raise ValueError("give --output-len or --output-len-range, not both.")
    if args.input_len_range is not None:
        in_range = parse_range(args.input_len_range, "--input-len-range")
    else:
        n = args.input_len if args.input_len is not None else DEFAULT_INPUT_LEN
        in_range = (n, n)
    if args.output_len_range is not None:
        out_range = parse_range(args.output_len_range, "--output-len-range")
    else:
        n = args.output_len if args.output_len is not None else DEFAULT_OUTPUT_LEN
        out_range = (n, n)
    if args.dataset is not None and args.output_len_range is not None:
        raise ValueError("--output-len-range is for synthetic prompts; with --dataset use --output-len.")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {args.request_rate}.")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}.")
    if args.warmup_requests < 0:
        raise ValueError(f"--warmup-requests must be at least 0, got {args.warmup_requests}.")
    SamplingParams(temperature=args.temperature)  # vLLM's wording for a bad temperature
    return in_range, out_range


def _engine_config(args):
    from jaxinfer.config import EngineConfig

    engine = EngineConfig.preset(args.engine_config) if args.engine_config else EngineConfig.for_backend()
    changes = {k: getattr(args, k) for k in ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
               if getattr(args, k) is not None}
    engine = engine.replace(**changes)
    if engine.max_num_seqs > engine.batch_buckets[-1]:
        raise ValueError(
            f"--max-num-seqs {engine.max_num_seqs} exceeds the largest batch bucket ({engine.batch_buckets[-1]}) "
            f"of the {engine.name} engine config."
        )
    return engine


def bench_command(args, out=None) -> int:
    """Run ``jaxinfer bench`` from parsed arguments; returns the exit status."""
    out = out if out is not None else sys.stdout
    in_range, out_range = _check_args(args)
    entries = read_dataset(args.dataset) if args.dataset is not None else None
    if entries is not None and args.num_prompts is not None and args.num_prompts > len(entries):
        raise ValueError(f"--num-prompts {args.num_prompts} is more than the {len(entries)} prompts in {args.dataset}.")
    engine = _engine_config(args)

    from jaxinfer.llm import LLM

    llm = LLM(args.model, engine_config=engine, enable_prefix_caching=not args.no_prefix_caching)
    try:
        vocab = llm.model_config.vocab_size
        if entries is not None:
            if llm.tokenizer is None:
                raise ValueError(f"model {llm.model_name!r} has no tokenizer, so --dataset prompts cannot be used.")
            entries = entries[: args.num_prompts] if args.num_prompts is not None else entries
            workload = dataset_workload(entries, llm.tokenizer.encode, out_range[0])
        else:
            n = args.num_prompts if args.num_prompts is not None else DEFAULT_NUM_PROMPTS
            workload = synthetic_workload(n, in_range, out_range, vocab, args.seed)
        check_workload_fits(workload, llm.max_model_len)
        if args.warmup:
            llm.engine.warmup(variants=("greedy",) if args.temperature == 0 else ("sample",),
                              progress=not args.no_progress)
        cfg = BenchConfig(
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            warmup_requests=args.warmup_requests,
            temperature=args.temperature,
            seed=args.seed,
            progress=not args.no_progress,
        )
        warm = warmup_workload(workload, args.warmup_requests, vocab, args.seed)
        result = run_benchmark(LibraryBackend(llm), workload, cfg, warm)
    finally:
        llm.close()

    import jax

    info = {
        "backend": LibraryBackend.name,
        "model": llm.model_name,
        "device": jax.default_backend(),
        "engine_config": engine.name,
        "dtype": engine.dtype,
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "prefix_caching": not args.no_prefix_caching,
        "dataset": args.dataset or "random",
    }
    summary = summarize(result, info)
    if args.json == "-":
        out.write(json.dumps(summary) + "\n")
    else:
        out.write(format_table(summary) + "\n")
        if args.json is not None:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
                f.write("\n")
    out.flush()
    return 0 if summary["completed"] else 1
