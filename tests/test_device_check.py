"""`python -m jaxinfer.tools.device_check --quick --skip-tests` on CPU: its table and its JSON.

The accelerator check (tests, parity, bandwidth, roofline, throughput) runs here at
--quick sizes through the same code path: a tiny random Llama through `LLM.from_params` and
the llama3 family fixture. (SmolLM2's row, parity included, is what an accelerator run adds;
on CPU tests/test_parity.py checks SmolLM2 against transformers, and loading it here too cost
the suite a minute.)
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest


pytestmark = [pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-check") / "check.json"
    models = "tiny"
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, "-m", "jaxinfer.tools.device_check", "--quick", "--skip-tests", "--models", models,
           "--json", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()), seconds, models


def _table_row(table: str, name: str) -> list:
    """The cells after the name of the table row that starts with `name` (split on 2+ spaces)."""
    for line in table.splitlines():
        if line.startswith(name + "  "):
            return re.split(r"\s{2,}", line[len(name):].strip())
    raise AssertionError(f"no row {name!r} in\n{table}")


def test_quick_check_prints_one_table_with_every_row_measured(quick_run):
    stdout, res, seconds, models = quick_run
    # ~30 s with the program cache warm, 45-65 s cold on two shared cores; a gross bound here
    # (the 1B model by mistake would take many minutes), the figure itself is in the report
    assert seconds < 240, f"--quick took {seconds:.0f} s"  # two test workers share the 2 CI cores
    table = res["table"]
    assert table in stdout and stdout.count("status: ") == 1
    assert "platform cpu" in table and f"jax {res['env']['jax']}" in table and "jaxlib" in table
    assert "flags:" in table and res["env"]["cpu_flags"] is not None  # the CPU's flags, on CPU
    assert "tests: skipped" in table and res["tests"] is None
    assert "status: OK" in table and res["ok"]
    # the quantized products are checked as the steps run them: on CPU the native kernel, with no float copy
    from jaxinfer.ops import kernels

    if kernels.ready(kernels.MATMUL) or kernels.is_built(kernels.MATMUL):
        assert all(q["custom_call"] and q["fused"] for q in res["quantized"]), res["quantized"]
    bw = res["bandwidth"]
    assert _positive(bw["copy_gb_s"]) and _positive(bw["read_gb_s"])
    assert bw["gb_s"] == max(bw["copy_gb_s"], bw["read_gb_s"])

    names = ["tiny Llama (random)"] + (["SmolLM2-135M"] if "smollm2" in models else [])
    assert sorted(m["model"] for m in res["models"]) == sorted(names)
    for m in res["models"]:
        step, tp = m["decode_step"], m["throughput"]
        assert _positive(step["step_s"]) and _positive(m["itl"]["itl_s"]) and _positive(tp["tok_s"])
        assert 0 < m["roofline_fraction"] < 2, m["roofline_fraction"]  # above 1 only if data sat in caches
        assert m["bytes_per_step"]["params"] >= 2 * m["params"]  # every parameter, 2 or 4 bytes each
        assert m["bytes_per_step"]["kv"] > 0
        assert step["context"] == res["prompt_len"] + res["new_tokens"] == 48
        assert tp["requests"] == res["num_requests"] == 8
        assert all(r["steps"] > 0 for r in tp["rounds"])
        assert tp["compiles_while_measuring"] == 0  # the warm-up round compiled every program
        assert m["itl"]["tokens"] == res["sizes"]["itl_tokens"]
        # the table shows the same figures: step ms, roofline %, ITL ms, tok/s all positive numbers
        cells = _table_row(table, m["model"])
        step_ms, roof, itl_ms, tok_s = cells[2], cells[3], cells[4], cells[5]
        assert float(step_ms) == pytest.approx(step["step_s"] * 1e3, abs=1e-3)
        assert roof.endswith("%") and float(roof[:-1]) > 0
        assert float(itl_ms) > 0 and float(tok_s) > 0


def test_quick_check_family_parity_matches_the_float32_fixture(quick_run):
    stdout, res, seconds, models = quick_run
    (fam,) = res["families"]
    assert fam["family"] == "llama3" and 0 < fam["default"]["max_err"] < 1e-4
    err = float(_table_row(res["table"], "fixture llama3")[-1])
    assert 0 < err < 1e-4
