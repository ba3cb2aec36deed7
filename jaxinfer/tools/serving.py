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
  `RequestMetrics`; `GrpcBackend` sends each request to a ``jaxinfer serve``
  and times the streamed messages as they arrive at the client (the view a
  user has), keeping the server's own timings alongside;
* the **driver** (`run_benchmark`): paces arrivals, caps concurrency, samples
  engine gauges, and returns a `BenchmarkResult`;
* the **report** (`summarize`, `format_table`): throughputs and
  mean / median / p90 / p99 of every latency (`jaxinfer.stats.describe`),
  as a table or JSON.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from jaxinfer.metrics import ROOFLINE_KINDS
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.stats import describe

# Random prompt ids stay this far from both ends of the vocabulary: special and
# control tokens live there in most tokenizers.
SPECIAL_TOKEN_MARGIN = 100


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
    server: Optional[dict] = None  # the server's own timings of the request (seconds), when it reports them

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
            **({"server_ms": {k: ms(v) for k, v in self.server.items()}} if self.server else {}),
        }


class Backend:
    """Sends requests somewhere and measures them. Subclass for each transport.

    `run_one` must not raise for a failed request: it returns a result with
    ``ok=False`` and the error, so one failure does not stop the run.
    """

    name = "backend"

    async def open(self) -> None:
        """Called in the benchmark's event loop before the first request (connect, start polling)."""

    async def close(self) -> None:
        """Called in the benchmark's event loop after the last request."""

    async def refresh(self) -> None:
        """Bring `counters` up to date (called just before and after the measured run)."""

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
            "preemptions": e.scheduler.num_preemptions,
            "prefix_queries": e.allocator.queries,
            "prefix_hits": e.allocator.hits,
            "engine_steps": e.stats.steps,
            **({"spec_drafts": e.speculator.stats.num_drafts, "spec_draft_tokens": e.speculator.stats.num_draft_tokens,
                "spec_accepted_tokens": e.speculator.stats.num_accepted_tokens} if e.speculator is not None else {}),
            # each step program against its physical floor (`jaxinfer.engine.roofline`), by kind
            **{f"roofline_{k}_{f}": getattr(h, f) for k, h in e.stats.roofline.items()
               for f in ("count", "measured_s", "floor_s")},
        }

    def gauges(self) -> dict:
        e = self.llm.engine
        return {
            "kv_usage": e.allocator.usage(),
            "running": e.scheduler.num_running,
            "waiting": e.scheduler.num_waiting,
        }


# Server timings kept per request: the names of the final message's Timings fields.
_SERVER_TIMINGS = ("queue_s", "prefill_s", "ttft_s", "tpot_s", "itl_mean_s", "itl_p99_s", "e2e_s")


