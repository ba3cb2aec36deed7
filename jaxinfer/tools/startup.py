"""Start-up benchmark: how long a user waits before the first text, a ready server, a loaded LLM.

    python -m jaxinfer.tools.startup [--baseline-python OLD/bin/python] [--rounds 3]

Each figure is measured in a fresh process, as a user meets it:

* ``generate``: ``python -m jaxinfer.cli.main generate PROMPT`` until its first
  byte of text on stdout (and until it exits);
* ``LLM()``: the library's ``jaxinfer.LLM(model)`` construction, timed
  inside the process (and the whole process, imports included);
* ``serve``: ``python -m jaxinfer.cli.main serve --port 0`` (full warm-up) until
  it prints its ready line;
* ``tokenize``: ``python -m jaxinfer.cli.main tokenize TEXT`` until it exits.

*Cold* runs use a fresh, empty ``HOME`` and ``XDG_CACHE_HOME`` (no model
cache, no program cache, no kernel built at run time, no XLA cache; the CPU
kernels the install built are there, as on a user's machine: ``make demo``'s
install builds them); ``--cold-rounds`` of them, a median; *warm* runs reuse the
HOME of the cold run, so every cache is in place. Warm figures are medians
of ``--rounds`` runs. With ``--baseline-python`` the same commands run with
another interpreter that has an older jaxinfer installed (a separate venv),
alternating with ours in the same run, so the two are compared side by side.
The CPU's flags and the versions are printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from jaxinfer.tools.harness import alternate, machine, machine_line, medians, write_json

PROMPT = "Why is the sky blue?"


def _env(home: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXINFER_", "XDG_", "JAX_"))}
    env["HOME"] = home
    env["XDG_CACHE_HOME"] = os.path.join(home, ".cache")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _first_output(cmd: list, env: dict, until: Optional[bytes], timeout: float) -> tuple[float, float, bytes]:
    """Run ``cmd``; seconds to the first stdout byte (or to a line containing ``until``), to the end."""
    t0 = time.perf_counter()
    # run from HOME, so `-m jaxinfer.cli.main` imports the interpreter's installed jaxinfer, not a checkout in the cwd
    proc = subprocess.Popen(cmd, env=env, cwd=env["HOME"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    first = None
    out = b""
    try:
        while True:
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError
            chunk = proc.stdout.readline() if until else proc.stdout.read(1)
            if not chunk:
                break
            out += chunk
            if first is None and (until is None or until in chunk):
                first = time.perf_counter() - t0
                if until is not None:
                    break
        if until is not None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    except TimeoutError:
        proc.kill()
        proc.wait()
        return float("nan"), float("nan"), out
    return (first if first is not None else float("nan")), time.perf_counter() - t0, out


def measure(python: str, home: str, what: str, model: str, timeout: float, serve_args: list) -> dict:
    env = _env(home)
    cli = [python, "-m", "jaxinfer.cli.main"]
    if what == "generate":
        first, total, _ = _first_output(
            cli + ["generate", PROMPT, "--model", model, "--max-tokens", "16", "--temperature", "0"], env, None, timeout
        )
        return {"first_text_s": first, "exit_s": total}
    if what == "llm":
        code = (
            "import time; t = time.perf_counter(); import jaxinfer; "
            f"jaxinfer.LLM({model!r}); print('LLM_S', time.perf_counter() - t)"
        )
        first, total, out = _first_output([python, "-c", code], env, b"LLM_S", timeout)
        inside = float(out.split(b"LLM_S", 1)[1].split()[0]) if b"LLM_S" in out else float("nan")
        return {"llm_s": inside, "process_s": first}
    if what == "serve":
        first, _, _ = _first_output(cli + ["serve", "--model", model, "--port", "0", *serve_args], env, b"ready",
                                    timeout)
        return {"ready_s": first}
    if what == "tokenize":
        _, total, _ = _first_output(cli + ["tokenize", "Hello there", "--model", model], env, None, timeout)
        return {"exit_s": total}
    raise ValueError(what)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--python", default=sys.executable, help="the interpreter with this jaxinfer (default: this one)")
    p.add_argument("--baseline-python", help="an interpreter with an older jaxinfer installed, measured alongside")
    p.add_argument("--baseline-serve-args", default="--warmup",
                   help="serve flags for the baseline (default: --warmup, its full warm-up)")
    p.add_argument("--rounds", type=int, default=3, help="warm runs of each command (median reported)")
    p.add_argument("--cold-rounds", type=int, default=1,
                   help="cold runs of the first command and of serve, each in an empty HOME (median reported)")
    p.add_argument("--only", nargs="*", default=["generate", "llm", "tokenize", "serve"],
                   choices=["generate", "llm", "tokenize", "serve"])
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a run counts as failed (nan)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.cold_rounds < 1:
        p.error(f"--cold-rounds must be at least 1 (the warm runs reuse the HOME the first command's cold run "
                f"filled), got {args.cold_rounds}")

    systems = {"jaxinfer": (args.python, [])}
    if args.baseline_python:
        systems["baseline"] = (args.baseline_python, args.baseline_serve_args.split())
    print(f"# {machine_line()}; python {platform.python_version()}", flush=True)
    results: dict = {name: {} for name in systems}
    homes = {name: tempfile.mkdtemp(prefix=f"jaxinfer-startup-{name}-") for name in systems}
    try:
        # cold: the first command (generate, as a new user would) in the HOME the warm runs then
        # reuse, and the server's start in a HOME of its own
        # (each --cold-rounds times, every time in an empty HOME; the first command's last HOME is kept)
        cold = [args.only[0]] + [w for w in ("serve",) if w in args.only[1:]]
        for what in cold:
            for name, (py, serve_args) in systems.items():
                runs = []
                for i in range(args.cold_rounds):
                    keep = what == args.only[0] and i == args.cold_rounds - 1
                    home = homes[name] if keep else tempfile.mkdtemp(prefix=f"jaxinfer-cold-{name}-")
                    runs.append(measure(py, home, what, args.model, args.timeout, serve_args))
                    if not keep:
                        shutil.rmtree(home, ignore_errors=True)
                med = medians(runs, runs[0].keys())
                results[name][f"cold {what}"] = {"median": med, "runs": runs}
                print(f"{name:9s} cold {what:9s} " + "  ".join(f"{k} {v:.2f}" for k, v in med.items())
                      + f"  (median of {args.cold_rounds})", flush=True)
        # warm: alternate the systems, round by round, in the HOME their cold run filled
        for what in args.only:
            runs = alternate({name: lambda i, name=name, py=py, serve_args=serve_args:
                              measure(py, homes[name], what, args.model, args.timeout, serve_args)
                              for name, (py, serve_args) in systems.items()}, args.rounds)
            for name in systems:
                med = medians(runs[name], runs[name][0].keys())
                results[name][f"warm {what}"] = {"median": med, "runs": runs[name]}
                print(f"{name:9s} warm {what:9s} " + "  ".join(f"{k} {v:.2f}" for k, v in med.items())
                      + f"  (median of {args.rounds})", flush=True)
    finally:
        for h in homes.values():
            shutil.rmtree(h, ignore_errors=True)
    if args.json:
        write_json(args.json, {"cpu": machine_line(), "machine": machine(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
