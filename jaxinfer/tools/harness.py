"""One measurement harness: the pieces every benchmark, `jaxinfer bench`, the device check and the soak share.

A benchmark says what it measures (its systems, its workload, its figures); this module does the rest:

* **the machine**: `machine()` (CPU model and count, the CPU flags that matter to the kernels, load
  average, jax's version) and `machine_line()`, printed beside every figure, since on a shared
  machine the figures move with the load;
* **the machine's peaks**: `peaks()` / `peaks_line()`, the read bandwidth and flops the engine's
  roofline measures (`jaxinfer.engine.roofline`), for a benchmark's "fraction of the floor";
* **rounds**: `timings()` times one call over repeated rounds; `alternate()` measures paired
  systems in rounds, the order rotating each round so no system always goes first (two systems:
  the order flips); `spread()` and `medians()` summarize them (medians come from `jaxinfer.stats`,
  as everywhere), `dropping()` leaves bulky keys out of them;
* **flags**: `parser()` (``--model``, ``--rounds``, ``--quick``, ``--dtype``, ``--json`` as every
  benchmark spells them), `settle()` (defaults that ``--quick`` changes, lower bounds),
  `worker_flags()` and `find_python()` (a peer's interpreter: a flag, an environment variable, a
  default path, or skipped);
* **a run**: `run()` (a `Bench`: the figures with the machine, a `Clock`, rounds in rotation with
  peers that may fail, then the report and ``--json``);
* **output**: `Clock` (progress lines on stderr with the time since the start), `table()`,
  `fmt()`, `heading()` (the title, the machine line and the load at start and end),
  `compare()` (two systems side by side with their ratio), `target()` / `targets_block()` (a goal
  and its PASS / FAIL), `write_json()` and `finish()` (the report, the total time, the ``--json`` file);
* **workers**: `Worker` drives a system that lives in another interpreter (the transformers and
  llama.cpp peers) in JSON lines: a setup line, then one command a line, one JSON reply each;
  `read_setup()`, `emit()` and `answer()` are that protocol's other side, in the worker.

It imports only the standard library at module level (numpy with the statistics, on first use), so a
worker in an interpreter without jaxinfer's dependencies can load it from the checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

# Flag-name prefixes shown with every figure: the SIMD and matrix extensions the kernels can use.
SHOWN_CPU_FLAGS = ("avx", "amx", "fma", "f16c", "bf16", "i8mm", "sve", "asimd", "neon", "sse4", "vnni")


# --------------------------------------------------------------------------- #
# The machine
# --------------------------------------------------------------------------- #


def shown_cpu_flags(flags: Optional[Iterable[str]] = None) -> list:
    """The CPU flags worth printing beside a figure (`SHOWN_CPU_FLAGS`), sorted; this host's by default."""
    if flags is None:
        from jaxinfer.env import cpu_flags

        flags = cpu_flags()
    return sorted(f for f in flags if f.startswith(SHOWN_CPU_FLAGS))


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` knows, else "?")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def load_average() -> Optional[list]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01; None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def load_line() -> str:
    """The load average with the CPU count: every figure on a shared machine is printed beside it."""
    la = load_average()
    if la is None:
        return "load average unknown"
    return f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} CPUs"


def jax_version() -> str:
    """The installed jax's version, read without importing jax."""
    jax = sys.modules.get("jax")
    if jax is not None:
        return jax.__version__
    try:
        return metadata.version("jax")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def machine() -> dict:
    """What a figure was measured on: CPU model and count, shown flags, platform, python, jax, load average.

    The JAX backend is named only where this process has imported jax (asking would start it).
    """
    m = {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "cpu_flags": shown_cpu_flags(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax_version(),
        "loadavg": load_average(),
    }
    if "jax" in sys.modules:
        m["backend"] = sys.modules["jax"].default_backend()
    return m


def machine_line(m: Optional[dict] = None) -> str:
    """One line: CPU model, count and flags, jax (and backend), load average."""
    m = m or machine()
    jax = f"jax {m['jax']}" + (f" on {m['backend']}" if m.get("backend") else "")
    la = m.get("loadavg")
    load = "load average unknown" if la is None else f"load average {' '.join(f'{x:.2f}' for x in la)}"
    return (f"CPU: {m['cpu_model']}, {m['cpus']} CPUs; flags: {' '.join(m['cpu_flags']) or '(unknown)'}; "
            f"{jax}; {load}")


def peaks() -> dict:
    """This machine's read bandwidth (GB/s) and float32 flops (GFLOP/s) as the engine's floor uses them:
    `jaxinfer.engine.roofline.cached_peaks` (the best of several read methods and thread counts, and of
    XLA's and the native kernel's products; measured once per machine and cached). Call it after the
    kernels load (an engine built, or `cpu_matmul.prepare()`), so the native kernel is among the probes.

    {"bandwidth_gbs", "method", "flops_gflops", "flops_method", "probes": {probe: figure}}."""
    from jaxinfer.engine.roofline import cached_peaks

    p = cached_peaks()
    return {"bandwidth_gbs": p.bandwidth_gbps, "method": p.method, "flops_gflops": p.flops_gflops,
            "flops_method": p.flops_method, "probes": dict(p.measurements)}


def peaks_line(pk: Mapping) -> str:
    """`peaks` in one line: the peak read bandwidth and flops with the probe each came from, then every probe."""
    probes = "; ".join(f"{k} {v:.1f}" for k, v in pk["probes"].items())
    return (f"memory bandwidth {pk['bandwidth_gbs']:.1f} GB/s ({pk['method']}), float32 {pk['flops_gflops']:.1f} "
            f"GFLOP/s ({pk['flops_method']}); every probe (GB/s of reads, GFLOP/s of products): {probes}")


# --------------------------------------------------------------------------- #
# Rounds
# --------------------------------------------------------------------------- #


def timings(fn: Callable[[], Any], repeats: int, warmup: int = 0, calls: int = 1) -> list:
    """Seconds per call of `fn` in each of `repeats` rounds of `calls` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return out


def rotation(names: Sequence, i: int) -> list:
    """Round `i`'s order of `names`: rotated by `i`, so each goes first as often as the others."""
    names = list(names)
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def alternate(
    systems: Mapping[Any, Callable[[int], Any]],
    rounds: int,
    log: Optional[Callable[[str], None]] = None,
    on_error: Optional[Callable[[Any, int, Exception], None]] = None,
) -> dict:
    """Measure every system once a round for `rounds` rounds, in `rotation`; {name: [result per round]}.

    `systems` maps a name to ``measure(round_index) -> result``. With `on_error`, a system whose
    measure raises is told to it (name, round index, exception) and left out of later rounds;
    without it the exception propagates.
    """
    live = dict(systems)
    out: dict = {name: [] for name in systems}
    for i in range(rounds):
        for name in rotation(systems, i):
            if name not in live:
                continue
            if log is not None:
                log(f"round {i + 1}/{rounds}: {name}")
            try:
                out[name].append(live[name](i))
            except Exception as e:
                if on_error is None:
                    raise
                on_error(name, i, e)
                del live[name]
    return out


def spread(values: Iterable[Optional[float]]) -> dict:
    """median, min, max and count of the values that are not None (all None when there are none)."""
    from jaxinfer.stats import median

    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def medians(rounds: Sequence[Mapping], keys: Optional[Iterable] = None) -> dict:
    """{key: median over the rounds} for `keys` (default: the first round's keys with numeric values);
    `keys` as a mapping ``{name: key}`` renames: ``{name: median of round[key]}``."""
    from jaxinfer.stats import median

    if keys is None:
        first = rounds[0] if rounds else {}
        keys = [k for k, v in first.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    names = dict(keys) if isinstance(keys, Mapping) else {k: k for k in keys}
    return {name: median([r[k] for r in rounds]) for name, k in names.items()}


def dropping(rounds: Iterable[Mapping], *keys) -> list:
    """The rounds without `keys` (bulky per-token lists a report keeps out of its JSON)."""
    return [{k: v for k, v in r.items() if k not in keys} for r in rounds]


# --------------------------------------------------------------------------- #
# Flags
# --------------------------------------------------------------------------- #


def parser(prog: str, doc: str, *, model: Optional[str] = "smollm2-135m-instruct", rounds: Any = None,
           quick: Optional[str] = None, dtype: bool = False,
           json_help: str = "also write every figure as JSON to this file") -> argparse.ArgumentParser:
    """A benchmark's parser, with the flags the benchmarks share spelt one way.

    `doc`'s first line is the description. ``--model`` (default `model`; None: no flag);
    ``--rounds``: `rounds` is its default, or a pair (default, with ``--quick``) that `settle`
    applies; ``--quick`` with `quick` as its help; ``--dtype`` (the weights': auto, float32,
    bfloat16); ``--json FILE`` always.
    """
    p = argparse.ArgumentParser(prog=prog, description=doc.strip().split("\n")[0])
    if model is not None:
        p.add_argument("--model", default=model, help=f"the model (default: {model})")
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    if rounds is not None:
        if isinstance(rounds, tuple):
            p.add_argument("--rounds", type=int, default=None,
                           help=f"measured rounds (default {rounds[0]}, --quick {rounds[1]})")
            p.set_defaults(_quick_rounds=rounds)
        else:
            p.add_argument("--rounds", type=int, default=rounds, help=f"measured rounds (default {rounds})")
    if dtype:
        p.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16"),
                       help="weights' dtype (default: the preset's)")
    p.add_argument("--json", default=None, metavar="FILE", help=json_help)
    return p


def settle(p: argparse.ArgumentParser, args: argparse.Namespace, quick: Optional[Mapping[str, tuple]] = None,
           at_least: Optional[Mapping[str, int]] = None) -> argparse.Namespace:
    """Fill the flags left unset (None) from `quick`'s ``{name: (default, with --quick)}`` (``--rounds``
    from `parser`'s pair too), then refuse a value under `at_least`'s ``{name: minimum}`` with
    one line naming the flag and the limit."""
    pairs = dict(quick or {})
    if getattr(args, "_quick_rounds", None):
        pairs.setdefault("rounds", args._quick_rounds)
        del args._quick_rounds
    fast = bool(getattr(args, "quick", False))
    for name, (normal, quick_value) in pairs.items():
        if getattr(args, name, None) is None:
            setattr(args, name, quick_value if fast else normal)
    for name, least in (at_least or {}).items():
        v = getattr(args, name)
        if v is not None and v < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {v}")
    return args


def worker_flags(p: argparse.ArgumentParser, name: str, what: str) -> None:
    """``--NAME-python PATH`` (the interpreter that runs the `what` worker) and ``--no-NAME`` (skip it)."""
    p.add_argument(f"--{name}-python", default=None, metavar="PATH", help=f"interpreter with {what}")
    p.add_argument(f"--no-{name}", action="store_true", help=f"skip the {what} peer")


def find_python(flag: Optional[str], env: str, *, off: Optional[str] = None, default: Optional[str] = None,
                here: bool = False, missing: str = "no interpreter") -> tuple:
    """(a worker's interpreter or None, how it was chosen or why it is skipped).

    In order: `off` (the flag that skipped it, e.g. ``"--no-hf"``), the flag's path, the environment
    variable `env`, `default` where that file exists, this interpreter where `here` is true;
    else None and ``"skipped: " + missing``.
    """
    if off:
        return None, f"skipped ({off})"
    if flag:
        return flag, "flag"
    if os.environ.get(env):
        return os.environ[env], env
    if default and os.path.exists(default):
        return default, "default"
    if here:
        return sys.executable, "this interpreter"
    return None, f"skipped: {missing}"


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


class Clock:
    """Seconds since the start, and progress lines on stderr stamped with them: ``[  12.3s] loading``."""

    def __init__(self, stream=None):
        self.t0 = time.perf_counter()
        self.stream = stream

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", file=self.stream or sys.stderr, flush=True)


def table(header: Sequence[str], rows: Iterable[Sequence], first_width: Optional[int] = None,
          left: Iterable[int] = (0,)) -> str:
    """Columns of text, each as wide as its widest cell: those in `left` (the first) left-aligned, the rest right."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[j]) for r in cells if j < len(r)) for j in range(len(header))]
    if first_width:
        widths[0] = max(widths[0], first_width)
    left = set(left)
    return "\n".join(
        " ".join(c.ljust(widths[j]) if j in left else c.rjust(widths[j]) for j, c in enumerate(r)).rstrip() for r in cells)


def fmt(x: Optional[float], spec: str = ".1f") -> str:
    """A figure in `spec`, or "-" where it was not measured (None)."""
    return "-" if x is None else format(x, spec)


def heading(title: str, system: Mapping) -> list:
    """A report's first lines: its title, the machine line, the load average at the start and at the end."""
    return [title, machine_line(dict(system)),
            f"load average at start {system.get('loadavg')}, at end {system.get('loadavg_end')}"]


def ratio(a: Optional[float], b: Optional[float], lower_better: bool = False) -> Optional[float]:
    """How many times better `a` is than `b` (a / b; b / a where lower is better); None without both."""
    if not a or not b:
        return None
    return b / a if lower_better else a / b


def compare(rows: Iterable[Sequence], names: Sequence[str] = ("jaxinfer", "transformers"), label: str = "metric",
            indent: str = "") -> str:
    """Two systems side by side and how many times better the first is, as a `table`.

    Each row is ``(label, a, b, spec)`` or ``(label, a, b, spec, "lower")`` where lower is better;
    a figure not measured (None) prints "-", and so does the ratio without both.
    """
    out = []
    for row in rows:
        name, a, b, spec = row[:4]
        r = ratio(a, b, lower_better=len(row) > 4 and row[4] == "lower")
        out.append([name, fmt(a, spec), fmt(b, spec), "-" if r is None else f"{r:.2f}x"])
    text = table([label, *names, "ratio"], out)
    return "\n".join(indent + line for line in text.splitlines())


def target(name: str, ok: Optional[bool], value: str, **extra) -> dict:
    """A goal's record: its name, PASS / FAIL (n/a where `ok` is None: not measured) and the value shown."""
    return {"name": name, "verdict": "n/a" if ok is None else ("PASS" if ok else "FAIL"), "value": value, **extra}


def targets_block(targets: Iterable[Mapping], title: str = "targets:") -> list:
    """The report's lines for the goals: `title`, then ``  [PASS] name: value`` each."""
    return [title] + [f"  [{t['verdict']:<4}] {t['name']}: {t['value']}" for t in targets]


def write_json(path, figures: Any, indent: int = 2) -> None:
    """Write the figures as JSON (what JSON cannot hold, as text)."""
    Path(path).write_text(json.dumps(figures, indent=indent, default=str) + "\n", encoding="utf-8")


def finish(report: str, figures: dict, json_path: Optional[str], clock: Optional[Clock] = None,
           json_figures: Optional[dict] = None) -> int:
    """Print the report (and the total time, with a `clock`), write `--json`'s file; 0, for `main` to return.

    `json_figures`, when given, is what the file holds instead of `figures` (a benchmark that keeps
    bulky per-token values out of it).
    """
    out = figures if json_figures is None else json_figures
    if clock is not None:
        figures["wall_s"] = out["wall_s"] = clock.elapsed()
    print(report, flush=True)
    if clock is not None:
        print(f"\n(total {figures['wall_s']:.0f} s)")
    if json_path:
        write_json(json_path, out)
        print(f"figures written to {json_path}")
    return 0


# --------------------------------------------------------------------------- #
# A run
# --------------------------------------------------------------------------- #


class Bench:
    """One benchmark run: its flags (`args`), the figures the report and ``--json`` read (``system``:
    the `machine` at the start, its load at the end added), `log` (a `Clock`), and what was skipped."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log = Clock()
        self.figures: dict = {"system": machine()}

    def skip(self, name: str, why: str, key: str = "skipped") -> None:
        """Record (in ``figures[key][name]``) and log why a system has no figures."""
        self.figures.setdefault(key, {})[name] = why
        self.log(f"{name} {why}")

    def start(self, name: str, make: Callable[[], Any], key: str = "skipped") -> Any:
        """`make()` (a peer's worker, a system); on an error, that recorded with `skip` and None."""
        try:
            return make()
        except Exception as e:  # reported, and the run goes on without it
            self.skip(name, f"failed: {e}", key)
            return None

    def rounds(self, systems: Mapping[Any, Callable[[int], Any]], n: Optional[int] = None, tag: str = "",
               may_fail: Any = (), on_fail: Optional[Callable[[Any, str], None]] = None) -> dict:
        """`alternate` over `n` rounds (``args.rounds`` by default), each round logged after `tag`.

        A system named in `may_fail` (True: any) whose measure raises is logged, left out of later
        rounds and told to `on_fail` (name, ``"failed in round k: error"``); any other one's error
        propagates.
        """
        def failed(name, i, e):
            if may_fail is not True and name not in may_fail:
                raise e
            why = f"failed in round {i + 1}: {e}"
            self.log(f"{name} {why}")
            if on_fail is not None:
                on_fail(name, why)

        return alternate(systems, self.args.rounds if n is None else n,
                         log=lambda m: self.log(f"{tag}{m}"), on_error=failed)


def run(measure: Callable[[Bench], None], report: Callable[[dict], str], args: argparse.Namespace,
        json_figures: Optional[Callable[[dict], dict]] = None) -> int:
    """A benchmark's `main`: `measure` fills a `Bench`'s figures, then the report is printed with the total
    time and the ``--json`` file written (`json_figures`, when given, chooses what it holds); 0."""
    bench = Bench(args)
    bench.log(machine_line(bench.figures["system"]))
    measure(bench)
    res = bench.figures
    res["system"]["loadavg_end"] = load_average()
    if "jax" in sys.modules and "backend" not in res["system"]:  # a benchmark that started jax itself
        res["system"]["backend"] = sys.modules["jax"].default_backend()
    return finish(report(res), res, getattr(args, "json", None), bench.log,
                  json_figures=json_figures(res) if json_figures else None)


# --------------------------------------------------------------------------- #
# Workers: a system in another interpreter, in JSON lines
# --------------------------------------------------------------------------- #


class Worker:
    """A worker process driven in JSON lines: a setup line (its reply is `info`), then one command a line.

    An ``{"error": ...}`` reply, or the process exiting, raises RuntimeError with the tail of the
    worker's stderr (kept in a temporary file while it runs).
    """

    def __init__(self, python: str, script, setup: dict, threads: Optional[int] = None, name: str = "worker",
                 env: Optional[dict] = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{re.sub(r'[^A-Za-z0-9]+', '_', name)}_",
                                               suffix=".log", delete=False)
        extra = dict(env or {})
        if threads is not None:
            extra.setdefault("OMP_NUM_THREADS", str(threads))
        self.proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=dict(os.environ, **extra))
        self.info = self.send(json.dumps(setup))

    def send(self, line: str) -> dict:
        """One command line; its JSON reply."""
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            reply = self.proc.stdout.readline()
        except BrokenPipeError:
            reply = ""
        if not reply:
            self.log.flush()
            self.log.seek(0)
            raise RuntimeError(f"{self.name} exited (rc={self.proc.wait(10)}):\n{self.log.read()[-3000:]}")
        out = json.loads(reply)
        if "error" in out:
            raise RuntimeError(f"{self.name}: {out['error']}")
        return out

    def round(self) -> dict:
        return self.send("round")

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def emit(obj: Any) -> None:
    """The worker's side: one JSON reply line on stdout."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def read_setup(stream=None) -> dict:
    """The worker's side: the setup line."""
    return json.loads((stream or sys.stdin).readline())


def answer(commands: Mapping[str, Callable[[], Any]], stream=None) -> int:
    """The worker's side: answer each command line with its function's result until "quit" or end of input.

    A failing command, or one not in `commands`, is answered ``{"error": ...}`` and the loop goes on.
    """
    for line in stream or sys.stdin:
        cmd = line.strip()
        if cmd == "quit" or not cmd:
            break
        if cmd not in commands:
            emit({"error": f"unknown command {cmd!r}; known: {', '.join(sorted(commands))}"})
            continue
        try:
            emit(commands[cmd]())
        except Exception as e:  # reported to the driver, which decides
            emit({"error": f"{type(e).__name__}: {e}"})
    return 0

