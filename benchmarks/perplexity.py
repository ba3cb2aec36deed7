"""Perplexity of jaxinfer's precisions and llama.cpp's on one fixed text, computed the same way.

    python -m benchmarks.perplexity                      # every row, 512-token windows
    python -m benchmarks.perplexity --quick              # the first 2 windows only
    python -m benchmarks.perplexity --systems jax:float32 jax:int8 --ctx 256 --json ppl.json

(from the repository root: ``benchmarks/`` is not installed with jaxinfer).

The text (``benchmarks/texts/``, its source and licence in the README there) is
tokenized once with jaxinfer's tokenizer, without a chat template or special tokens;
where the model's tokenizer adds a BOS token, each window starts with it in place of its
first token, as llama.cpp's ``perplexity`` tool does. The tokens are cut into
non-overlapping windows of ``--ctx`` tokens (what does not fill a whole window is left
out); each window is evaluated from an empty cache and only its second half is scored:
the log-probability of token j+1 from the logits at position j, for j from ctx/2 to
ctx - 2 (llama.cpp's method: every scored token sees at least ctx/2 tokens of context).
perplexity = exp(-mean log-probability) over every scored token of every window.

Rows: jaxinfer float32, int8, int4 (the file's Q4_1 blocks as they are), and int4
requantized from float32 (the float32 model saved with `jaxinfer.loading.checkpoint.save_model`
and loaded back with ``quantization="int4"``); llama.cpp F32, Q8_0, Q4_1 on the same token
ids (the shipped Q4_1 file, and F32 / Q8_0 copies of it from `benchmarks.gguf_variants`),
through llama-cpp-python with ``logits_all=True`` in its own interpreter
(``benchmarks/llamacpp_worker.py``; ``--llama-python`` / ``JAXINFER_LLAMA_PYTHON``).
jaxinfer's logits come from the model family's ``forward`` + ``logits`` over the whole
window in one chunk, through a paged KV cache of its own, with the loaded engine's parameters.

Each row's perplexity is compared to its own system's float32 one; the checks: jaxinfer
int8 within 1%, int4 within 5%. Top-1 agreement: how often the argmax at a scored
position is the float32 row's argmax.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.ops import kv_cache
from jaxinfer.ops.attention import AttentionMetadata
from jaxinfer.models import get_family

from jaxinfer.tools.harness import (Bench, Worker, fmt, heading, parser, run, settle, table, target, targets_block,
                                   worker_flags)

from benchmarks.llamacpp_peer import WORKER, find_llama_python

TEXT = Path(__file__).with_name("texts") / "python_reference_execmodel_import.txt"

# name -> (dtype, quantization, requantize from a saved float32 model)
JAX_ROWS = {
    "jax:float32": ("float32", None, False),
    "jax:bfloat16": ("bfloat16", None, False),
    "jax:int8": ("float32", "int8", False),
    "jax:int4": ("float32", "int4", False),
    "jax:int4-requant": ("float32", "int4", True),
}
LLAMA_ROWS = {"llama:F32": "F32", "llama:BF16": "BF16", "llama:Q8_0": "Q8_0", "llama:Q4_1": "Q4_1"}
DEFAULT_ROWS = ["jax:float32", "jax:int8", "jax:int4", "jax:int4-requant", "llama:F32", "llama:Q8_0", "llama:Q4_1"]
ALL_ROWS = list(JAX_ROWS) + list(LLAMA_ROWS)
LABELS = {
    "jax:float32": "jaxinfer float32",
    "jax:bfloat16": "jaxinfer bfloat16",
    "jax:int8": "jaxinfer int8",
    "jax:int4": "jaxinfer int4 (Q4_1 blocks)",
    "jax:int4-requant": "jaxinfer int4 requantized from float32",
    "llama:F32": "llama.cpp F32",
    "llama:BF16": "llama.cpp BF16",
    "llama:Q8_0": "llama.cpp Q8_0",
    "llama:Q4_1": "llama.cpp Q4_1",
}
# a row's own float32 reference, and the check it has to pass (relative ppl increase allowed)
REFERENCE = {n: "jax:float32" for n in JAX_ROWS} | {n: "llama:F32" for n in LLAMA_ROWS}
LIMITS = {"jax:int8": 0.01, "jax:int4": 0.05, "jax:int4-requant": 0.05}


def windows_of(ids: list, ctx: int, bos) -> list:
    """Non-overlapping `ctx`-token windows; the first token of each is BOS when `bos` is not None."""
    out = []
    for i in range(len(ids) // ctx):
        w = list(ids[i * ctx : (i + 1) * ctx])
        if bos is not None:
            w[0] = bos
        out.append(w)
    return out


# --------------------------------------------------------------------------- #
# jaxinfer: logits at every position of a window
# --------------------------------------------------------------------------- #


class JaxScorer:
    """log p(next token) and the argmax at every position of a window, on an LLM's parameters."""

    def __init__(self, llm, ctx: int):
        self.params = llm.runner.params
        cfg = self.cfg = llm.model_config
        family = get_family(cfg.architecture)
        ps = llm.engine_config.page_size
        self.ps = ps
        self.pages = -(-ctx // ps)
        self.engine = llm.engine_config.replace(num_pages=self.pages + 1)  # page 0 stays unused, as in the engine

        def score(params, tokens, targets, cache, attn):
            hidden, cache = family.forward(params, cfg, tokens, cache, attn)
            logits = family.logits(params, cfg, hidden[0])  # [T, V] float32
            logp = jax.nn.log_softmax(logits, axis=-1)
            picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
            return picked, jnp.argmax(logits, axis=-1)

        self.fn = jax.jit(score)

    def window(self, w: list, first: int) -> tuple:
        n = len(w)
        table = np.arange(1, self.pages + 1, dtype=np.int32)[None]
        pos = np.arange(n, dtype=np.int32)[None]
        attn = AttentionMetadata(pos, kv_cache.slots_for(table, pos, self.ps).astype(np.int32), table,
                                 np.array([n], np.int32))
        cache = kv_cache.init_cache(self.cfg, self.engine)  # empty for every window
        targets = np.asarray(list(w[1:]) + [0], np.int32)
        lp, top = self.fn(self.params, jnp.asarray([w], jnp.int32), jnp.asarray(targets), cache, attn)
        lp, top = np.asarray(lp), np.asarray(top)
        return lp[first : n - 1].astype(np.float64).tolist(), top[first : n - 1].tolist()


def jax_row(name: str, model: str, windows: list, first: int, a, log, float_llm=None) -> dict:
    dtype, quant, requant = JAX_ROWS[name]
    kw = {"quantization": quant} if quant else {}
    tmp = None
    t0 = time.perf_counter()
    if requant:
        from jaxinfer.loading.checkpoint import save_model

        src = float_llm
        own = src is None
        if own:
            src = jaxinfer.LLM(model, dtype="float32", enable_prefix_caching=False)
        tmp = tempfile.TemporaryDirectory(prefix="jaxinfer-ppl-f32-")
        path = Path(tmp.name) / "model"
        log(f"{name}: saving the float32 model to {path}")
        save_model(path, src.model_config, src.runner.params, src.tokenizer, src.generation_defaults, dtype="float32")
        if own:
            src.close()
        model = str(path)
    try:
        llm = jaxinfer.LLM(model, dtype=dtype, enable_prefix_caching=False, **kw)
        load_s = time.perf_counter() - t0
        scorer = JaxScorer(llm, a.ctx)
        t0 = time.perf_counter()
        logp, top1 = [], []
        for w in windows:
            lp, top = scorer.window(w, first)
            logp.append(lp)
            top1.append(top)
        info = {"load_s": load_s, "eval_s": time.perf_counter() - t0, "dtype": llm.engine_config.dtype,
                "quantization": getattr(llm.model_config, "quant", None) or None,
                "weight_bytes": sum(x.nbytes for x in jax.tree.leaves(llm.runner.params))}
        llm.close()
        return {"logp": logp, "top1": top1, "info": info}
    finally:
        if tmp is not None:
            tmp.cleanup()


def llama_row(name: str, python: str, path: Path, windows: list, first: int, a) -> dict:
    setup = {"mode": "perplexity", "model": str(path), "threads": a.threads, "windows": windows, "score_from": first}
    w = Worker(python, WORKER, setup, a.threads, name)
    try:
        out = w.info
    finally:
        w.close()
    return {"logp": out["logp"], "top1": out["top1"],
            "info": {"load_s": out["load_s"], "eval_s": out["eval_s"], "path": str(path), "version": out["version"]}}


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def ppl_of(logp: list) -> float:
    flat = [x for w in logp for x in w]
    return math.exp(-sum(flat) / len(flat))


def agreement(a: list, b: list) -> float:
    xs = [x == y for wa, wb in zip(a, b) for x, y in zip(wa, wb)]
    return sum(xs) / len(xs)


def summarize(res: dict) -> None:
    rows = res["rows"]
    for name, r in rows.items():
        r["ppl"] = ppl_of(r["logp"])
        r["scored"] = sum(len(w) for w in r["logp"])
    for name, r in rows.items():
        ref = rows.get(REFERENCE[name])
        if ref is not None:
            r["ratio"] = r["ppl"] / ref["ppl"]
            r["top1_agree"] = agreement(r["top1"], ref["top1"])
        lim = LIMITS.get(name)
        if lim is not None and "ratio" in r:
            r["check"] = {"limit": lim, "pass": r["ratio"] <= 1 + lim}
    if "jax:float32" in rows and "llama:F32" in rows:
        a, b = rows["jax:float32"], rows["llama:F32"]
        diffs = [abs(x - y) for wa, wb in zip(a["logp"], b["logp"]) for x, y in zip(wa, wb)]
        res["cross_f32"] = {"ppl_ratio": a["ppl"] / b["ppl"], "top1_agree": agreement(a["top1"], b["top1"]),
                            "max_abs_logp_diff": max(diffs), "mean_abs_logp_diff": sum(diffs) / len(diffs)}
    if "jax:int4" in rows and "llama:Q4_1" in rows:
        a, b = rows["jax:int4"], rows["llama:Q4_1"]
        res["cross_q4"] = {"ppl_ratio": a["ppl"] / b["ppl"], "top1_agree": agreement(a["top1"], b["top1"])}


def targets(res: dict) -> list:
    out = []
    for name in ("jax:int8", "jax:int4", "jax:int4-requant"):
        if name not in res["order"]:
            continue
        r, goal = res["rows"].get(name), f"{LABELS[name]} ppl within {100 * LIMITS[name]:.0f}% of float32"
        if r is None or "check" not in r:
            out.append(target(goal, None, res["skipped"].get(name, "no float32 row")))
        else:
            out.append(target(goal, r["check"]["pass"], f"{r['ppl']:.4f} vs {res['rows']['jax:float32']['ppl']:.4f} "
                              f"({100 * (r['ratio'] - 1):+.2f}%)"))
    return out


def report(res: dict) -> str:
    L = heading(
        f"perplexity — {res['model']}; text {res['text']} ({res['text_tokens']} tokens, jaxinfer's tokenizer, "
        f"no chat template{', BOS first in each window' if res['bos'] is not None else ', no BOS (the model adds none)'})",
        res["system"])
    L.insert(1, f"{res['windows']} non-overlapping windows of {res['ctx']} tokens, each from an empty cache; scored: "
                f"positions {res['score_from']}..{res['ctx'] - 2} of each (the next token's log-probability), "
                f"{res['scored']} tokens in all")
    L += [f"note: {n}" for n in res.get("notes", [])]
    rows, skipped = [], []
    for name in res["order"]:
        r = res["rows"].get(name)
        if r is None:
            skipped.append(f"{LABELS[name]}: {res['skipped'].get(name, 'skipped')}")
            continue
        own = REFERENCE[name] == name
        chk = ""
        if "check" in r:
            c = r["check"]
            chk = f"[{'PASS' if c['pass'] else 'FAIL'}] within {100 * c['limit']:.0f}% ({100 * (r['ratio'] - 1):+.2f}%)"
        elif not own and "ratio" in r:
            chk = f"({100 * (r['ratio'] - 1):+.2f}%)"
        rows.append([LABELS[name], f"{r['ppl']:.4f}", fmt(r.get("ratio"), ".4f"),
                     f"{100 * r['top1_agree']:.2f}%" if "top1_agree" in r and not own else "-", chk])
    L += ["", table(["row", "ppl", "vs own f32", "top-1 = f32", "check"], rows, left=(0, 4)), *skipped, ""]
    c = res.get("cross_f32")
    if c:
        L.append(
            f"jaxinfer float32 vs llama.cpp F32 (the same weights): ppl ratio {c['ppl_ratio']:.5f}, top-1 agreement "
            f"{100 * c['top1_agree']:.2f}%, |log p| difference mean {c['mean_abs_logp_diff']:.2e}, max {c['max_abs_logp_diff']:.2e}"
        )
    c = res.get("cross_q4")
    if c:
        L.append(
            f"jaxinfer int4 vs llama.cpp Q4_1 (the same Q4_1 blocks): ppl ratio {c['ppl_ratio']:.5f}, "
            f"top-1 agreement {100 * c['top1_agree']:.2f}%"
        )
    for name in res["order"]:
        r = res["rows"].get(name)
        if r is not None:
            i = r["info"]
            extra = f", {i['weight_bytes'] / 1e6:.0f} MB of weights" if "weight_bytes" in i else ""
            L.append(f"{LABELS[name]}: load {i['load_s']:.1f} s, scoring {i['eval_s']:.1f} s{extra}")
    L += ["", *targets_block(res["targets"])]
    return "\n".join(L)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    p = parser("python -m benchmarks.perplexity", __doc__, quick="the first 2 windows only",
               json_help="also write the figures (not the per-token values) as JSON")
    p.add_argument("--text", default=str(TEXT), help="a UTF-8 text file (default: the committed one)")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (even)")
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--systems", nargs="+", default=None, choices=ALL_ROWS, metavar="ROW",
                   help=f"rows to compute (default: {' '.join(DEFAULT_ROWS)}; also jax:bfloat16, llama:BF16)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads")
    worker_flags(p, "llama", "llama-cpp-python for the llama.cpp")
    a = settle(p, p.parse_args(argv), quick={"max_windows": (None, 2)}, at_least={"ctx": 4})
    if a.ctx % 2:
        p.error(f"--ctx must be an even number, got {a.ctx}")
    a.systems = [s for s in ALL_ROWS if s in (a.systems or DEFAULT_ROWS)]
    return a