class GrpcBackend(Backend):
    """A running ``jaxinfer serve``, reached with the asyncio client (`jaxinfer.server.client.AsyncClient`).

    Prompts go as token ids. TTFT, ITL, TPOT and end-to-end are measured on the
    client, from the send to each streamed message's arrival, so they include
    the network, (de)serialization and the server's own queueing: the honest
    view of a user. A message carrying several tokens is one gap, as in vLLM's
    ``bench serve``. The server's own timings (from the final message) are
    kept in `RequestResult.server`. Engine counters and gauges come from
    ``GetModelInfo``, polled every `poll_interval` seconds.
    """

    name = "grpc"

    def __init__(self, target: str, token: Optional[str] = None, tls_ca: Optional[str] = None,
                 timeout: Optional[float] = None, poll_interval: float = 0.5):
        self.target = target
        self.token = token
        self.tls_ca = tls_ca
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.client = None
        self._stats: dict = {}
        self._poller: Optional[asyncio.Task] = None

    async def open(self) -> None:
        from jaxinfer.server.client import AsyncClient

        self.client = AsyncClient(self.target, token=self.token, tls_ca=self.tls_ca)
        await self.refresh()
        self._poller = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
            self._poller = None
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def refresh(self) -> None:
        info = await self.client.model_info(timeout=30.0)
        self._stats = info.get("stats") or {}

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a missed sample is not a failed run
                pass

    async def run_one(self, prompt_ids: list, params: SamplingParams) -> RequestResult:
        from jaxinfer.server.client import ServerError

        n_out = params.max_tokens or 0
        kw = dict(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos, temperature=params.temperature,
                  seed=params.seed)
        times: list = []
        n_tokens = 0
        final = None
        arrival = time.perf_counter()
        try:
            async for piece in self.client.generate(list(prompt_ids), timeout=self.timeout, **kw):
                now = time.perf_counter()
                if piece.token_ids:
                    times.append(now)
                    n_tokens += len(piece.token_ids)
                if piece.finished:
                    final = piece
        except ServerError as e:
            return RequestResult(False, len(prompt_ids), output_len=n_tokens, expected_output_len=n_out,
                                 arrival_time=arrival, error=f"{e.code.name}: {e.details}")
        except Exception as e:  # noqa: BLE001 - one failed request is a data point
            return RequestResult(False, len(prompt_ids), output_len=n_tokens, expected_output_len=n_out,
                                 arrival_time=arrival, error=f"{type(e).__name__}: {e}")
        end = time.perf_counter()
        reason = final.finish_reason if final is not None else None
        ok = reason not in (None, "abort", "error")
        timings = (final.timings or {}) if final is not None else {}
        return RequestResult(
            ok=ok,
            prompt_len=len(prompt_ids),
            output_len=n_tokens,
            expected_output_len=n_out,
            arrival_time=arrival,
            ttft_s=times[0] - arrival if times else None,
            tpot_s=(times[-1] - times[0]) / (n_tokens - 1) if n_tokens > 1 else None,
            itl_s=[b - a for a, b in zip(times, times[1:])],
            e2e_s=end - arrival,
            queue_s=timings.get("queue_s"),
            cached_tokens=(final.usage or {}).get("cached_tokens", 0) if final is not None else 0,
            error="" if ok else f"finished with {reason!r}",
            server={k: timings.get(k) for k in _SERVER_TIMINGS} if timings else None,
        )

    def counters(self) -> dict:
        s = self._stats
        if not s:
            return {}
        return {"preemptions": s.get("preemptions", 0), "engine_steps": s.get("steps", 0)}

    def gauges(self) -> dict:
        s = self._stats
        if not s:
            return {}
        return {"kv_usage": s.get("kv_usage"), "running": s.get("running"), "waiting": s.get("waiting")}


# --------------------------------------------------------------------------- #
# OpenAI-compatible servers (HTTP)
# --------------------------------------------------------------------------- #

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)

