"""Core benchmark: jaxinfer vs Hugging Face transformers on the same weights, in one run.

Run it from the repository root (this folder is not installed with jaxinfer),
jaxinfer in one venv, torch + transformers in another:

    pip install -e .
    JAXINFER_HF_PYTHON=/path/to/venv-with-torch/bin/python python -m benchmarks.core

or install both in one venv (``pip install -e '.[reference]'``) and run
``python -m benchmarks.core``. ``--no-hf`` skips the peer; ``--json
FILE`` also writes every figure (and the per-round samples) as JSON.

What it measures, all on this machine and in this process:

* the machine's read bandwidth as the engine's roofline measures it (`jaxinfer.tools.harness.peaks`:
  the best of several read methods and thread counts) and the decode floor it sets: the weight
  bytes (in the engine's dtype) read once per step;
* jaxinfer: compile time (first request of a shape minus a warm one), time to
  first token for a 128-token prompt, batch-1 decode tokens/s, batch-8
  aggregate tokens/s;
* transformers (subprocess, ``benchmarks/hf_peer.py``) on the same GGUF dequantized to
  float32, the same token ids, in rounds alternating with jaxinfer's;
* the jitted decode step alone, with the KV cache allocated at 1x and 8x
  capacity, at the same context length.

Every figure is the median over ``--repeats`` rounds (`jaxinfer.stats.median`).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import jax

import jaxinfer
from jaxinfer.engine.compile_cache import compile_count
from jaxinfer.engine.buckets import pages_needed
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.stats import median
from jaxinfer.loading.weights import resolve_model
from jaxinfer.tools.harness import (Bench, Worker, alternate, compare, find_python, heading, medians, parser, peaks,
                                   peaks_line, ratio, run, settle, target, targets_block, timings, worker_flags)

HF_PEER = Path(__file__).with_name("hf_peer.py")
TEXT = (
    "The history of computing is a history of memory. Every processor waits on the data it needs, "
    "and the art of making programs fast is the art of keeping that data close: in registers, in "
    "caches, in pages that the operating system keeps resident. Language models make this plain. "
    "To produce one token, a decoder reads every one of its weights once, so the speed of a single "
    "stream is set by how many bytes per second the memory system can deliver, not by arithmetic. "
)


# --------------------------------------------------------------------------- #
# Prompts
# --------------------------------------------------------------------------- #


def make_prompts(llm, length: int, batch: int) -> tuple:
    """One `length`-token prompt and `batch` different ones, deterministic, from a repeated text."""
    if llm.tokenizer is not None:
        ids = llm.tokenizer.encode(TEXT * (2 + (length * (batch + 1)) // 60), add_special_tokens=False)
    else:
        ids = [(7 * i + 11) % llm.model_config.vocab_size for i in range(length * (batch + 2))]
    need = length + 7 * batch
    while len(ids) < need:
        ids = ids + ids
    prompt = ids[:length]
    batch_prompts = [ids[7 * (i + 1) : 7 * (i + 1) + length] for i in range(batch)]
    return prompt, batch_prompts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# --------------------------------------------------------------------------- #
# jaxinfer measurements
# --------------------------------------------------------------------------- #


def jax_compile(llm, prompt, batch_prompts, warm: int = 3) -> dict:
    """Compile cost = the first request of a shape minus the median warm request of that shape."""
    c0 = compile_count()
    first1 = timings(lambda: llm.generate([prompt], greedy(2)), 1)[0]  # prefill @128 + one decode step, batch 1
    warm1 = median(timings(lambda: llm.generate([prompt], greedy(2)), warm))
    first8 = timings(lambda: llm.generate(batch_prompts, greedy(2)), 1)[0]  # adds the batch-8 decode step
    warm8 = median(timings(lambda: llm.generate(batch_prompts, greedy(2)), warm))
    return {
        "compile_b1_s": first1 - warm1,
        "compile_b8_extra_s": first8 - warm8,
        "programs_compiled": compile_count() - c0,
    }


def batch_round(llm, prompts: list, n: int) -> dict:
    """All `prompts` at once through `LLM.generate`, `n` greedy tokens each: end-to-end and decode-phase rates."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy(n))
    t1 = time.perf_counter()
    ms = [o.metrics for o in outs]
    ntok = [len(o.outputs[0].token_ids) for o in outs]
    all_first = max(m.first_token_time for m in ms)
    last = max(m.finished_time for m in ms)
    return {
        "wall_s": t1 - t0,
        "output_tokens": sum(ntok),
        "e2e_tok_s": sum(ntok) / (t1 - t0),
        # after every request has its first token (all prefills done) to the last token
        "decode_tok_s": sum(k - 1 for k in ntok) / (last - all_first),
        "all_first_tokens_s": all_first - t0,
        "cached_tokens": sum(m.cached_tokens for m in ms),
        "tokens_first": list(outs[0].outputs[0].token_ids),
    }


