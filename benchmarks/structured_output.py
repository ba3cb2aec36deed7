"""Structured output's cost: a batch with constrained rows against the same batch unconstrained (issue 21).

    python -m benchmarks.structured_output                 # SmolLM2-135M-Instruct, 3 rounds
    python -m benchmarks.structured_output --quick         # a tiny random model, 2 rounds (minutes)
    python -m benchmarks.structured_output --rounds 5 --json structured.json

(from the repository root: ``benchmarks/`` is not installed with jaxinfer; it needs jaxinfer only).

The workload: ``--batch`` (32) chat prompts asking for a small JSON record, all submitted at once
through ``LLM.generate``, temperature 1.0, one seed per request, ``--max-tokens`` (64), nothing
ignored (a request ends at end-of-sequence, when its grammar is complete, or at max_tokens). The
constraint is a bounded JSON Schema (`SCHEMA`: a string of at most 16 characters, an integer in
[0, 120], an array of at most 3 enum values, no other keys), so every constrained request ends by
itself well before max_tokens. The prefix cache is off (every run sends the same prompts).

Five runs, measured side by side in every round (their order rotating from round to round):

- ``mixed``: every second request constrained, the others free;
- ``plain``: the same prompts and seeds, all free, each request made to produce exactly as many
  tokens as it did in ``mixed`` (``min_tokens = max_tokens = that count``), so both runs generate
  the same tokens per row: the fair baseline for ``mixed``;
- ``plain+sync``: ``plain`` again with the engine made to read every step in flight before it
  schedules the next (what it does while a constrained request runs), but no masks: the cost of
  losing the one-step pipelining alone. The engine has no switch for this, so the benchmark wraps
  the engine's ``step`` on its instance (the lines of `Engine.step` that do it for a constrained row);
  no engine code is changed;
- ``all``: every request constrained (the worst case);
- ``plain-all``: all free, with ``all``'s token counts (its baseline).

The counts come from an unmeasured warm-up run of ``mixed`` and ``all`` (which also compiles every
shape): the same prompts and seeds give the same tokens in every round, and each round checks it.
Throughput is generated tokens / wall time of the ``generate`` call (prefill included); the decode
rate (tokens after each request's first / time from the last first token to the last token) is
printed beside it. Reported: each run's median over ``--rounds``, the ratio constrained / baseline
per round and its median against the issue's goal (>= 0.8x), and where the time goes:

- the mask: the engine's own ``mask_s`` / ``mask_rows`` (host time of the steps' sampling data when
  a row is constrained) per step and per row; inside it, llguidance's batch fill alone
  (`jaxinfer.engine.structured.fill_bitmasks`, timed by a wrapper); and the matcher advancing on each token
  read back (`Constraint.accept`);
- the sync: ``grammar_syncs`` against the steps, and ``plain+sync`` against ``plain``;
- the device stage: the jitted bitmask stage alone (`jaxinfer.ops.sampler._apply_allowed` on
  ``[batch, vocab]`` logits) and the host-to-device copy of one step's mask.

Every figure is printed with the CPU, its flags (/proc/cpuinfo) and the load average: on a shared
machine other processes' load moves every number, which is why the runs alternate.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer import SamplingParams, StructuredOutputsParams
from jaxinfer.engine import sampling, structured
from jaxinfer.stats import median
from jaxinfer.engine.compile_cache import compile_count
from jaxinfer.tools.harness import (Bench, fmt, heading, load_line, machine_line, parser, run, settle, table, target,
                                   targets_block, timings)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SUBJECTS = ("a cat", "a pilot", "a chef", "a robot", "a gardener", "a dragon", "a sailor", "a teacher")
RUNS = ("mixed", "plain", "plain+sync", "all", "plain-all")
BASELINE = {"mixed": "plain", "all": "plain-all", "plain+sync": "plain"}
GOAL = 0.8


# --------------------------------------------------------------------------- #
# The model and the workload
# --------------------------------------------------------------------------- #


def tiny_llm(model: str):
    """A random-weight Llama small enough to make the model's share of a step small, with the real
    model's tokenizer (so the masks are the real vocabulary's width and llguidance's real work)."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.models import llama
    from jaxinfer.ops.spec import init_random
    from jaxinfer.text.tokenizer import load_tokenizer
    from jaxinfer.loading.weights import resolve_model

    tok = load_tokenizer(resolve_model(model).path)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0,
                      tie_word_embeddings=True, name="tiny-random")
    params = init_random(llama.param_specs(cfg), jax.random.key(0), scale=0.05)
    return jaxinfer.LLM.from_params(cfg, params, tokenizer=tok, name="tiny-random",
                                    enable_prefix_caching=False)


