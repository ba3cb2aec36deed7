"""The OpenAI-compatible HTTP front door against the gRPC one, on the same server and engine (issue 19).

    python -m benchmarks.http_vs_grpc                       # SmolLM2-135M-Instruct, the cpu preset, 5 rounds
    python -m benchmarks.http_vs_grpc --rounds 3 --streams 32 --json http_vs_grpc.json

(from the repository root: ``benchmarks/`` is not installed with jaxinfer; it needs jaxinfer only).

What it does, all on loopback:

1. starts one ``jaxinfer serve --port 0 --http-port 0 --no-prefix-caching`` (it compiles, or loads
   from the program cache, every program before it is ready) and reads both addresses from its
   ready line; the prefix cache is off because both protocols of a round send the same prompts;
2. warms both paths up with one short unmeasured run each;
3. for ``--rounds`` rounds runs ``jaxinfer bench --base-url http://...`` (OpenAI ``/v1/completions``,
   streamed, the prompt as token ids) and ``jaxinfer bench --server HOST:PORT`` (gRPC ``Generate``)
   one after the other, the order flipped each round, each a separate process with the same
   workload: ``--streams`` requests sent at once (so ``--streams`` concurrent streams), prompts of
   ``--input-len`` random tokens, outputs uniform in ``--output-len-range`` (``ignore_eos``), the
   same seed for both protocols within a round;
   then ``--single-requests`` requests one at a time (4 output tokens each), whose TTFT has no
   queueing in it: what the protocol itself adds;
4. prints each round's output tokens/s and TTFT p50, then per protocol the medians
   (`jaxinfer.stats.median`), the ratio HTTP / gRPC of throughput and the difference of TTFT p50,
   against the issue's targets (HTTP >= 0.9x gRPC throughput, <= +5 ms TTFT p50), with the CPU,
   its flags (/proc/cpuinfo) and the load average beside them.

Both clients time on the client side, as a user sees it, and run on the same machine as the server:
on a small machine their own CPU (HTTP: JSON chunks over SSE; gRPC: protobuf messages) competes
with the server's, and is part of what is compared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from jaxinfer.tools.harness import alternate, load_line, machine_line, medians, write_json

from benchmarks.bench_figures import _say, start_server, stop_server


def bench(target: list, args, seed: int, num_prompts: int, output_range: str, concurrency: int) -> dict:
    """One ``jaxinfer bench`` process against `target` (its flags); its JSON summary."""
    cmd = [sys.executable, "-m", "jaxinfer", "bench", *target, "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--input-len", str(args.input_len),
           "--output-len-range", output_range, "--seed", str(seed), "--no-progress", "--quiet", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(target)}: jaxinfer bench exited {p.returncode}: {p.stderr.strip()[-500:]}")
    s = json.loads(p.stdout)
    if s["failed"]:
        raise RuntimeError(f"{' '.join(target)}: {s['failed']} requests failed: {s['errors']}")
    return s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.http_vs_grpc", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--engine-config", default="cpu")
    p.add_argument("--rounds", type=int, default=5, help="alternating HTTP / gRPC rounds (default: 5)")
    p.add_argument("--streams", type=int, default=32, help="requests per run, all sent at once (default: 32)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len-range", default="64:128", metavar="LO:HI",
                   help="output tokens, uniform in [LO, HI] (default: 64:128)")
    p.add_argument("--single-requests", type=int, default=16, metavar="N",
                   help="then N requests one at a time (4 output tokens each), for TTFT without queueing; "
                   "0: skip (default: 16)")
    p.add_argument("--bench-timeout", type=float, default=900.0, metavar="SECONDS")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for jaxinfer serve (repeat)")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = p.parse_args(argv)

    cpu = machine_line()
    t_start = time.time()
    _say(f"# {cpu}")
    _say(f"# {load_line()}")
    proc, address, url = start_server(args.model, args.engine_config, http=True,
                                      extra=["--no-prefix-caching", *args.serve_arg])
    _say(f"# server ready after {time.time() - t_start:.0f} s: gRPC {address}, HTTP {url}")
    targets = {"http": ["--base-url", url], "grpc": ["--server", address]}
    try:
        for name, target in targets.items():  # unmeasured: connections, the first prefills
            t0 = time.time()
            bench(target, args, 999, 8, "8:8", args.streams)
            _say(f"# warm-up through {name}: {time.time() - t0:.0f} s")
        _say(f"\n## {args.streams} concurrent streams, {args.input_len} prompt tokens, "
             f"{args.output_len_range.replace(':', '-')} output tokens, {args.rounds} alternating rounds")

        def measure(name):
            def one(r):
                s = bench(targets[name], args, r, args.streams, args.output_len_range, args.streams)
                f = {"output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["median"],
                     "itl_p50_ms": s["itl_ms"]["median"], "duration_s": s["duration_s"],
                     "output_tokens": s["total_output_tokens"]}
                one = ""
                if args.single_requests:
                    s1 = bench(targets[name], args, 100 + r, args.single_requests, "4:4", 1)
                    f["ttft_p50_single_ms"] = s1["ttft_ms"]["median"]
                    one = f", one at a time: TTFT p50 {f['ttft_p50_single_ms']:6.1f} ms"
                _say(f"round {r + 1} {name:<4}: {f['output_tok_s']:7.1f} output tok/s, TTFT p50 "
                     f"{f['ttft_p50_ms']:7.1f} ms, ITL p50 {f['itl_p50_ms']:6.1f} ms, {f['output_tokens']} tokens in "
                     f"{f['duration_s']:.1f} s{one}  ({load_line()})")
                return f
            return one

        figures = alternate({name: measure(name) for name in targets}, args.rounds)
        # NOTE: llama-cpp-python's own OpenAI server (`pip install 'llama-cpp-python[server]'`, built from
        # source, never in CI; `python -m llama_cpp.server --model FILE.gguf --port P`) would add a third
        # row here on the same GGUF: `bench(["--base-url", f"http://127.0.0.1:{P}", "--tokenizer", args.model],
        # ...)` (its /v1/models reports no vocabulary size, unlike llama.cpp's own llama-server: --tokenizer
        # gives it, and makes the prompts the same token ids; compare its output token counts with ours, since a
        # server that ignores ignore_eos stops early). It is not installed where these figures come from.
    finally:
        stop_server(proc, 60)
    keys = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms") + (("ttft_p50_single_ms",) if args.single_requests else ())
    med = {name: medians(fs, keys) for name, fs in figures.items()}
    ratio = med["http"]["output_tok_s"] / med["grpc"]["output_tok_s"]
    extra_ttft = med["http"]["ttft_p50_ms"] - med["grpc"]["ttft_p50_ms"]
    single_extra = (med["http"]["ttft_p50_single_ms"] - med["grpc"]["ttft_p50_single_ms"]
                    if args.single_requests else None)
    per_round = [h["output_tok_s"] / g["output_tok_s"] for h, g in zip(figures["http"], figures["grpc"])]
    rows = [
        "",
        f"{'medians of ' + str(args.rounds) + ' rounds':<28} {'HTTP (OpenAI)':>14} {'gRPC':>10} {'HTTP vs gRPC':>14}"
        f"  target",
        f"{'output tokens/s':<28} {med['http']['output_tok_s']:>14.1f} {med['grpc']['output_tok_s']:>10.1f} "
        f"{ratio:>13.3f}x  >= 0.90x  {'PASS' if ratio >= 0.9 else 'FAIL'}",
        f"{'TTFT p50 (ms)':<28} {med['http']['ttft_p50_ms']:>14.1f} {med['grpc']['ttft_p50_ms']:>10.1f} "
        f"{extra_ttft:>+11.1f} ms  <= +5 ms   {'PASS' if extra_ttft <= 5.0 else 'FAIL'}",
        f"{'ITL p50 (ms)':<28} {med['http']['itl_p50_ms']:>14.1f} {med['grpc']['itl_p50_ms']:>10.1f}",
        *([f"{'TTFT p50, one at a time (ms)':<28} {med['http']['ttft_p50_single_ms']:>14.1f} "
           f"{med['grpc']['ttft_p50_single_ms']:>10.1f} {single_extra:>+11.1f} ms  <= +5 ms   "
           f"{'PASS' if single_extra <= 5.0 else 'FAIL'}"] if args.single_requests else []),
        f"throughput ratio per round: {', '.join(f'{x:.3f}' for x in per_round)}",
        f"model {args.model}, engine {args.engine_config}; {cpu}; {load_line()}; total {time.time() - t_start:.0f} s",
    ]
    _say("\n".join(rows))
    if args.json:
        write_json(args.json, {"model": args.model, "engine_config": args.engine_config, "cpu": cpu,
                               "streams": args.streams, "input_len": args.input_len,
                               "output_len_range": args.output_len_range, "rounds": figures, "median": med,
                               "throughput_ratio": ratio, "ttft_p50_extra_ms": extra_ttft,
                               "ttft_p50_single_extra_ms": single_extra})
    return 0


if __name__ == "__main__":
    sys.exit(main())
