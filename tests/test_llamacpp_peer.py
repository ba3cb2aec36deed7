"""benchmarks/llamacpp_peer.py: which systems a run takes, and the "never slower than the XLA path" targets."""

from __future__ import annotations

import pytest

peer = pytest.importorskip("benchmarks.llamacpp_peer")


def test_the_xla_path_runs_only_when_named():
    assert not [s for s in peer.parse_args([]).systems if s.startswith("xla:")]
    a = peer.parse_args(["--systems", "jax:int8", "xla:int8"])
    assert a.systems == ["jax:int8", "xla:int8"]
    assert peer.JAX_SYSTEMS["xla:int8"] == ("float32", "int8", False)
    assert peer.JAX_SYSTEMS["jax:int8"] == ("float32", "int8", True)


def _res(jax, xla):
    fig = lambda t, d, e: {"ttft_ms": t, "decode_tok_s": d, "batch_e2e_tok_s": e}  # noqa: E731
    return {"summary": {"jax:bfloat16": fig(*jax), "xla:bfloat16": fig(*xla)}, "batch": 32, "prompt_len": 128,
            "llama_batch_mode": "batched"}


def test_each_figure_is_held_against_the_xla_path():
    got = {t["name"]: t for t in peer.targets(_res((170.0, 60.0, 200.0), (140.0, 45.0, 250.0)))}
    b1 = got["batch-1 decode: jaxinfer bfloat16 >= its XLA path"]
    conc = got["32 concurrent: jaxinfer bfloat16 >= its XLA path"]
    ttft = got["TTFT(128): jaxinfer bfloat16 <= its XLA path"]
    assert (b1["verdict"], conc["verdict"], ttft["verdict"]) == ("PASS", "FAIL", "FAIL")  # faster at batch 1; slower concurrent and to the first token
    assert b1["ratio"] == pytest.approx(60 / 45) and ttft["ratio"] == pytest.approx(140 / 170)
    assert not [n for n in got if "float32 >= its XLA" in n]  # no xla:float32 ran: no such target
