"""The soak (``python -m jaxinfer.tools.soak``), short: a few hundred hostile requests against a real
``jaxinfer serve`` process serving a tiny random-weight model with a tokenizer and a chat template."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import jax
import pytest

import jaxinfer
from jaxinfer.config import ModelConfig
from jaxinfer.tools.soak import (CONSTRAINED_SHARE, GRPC_CONSTRAINED, HTTP_CONSTRAINED, HTTP_INVALID_CONSTRAINED,
                                  INVALID_CONSTRAINED, TOOL_CONSTRAINTS, constraint_bad)
from jaxinfer.models import llama
from jaxinfer.ops.spec import init_random
from jaxinfer.text.tokenizer import load_tokenizer
from test_tokenizer import train_tiny_sentencepiece

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# An engine big enough that 16 streams at once fill it: 8 rows, 63 pages of 16 tokens, a 128-token
# context; 8 more may wait, then RESOURCE_EXHAUSTED. One batch bucket and one chunk bucket: the server
# warms up 2 programs (8 rows x 8 tokens, 8 x 32) where every bucket of 1-8 rows made 12, which was
# most of a soak's time (its 200 items take a few seconds); the soak is about the server under
# hostile load, not about shapes. (--engine-config takes a JSON file of EngineConfig's keys.)
TINY_SERVE_ENGINE = {
    "page_size": 16, "num_pages": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64, "dtype": "float32",
    "batch_buckets": [8], "chunk_buckets": [32], "page_buckets": [2, 4, 8], "max_logprobs": 5,
}
SERVE = ["--max-model-len", "128", "--max-waiting", "8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    src = tmp_path_factory.mktemp("spm")
    (src / "tokenizer.model").write_bytes(train_tiny_sentencepiece())
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    tok = load_tokenizer(src)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, name="tiny")
    params = init_random(llama.param_specs(cfg), jax.random.key(0), scale=0.3)
    return str(jaxinfer.save_model(tmp_path_factory.mktemp("soak") / "tiny", cfg, params, tokenizer=tok))


@pytest.mark.slow
def test_short_soak_passes_every_check(model_dir, tmp_path):
    # 200 items, seed 5: a plan with every kind, every constraint and every refused one (kills and a burst
    # past max_waiting among them; not every seed's 200 has all, test_the_plan_is_a_function_of_the_seed)
    out = tmp_path / "soak.json"
    engine = tmp_path / "tiny-engine.json"
    engine.write_text(json.dumps(TINY_SERVE_ENGINE))
    cmd = [sys.executable, "-m", "jaxinfer.tools.soak", "--model", model_dir, "--engine-config", str(engine), *SERVE, "--requests", "200",
           "--concurrency", "16", "--max-tokens", "24", "--seed", "5", "--duration", "120", "--json", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    report = proc.stdout + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    failed = [f"{c['name']}: {c['detail']}" for c in result["checks"] if not c["passed"]]
    assert not failed, report
    assert proc.returncode == 0 and result["passed"], report
    assert "FAIL" not in proc.stdout and proc.stdout.count("PASS") == len(result["checks"]) >= 10, report
    kinds = {k.split("/")[0] for k in result["counts"]}
    assert kinds == {"stream", "cancel", "deadline", "invalid", "malformed", "garbage", "kill", "burst",
                     "tokenize", "model_info", "health"}, report
    assert result["counts"]["kill"] == {"KILLED": result["counts"]["kill"].get("KILLED", 0)} != {}, report
    assert result["ttft_s"]["p50"] is not None and result["itl_s"]["p99"] is not None, report
    # constrained streams of every kind ran, and some answers ended and validated (the check above held)
    counts = result["counts"]
    assert {k.split("/")[1] for k in counts if k.startswith("stream/")} == set(GRPC_CONSTRAINED), report
    assert result["constrained_outcomes"].get("stop", 0) > 0, report
    assert "constrained calls" in " | ".join(c["name"] for c in result["checks"]), report
    refused = {k: c for k, c in counts.items() if k.split("/")[-1] in INVALID_CONSTRAINED and k.startswith("invalid/")}
    assert refused and all(c == {"INVALID_ARGUMENT": c["INVALID_ARGUMENT"]} for c in refused.values()), report
    print(f"soak wall time {wall:.1f} s (load {result['load_s']:.1f} s)\n{proc.stdout}")


def test_the_plan_is_a_function_of_the_seed():
    from types import SimpleNamespace

    from jaxinfer.tools.soak import Soak

    def plan(seed):
        s = Soak(SimpleNamespace(seed=seed, requests=500), "localhost:1", None)
        s.info = {"max_waiting": 4}
        s.forms = ["token_ids", "prompt", "chat"]
        return s.plan()

    assert plan(7) == plan(7) and plan(7) != plan(8)
    kinds = {k for k, _, _ in plan(7)}
    assert {"stream", "invalid", "malformed", "garbage", "kill", "burst"} <= kinds
    # about one stream in CONSTRAINED_SHARE carries a constraint, every one of them in turn; every constraint
    # that must be refused is among the invalid items
    streams = [v for k, v, _ in plan(7) if k == "stream"]
    constrained = [v for v in streams if v]
    assert set(constrained) == set(GRPC_CONSTRAINED)
    assert len(streams) / (2 * CONSTRAINED_SHARE) < len(constrained) < 2 * len(streams) / CONSTRAINED_SHARE
    assert set(INVALID_CONSTRAINED) <= {v for k, v, _ in plan(7) if k == "invalid"}


HTTP_KINDS = {"http_stream", "http_complete", "http_disconnect", "http_invalid", "http_malformed", "http_garbage",
              "http_burst", "http_misc"}


@pytest.mark.slow
def test_short_http_soak_passes_every_check(model_dir, tmp_path):
    out = tmp_path / "soak.json"
    engine = tmp_path / "tiny-engine.json"
    engine.write_text(json.dumps(TINY_SERVE_ENGINE))
    cmd = [sys.executable, "-m", "jaxinfer.tools.soak", "--protocol", "http", "--model", model_dir, "--engine-config",
           str(engine), *SERVE, "--requests", "200", "--concurrency", "16", "--max-tokens", "24", "--seed", "1",
           "--duration", "120", "--json", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    report = proc.stdout + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    failed = [f"{c['name']}: {c['detail']}" for c in result["checks"] if not c["passed"]]
    assert not failed, report
    assert proc.returncode == 0 and result["passed"], report
    names = " | ".join(c["name"] for c in result["checks"])
    for needle in ("no HTTP 5xx", "HTTP bursts past max_waiting got 429", "HTTP malformed bodies", "engine settled",
                   "HTTP greedy outputs byte-identical", "same text over gRPC and HTTP", "stopped cleanly"):
        assert needle in names, names
    counts = result["counts"]
    assert {k.split("/")[0] for k in counts} == HTTP_KINDS, report
    assert result["constrained_outcomes"].get("stop", 0) > 0, report  # constrained answers ended and validated
    assert {k.split("/")[1] for k in counts if k.startswith(("http_stream/", "http_complete/"))} == set(
        HTTP_CONSTRAINED), report
    refused = {k: c for k, c in counts.items() if k.startswith("http_invalid/") and k[13:] in HTTP_INVALID_CONSTRAINED}
    assert refused and all(set(c) == {"400"} for c in refused.values()), report  # with the param named
    assert counts["http_burst"].get("429", 0) > 0 and counts["http_burst"].get("200", 0) > 0, report
    assert sum(counts.get(f"http_disconnect/{v}", {}).get("DISCONNECTED", 0)
               for v in ("after_chunks", "timer", "reset")) > 0, report
    assert sum(c.get("400", 0) for k, c in counts.items() if k.startswith("http_malformed/")) > 0, report
    assert result["http_ttft_s"]["p50"] is not None and result["http_gap_s"]["p99"] is not None, report
    print(f"HTTP soak wall time {wall:.1f} s (load {result['load_s']:.1f} s)\n{proc.stdout}")


@pytest.mark.parametrize("protocol, kinds", [("http", HTTP_KINDS), ("both", None)])
def test_the_http_plan_covers_every_http_kind(protocol, kinds):
    from types import SimpleNamespace

    from jaxinfer.tools.soak import HTTP_WEIGHTS, WEIGHTS, Soak

    s = Soak(SimpleNamespace(seed=3, requests=600, protocol=protocol), "localhost:1", None)
    s.info = {"max_waiting": 4}
    s.forms = ["token_ids", "prompt", "chat"]
    plan = s.plan()
    assert {k for k, _, _ in plan} == (kinds or set(WEIGHTS) | set(HTTP_WEIGHTS))
    variants = {(k, v) for k, v, _ in plan}
    assert {v for k, v in variants if k in ("http_stream", "http_complete") and v} == set(HTTP_CONSTRAINED)
    assert set(HTTP_INVALID_CONSTRAINED) <= {v for k, v in variants if k == "http_invalid"}
    s.info = {"max_waiting": -1}  # no admission limit: no bursts
    assert not {k for k, _, _ in s.plan()} & {"burst", "http_burst"}
    s.forms = ["token_ids", "prompt"]  # no chat template: no forced tool calls
    assert {v for k, v, _ in s.plan() if k == "http_stream" and v} == set(HTTP_CONSTRAINED) - set(TOOL_CONSTRAINTS)
    s.forms = ["token_ids"]  # no tokenizer: nothing is constrained
    assert not {v for k, v, _ in s.plan() if k in ("stream", "http_stream", "http_complete") and v}


def test_constrained_answers_are_checked():
    """The soak's check of a constrained answer takes what the constraint allows and nothing else."""
    good = json.dumps({"n": 7, "t": ["a", "b"], "s": "ab", "o": {"k": "x"}}, separators=(",", ":"))
    assert constraint_bad("json_schema", None, good, "stop", None, None) is None
    for bad in ({"n": 100, "t": ["a"], "s": "ab", "o": {"k": "x"}}, {"n": 1, "t": [], "s": "", "o": {"k": "x"}},
                {"n": 1, "t": ["a"], "s": "ABC", "o": {"k": "x"}}, {"n": 1, "t": ["a"], "s": "", "o": {"k": "z"}},
                {"n": 1, "t": ["a"], "s": "", "o": {"k": "x"}, "extra": 1}):
        assert constraint_bad("json_schema", None, json.dumps(bad), "stop", None, None), bad
    assert constraint_bad("json_schema", None, good[:-1], "stop", None, None)  # cut short but "stop"
    assert constraint_bad("json_schema", None, good[:-1], "length", None, None) is None  # cut by max_tokens
    assert constraint_bad("json_object", None, "[1]", "stop", None, None)
    assert constraint_bad("regex", None, "yes-12", "stop", None, None) is None
    assert constraint_bad("regex", None, "yes-12</s>", "stop", None, None)
    assert constraint_bad("choice", None, "red", "stop", None, None) is None
    assert constraint_bad("choice", None, "re", "stop", None, None)
    assert constraint_bad("lark", None, "hello ab", "stop", None, None) is None
    assert constraint_bad("gbnf", None, "yes!", "stop", None, None)
    assert constraint_bad("regex", None, "ye", "error", "structured output (regex) ...", None) is None
    assert constraint_bad("regex", None, "ye", "error", "", None)  # an error must say why
    assert constraint_bad("regex", None, "ye", "abort", None, None)
    named = {"tools": [], "tool_choice": {"type": "function", "function": {"name": "add"}}}
    assert constraint_bad("tool_named", named, "", "tool_calls", None, [("add", '{"a":1,"b":2}')]) is None
    assert constraint_bad("tool_named", named, "", "tool_calls", None, [("pick", '{"k":"x"}')])  # not the named
    assert constraint_bad("tool_named", named, "", "tool_calls", None, [("add", '{"a":10,"b":2}')])
    assert constraint_bad("tool_named", named, "", "stop", None, [("add", '{"a":1,"b":2}')])
    required = {"tool_choice": "required", "parallel_tool_calls": False}
    assert constraint_bad("tool_required", required, "", "tool_calls", None, [("now", "{}")]) is None
    assert constraint_bad("tool_required", required, "", "tool_calls", None, [("now", "{}"), ("now", "{}")])
    assert constraint_bad("tool_required", required, "", "tool_calls", None, [("now", '{"x":1}')])
    assert constraint_bad("tool_required", required, "", "tool_calls", None, [])


def test_sse_lines_end_only_at_line_feeds():
    """A sampled token may spell U+2028 or U+0085, which JSON leaves raw in a string: still one line."""
    import asyncio

    import httpx

    from jaxinfer.tools.soak import _sse_lines

    body = 'data: {"t": "a\u2028b\x85c日本"}\r\n\ndata: [DONE]\n\n'.encode()

    async def pieces():  # three bytes at a time: lines and characters cut across reads
        for i in range(0, len(body), 3):
            yield body[i:i + 3]

    async def lines():
        return [line async for line in _sse_lines(httpx.Response(200, content=pieces()))]

    assert asyncio.run(lines()) == ['data: {"t": "a\u2028b\x85c日本"}', "", "data: [DONE]", ""]
