"""Replicas behind sglang-router: cache-aware routing against round robin on a multi-turn chat workload (issue 37).

    python -m benchmarks.router_replicas                    # SmolLM2-135M-Instruct, 2 replicas, 1 round
    python -m benchmarks.router_replicas --quick            # 4 conversations of 3 turns
    python -m benchmarks.router_replicas --rounds 3 --json router_replicas.json

(from the repository root: ``benchmarks/`` is not installed with jaxinfer; it needs jaxinfer and
``sglang-router``, a wheel: ``pip install sglang-router``).

What it does, all on loopback, for each policy (``cache_aware``, ``round_robin``) in each round, the
order flipped each round:

1. starts ``--replicas`` fresh ``jaxinfer serve`` processes (so every policy starts from empty prefix
   caches), replica *i* pinned with ``taskset`` to core *i* (modulo the cores there are), each compiling
   or loading its programs before it is ready (``--warmup``), and ``python -m sglang_router.launch_router
   --policy POLICY --worker-urls ...`` in front of them (not pinned);
2. runs the workload through the router with the ``openai`` client: ``--conversations`` chats at once,
   each ``--turns`` turns long; a chat opens with a system prompt of its own (``--system-words`` words
   from ``benchmarks/texts``, a different passage each) and every turn, after a pause of ``--think-ms``
   on average, resends the whole history (the earlier questions and the model's own greedy answers,
   ``--max-tokens`` each) with one more question, streamed, so a replica that served the previous turn
   holds all but the last answer and the new question in its prefix cache;
3. reads each replica's prefix-cache counters (``jaxinfer:prefix_cache_queries`` / ``_hits``, prompt tokens
   in whole pages) before and after: the **prefix-hit rate** is hits over queries over all replicas; and
   the client's **TTFT** of every turn (to the first streamed token), reported for the turns after the
   first (where a hit is possible) and for all.

Each replica's KV cache (``--num-pages``) holds about its share of the chats' histories, not all of them:
KV memory is what cache-aware routing saves, since round robin ends up keeping a copy of every chat on
every replica. With room for everything (``--num-pages 0``: the preset's 1,024 pages) round robin still
hits whenever any earlier turn of the chat went to the same replica, which with 2 replicas and 4 turns is
most of the time.

Round robin sends a chat's next turn to whichever replica is next, so about half of the later turns land
where their history is not cached; cache-aware routing matches the request's text against a tree of what
each replica has been sent and keeps a chat on its replica while the load is balanced. The goal (the
issue's): the cache-aware hit rate at least 1.5x round robin's. Figures, not a timed test: they move with
the machine's load, printed beside them.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxinfer.stats import median
from jaxinfer.tools.harness import Bench, heading, load_line, machine_line, parser, run, settle, table, target, \
    targets_block

POLICIES = ("cache_aware", "round_robin")
TEXT = Path(__file__).parent / "texts" / "python_reference_execmodel_import.txt"
QUESTIONS = ("Summarize that in one sentence.", "What is the key idea here?", "Give an example.",
             "Why does that matter?", "What would change if it were otherwise?", "Say it more simply.",
             "What is a common mistake about this?", "How would you test it?")


def _http(url: str, timeout: float = 10.0) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def start_replica(model: str, engine_config: str, core: int, extra=(), timeout: float = 1200.0):
    """``jaxinfer serve`` pinned to one core, free ports; (process, HTTP base URL) once it says it is ready."""
    cmd = [sys.executable, "-m", "jaxinfer", "serve", "--model", model, "--engine-config", engine_config,
           "--port", "0", "--http-port", "0", "--log-stats-interval", "0", "--warmup", *extra]
    if os.path.exists("/usr/bin/taskset") or os.path.exists("/bin/taskset"):
        cmd = ["taskset", "-c", str(core), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + timeout
    for line in proc.stdout:
        h = re.search(r"OpenAI-compatible API at (\S+?)/v1\b", line)
        if h and "- ready" in line:
            return proc, h.group(1)
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"replica {core} did not start: exit code {proc.poll()}")


def start_router(policy: str, urls: list, timeout: float = 120.0):
    """``launch_router --policy POLICY`` over `urls` on free ports; (process, base URL) once every worker is
    healthy in its ``/workers``."""
    import json
    import socket

    def free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = free()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free()), "--policy", policy, "--log-level", "warn", "--worker-urls", *urls]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited ({proc.returncode})")
        try:
            workers = json.loads(_http(url + "/workers", 2)).get("workers", [])
            if len(workers) == len(urls) and all(w.get("is_healthy") for w in workers):
                return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the router's workers never became healthy")


def stop(proc, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "request_success_total",
            "num_preemptions_total")


def prefix_counters(url: str) -> tuple:
    """(prefix-cache queries, hits, finished requests, preemptions) of one replica, from its /metrics."""
    got = dict.fromkeys(COUNTERS, 0.0)
    for line in _http(url + "/metrics").splitlines():
        m = re.match(r"^jaxinfer:(\w+?)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in got:
            got[m.group(1)] += float(m.group(3))
    return tuple(got[k] for k in COUNTERS)


def conversations(n: int, words: int, seed: int) -> list:
    """`n` system prompts: a different passage of the text each, `words` words long."""
    text = TEXT.read_text().split()
    rng = random.Random(seed)
    out = []
    for c in range(n):
        start = rng.randrange(0, max(1, len(text) - words))
        out.append(f"Conversation {c}. Read this and answer questions about it.\n\n"
                   + " ".join(text[start:start + words]))
    return out


def chat(client, model: str, system: str, turns: int, max_tokens: int, seed: int, think_s: float) -> list:
    """One conversation, turn after turn, a pause of 0 to 2x `think_s` before each; the TTFT (s) of each turn."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": system}]
    ttfts = []
    for _ in range(turns):
        time.sleep(rng.uniform(0, 2 * think_s))
        messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
        t0 = time.perf_counter()
        first, answer = None, ""
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - t0
                answer += chunk.choices[0].delta.content
        ttfts.append(first if first is not None else time.perf_counter() - t0)
        messages.append({"role": "assistant", "content": answer})
    return ttfts


