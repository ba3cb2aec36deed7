"""The measurement harness (`jaxinfer.tools.harness`): rounds, statistics, output, the machine line, workers."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import textwrap

import pytest

from jaxinfer.tools import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- #
# Rounds
# --------------------------------------------------------------------------- #


def test_alternate_rotates_the_order_so_each_system_leads_equally_often():
    calls = []
    names = ["a", "b", "c"]
    out = harness.alternate({n: (lambda i, n=n: calls.append((i, n)) or f"{n}{i}") for n in names}, 6)
    firsts = [calls[3 * i][1] for i in range(6)]
    assert {n: firsts.count(n) for n in names} == {"a": 2, "b": 2, "c": 2}
    for i in range(6):  # every round measures each system once, with its own round index
        assert sorted(n for j, n in calls if j == i) == names
        assert [j for j, _ in calls[3 * i:3 * i + 3]] == [i, i, i]
    assert out == {n: [f"{n}{i}" for i in range(6)] for n in names}  # results by system, in round order


def test_two_systems_flip_each_round():
    order = []
    harness.alternate({"x": lambda i: order.append("x"), "y": lambda i: order.append("y")}, 4)
    assert order == ["x", "y", "y", "x", "x", "y", "y", "x"]


def test_a_failing_system_is_dropped_and_the_others_go_on():
    told = []

    def bad(i):
        if i == 1:
            raise ValueError("worker gone")
        return i

    out = harness.alternate({"ok": lambda i: i, "bad": bad}, 4, on_error=lambda n, i, e: told.append((n, i, str(e))))
    assert out == {"ok": [0, 1, 2, 3], "bad": [0]}
    assert told == [("bad", 1, "worker gone")]
    with pytest.raises(ValueError):
        harness.alternate({"bad": bad}, 3)


def test_spread_and_medians_agree_with_the_standard_library():
    rng = random.Random(5)
    for n in (1, 2, 7, 10):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        s = harness.spread(xs + [None])
        assert s["median"] == pytest.approx(statistics.median(xs))
        assert (s["min"], s["max"], s["n"]) == (min(xs), max(xs), n)
    assert harness.spread([None]) == {"median": None, "min": None, "max": None, "n": 0}
    rounds = [{"tok_s": rng.uniform(1, 9), "ms": rng.uniform(1, 9), "name": "r", "ok": True} for _ in range(5)]
    m = harness.medians(rounds)
    assert set(m) == {"tok_s", "ms"}  # numbers only, by default
    assert m["tok_s"] == pytest.approx(statistics.median(r["tok_s"] for r in rounds))


def test_medians_rename_and_dropping_leaves_the_bulky_keys_out():
    rounds = [{"batch_tok_s": x, "tokens": [1, 2, 3], "ms": 2 * x} for x in (3.0, 1.0, 2.0)]
    assert harness.medians(rounds, {"tok_s": "batch_tok_s"}) == {"tok_s": 2.0}
    assert harness.medians(rounds, ("ms",)) == {"ms": 4.0}
    kept = harness.dropping(rounds, "tokens")
    assert kept == [{"batch_tok_s": x, "ms": 2 * x} for x in (3.0, 1.0, 2.0)] and "tokens" in rounds[0]


def test_timings_time_each_round_per_call_after_the_warm_up():
    calls = []
    ts = harness.timings(lambda: calls.append(1), 4, warmup=2, calls=3)
    assert len(calls) == 2 + 4 * 3 and len(ts) == 4 and all(t >= 0 for t in ts)
    slow = harness.timings(lambda: __import__("time").sleep(0.01), 2)
    assert all(t >= 0.009 for t in slow)


def test_peaks_are_the_engines_roofline_figures(tmp_path, monkeypatch):
    # the figures the engine's floor divides by, stored as the engine stores them, are what a benchmark reports
    from jaxinfer.engine import roofline

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    stored = roofline.MachinePeaks(12.5, 90.0, "numpy max, 2 threads", "xla jitted matmul 1024^3",
                                   {"numpy max, 2 threads": 12.5, "xla jitted sum": 9.0, "xla jitted matmul 1024^3": 90.0},
                                   roofline.machine_key())
    roofline.store_peaks(stored, load=0.0)
    pk = harness.peaks()
    assert pk == {"bandwidth_gbs": 12.5, "method": "numpy max, 2 threads", "flops_gflops": 90.0,
                  "flops_method": "xla jitted matmul 1024^3", "probes": stored.measurements}
    line = harness.peaks_line(pk)
    assert line.startswith("memory bandwidth 12.5 GB/s (numpy max, 2 threads), float32 90.0 GFLOP/s")
    assert all(f"{k} {v:.1f}" in line for k, v in stored.measurements.items())


# --------------------------------------------------------------------------- #
# Output and the machine
# --------------------------------------------------------------------------- #


def test_finish_prints_the_report_and_the_json_file_round_trips(tmp_path, capsys):
    path = tmp_path / "figures.json"
    figures = {"model": "m", "rounds": {"a": [1.5, 2.5]}, "machine": harness.machine(), "path": tmp_path}
    clock = harness.Clock()
    assert harness.finish("REPORT", figures, str(path), clock) == 0
    out = capsys.readouterr().out
    assert out.startswith("REPORT\n") and "(total " in out and f"figures written to {path}" in out
    back = json.loads(path.read_text())
    assert back == json.loads(json.dumps(figures, default=str))
    assert back["path"] == str(tmp_path) and back["wall_s"] >= 0  # what JSON cannot hold, as text


def test_table_aligns_columns():
    text = harness.table(["name", "tok/s"], [["jaxinfer", "12.5"], ["x", "3"]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1  # right-aligned numbers end in one column
    assert lines[1].startswith("jaxinfer") and lines[2].endswith("   3")


def test_the_machine_line_names_the_cpu_flags_and_the_load():
    assert harness.shown_cpu_flags({"avx2", "fma", "sse2", "avx512f", "lm", "asimd"}) == [
        "asimd", "avx2", "avx512f", "fma"]
    m = harness.machine()
    line = harness.machine_line(m)
    assert m["cpus"] == os.cpu_count() and m["jax"] in line
    for flag in m["cpu_flags"]:
        assert flag in line
    from jaxinfer.env import cpu_flags

    if "avx2" in cpu_flags():
        assert "avx2" in line.split("flags: ", 1)[1]
    if m["loadavg"] is not None:
        assert f"load average {m['loadavg'][0]:.2f}" in line


def test_the_harness_imports_with_the_standard_library_alone():
    # a worker runs it in an interpreter that may lack jaxinfer's dependencies
    code = textwrap.dedent(f"""
        import sys
        for m in ("numpy", "jax", "grpc"):
            sys.modules[m] = None
        sys.path.insert(0, {ROOT!r})
        from jaxinfer.tools import harness
        harness.emit({{"line": harness.load_line()}})
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["line"].startswith("load average")


