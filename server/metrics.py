"""Prometheus metrics of one gRPC server, in vLLM's names with the ``jaxinfer:`` prefix.

    jaxinfer serve --metrics-port 9090        # text exposition at http://127.0.0.1:9090/metrics

Each server has its own `CollectorRegistry` (never the process-global one), so
several servers, or tests, can live in one process.

Two kinds of numbers:

* **Per request**, recorded when a request finishes, from its `RequestMetrics`:
  ``request_success_total{finished_reason}`` (stop, length, abort, error: every
  finished request, aborted ones included), the latency histograms (TTFT,
  TPOT, each inter-token gap, end-to-end, queue, prefill, decode; a request
  adds to those whose quantity it has: one that was aborted before its first
  token has no TTFT) and the token counters (``prompt_tokens_total`` counts
  each finished request's whole prompt, cached part included;
  ``generation_tokens_total`` its output tokens). A request the client
  cancelled is recorded once the engine has finished it, which is after the
  call has ended: such requests are kept aside and recorded at the next
  finish or scrape.
* **Engine gauges and counters**, read from the engine at scrape time:
  running / waiting requests, KV-cache usage (a fraction, as vLLM's
  ``kv_cache_usage_perc``), the prefix-cache hit rate and its queries / hits in
  tokens, preemptions; the server's own Generate calls in flight; and, on a
  server with a disaggregation role, its KV transfers (`transfer_metrics`:
  held transfers and pages, in flight, registered or pulled, expired, failed,
  bytes).

**The gateways' names.** Kubernetes' Gateway API Inference Extension (the
endpoint picker llm-d deploys) scrapes each model server for its queue, its
running requests and its KV-cache usage, under vLLM's names; the same numbers
are served under those names too, from the same registry (so on ``/metrics``
of the HTTP port and on ``--metrics-port``): ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (a fraction, as
vLLM's) and the older ``vllm:gpu_cache_usage_perc`` that earlier pickers
read, and ``vllm:cache_config_info{block_size, num_gpu_blocks}`` (value 1),
which the picker's prefix-cache scorer reads for the page size and the page
count. (``vllm:lora_requests_info`` is not served: no adapters are served.)

``grpc_requests_rejected_total{reason}`` counts calls refused before they
reached the engine: invalid_argument, resource_exhausted (admission control),
shutting_down, duplicate_request_id, unauthenticated, internal.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxinfer.engine.kv_transfer import transfer_metrics
from jaxinfer.metrics import RooflineCollector

PREFIX = "jaxinfer:"
GATEWAY_PREFIX = "vllm:"  # the names the Gateway API Inference Extension reads (its model-server protocol)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = (
    "invalid_argument", "resource_exhausted", "shutting_down", "duplicate_request_id", "unauthenticated", "internal",
)

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
PENDING_LIMIT = 10_000  # cancelled calls whose request the engine has not finished yet


class _FlushPending:
    """Registered first, so a scrape records late-finishing requests before any counter is read."""

    def __init__(self, owner: "ServerMetrics"):
        self._owner = owner

    def describe(self):
        return []

    def collect(self):
        self._owner.flush_pending()
        return []


class _EngineCollector:
    """Gauges and engine-wide counters, read when Prometheus scrapes."""

    def __init__(self, owner: "ServerMetrics"):
        self._owner = owner

    def collect(self):
        owner = self._owner
        engine = owner.engine
        labels = owner.label_names
        values = owner.label_values
        snap = engine.stats.snapshot()
        page_size = engine.ecfg.page_size

        def one(family, name, doc, value, prefix=PREFIX):
            m = family(prefix + name, doc, labels=labels)
            m.add_metric(values, float(value))
            return m

        def gauge(name, doc, value, prefix=PREFIX):
            return one(GaugeMetricFamily, name, doc, value, prefix)

        def counter(name, doc, value):
            return one(CounterMetricFamily, name, doc, value)

        yield gauge("num_requests_running", "Number of requests in the engine's running batch.", snap["running"])
        yield gauge("num_requests_waiting", "Number of requests waiting to be scheduled.", snap["waiting"])
        yield gauge("kv_cache_usage_perc", "KV-cache usage: the fraction of pages in use (1 = full).",
                    snap["kv_usage"])
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits over lookups since start (0..1).",
                    snap["prefix_hit_rate"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (whole pages).",
                      engine.allocator.queries * page_size)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (whole pages).",
                      engine.allocator.hits * page_size)
        yield counter("num_preemptions", "Requests preempted (to be recomputed) because KV pages ran out.",
                      snap["preemptions"])
        yield gauge("grpc_requests_active", "Generate calls in flight on this server.", owner.active_calls())
        for kind, name, doc, value in transfer_metrics(engine):  # a prefill or decode role's KV transfers
            yield (gauge if kind == "gauge" else counter)(name, doc, value)
        yield from self._gateway(snap, page_size, engine.allocator.num_usable, gauge)
        spec = snap.get("spec")
        if spec is not None:  # speculative decoding, as vLLM names it
            yield counter("spec_decode_num_drafts", "Verify segments that carried draft tokens.", spec["num_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                          spec["num_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec["num_accepted_tokens"])
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft (0: the first).",
                                          labels=labels + ["position"])
            for i, n in enumerate(spec["accepted_per_pos"]):
                per_pos.add_metric(values + [str(i)], float(n))
            yield per_pos


    def _gateway(self, snap: dict, page_size: int, num_pages: int, gauge):
        """The same numbers under vLLM's names, for the gateways that read them (the model-server protocol of
        Kubernetes' Gateway API Inference Extension: TotalQueuedRequests, TotalRunningRequests,
        KVCacheUtilization, and the prefix-cache scorer's BlockSize and NumGPUBlocks)."""
        labels, values = self._owner.label_names, self._owner.label_values
        for name, doc, value in (
            ("num_requests_running", "Requests in the engine's running batch (vLLM's name).", snap["running"]),
            ("num_requests_waiting", "Requests waiting to be scheduled (vLLM's name).", snap["waiting"]),
            ("kv_cache_usage_perc", "KV-cache usage, the fraction of pages in use, 1 = full (vLLM's name).",
             snap["kv_usage"]),
            ("gpu_cache_usage_perc", "KV-cache usage, the fraction of pages in use (vLLM's older name).",
             snap["kv_usage"]),
        ):
            yield gauge(name, doc, value, prefix=GATEWAY_PREFIX)
        info = GaugeMetricFamily(GATEWAY_PREFIX + "cache_config_info",
                                 "The KV cache's page size (block_size) and page count (num_gpu_blocks), as labels.",
                                 labels=labels + ["block_size", "num_gpu_blocks"])
        info.add_metric(values + [str(page_size), str(num_pages)], 1.0)
        yield info