# Prometheus names of the engine figures the report shows, as jaxinfer, vLLM and llama.cpp's server
# expose them on /metrics (the first name found wins).
_METRIC_GAUGES = {
    "running": ("jaxinfer:num_requests_running", "vllm:num_requests_running", "llamacpp:requests_processing"),
    "waiting": ("jaxinfer:num_requests_waiting", "vllm:num_requests_waiting", "llamacpp:requests_deferred"),
    "kv_usage": ("jaxinfer:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "llamacpp:kv_cache_usage_ratio"),
}
_METRIC_COUNTERS = {
    "preemptions": ("jaxinfer:num_preemptions_total", "jaxinfer:num_preemptions", "vllm:num_preemptions_total"),
    # speculative decoding (a server that speculates)
    "spec_drafts": ("jaxinfer:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"),
    "spec_draft_tokens": ("jaxinfer:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
    "spec_accepted_tokens": ("jaxinfer:spec_decode_num_accepted_tokens_total",
                             "vllm:spec_decode_num_accepted_tokens_total"),
}


class OpenAIServerError(Exception):
    """An OpenAI-compatible server that cannot be benchmarked (unreachable, or it refused); one line."""


def openai_base_url(url: str) -> str:
    """``scheme://host[:port][/prefix]``, the form the endpoints are appended to.

    Accepts the OpenAI SDK's form too (ending in ``/v1``); ValueError for anything not http(s).
    """
    from urllib.parse import urlsplit

    text = (url or "").strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"--base-url must be an http:// or https:// URL such as http://127.0.0.1:8000, "
                         f"got {url!r}.")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in range
    except ValueError:
        raise ValueError(f"--base-url has a bad port: {url!r}.") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


def one_line_error(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def http_error_text(status: int, body: bytes) -> str:
    """``HTTP 400: <message>`` from an OpenAI error object (or vLLM's, llama.cpp's, FastAPI's shapes)."""
    message = None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            message = err.get("message")
        elif isinstance(err, str):
            message = err
        message = message or data.get("message") or data.get("detail")
    if not isinstance(message, str) or not message.strip():
        message = (body or b"").decode("utf-8", "replace").strip() or "(empty body)"
    return f"HTTP {status}: {one_line_error(message)}"


def auth_headers(api_key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _positive_int(x) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


def openai_server_info(client, base_url: str, model: Optional[str] = None) -> dict:
    """What ``GET /v1/models`` says: the model to benchmark (`model`, else the first listed) and, when the
    server reports them, its context length (``max_model_len``: vLLM, jaxinfer; ``meta.n_ctx``: llama.cpp's
    server, a slot's context) and vocabulary size
    (``vocab_size``: jaxinfer; ``meta.n_vocab``: llama.cpp's server). `client` is an ``httpx.Client``."""
    import httpx

    try:
        r = client.get("/v1/models")
    except httpx.HTTPError as e:
        raise OpenAIServerError(f"nothing answered at {base_url}: {one_line_error(f'{type(e).__name__}: {e}')}") from None
    if r.status_code != 200:
        raise OpenAIServerError(f"{base_url}/v1/models answered {http_error_text(r.status_code, r.content)}")
    try:
        entries = r.json()["data"]
        ids = [e["id"] for e in entries]
    except (ValueError, KeyError, TypeError):
        raise OpenAIServerError(f"{base_url}/v1/models did not answer an OpenAI model list: "
                                f"{one_line_error(r.text, 120)}") from None
    if not ids:
        raise OpenAIServerError(f"{base_url}/v1/models lists no model.")
    if model is None:
        entry = entries[0]
    elif model in ids:
        entry = entries[ids.index(model)]
    else:
        raise OpenAIServerError(f"the server at {base_url} serves {', '.join(map(repr, ids[:8]))}, not {model!r} "
                                "(--model).")
    meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
    return {
        "model": entry["id"],
        "models": ids,
        "owned_by": entry.get("owned_by"),
        "max_model_len": _positive_int(entry.get("max_model_len")) or _positive_int(meta.get("n_ctx")),
        "vocab_size": _positive_int(entry.get("vocab_size")) or _positive_int(meta.get("n_vocab")),
    }


def server_tokenize(client, model: str, text: str) -> list:
    """Token ids of `text` from the server's ``POST /tokenize`` (vLLM's and jaxinfer's body, and llama.cpp's)."""
    r = client.post("/tokenize", json={"model": model, "prompt": text, "content": text})
    if r.status_code != 200:
        raise OpenAIServerError(f"/tokenize answered {http_error_text(r.status_code, r.content)}")
    ids = r.json().get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise OpenAIServerError("/tokenize did not answer a list of token ids.")
    return ids


def server_detokenize(client, model: str, ids: list) -> str:
    """The text of `ids` from the server's ``POST /detokenize`` (vLLM's, jaxinfer's or llama.cpp's)."""
    r = client.post("/detokenize", json={"model": model, "tokens": list(ids)})
    if r.status_code != 200:
        raise OpenAIServerError(f"/detokenize answered {http_error_text(r.status_code, r.content)}")
    data = r.json()
    text = data.get("prompt", data.get("content"))
    if not isinstance(text, str):
        raise OpenAIServerError("/detokenize did not answer a text.")
    return text


def detokenize_vocab_size(client, model: str) -> Optional[int]:
    """The vocabulary size found by bisection on ``POST /detokenize``, for servers that refuse an id past
    their vocabulary with a 400 (jaxinfer's does); None when the server does not tell (vLLM's decodes any
    id, llama.cpp's has its size in /v1/models) or has no /detokenize. About 32 small requests."""

    def takes(i: int) -> Optional[bool]:
        r = client.post("/detokenize", json={"model": model, "tokens": [i]})
        return True if r.status_code == 200 else False if r.status_code == 400 else None

    lo, hi = 0, 2**31 - 1
    if takes(lo) is not True or takes(hi) is not False:
        return None
    while hi - lo > 1:  # takes(lo) and not takes(hi)
        mid = (lo + hi) // 2
        ok = takes(mid)
        if ok is None:
            return None
        lo, hi = (mid, hi) if ok else (lo, mid)
    return hi


def parse_prometheus(text: str, names) -> dict:
    """{name: value} of the samples named in `names`, summed over label sets (e.g. per model)."""
    out: dict = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = line.find("{")
        name = line[:end] if end >= 0 else line.split(" ", 1)[0]
        if name not in names:
            continue
        try:
            value = float(line.rsplit("}", 1)[-1].split()[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


class OpenAIBackend(Backend):
    """Any OpenAI-compatible server (jaxinfer's, vLLM's, llama.cpp's...) over HTTP, with httpx.

    Each request streams ``/v1/completions`` (``prompt`` as token ids, or as text when `texts` maps
    each prompt's ids to its text) or ``/v1/chat/completions`` (one user message of that text), with
    ``max_tokens``, ``temperature``, ``seed``, ``ignore_eos`` (vLLM's and jaxinfer's extension) and
    ``stream_options.include_usage``. Timed on the client, as `GrpcBackend` is: TTFT is the arrival of
    the first chunk carrying text, ITL the gaps between chunks carrying text, and the output token
    count the usage chunk's ``completion_tokens`` (the text chunks counted when the server sends no
    usage). Engine gauges and counters come from the server's Prometheus ``/metrics`` where it has one.
    """

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key: Optional[str] = None, endpoint: str = COMPLETIONS,
                 texts: Optional[dict] = None, timeout: Optional[float] = None, poll_interval: float = 0.5,
                 verify: Any = True):
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}.")
        if endpoint == CHAT_COMPLETIONS and texts is None:
            raise ValueError(f"{CHAT_COMPLETIONS} takes text: give the prompts' texts.")
        self.base_url = openai_base_url(base_url)
        self.model = model
        self.api_key = api_key
        self.endpoint = endpoint
        self.texts = texts  # {tuple(prompt ids): text}, or None to send the ids themselves
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.verify = verify
        self.client = None
        self._stats: dict = {}
        self._poller: Optional[asyncio.Task] = None
        self._has_metrics = True

    async def open(self) -> None:
        import httpx

        self.client = httpx.AsyncClient(
            base_url=self.base_url, headers=auth_headers(self.api_key), verify=self.verify,
            timeout=httpx.Timeout(connect=30.0, read=self.timeout or 600.0, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        await self.refresh()
        if self._has_metrics:
            self._poller = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
            self._poller = None
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def refresh(self) -> None:
        if not self._has_metrics or self.client is None:
            return
        import httpx

        names = {n for group in (_METRIC_GAUGES, _METRIC_COUNTERS) for ns in group.values() for n in ns}
        try:
            r = await self.client.get("/metrics")
        except httpx.HTTPError:
            return  # a missed sample is not a failed run
        if r.status_code != 200:
            self._has_metrics = False  # no Prometheus endpoint (or it needs what we lack): no engine figures
            return
        self._stats = parse_prometheus(r.text, names)

    async def _poll(self) -> None:
        while self._has_metrics:
            await asyncio.sleep(self.poll_interval)
            await self.refresh()

    def _pick(self, table: dict) -> dict:
        out = {}
        for key, names in table.items():
            for n in names:
                if n in self._stats:
                    out[key] = self._stats[n]
                    break
        return out

    def counters(self) -> dict:
        return self._pick(_METRIC_COUNTERS)

    def gauges(self) -> dict:
        return self._pick(_METRIC_GAUGES)

    def request_body(self, prompt_ids: list, params: SamplingParams) -> dict:
        body: dict[str, Any] = {"model": self.model, "max_tokens": params.max_tokens,
                                "temperature": params.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if params.ignore_eos:
            body["ignore_eos"] = True
        if params.seed is not None:
            body["seed"] = params.seed
        prompt = list(prompt_ids) if self.texts is None else self.texts[tuple(prompt_ids)]
        if self.endpoint == CHAT_COMPLETIONS:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def run_one(self, prompt_ids: list, params: SamplingParams) -> RequestResult:
        import httpx

        n_out = params.max_tokens or 0
        body = self.request_body(prompt_ids, params)
        chat = self.endpoint == CHAT_COMPLETIONS
        times: list = []
        usage: Optional[dict] = None
        finish = None
        error = ""
        arrival = time.perf_counter()
        try:
            async with self.client.stream("POST", self.endpoint, json=body) as r:
                if r.status_code != 200:
                    error = http_error_text(r.status_code, await r.aread())
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue  # blank separators, SSE comments and event names
                        now = time.perf_counter()
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if chunk.get("error"):
                            error = "error in the stream: " + http_error_text(r.status_code, data.encode())[9:]
                            break
                        for choice in chunk.get("choices") or ():
                            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                            if piece:
                                times.append(now)
                            finish = choice.get("finish_reason") or finish
                        if isinstance(chunk.get("usage"), dict):
                            usage = chunk["usage"]
        except httpx.HTTPError as e:
            error = one_line_error(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        except (ValueError, AttributeError) as e:  # a data line that is not a JSON chunk
            error = one_line_error(f"bad stream chunk: {e}")
        end = time.perf_counter()
        if not error and finish is None:
            error = "the stream ended without a finish_reason"
        n_tokens = usage.get("completion_tokens") if usage else None
        n_tokens = n_tokens if isinstance(n_tokens, int) else len(times)
        prompt_len = usage.get("prompt_tokens") if usage else None
        details = (usage or {}).get("prompt_tokens_details") or {}
        ok = not error and finish in ("stop", "length")
        return RequestResult(
            ok=ok,
            prompt_len=prompt_len if isinstance(prompt_len, int) else len(prompt_ids),
            output_len=n_tokens,
            expected_output_len=n_out,
            arrival_time=arrival,
            ttft_s=times[0] - arrival if times else None,
            tpot_s=(times[-1] - times[0]) / (n_tokens - 1) if len(times) > 1 and n_tokens > 1 else None,
            itl_s=[b - a for a, b in zip(times, times[1:])],
            e2e_s=end - arrival,
            cached_tokens=(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
            error=error or ("" if ok else f"finished with {finish!r}"),
        )


# --------------------------------------------------------------------------- #
# Progress
# --------------------------------------------------------------------------- #


class Progress:
    """Requests done so far, on a stream (stderr).

    On a terminal, one bar redrawn in place: ``bench [####....] 7/16 requests, 3.2s``.
    Anywhere else (a log file, a pipe, CI) no carriage returns: a plain line when the
    run starts, at most one every `every` seconds while it runs, and one when it ends.
    """

    def __init__(self, total: int, label: str = "bench", stream=None, enabled: bool = True, width: int = 30,
                 every: float = 10.0):
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.failed = 0
        self._t0 = time.perf_counter()
        self._last = -math.inf
        self.tty = _isatty(self.stream)
        self._every = 0.1 if self.tty else every
        self._closed = False
        if enabled and not self.tty:
            self._last = self._t0
            self.stream.write(f"{label}: {total} requests ...\n")
            self.stream.flush()

    def update(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        self.refresh(force=self.tty and self.done == self.total)  # a log gets the last count from close()

    def refresh(self, force: bool = False) -> None:
        """Redraw (the elapsed time moves even when no request finished), throttled."""
        now = time.perf_counter()
        if force or now - self._last >= self._every:
            self._last = now
            self._draw(now)

    def _text(self, now: float) -> str:
        fail = f", {self.failed} failed" if self.failed else ""
        return f"{self.done}/{self.total} requests{fail}, {now - self._t0:.1f}s"

    def _draw(self, now: float) -> None:
        if not self.enabled or self._closed:
            return
        if self.tty:
            filled = self.width * self.done // max(self.total, 1)
            self.stream.write(f"\r{self.label} [{'#' * filled:<{self.width}}] {self._text(now)}")
        else:
            self.stream.write(f"{self.label}: {self._text(now)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and not self._closed:
            if self.tty:
                self._draw(time.perf_counter())
                self.stream.write("\n")
            else:
                self.stream.write(f"{self.label}: {self._text(time.perf_counter())}, done\n")
            self.stream.flush()
        self._closed = True


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):  # no isatty, or a closed stream
        return False


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
    await backend.open()
    try:
        return await _run_measured(backend, workload, cfg, warmup)
    finally:
        await backend.close()


async def _run_measured(backend: Backend, workload: list, cfg: BenchConfig, warmup: Optional[list]) -> BenchmarkResult:
    if warmup:
        p = Progress(len(warmup), "warm-up", enabled=cfg.progress)
        await _run_all(backend, warmup, cfg, [0.0] * len(warmup), p)
        p.close()
    offsets = arrival_offsets(len(workload), cfg.request_rate, cfg.seed, cfg.burstiness)
    await backend.refresh()
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
    await backend.refresh()
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
    if c.get("spec_drafts"):  # speculative decoding: vLLM's acceptance rate and mean acceptance length
        engine["spec_acceptance_rate"] = c.get("spec_accepted_tokens", 0) / max(c.get("spec_draft_tokens", 0), 1)
        engine["spec_mean_acceptance_length"] = 1 + c.get("spec_accepted_tokens", 0) / c["spec_drafts"]
    if "kv_usage" in bench.peaks:
        engine["peak_kv_usage"] = bench.peaks["kv_usage"]
    if "running" in bench.peaks:
        engine["peak_running"] = bench.peaks["running"]
    if "waiting" in bench.peaks:
        engine["peak_waiting"] = bench.peaks["waiting"]
    for kind in ROOFLINE_KINDS:  # floor / measured time of the run's steps of each kind
        n, measured = c.get(f"roofline_{kind}_count", 0), c.get(f"roofline_{kind}_measured_s", 0.0)
        if n and measured > 0:
            floor = c[f"roofline_{kind}_floor_s"]
            engine[f"{kind}_step_roofline"] = {"fraction": floor / measured, "steps": n,
                                               "mean_step_ms": 1e3 * measured / n, "mean_floor_ms": 1e3 * floor / n}
    failed = [r for r in bench.results if not r.ok]
    server = [r.server for r in ok if r.server]
    extra: dict[str, Any] = {}
    if server:  # the server's own account, next to the client's
        extra["server_timings_ms"] = {
            k[:-2]: describe([t.get(k) for t in server], 1e3) for k in _SERVER_TIMINGS
        }
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
        **extra,
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
    for k, label in (("backend", "Backend"), ("server", "Server"), ("model", "Model")):
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
    st = s.get("server_timings_ms")
    if st:
        title("Server-reported (median / p99 ms)")
        for key, label in (("queue", "Queue"), ("prefill", "Prefill"), ("ttft", "TTFT"), ("tpot", "TPOT"),
                           ("itl_mean", "ITL (request mean)"), ("e2e", "E2EL")):
            d = st[key]
            med = "-" if d["median"] is None else f"{d['median']:.2f}"
            p99 = "-" if d["p99"] is None else f"{d['p99']:.2f}"
            rows.append(f"{label + ':':<{width - 24}}{med:>12}{p99:>12}")
    e = s["engine"]
    if e:
        title("Engine")
        if "preemptions" in e:
            row("Preemptions:", e["preemptions"])
        if "prefix_cache_hit_rate" in e:
            row("Prefix cache hit rate (%):", 100 * e["prefix_cache_hit_rate"])
        if "spec_acceptance_rate" in e:
            row("Draft acceptance rate (%):", 100 * e["spec_acceptance_rate"])
            row("Mean acceptance length:", e["spec_mean_acceptance_length"])
        if "peak_kv_usage" in e:
            row("Peak KV cache usage (%):", 100 * e["peak_kv_usage"])
        if "peak_running" in e:
            row("Peak running requests:", e["peak_running"])
        if "peak_waiting" in e:
            row("Peak waiting requests:", e["peak_waiting"])
        if "engine_steps" in e:
            row("Engine steps:", e["engine_steps"])
        for kind in ROOFLINE_KINDS:
            r = e.get(f"{kind}_step_roofline")
            if r:
                row(f"{kind.capitalize()} step floor/measured:", r["fraction"])
                row(f"  mean {kind} step / floor (ms):", f"{r['mean_step_ms']:.1f}/{r['mean_floor_ms']:.1f}")
    rows.append("=" * width)
    if s["errors"]:
        rows.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(rows)