def make_prompts(llm, n: int) -> list:
    out = []
    for i in range(n):
        ask = f"Describe {SUBJECTS[i % len(SUBJECTS)]} (number {i}) as a JSON object with a name, an age and tags."
        out.append(llm.tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=True))
    return out


def params_for(run: str, n: int, max_tokens: int, seed: int, counts) -> list:
    """One SamplingParams per request for a run (``counts``: the token counts a free run must match)."""
    out = []
    for i in range(n):
        constrained = run == "all" or (run == "mixed" and i % 2 == 0)
        if constrained or run == "mixed":
            sop = StructuredOutputsParams(json=SCHEMA) if constrained else None
            out.append(SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, structured_outputs=sop))
        else:
            k = counts[i]
            out.append(SamplingParams(max_tokens=k, min_tokens=k, temperature=1.0, seed=seed + i))
    return out


def is_constrained(run: str, i: int) -> bool:
    return run == "all" or (run == "mixed" and i % 2 == 0)


# --------------------------------------------------------------------------- #
# Probes: wrappers that time the host's structured-output work (engine code unchanged)
# --------------------------------------------------------------------------- #


class Probe:
    """Times `jaxinfer.engine.structured.fill_bitmasks` (as `jaxinfer.engine.sampling` calls it: the name it imported)
    and `Constraint.accept` while installed."""

    def __init__(self):
        self.fill_calls = self.fill_rows = self.accept_calls = 0
        self.fill_s = self.accept_s = 0.0

    def snapshot(self) -> tuple:
        return self.fill_calls, self.fill_rows, self.fill_s, self.accept_calls, self.accept_s

    @contextmanager
    def installed(self):
        fill, accept = sampling.fill_bitmasks, structured.Constraint.accept

        def timed_fill(rows, batch, vocab_size):
            t0 = time.perf_counter()
            try:
                return fill(rows, batch, vocab_size)
            finally:
                self.fill_s += time.perf_counter() - t0
                self.fill_calls += 1
                self.fill_rows += len(rows)

        def timed_accept(c, token):
            t0 = time.perf_counter()
            try:
                return accept(c, token)
            finally:
                self.accept_s += time.perf_counter() - t0
                self.accept_calls += 1

        sampling.fill_bitmasks, structured.Constraint.accept = timed_fill, timed_accept
        try:
            yield self
        finally:
            sampling.fill_bitmasks, structured.Constraint.accept = fill, accept


@contextmanager
def forced_sync(engine, counter: list):
    """Make the engine read every step in flight before it schedules the next, as `Engine.step` does
    while a constrained request runs, for unconstrained requests too (``counter[0]``: such reads)."""
    step = engine.step

    st = engine.stats

    def synced_step():
        if engine._pending and engine.scheduler.running:
            counter[0] += 1
            t0, w0 = time.perf_counter(), st.wait_s
            while engine._pending:
                engine._read(*engine._pending.popleft())
            # counted in the step's busy and host time, as Engine.step counts its own sync
            dt = time.perf_counter() - t0
            st.busy_s += dt
            st.host_s += dt - (st.wait_s - w0)
        step()

    engine.step = synced_step  # the engine thread calls self.step(): the instance attribute wins
    try:
        yield
    finally:
        del engine.step


# --------------------------------------------------------------------------- #
# One run
# --------------------------------------------------------------------------- #


