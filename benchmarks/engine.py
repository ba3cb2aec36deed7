"""Continuous-batching benchmark: the engine under load, against transformers' static batch.

    JAXINFER_HF_PYTHON=/path/to/venv-with-torch/bin/python python -m benchmarks.engine
    python -m benchmarks.engine --quick --no-hf --json engine.json

(from the repository root: ``benchmarks/`` is not installed with jaxinfer).

What it measures, all in one process (transformers in a subprocess, ``benchmarks/hf_peer.py``
in ``"batch"`` mode), on the engine preset of this backend:

1. **throughput**: 32 requests of 128 prompt tokens and 64 output tokens
   submitted at once (greedy, ``ignore_eos``) through ``LLM.generate``, vs
   transformers' static batch of 32 (``model.generate``) on the same weights,
   in alternating rounds; the ratio of output tokens/s (wall clock, prefill
   included), the decode-only rates, and the machine's compute ceiling
   (a jitted float32 matmul's GFLOP/s over the model's FLOPs per token);
2. **serving**: the ``jaxinfer bench`` driver (`serving.LibraryBackend`) at
   concurrency 1, 8 and 32: output tokens/s, TTFT and ITL p50 / p99;
3. **prefix cache**: TTFT of a request whose 1,000-token system prompt is cached
   vs. an engine without the prefix cache, and the ``cached_tokens`` it reports;
4. **host share** of a steady decode step at batch 1 and 8 (engine stats), next
   to the jitted step alone and the model's matmuls at each batch size;
5. **stall**: the longest gap of 8 running streams while a 2,000-token prompt is
   prefilled in chunks, vs. their usual gap and vs. one 512-token chunk step.

Every shape is run once before it is measured. Random token ids are fresh for
every measured request unless a prefix hit is the point, so the prefix cache
never helps a figure by accident. Figures are medians over rounds (`jaxinfer.stats.median`).
"""

from __future__ import annotations

import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.engine.compile_cache import compile_count
from jaxinfer.tools import serving
from jaxinfer.metrics import RequestMetrics
from jaxinfer.stats import median
from jaxinfer.loading.weights import resolve_model

from jaxinfer.tools.harness import (Bench, Worker, alternate, compare, dropping, fmt, heading, load_average, medians,
                                   parser, run, settle, table, target, targets_block, timings)

from benchmarks.core import (HF_PEER, StepBench, batch_round, common_prefix, greedy, hf_flags, start_hf_peer,
                             step_rounds, twin)


class Ids:
    """Fresh random prompt ids from one seeded stream (away from the vocabulary's special ends)."""

    def __init__(self, vocab_size: int, seed: int):
        self.vocab = vocab_size
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list:
        return serving.random_token_ids(self.rng, n, self.vocab)


# --------------------------------------------------------------------------- #
# Compute ceiling
# --------------------------------------------------------------------------- #