def jax_round(llm, prompt, batch_prompts, n: int) -> dict:
    """One round: TTFT of `prompt` (one output token), batch-1 decode of `n` tokens, then `batch_round`."""
    t0 = time.perf_counter()
    ttft = llm.generate([prompt], greedy(1))[0].metrics.ttft_s
    ttft_wall = time.perf_counter() - t0
    out = llm.generate([prompt], greedy(n))[0]
    tpot_wall = (time.perf_counter() - out.metrics.first_token_time) / (n - 1)
    bt = batch_round(llm, batch_prompts, n)
    return {"ttft_s": ttft, "ttft_wall_s": ttft_wall, "tpot_s": out.metrics.tpot_s, "tpot_wall_s": tpot_wall,
            "batch_decode_tok_s": bt["decode_tok_s"], "batch_e2e_tok_s": bt["e2e_tok_s"],
            "batch_all_first_tokens_s": bt["all_first_tokens_s"], "tokens": list(out.outputs[0].token_ids),
            "batch_tokens_first": bt["tokens_first"]}


class StepBench:
    """Times the jitted decode step of one LLM at a fixed context, its inputs built once.

    `batch` requests are each given the pages for `context` tokens and positioned
    at their last token; the runner pads their inputs once (we capture the program
    it runs from its program table and the arguments it passes), after which that
    program is called directly with the cache fed back, as the engine does. The
    pages are taken from the top of the cache without the allocator; their
    contents are overwritten, so use this on an engine with nothing running.
    """

    def __init__(self, llm, prompt, context: int, batch: int = 1):
        self.llm = llm
        runner = llm.runner
        e = llm.engine_config
        k = pages_needed(context, e.page_size)
        if k * batch > e.num_pages - 1:
            raise ValueError(f"{batch} x {context} tokens do not fit a cache of {e.num_pages - 1} pages")
        self.requests = []
        for i in range(batch):
            r = llm.make_request(list(prompt), greedy(context - len(prompt)))
            r.pages = list(range(e.num_pages - (i + 1) * k, e.num_pages - i * k))
            r.slot = i
            r.num_computed = context - 1  # the step writes position context-1 and attends `context` tokens
            r.num_sampled = 1
            r.last_token = int(prompt[-1])
            self.requests.append(r)
        key, host_inputs = runner.step_inputs(self.requests, [])  # a decode step: the ragged step of decode rows
        self.runner_step = lambda: runner.step(self.requests, [])
        self.runner_step().tokens.block_until_ready()
        self.program = runner.programs.get(key)
        self.inputs = jax.device_put(host_inputs)  # tokens, from_state, attention and sampling metadata
        self.direct(3)
        self.through_runner(3)

    def step(self) -> None:
        """One call of the compiled step alone (inputs already on device, the cache fed back), blocking."""
        runner = self.llm.runner
        res, runner.kv_cache, runner.sampler_state = self.program(
            runner.params, runner.kv_cache, runner.sampler_state, *self.inputs
        )
        res.tokens.block_until_ready()

    def direct(self, k: int) -> list:
        """Seconds per call of the compiled step alone (`step`)."""
        return timings(self.step, k)

    def through_runner(self, k: int) -> list:
        """Seconds per step through the runner (host input building + step), blocking each call."""
        return timings(lambda: self.runner_step().tokens.block_until_ready(), k)

    def close(self) -> None:
        for r in self.requests:
            r.pages = []