def jax_rows(b: Bench, f32, windows: list, first: int) -> None:
    """Score every jaxinfer row (float32 on the engine already loaded) into ``figures["rows"]``."""
    a, res = b.args, b.figures
    quant_ok = "quantization" in inspect.signature(jaxinfer.LLM).parameters
    for name in [s for s in a.systems if s in JAX_ROWS]:
        if JAX_ROWS[name][1] and not quant_ok:
            b.skip(name, "skipped: jaxinfer.LLM has no quantization= argument yet")
            continue
        b.log(f"{name}: scoring {len(windows)} windows")

        def score(name=name):
            if name != "jax:float32":
                return jax_row(name, a.model, windows, first, a, b.log, float_llm=f32)
            scorer = JaxScorer(f32, a.ctx)
            t0 = time.perf_counter()
            logp, top1 = zip(*(scorer.window(w, first) for w in windows))
            return {"logp": list(logp), "top1": list(top1), "info": {
                "load_s": f32.load_time_s, "eval_s": time.perf_counter() - t0, "dtype": "float32",
                "weight_bytes": sum(x.nbytes for x in jax.tree.leaves(f32.runner.params))}}

        row = b.start(name, score)
        if row is not None:
            res["rows"][name] = row
    if not quant_ok and any(JAX_ROWS[s][1] for s in a.systems if s in JAX_ROWS):
        res["notes"].append("jaxinfer int8 / int4 rows skipped: jaxinfer.LLM has no quantization= argument in this checkout")


