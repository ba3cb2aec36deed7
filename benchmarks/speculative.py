"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side in one run.

    python -m benchmarks.speculative [--rounds 3] [--k 4] [--quick] [--json FILE]

Engines of the same weights in one process (SmolLM2-135M-Instruct in float32 on the ``cpu`` preset by
default): plain, ``speculative_config={"method": "ngram", "num_speculative_tokens": k}``, and a draft model
(the same model's int4 weights, ``{"method": "draft_model", "quantization": "int4", ...}``: a pair that
shares one tokenizer offline); each round runs every workload on each, the order rotating. Greedy decoding, so both must give the same tokens
(checked every round). Workloads:

* **grounded, batch 1**: the model copies or edits a passage it was given (the kind of task prompt lookup
  is for: code editing, summarising with quotes): decode tokens per second (output tokens after the
  first over the time from the first to the last), one request at a time;
* **open chat, batch 1**: open-ended questions (little to copy: low acceptance);
* **32 concurrent**: 32 open-chat requests at once: output tokens per second of the batch.

The acceptance rate and mean accepted length of each workload are printed with the speed-ups, the
host time the proposer and the per-step sync took, and the batch above which no step speculates
(``disable_by_batch_size``: by default where a decode step turns compute-bound on this machine). Targets (issue 24): grounded >= 1.8x, open chat and
32 concurrent >= 0.95x plain.
"""

from __future__ import annotations

import sys
import time

from jaxinfer.tools.harness import (
    compare, fmt, heading, medians, parser, run, settle, table, target, targets_block,
)

PASSAGES = [
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker opened his shutters, "
    "and the ferry bell rang twice across the water. By eight the market square was full of carts carrying "
    "apples, onions, cheese and bread, and the schoolchildren ran between them towards the old stone bridge.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n        total += v\n"
    "        if i >= window:\n            total -= values[i - window]\n        out.append(total / min(i + 1, window))\n"
    "    return out\n",
    "Our library opens at nine on weekdays and at ten on Saturdays. Members may borrow up to six books for three "
    "weeks and renew them twice online. Late returns cost ten cents a day. The reading room on the second floor "
    "is quiet space; the children's corner on the ground floor hosts story time every Wednesday at four.",
]
GROUNDED = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Rename the function to running_mean and otherwise repeat the code unchanged:\n\n{}",
    "Copy this notice, changing 'Saturdays' to 'Sundays' and nothing else:\n\n{}",
]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten year old.",
    "What are three good habits for learning a new language? Explain each.",
]


def measure(bench) -> None:
    import jaxinfer
    from jaxinfer import SamplingParams

    a = bench.args
    spec_cfg = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    draft_cfg = {"method": "draft_model", "model": a.model, "quantization": "int4", "num_speculative_tokens": a.k}
    # every program compiled first (from the program cache after a first run): no round waits for a compile
    llms = {
        "plain": jaxinfer.LLM(a.model, engine_config="cpu", dtype=a.dtype, warmup=True),
        "ngram": jaxinfer.LLM(a.model, engine_config="cpu", dtype=a.dtype, speculative_config=spec_cfg, warmup=True),
    }
    if not a.no_draft:
        llms["draft"] = jaxinfer.LLM(a.model, engine_config="cpu", dtype=a.dtype, speculative_config=draft_cfg,
                                     warmup=True)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    grounded = [[{"role": "user", "content": t.format(p)}] for t, p in zip(GROUNDED, PASSAGES)]
    opened = [[{"role": "user", "content": q}] for q in OPEN]
    crowd = [opened[i % len(opened)] for i in range(32)]
    crowd_sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens // 2, ignore_eos=True)
    outputs: dict = {}

    def decode_rate(outs) -> float:
        toks = secs = 0.0
        for o in outs:
            t = o.metrics.token_times
            toks += len(t) - 1
            secs += t[-1] - t[0]
        return toks / secs if secs else 0.0

    def spec_counts(llm):
        s = llm.engine.speculator
        return (s.stats.num_drafts, s.stats.num_draft_tokens, s.stats.num_accepted_tokens) if s else (0, 0, 0)

    def one(name, workload):
        llm = llms[name]
        before = spec_counts(llm)
        t0 = time.perf_counter()
        if workload == "crowd":
            outs = llm.chat(crowd, crowd_sp)
            wall = time.perf_counter() - t0
            speed = sum(len(o.outputs[0].token_ids) for o in outs) / wall
        else:
            outs = [llm.chat([m], sp)[0] for m in (grounded if workload == "grounded" else opened)]
            speed = decode_rate(outs)
        after = spec_counts(llm)
        drafts, drafted, accepted = (x - y for x, y in zip(after, before))
        tokens = [o.outputs[0].token_ids for o in outs]
        prev = outputs.setdefault(workload, tokens)
        if prev != tokens:
            raise RuntimeError(f"{name} {workload}: greedy output differs from the other engine's")
        return {"tok_s": speed, "acceptance": accepted / drafted if drafted else None,
                "mean_len": 1 + accepted / drafts if drafts else None}

    workloads = ("grounded", "open", "crowd")
    bench.log("warming up (programs compile on first use)")
    for w in workloads:
        for name in llms:
            one(name, w)
    results = {w: bench.rounds({name: (lambda i, n=name, w=w: one(n, w)) for name in llms}, tag=f"{w}: ")
               for w in workloads}
    bench.figures["results"] = {w: {n: rs for n, rs in r.items()} for w, r in results.items()}
    bench.figures["medians"] = {w: {n: medians([x for x in rs if x["acceptance"] is not None] or rs,
                                               ["tok_s"] + (["acceptance", "mean_len"] if n != "plain" else []))
                                    for n, rs in r.items()} for w, r in results.items()}
    st = llms["ngram"].engine.speculator.stats
    bench.figures["host"] = {"propose_s": st.propose_s, "sync_s": st.sync_s,
                             "spec_syncs": llms["ngram"].engine.stats.spec_syncs,
                             "steps": llms["ngram"].engine.stats.steps,
                             "batch_limit": llms["ngram"].engine.speculator.batch_limit,
                             "unspeculated_steps": st.unspeculated_steps}
    bench.figures["k"] = a.k


def report(res: dict) -> str:
    med = res["medians"]
    rows = []
    goals = {"grounded": 1.8, "open": 0.95, "crowd": 0.95}
    names = {"grounded": "grounded, batch 1 (decode tok/s)", "open": "open chat, batch 1 (decode tok/s)",
             "crowd": "32 concurrent (output tok/s)"}
    targets = []
    for w, goal in goals.items():
        p, s = med[w]["plain"]["tok_s"], med[w]["ngram"]["tok_s"]
        rows.append((names[w], s, p, ".1f"))
        targets.append(target(f"{w}: ngram / plain >= {goal}", s / p >= goal, f"{s / p:.2f}x"))
        if "draft" in med[w]:
            rows.append(("  draft model (int4 of itself)", med[w]["draft"]["tok_s"], p, ".1f"))
    acc = [(f"{names[w]}, {n}", fmt(med[w][n].get("acceptance"), ".2f"), fmt(med[w][n].get("mean_len"), ".2f"))
           for w in goals for n in ("ngram", "draft") if n in med[w]]
    h = res["host"]
    return "\n".join([
        *heading(f"speculative decoding (k = {res['k']}) vs plain, same weights, same run", res["system"]),
        compare(rows, names=("speculative", "plain"), label="median of rounds"),
        table(["workload", "acceptance rate", "mean accepted length"], acc),
        f"host: proposing {h['propose_s'] * 1e3:.0f} ms, waiting for the previous step before proposing "
        f"{h['sync_s']:.1f} s over {h['spec_syncs']} syncs in {h['steps']} steps; no drafts in the "
        f"{h['unspeculated_steps']} steps with more than {h['batch_limit']} requests decoding (disable_by_batch_size)",
        *targets_block(targets),
    ])


def main(argv=None) -> int:
    p = parser("python -m benchmarks.speculative", __doc__, rounds=(3, 1), quick="one round, 64 tokens",
               dtype=True)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--no-draft", action="store_true",
                   help="leave out the draft-model engine (the model's own int4 weights drafting for it)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens a request (default 128, --quick 64)")
    args = settle(p, p.parse_args(argv), quick={"max_tokens": (128, 64), "dtype": ("float32", "float32")},
                  at_least={"k": 1, "max_tokens": 8})
    return run(measure, report, args)


if __name__ == "__main__":
    sys.exit(main())
