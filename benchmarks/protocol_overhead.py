"""What the OpenAI-compatible HTTP path adds to time to first token, against gRPC, with the model's cost made small.

    python -m benchmarks.protocol_overhead                 # 60 alternating single requests per protocol
    python -m benchmarks.protocol_overhead --requests 200

(from the repository root). One in-process server (`ServerThread`) serves both protocols over the tiny
random-weight test model (tests/openai_models.py), so a request's time is mostly the path it takes:
parsing, building the request, the engine's queue, the first step, the stream back. Single requests,
alternating (the order flipping each pair) HTTP (a streamed ``/v1/completions`` read with httpx) and gRPC (``Generate`` with the
jaxinfer client), each timed at the client from sending to the first streamed token; the first
``--skip`` pairs are warm-up. Prints the medians, their difference and the CPU flags. Not a test.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import time

from jaxinfer.tools.harness import Bench, heading, parser, run, spread


def measure(b: Bench) -> None:
    a = b.args
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import httpx

    from jaxinfer.server import ServerConfig, ServerThread
    from jaxinfer.server.client import Client
    from openai_models import sp_llm

    llm = sp_llm(pathlib.Path(tempfile.mkdtemp()))
    ids = list(range(5, 37))
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    with ServerThread(llm, ServerConfig(port=0, http_port=0)) as srv, Client(srv.address, timeout=60) as c, \
            httpx.Client(base_url=srv.http_url, timeout=60) as h:
        def grpc_first(i):
            t0 = time.perf_counter()
            next(piece for piece in c.generate(ids, max_tokens=4, temperature=0, ignore_eos=True) if piece.token_ids)
            return time.perf_counter() - t0

        def http_first(i):
            t0 = time.perf_counter()
            with h.stream("POST", "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data: {"))
            return time.perf_counter() - t0

        times = b.rounds({"grpc": grpc_first, "http": http_first}, a.requests + a.skip)
    llm.close()
    b.figures.update(requests=a.requests, skip=a.skip, seconds=times,
                     **{f"{k}_ms": spread(times[k][a.skip:])["median"] * 1e3 for k in ("grpc", "http")})


def report(res: dict) -> str:
    g, h = res["grpc_ms"], res["http_ms"]
    return "\n".join(heading(f"time to the first streamed token, median of {res['requests']} alternating single "
                             "requests (tiny model)", res["system"])
                     + [f"  gRPC {g:.2f} ms   HTTP {h:.2f} ms   HTTP - gRPC {h - g:+.2f} ms   (target: <= +5 ms)"])


def main(argv=None) -> int:
    p = parser("python -m benchmarks.protocol_overhead", __doc__, model=None)
    p.add_argument("--requests", type=int, default=60, help="single requests per protocol (default: 60)")
    p.add_argument("--skip", type=int, default=10, help="warm-up pairs left out (default: 10)")
    return run(measure, report, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