def llama_rows(b: Bench, windows: list, first: int) -> None:
    """Score every llama.cpp row in its worker into ``figures["rows"]`` (skipped without an interpreter)."""
    a, res = b.args, b.figures
    names = [s for s in a.systems if s in LLAMA_ROWS]
    if not names:
        return
    py, why = find_llama_python(a.llama_python, off=a.no_llama and "--no-llama")
    from jaxinfer.loading.weights import resolve_model

    src = Path(resolve_model(a.model).path)
    if py and src.suffix != ".gguf":
        py, why = None, f"skipped: {src} is not a GGUF file"
    for name in names:
        if not py:
            b.skip(name, why)
            continue
        from benchmarks import gguf_variants

        def score(name=name):
            t = LLAMA_ROWS[name]
            path = gguf_variants.variants(src, [t], log=b.log)[t]
            b.log(f"{name}: scoring {len(windows)} windows ({path.name})")
            return llama_row(name, py, path, windows, first, a)

        row = b.start(name, score)
        if row is not None:
            res["rows"][name] = row


def measure(b: Bench) -> None:
    a, res = b.args, b.figures
    text_path = Path(a.text)
    res.update(model=a.model, ctx=a.ctx, order=a.systems, rows={}, skipped={}, notes=[], text=text_path.name)
    b.log("loading jaxinfer float32 (the tokenizer and the float32 row)")
    f32 = jaxinfer.LLM(a.model, dtype="float32", enable_prefix_caching=False)
    tok = f32.tokenizer
    ids = tok.encode(text_path.read_text(encoding="utf-8"), add_special_tokens=False)
    bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
    windows = windows_of(ids, a.ctx, bos)[: a.max_windows or None]
    if not windows:
        raise SystemExit(f"{text_path} has {len(ids)} tokens: not one window of {a.ctx}")
    first = a.ctx // 2
    res.update(text_tokens=len(ids), bos=bos, windows=len(windows), score_from=first,
               scored=len(windows) * (a.ctx - 1 - first))
    jax_rows(b, f32, windows, first)
    f32.close()
    del f32
    llama_rows(b, windows, first)
    summarize(res)
    res["targets"] = targets(res)


def without_tokens(res: dict) -> dict:
    """The figures for ``--json``: every row without its per-token values."""
    return dict(res, rows={n: {k: v for k, v in r.items() if k not in ("logp", "top1")} for n, r in res["rows"].items()})


def main(argv=None) -> int:
    return run(measure, report, parse_args(argv), json_figures=without_tokens)


if __name__ == "__main__":
    sys.exit(main())