# --------------------------------------------------------------------------- #
# Workers
# --------------------------------------------------------------------------- #

WORKER = f"""
import sys
sys.path.insert(0, {ROOT!r})
from jaxinfer.tools.harness import answer, emit, read_setup

setup = read_setup()
if setup.get("crash"):
    print("setup refused", file=sys.stderr)
    sys.exit(3)
count = [0]

def round_():
    count[0] += 1
    return {{"round": count[0], "scale": setup["scale"] * count[0]}}

def fail():
    raise RuntimeError("no such figure")

emit({{"ready": True, "scale": setup["scale"]}})
sys.exit(answer({{"round": round_, "fail": fail}}))
"""


def test_a_worker_answers_in_json_lines_and_its_errors_reach_the_driver(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    w = harness.Worker(sys.executable, script, {"scale": 3}, threads=1, name="toy worker")
    try:
        assert w.info == {"ready": True, "scale": 3}
        assert [w.round() for _ in range(3)] == [{"round": k, "scale": 3 * k} for k in (1, 2, 3)]
        with pytest.raises(RuntimeError, match="toy worker: RuntimeError: no such figure"):
            w.send("fail")
        with pytest.raises(RuntimeError, match="unknown command 'nope'"):
            w.send("nope")
        assert w.round()["round"] == 4  # still answering after errors
    finally:
        w.close()
    assert w.proc.returncode == 0 and not os.path.exists(w.log.name)
    with pytest.raises(RuntimeError, match=r"exited \(rc=3\):\nsetup refused"):
        harness.Worker(sys.executable, script, {"crash": True, "scale": 1}, name="toy worker")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed here")
def test_the_llamacpp_worker_runs_by_path_and_reports_its_missing_library():
    from benchmarks.llamacpp_peer import WORKER as LLAMA_WORKER

    with pytest.raises(RuntimeError, match="llama_cpp"):
        harness.Worker(sys.executable, LLAMA_WORKER, {"mode": "bench", "model": "/nonexistent.gguf"}, name="llama")


# --------------------------------------------------------------------------- #
# Flags, the report's pieces, a run
# --------------------------------------------------------------------------- #


def test_settle_fills_quick_defaults_and_refuses_values_under_a_limit(capsys):
    def parse(argv):
        p = harness.parser("python -m benchmarks.toy", "A toy.\n\nMore.", rounds=(3, 2), quick="fewer", dtype=True)
        p.add_argument("--window", type=int, default=None)
        p.add_argument("--tokens", type=int, default=8)
        return harness.settle(p, p.parse_args(argv), quick={"window": (48, 24)}, at_least={"tokens": 2})

    a = parse([])
    assert (a.rounds, a.window, a.quick, a.json, a.model, a.dtype) == (3, 48, False, None, "smollm2-135m-instruct", None)
    a = parse(["--quick", "--json", "f.json"])
    assert (a.rounds, a.window, a.json) == (2, 24, "f.json")
    a = parse(["--quick", "--rounds", "7", "--window", "5"])  # what is given wins over --quick
    assert (a.rounds, a.window) == (7, 5)
    with pytest.raises(SystemExit) as e:
        parse(["--tokens", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("error: --tokens must be at least 2, got 1")


def test_find_python_takes_the_flag_then_the_environment_then_the_default(tmp_path, monkeypatch):
    monkeypatch.delenv("TOY_PYTHON", raising=False)
    default = tmp_path / "python"
    assert harness.find_python("/x/py", "TOY_PYTHON", off="--no-toy") == (None, "skipped (--no-toy)")
    assert harness.find_python(None, "TOY_PYTHON", default=str(default), missing="none here") == (
        None, "skipped: none here")
    default.write_text("")
    assert harness.find_python(None, "TOY_PYTHON", default=str(default))[0] == str(default)
    monkeypatch.setenv("TOY_PYTHON", "/env/py")
    assert harness.find_python(None, "TOY_PYTHON", default=str(default)) == ("/env/py", "TOY_PYTHON")
    assert harness.find_python("/flag/py", "TOY_PYTHON")[0] == "/flag/py"
    monkeypatch.delenv("TOY_PYTHON")
    assert harness.find_python(None, "TOY_PYTHON", here=True)[0] == sys.executable


def test_compare_gives_how_many_times_better_the_first_is_either_way():
    text = harness.compare([("tok/s", 30.0, 10.0, ".1f"), ("TTFT (ms)", 50.0, 100.0, ".1f", "lower"),
                            ("load (s)", 2.0, None, ".2f")], names=("ours", "theirs"))
    lines = text.splitlines()
    assert lines[0].split() == ["metric", "ours", "theirs", "ratio"]
    assert lines[1].split()[-3:] == ["30.0", "10.0", "3.00x"]
    assert lines[2].split()[-3:] == ["50.0", "100.0", "2.00x"]  # lower is better: theirs / ours
    assert lines[3].split()[-3:] == ["2.00", "-", "-"]
    assert harness.ratio(None, 3.0) is None and harness.fmt(None) == "-"


def test_targets_say_pass_fail_or_not_measured():
    ts = [harness.target("a", True, "1.2x"), harness.target("b", False, "0.5x", ratio=0.5),
          harness.target("c", None, "peer skipped")]
    assert [t["verdict"] for t in ts] == ["PASS", "FAIL", "n/a"] and ts[1]["ratio"] == 0.5
    assert harness.targets_block(ts) == ["targets:", "  [PASS] a: 1.2x", "  [FAIL] b: 0.5x", "  [n/a ] c: peer skipped"]


def test_run_measures_in_rounds_drops_a_failing_peer_and_writes_the_figures(tmp_path, capsys):
    p = harness.parser("toy", "A toy.", model=None, rounds=3)
    args = harness.settle(p, p.parse_args(["--json", str(tmp_path / "toy.json")]))
    told = []

    def peer(i):
        if i == 1:
            raise RuntimeError("worker gone")
        return 1.0

    def measure(b):
        assert b.args is args and "cpu_flags" in b.figures["system"]
        by = b.rounds({"ours": lambda i: 2.0 + i, "peer": peer}, may_fail=("peer",),
                      on_fail=lambda name, why: told.append((name, why)))
        b.figures["medians"] = {k: harness.spread(v)["median"] for k, v in by.items()}
        assert b.start("broken", lambda: 1 / 0) is None
        with pytest.raises(ValueError):  # only the systems named may fail
            b.rounds({"ours": lambda i: int("x")}, n=1)

    def report(res):
        return "\n".join(harness.heading("toy benchmark", res["system"]) + [f"ours {res['medians']['ours']:.1f}"])

    assert harness.run(measure, report, args) == 0
    assert told == [("peer", "failed in round 2: worker gone")]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "toy benchmark" and out[1].startswith("CPU: ") and "at end [" in out[2] and out[3] == "ours 3.0"
    back = json.loads((tmp_path / "toy.json").read_text())
    assert back["medians"] == {"ours": 3.0, "peer": 1.0} and back["skipped"] == {"broken": "failed: division by zero"}
    assert back["system"]["loadavg_end"] is not None or back["system"]["loadavg"] is None
