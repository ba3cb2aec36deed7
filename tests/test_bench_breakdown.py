"""benchmarks/step_breakdown.py (issue 35): a compiled decode step's thunks attributed to the parts of the model
that run them, and the profile that times them, on the tiny model through the real engine."""

from __future__ import annotations

import collections

import pytest

from jaxinfer.ops.backend import KernelChoice

breakdown = pytest.importorskip("benchmarks.step_breakdown")
core = pytest.importorskip("benchmarks.core")


@pytest.fixture()
def step(tiny_llm):
    if not KernelChoice.loaded().cpu_matmul:
        pytest.skip("the native CPU kernels are not loaded: the step has no custom calls to attribute")
    bench = core.StepBench(tiny_llm, list(range(10, 26)), 32, 1)
    yield tiny_llm, bench
    bench.close()


def test_every_product_and_attention_call_is_named_by_its_weight(step):
    llm, bench = step
    cfg = llm.model_config
    parts = breakdown.thunk_parts(bench.program.as_text(), cfg)
    count = collections.Counter(parts.values())
    for name in ("matmul wqkv", "matmul wo", "matmul w_gate_up", "matmul w_down", "attention kernel"):
        assert count[name] == cfg.num_layers, (name, count)
    assert count["matmul LM head"] >= 1  # one in each branch of the step's sampler that computes logits
    assert count["row sums (norms, softmax)"] >= 2 * cfg.num_layers + 1  # two norms a layer, the final norm
    assert not [p for p in parts.values() if p.startswith("matmul other")], count


def test_the_profile_times_the_named_parts(step):
    llm, bench = step
    parts = breakdown.thunk_parts(bench.program.as_text(), llm.model_config)
    us = breakdown.profile(bench.step, 3, parts)
    for name in ("matmul wqkv", "matmul LM head", "attention kernel"):
        assert us.get(name, 0) > 0, us
    assert 0 < sum(us.values()) < 10 * min(bench.direct(3)) * 1e6  # per call, not summed over the calls


def test_a_prefill_is_attributed_too(step):
    """The TTFT's breakdown: the prefill chunk's program named part by part, and its profile times them."""
    llm, _ = step
    prompt = list(range(10, 30))
    breakdown.first_token_seconds(llm, prompt)  # its programs made
    parts = breakdown.prefill_parts(llm, len(prompt))
    count = collections.Counter(parts.values())
    assert count["matmul w_gate_up"] == count["attention kernel"] == llm.model_config.num_layers, count
    us = breakdown.profile(lambda: breakdown.first_token_seconds(llm, prompt), 2, parts)
    assert us.get("matmul w_gate_up", 0) > 0 and us.get("attention kernel", 0) > 0, us