def valid(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # the test extra; without it, the shape by hand
        return (isinstance(v, dict) and set(v) == set(SCHEMA["required"]) and isinstance(v["name"], str)
                and len(v["name"]) <= 16 and isinstance(v["age"], int) and 0 <= v["age"] <= 120
                and isinstance(v["tags"], list) and len(v["tags"]) <= 3)
    try:
        jsonschema.validate(v, SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def run_once(llm, run: str, prompts: list, a, counts, probe: Probe) -> dict:
    eng = llm.engine
    st = eng.stats
    sp = params_for(run, len(prompts), a.max_tokens, a.seed, counts)
    syncs = [0]
    c0 = compile_count()
    s0, p0 = st.snapshot(), probe.snapshot()
    e0 = (st.busy_s, st.host_s, st.wait_s)
    ctx = forced_sync(eng, syncs) if run == "plain+sync" else nullcontext()
    with ctx:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
    s1, p1 = st.snapshot(), probe.snapshot()
    busy, host, wait = (y - x for x, y in zip(e0, (st.busy_s, st.host_s, st.wait_s)))
    d = {k: s1[k] - s0[k] for k in ("steps", "grammar_syncs", "mask_s", "mask_rows", "generation_tokens")}
    fill_calls, fill_rows, fill_s, accept_calls, accept_s = (y - x for x, y in zip(p0, p1))
    ntok = [len(o.outputs[0].token_ids) for o in outs]
    ms = [o.metrics for o in outs]
    all_first = max(m.first_token_time for m in ms)
    last = max(m.finished_time for m in ms)
    cons = [o.outputs[0] for i, o in enumerate(outs) if is_constrained(run, i)]
    reasons: dict = {}
    for o in outs:
        reasons[o.outputs[0].finish_reason] = reasons.get(o.outputs[0].finish_reason, 0) + 1
    steps = d["steps"]
    return {
        "run": run,
        "wall_s": wall,
        "output_tokens": sum(ntok),
        "tok_s": sum(ntok) / wall,
        "decode_tok_s": sum(k - 1 for k in ntok) / (last - all_first) if last > all_first else None,
        "counts": ntok,
        "finish_reasons": reasons,
        "constrained": len(cons),
        "constrained_valid": sum(1 for c in cons if c.finish_reason == "stop" and valid(c.text)),
        "programs_compiled": compile_count() - c0,
        "steps": steps,
        "step_ms": 1e3 * busy / steps if steps else None,
        "host_ms_per_step": 1e3 * host / steps if steps else None,
        "wait_ms_per_step": 1e3 * wait / steps if steps else None,
        "grammar_syncs": d["grammar_syncs"],
        "forced_syncs": syncs[0],
        "mask_s": d["mask_s"],
        "mask_rows": d["mask_rows"],
        "mask_steps": fill_calls,
        "fill_s": fill_s,
        "fill_rows": fill_rows,
        "accept_calls": accept_calls,
        "accept_s": accept_s,
        "example": cons[0].text if cons else outs[0].outputs[0].text,
    }


# --------------------------------------------------------------------------- #
# The device stage alone
# --------------------------------------------------------------------------- #


def device_stage(batch: int, vocab: int, repeats: int) -> dict:
    """ms of the jitted bitmask stage on [batch, vocab] float32 logits, and of placing one step's mask."""
    from jaxinfer.ops.sampler import _apply_allowed

    rng = np.random.default_rng(0)
    w = structured.bitmask_width(vocab)
    mask = rng.integers(-2**31, 2**31 - 1, size=(batch, w), dtype=np.int64).astype(np.int32)
    logits = jnp.asarray(rng.standard_normal((batch, vocab), dtype=np.float32))
    f = jax.jit(_apply_allowed)
    g = jax.jit(lambda lg: lg * 1.0)  # the same read and write of the logits, without the mask
    dm = jax.device_put(mask)
    f(logits, dm).block_until_ready()
    g(logits).block_until_ready()

    def t(fn) -> float:
        return 1e3 * median(timings(fn, repeats))

    return {
        "batch": batch,
        "vocab": vocab,
        "mask_bytes": mask.nbytes,
        "apply_ms": t(lambda: f(logits, dm).block_until_ready()),
        "copy_logits_ms": t(lambda: g(logits).block_until_ready()),
        "put_mask_ms": t(lambda: jax.device_put(mask).block_until_ready()),
    }


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #


def _per(total: float, count: float) -> Optional[float]:
    """total / count; None where nothing was counted."""
    return total / count if count else None


def summarize(rounds: dict) -> dict:
    keys = ("tok_s", "decode_tok_s", "wall_s", "step_ms", "host_ms_per_step", "wait_ms_per_step")
    med = {}
    for name, rs in rounds.items():
        med[name] = {k: median([r[k] for r in rs if r[k] is not None]) for k in keys if any(r[k] is not None for r in rs)}
        med[name]["output_tokens"] = median([r["output_tokens"] for r in rs])
        med[name]["steps"] = median([r["steps"] for r in rs])
    ratios = {}
    for name, base in BASELINE.items():
        if name in rounds and base in rounds:
            per = [x["tok_s"] / y["tok_s"] for x, y in zip(rounds[name], rounds[base])]
            dec = [x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(rounds[name], rounds[base])
                   if x["decode_tok_s"] and y["decode_tok_s"]]
            ratios[name] = {"baseline": base, "per_round": per, "median": median(per),
                           "decode_per_round": dec, "decode_median": median(dec) if dec else None}
    masks = {}
    for name in ("mixed", "all"):
        rs = rounds.get(name)
        if not rs:
            continue
        t = {k: sum(r[k] for r in rs) for k in ("mask_s", "mask_rows", "mask_steps", "fill_s", "accept_s",
                                                 "accept_calls", "steps", "grammar_syncs", "wall_s")}
        mask_s, acc_s, msteps, steps, syncs = t["mask_s"], t["accept_s"], t["mask_steps"], t["steps"], t["grammar_syncs"]
        masks[name] = {
            "mask_steps": msteps,
            "mask_rows": t["mask_rows"],
            "mask_ms_per_step": _per(1e3 * mask_s, msteps),
            "mask_us_per_row": _per(1e6 * mask_s, t["mask_rows"]),
            "fill_ms_per_step": _per(1e3 * t["fill_s"], msteps),
            "fill_us_per_row": _per(1e6 * t["fill_s"], t["mask_rows"]),
            "accept_us_per_token": _per(1e6 * acc_s, t["accept_calls"]),
            "rows_per_mask_step": _per(t["mask_rows"], msteps),
            "steps": steps,
            "grammar_syncs": syncs,
            "sync_share": _per(syncs, steps),
            # the host's structured-output work as a share of the name's wall time
            "host_share_of_wall": (mask_s + acc_s) / t["wall_s"],
        }
        base = rounds.get(BASELINE[name])
        if base and msteps and steps:
            # what the parts add to a step of the baseline, measured apart from the noise of whole runs:
            # the masks and the matcher (host, now on the critical path), and the baseline's own host
            # work on each synced step (no longer overlapped with the device)
            b_step = median([r["step_ms"] for r in base])
            b_host = median([r["host_ms_per_step"] for r in base])
            extra = (1e3 * (mask_s + acc_s) + b_host * syncs) / steps
            masks[name].update({"baseline_step_ms": b_step, "baseline_host_ms_per_step": b_host,
                               "expected_extra_ms_per_step": extra, "expected_ratio": b_step / (b_step + extra)})
    return {"median": med, "ratios": ratios, "masks": masks}


def report(res: dict) -> str:
    s = res["summary"]
    med, ratios, masks = s["median"], s["ratios"], s["masks"]
    L = heading(f"structured output — {res['model']} ({res['dtype']}), batch {res['batch']}, max_tokens "
                f"{res['max_tokens']}, temperature 1.0; medians of {res['rounds']} rounds, runs alternating",
                res["system"])
    L.append(f"warm-up and compiles {res['warmup_s']:.0f} s")
    rows = []
    for run_name in res["runs"]:
        m, ratio = med[run_name], ratios.get(run_name)
        rows.append([run_name, res["rounds_data"][run_name][0]["constrained"], fmt(m["output_tokens"], ".0f"),
                     fmt(m["steps"], ".0f"), fmt(m["wall_s"], ".2f"), fmt(m["tok_s"]), fmt(m.get("decode_tok_s")),
                     fmt(m.get("step_ms")), fmt(m.get("host_ms_per_step")),
                     f"{ratio['median']:.3f}x" if ratio else ""])
    L += ["", table(["run", "constrained", "tokens", "steps", "wall s", "tok/s", "decode tok/s", "step ms", "host ms",
                     "vs baseline"], rows), ""]
    for run_name, r in ratios.items():
        what = {"mixed": "half constrained", "all": "all constrained", "plain+sync": "sync forced, no masks"}[run_name]
        L.append(f"{run_name} ({what}) / {r['baseline']}: median {r['median']:.3f}x; per round "
                 f"{', '.join(f'{x:.3f}' for x in r['per_round'])}")
        if r["decode_median"] is not None:
            L.append(f"{'':>4}decode phase only: median {r['decode_median']:.3f}x; per round "
                     f"{', '.join(f'{x:.3f}' for x in r['decode_per_round'])}")
    L.append("")
    for run_name, m in masks.items():
        L.append(
            f"{run_name}: mask {m['mask_ms_per_step']:.2f} ms per step ({m['rows_per_mask_step']:.1f} constrained rows), "
            f"{m['mask_us_per_row']:.0f} us per row (runner.mask_s / mask_rows over {m['mask_steps']} steps); "
            f"llguidance's fill alone {m['fill_ms_per_step']:.2f} ms per step, {m['fill_us_per_row']:.0f} us per row; "
            f"matcher advance {m['accept_us_per_token']:.1f} us per token; host structured-output work "
            f"{100 * m['host_share_of_wall']:.2f}% of wall time"
        )
        L.append(f"{run_name}: grammar_syncs {m['grammar_syncs']} of {m['steps']} steps ({100 * m['sync_share']:.0f}%)")
        if "expected_ratio" in m:
            L.append(f"{run_name}: from the parts (masks + matcher + the baseline's host work "
                     f"{m['baseline_host_ms_per_step']:.1f} ms on each synced step): +{m['expected_extra_ms_per_step']:.2f} "
                     f"ms on a {m['baseline_step_ms']:.1f} ms step = {m['expected_ratio']:.3f}x expected")
    ds = res.get("device_stage")
    if ds:
        L.append(
            f"device stage alone (jitted, [{ds['batch']}, {ds['vocab']}] float32 logits): bitmask applied "
            f"{ds['apply_ms']:.3f} ms (a plain read+write of the logits {ds['copy_logits_ms']:.3f} ms); "
            f"one step's mask ({ds['mask_bytes'] // 1024} KiB) placed on device {ds['put_mask_ms']:.3f} ms"
        )
    checks = res["checks"]
    L += [
        f"constrained outputs that ended 'stop' and validate against the schema: {checks['valid']} of "
        f"{checks['constrained']}; token counts of the free runs matched their constrained runs: "
        f"{'yes' if checks['counts_matched'] else 'NO (see JSON)'}; programs compiled during the rounds: "
        f"{checks['programs_compiled_in_rounds']}",
        f"example constrained output: {res['example']}",
    ]
    if res["targets"]:
        L += ["", *targets_block(res["targets"])]
    return "\n".join(L)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #


def parse_args(argv=None):
    p = parser("python -m benchmarks.structured_output", __doc__, rounds=(3, 2),
               quick="--tiny, 2 rounds: a few minutes on 2 cores", json_help="also write every figure as JSON")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random-weight model with --model's tokenizer instead of --model's weights")
    p.add_argument("--batch", type=int, default=32, help="concurrent requests (default: 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default: 64)")
    p.add_argument("--seed", type=int, default=1000, help="request i samples with seed + i (default: 1000)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="which runs (a ratio needs its baseline: mixed/plain, all/plain-all, plain+sync/plain)")
    # --batch 2: half the rows are constrained; --max-tokens 32: the schema's longest output fits
    a = settle(p, p.parse_args(argv), at_least={"rounds": 1, "batch": 2, "max_tokens": 32})
    a.tiny = a.tiny or a.quick
    return a


def warm_up(llm, a, runs: list, prompts: list, probe: Probe, log) -> dict:
    """Compile every shape; the constrained runs' token counts, which the free runs must match."""
    counts: dict = {}
    for run_name in ("mixed", "all"):
        if run_name in runs or BASELINE.get(run_name) in runs or (run_name == "mixed" and "plain+sync" in runs):
            log(f"warm-up: {run_name}")
            counts[run_name] = run_once(llm, run_name, prompts, a, None, probe)["counts"]
    for run_name in ("plain", "plain-all"):
        if run_name in runs:
            log(f"warm-up: {run_name}")
            run_once(llm, run_name, prompts, a, counts.get("mixed" if run_name == "plain" else "all"), probe)
    if "plain+sync" in runs and "plain" not in runs:
        run_once(llm, "plain", prompts, a, counts["mixed"], probe)
    return counts


def measure(b: Bench) -> None:
    a, res, log = b.args, b.figures, b.log
    res.update(cpu=machine_line(res["system"]), load_start=load_line())
    if a.tiny:
        log(f"building a tiny random model with {a.model}'s tokenizer")
        llm = tiny_llm(a.model)
    else:
        log(f"loading {a.model}")
        llm = jaxinfer.LLM(a.model, enable_prefix_caching=False)
    prompts = make_prompts(llm, a.batch)
    probe = Probe()
    runs = [r for r in RUNS if r in a.runs]
    with probe.installed():
        counts = warm_up(llm, a, runs, prompts, probe, log)
        warmup_s = log.elapsed()

        def measured(run_name):
            def one(i):
                r = run_once(llm, run_name, prompts, a, counts.get("all" if run_name == "plain-all" else "mixed"), probe)
                r["load"] = load_line()
                log(f"round {i + 1}/{a.rounds} {run_name:<10}: {r['tok_s']:7.1f} tok/s, {r['output_tokens']} tokens in "
                    f"{r['wall_s']:.2f} s, {r['steps']} steps, {r['grammar_syncs']} grammar syncs  ({r['load']})")
                return r
            return one

        data = b.rounds({run_name: measured(run_name) for run_name in runs})
    log("the bitmask stage alone")
    ds = device_stage(a.batch, llm.model_config.vocab_size, 50)
    matched = all(r["counts"] == counts["mixed" if run_name in ("mixed", "plain", "plain+sync") else "all"]
                  for run_name, rs in data.items() for r in rs)
    cons = [r for run_name in ("mixed", "all") for r in data.get(run_name, [])]
    summary = summarize(data)
    res.update({
        "model": "tiny-random (" + a.model + "'s tokenizer)" if a.tiny else a.model,
        "dtype": llm.engine_config.dtype,
        "batch": a.batch,
        "max_tokens": a.max_tokens,
        "rounds": a.rounds,
        "runs": runs,
        "schema": SCHEMA,
        "counts": counts,
        "rounds_data": data,
        "device_stage": ds,
        "checks": {"constrained": sum(r["constrained"] for r in cons),
                   "programs_compiled_in_rounds": sum(r["programs_compiled"] for rs in data.values() for r in rs),
                   "valid": sum(r["constrained_valid"] for r in cons), "counts_matched": matched},
        "example": cons[0]["example"] if cons else "",
        "load_end": load_line(),
        "warmup_s": warmup_s,
        "summary": summary,
        "targets": [target(f"{run_name} / {r['baseline']} >= {GOAL:.2f}x", r["median"] >= GOAL, f"{r['median']:.3f}x")
                    for run_name, r in summary["ratios"].items() if run_name != "plain+sync"],
        "total_s": log.elapsed(),
    })
    llm.close()


def main(argv=None) -> int:
    return run(measure, report, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
