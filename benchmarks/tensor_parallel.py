"""Tensor parallelism on this host: decode step time at TP = 1, 2, 4, 8 and peak host memory while loading.

    python -m benchmarks.tensor_parallel            (from the repository root)

Runs SmolLM2-135M-Instruct (the default model, restored from the model cache) on
``--devices`` CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``,
set here before JAX starts). On one CPU host the fake devices share the same
cores, so a larger TP cannot be faster: the figures show what the mesh costs
(collectives, per-shard dispatch), not a speed-up. The engines of every TP size
are kept loaded and measured in alternating rounds (the steady decode step from
the engine's counters, `benchmarks.engine.steady_window`); medians are printed
with the machine line (CPU flags, load). Peak host memory while loading is measured for each size in
a fresh process (the high-water mark of its resident memory, which includes the
JAX runtime and, on CPU, the devices' own arrays: the parameters and the KV cache,
which grows with TP when KV heads are replicated), loading from the model cache into
the mesh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxinfer.tools.harness import Bench, heading, parser, run

LOAD_PROBE = """
import json, sys, time
t = time.perf_counter()
import jaxinfer
from jaxinfer.ops.mesh import peak_host_memory_mb, per_device_bytes
llm = jaxinfer.LLM({model!r}, dtype={dtype!r}, tensor_parallel_size={tp})
params, cache = per_device_bytes(llm.runner.params), per_device_bytes(llm.runner.kv_cache)
print("LOAD", json.dumps({{"peak_mb": peak_host_memory_mb(), "load_s": time.perf_counter() - t,
                           "param_mb_per_device": max(params.values()) / 1e6,
                           "device_mb": (sum(params.values()) + sum(cache.values())) / 1e6}}))
"""


def load_probe(model: str, dtype: str, tp: int, devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    out = subprocess.run([sys.executable, "-c", LOAD_PROBE.format(model=model, dtype=dtype, tp=tp)], env=env,
                         capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("LOAD "):
            return json.loads(line[5:])
    raise RuntimeError(f"load probe at TP {tp} failed:\n{out.stderr[-2000:]}")


def measure(b: Bench) -> None:
    a = b.args
    import jaxinfer  # after main set XLA_FLAGS: JAX reads them when it starts
    from jaxinfer.config import DEFAULT_MODEL, EngineConfig

    from benchmarks.engine import Ids, steady_window

    model = a.model or DEFAULT_MODEL
    jaxinfer.LLM(model, dtype=a.dtype).close()  # fill the model cache before the probes
    m = b.figures["system"]
    b.figures.update(devices=a.devices, cpu_flags=" ".join(m["cpu_flags"]), machine=m, steps={})
    b.figures["loads"] = {tp: load_probe(model, a.dtype, tp, a.devices) for tp in a.sizes}
    ecfg = EngineConfig.preset("cpu").replace(dtype=a.dtype, max_num_seqs=max(a.batches), num_pages=256)
    llms = {tp: jaxinfer.LLM(model, engine_config=ecfg.replace(tensor_parallel_size=tp)) for tp in a.sizes}
    ids = Ids(llms[a.sizes[0]].model_config.vocab_size, 0)  # fresh random prompts, away from the special ends
    for n in a.batches:
        for llm in llms.values():  # compile and settle this batch size once
            steady_window(llm, n, 32, ids, skip=2, window=4)
        b.figures["steps"][n] = b.rounds({tp: lambda i, llm=llm: steady_window(llm, n, 32, ids, skip=4, window=16)[
            "step_ms"] for tp, llm in llms.items()}, tag=f"batch {n}: ")
    for llm in llms.values():
        llm.close()


def report(res: dict) -> str:
    from jaxinfer.stats import median

    L = heading("tensor parallelism on this host: decode step time per TP size, peak host memory while loading",
                res["system"]) + [f"devices: {res['devices']} (fake CPU devices share the cores)"]
    for tp, r in res["loads"].items():
        L.append(f"TP {tp}: load {r['load_s']:.1f} s, peak host memory {r['peak_mb']:.0f} MB, of which the "
                 f"devices' arrays (parameters and KV cache, all devices) {r['device_mb']:.0f} MB; "
                 f"parameters {r['param_mb_per_device']:.1f} MB per device")
    for n, times in res["steps"].items():
        base = median(next(iter(times.values())))
        cells = ", ".join(f"TP {tp} {median(t):.1f} ms ({median(t) / base:.2f}x)" for tp, t in times.items())
        L.append(f"batch {n:2d} decode step: {cells}")
    return "\n".join(L)


def main(argv=None) -> int:
    p = parser("python -m benchmarks.tensor_parallel", __doc__, model=None, rounds=3)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"
    return run(measure, report, a)


if __name__ == "__main__":
    raise SystemExit(main())
