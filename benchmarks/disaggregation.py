"""Prefill/decode disaggregation against one engine: decode streams' inter-token latency while long prompts arrive,
the TTFT a KV transfer adds, and the transfer rate against the machine's copy bandwidth (issue 37).

    python -m benchmarks.disaggregation                     # SmolLM2-135M-Instruct, 1 round
    python -m benchmarks.disaggregation --quick             # a shorter window, fewer TTFT requests
    python -m benchmarks.disaggregation --rounds 3 --json disaggregation.json

(from the repository root: ``benchmarks/`` is not installed with jaxinfer; it needs jaxinfer, ``httpx`` and
``sglang-router``, a wheel: ``pip install sglang-router``).

Two systems, each started fresh in every round (the order flipped each round), every server compiling or
loading its programs before it is ready (``--warmup``), all on loopback:

* **pd**: a ``jaxinfer serve --disaggregation-mode prefill`` server pinned with ``taskset`` to core 0, a
  ``--disaggregation-mode decode`` server pinned to core 1, and ``python -m sglang_router.launch_router
  --pd-disaggregation --prefill P BOOTSTRAP --decode D`` in front of them;
* **single**: one ``jaxinfer serve`` given both cores (``taskset -c 0-1``) behind the same router in its
  plain mode (``--policy round_robin --worker-urls``), so both go through the same extra hop.

The router and this client are not pinned. In each system, after a few warm-up requests of every shape:

1. **TTFT** (``--ttft-requests`` each, one at a time, a different prompt each so nothing is a prefix hit):
   streamed completions of 128 and 2,000 prompt tokens asking 2 tokens; the client's time to the first
   streamed token, medians. The difference pd - single is what the split adds: the KV transfer, the
   router's second request, and one core for the prompt instead of two. For pd the decode server
   logs each pull at DEBUG (``KV transfer ROOM/I: N tokens, B bytes in X ms``, the time from the pull's
   start to its buffers being ready; this benchmark starts it with jaxinfer's logger at DEBUG, the only
   way to read one transfer's time: /metrics has the bytes, ``jaxinfer:kv_transfer_bytes_total``, but not
   the seconds, and the stats line's cumulative GB/s has two decimals): the **transfer rate** of a size
   is its transfers' bytes over their seconds (also shown for the long prompts pulled under load). The goal
   compares the 2,000-token rate with this machine's **copy bandwidth**
   (a numpy copy of a 256 MB array, bytes copied per second, best of 5, measured before any server starts).
2. **ITL under arriving prompts**: ``--streams`` streamed completions (short prompts, ``ignore_eos``,
   ``max_tokens`` to fill the context) start; once every one has its first token, a ``--window`` seconds
   window opens, during which a fresh ``--long-tokens``-token prompt asking ``--long-max-tokens`` tokens
   arrives every ``--every`` seconds (open loop, whether the last one is done or not). The client stamps the
   arrival of every streamed chunk of the decode streams (``httpx``, as each SSE line arrives); the gaps
   between consecutive chunks of a stream that overlap the window are its inter-token latencies: p50, p99
   and the worst, over all streams. The streams are closed a few seconds after the window (the client
   walking away aborts them). Also shown: the decode streams' tokens per second in the window, and how
   many long prompts finished and their TTFT.

Goals (the issue's): pd's ITL p99 at most 0.5x the single engine's; the KV transfer rate at least 0.3x the
copy bandwidth. Figures, not a timed test: they move with the machine's load, printed beside them; the
client and the router share the two cores with the servers.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxinfer.stats import median, percentile
from jaxinfer.tools.harness import Bench, heading, load_line, machine_line, parser, run, settle, table, target, \
    targets_block

SYSTEMS = ("pd", "single")
TEXT = Path(__file__).parent / "texts" / "python_reference_execmodel_import.txt"
STREAM_TOPICS = ("the sea", "a city at night", "an old clock", "the first snow", "a long train journey",
                 "a library", "a mountain village", "a lost letter", "a lighthouse keeper", "a market day",
                 "a garden in spring", "a bridge", "a storm at sea", "a quiet street", "an empty theatre",
                 "a river crossing", "a desert road", "a winter forest", "a radio station", "a harbour")


# --------------------------------------------------------------------------- #
# Pure helpers
# --------------------------------------------------------------------------- #


def gaps_in_window(times, t0: float, t1: float) -> list:
    """The gaps (s) between consecutive arrival `times` (sorted) of one stream that overlap [t0, t1]: the
    later arrival after t0 and the earlier one before t1 (a stall that spans an edge of the window counts)."""
    return [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]


def itl_figures(streams, t0: float, t1: float) -> dict:
    """Inter-token latency over the window [t0, t1] of every stream's arrival times: p50, p99, the worst gap
    (ms), how many gaps, and the chunks that arrived inside the window per second."""
    gaps = [g for s in streams for g in gaps_in_window(s, t0, t1)]
    worst = max(((b - a, a - t0) for s in streams for a, b in zip(s, s[1:]) if b > t0 and a < t1), default=(0, 0))
    inside = sum(1 for s in streams for t in s if t0 <= t <= t1)
    return {"itl_p50_ms": 1e3 * percentile(gaps, 50) if gaps else None,
            "itl_p99_ms": 1e3 * percentile(gaps, 99) if gaps else None,
            "itl_max_ms": 1e3 * max(gaps) if gaps else None, "worst_gap_starts_s": worst[1], "gaps": len(gaps),
            "decode_chunks_per_s": inside / (t1 - t0) if t1 > t0 else None}


def transfers_logged(text: str) -> list:
    """The decode server's per-transfer debug lines (``KV transfer ROOM/I: N tokens, B bytes in X ms``) as
    (tokens, bytes, seconds), in order."""
    return [(int(n), int(nb), float(ms) / 1e3)
            for n, nb, ms in re.findall(r"KV transfer \S+: (\d+) tokens, (\d+) bytes in ([\d.]+) ms", text)]


def transfer_figures(transfers) -> dict:
    """Transfers' (tokens, bytes, seconds): how many, MB and ms each (medians), and the rate (GB/s: all their
    bytes over all their seconds); {} without any."""
    if not transfers:
        return {}
    return {"n": len(transfers), "mb": median([b for _, b, _ in transfers]) / 1e6,
            "ms": 1e3 * median([s for _, _, s in transfers]),
            "gbs": sum(b for _, b, _ in transfers) / sum(s for _, _, s in transfers) / 1e9}


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """This machine's copy bandwidth (GB/s): bytes a numpy copy of an `nbytes` array moves per second, best
    of `repeats`."""
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best / 1e9


# --------------------------------------------------------------------------- #
# Processes
# --------------------------------------------------------------------------- #


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose output goes to a temporary file (read at any time, never a full pipe)."""

    def __init__(self, argv, name: str):
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"disagg_{name}_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return re.sub(r"\x1b\[[0-9;]*m", "", f.read())

    def wait_for(self, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.output()[-2000:]}")
            try:
                if ready():
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready in {timeout:.0f} s:\n{self.output()[-2000:]}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def pinned(cores: str, argv: list) -> list:
    return ["taskset", "-c", cores, *argv] if shutil.which("taskset") else argv


class Server:
    """``jaxinfer serve`` on a free HTTP port, pinned to `cores`."""

    def __init__(self, a, cores: str, name: str, role=(), debug: bool = False):
        import httpx

        self.url = f"http://127.0.0.1:{free_port()}"
        # the decode side logs each pull's bytes and milliseconds at DEBUG: this raises jaxinfer's logger to it
        entry = ["-c", "import logging, sys; logging.getLogger('jaxinfer').setLevel(logging.DEBUG); "
                       "from jaxinfer.cli.main import main; sys.exit(main(sys.argv[1:]))"] if debug else ["-m", "jaxinfer"]
        argv = [sys.executable, *entry, "serve", "--model", a.model, "--engine-config", a.engine_config,
                "--port", "0", "--http-port", self.url.rsplit(":", 1)[1], "--max-model-len", str(a.max_model_len),
                "--num-pages", str(a.num_pages), "--log-stats-interval", "0", "--warmup", *role, *a.serve_arg]
        self.p = Proc(pinned(cores, argv), name)
        self.ready = lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200

    def metrics(self) -> dict:
        import httpx

        out: dict = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out


class Router:
    def __init__(self, args: list, n: int):
        import httpx

        self.url = f"http://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                self.url.rsplit(":", 1)[1], "--prometheus-port", str(free_port()), "--log-level", "warn", *args]
        self.p = Proc(argv, "router")

        def ready():
            ws = httpx.get(self.url + "/workers", timeout=2).json().get("workers", [])
            return len(ws) == n and all(w.get("is_healthy") for w in ws)

        self.ready = ready


# --------------------------------------------------------------------------- #
# Requests
# --------------------------------------------------------------------------- #


class Prompts:
    """Prompts of an exact token count (cut from `TEXT` at a random place, opened by a unique tag so no two
    share a prefix page), made with the served model's tokenizer."""

    def __init__(self, model: str, seed: int):
        from jaxinfer.loading.model_cache import load_tokenizer
        from jaxinfer.loading.weights import resolve_model

        self.tok = load_tokenizer(resolve_model(model))
        self.words = TEXT.read_text().split()
        self.rng = random.Random(seed)
        self.n = 0

    def make(self, tokens: int) -> str:
        self.n += 1
        start = self.rng.randrange(len(self.words))
        words = (self.words[start:] + self.words[:start]) * 2
        text = f"Request {self.n}-{self.rng.randrange(10 ** 6)}. " + " ".join(words[:tokens])
        ids = self.tok.encode(text)
        return self.tok.decode(ids[:tokens])

    def stream_prompt(self, i: int) -> str:
        return f"Stream {i}: write a very long story about {STREAM_TOPICS[i % len(STREAM_TOPICS)]}, chapter after chapter."


def complete(client, model: str, prompt: str, max_tokens: int, stop=None, times=None, ignore_eos=False) -> dict:
    """One streamed completion; stamps each chunk's arrival into `times` (perf_counter), stops reading (closing
    the connection) once `stop` is set. {"ttft": s or None, "chunks": n, "finish": reason or None, "error": the
    first error event's text or None}."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    times = [] if times is None else times
    finish = error = None
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("error") and error is None:
                error = str(event["error"])[:300]
            choices = event.get("choices") or []
            if choices and (choices[0].get("text") or not choices[0].get("finish_reason")):
                times.append(now)
            if choices and choices[0].get("finish_reason"):
                finish = choices[0]["finish_reason"]
            if stop is not None and stop.is_set():
                break
    return {"ttft": times[0] - t0 if times else None, "chunks": len(times), "finish": finish, "error": error}


# --------------------------------------------------------------------------- #
# One system
# --------------------------------------------------------------------------- #


def start_system(b: Bench, name: str) -> tuple:
    """(servers by role, router, the decode-side server whose counters show transfers or None)."""
    a = b.args
    servers: dict = {}
    router = None
    try:
        if name == "pd":
            boot = free_port()
            wait = ["--disaggregation-timeout", str(a.transfer_timeout)]
            servers["prefill"] = Server(a, "0", "prefill", ["--disaggregation-mode", "prefill",
                                                            "--disaggregation-bootstrap-port", str(boot), *wait])
            servers["decode"] = Server(a, "1", "decode", ["--disaggregation-mode", "decode", *wait], debug=True)
            for s in servers.values():
                s.p.wait_for(s.ready, a.start_timeout)
            router = Router(["--pd-disaggregation", "--prefill", servers["prefill"].url, str(boot),
                             "--decode", servers["decode"].url], 2)
        else:
            servers["single"] = Server(a, "0-1", "single")
            servers["single"].p.wait_for(servers["single"].ready, a.start_timeout)
            router = Router(["--policy", "round_robin", "--worker-urls", servers["single"].url], 1)
        router.p.wait_for(router.ready, 120)
    except BaseException:
        stop_system(servers, router)
        raise
    return servers, router


def stop_system(servers: dict, router) -> None:
    if router is not None:
        router.p.stop()
    for s in servers.values():
        s.p.stop()


def one_system(b: Bench, name: str, r: int) -> dict:
    import httpx

    a = b.args
    prompts = Prompts(a.model, seed=1000 * r + (1 if name == "pd" else 2))
    servers, router = start_system(b, name)
    decode = servers.get("decode")
    f: dict = {}
    try:
        client = httpx.Client(base_url=router.url, timeout=httpx.Timeout(600, connect=10),
                              limits=httpx.Limits(max_connections=a.streams + 64))
        model = client.get("/v1/models").json()["data"][0]["id"]
        for n in (128, a.long_tokens, 128, a.long_tokens):  # warm-up through the router
            complete(client, model, prompts.make(n), 4)
        with ThreadPoolExecutor(a.streams) as pool:  # and a decode batch of the measured size
            list(pool.map(lambda i: complete(client, model, prompts.stream_prompt(i), 16), range(a.streams)))

        # 1. TTFT one request at a time, and the transfer rate of each size
        logged = lambda: transfers_logged(decode.p.output()) if decode else []  # noqa: E731
        seen = len(logged())
        for n in (128, a.long_tokens):
            ttfts = [complete(client, model, prompts.make(n), 2)["ttft"] for _ in range(a.ttft_requests)]
            f[f"ttft_{n}_ms"] = 1e3 * median(ttfts)
            if decode:
                now = logged()
                f.update({f"transfer_{n}_{k}": v for k, v in transfer_figures(now[seen:]).items()})
                seen = len(now)

        # 2. decode streams while long prompts keep arriving
        decoder = decode or servers["single"]
        preempted = decoder.metrics().get("jaxinfer:num_preemptions_total", 0)
        stop, times = threading.Event(), [[] for _ in range(a.streams)]
        budget = a.max_model_len - 64
        pool = ThreadPoolExecutor(a.streams + 64)
        streams = [pool.submit(complete, client, model, prompts.stream_prompt(i), budget, stop, times[i], True)
                   for i in range(a.streams)]
        deadline = time.monotonic() + 300
        while not all(times) and time.monotonic() < deadline:
            if any(s.done() for s in streams):
                for s in streams:
                    if s.done():
                        s.result()  # raises what failed
            time.sleep(0.05)
        time.sleep(a.settle_s)
        t0 = time.perf_counter()
        longs = []
        k = 0
        while time.perf_counter() - t0 < a.window:
            longs.append(pool.submit(complete, client, model, prompts.make(a.long_tokens), a.long_max_tokens))
            k += 1
            time.sleep(max(0.0, t0 + k * a.every - time.perf_counter()))
        t1 = t0 + a.window
        time.sleep(max(0.0, t1 - time.perf_counter()) + a.tail_s)
        stop.set()
        ended = [s.result(timeout=120) for s in streams]
        done = [x.result(timeout=600) for x in longs]
        pool.shutdown()
        client.close()
        f.update(itl_figures(times, t0, t1))
        f["preemptions"] = int(decoder.metrics().get("jaxinfer:num_preemptions_total", 0) - preempted)
        f["streams_ended_early"] = sum(1 for e in ended if e["finish"] is not None)
        f["long_prompts"] = len(longs)
        ok = [d for d in done if d["finish"] in ("length", "stop") and not d["error"] and d["ttft"] is not None]
        f["long_failed"] = len(done) - len(ok)
        if len(ok) < len(done):
            b.log(f"{name}: {len(done) - len(ok)} long prompts failed, e.g. "
                  f"{next(d for d in done if d not in ok)}")
        f["long_ttft_p50_ms"] = 1e3 * median([d["ttft"] for d in ok]) if ok else None
        f["long_ttft_max_ms"] = 1e3 * max(d["ttft"] for d in ok) if ok else None
        if decode:  # the long prompts' transfers, pulled while the decode server decoded the streams
            now = logged()
            f.update({f"transfer_load_{k}": v for k, v in
                      transfer_figures([t for t in now[seen:] if t[0] >= 0.9 * a.long_tokens]).items()})
            f["decode_transfers_failed"] = int(decode.metrics().get("jaxinfer:kv_transfers_failed_total", 0))
            f["prefill_transfers_expired"] = int(servers["prefill"].metrics().get(
                "jaxinfer:kv_transfers_expired_total", 0))
            if decode.metrics().get("jaxinfer:kv_transfers_total", 0) != len(now):
                b.log("the decode server logged fewer transfers than its counter shows")
    finally:
        stop_system(servers, router)
    b.log(f"round {r + 1} {name:<6}: ITL p50 {f['itl_p50_ms']:.0f} p99 {f['itl_p99_ms']:.0f} worst "
          f"{f['itl_max_ms']:.0f} ms ({f['gaps']} gaps, {f['decode_chunks_per_s']:.1f} chunks/s), "
          f"{f['long_prompts']} long prompts ({f['long_failed']} failed) TTFT p50 {f['long_ttft_p50_ms'] or 0:.0f} ms; "
          f"TTFT 128 "
          f"{f['ttft_128_ms']:.0f} ms, {a.long_tokens} {f[f'ttft_{a.long_tokens}_ms']:.0f} ms"
          + (f"; transfer {f.get(f'transfer_{a.long_tokens}_gbs') or 0:.2f} GB/s" if name == "pd" else "")
          + f"  ({load_line()})")
    return f


# --------------------------------------------------------------------------- #
# The run
# --------------------------------------------------------------------------- #


def measure(b: Bench) -> None:
    import importlib.util

    a, res = b.args, b.figures
    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit("sglang-router is not installed: pip install sglang-router")
    b.log("measuring the copy bandwidth")
    res.update(model=a.model, engine_config=a.engine_config, cpu=machine_line(res["system"]), streams=a.streams,
               window_s=a.window, every_s=a.every, long_tokens=a.long_tokens, long_max_tokens=a.long_max_tokens,
               ttft_requests=a.ttft_requests, max_model_len=a.max_model_len, num_pages=a.num_pages,
               cores=os.cpu_count(), copy_gbs=copy_bandwidth())
    b.log(f"copy bandwidth {res['copy_gbs']:.1f} GB/s")
    res["rounds"] = figures = b.rounds({s: lambda r, s=s: one_system(b, s, r) for s in SYSTEMS})
    keys = sorted({k for fs in figures.values() for f in fs for k, v in f.items() if isinstance(v, (int, float))})
    res["median"] = med = {s: {k: median([f.get(k) for f in fs]) for k in keys} for s, fs in figures.items()}
    pd, single = med["pd"], med["single"]
    ratio = pd["itl_p99_ms"] / single["itl_p99_ms"] if single.get("itl_p99_ms") else None
    rate = pd.get(f"transfer_{a.long_tokens}_gbs")
    res["itl_p99_ratio"], res["transfer_vs_copy"] = ratio, rate / res["copy_gbs"] if rate else None
    res["targets"] = [
        target("pd ITL p99 <= 0.5x the single engine's", None if ratio is None else ratio <= 0.5,
               "-" if ratio is None else f"{pd['itl_p99_ms']:.0f} ms vs {single['itl_p99_ms']:.0f} ms: {ratio:.2f}x"),
        target(f"KV transfer rate ({a.long_tokens} tokens) >= 0.3x the copy bandwidth",
               None if rate is None else res["transfer_vs_copy"] >= 0.3,
               "-" if rate is None else f"{rate:.2f} GB/s vs {res['copy_gbs']:.1f} GB/s: "
                                        f"{res['transfer_vs_copy']:.2f}x")]


def report(res: dict) -> str:
    med, n = res["median"], len(res["rounds"]["pd"])
    L = res["long_tokens"]

    def cell(s, k, spec):
        v = med[s].get(k)
        return "-" if v is None else format(v, spec)

    rows = [(f"decode streams' ITL p50 (ms)", "itl_p50_ms", ".1f"), ("ITL p99 (ms)", "itl_p99_ms", ".1f"),
            ("worst gap (ms)", "itl_max_ms", ".0f"), ("... it began (s into the window)", "worst_gap_starts_s", ".1f"),
            ("preemptions on the decoding server", "preemptions", ".0f"), ("decode chunks/s in the window", "decode_chunks_per_s", ".1f"),
            ("streams that ended before the window did", "streams_ended_early", ".0f"),
            ("long prompts arrived", "long_prompts", ".0f"), ("long prompts failed", "long_failed", ".0f"),
            (f"their TTFT under load, p50 (ms)", "long_ttft_p50_ms", ".0f"),
            (f"their TTFT under load, worst (ms)", "long_ttft_max_ms", ".0f"),
            ("TTFT alone, 128 tokens, p50 (ms)", "ttft_128_ms", ".0f"),
            (f"TTFT alone, {L} tokens, p50 (ms)", f"ttft_{L}_ms", ".0f")]
    added = [f"TTFT added by the split (pd - single): " + ", ".join(
        f"{t} tokens {med['pd'][f'ttft_{t}_ms'] - med['single'][f'ttft_{t}_ms']:+.0f} ms" for t in (128, L))]
    xfer = [f"KV transfer (the decode server's log of each pull), {what}: "
            f"{cell('pd', f'transfer_{t}_mb', '.1f')} MB in {cell('pd', f'transfer_{t}_ms', '.1f')} ms each (median), "
            f"{cell('pd', f'transfer_{t}_gbs', '.3f')} GB/s"
            for t, what in ((128, "128 tokens alone"), (L, f"{L} tokens alone"), ("load", f"{L} tokens under load"))]
    H = heading(f"Prefill/decode disaggregation against one engine — {res['model']}, engine {res['engine_config']}, "
                f"max-model-len {res['max_model_len']}, {res['num_pages']} KV pages; pd: prefill server on core 0, "
                f"decode server on core 1, launch_router --pd-disaggregation; single: one server on cores 0-1 "
                f"behind launch_router's plain mode; {res['streams']} decode streams while a {L}-token prompt "
                f"({res['long_max_tokens']} tokens out) arrives every {res['every_s']:g} s for {res['window_s']:g} s",
                res["system"])
    return "\n".join(H + ["", table([f"medians of {n} rounds", "pd", "single"],
                                    [(label, cell("pd", k, spec), cell("single", k, spec)) for label, k, spec in rows]),
                          "", *added, *xfer, f"pd: decode requests whose transfer failed {cell('pd', 'decode_transfers_failed', '.0f')}, transfers the "
                          f"prefill server let expire {cell('pd', 'prefill_transfers_expired', '.0f')}",
                          f"copy bandwidth (numpy, 256 MB): {res['copy_gbs']:.1f} GB/s",
                          "", *targets_block(res["targets"])])


def main(argv=None) -> int:
    p = parser("python -m benchmarks.disaggregation", __doc__, rounds=1,
               quick="a 10 s window, 3 TTFT requests of each size")
    p.add_argument("--engine-config", default="cpu")
    p.add_argument("--streams", type=int, default=16, help="decode streams (default: 16)")
    p.add_argument("--window", type=float, default=None, help="seconds the ITL is measured over (default: 40, "
                   "--quick 10)")
    p.add_argument("--every", type=float, default=2.0, help="seconds between long prompts (default: 2)")
    p.add_argument("--long-tokens", type=int, default=2000, help="tokens of each long prompt (default: 2000)")
    p.add_argument("--long-max-tokens", type=int, default=4, help="tokens each long prompt asks (default: 4)")
    p.add_argument("--ttft-requests", type=int, default=None, help="requests of each size for the TTFT (default: 7, "
                   "--quick 3)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-pages", type=int, default=2048, help="KV pages of each server (default: 2048)")
    p.add_argument("--settle-s", type=float, default=2.0, help="seconds between the streams' first tokens and the "
                   "window (default: 2)")
    p.add_argument("--tail-s", type=float, default=3.0, help="seconds the streams run past the window (default: 3)")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    p.add_argument("--transfer-timeout", type=float, default=600.0,
                   help="pd servers' --disaggregation-timeout (default: 600; the servers' own default, 30 s, fails the "
                   "decode requests of long prompts queued longer than that on an overloaded prefill server)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every jaxinfer serve (repeat)")
    args = settle(p, p.parse_args(argv), quick={"window": (40.0, 10.0), "ttft_requests": (7, 3)},
                  at_least={"streams": 1, "ttft_requests": 1})
    return run(measure, report, args)


if __name__ == "__main__":
    sys.exit(main())
