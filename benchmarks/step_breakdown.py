"""Where a step's time goes: one batch-1 decode step and one 128-token prefill, per precision, beside the floor.

    python -m benchmarks.step_breakdown                        # every precision, 2 rounds
    python -m benchmarks.step_breakdown --systems bfloat16 bfloat16-fp32x --steps 40 --json steps.json

(from the repository root). SmolLM2-135M-Instruct through `jaxinfer.LLM` (prefix cache off), each system in
its own engine in one process:

* **decode, batch 1** (``--context`` tokens attended): the compiled step called alone with its inputs on
  device (`benchmarks.core.StepBench`), the same step through the runner (host inputs built and
  dispatched each step), and a whole `LLM.generate`'s time per output token (the host loop, sampling's
  read-back, detokenizing and the request's stream on top);
* **prefill**: the time to the first token of a ``--prompt-len`` prompt (`LLM.generate`, one token), and the
  same request run again under the JAX profiler, its prefill program's thunks attributed as the decode
  step's are (the rest of the TTFT is the host's work: the request's way in, scheduling, inputs, dispatch,
  reading the token back, and XLA's runtime between thunks);
* the decode step's ``--steps`` calls run again under the JAX profiler, every thunk XLA's CPU runtime executed
  attributed from the compiled program's HLO: the native matmul kernel by the weight it multiplies
  (wqkv, wo, w_gate_up, w_down, the LM head; products with a row of ones are the batch-invariant row
  sums of the norms and the sampler's softmax), the attention kernel, and XLA's own ops (norms' scaling,
  RoPE, the residual adds, the sampler); the rest of the program's wall time is XLA's runtime between
  thunks and the call's dispatch;
* the floor (`jaxinfer.engine.roofline`: bytes the step must move / the machine's measured bandwidth,
  flops / its peak) and the fraction of it each step reaches.

Systems: float32, bfloat16 (on a CPU with AMX: its tiles, activations rounded to bfloat16),
bfloat16-fp32x (``JAXINFER_CPU_AMX=0``: the weights widened, activations in float32), int8, int4 (the
file's Q4_1 blocks). Rounds alternate the systems; figures are medians. The CPU flags and load print
with the figures.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time
from typing import Optional

import jax

import jaxinfer
from jaxinfer.engine.roofline import CostModel, MachinePeaks, floor_seconds
from jaxinfer.stats import median
from jaxinfer.tools.harness import Bench, heading, parser, peaks, peaks_line, run, settle

from benchmarks.core import StepBench, greedy, make_prompts

# name -> (weights dtype, quantization, JAXINFER_CPU_AMX)
SYSTEMS = {
    "float32": ("float32", None, "1"),
    "bfloat16": ("bfloat16", None, "1"),
    "bfloat16-fp32x": ("bfloat16", None, "0"),
    "int8": ("float32", "int8", "1"),
    "int4": ("float32", "int4", "1"),
}
# Thunks that hold other thunks (their time is their children's): left out of the sums.
CONTAINERS = re.compile(r"^(cond|while|call|conditional)[.\d]*(\.clone)?$")


def roles(cfg) -> dict:
    """{(K, N): part} for the products of a Llama-shaped model (``N`` the outputs, ``K`` the contraction)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    return {(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd): "matmul wqkv", (cfg.num_heads * hd, h): "matmul wo",
            (h, 2 * cfg.intermediate_size): "matmul w_gate_up", (cfg.intermediate_size, h): "matmul w_down",
            (h, cfg.vocab_size): "matmul LM head"}


def thunk_parts(hlo: str, cfg) -> dict:
    """{thunk name: part} for the custom calls of a compiled program's HLO text."""
    parts, by_shape = {}, roles(cfg)
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*custom_call_target=\"(\w+)\"", line)
        if not m:
            continue
        name, target = m.groups()
        if "attention" in target:
            parts[name] = "attention kernel"
        elif "matmul" in target:
            ops = re.search(r"operand_layout_constraints=\{(.*?)\}, api", line)
            shapes = re.findall(r"(\w+)\[([\d,]*)\]", ops.group(1)) if ops else []
            wc = re.search(r"w_contract = (\d)", line)
            dims = [int(d) for d in shapes[1][1].split(",")] if len(shapes) > 1 and shapes[1][1] else []
            k = int(shapes[0][1].split(",")[1]) if shapes and "," in shapes[0][1] else 0
            n = (dims[0] if wc and wc.group(1) == "1" else dims[-1]) if dims else 0
            parts[name] = "row sums (norms, softmax)" if n == 1 else by_shape.get((k, n), f"matmul other [{k}, {n}]")
        else:
            parts[name] = "sampler top-k" if target == "TopK" else f"custom call {target}"
    return parts