class ServerMetrics:
    """The metrics of one server. `observe_finished` / `on_call_end` / `rejected` feed it; `registry` holds it."""

    def __init__(self, engine, model_name: str = "", active_calls=None):
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        self.label_names = ["model_name"]
        self.label_values = [model_name]
        self.active_calls = active_calls or (lambda: 0)
        self._lock = threading.Lock()
        self._pending: deque = deque()  # streams of ended calls whose request has not finished yet
        self._http = None
        self._http_thread = None
        r, ln = self.registry, self.label_names
        r.register(_FlushPending(self))

        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.", ln + ["finished_reason"], registry=r)
        self.rejected_total = Counter(
            PREFIX + "grpc_requests_rejected", "Generate calls refused before reaching the engine, by reason.",
            ln + ["reason"], registry=r)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests (cached ones included).", ln, registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated by finished requests.", ln, registry=r)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first output token.", ln,
            buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first, one observation per request.", ln,
            buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Each gap between consecutive output tokens.", ln,
            buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the end of the request.", ln,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(
            PREFIX + "request_queue_time_seconds", "Time a request waited before it was first scheduled.", ln,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram(
            PREFIX + "request_prefill_time_seconds", "Time from first scheduled to the first output token.", ln,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram(
            PREFIX + "request_decode_time_seconds", "Time from the first output token to the last.", ln,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self.request_success.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self.rejected_total.labels(model_name, reason)
        self.registry.register(_EngineCollector(self))
        self.registry.register(RooflineCollector(lambda: engine.stats.roofline, PREFIX, self.label_names,
                                                 self.label_values))

    # -- feeding -------------------------------------------------------------

    def observe_finished(self, output) -> None:
        """Record one finished request from its `RequestOutput` (finish reason, usage, `RequestMetrics`)."""
        v = self.label_values
        reason = output.outputs[0].finish_reason or "error"
        m = output.metrics
        self.request_success.labels(*v, reason).inc()
        self.prompt_tokens.labels(*v).inc(output.usage["prompt_tokens"])
        self.generation_tokens.labels(*v).inc(output.usage["completion_tokens"])
        if m is None:
            return
        for hist, value in ((self.ttft, m.ttft_s), (self.tpot, m.tpot_s), (self.e2e, m.e2e_s),
                            (self.queue, m.queue_s), (self.prefill, m.prefill_s)):
            if value is not None:
                hist.labels(*v).observe(max(0.0, value))
        if m.first_token_time is not None and m.token_times:
            self.decode.labels(*v).observe(max(0.0, m.token_times[-1] - m.first_token_time))
        itl = self.itl.labels(*v)
        for gap in m.itl_s:
            itl.observe(max(0.0, gap))

    def on_call_end(self, stream) -> None:
        """A Generate call ended: record its request now if it finished, else once the engine finishes it."""
        with self._lock:
            if stream.output is None:
                if len(self._pending) >= PENDING_LIMIT:
                    self._pending.popleft()
                self._pending.append(stream)
                return
        self.observe_finished(stream.output)
        self.flush_pending()

    def flush_pending(self) -> None:
        """Record the requests of ended calls that the engine has finished since."""
        with self._lock:
            done = [s for s in self._pending if s.output is not None]
            if not done:
                return
            self._pending = deque(s for s in self._pending if s.output is None)
        for s in done:
            self.observe_finished(s.output)

    def rejected(self, reason: str) -> None:
        self.rejected_total.labels(*self.label_values, reason).inc()

    # -- exposition --------------------------------------------------------------

    def start_http(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve the text exposition at ``http://host:port/metrics`` from a daemon thread; returns the port."""
        host = host.strip("[]")
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    @property
    def port(self) -> Optional[int]:
        return None if self._http is None else self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def exposition(self) -> bytes:
        """The current text exposition (what a scrape returns)."""
        return generate_latest(self.registry)