def twin(llm, llm_kwargs: Optional[dict] = None, **engine_changes):
    """Another engine on `llm`'s weights (no reload): its engine config changed by `engine_changes`,
    `llm_kwargs` for `LLM.from_params` (e.g. ``enable_prefix_caching``)."""
    return jaxinfer.LLM.from_params(llm.model_config, llm.runner.params, tokenizer=llm.tokenizer,
                                    engine_config=llm.engine_config.replace(**engine_changes), **(llm_kwargs or {}))


def step_rounds(benches: dict, rounds: int, steps: int, runner_steps: int) -> dict:
    """Each `StepBench` once a round, in rotation (no one always first): ``steps`` calls of the step alone,
    ``runner_steps`` through the runner; {name: {"direct": seconds, "runner": seconds}}, all rounds' calls."""
    by = alternate({k: lambda i, b=b: (b.direct(steps), b.through_runner(runner_steps)) for k, b in benches.items()},
                   rounds)
    return {k: {"direct": [t for d, _ in rs for t in d], "runner": [t for _, r in rs for t in r]} for k, rs in by.items()}


def cache_capacity_steps(llm, prompt, context: int, tokens_1x: int, repeats: int, steps: int, batch: int) -> dict:
    """Decode-step time with the cache at 1x and 8x capacity (and the loaded engine's), interleaved."""
    ps = llm.engine_config.page_size
    n1 = tokens_1x // ps
    llms = {"1x": twin(llm, num_pages=n1 + 1), "8x": twin(llm, num_pages=8 * n1 + 1), "engine": llm,
            f"engine_b{batch}": llm}
    benches = {k: StepBench(v, prompt, context, batch if k.endswith(f"_b{batch}") else 1) for k, v in llms.items()}
    times = step_rounds(benches, repeats, steps, max(2, steps // 4))
    res = {"context": context, "page_size": ps, "batch": batch}
    for k, b in benches.items():
        e, t = llms[k].engine_config, times[k]
        res[k] = {"num_pages": e.num_pages, "capacity_tokens": (e.num_pages - 1) * ps,
                  "cache_bytes": sum(x.nbytes for x in jax.tree.leaves(llms[k].runner.kv_cache)),
                  "step_s": median(t["direct"]), "step_min_s": min(t["direct"]), "runner_step_s": median(t["runner"]),
                  "samples_s": t["direct"]}
        b.close()
    return res


# --------------------------------------------------------------------------- #
# transformers peer
# --------------------------------------------------------------------------- #


def _can_import_torch_transformers() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def hf_flags(p, threads: int = 2) -> None:
    """The transformers peer's flags (`core` and `engine`): where it runs, its threads, its attention."""
    worker_flags(p, "hf", "torch + transformers (+ gguf) for the transformers")
    p.add_argument("--threads", type=int, default=threads, help="torch threads for the peer")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="the peer's attention implementation")


def find_hf_python(flag: Optional[str], off: Optional[str] = None) -> tuple:
    """(interpreter or None, how it was chosen or why skipped): --hf-python, JAXINFER_HF_PYTHON, this one."""
    return find_python(flag, "JAXINFER_HF_PYTHON", off=off, here=_can_import_torch_transformers(), missing=(
        "this interpreter lacks torch/transformers; set JAXINFER_HF_PYTHON or pass --hf-python "
        "(a Python with torch, transformers, accelerate and gguf), or install '.[reference]'"))


def start_hf_peer(b: Bench, what: str, make: Callable[[str], Worker]) -> tuple:
    """(the transformers peer ``make(interpreter)`` or None, the interpreter or why it is skipped): where
    ``--hf-python`` / ``JAXINFER_HF_PYTHON`` / this interpreter has torch, unless ``--no-hf``; a peer that
    fails to start is recorded by `Bench.start`."""
    python, why = find_hf_python(b.args.hf_python, off=b.args.no_hf and "--no-hf")
    if not python:
        b.log(f"transformers peer {why}")
        return None, why
    b.log(f"starting the transformers peer ({python}; {what})")
    return b.start("transformers", lambda: make(python)), python


class HFPeer(Worker):
    """The transformers worker process (hf_peer.py), driven one JSON line per round."""

    def __init__(self, python: str, model_path: str, threads: int, attn: str, prompt, batch_prompts, n: int):
        setup = {
            "model": model_path,
            "threads": threads,
            "attn": attn,
            "prompt": list(prompt),
            "batch_prompts": [list(p) for p in batch_prompts],
            "decode_tokens": n,
        }
        super().__init__(python, HF_PEER, setup, threads, "the transformers worker",
                         env={"TOKENIZERS_PARALLELISM": "false"})


def common_prefix(a, b) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


# --------------------------------------------------------------------------- #
# What is measured
# --------------------------------------------------------------------------- #


def measure(b: Bench) -> None:
    a, res, log = b.args, b.figures, b.log
    res.update(model=a.model, repeats=a.repeats, batch=a.batch, prompt_len=a.prompt_len, decode_tokens=a.decode_tokens)
    log(f"loading {a.model} with jaxinfer")
    # The prefix cache off: the rounds reuse one prompt, and a cache hit would make every TTFT after the
    # first a 16-token prefill (transformers recomputes the whole prompt each time).
    llm = jaxinfer.LLM(a.model, dtype=a.dtype, enable_prefix_caching=False)
    res["dtype"] = llm.engine_config.dtype
    log("the machine's peaks (the engine's roofline probes, cached per machine)")
    res["bandwidth"] = bw = peaks()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.runner.params))
    res["floor"] = {"weight_bytes": weight_bytes, "bandwidth_gbs": bw["bandwidth_gbs"],
                    "floor_ms": weight_bytes / bw["bandwidth_gbs"] / 1e6}
    prompt, batch_prompts = make_prompts(llm, a.prompt_len, a.batch)
    log("jaxinfer compile time")
    res["jaxinfer"] = {"load_s": llm.load_time_s, "compile": jax_compile(llm, prompt, batch_prompts)}
    peer_rounds(b, llm, prompt, batch_prompts)
    context = a.step_context or a.prompt_len + a.decode_tokens
    log(f"decode step with the cache at 1x ({a.cache_tokens} tokens) and 8x capacity, context {context}")
    res["cache"] = c = cache_capacity_steps(llm, prompt, context, a.cache_tokens, a.repeats, a.steps, a.batch)
    c["ratio_8x_1x"] = c["8x"]["step_s"] / c["1x"]["step_s"]
    tpot, step = res["jaxinfer"]["tpot_s"], c["engine"]["step_s"]
    res["floor_over_step"] = res["floor"]["floor_ms"] / 1e3 / step
    res["floor_over_tpot"] = res["floor"]["floor_ms"] / 1e3 / tpot
    res["host_share"] = max(0.0, 1 - step / tpot)
    res["targets"] = targets(res)