def matmul_gflops(m: int = 4096, k: int = 576, n: int = 1536, repeats: int = 7, dtype="float32") -> float:
    """GFLOP/s of a jitted [m,k] x [k,n] matmul in `dtype`, accumulated in float32 (median of `repeats`)."""
    a = (jnp.ones((m, k), jnp.float32) * 0.01).astype(dtype)
    b = (jnp.ones((k, n), jnp.float32) * 0.01).astype(dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2.0 * m * k * n / median(timings(lambda: f(a, b).block_until_ready(), repeats, warmup=1)) / 1e9


def model_flops(cfg, context: float = 0.0, with_head: bool = True) -> float:
    """FLOPs to run one token through the model: 2 x the matmul weights (+ attention over `context`)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    weights = cfg.num_layers * per_layer + (d * cfg.vocab_size if with_head else 0)
    attn = cfg.num_layers * 4 * q * context  # scores + weighted sum
    return 2.0 * weights + attn


def ceiling(cfg, gflops: float, n_req: int, prompt_len: int, out_len: int) -> dict:
    """Output tokens/s if every FLOP ran at the measured matmul rate."""
    # decode: each output token after the first is one token through the model, at a mean context
    ctx = prompt_len + out_len / 2
    per_decode = model_flops(cfg, ctx)
    # the whole batch: the prompts' prefill (the LM head only on each last token) plus the decode
    prefill = n_req * (prompt_len * model_flops(cfg, prompt_len / 2, with_head=False) + 2 * cfg.hidden_size * cfg.vocab_size)
    decode = n_req * (out_len - 1) * per_decode
    return {
        "matmul_gflops": gflops,
        "flops_per_decode_token": per_decode,
        "decode_tok_s": gflops * 1e9 / per_decode,
        "batch_e2e_tok_s": n_req * out_len / ((prefill + decode) / (gflops * 1e9)),
    }


# --------------------------------------------------------------------------- #
# 1. Throughput vs transformers' static batch
# --------------------------------------------------------------------------- #


class BatchPeer(Worker):
    """The transformers worker in ``"batch"`` mode: only the static batch is timed each round."""

    def __init__(self, python: str, model_path: str, threads: int, attn: str, batch_prompts, n: int, dtype: str):
        setup = {
            "model": model_path,
            "threads": threads,
            "attn": attn,
            "dtype": dtype,
            "mode": "batch",
            "batch_prompts": [list(p) for p in batch_prompts],
            "decode_tokens": n,
        }
        super().__init__(python, HF_PEER, setup, threads, "the transformers worker",
                         env={"TOKENIZERS_PARALLELISM": "false"})


def bench_throughput(llm, b: Bench, ids: Ids) -> dict:
    a, log = b.args, b.log
    n_req, plen, n = a.batch, a.prompt_len, a.output_len
    hf_prompts = [ids(plen) for _ in range(n_req)]
    log(f"[1] warm-up: {n_req} x {plen} in / {n} out through the engine (compiles its shapes)")
    c0 = compile_count()
    t0 = time.perf_counter()
    batch_round(llm, [ids(plen) for _ in range(n_req)], n)
    warm = {"warmup_s": time.perf_counter() - t0, "programs_compiled": compile_count() - c0}

    peer, why = start_hf_peer(b, f"load + a short warm-up generate at batch {n_req}", lambda py: BatchPeer(
        py, str(resolve_model(a.model).path), a.threads, a.attn, hf_prompts, n, a.hf_dtype))

    # round 1 uses transformers' prompts (for the token check); later rounds fresh ids, so no prefix hits
    systems = {"jaxinfer": lambda i: batch_round(llm, hf_prompts if i == 0 else [ids(plen) for _ in range(n_req)], n)}
    if peer is not None:
        systems["transformers"] = lambda i: peer.round()
    c1 = compile_count()
    rounds = b.rounds(systems, tag="[1] ", may_fail=("transformers",))
    jr, hr = rounds["jaxinfer"], rounds.get("transformers", [])
    res = {"jaxinfer": {**warm, "recompiles": compile_count() - c1,
                        **medians(jr, ("e2e_tok_s", "decode_tok_s", "wall_s", "all_first_tokens_s")),
                        "cached_tokens": sum(r["cached_tokens"] for r in jr), "rounds": dropping(jr, "tokens_first")},
           "transformers_python": b.figures.get("skipped", {}).get("transformers", why)}
    if hr:
        res["transformers"] = {"info": peer.info, **medians(hr, {"e2e_tok_s": "batch_e2e_tok_s",
                               "decode_tok_s": "batch_decode_tok_s", "wall_s": "batch_generate_s",
                               "first_token_s": "batch_first_s"}), "rounds": dropping(hr, "batch_tokens_first")}
        res["ratio_e2e"] = res["jaxinfer"]["e2e_tok_s"] / res["transformers"]["e2e_tok_s"]
        res["ratio_decode"] = res["jaxinfer"]["decode_tok_s"] / res["transformers"]["decode_tok_s"]
        res["agree_row0"] = common_prefix(jr[0]["tokens_first"], hr[0]["batch_tokens_first"])
    if peer is not None:
        peer.close()
    return res


# --------------------------------------------------------------------------- #
# 2. The serving driver at concurrency 1, 8, 32
# --------------------------------------------------------------------------- #


def bench_serving(llm, a, log) -> dict:
    backend = serving.LibraryBackend(llm)
    vocab = llm.model_config.vocab_size
    out = {}
    for j, c in enumerate(a.concurrency):
        n = a.requests_per_slot * c
        work = serving.synthetic_workload(n, (a.prompt_len,) * 2, (a.output_len,) * 2, vocab, seed=1000 + j)
        warm = serving.warmup_workload(work, c, vocab, seed=2000 + j)
        cfg = serving.BenchConfig(max_concurrency=c, progress=False, warmup_requests=len(warm))
        log(f"[2] concurrency {c}: {len(warm)} warm-up + {n} measured requests ({a.prompt_len} in / {a.output_len} out)")
        s = serving.summarize(serving.run_benchmark(backend, work, cfg, warm))
        out[str(c)] = {
            "requests": n,
            "failed": s["failed"],
            "duration_s": s["duration_s"],
            "output_tok_s": s["output_throughput"],
            "ttft_ms": {k: s["ttft_ms"][k] for k in ("median", "p99", "mean")},
            "itl_ms": {k: s["itl_ms"][k] for k in ("median", "p99", "mean", "max")},
            "tpot_ms": {k: s["tpot_ms"][k] for k in ("median", "p99")},
            "engine": s["engine"],
        }
    return out


# --------------------------------------------------------------------------- #
# 3. Prefix cache on a shared system prompt
# --------------------------------------------------------------------------- #


def _ttft(llm, prompt: list) -> tuple:
    o = llm.generate([prompt], greedy(1))[0]
    return o.metrics.ttft_s, o.usage["cached_tokens"]


def bench_prefix(llm, a, ids: Ids, log) -> dict:
    plain = twin(llm, {"enable_prefix_caching": False})
    try:
        system = ids(a.system_len)
        log(f"[3] warm-up: a {a.system_len}-token system prompt on both engines (another prompt)")
        other = ids(a.system_len)
        for eng in (llm, plain):
            _ttft(eng, other + ids(a.suffix_len))
        _ttft(llm, other + ids(a.suffix_len))  # the cached shape
        t_fill, _ = _ttft(llm, system + ids(a.suffix_len))  # fills the cache with `system`
        ttfts = alternate({"cached": lambda i: _ttft(llm, system + ids(a.suffix_len)),
                           "uncached": lambda i: _ttft(plain, system + ids(a.suffix_len))},
                          a.prefix_requests, log=lambda m: log(f"[3] {m.replace('round', 'request')}"))
        cached, hits = [t for t, _ in ttfts["cached"]], [h for _, h in ttfts["cached"]]
        uncached = [t for t, _ in ttfts["uncached"]]
    finally:
        plain.close()
    res = {"prompt_tokens": a.system_len + a.suffix_len, "fill_ttft_s": t_fill, "ttft_cached_s": median(cached),
           "ttft_uncached_s": median(uncached), "cached_tokens": hits, "samples_cached_s": cached,
           "samples_uncached_s": uncached}
    res["speedup"] = res["ttft_uncached_s"] / res["ttft_cached_s"]
    return res


# --------------------------------------------------------------------------- #
# 4. Host share of a steady decode step
# --------------------------------------------------------------------------- #


def _submit(llm, prompt: list, n: int):
    m = RequestMetrics(arrival_time=time.perf_counter())
    r = llm.make_request(prompt, greedy(n), metrics=m)
    return r, llm.submit(r)


def _wait(cond, timeout: float = 120.0, poll: float = 0.002) -> bool:
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        if cond():
            return True
        time.sleep(poll)
    return False


def steady_window(llm, b: int, prompt_len: int, ids: Ids, skip: int, window: int) -> dict:
    """Run `b` requests; once each has `skip` tokens, read the engine's counters over `window` more tokens each."""
    st = llm.engine.stats
    reqs = [_submit(llm, ids(prompt_len), skip + window + 16) for _ in range(b)]
    ms = [r.metrics for r, _ in reqs]
    _wait(lambda: all(len(m.token_times) >= skip for m in ms))
    s0 = (st.busy_s, st.host_s, st.wait_s, st.steps, st.generation_tokens, time.perf_counter())
    _wait(lambda: all(len(m.token_times) >= skip + window for m in ms))
    s1 = (st.busy_s, st.host_s, st.wait_s, st.steps, st.generation_tokens, time.perf_counter())
    for _, s in reqs:
        s.abort()
    llm.wait_idle(60)
    d = [y - x for x, y in zip(s0, s1)]
    busy, host, wait, steps, toks, wall = d
    gaps = [g for m in ms for g in m.itl_s[skip:skip + window]]
    return {
        "batch": b,
        "steps": steps,
        "host_share": host / busy if busy else None,
        "step_ms": 1e3 * busy / steps if steps else None,
        "host_ms_per_step": 1e3 * host / steps if steps else None,
        "wait_ms_per_step": 1e3 * wait / steps if steps else None,
        "busy_share_of_wall": busy / wall if wall else None,
        "tok_s": toks / wall if wall else None,
        "itl_median_ms": 1e3 * median(gaps) if gaps else None,
    }


def matmul_times(cfg, batches, repeats: int = 15, dtype="float32", quantization=None) -> dict:
    """ms of the model's matmul shapes at each batch size (jitted, blocking), per layer and for the head.

    Through the model's own `matmul` (weights in `dtype`, float32 accumulation; quantized by
    `cfg.quant` when ``quantization`` is given, the head as the model stores it then)."""
    from jaxinfer.ops import quant
    from jaxinfer.models.decoder import matmul

    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # name: (weight shape, contracting axis); head_tied is the LM head as the model computes
    # it with tied embeddings (hidden x embed^T)
    shapes = {"qkv": ((d, q + 2 * kv), 0), "o": ((q, d), 0), "gate_up": ((d, 2 * f), 0), "down": ((f, d), 0),
              "head": ((d, cfg.vocab_size), 0), "head_tied": ((cfg.vocab_size, d), 1)}
    mm = jax.jit(matmul, static_argnames="w_contract")
    out = {}
    layers, head = quant.Scheme.pair(cfg.quant) if quantization else (None, None)
    for name, (shape, contract) in shapes.items():
        w = (jnp.ones(shape, jnp.float32) * 0.01).astype(dtype)
        if layers is not None:  # the head is stored [vocab, hidden] when quantized (jaxinfer.ops.quant)
            if name == "head":
                continue
            if name == "head_tied":
                w = jax.tree.map(jnp.asarray, quant.quantize(np.asarray(w, np.float32), head, axis=1))
            else:
                w = jax.tree.map(jnp.asarray, quant.quantize(np.asarray(w, np.float32), layers))
        row = {}
        for b in batches:
            x = jnp.ones((b, shape[contract]), jnp.float32)
            row[str(b)] = 1e3 * median(timings(lambda: mm(x, w, w_contract=contract).block_until_ready(), repeats,
                                               warmup=1))
        out[name] = {"shape": list(shape), "ms": row}
    per_layer = {str(b): sum(out[k]["ms"][str(b)] for k in ("qkv", "o", "gate_up", "down")) for b in batches}
    head_ms = out["head_tied" if (cfg.tie_word_embeddings or quantization) else "head"]["ms"]
    out["model_ms"] = {str(b): cfg.num_layers * per_layer[str(b)] + head_ms[str(b)] for b in batches}
    return out


def attention_times(cfg, ecfg, batches, context: int, repeats: int = 15) -> dict:
    """ms of one layer's decode attention (`paged_attention`, T = 1) at each batch size, jitted alone.

    The cache layer is donated and fed back, as in the engine's step (the CPU kernel
    updates it in place; without donation XLA would copy the layer first)."""
    from jaxinfer.ops.attention import AttentionMetadata, paged_attention
    from jaxinfer.engine.buckets import bucket_for, pages_needed
    from jaxinfer.ops.kv_cache import slots_for

    ps, kvh, hd = ecfg.page_size, cfg.num_kv_heads, cfg.head_dim
    p = bucket_for(pages_needed(context, ps), ecfg.page_buckets)
    state = {"cache": jnp.zeros((ecfg.num_pages, ps, 2 * kvh, hd), ecfg.cache_dtype)}  # donated, fed back
    f = jax.jit(lambda q, k, v, c, m: paged_attention(q, k, v, c, m, hd**-0.5), donate_argnums=(3,))
    out = {"pages": p}
    for b in batches:
        q = jnp.ones((b, 1, cfg.num_heads, hd), jnp.float32)
        k = jnp.ones((b, 1, kvh, hd), jnp.float32)
        pages = np.arange(1, 1 + b * p, dtype=np.int32).reshape(b, p) % (ecfg.num_pages - 1) + 1
        pos = np.full((b, 1), context - 1, np.int32)
        meta = jax.device_put(AttentionMetadata(pos, slots_for(pages, pos, ps), pages, np.full((b,), context, np.int32)))

        def step():
            o, state["cache"] = f(q, k, k, state["cache"], meta)
            o.block_until_ready()

        out[str(b)] = 1e3 * median(timings(step, repeats, warmup=1))
    return out


def bench_host(llm, a, ids: Ids, log) -> dict:
    res = {"engine": {}, "step_alone_ms": {}}
    for b in a.host_batches:  # warm-up: the decode shapes at these batch sizes and contexts
        log(f"[4] warm-up at batch {b}")
        steady_window(llm, b, a.prompt_len, ids, 2, 8)
    windows = alternate({str(b): lambda i, b=b: steady_window(llm, b, a.prompt_len, ids, 8, a.host_window)
                         for b in a.host_batches}, a.rounds, log=lambda m: log(f"[4] {m.replace(': ', ': steady decode at batch ')}"))
    res["engine"] = windows
    res["summary"] = {b: medians(rs, [k for k in rs[0] if k != "batch"]) for b, rs in windows.items()}
    # the jitted step alone (inputs on device) and through the runner, same context
    context = a.prompt_len + a.output_len
    log(f"[4] the jitted decode step alone at batch {', '.join(map(str, a.step_batches))}, context {context}")
    prompt = ids(a.prompt_len)
    benches = {b: StepBench(llm, prompt, context, b) for b in a.step_batches}
    for b, t in step_rounds(benches, a.rounds + 1, 8, 4).items():
        res["step_alone_ms"][str(b)] = {"direct": 1e3 * median(t["direct"]), "runner": 1e3 * median(t["runner"])}
        benches[b].close()
    log("[4] the model's matmuls at each batch size")
    res["matmuls"] = matmul_times(llm.model_config, a.step_batches, dtype=llm.engine_config.dtype,
                                  quantization=llm.engine_config.quantization)
    res["attention"] = attention_times(llm.model_config, llm.engine_config, a.step_batches, context)
    return res


# --------------------------------------------------------------------------- #
# 5. Stall of running streams when a long prompt arrives
# --------------------------------------------------------------------------- #


def stall_run(llm, a, ids: Ids) -> dict:
    n_streams, skip = a.stall_streams, 12
    streams = [_submit(llm, ids(a.prompt_len), 2000) for _ in range(n_streams)]
    ms = [r.metrics for r, _ in streams]
    _wait(lambda: all(len(m.token_times) >= skip for m in ms))
    t_submit = time.perf_counter()
    long_r, long_s = _submit(llm, ids(a.long_len), 2)
    _wait(lambda: long_r.metrics.first_token_time is not None)
    t_first = long_r.metrics.first_token_time
    counts = [len(m.token_times) for m in ms]
    _wait(lambda: all(len(m.token_times) >= c + 4 for m, c in zip(ms, counts)))
    for _, s in streams:
        s.abort()
    long_s.result()
    llm.wait_idle(60)
    before, during = [], []
    for m in ms:
        t = list(m.token_times)
        for x, y in zip(t, t[1:]):
            if y <= t_submit:
                before.append(y - x)
            elif x < t_first:  # the gap overlaps the long prompt's prefill
                during.append(y - x)
    before = before[-n_streams * 8:]  # the steady gaps just before
    return {
        "long_ttft_s": long_r.metrics.ttft_s,
        "long_chunks": len(long_r.metrics.prefill_chunks),
        "median_gap_before_ms": 1e3 * median(before),
        "max_gap_during_ms": 1e3 * max(during) if during else None,
        "median_gap_during_ms": 1e3 * median(during) if during else None,
        "gaps_during": len(during),
    }


def bench_stall(llm, a, ids: Ids, log) -> dict:
    chunk = llm.engine_config.chunk_buckets[-1]
    log(f"[5] warm-up: {a.stall_streams} streams + a {a.long_len}-token prompt; lone {chunk}- and {a.long_len}-token prompts")
    stall_run(llm, a, ids)
    _ttft(llm, ids(chunk))
    _ttft(llm, ids(a.long_len))
    rounds = alternate({"lone chunk": lambda i: _ttft(llm, ids(chunk))[0],
                        "lone long prompt": lambda i: _ttft(llm, ids(a.long_len))[0],
                        "streams + long prompt": lambda i: stall_run(llm, a, ids)},
                       a.rounds, log=lambda m: log(f"[5] {m}"))
    lone_chunk, lone_long, runs = rounds["lone chunk"], rounds["lone long prompt"], rounds["streams + long prompt"]
    res = {k: median(r[k] for r in runs) for k in runs[0]}
    res["max_gap_during_worst_ms"] = max(r["max_gap_during_ms"] for r in runs if r["max_gap_during_ms"] is not None)
    res["lone_chunk_ttft_ms"] = 1e3 * median(lone_chunk)
    res["lone_long_ttft_ms"] = 1e3 * median(lone_long)
    res["chunk_tokens"] = chunk
    res["budget_tokens"] = llm.engine.scheduler.budget
    res["runs"] = runs
    return res


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def _throughput_lines(res: dict) -> list:
    """1. the batch against transformers, and the compute ceiling."""
    L: list = []
    t, c = res.get("throughput"), res.get("ceiling")
    if t:
        j, h = t["jaxinfer"], t.get("transformers")
        L += [
            "",
            f"1. {res['batch']} requests x {res['prompt_len']} prompt / {res['output_len']} output tokens at once "
            "(greedy, ignore_eos)",
            compare([("output tok/s, wall clock incl. prefill", j["e2e_tok_s"], h and h["e2e_tok_s"], ".1f"),
                     ("decode-only tok/s (after all first tokens)", j["decode_tok_s"], h and h["decode_tok_s"], ".1f")],
                    label="", indent="   "),
            f"   wall time: jaxinfer {fmt(j['wall_s'], '.2f')} s (all first tokens after "
            f"{fmt(j['all_first_tokens_s'], '.2f')} s)"
            + (f"; transformers {fmt(h['wall_s'], '.2f')} s (first token {fmt(h['first_token_s'], '.2f')} s)" if h else ""),
            f"   per-round e2e tok/s: jaxinfer {[round(r['e2e_tok_s'], 1) for r in j['rounds']]}"
            + (f", transformers {[round(r['batch_e2e_tok_s'], 1) for r in h['rounds']]}" if h else ""),
            f"   jaxinfer warm-up {j['warmup_s']:.1f} s ({j['programs_compiled']} programs compiled), "
            f"{j['recompiles']} compiled during the rounds; prefix-cache tokens reused in the rounds: {j['cached_tokens']}",
        ]
        if h:
            i = h.get("info") or {}
            v = i.get("versions") or {}
            L.append(
                f"   transformers: {i.get('dtype')}, {i.get('attn')} attention, {i.get('threads')} threads, torch "
                f"{v.get('torch')}, transformers {v.get('transformers')}; greedy row 0 agrees for {t['agree_row0']} of "
                f"{res['output_len']} tokens"
            )
        else:
            L.append(f"   transformers: {t['transformers_python']}")
    if c:
        L.append(
            f"   compute ceiling: jitted {res['dtype']} [4096,576]x[576,1536] matmul {c['matmul_gflops']:.1f} GFLOP/s; "
            f"{c['flops_per_decode_token'] / 1e6:.0f} MFLOP per decode token => decode <= "
            f"{c['decode_tok_s']:.0f} tok/s; with the batch's prefill counted, output <= {c['batch_e2e_tok_s']:.0f} tok/s"
        )
        if t:
            L.append(
                f"   jaxinfer at {100 * t['jaxinfer']['decode_tok_s'] / c['decode_tok_s']:.0f}% of the decode ceiling, "
                f"{100 * t['jaxinfer']['e2e_tok_s'] / c['batch_e2e_tok_s']:.0f}% of the end-to-end ceiling"
            )
    return L


def _serving_lines(res: dict) -> list:
    """2. the serving driver at each concurrency."""
    L: list = []
    sv = res.get("serving")
    if sv:
        rows = [[k, v["requests"], fmt(v["output_tok_s"]), fmt(v["ttft_ms"]["median"]), fmt(v["ttft_ms"]["p99"]),
                 fmt(v["itl_ms"]["median"]), fmt(v["itl_ms"]["p99"]), fmt(v["itl_ms"]["max"]),
                 fmt(v["tpot_ms"]["median"]), f"failed {v['failed']}" if v["failed"] else ""] for k, v in sv.items()]
        text = table(["conc", "reqs", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max", "TPOT p50",
                      "(ms)"], rows)
        L += ["", f"2. jaxinfer bench driver (LibraryBackend), {res['requests_per_slot']} x concurrency requests of "
              f"{res['prompt_len']} in / {res['output_len']} out, all sent at once under the cap",
              *("   " + line for line in text.splitlines())]
    return L


def _prefix_lines(res: dict) -> list:
    """3. the prefix cache."""
    L: list = []
    p = res.get("prefix")
    if p:
        L += [
            "",
            f"3. prefix cache: {p['prompt_tokens']}-token prompts sharing a {res['system_len']}-token system prompt",
            f"   TTFT with the cache {1e3 * p['ttft_cached_s']:.1f} ms, without {1e3 * p['ttft_uncached_s']:.1f} ms: "
            f"{p['speedup']:.1f}x faster; cached_tokens reported {p['cached_tokens']} "
            f"(the request that filled it: {1e3 * p['fill_ttft_s']:.1f} ms)",
            f"   samples (ms): cached {[round(1e3 * x, 1) for x in p['samples_cached_s']]}, "
            f"uncached {[round(1e3 * x, 1) for x in p['samples_uncached_s']]}",
        ]
    return L


def _host_lines(res: dict) -> list:
    """4. the host share of a steady decode step."""
    L: list = []
    hs = res.get("host")
    if hs:
        L += ["", "4. host share of a steady decode step (engine stats over a window, all requests decoding)"]
        for b, v in hs["summary"].items():
            L.append(
                f"   batch {b:>2}: step {fmt(v['step_ms'], '.2f')} ms, host {fmt(v['host_ms_per_step'], '.2f')} ms, "
                f"waiting on the device {fmt(v['wait_ms_per_step'], '.2f')} ms => host share "
                f"{100 * v['host_share']:.0f}%; {fmt(v['tok_s'])} tok/s, ITL p50 {fmt(v['itl_median_ms'], '.2f')} ms"
            )
        sa, mm, at = hs["step_alone_ms"], hs["matmuls"], hs["attention"]
        b0 = next(iter(sa))
        L += [
            "   jitted decode step alone (inputs on device) / through the runner: " + ", ".join(
                f"b{b} {v['direct']:.2f} / {v['runner']:.2f} ms ({v['direct'] / sa[b0]['direct']:.2f}x b{b0})"
                for b, v in sa.items()),
            "   the model's matmuls alone (30 layers + head, jitted one by one): "
            + ", ".join(f"b{b} {v:.2f} ms" for b, v in mm["model_ms"].items()),
            f"   decode attention alone, one layer ({at['pages']} pages attended) x {res['num_layers']} layers: "
            + ", ".join(f"b{b} {res['num_layers'] * at[str(b)]:.2f} ms" for b in sa),
        ]
        for name in ("qkv", "o", "gate_up", "down", "head", "head_tied"):
            if name in mm:
                v = mm[name]
                L.append(f"     {name:<8} {str(v['shape']):<13} "
                         + ", ".join(f"b{b} {x:.3f} ms" for b, x in v["ms"].items()))
    return L


def _stall_lines(res: dict) -> list:
    """5. the stall of running streams."""
    L: list = []
    st = res.get("stall")
    if st:
        per_chunk = st["lone_long_ttft_ms"] / st["long_chunks"]
        L += [
            "",
            f"5. stall: {res['stall_streams']} streams decoding, then a {res['long_len']}-token prompt arrives "
            f"(chunk {st['chunk_tokens']}, budget {st['budget_tokens']} tokens/step)",
            f"   gaps before {st['median_gap_before_ms']:.1f} ms (median); during its prefill ({st['long_chunks']:.0f} "
            f"chunks, TTFT {1e3 * st['long_ttft_s']:.0f} ms) median {fmt(st['median_gap_during_ms'])} ms, "
            f"max {fmt(st['max_gap_during_ms'])} ms (worst round {st['max_gap_during_worst_ms']:.1f} ms)",
            f"   one {st['chunk_tokens']}-token chunk step alone (TTFT of a lone {st['chunk_tokens']}-token prompt) "
            f"{st['lone_chunk_ttft_ms']:.1f} ms; lone {res['long_len']}-token prompt {st['lone_long_ttft_ms']:.0f} ms "
            f"= {per_chunk:.1f} ms per chunk",
            f"   max gap = {st['max_gap_during_ms'] / st['median_gap_before_ms']:.1f}x the usual gap, "
            f"{st['max_gap_during_ms'] / st['lone_chunk_ttft_ms']:.2f}x a lone first chunk, "
            f"{st['max_gap_during_ms'] / (per_chunk + st['median_gap_before_ms']):.2f}x (mean chunk of the long prompt "
            "+ one decode step)",
        ]
    return L


def report(res: dict) -> str:
    L = heading(
        f"jaxinfer engine benchmark — {res['model']} ({res.get('quantization') or res['dtype']} weights, "
        f"{res.get('kv_cache_dtype')} KV cache), engine config {res['engine_config']} (max_num_seqs "
        f"{res['max_num_seqs']}, max_num_batched_tokens {res['max_num_batched_tokens']}); medians of {res['rounds']} rounds",
        res["system"])
    for part in (_throughput_lines, _serving_lines, _prefix_lines, _host_lines, _stall_lines):
        L += part(res)
    if res.get("targets"):
        L += ["", *targets_block(res["targets"])]
    return "\n".join(L)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #

SECTIONS = ("throughput", "serving", "prefix", "host", "stall")


def parse_args(argv=None):
    p = parser("python -m benchmarks.engine", __doc__, rounds=(3, 2), quick="fewer rounds and requests", dtype=True)
    p.add_argument("--engine-config", default=None, help="engine preset (default: this backend's)")
    p.add_argument("--quantization", default=None, choices=("int8", "int4"), help="quantized weights (jaxinfer.ops.quant)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-slot", type=int, default=None, help="serving requests per unit of concurrency (default 2)")
    p.add_argument("--system-len", type=int, default=1000)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--prefix-requests", type=int, default=None, help="default 5, --quick 3")
    p.add_argument("--host-batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--host-window", type=int, default=None, help="decode tokens per request timed (default 48, --quick 24)")
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--stall-streams", type=int, default=8)
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=None, help="run only these sections")
    hf_flags(p)
    p.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the peer's dtype (float32: what transformers' GGUF loader gives by default)")
    p.add_argument("--seed", type=int, default=0)
    a = settle(p, p.parse_args(argv), quick={"requests_per_slot": (2, 1), "prefix_requests": (5, 3),
                                             "host_window": (48, 24)}, at_least={"output_len": 2})
    a.step_batches = sorted(set(a.host_batches) | {a.batch})
    return a


