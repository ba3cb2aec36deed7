"""Each step's physical floor (`jaxinfer.engine.roofline`): what a step must move and compute, the
machine's peaks measured once and cached per machine, and the floor reported beside each step."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import numpy as np
import pytest

from conftest import TINY, TINY_ENGINE, tiny_params
from jaxinfer.config import EngineConfig
from jaxinfer.engine import roofline
from jaxinfer.metrics import RooflineCollector
from jaxinfer.ops.quant import quantize_params

L, KVH, D, H = TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, TINY.num_heads


def tree_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def kv_bytes(tokens: int, itemsize: int = 4, layers: int = L) -> int:
    """K and V of ``tokens`` tokens over ``layers`` layers, from the cache's shapes."""
    return tokens * layers * 2 * KVH * D * itemsize


@pytest.fixture(scope="module")
def tied():
    cfg = dataclasses.replace(TINY, tie_word_embeddings=True)
    return cfg, tiny_params(cfg)


def test_step_bytes_are_the_weights_once_plus_kv_read_and_written(tied):
    cfg, params = tied
    rows, context = [5, 1, 1], [0, 7, 12]  # a prefill chunk and two decode rows
    cost = roofline.step_cost(cfg, params, np.float32, rows, context)
    assert cost.weight_bytes == tree_bytes(params)  # tied: the embedding is the LM head, read whole
    assert cost.kv_read_bytes == kv_bytes(7 + 12)
    assert cost.kv_write_bytes == kv_bytes(5 + 1 + 1)
    assert cost.bytes == tree_bytes(params) + kv_bytes(19) + kv_bytes(7)
    half = roofline.step_cost(cfg, params, np.float16, rows, context)  # a 16-bit cache: half the KV bytes
    assert half.kv_read_bytes == kv_bytes(19, 2) and half.kv_write_bytes == kv_bytes(7, 2)


def test_untied_embedding_counts_only_the_rows_looked_up():
    params = tiny_params()
    row = TINY.hidden_size * 4
    with_logits = roofline.step_cost(TINY, params, np.float32, [3], [0])
    assert with_logits.weight_bytes == tree_bytes(params) - params.embed.nbytes + 3 * row
    no_logits = roofline.step_cost(TINY, params, np.float32, [3], [0], logits_rows=0)  # a mid-prompt chunk
    assert no_logits.weight_bytes == with_logits.weight_bytes - params.lm_head.nbytes


def test_quantized_weights_count_their_stored_bytes(tied):
    cfg, params = tied
    qcfg, qparams = quantize_params(params, cfg, "int8")
    cost = roofline.step_cost(qcfg, qparams, np.float32, [1], [10])
    stored = sum(x.nbytes for x in jax.tree.leaves(qparams, is_leaf=lambda x: hasattr(x, "dequantize")))
    assert cost.weight_bytes == stored < tree_bytes(params)


def test_windowed_layers_read_at_most_their_window(tied):
    cfg, params = tied
    w = 6
    slid = dataclasses.replace(cfg, sliding_window=w, layer_types=("sliding_attention", "full_attention"))
    for s in (0, 3, 5, 40):
        cost = roofline.step_cost(slid, params, np.float32, [1], [s])
        assert cost.kv_read_bytes == kv_bytes(min(s, w - 1), layers=1) + kv_bytes(s, layers=1)


def test_attention_flops_grow_by_4HD_per_layer_per_key(tied):
    cfg, params = tied
    model = roofline.CostModel(cfg, params, np.float32)
    f = [model.step([1], [c]).flops for c in (10, 11, 30)]
    assert f[1] - f[0] == 4 * H * D * L
    assert f[2] - f[0] == 20 * 4 * H * D * L
    # a chunk of n tokens from 0 attends n(n+1)/2 pairs; its products are 2 flops per weight per token
    two = model.step([2], [0], logits_rows=0).flops
    one = model.step([1], [0], logits_rows=0).flops
    assert two - 2 * one == 4 * H * D * L * (3 - 2)


def test_floor_is_the_larger_of_bytes_and_flops_over_the_peaks():
    cost = roofline.StepCost(weight_bytes=10**9, kv_read_bytes=0, kv_write_bytes=0, flops=4 * 10**9)
    p = roofline.MachinePeaks(bandwidth_gbps=20.0, flops_gflops=100.0)
    assert roofline.floor_seconds(cost, p) == pytest.approx(max(1 / 20, 4 / 100))
    assert roofline.floor_seconds(cost, dataclasses.replace(p, flops_gflops=0.0)) == pytest.approx(1 / 20)


