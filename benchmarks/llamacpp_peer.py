"""llama.cpp as a peer: jaxinfer, llama.cpp and transformers side by side, in one run.

    python -m benchmarks.llamacpp_peer                         # everything, 2 alternating rounds
    python -m benchmarks.llamacpp_peer --quick                 # short: 8 requests, 32 new tokens
    python -m benchmarks.llamacpp_peer --systems jax:float32 llama:F32 --rounds 3 --json out.json

(from the repository root: ``benchmarks/`` is not installed with jaxinfer). llama.cpp runs
through llama-cpp-python in its own interpreter (``benchmarks/llamacpp_worker.py``, a
subprocess per model file, driven in JSON lines): ``--llama-python PATH`` or
``JAXINFER_LLAMA_PYTHON``, else ``/work/llamavenv/bin/python`` where that exists, else
llama.cpp is reported as skipped. transformers is the worker `benchmarks.core` uses
(``JAXINFER_HF_PYTHON`` / ``--hf-python``). This module imports neither llama_cpp nor torch.

Every system gets the same token ids (`benchmarks.core.make_prompts`: one 128-token
prompt and ``--batch`` distinct ones), 128 new tokens, greedy, end-of-sequence ignored:

* TTFT of the 128-token prompt (ms);
* batch-1 decode tokens/s (after the first token);
* ``--batch`` (32) requests at once, 128 in / 128 out: aggregate output tokens/s over the
  wall clock (prefill included), and the decode-only rate after every first token.
  jaxinfer: one `LLM.generate` of all of them (continuous batching). llama.cpp: one
  context with a KV stream per request, prompts prefilled together and one `llama_decode`
  per step for every sequence (the low-level ``llama_batch`` API, as its server batches
  slots); ``--llama-sequential`` runs them one after another instead. transformers:
  its static batch (``model.generate``).

Systems: jaxinfer float32 / bfloat16 / int8 / int4 (``quantization=``, where `jaxinfer.LLM`
has it), the same four on jaxinfer's XLA path (``xla:...``: ``JAXINFER_CPU_KERNELS=0`` for that engine,
the built-in peer; only when named, with PASS/FAIL for "never slower than it"), llama.cpp F32 / BF16 / Q8_0 / Q4_1 (the shipped Q4_1 file and copies
made from it by `benchmarks.gguf_variants`: the same weights), transformers float32 (the
Q4_1 file dequantized). jaxinfer runs with the prefix cache off, as llama.cpp's cache is
cleared before every run. Each round runs every system in turn (the order rotates
from round to round); a system's figure for a round is the median of ``--repeats`` runs
and the report gives the median over rounds (`jaxinfer.stats.median`).

The batch-1 floor: every weight byte is read once per decoded token, so bytes of weights /
the machine's read bandwidth as the engine's roofline measures it (`jaxinfer.tools.harness.peaks`)
bounds batch-1 decode.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from pathlib import Path
from typing import Optional

import jax

import jaxinfer
from jaxinfer.engine.compile_cache import compile_count
from jaxinfer.stats import median
from jaxinfer.tools.harness import (Bench, Worker, find_python, fmt, heading, load_average, parser, peaks, peaks_line,
                                   ratio, run, settle, table, target, targets_block, worker_flags)

from benchmarks.core import HFPeer, batch_round, common_prefix, find_hf_python, greedy, make_prompts

WORKER = Path(__file__).with_name("llamacpp_worker.py")
DEFAULT_LLAMA_PYTHON = "/work/llamavenv/bin/python"

# name -> (weights dtype, quantization, native CPU kernels). The xla: systems are jaxinfer with
# JAXINFER_CPU_KERNELS=0 (XLA's own products and the pure-JAX attention: the built-in peer, the path GPUs
# and TPUs take); they run only when named (--systems).
JAX_SYSTEMS = {
    "jax:float32": ("float32", None, True),
    "jax:bfloat16": ("bfloat16", None, True),
    "jax:int8": ("float32", "int8", True),
    "jax:int4": ("float32", "int4", True),
    "xla:float32": ("float32", None, False),
    "xla:bfloat16": ("bfloat16", None, False),
    "xla:int8": ("float32", "int8", False),
    "xla:int4": ("float32", "int4", False),
}
LLAMA_SYSTEMS = {"llama:F32": "F32", "llama:BF16": "BF16", "llama:Q8_0": "Q8_0", "llama:Q4_1": "Q4_1"}
HF_SYSTEMS = {"hf:float32": "float32"}
ALL_SYSTEMS = list(JAX_SYSTEMS) + list(LLAMA_SYSTEMS) + list(HF_SYSTEMS)
DEFAULT_SYSTEMS = [s for s in ALL_SYSTEMS if not s.startswith("xla:")]
LABELS = {
    "jax:float32": "jaxinfer float32",
    "jax:bfloat16": "jaxinfer bfloat16",
    "jax:int8": "jaxinfer int8",
    "jax:int4": "jaxinfer int4 (Q4_1 blocks)",
    "xla:float32": "jaxinfer float32, XLA path",
    "xla:bfloat16": "jaxinfer bfloat16, XLA path",
    "xla:int8": "jaxinfer int8, XLA path",
    "xla:int4": "jaxinfer int4, XLA path",
    "llama:F32": "llama.cpp F32",
    "llama:BF16": "llama.cpp BF16",
    "llama:Q8_0": "llama.cpp Q8_0",
    "llama:Q4_1": "llama.cpp Q4_1",
    "hf:float32": "transformers float32",
}
# precision groups for the floor and the side-by-side checks
PRECISION = {
    "jax:float32": "32-bit", "xla:float32": "32-bit", "llama:F32": "32-bit", "hf:float32": "32-bit",
    "jax:bfloat16": "16-bit", "xla:bfloat16": "16-bit", "llama:BF16": "16-bit",
    "jax:int8": "8-bit", "xla:int8": "8-bit", "llama:Q8_0": "8-bit",
    "jax:int4": "4-bit", "xla:int4": "4-bit", "llama:Q4_1": "4-bit",
}


def has_quantization() -> bool:
    return "quantization" in inspect.signature(jaxinfer.LLM).parameters


def find_llama_python(flag: Optional[str], off: Optional[str] = None) -> tuple:
    """(interpreter or None, how it was chosen / why skipped): --llama-python, JAXINFER_LLAMA_PYTHON, the default."""
    return find_python(flag, "JAXINFER_LLAMA_PYTHON", off=off, default=DEFAULT_LLAMA_PYTHON, missing=(
        "no llama-cpp-python interpreter; pass --llama-python or set JAXINFER_LLAMA_PYTHON "
        "(a Python with llama-cpp-python, e.g. pip install '.[benchmark]')"))


# --------------------------------------------------------------------------- #
# The systems
# --------------------------------------------------------------------------- #


class JaxSystem:
    kind = "jaxinfer"

    def __init__(self, name: str, model: str, dtype: str, quantization: Optional[str], a, kernels: bool = True):
        self.name = name
        kw = {"quantization": quantization} if quantization else {}
        # the native kernels on or off for this engine: its kernel choice is made when it is built
        before = os.environ.get("JAXINFER_CPU_KERNELS")
        os.environ["JAXINFER_CPU_KERNELS"] = "1" if kernels else "0"
        try:
            # the prefix cache off: every run prefills its whole prompt, as llama.cpp's (cleared) cache does
            self.llm = jaxinfer.LLM(model, dtype=dtype, enable_prefix_caching=False, **kw)
        finally:
            if before is None:
                del os.environ["JAXINFER_CPU_KERNELS"]
            else:
                os.environ["JAXINFER_CPU_KERNELS"] = before
        self.n, self.repeats, self.batch_repeats = a.decode_tokens, a.repeats, a.batch_repeats
        self.weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.llm.runner.params))
        self.info = {"load_s": self.llm.load_time_s, "dtype": self.llm.engine_config.dtype,
                     "quantization": quantization, "weight_bytes": self.weight_bytes}

    def set_prompts(self, prompt, batch_prompts) -> None:
        self.prompt, self.batch_prompts = prompt, batch_prompts

    def _ttft(self) -> float:
        return self.llm.generate([self.prompt], greedy(1))[0].metrics.ttft_s

    def _decode(self) -> tuple:
        out = self.llm.generate([self.prompt], greedy(self.n))[0]
        return out.metrics.tpot_s, list(out.outputs[0].token_ids), out.metrics.cached_tokens

    def warm(self) -> None:
        c0 = compile_count()
        t0 = time.perf_counter()
        self._ttft()
        self._decode()
        batch_round(self.llm, self.batch_prompts, self.n)
        self.info["warmup_s"] = time.perf_counter() - t0
        self.info["programs_compiled_in_warmup"] = compile_count() - c0
        self.info["recompiles_in_rounds"] = 0

    def round(self) -> dict:
        c0 = compile_count()
        k = self.repeats
        ttft = [self._ttft() for _ in range(k)]
        dec = [self._decode() for _ in range(k)]
        bat = [batch_round(self.llm, self.batch_prompts, self.n) for _ in range(self.batch_repeats)]
        self.info["recompiles_in_rounds"] += compile_count() - c0
        return {
            "ttft_s": median(ttft),
            "tpot_s": median([d[0] for d in dec]),
            "batch_e2e_tok_s": median([b["e2e_tok_s"] for b in bat]),
            "batch_decode_tok_s": median([b["decode_tok_s"] for b in bat]),
            "batch_wall_s": median([b["wall_s"] for b in bat]),
            "batch_all_first_s": median([b["all_first_tokens_s"] for b in bat]),
            "cached_tokens": sum(d[2] for d in dec) + sum(b["cached_tokens"] for b in bat),
            "ttft_samples_s": ttft,
            "tpot_samples_s": [d[0] for d in dec],
            "batch_e2e_samples": [b["e2e_tok_s"] for b in bat],
            "tokens": dec[-1][1],
            "batch_tokens_first": bat[-1]["tokens_first"],
        }

    def close(self) -> None:
        self.llm.close()


class LlamaSystem:
    kind = "llama.cpp"

    def __init__(self, name: str, python: str, path: Path, prompt, batch_prompts, a):
        self.name = name
        setup = {
            "mode": "bench", "model": str(path), "threads": a.threads, "prompt": list(prompt),
            "batch_prompts": [list(p) for p in batch_prompts], "decode_tokens": a.decode_tokens,
            "repeats": a.repeats, "batch_repeats": a.batch_repeats, "parallel": not a.llama_sequential,
        }
        self.worker = Worker(python, WORKER, setup, a.threads, name)
        self.info = dict(self.worker.info, path=str(path))
        self.weight_bytes = self.info["model_bytes"]

    def warm(self) -> None:
        pass  # the worker warms up before it answers its setup line

    def round(self) -> dict:
        return self.worker.round()

    def close(self) -> None:
        self.worker.close()


class HFSystem:
    kind = "transformers"

    def __init__(self, name: str, python: str, model_path: str, prompt, batch_prompts, a):
        self.name = name
        self.repeats = a.batch_repeats  # its worker times the batch-1 and the batch figures together
        self.peer = HFPeer(python, model_path, a.threads, "sdpa", prompt, batch_prompts, a.decode_tokens)
        self.info = self.peer.info
        self.weight_bytes = self.info.get("param_bytes")

    def warm(self) -> None:
        pass  # HFPeer's setup runs a warm-up round

    def round(self) -> dict:
        rs = [self.peer.round() for _ in range(self.repeats)]
        ttft = [min(r["ttft_manual_s"], r["ttft_generate_s"]) for r in rs]
        tpot = [min(r["tpot_manual_s"], r["tpot_generate_s"]) for r in rs]
        return {
            "ttft_s": median(ttft),
            "tpot_s": median(tpot),
            "batch_e2e_tok_s": median([r["batch_e2e_tok_s"] for r in rs]),
            "batch_decode_tok_s": median([r["batch_decode_tok_s"] for r in rs]),
            "batch_wall_s": median([r["batch_generate_s"] for r in rs]),
            "ttft_samples_s": ttft,
            "tpot_samples_s": tpot,
            "batch_e2e_samples": [r["batch_e2e_tok_s"] for r in rs],
            "tokens": rs[-1]["tokens_manual"],
            "batch_tokens_first": rs[-1]["batch_tokens_first"],
        }

    def close(self) -> None:
        self.peer.close()


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def targets(res: dict) -> list:
    s, out = res["summary"], []

    def add(name, name_a, name_b, key, need, value_fmt, lower_better=False):
        a, b = (s.get(name_a) or {}).get(key), (s.get(name_b) or {}).get(key)
        if a is None or b is None:
            missing = [LABELS[n] for n, v in ((name_a, a), (name_b, b)) if v is None]
            out.append(target(name, None, f"not measured: {', '.join(missing)}"))
            return
        r = ratio(a, b, lower_better)
        out.append(target(name, r >= need, value_fmt.format(a=a, b=b, r=r), ratio=r))

    for name_a, name_b, label in (("jax:float32", "llama:F32", "batch-1 decode: jaxinfer float32 >= llama.cpp F32"),
                                  ("jax:int8", "llama:Q8_0", "batch-1 decode: jaxinfer int8 >= llama.cpp Q8_0"),
                                  ("jax:int4", "llama:Q4_1", "batch-1 decode: jaxinfer int4 >= llama.cpp Q4_1")):
        add(label, name_a, name_b, "decode_tok_s", 1.0, "{a:.1f} vs {b:.1f} tok/s ({r:.2f}x)")
    b = res["batch"]
    seq = " (llama.cpp sequential)" if res["llama_batch_mode"] == "sequential" else ""
    add(f"{b} concurrent: jaxinfer float32 >= 1.5x llama.cpp F32{seq}", "jax:float32", "llama:F32",
        "batch_e2e_tok_s", 1.5, "{a:.1f} vs {b:.1f} tok/s ({r:.2f}x)")
    add(f"{b} concurrent: jaxinfer float32 >= 2.5x transformers float32", "jax:float32", "hf:float32",
        "batch_e2e_tok_s", 2.5, "{a:.1f} vs {b:.1f} tok/s ({r:.2f}x)")
    add(f"TTFT({res['prompt_len']}): jaxinfer float32 <= llama.cpp F32", "jax:float32", "llama:F32",
        "ttft_ms", 1.0, "{a:.1f} vs {b:.1f} ms ({r:.2f}x)", lower_better=True)
    for p in ("float32", "bfloat16", "int8", "int4"):  # never slower than XLA's own path, where it ran
        if f"xla:{p}" not in s:
            continue
        add(f"batch-1 decode: jaxinfer {p} >= its XLA path", f"jax:{p}", f"xla:{p}", "decode_tok_s", 1.0,
            "{a:.1f} vs {b:.1f} tok/s ({r:.2f}x)")
        add(f"{b} concurrent: jaxinfer {p} >= its XLA path", f"jax:{p}", f"xla:{p}", "batch_e2e_tok_s", 1.0,
            "{a:.1f} vs {b:.1f} tok/s ({r:.2f}x)")
        add(f"TTFT({res['prompt_len']}): jaxinfer {p} <= its XLA path", f"jax:{p}", f"xla:{p}", "ttft_ms", 1.0,
            "{a:.1f} vs {b:.1f} ms ({r:.2f}x)", lower_better=True)
    return out


def report(res: dict) -> str:
    L = heading(
        f"llama.cpp peer benchmark — {res['model']}; {res['threads']} threads for llama.cpp and torch; {res['batch']} "
        f"prompts of {res['prompt_len']} tokens, {res['decode_tokens']} new tokens, greedy, EOS ignored; medians of "
        f"{res['repeats']} runs per round ({res['batch_repeats']} of the concurrent batch), {res['rounds']} alternating "
        "rounds", res["system"])
    if res.get("llama_system_info"):
        L.append(f"llama.cpp {res.get('llama_version')}: {res['llama_system_info']}")
    L.append(f"{peaks_line(res['bandwidth'])}; the floor uses {res['bandwidth_gbs']:.1f} GB/s")
    L += [f"note: {line}" for line in res.get("notes", [])]
    L += ["", "batch-1 floor (weight bytes read per token / bandwidth):"]
    for name, f in res["floors"].items():
        L.append(f"  {LABELS[name]:<30} {f['weight_bytes'] / 1e6:>7.1f} MB -> {f['floor_ms']:>6.2f} ms/token = "
                 f"{f['floor_tok_s']:>6.1f} tok/s")
    s = res["summary"]
    ref = (s.get("llama:F32") or {}).get("batch_e2e_tok_s")
    rows, skipped = [], []
    for name in res["systems"]:
        v = s.get(name)
        if v is None:
            skipped.append(f"{LABELS[name]}: {res['skipped'].get(name, 'skipped')}")
            continue
        fl = res["floors"].get(name)
        rows.append([LABELS[name], fmt(v["ttft_ms"]), fmt(v["decode_tok_s"]),
                     fmt(100 * v["decode_tok_s"] / fl["floor_tok_s"] if fl else None, ".0f"),
                     fmt(v["batch_e2e_tok_s"]), fmt(v["batch_decode_tok_s"]),
                     f"{v['batch_e2e_tok_s'] / ref:.2f}x" if ref else "-"])
    L += ["", table(["system", "TTFT ms", "b1 tok/s", "floor %", f"{res['batch']} conc e2e", "decode-only", "vs F32"],
                    rows), *skipped, ""]
    L.append(
        f"{res['batch']} concurrent: e2e = all output tokens / wall clock of the whole batch (prefill included); "
        f"decode-only = tokens after each request's first / time after all first tokens. 'vs F32' = e2e / llama.cpp F32's."
    )
    if res["llama_batch_mode"] == "sequential":
        L.append("llama.cpp's batch ran its requests SEQUENTIALLY (--llama-sequential): one after another, not batched.")
    elif any(n.startswith("llama:") for n in s):
        L.append(
            "llama.cpp's batch: one context, a KV stream per request (n_seq_max = batch), prompts prefilled together "
            "in 2048-token batches, then one llama_decode per step for all sequences (low-level llama_batch API)."
        )
    L.append("per-round figures (TTFT ms / batch-1 tok/s / concurrent e2e tok/s):")
    for name in res["systems"]:
        rs = res["rounds_by_system"].get(name)
        if rs:
            L.append(f"  {LABELS[name]:<30} "
                     + "  ".join(f"{1e3 * r['ttft_s']:.1f}/{1 / r['tpot_s']:.1f}/{r['batch_e2e_tok_s']:.1f}" for r in rs))
    agree = res.get("agreement", {})
    if agree:
        L.append(
            f"greedy tokens, batch 1, agreeing with {LABELS[res['agreement_ref']]} for the first k of "
            f"{res['decode_tokens']}: " + ", ".join(f"{LABELS[k]} {v}" for k, v in agree.items())
        )
    for name, info in res["infos"].items():
        if name.startswith(("jax:", "xla:")):
            L.append(
                f"{LABELS[name]}: load {info['load_s']:.1f} s, warm-up {info.get('warmup_s', 0):.1f} s "
                f"({info.get('programs_compiled_in_warmup')} programs), {info.get('recompiles_in_rounds')} compiled "
                "during the rounds"
            )
        elif name.startswith("llama:"):
            L.append(f"{LABELS[name]}: {Path(info['path']).name}, {info['model_bytes'] / 1e6:.1f} MB, "
                     f"load {info['load_s']:.2f} s")
        elif name.startswith("hf:"):
            v = info.get("versions", {})
            L.append(f"{LABELS[name]}: {info.get('attn')} attention, {info.get('threads')} threads, torch "
                     f"{v.get('torch')}, transformers {v.get('transformers')}")
    L += ["", *targets_block(res["targets"])]
    return "\n".join(L)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    p = parser("python -m benchmarks.llamacpp_peer", __doc__, rounds=2,
               quick="short: 8 requests, 32 new tokens, 1 run per round")
    p.add_argument("--systems", nargs="+", default=None, choices=ALL_SYSTEMS, metavar="SYSTEM",
                   help=f"which to run (default all but the xla: ones): {' '.join(ALL_SYSTEMS)}")
    p.add_argument("--skip", nargs="+", default=[], choices=ALL_SYSTEMS, metavar="SYSTEM", help="leave these out")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of TTFT and batch-1 decode per round (default 3, --quick 1)")
    p.add_argument("--batch-repeats", type=int, default=None,
                   help="runs of the concurrent batch per round (default: --repeats); transformers' worker times "
                        "all its figures together, so it runs this many times")
    p.add_argument("--batch", type=int, default=None, help="concurrent requests (default 32, --quick 8)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=None, help="new tokens (default 128, --quick 32)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp and torch threads (default: the cores)")
    worker_flags(p, "llama", "llama-cpp-python for the llama.cpp")
    p.add_argument("--llama-sequential", action="store_true",
                   help="run llama.cpp's concurrent requests one after another instead of batched")
    worker_flags(p, "hf", "torch + transformers (+ gguf) for the transformers")
    a = settle(p, p.parse_args(argv), quick={"repeats": (3, 1), "batch": (32, 8), "decode_tokens": (128, 32)},
               at_least={"decode_tokens": 2})
    a.batch_repeats = a.batch_repeats or a.repeats
    a.systems = [s for s in ALL_SYSTEMS if s in (a.systems or DEFAULT_SYSTEMS) and s not in a.skip]
    return a


def start_peers(b: Bench, systems: dict, names: list, python: Optional[str], why: str, make) -> None:
    """Each of `names` started by ``make(name)`` into `systems` (one that fails to start is skipped, and
    said why), or all skipped for `why` where there is no interpreter `python`."""
    for name in names:
        sysm = b.start(name, lambda: make(name)) if python else b.skip(name, why)
        if sysm is not None:
            systems[name] = sysm


def start_systems(b: Bench, systems: dict) -> tuple:
    """Load every chosen system into `systems` (the jaxinfer ones first: their tokenizer makes the prompts);
    (prompt, batch_prompts)."""
    a, res, log = b.args, b.figures, b.log
    prompt = batch_prompts = None
    for name in [s for s in a.systems if s in JAX_SYSTEMS]:
        dtype, quant, native = JAX_SYSTEMS[name]
        if quant and not has_quantization():
            b.skip(name, "skipped: jaxinfer.LLM has no quantization= argument yet")
            continue
        log(f"loading {name} (dtype={dtype}, quantization={quant}, native kernels {'on' if native else 'off'})")
        sysm = b.start(name, lambda: JaxSystem(name, a.model, dtype, quant, a, kernels=native))
        if sysm is None:
            continue
        if prompt is None:
            prompt, batch_prompts = make_prompts(sysm.llm, a.prompt_len, a.batch)
        sysm.set_prompts(prompt, batch_prompts)
        systems[name] = sysm
    if prompt is None:  # no jaxinfer system: a float32 engine just for the tokenizer
        tmp = jaxinfer.LLM(a.model, dtype="float32")
        prompt, batch_prompts = make_prompts(tmp, a.prompt_len, a.batch)
        tmp.close()
    res["prompt_ids"] = list(prompt)

    from jaxinfer.loading.weights import resolve_model

    src = Path(resolve_model(a.model).path)
    llama_names = [s for s in a.systems if s in LLAMA_SYSTEMS]
    if llama_names:
        lpy, why = find_llama_python(a.llama_python, off=a.no_llama and "--no-llama")
        res["llama_python"] = lpy or why
        if lpy and src.suffix != ".gguf":
            lpy, why = None, f"skipped: {src} is not a GGUF file"

        def llama(name):
            from benchmarks import gguf_variants

            path = gguf_variants.variants(src, [LLAMA_SYSTEMS[name]], log=log)[LLAMA_SYSTEMS[name]]
            log(f"starting {name} ({path.name}; load + warm-up)")
            return LlamaSystem(name, lpy, path, prompt, batch_prompts, a)

        start_peers(b, systems, llama_names, lpy, why, llama)
    hf_names = [s for s in a.systems if s in HF_SYSTEMS]
    if hf_names:
        hpy, why = find_hf_python(a.hf_python, off=a.no_hf and "--no-hf")
        res["transformers_python"] = hpy or why

        def hf(name):
            log(f"starting {name} ({hpy}; load + a warm-up round)")
            return HFSystem(name, hpy, str(src), prompt, batch_prompts, a)

        start_peers(b, systems, hf_names, hpy, why, hf)
    return prompt, batch_prompts


def summarize(res: dict, rounds: dict, systems: list) -> None:
    summary, floors = {}, {}
    for name in systems:
        rs = rounds.get(name)
        if not rs:
            continue
        summary[name] = {
            "ttft_ms": 1e3 * median([r["ttft_s"] for r in rs]),
            "decode_tok_s": 1 / median([r["tpot_s"] for r in rs]),
            "batch_e2e_tok_s": median([r["batch_e2e_tok_s"] for r in rs]),
            "batch_decode_tok_s": median([r["batch_decode_tok_s"] for r in rs]),
        }
        info = res["infos"].get(name, {})
        wb = info.get("weight_bytes") or info.get("model_bytes") or info.get("param_bytes")
        if wb:
            floor_s = wb / (res["bandwidth_gbs"] * 1e9)
            floors[name] = {"weight_bytes": wb, "floor_ms": 1e3 * floor_s, "floor_tok_s": 1 / floor_s}
    res["summary"], res["floors"] = summary, floors
    res["rounds_by_system"] = by = {n: rs for n, rs in rounds.items() if rs}
    ref = "llama:F32" if "llama:F32" in by else next(iter(by), None)
    if ref:
        res["agreement_ref"] = ref
        res["agreement"] = {n: common_prefix(rs[-1]["tokens"], by[ref][-1]["tokens"]) for n, rs in by.items() if n != ref}


def measure(b: Bench) -> None:
    a, res, log = b.args, b.figures, b.log
    res.update(model=a.model, batch=a.batch, prompt_len=a.prompt_len, decode_tokens=a.decode_tokens, repeats=a.repeats,
               batch_repeats=a.batch_repeats, rounds=a.rounds, threads=a.threads, systems=a.systems,
               llama_batch_mode="sequential" if a.llama_sequential else "parallel", skipped={}, notes=[], infos={})
    systems: dict = {}
    try:
        start_systems(b, systems)
        log("the machine's peaks (the engine's roofline probes, cached per machine)")  # after the kernels load
        res["bandwidth"] = peaks()
        res["bandwidth_gbs"] = res["bandwidth"]["bandwidth_gbs"]
        for name, sysm in systems.items():
            res["infos"][name] = sysm.info  # the same dict: what warm() and the rounds add shows up
            if sysm.kind == "jaxinfer":
                log(f"warm-up {name}: one run of each figure (compiles its shapes)")
                sysm.warm()
        def dropped(name, why):  # reported; the others go on
            res["skipped"][name] = why
            systems.pop(name).close()

        rounds = b.rounds({n: (lambda i, s=s: s.round()) for n, s in systems.items()}, may_fail=True, on_fail=dropped)
        res["system"]["loadavg_end"] = load_average()
        llama_infos = [info for name, info in res["infos"].items() if name.startswith("llama:")]
        if llama_infos:
            res["llama_system_info"] = llama_infos[0].get("system_info")
            res["llama_version"] = llama_infos[0].get("version")
    finally:
        for sysm in systems.values():
            try:
                sysm.close()
            except Exception:
                pass

    summarize(res, rounds, a.systems)
    if any(s in JAX_SYSTEMS and JAX_SYSTEMS[s][1] for s in a.systems) and not has_quantization():
        res["notes"].append("jaxinfer int8 / int4 rows skipped: jaxinfer.LLM has no quantization= argument in this checkout")
    cached = {n: sum(r.get("cached_tokens", 0) for r in rs) for n, rs in res["rounds_by_system"].items() if n in JAX_SYSTEMS}
    if any(cached.values()):
        res["notes"].append(f"prefix-cache hits during the rounds (should be none): {cached}")
    busy = max((res["system"].get(k) or [0])[0] for k in ("loadavg", "loadavg_end"))
    if busy > 0.5 * (os.cpu_count() or 1):
        res["notes"].append(
            f"the machine was busy (1-minute load average up to {busy:.1f} on {os.cpu_count()} CPUs): every figure is "
            "unreliable, llama.cpp's most (its OpenMP threads spin-wait for each other)"
        )
    res["targets"] = targets(res)


def main(argv=None) -> int:
    return run(measure, report, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
