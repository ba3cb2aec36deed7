"""The server's figures for issue 4: a request-rate sweep over gRPC, and the server path vs the library path.

    python -m benchmarks.bench_figures                       # SmolLM2-135M-Instruct, CPU preset
    python -m benchmarks.bench_figures --rates 0.25,0.5,1,inf --num-prompts 16 --rounds 3 --json figs.json

(from the repository root: ``benchmarks/`` is not installed with jaxinfer; this one needs
no transformers, only jaxinfer and its server).

What it does, all on loopback:

1. starts ``jaxinfer serve --warmup`` as a subprocess (port picked by the OS; it
   compiles, or loads from the program cache, every program first) and loads
   the same model with the same engine preset in this process (the library
   path); a short warm-up run through each compiles (or loads from the
   program cache) the programs the measurements use;
2. **rate sweep**: ``--num-prompts`` requests of ``--input-len`` random
   prompt tokens and exactly ``--output-len`` output tokens, Poisson arrivals
   at each of ``--rates``, through `GrpcBackend` (latencies timed on the
   client); one line per rate: throughput, TTFT and ITL p50 / p99;
3. **overhead**: ``--streams`` requests sent all at once, through the library
   (`LibraryBackend`, in process) and through the server, alternately for
   ``--rounds`` rounds (the order flips each round); the medians of output
   tokens/s (`jaxinfer.stats.median`) and their ratio (server / library).

The machine line (CPU flags, jax) and the load average are printed before and
after each part: on a shared machine the figures move with the load.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time

from jaxinfer.stats import median
from jaxinfer.tools.harness import Bench, heading, load_average, parser, run, table


def start_server(model: str, engine_config: str, timeout: float = 1200.0, warmup: bool = True, http: bool = False,
                 extra=()):
    """``jaxinfer serve`` on 127.0.0.1, free ports; (process, "127.0.0.1:PORT", HTTP base URL or None) once ready.

    With ``warmup`` the server compiles (or loads from the program cache) every program
    before it is ready: requests that trickle in over gRPC reach prefill batch sizes that
    depend on timing, and a compile inside a measured round would be counted as server cost.
    With ``http`` it serves the OpenAI-compatible API too.
    """
    cmd = [sys.executable, "-m", "jaxinfer", "serve", "--model", model, "--engine-config", engine_config,
           "--port", "0", "--log-stats-interval", "0", "--warmup" if warmup else "--no-warmup", *extra]
    if http:
        cmd += ["--http-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + timeout
    for line in proc.stdout:
        m = re.search(r" on (\S+:\d+) .*- ready", line)
        h = re.search(r"OpenAI-compatible API at (\S+?)/v1\b", line)
        if m and (h or not http):
            return proc, m.group(1), h.group(1) if h else None
        if m or time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the server did not start{' with both protocols' if http else ''}: exit code {proc.poll()}")


def stop_server(proc, timeout: float = 30.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def measure(b: Bench) -> None:
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.compile_cache import enable_compilation_cache
    from jaxinfer.llm import LLM
    from jaxinfer.tools.serving import BenchConfig, GrpcBackend, LibraryBackend, run_benchmark, synthetic_workload

    a, res, log = b.args, b.figures, b.log
    enable_compilation_cache()
    proc, address, _ = start_server(a.model, a.engine_config, warmup=not a.no_server_warmup)
    log(f"server {address} ready")
    llm = LLM(a.model, engine_config=EngineConfig.preset(a.engine_config))
    res.update(model=llm.model_name, engine_config=a.engine_config, address=address, input_len=a.input_len,
               output_len=a.output_len, streams=a.streams, rounds=a.rounds, num_prompts=a.num_prompts)
    paths = {"library": LibraryBackend(llm), "server": GrpcBackend(address)}

    def work(n: int, seed: int, out: int = a.output_len):
        return synthetic_workload(n, (a.input_len,) * 2, (out,) * 2, llm.model_config.vocab_size, seed=seed)

    try:
        for name, backend in paths.items():  # the batch and page buckets of the runs below, through both paths
            log(f"warm-up through the {name}")
            run_benchmark(backend, work(a.warmup_requests, 999, 24), BenchConfig(progress=False))
        if not a.skip_sweep:
            res["sweep"] = [sweep_point(paths["server"], work(a.num_prompts, 100 + i), float(r), i, log)
                            for i, r in enumerate(a.rates.split(","))]
            res["system"]["loadavg_after_sweep"] = load_average()
        if not a.skip_overhead:
            tps = b.rounds({name: lambda r, backend=backend: throughput(backend, work(a.streams, 1000 + 11 * r), log)
                            for name, backend in paths.items()}, tag="overhead ")
            med = {k: median(v) for k, v in tps.items()}
            res["overhead"] = {"output_tok_s": tps, "median": med, "ratio": med["server"] / med["library"],
                               "per_round": [s / lib for s, lib in zip(tps["server"], tps["library"])]}
    finally:
        llm.close()
        stop_server(proc)


def sweep_point(backend, work, rate: float, seed: int, log) -> dict:
    """One rate of the sweep: its summary (`serving.summarize`) without the per-request records."""
    from jaxinfer.tools.serving import BenchConfig, run_benchmark, summarize

    log(f"sweep at {_rate_text(rate)} req/s")
    s = summarize(run_benchmark(backend, work, BenchConfig(request_rate=rate, seed=seed, progress=False)))
    s.pop("requests")
    return s


def throughput(backend, work, log) -> float:
    """All of `work` sent at once through `backend`; its output tokens/s."""
    from jaxinfer.tools.serving import BenchConfig, run_benchmark, summarize

    s = summarize(run_benchmark(backend, work, BenchConfig(progress=False)))
    log(f"  {s['output_throughput']:.1f} output tok/s, {s['completed']}/{len(work)} done in {s['duration_s']:.1f} s, "
        f"ITL p50 {s['itl_ms']['median']:.0f} ms")
    return s["output_throughput"]


def report(res: dict) -> str:
    L = heading(f"jaxinfer serve vs the library — {res['model']}, engine config {res['engine_config']}, "
                f"server {res['address']}", res["system"])
    if "sweep" in res:
        rows = [[_rate_text(float(s["config"]["request_rate"])), s["completed"], f"{s['duration_s']:.1f}",
                 f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                 *(f"{s[k][q]:.0f}" for k in ("ttft_ms", "itl_ms") for q in ("median", "p99")),
                 f"{s.get('server_timings_ms', {}).get('ttft', {}).get('median') or 0:.0f}"] for s in res["sweep"]]
        L += ["", f"rate sweep through the server: {res['num_prompts']} requests per rate, "
              f"{res['input_len']} prompt + {res['output_len']} output tokens (load after: "
              f"{res['system'].get('loadavg_after_sweep')})",
              table(["rate", "done", "dur s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                     "srv TTFT p50 (ms)"], rows)]
    o = res.get("overhead")
    if o:
        med = o["median"]
        L += ["", f"overhead: {res['streams']} streams at once, {res['input_len']} + {res['output_len']} tokens, "
              f"{res['rounds']} alternating rounds",
              f"median output tok/s: library {med['library']:.1f}, server {med['server']:.1f}; server / library = "
              f"{o['ratio']:.3f} (per round: {', '.join(f'{x:.3f}' for x in o['per_round'])}); target >= 0.90"]
    return "\n".join(L)


def main(argv=None) -> int:
    p = parser("python -m benchmarks.bench_figures", __doc__, rounds=3)
    p.add_argument("--engine-config", default="cpu")
    p.add_argument("--rates", default="0.125,0.25,0.5,1,inf", help="request rates of the sweep (req/s)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the overhead comparison")
    p.add_argument("--warmup-requests", type=int, default=32)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--no-server-warmup", action="store_true",
                   help="start the server without compiling every program first (then a round may pay for compiles)")
    p.add_argument("--skip-overhead", action="store_true")
    return run(measure, report, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