def test_measured_peaks_are_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return roofline.measure_peaks(buffer_bytes=8 << 20, reps=1, native_kernel=False)

    key = roofline.machine_key(native_kernel=False)
    quiet = lambda: 0.0  # noqa: E731 - the host's load average, as the cache sees it
    first = roofline.cached_peaks(measure, key, quiet)
    assert len(calls) == 1 and first.bandwidth_gbps > 0 and first.flops_gflops > 0
    assert {"numpy max, 1 thread", "numpy BLAS gemv", "xla jitted sum"} <= set(first.measurements)
    best_read = max(v for k, v in first.measurements.items() if "matmul" not in k)
    assert first.bandwidth_gbps == pytest.approx(best_read, abs=1e-3)  # the best probe, not the first
    again = roofline.cached_peaks(measure, key, quiet)
    assert len(calls) == 1 and again == first  # read back, not measured
    other = roofline.cached_peaks(measure, dict(key, cpu="another CPU"), quiet)
    assert len(calls) == 2 and roofline.cache_path(key) != roofline.cache_path(dict(key, cpu="another CPU"))
    files = os.listdir(os.path.join(tmp_path, "jaxinfer", "roofline"))
    assert len(files) == 2
    with open(roofline.cache_path(key)) as f:
        assert json.load(f)["key"] == key
    assert other.key["cpu"] == "another CPU"


def test_peaks_measured_on_a_busy_host_are_measured_again_when_quieter(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = roofline.machine_key(native_kernel=False)
    low = roofline.MachinePeaks(5.0, 10.0, "probe a", "probe f", {"probe a": 5.0, "probe b": 9.0, "probe f": 10.0})
    high = roofline.MachinePeaks(8.0, 7.0, "probe a", "probe f", {"probe a": 8.0, "probe b": 1.0, "probe f": 7.0})
    busy = 4.0 * os.cpu_count()
    assert roofline.cached_peaks(lambda: low, key, lambda: busy).bandwidth_gbps == 5.0
    assert roofline.cached_peaks(lambda: high, key, lambda: busy) == low  # as busy: kept
    best = roofline.cached_peaks(lambda: high, key, lambda: 0.0)  # quieter: measured again, best of both
    assert (best.bandwidth_gbps, best.flops_gflops) == (8.0, 10.0)
    assert best.measurements == {"probe a": 8.0, "probe b": 9.0, "probe f": 10.0}
    assert roofline.cached_peaks(lambda: low, key, lambda: 0.0) == best  # measured quiet: kept from now on


def test_machine_peaks_from_the_config_and_none_when_unknown():
    assert roofline.machine_peaks(EngineConfig(), platform_name="tpu") is None
    e = EngineConfig(peak_bandwidth_gbps=800.0, peak_tflops=200.0, tensor_parallel_size=4)
    p = roofline.machine_peaks(e, platform_name="tpu")
    assert (p.bandwidth_gbps, p.flops_gflops, p.method) == (3200.0, 800e3, "config")


@pytest.mark.parametrize("field", ["peak_bandwidth_gbps", "peak_tflops"])
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_engine_config_peaks_validate(field, bad):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: bad})


def test_peaks_do_not_key_compiled_programs():
    assert repr(EngineConfig()) == repr(EngineConfig(peak_bandwidth_gbps=100.0, peak_tflops=1.0))


@pytest.fixture(scope="module")
def served():
    """A tiny engine after two requests, on this machine's peaks (measured once per machine and cached)."""
    import jaxinfer

    llm = jaxinfer.LLM.from_params(TINY, tiny_params(), engine_config=TINY_ENGINE)
    given = llm.engine.roofline.peaks
    outs = llm.generate([list(range(1, 30)), list(range(5, 12))], jaxinfer.SamplingParams(max_tokens=6,
                                                                                          temperature=0.0))
    yield llm, outs, given
    llm.close()