def peer_rounds(b: Bench, llm, prompt, batch_prompts) -> None:
    """jaxinfer's rounds (`jax_round`) alternating with the transformers peer's, where it runs; their medians."""
    a, res = b.args, b.figures
    peer, res["transformers_python"] = start_hf_peer(b, "load + one warm-up round", lambda py: HFPeer(
        py, str(resolve_model(a.model).path), a.threads, a.attn, prompt, batch_prompts, a.decode_tokens))
    systems = {"jaxinfer": lambda i: jax_round(llm, prompt, batch_prompts, a.decode_tokens)}
    if peer is not None:
        systems["transformers"] = lambda i: peer.round()
    c0 = compile_count()
    by_system = b.rounds(systems, a.repeats, may_fail=("transformers",))
    jrounds, hrounds = by_system["jaxinfer"], by_system.get("transformers", [])
    jres = res["jaxinfer"]
    jres["recompiles_during_rounds"] = compile_count() - c0
    if peer is not None:
        peer.close()
        peer = peer if len(hrounds) == a.repeats else None
    res["transformers_python"] = res.get("skipped", {}).get("transformers", res["transformers_python"])
    jres.update(medians(jrounds, ["ttft_s", "ttft_wall_s", "tpot_s", "tpot_wall_s", "batch_decode_tok_s",
                                  "batch_e2e_tok_s", "batch_all_first_tokens_s"]), rounds=jrounds)
    if peer is None:
        return
    s = medians(hrounds, [k for k in hrounds[0] if not k.startswith(("tokens", "batch_tokens"))])
    res["transformers"] = {"info": peer.info, "summary": s, "rounds": hrounds}
    res["transformers_summary"] = {  # the faster of its hand-written loop and generate()
        "ttft_s": min(s["ttft_manual_s"], s["ttft_generate_s"]), "tpot_s": min(s["tpot_manual_s"], s["tpot_generate_s"]),
        "batch_decode_tok_s": s["batch_decode_tok_s"], "batch_e2e_tok_s": s["batch_e2e_tok_s"]}
    res["agree_b1"] = common_prefix(jrounds[-1]["tokens"], hrounds[-1]["tokens_manual"])
    res["agree_b8"] = common_prefix(jrounds[-1]["batch_tokens_first"], hrounds[-1]["batch_tokens_first"])