def profile(fn, calls: int, parts: dict, wall: Optional[list] = None) -> dict:
    """Run ``fn`` ``calls`` times under the JAX profiler; {part: microseconds per call} of the leaf thunks
    (custom calls by `parts`, everything else XLA's own ops). ``wall``: a list that gets each call's seconds
    under the profiler (the time the parts are shares of)."""
    d = tempfile.mkdtemp(prefix="jaxinfer_breakdown_")
    try:
        with jax.profiler.trace(d):
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                if wall is not None:
                    wall.append(time.perf_counter() - t0)
        events = json.load(gzip.open(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)[0]))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    total = collections.Counter()
    for e in events["traceEvents"]:
        if e.get("ph") != "X" or e["name"].startswith(("$", "Thunk", "Pjit", "Common", "Handle", "Parse", "Wait",
                                                         "Allocate", "end:", "PythonRef")):
            continue
        n = e["name"]
        if CONTAINERS.match(n):
            continue
        part = parts.get(n)
        if part is None:
            if not re.match(r"^[a-z][\w-]*(\.[\w-]+)*$", n):
                continue  # not a thunk (a Python or runtime annotation)
            part = "XLA ops (norm scaling, RoPE, residuals, sampler)"
        total[part] += e["dur"]
    return {k: v / calls for k, v in total.items()}


def first_token_seconds(llm, prompt) -> float:
    r = llm.generate([prompt], greedy(1))[0]
    return r.metrics.first_token_time - r.metrics.arrival_time


def prefill_parts(llm, prompt_len: int) -> dict:
    """`thunk_parts` of the programs a ``prompt_len``-token prompt's prefill runs (its chunks' steps)."""
    table, parts = llm.runner.programs, {}
    for key in llm.engine.request_program_keys(prompt_len, 1):
        if key.tokens > 1:  # a prefill chunk (decode steps carry one token a request)
            parts.update(thunk_parts(table.get(key).as_text(), llm.model_config))
    return parts


class System:
    def __init__(self, name: str, a):
        dtype, quantization, amx = SYSTEMS[name]
        os.environ["JAXINFER_CPU_AMX"] = amx  # read when the engine's kernel choice is made
        kw = {"quantization": quantization} if quantization else {}
        self.name, self.a = name, a
        self.llm = jaxinfer.LLM(a.model, dtype=dtype, enable_prefix_caching=False, **kw)
        self.choice = str(self.llm.runner.kernels)
        self.prompt, _ = make_prompts(self.llm, a.prompt_len, 1)
        self.bench = StepBench(self.llm, self.prompt, a.context, 1)
        self.parts = thunk_parts(self.bench.program.as_text(), self.llm.model_config)
        first_token_seconds(self.llm, self.prompt)  # compile / warm the prefill
        self.prefill_parts = prefill_parts(self.llm, len(self.prompt))

    def floors(self, pk: dict) -> tuple:
        """(decode step floor, prefill floor) in seconds at the machine's peaks."""
        r = self.llm.runner
        cost = CostModel(r.model_cfg, r.params, r.ecfg.cache_dtype)
        at = MachinePeaks(bandwidth_gbps=pk["bandwidth_gbs"], flops_gflops=pk["flops_gflops"])
        return (floor_seconds(cost.step([1], [self.a.context - 1]), at),
                floor_seconds(cost.step([self.a.prompt_len], [0]), at))

    def round(self) -> dict:
        a, b = self.a, self.bench
        out = {"direct_ms": median(b.direct(a.steps)) * 1e3, "runner_ms": median(b.through_runner(a.steps)) * 1e3}
        r = self.llm.generate([self.prompt], greedy(a.decode_tokens))[0]
        t = r.metrics.token_times
        out["generate_ms"] = (t[-1] - t[0]) / (len(t) - 1) * 1e3
        out["ttft_ms"] = median([first_token_seconds(self.llm, self.prompt) for _ in range(3)]) * 1e3
        out["decode_parts_us"] = profile(b.step, a.steps, self.parts)
        wall: list = []
        out["prefill_parts_us"] = profile(lambda: first_token_seconds(self.llm, self.prompt), 3, self.prefill_parts,
                                          wall)
        out["prefill_profiled_ms"] = median(wall) * 1e3  # the request's time under the profiler
        return out