def test_every_step_takes_at_least_its_floor(served):
    llm, outs, given = served
    assert llm.engine.roofline.peaks == given  # no step beat its floor (that would raise the peaks)
    for o in outs:
        steps = o.metrics.steps
        kinds = {s[0] for s in steps}
        # ragged steps: prompt chunks alone, decode rows alone, or both ("mixed")
        assert kinds <= {"prefill", "decode", "mixed"} and kinds & {"prefill", "mixed"} and kinds & {"decode", "mixed"}
        assert len(steps) == len(o.metrics.prefill_chunks) + o.metrics.decode_steps  # every step it was in, once
        for kind, tokens, measured, floor in steps:
            assert tokens >= 1 and 0 < floor <= measured


def test_floor_appears_in_trace_stats_line_and_prometheus(served):
    from prometheus_client import CollectorRegistry, generate_latest

    llm, outs, _ = served
    trace = outs[0].metrics.trace()
    assert "floor" in trace and "decode steps      mean" in trace
    chunks = [s for s in outs[0].metrics.steps if s[0] == "prefill"]
    assert trace.count("prefill step ") == len(chunks) >= 2  # 29 prompt tokens in chunks of at most 16
    summary = outs[0].metrics.summary()
    assert 0 < summary["decode_roofline"] <= 1 and 0 < summary["prefill_roofline"] <= 1
    line = llm.engine.stats.line()
    assert "Step floor/measured: prefill 0." in line and "decode 0." in line
    snap = llm.engine.stats.snapshot()["roofline"]
    hist = llm.engine.stats.roofline
    assert snap["decode"]["steps"] == hist["decode"].count >= 5
    reg = CollectorRegistry()
    reg.register(RooflineCollector(lambda: llm.engine.stats.roofline, "jaxinfer:", ["model_name"], ["tiny"]))
    text = generate_latest(reg).decode()
    n = hist["decode"].count
    assert f'jaxinfer:step_roofline_fraction_count{{kind="decode",model_name="tiny"}} {float(n)}' in text
    assert f'jaxinfer:step_roofline_fraction_bucket{{kind="prefill",le="1.0",model_name="tiny"}} ' \
           f'{float(hist["prefill"].count)}' in text


def test_bench_summary_reports_the_fraction_for_prefill_and_decode(served):
    from jaxinfer.tools import serving

    llm, _, _ = served
    workload = serving.synthetic_workload(4, (6, 20), (3, 6), TINY.vocab_size, seed=1)
    cfg = serving.BenchConfig(request_rate=float("inf"), max_concurrency=2, warmup_requests=0, seed=0,
                              progress=False)
    s = serving.summarize(serving.run_benchmark(serving.LibraryBackend(llm), workload, cfg), {"backend": "library"})
    for kind in ("prefill", "decode"):
        r = s["engine"][f"{kind}_step_roofline"]
        assert 0 < r["fraction"] <= 1 and r["steps"] >= 1 and r["mean_floor_ms"] <= r["mean_step_ms"]
    assert s["engine"]["decode_step_roofline"]["steps"] >= max(r.output_len for r in workload) - 1
    table = serving.format_table(s)
    assert "Prefill step floor/measured:" in table and "Decode step floor/measured:" in table


def test_closing_the_engine_stops_its_step_clock(served):  # last: it closes the module's engine
    llm = served[0]
    thread = llm.engine.roofline.clock._thread
    assert thread is not None and thread.is_alive()
    llm.close()
    assert not thread.is_alive()


def test_a_mixture_of_experts_reads_and_multiplies_only_the_routed_experts(tied):
    from jaxinfer.ops.spec import init_random, model_specs

    cfg = dataclasses.replace(tied[0], architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, qk_norm=True)
    params = init_random(model_specs(cfg), jax.random.key(0))
    experts = sum(x.nbytes for x in jax.tree.leaves(params) if x.ndim == 3 and x.shape[0] == 8)
    assert experts > 0
    model = roofline.CostModel(cfg, params, np.float32)
    cost = model.step([1], [0])
    assert cost.weight_bytes == tree_bytes(params) - experts + experts * 2 // 8
    # one more token adds 2 flops per weight it meets: the dense ones and 2 of the 8 experts' (and the LM head)
    per_token = model.step([2], [0], logits_rows=0).flops - model.step([1], [0], logits_rows=0).flops
    dense = sum(x.size for x in jax.tree.leaves(params) if not (x.ndim == 3 and x.shape[0] == 8)) - params.embed.size
    assert per_token == 2 * (dense + (experts // 4) * 2 // 8) + 4 * H * D * L * 2
