"""The ragged step against the two-program engine it replaced (issue 23), side by side in one run.

    python -m benchmarks.ragged_step --before /tmp/wt_base [--rounds 2] [--json FILE]

``--before`` is a checkout of the commit before the ragged step (``git worktree add DIR <commit>``; with
``models`` and ``server`` linked into its ``jaxinfer/`` so it imports from there). Each round runs every
workload once in each tree, the order alternating, each in a fresh interpreter (its programs warmed
up first, from the program cache after the first round). The workloads, SmolLM2-135M in float32 on the
``cpu`` preset:

* **mixed**: 48 requests at once, prompts uniform in 16-700 tokens, 32 output tokens each (greedy,
  ignoring end-of-sequence): output + prompt throughput, TTFT p50, the p99 inter-token gap;
* **arrival**: 16 streams decoding, then a 2,000-token prompt arrives: the worst gap of the 16 streams
  from the arrival on, against their median gap before it;
* **batch 1**: one 128-token prompt, 64 tokens: the median time per output token.

and the program count of each engine's warm-up list. The CPU flags are printed with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

from jaxinfer.tools.harness import machine, machine_line, medians, table

WORKER = textwrap.dedent('''
    import json, statistics, sys, time
    import numpy as np
    import jaxinfer
    from jaxinfer import SamplingParams
    from jaxinfer.stats import percentile
    which = sys.argv[1]
    llm = jaxinfer.LLM(engine_config="cpu", dtype="float32", warmup=True)
    out = {"programs": len(llm.engine.program_keys())}
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    def prompt(n):
        return rng.integers(10, vocab - 10, n).tolist()
    def sp(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    def gaps(m):
        t = m.token_times
        return [b - a for a, b in zip(t, t[1:])]
    if which == "mixed":
        prompts = [prompt(int(n)) for n in rng.integers(16, 701, 48)]
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp(32))
        wall = time.perf_counter() - t0
        toks = sum(len(p) for p in prompts) + sum(len(r.outputs[0].token_ids) for r in res)
        ttft = [r.metrics.first_token_time - r.metrics.arrival_time for r in res]
        itl = [g for r in res for g in gaps(r.metrics)]
        out.update(throughput=toks / wall, ttft_p50=percentile(ttft, 50), itl_p99=percentile(itl, 99), wall=wall)
    elif which == "arrival":
        reqs = [llm.make_request(prompt(64), sp(160)) for _ in range(16)]
        streams = [llm.submit(r) for r in reqs]
        while min(len(r.metrics.token_times) for r in reqs) < 40:
            time.sleep(0.005)
        before = [g for r in reqs for g in gaps(r.metrics)[10:]]
        t_arrive = time.perf_counter()
        long = llm.submit(llm.make_request(prompt(2000), sp(4)))
        long.result()
        after = []
        for r in reqs:
            t = [x for x in r.metrics.token_times]
            after += [b - a for a, b in zip(t, t[1:]) if b > t_arrive]
        for s in streams:
            s.result()
        out.update(gap_before_median=statistics.median(before), worst_gap_after=max(after))
    else:
        res = llm.generate([prompt(128)], sp(64))[0]
        out.update(tpot_median=statistics.median(gaps(res.metrics)))
    llm.close()
    print("RESULT " + json.dumps(out), flush=True)
''')

WORKLOADS = ("mixed", "arrival", "batch1")


def run(tree: str, workload: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.run([sys.executable, "-c", WORKER, workload], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"{tree} {workload}: exit {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout of the commit before the ragged step")
    ap.add_argument("--after", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    m = machine()
    print(machine_line(m), flush=True)
    rounds: dict = {"before": [], "after": []}
    for i in range(a.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        got = {name: {} for name in order}
        for w in a.workloads:
            for name in order:
                r = run(getattr(a, name), w)
                got[name].update({f"{w}:{k}": v for k, v in r.items()})
                print(f"round {i + 1} {name:6s} {w}: {r}", flush=True)
        for name in order:
            rounds[name].append(got[name])
    med = {name: medians(rs) for name, rs in rounds.items()}
    keys = sorted(set(med["before"]) & set(med["after"]))
    rows = [(k, f"{med['before'][k]:.4g}", f"{med['after'][k]:.4g}",
             f"{med['after'][k] / med['before'][k]:.2f}x" if med["before"][k] else "-") for k in keys]
    print(machine_line(m))
    print(table(["figure (median of rounds)", "two programs", "ragged step", "after/before"], rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"system": m, "rounds": rounds, "medians": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