def measure(b: Bench) -> None:
    a = b.args
    systems = {}
    for name in a.systems:
        b.log(f"loading {name}")
        systems[name] = System(name, a)
    b.figures["peaks"] = pk = peaks()  # after the kernels load: the native kernel is among the probes
    b.figures.update(context=a.context, prompt_len=a.prompt_len, results={})
    rounds = b.rounds({n: (lambda i, s=s: s.round()) for n, s in systems.items()})
    for name, rs in rounds.items():
        s = systems[name]
        decode_floor, prefill_floor = s.floors(pk)
        parts, prefill = collections.defaultdict(list), collections.defaultdict(list)
        for r in rs:
            for k, v in r["decode_parts_us"].items():
                parts[k].append(v)
            for k, v in r["prefill_parts_us"].items():
                prefill[k].append(v)
        b.figures["results"][name] = {
            "choice": s.choice, "decode_floor_ms": decode_floor * 1e3, "prefill_floor_ms": prefill_floor * 1e3,
            **{k: median([r[k] for r in rs])
               for k in ("direct_ms", "runner_ms", "generate_ms", "ttft_ms", "prefill_profiled_ms")},
            "decode_parts_ms": {k: median(v) / 1e3 for k, v in parts.items()},
            "prefill_parts_ms": {k: median(v) / 1e3 for k, v in prefill.items()},
            "rounds": [{k: v for k, v in r.items() if not k.endswith("_us")} for r in rs]}
    for s in systems.values():
        s.bench.close()
        s.llm.close()


def report(res: dict) -> str:
    L = heading("where a step's time goes: batch-1 decode and a 128-token prefill, beside the floor", res["system"])
    L.append(peaks_line(res["peaks"]))
    for name, r in res["results"].items():
        step = r["direct_ms"]
        L += ["", f"{name}  ({r['choice']})",
              f"  decode step alone {step:7.2f} ms   floor {r['decode_floor_ms']:6.2f} ms   "
              f"fraction of the floor {r['decode_floor_ms'] / step:.2f}",
              f"  through the runner {r['runner_ms']:6.2f} ms (host inputs + dispatch {r['runner_ms'] - step:+.2f})",
              f"  LLM.generate per token {r['generate_ms']:6.2f} ms (host loop, read-back, detokenize, stream "
              f"{r['generate_ms'] - r['runner_ms']:+.2f})",
              f"  TTFT of {res['prompt_len']} tokens {r['ttft_ms']:7.1f} ms   prefill floor {r['prefill_floor_ms']:6.2f} ms"]
        L.append("    decode step:")
        L += _parts_lines(r["decode_parts_ms"], step, "XLA runtime between thunks + the call")
        if r.get("prefill_parts_ms"):
            L.append(f"    the first token ({res['prompt_len']}-token prompt), {r['prefill_profiled_ms']:.1f} ms a request "
                     f"under the profiler:")
            L += _parts_lines(r["prefill_parts_ms"], r["prefill_profiled_ms"],
                              "host (way in, scheduling, inputs, dispatch, read-back) + XLA runtime")
    return "\n".join(L)


def _parts_lines(parts: dict, total: float, rest: str) -> list:
    known = sum(parts.values())
    lines = [f"      {k:46s} {v:7.2f} ms  {v / total:5.1%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])]
    if known > total:  # XLA ran some thunks at the same time (its thunk executor): shares of the wall overlap
        return lines + [f"      (the parts overlap: {known:.2f} ms of thunks in {total:.2f} ms)"]
    return lines + [f"      {rest:46s} {total - known:7.2f} ms  {(total - known) / total:5.1%}"]


def main(argv=None) -> int:
    p = parser("python -m benchmarks.step_breakdown", __doc__, rounds=(2, 1), quick="1 round, fewer steps")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--steps", type=int, default=None, help="decode steps timed and profiled (default 30, --quick 10)")
    p.add_argument("--context", type=int, default=256, help="tokens the decode step attends (default 256)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens of the LLM.generate timing (default 64)")
    a = settle(p, p.parse_args(argv), quick={"steps": (30, 10)}, at_least={"steps": 2})
    return run(measure, report, a)


if __name__ == "__main__":
    raise SystemExit(main())
