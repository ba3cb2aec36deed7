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

import argparse
import math
import re
import subprocess
import sys
import time

from jaxinfer.tools.harness import load_line, machine_line


def _say(text: str) -> None:
    print(text, flush=True)


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


def main(argv=None) -> int:
    from jaxinfer.tools.serving import (
        BenchConfig, GrpcBackend, LibraryBackend, run_benchmark, summarize, synthetic_workload,
    )
    from jaxinfer.stats import median
    from jaxinfer.tools.harness import alternate, write_json

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_figures", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine-config", default="cpu")
    p.add_argument("--rates", default="0.125,0.25,0.5,1,inf", help="request rates of the sweep (req/s)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the overhead comparison")
    p.add_argument("--rounds", type=int, default=3, help="alternating library / server rounds")
    p.add_argument("--warmup-requests", type=int, default=32)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--no-server-warmup", action="store_true",
                   help="start the server without compiling every program first (then a round may pay for compiles)")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]

    from jaxinfer.engine.compile_cache import enable_compilation_cache
    from jaxinfer.config import EngineConfig
    from jaxinfer.llm import LLM

    enable_compilation_cache()
    t_start = time.time()
    _say(f"# {machine_line()}")
    proc, address, _ = start_server(args.model, args.engine_config, warmup=not args.no_server_warmup)
    _say(f"# server {address} ready after {time.time() - t_start:.0f} s")
    llm = LLM(args.model, engine_config=EngineConfig.preset(args.engine_config))
    vocab = llm.model_config.vocab_size
    lib, srv = LibraryBackend(llm), GrpcBackend(address)
    report: dict = {"model": llm.model_name, "engine_config": args.engine_config, "address": address,
                    "input_len": args.input_len, "output_len": args.output_len}
    io = (args.input_len, args.input_len)
    oo = (args.output_len, args.output_len)
    try:
        # warm-up: the batch and page buckets of the runs below, through both paths
        warm = synthetic_workload(args.warmup_requests, io, (24, 24), vocab, seed=999)
        quiet = BenchConfig(progress=False)
        for name, backend in (("library", lib), ("server", srv)):
            t0 = time.time()
            run_benchmark(backend, warm, quiet)
            _say(f"# warm-up through the {name}: {time.time() - t0:.0f} s")

        if not args.skip_sweep:
            _say(f"\n## rate sweep through the server: {args.num_prompts} requests per rate, "
                 f"{args.input_len} prompt + {args.output_len} output tokens  ({load_line()})")
            _say(f"{'rate':>6} {'done':>5} {'dur s':>7} {'req/s':>6} {'out tok/s':>9} "
                 f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'srv TTFT p50':>12}  (ms)")
            sweep = []
            for i, rate in enumerate(rates):
                work = synthetic_workload(args.num_prompts, io, oo, vocab, seed=100 + i)
                s = summarize(run_benchmark(srv, work, BenchConfig(request_rate=rate, seed=i, progress=False)))
                s.pop("requests")
                sweep.append(s)
                t, itl, st = s["ttft_ms"], s["itl_ms"], s.get("server_timings_ms", {}).get("ttft", {})
                _say(f"{_rate_text(rate):>6} {s['completed']:>5} {s['duration_s']:>7.1f} "
                     f"{s['request_throughput']:>6.2f} {s['output_throughput']:>9.1f} {t['median']:>9.0f} "
                     f"{t['p99']:>9.0f} {itl['median']:>8.0f} {itl['p99']:>8.0f} {st.get('median') or 0:>12.0f}")
            report["sweep"] = sweep
            _say(f"# {load_line()}")

        if not args.skip_overhead:
            _say(f"\n## overhead: {args.streams} streams at once, {args.input_len} + {args.output_len} tokens, "
                 f"{args.rounds} alternating rounds  ({load_line()})")
            def measure(name, backend):
                def one(r):
                    work = synthetic_workload(args.streams, io, oo, vocab, seed=1000 + 11 * r)
                    s = summarize(run_benchmark(backend, work, BenchConfig(progress=False)))
                    _say(f"round {r + 1} {name:<7}: {s['output_throughput']:7.1f} output tok/s, "
                         f"{s['completed']}/{args.streams} done in {s['duration_s']:.1f} s, "
                         f"ITL p50 {s['itl_ms']['median']:.0f} ms  ({load_line()})")
                    return s["output_throughput"]
                return one

            tps = alternate({"library": measure("library", lib), "server": measure("server", srv)}, args.rounds)
            med = {k: median(v) for k, v in tps.items()}
            ratio = med["server"] / med["library"]
            per_round = [s / l for s, l in zip(tps["server"], tps["library"])]
            _say(f"median output tok/s: library {med['library']:.1f}, server {med['server']:.1f}; "
                 f"server / library = {ratio:.3f} (per round: {', '.join(f'{x:.3f}' for x in per_round)}); "
                 f"target >= 0.90")
            report["overhead"] = {"output_tok_s": tps, "median": med, "ratio": ratio, "per_round": per_round}
    finally:
        llm.close()
        stop_server(proc)
    _say(f"# total {time.time() - t_start:.0f} s; {load_line()}")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