def one_policy(b: Bench, policy: str, r: int) -> dict:
    a = b.args
    cores = os.cpu_count() or 1
    replicas, router = [], None
    try:
        for i in range(a.replicas):
            extra = [*(["--num-pages", str(a.num_pages)] if a.num_pages else []), *a.serve_arg]
            replicas.append(start_replica(a.model, a.engine_config, i % cores, extra))
        urls = [u for _, u in replicas]
        router, base = start_router(policy, urls)
        import openai

        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        before = [prefix_counters(u) for u in urls]
        systems = conversations(a.conversations, a.system_words, seed=1000 * r)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.conversations) as pool:
            futures = [pool.submit(chat, client, model, s, a.turns, a.max_tokens, 1000 * r + c, a.think_ms / 1e3)
                       for c, s in enumerate(systems)]
            ttfts = [f.result() for f in futures]
        took = time.perf_counter() - t0
        after = [prefix_counters(u) for u in urls]
    finally:
        if router is not None:
            stop(router)
        for p, _ in replicas:
            stop(p)
    queries = sum(x[0] - y[0] for x, y in zip(after, before))
    hits = sum(x[1] - y[1] for x, y in zip(after, before))
    later = [t for conv in ttfts for t in conv[1:]]
    every = [t for conv in ttfts for t in conv]
    f = {"hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits, "query_tokens": queries,
         "ttft_later_mean_ms": 1e3 * sum(later) / max(len(later), 1), "ttft_later_p50_ms": 1e3 * median(later),
         "ttft_all_p50_ms": 1e3 * median(every), "first_turn_p50_ms": 1e3 * median([c[0] for c in ttfts]),
         "requests_per_replica": [int(x[2] - y[2]) for x, y in zip(after, before)],
         "preemptions": int(sum(x[3] - y[3] for x, y in zip(after, before))), "duration_s": took}
    b.log(f"round {r + 1} {policy:<11}: prefix hits {f['hit_rate']:.3f} ({int(hits)} of {int(queries)} prompt "
          f"tokens), TTFT after the first turn mean {f['ttft_later_mean_ms']:.0f} ms p50 "
          f"{f['ttft_later_p50_ms']:.0f} ms, requests per replica {f['requests_per_replica']}, preemptions "
          f"{f['preemptions']}, {took:.1f} s  "
          f"({load_line()})")
    return f


