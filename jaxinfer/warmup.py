"""Warm-up: compile every program the engine can use before serving.

The set is known in advance (`Engine.compile_shapes`: bucketed prefill and
decode shapes) times the sampler variants asked for. Each program is run
once on all-padding inputs, which write only to the dummy page 0, so the
jit caches are filled exactly as real traffic would fill them. With JAX's
persistent compilation cache on, a second start loads them from disk.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax.numpy as jnp
import numpy as np

from jaxinfer import step
from jaxinfer.attention import AttentionMetadata
from jaxinfer.sampler import build_metadata

VARIANTS = {
    "greedy": dict(all_greedy=True),
    "sample": dict(all_greedy=False),
    "sample+filters": dict(all_greedy=False, use_filters=True),
    "penalties": dict(all_greedy=False, use_filters=True, use_penalties=True),
    "logprobs": dict(all_greedy=True, num_logprobs=-1),  # -1: the engine's max_logprobs
}


def _metadata(engine, batch: int, variant: str):
    flags = dict(VARIANTS[variant])
    if flags.get("num_logprobs") == -1:
        flags["num_logprobs"] = engine.ecfg.max_logprobs
    md = build_metadata([None] * batch, batch, num_slots=engine.ecfg.max_num_seqs, num_logprobs=0)
    return dataclasses.replace(md, **flags)


def compile_all(engine, variants=("greedy",), progress: bool = True) -> int:
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown warm-up variants {unknown}; choose from {sorted(VARIANTS)}")
    runner = engine.runner
    shapes = engine.compile_shapes()
    jobs = [("prefill", s, v) for v in variants for s in shapes["prefill"]]
    jobs += [("decode", s, v) for v in variants for s in shapes["decode"]]
    before = step.compiled_count()
    t0 = time.perf_counter()
    for i, (kind, shape, variant) in enumerate(jobs):
        if kind == "prefill":
            b, t, p = shape
        else:
            (b, p), t = shape, 1
        md = _metadata(engine, b, variant)
        attn = AttentionMetadata(
            np.full((b, t), -1, np.int32), np.zeros((b, t), np.int32), np.zeros((b, p), np.int32), np.zeros(b, np.int32)
        )
        state = runner.sampler_state if md.use_penalties else None
        if kind == "prefill":
            out, runner.kv_cache, state = step.prefill(
                runner.params, runner.kv_cache, state, np.zeros((b, t), np.int32), attn, np.zeros(b, np.int32), md,
                cfg=runner.cfg,
            )
        else:
            out, runner.kv_cache, state = step.decode_step(
                runner.params, runner.kv_cache, state, jnp.zeros((b,), jnp.int32), attn, md, cfg=runner.cfg
            )
        if md.use_penalties:
            runner.sampler_state = state
        out.tokens.block_until_ready()
        if progress:
            done = i + 1
            bar = "#" * (30 * done // len(jobs))
            sys.stderr.write(
                f"\rwarm-up [{bar:<30}] {done}/{len(jobs)} programs, {time.perf_counter() - t0:.0f}s"
            )
            sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    return step.compiled_count() - before