def measure(b: Bench) -> None:
    a, res, log = b.args, b.figures, b.log
    llm = jaxinfer.LLM(a.model, engine_config=a.engine_config, dtype=a.dtype, quantization=a.quantization)
    e = llm.engine_config
    res.update(model=llm.model_name, dtype=e.dtype, quantization=e.quantization, kv_cache_dtype=e.cache_dtype,
               engine_config=e.name, max_num_seqs=e.max_num_seqs, max_num_batched_tokens=llm.engine.scheduler.budget,
               rounds=a.rounds, num_layers=llm.model_config.num_layers, batch=a.batch, prompt_len=a.prompt_len,
               output_len=a.output_len, requests_per_slot=a.requests_per_slot, system_len=a.system_len,
               long_len=a.long_len, stall_streams=a.stall_streams)
    log(f"loaded {llm.model_name} in {llm.load_time_s:.1f} s; load average {load_average()}")
    ids = Ids(llm.model_config.vocab_size, a.seed)
    sections = {
        "throughput": lambda: bench_throughput(llm, b, ids),
        "serving": lambda: bench_serving(llm, a, log),
        "prefix": lambda: bench_prefix(llm, a, ids, log),
        "host": lambda: bench_host(llm, a, ids, log),
        "stall": lambda: bench_stall(llm, a, ids, log),
    }
    try:
        log(f"compute ceiling: jitted {e.dtype} [4096,576]x[576,1536] matmul")
        res["ceiling"] = ceiling(llm.model_config, matmul_gflops(dtype=e.dtype), a.batch, a.prompt_len, a.output_len)
        for name in a.only or SECTIONS:
            res[name] = sections[name]()
            res["system"][f"loadavg_after_{name}"] = load_average()
            log(f"{name} done; load average {load_average()}")
    finally:
        llm.close()
    t = res.get("throughput")
    if t and "ratio_e2e" in t:
        res["targets"] = [target("batch throughput >= 2.5x transformers", t["ratio_e2e"] >= 2.5, f"{t['ratio_e2e']:.2f}x")]


def main(argv=None) -> int:
    return run(measure, report, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
