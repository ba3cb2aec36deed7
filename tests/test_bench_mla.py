"""benchmarks/mla.py (issue 25): its two models, its arithmetic, and one tiny run through the real engines."""

from __future__ import annotations

import json

import pytest

from jaxinfer.models import active_params

mla_bench = pytest.importorskip("benchmarks.mla")

TINY_ARGS = ["--hidden", "64", "--heads", "4", "--kv-lora-rank", "32", "--qk-nope", "16", "--qk-rope", "16",
             "--v-head", "16", "--head-dim", "16", "--kv-heads", "2", "--intermediate", "128", "--layers", "1",
             "--vocab", "256", "--max-position", "4096"]


def _args(argv, monkeypatch):
    """The benchmark's flags as its main parses and checks them (the run itself replaced)."""
    seen = {}
    monkeypatch.setattr(mla_bench, "run", lambda measure, report, a: seen.setdefault("a", a) and 0)
    assert mla_bench.main(argv) == 0
    return seen["a"]


@pytest.mark.parametrize("argv", [[], TINY_ARGS])
def test_the_gqa_peer_runs_about_mlas_parameters_per_token(argv, monkeypatch):
    mla, gqa = mla_bench.configs(_args(argv, monkeypatch))
    assert mla.latent and not gqa.latent and gqa.num_kv_heads < gqa.num_heads
    # a layer's MLP absorbs the attention's difference to within half a 64-wide step of gate, up and down
    # (and the latent's norm): the benchmark's count of attention parameters is the family's
    per_layer = 3 * 32 * mla.hidden_size + mla.kv_lora_rank + mla.q_lora_rank
    assert abs(active_params(mla) - active_params(gqa)) <= mla.num_layers * per_layer
    assert gqa.intermediate_size != mla.intermediate_size  # MLA's attention is the larger: GQA's MLP widened


def test_the_real_configs_cache_a_latent_far_smaller_than_per_head_keys_and_values():
    real = mla_bench.real_models()
    v3, lite = real["DeepSeek-V3"], real["DeepSeek-V2-Lite"]
    for m in (v3, lite):
        assert m["latent_values"] == 512 + 64 and m["qk_dim"] == 192 and m["v_dim"] == 128
        assert m["latent_bytes"] == m["latent_values"] * m["layers"] * 2  # bfloat16
        assert m["per_head_bytes"] == m["heads"] * (192 + 128) * m["layers"] * 2
    assert (v3["layers"], v3["heads"], lite["layers"], lite["heads"]) == (61, 128, 27, 16)
    assert 70 < v3["smaller_by"] < 72 and 8 < lite["smaller_by"] < 10


def test_bad_flags_exit_2_with_one_line_naming_the_flag(capsys):
    for argv, needle in ((["--contexts", "0"], "--contexts must be at least 1"),
                         (["--contexts", "9000"], "--contexts must be at most --max-position"),
                         (["--steps", "0"], "--steps and --rounds must be at least 1")):
        with pytest.raises(SystemExit) as e:
            mla_bench.main(argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_tiny_run_measures_both_engines_and_its_kv_arithmetic_is_the_engines_cache(tmp_path, capsys):
    out = tmp_path / "mla.json"
    argv = TINY_ARGS + ["--systems", "mla", "gqa", "--batches", "2", "--contexts", "40", "--rounds", "1",
                        "--steps", "1", "--json", str(out)]
    assert mla_bench.main(argv) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert "CPU: " in text and "; flags: " in text and isinstance(res["system"]["cpu_flags"], list)
    assert "conclusion: at batch 2, context 40" in text
    eng = res["engine"]
    for k, m in res["models"].items():
        # what the benchmark counts a token's entry is what the engine allocates for one
        assert m["cache_bytes"] == eng["num_pages"] * eng["page_size"] * m["kv_bytes_per_token"], k
    assert res["models"]["mla"]["kv_bytes_per_token"] == (32 + 16) * 4  # one layer, float32 cache
    assert res["models"]["gqa"]["kv_bytes_per_token"] == 2 * 2 * 16 * 4
    row = res["steps"]["b2_c40"]
    for k in ("mla", "gqa"):
        assert row[k]["step_ms"] > 0 and len(row[k]["rounds_ms"]) == 1
        assert row[k]["kv_read_bytes"] == 2 * 40 * res["models"][k]["kv_bytes_per_token"]