def targets(res: dict) -> list:
    j, c, hs = res["jaxinfer"], res["cache"], res.get("transformers_summary")
    decode = ratio(j["tpot_s"], hs and hs["tpot_s"], lower_better=True)
    ttft = ratio(j["ttft_s"], hs and hs["ttft_s"], lower_better=True)
    return [
        target("batch-1 decode >= 2x transformers", hs and decode >= 2.0,
               f"{decode:.2f}x" if hs else "peer skipped"),
        target("TTFT(128) no worse than transformers", hs and ttft >= 1.0,
               f"{1e3 * j['ttft_s']:.1f} vs {1e3 * hs['ttft_s']:.1f} ms" if hs else "peer skipped"),
        target("batch-1 decode at >= 0.75 of the floor", res["floor_over_tpot"] >= 0.75,
               f"{res['floor_over_tpot']:.2f} streamed, {res['floor_over_step']:.2f} device step"),
        target("decode step at 8x cache within 10% of 1x", c["ratio_8x_1x"] <= 1.10, f"{c['ratio_8x_1x']:.3f}"),
    ]


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def report(res: dict) -> str:
    bw, fl, j, h = res["bandwidth"], res["floor"], res["jaxinfer"], res.get("transformers")
    hs, n, dtype = res.get("transformers_summary") or {}, res["batch"], res.get("dtype", "float32")

    def peer(key, scale=1.0):
        return scale * hs[key] if hs else None

    L = heading(f"jaxinfer core benchmark — {res['model']} ({dtype} weights); medians of {res['repeats']} "
                "alternating rounds", res["system"])
    L += [
        "",
        peaks_line(bw),
        f"decode floor: {fl['weight_bytes'] / 1e6:.0f} MB of {dtype} weights / {fl['bandwidth_gbs']:.1f} GB/s "
        f"(best read) = {fl['floor_ms']:.2f} ms/step = {1e3 / fl['floor_ms']:.1f} tok/s",
        "",
        compare([
            ("compile, prefill@128 + decode b1 (s)", j["compile"]["compile_b1_s"], None, ".2f"),
            ("compile, extra for decode b8 (s)", j["compile"]["compile_b8_extra_s"], None, ".2f"),
            ("load (s)", j["load_s"], h["info"]["load_s"] if h else None, ".2f", "lower"),
            ("TTFT, 128-token prompt (ms)", 1e3 * j["ttft_s"], peer("ttft_s", 1e3), ".1f", "lower"),
            ("batch-1 decode (tok/s)", 1 / j["tpot_s"], 1 / hs["tpot_s"] if hs else None, ".1f"),
            ("batch-1 decode, ms/token", 1e3 * j["tpot_s"], peer("tpot_s", 1e3), ".2f", "lower"),
            (f"batch-{n} aggregate decode (tok/s)", j["batch_decode_tok_s"], peer("batch_decode_tok_s"), ".1f"),
            (f"batch-{n} aggregate end-to-end (tok/s)", j["batch_e2e_tok_s"], peer("batch_e2e_tok_s"), ".1f"),
        ]),
        "",
        f"jaxinfer TTFT wall clock around llm.generate: {1e3 * j['ttft_wall_s']:.1f} ms; "
        f"batch-1 ms/token from the wall clock: {1e3 * j['tpot_wall_s']:.2f}",
    ]
    if h:
        s, i = h["summary"], h["info"]
        L.append(
            f"transformers ({i['attn']} attention, {i['threads']} threads, torch {i['versions']['torch']}, "
            f"transformers {i['versions']['transformers']}): TTFT forward {1e3 * s['ttft_manual_s']:.1f} ms / generate "
            f"{1e3 * s['ttft_generate_s']:.1f} ms; decode loop with its cache {1e3 * s['tpot_manual_s']:.2f} ms/token / "
            f"generate {1e3 * s['tpot_generate_s']:.2f} ms/token (the table uses the faster of each)"
        )
        jr, hr = j["rounds"], h["rounds"]
        jb = min(r["tpot_s"] for r in jr)
        hb = min(min(r["tpot_manual_s"], r["tpot_generate_s"]) for r in hr)
        jt = min(r["ttft_s"] for r in jr)
        ht = min(min(r["ttft_manual_s"], r["ttft_generate_s"]) for r in hr)
        j8 = max(r["batch_decode_tok_s"] for r in jr)
        h8 = max(r["batch_decode_tok_s"] for r in hr)
        L.append(
            f"best round of each (least disturbed): batch-1 {1e3 * jb:.2f} vs {1e3 * hb:.2f} ms/token ({hb / jb:.2f}x), "
            f"TTFT {1e3 * jt:.1f} vs {1e3 * ht:.1f} ms ({ht / jt:.2f}x), batch-{n} decode {j8:.1f} vs "
            f"{h8:.1f} tok/s ({j8 / h8:.2f}x)"
        )
        L.append(
            f"greedy tokens agree with transformers for the first {res['agree_b1']} of {res['decode_tokens']} "
            f"(batch 1) and {res['agree_b8']} of {res['decode_tokens']} (batch row 0)"
        )
    L.append(
        f"batch-{n} aggregate decode = output tokens after each request's first / (last token - the moment all {n} "
        "have their first token, i.e. all prefills done); end-to-end = all output tokens / wall time of the call"
    )
    c = res["cache"]
    L += ["", f"decode step (jitted, blocking, inputs on device), batch 1 at context {c['context']}:"]
    for k in ("1x", "8x", "engine"):
        d = c[k]
        L.append(
            f"  cache {k:<6} {d['num_pages']:>5} pages = {d['capacity_tokens']:>6} tokens "
            f"({d['cache_bytes'] / 1e6:>6.0f} MB): step {1e3 * d['step_s']:.2f} ms (min {1e3 * d['step_min_s']:.2f}), "
            f"through the runner {1e3 * d['runner_step_s']:.2f} ms"
        )
    d = c[f"engine_b{c['batch']}"]
    L += [
        f"  batch {c['batch']}, engine cache: step {1e3 * d['step_s']:.2f} ms (min {1e3 * d['step_min_s']:.2f}) "
        f"= {c['batch'] / d['step_s']:.1f} tok/s aggregate; {d['step_s'] / c['engine']['step_s']:.2f}x the batch-1 step",
        f"  8x / 1x step time: {c['ratio_8x_1x']:.3f}",
        f"  floor / step: {res['floor_over_step']:.2f} (device step alone), "
        f"{res['floor_over_tpot']:.2f} (streamed batch-1 token)",
        f"  host share of a streamed token: {100 * res['host_share']:.0f}% "
        f"({1e3 * j['tpot_s']:.2f} ms/token streamed vs {1e3 * c['engine']['step_s']:.2f} ms device step)",
        "",
        *targets_block(res["targets"]),
    ]
    return "\n".join(L)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    p = parser("python -m benchmarks.core", __doc__, dtype=True, json_help="also write the figures as JSON to this file")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds (default 5)")
    hf_flags(p)
    p.add_argument("--cache-tokens", type=int, default=4096, help="KV capacity (tokens) of the 1x cache")
    p.add_argument("--step-context", type=int, default=None, help="context of the timed decode step (default prompt + decode)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per block")
    return settle(p, p.parse_args(argv), at_least={"decode_tokens": 2})


def main(argv=None) -> int:
    return run(measure, report, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