def measure(b: Bench) -> None:
    a, res = b.args, b.figures
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit("sglang-router is not installed: pip install sglang-router")
    res.update(model=a.model, engine_config=a.engine_config, cpu=machine_line(res["system"]), replicas=a.replicas,
               conversations=a.conversations, turns=a.turns, system_words=a.system_words, max_tokens=a.max_tokens,
               think_ms=a.think_ms, num_pages=a.num_pages, cores=os.cpu_count())
    res["rounds"] = figures = b.rounds({p: lambda r, p=p: one_policy(b, p, r) for p in POLICIES})
    keys = ("hit_rate", "ttft_later_mean_ms", "ttft_later_p50_ms", "ttft_all_p50_ms", "first_turn_p50_ms")
    res["median"] = med = {p: {k: median([f[k] for f in fs]) for k in keys} for p, fs in figures.items()}
    ca, rr = med["cache_aware"], med["round_robin"]
    res["hit_ratio"] = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
    res["targets"] = [target("cache-aware prefix-hit rate >= 1.5x round robin's", res["hit_ratio"] >= 1.5,
                             f"{res['hit_ratio']:.2f}x")]


def report(res: dict) -> str:
    med = res["median"]
    rows = [("prefix-hit rate (prompt tokens)", "hit_rate", ".3f"),
            ("TTFT after the first turn, mean (ms)", "ttft_later_mean_ms", ".0f"),
            ("TTFT after the first turn, p50 (ms)", "ttft_later_p50_ms", ".0f"),
            ("TTFT of the first turns, p50 (ms)", "first_turn_p50_ms", ".0f"),
            ("TTFT of every turn, p50 (ms)", "ttft_all_p50_ms", ".0f")]
    n = len(res["rounds"]["cache_aware"])
    spread = {p: ", ".join(f"{f['requests_per_replica']} ({f['preemptions']} preempted)" for f in fs)
              for p, fs in res["rounds"].items()}
    pages = res["num_pages"] or "the preset's"
    L = heading(f"{res['replicas']} replicas behind sglang-router, cache_aware against round_robin — {res['model']}, "
                f"engine {res['engine_config']}; {res['conversations']} chats at once x {res['turns']} turns, "
                f"system prompts of {res['system_words']} words, {res['max_tokens']} tokens an answer, pauses of "
                f"{res['think_ms']:.0f} ms on average; each replica "
                f"pinned to one of {res['cores']} cores, {pages} KV pages", res["system"])
    return "\n".join(L + ["", table([f"medians of {n} rounds", "cache_aware", "round_robin"],
                                    [(label, format(med["cache_aware"][k], spec), format(med["round_robin"][k], spec))
                                     for label, k, spec in rows]),
                          f"requests per replica (preemptions): cache_aware {spread['cache_aware']}; round_robin "
                          f"{spread['round_robin']}",
                          "", *targets_block(res["targets"])])


def main(argv=None) -> int:
    p = parser("python -m benchmarks.router_replicas", __doc__, rounds=1,
               quick="4 conversations of 3 turns")
    p.add_argument("--engine-config", default="cpu")
    p.add_argument("--replicas", type=int, default=2, help="jaxinfer serve processes (default: 2)")
    p.add_argument("--conversations", type=int, default=None, help="chats at once (default: 8, --quick 4)")
    p.add_argument("--turns", type=int, default=None, help="turns of each chat (default: 4, --quick 3)")
    p.add_argument("--system-words", type=int, default=300, help="words of each chat's system prompt (default: 300)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens of each answer (default: 16)")
    p.add_argument("--think-ms", type=float, default=300.0,
                   help="a user's mean pause before each turn, uniform in [0, 2x] (default: 300): chats that do not "
                   "move in lockstep (in lockstep, round robin over an even number of chats keeps each on one "
                   "replica by accident)")
    p.add_argument("--num-pages", type=int, default=192,
                   help="KV pages of each replica, page 0 reserved (default: 192, about 3/4 of what all the chats' "
                   "histories take with the defaults: a replica holds its share of them, not all; 0: the preset's)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for jaxinfer serve (repeat)")
    args = settle(p, p.parse_args(argv), quick={"conversations": (8, 4), "turns": (4, 3)},
                  at_least={"replicas": 1, "conversations": 1, "turns": 2})
    return run(measure, report, args)


if __name__ == "__main__":
    sys.exit(main())
