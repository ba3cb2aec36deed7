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
4. logs each round's output tokens/s and TTFT p50, then prints per protocol the medians
   (`jaxinfer.stats.median`), the ratio HTTP / gRPC of throughput and the difference of TTFT p50,
   against the issue's targets (HTTP >= 0.9x gRPC throughput, <= +5 ms TTFT p50), with the CPU,
   its flags (/proc/cpuinfo) and the load average beside them.

Both clients time on the client side, as a user sees it, and run on the same machine as the server:
on a small machine their own CPU (HTTP: JSON chunks over SSE; gRPC: protobuf messages) competes
with the server's, and is part of what is compared.
"""

from __future__ import annotations

import json
import subprocess
import sys

from jaxinfer.tools.harness import Bench, heading, load_line, machine_line, medians, parser, run, table, target, \
    targets_block

from benchmarks.bench_figures import start_server, stop_server


def bench(flags: list, args, seed: int, num_prompts: int, output_range: str, concurrency: int) -> dict:
    """One ``jaxinfer bench`` process against the server its `flags` name; its JSON summary."""
    cmd = [sys.executable, "-m", "jaxinfer", "bench", *flags, "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--input-len", str(args.input_len),
           "--output-len-range", output_range, "--seed", str(seed), "--no-progress", "--quiet", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(flags)}: jaxinfer bench exited {p.returncode}: {p.stderr.strip()[-500:]}")
    s = json.loads(p.stdout)
    if s["failed"]:
        raise RuntimeError(f"{' '.join(flags)}: {s['failed']} requests failed: {s['errors']}")
    return s


def one_round(b: Bench, name: str, flags: list, r: int) -> dict:
    """Round `r` through one protocol: ``--streams`` requests at once, then ``--single-requests`` one at a time."""
    a = b.args
    s = bench(flags, a, r, a.streams, a.output_len_range, a.streams)
    f = {"output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["median"],
         "itl_p50_ms": s["itl_ms"]["median"], "duration_s": s["duration_s"], "output_tokens": s["total_output_tokens"]}
    if a.single_requests:
        f["ttft_p50_single_ms"] = bench(flags, a, 100 + r, a.single_requests, "4:4", 1)["ttft_ms"]["median"]
    b.log(f"round {r + 1} {name:<4}: {f['output_tok_s']:7.1f} output tok/s, TTFT p50 {f['ttft_p50_ms']:7.1f} ms, ITL "
          f"p50 {f['itl_p50_ms']:6.1f} ms, {f['output_tokens']} tokens in {f['duration_s']:.1f} s"
          + (f", one at a time: TTFT p50 {f['ttft_p50_single_ms']:6.1f} ms" if a.single_requests else "")
          + f"  ({load_line()})")
    return f


def measure(b: Bench) -> None:
    a, res = b.args, b.figures
    res.update(model=a.model, engine_config=a.engine_config, cpu=machine_line(res["system"]), streams=a.streams,
               input_len=a.input_len, output_len_range=a.output_len_range, single_requests=a.single_requests)
    proc, address, url = start_server(a.model, a.engine_config, http=True,
                                      extra=["--no-prefix-caching", *a.serve_arg])
    b.log(f"server ready: gRPC {address}, HTTP {url}")
    protocols = {"http": ["--base-url", url], "grpc": ["--server", address]}
    try:
        for name, flags in protocols.items():  # unmeasured: connections, the first prefills
            b.log(f"warm-up through {name}")
            bench(flags, a, 999, 8, "8:8", a.streams)
        res["rounds"] = figures = b.rounds({name: lambda r, name=name, flags=flags: one_round(b, name, flags, r)
                                            for name, flags in protocols.items()})
        # NOTE: llama-cpp-python's own OpenAI server (`pip install 'llama-cpp-python[server]'`, built from
        # source, never in CI; `python -m llama_cpp.server --model FILE.gguf --port P`) would add a third
        # row here on the same GGUF: `bench(["--base-url", f"http://127.0.0.1:{P}", "--tokenizer", args.model],
        # ...)` (its /v1/models reports no vocabulary size, unlike llama.cpp's own llama-server: --tokenizer
        # gives it, and makes the prompts the same token ids; compare its output token counts with ours, since a
        # server that ignores ignore_eos stops early). It is not installed where these figures come from.
    finally:
        stop_server(proc, 60)
    keys = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms") + (("ttft_p50_single_ms",) if a.single_requests else ())
    res["median"] = med = {name: medians(fs, keys) for name, fs in figures.items()}
    h, g = med["http"], med["grpc"]
    res["throughput_ratio"] = h["output_tok_s"] / g["output_tok_s"]
    res["ttft_p50_extra_ms"] = h["ttft_p50_ms"] - g["ttft_p50_ms"]
    res["ttft_p50_single_extra_ms"] = (h["ttft_p50_single_ms"] - g["ttft_p50_single_ms"]) if a.single_requests else None
    res["per_round_ratio"] = [x["output_tok_s"] / y["output_tok_s"] for x, y in zip(figures["http"], figures["grpc"])]
    res["targets"] = [
        target("HTTP output tokens/s >= 0.90x gRPC", res["throughput_ratio"] >= 0.9, f"{res['throughput_ratio']:.3f}x"),
        target("HTTP TTFT p50 <= gRPC + 5 ms", res["ttft_p50_extra_ms"] <= 5.0, f"{res['ttft_p50_extra_ms']:+.1f} ms"),
    ] + ([target("HTTP TTFT p50 one at a time <= gRPC + 5 ms", res["ttft_p50_single_extra_ms"] <= 5.0,
                 f"{res['ttft_p50_single_extra_ms']:+.1f} ms")] if a.single_requests else [])


def report(res: dict) -> str:
    h, g = res["median"]["http"], res["median"]["grpc"]
    rows = [("output tokens/s", "output_tok_s", f"{res['throughput_ratio']:.3f}x"),
            ("TTFT p50 (ms)", "ttft_p50_ms", f"{res['ttft_p50_extra_ms']:+.1f} ms"),
            ("ITL p50 (ms)", "itl_p50_ms", "")]
    if res["single_requests"]:
        rows.append(("TTFT p50, one at a time (ms)", "ttft_p50_single_ms", f"{res['ttft_p50_single_extra_ms']:+.1f} ms"))
    n = len(res["rounds"]["http"])
    L = heading(f"the OpenAI-compatible HTTP API against gRPC — {res['model']}, engine {res['engine_config']}; "
                f"{res['streams']} concurrent streams, {res['input_len']} prompt tokens, "
                f"{res['output_len_range'].replace(':', '-')} output tokens", res["system"])
    return "\n".join(L + ["", table([f"medians of {n} rounds", "HTTP (OpenAI)", "gRPC", "HTTP vs gRPC"],
                                    [(label, f"{h[k]:.1f}", f"{g[k]:.1f}", d) for label, k, d in rows]),
                          f"throughput ratio per round: {', '.join(f'{x:.3f}' for x in res['per_round_ratio'])}",
                          "", *targets_block(res["targets"])])


def main(argv=None) -> int:
    p = parser("python -m benchmarks.http_vs_grpc", __doc__, rounds=5)
    p.add_argument("--engine-config", default="cpu")
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
    return run(measure, report, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
