"""Engine-wide numbers: running / waiting, KV usage, prefix-cache hit rate, throughput.

`line()` formats them the way vLLM's periodic log line does, so the numbers
read the same: ``Avg prompt throughput: … tokens/s, Avg generation throughput:
… tokens/s, Running: … reqs, Waiting: … reqs, KV cache usage: …%, Prefix cache
hit rate: …%``.
"""

from __future__ import annotations

import time
from collections import deque

from jaxinfer.metrics import ROOFLINE_KINDS, RooflineHistogram


class EngineStats:
    def __init__(self, engine):
        self._engine = engine
        self.prompt_tokens = 0  # prefilled (computed) prompt tokens
        self.generation_tokens = 0
        self.steps = 0
        self.wait_s = 0.0  # host time spent waiting for device results
        self.busy_s = 0.0  # wall time of steps that dispatched work
        self.host_s = 0.0  # of which the host was working (not waiting for the device)
        self.grammar_syncs = 0  # steps that read the previous step's tokens first (a constrained row ran)
        self.spec_syncs = 0  # steps that read the previous step first so drafts follow its tokens (speculation)
        self.finished: dict = {}
        self.recent: deque = deque(maxlen=4096)  # summaries of finished requests
        # each step program against its physical floor (`jaxinfer.engine.roofline`), by kind
        self.roofline: dict = {k: RooflineHistogram() for k in ROOFLINE_KINDS}
        self._mark = (time.perf_counter(), 0, 0)
        self._roofline_mark: dict = {}  # kind -> (measured s, floor s) at the last line
        self._spec_mark = None  # speculative decoding's counters at the last line (set at the first)

    def on_step_timed(self, t) -> None:
        """One dispatched program timed (`jaxinfer.engine.roofline.StepTiming`): into the kind's
        histogram, and onto each unfinished request that had rows in it."""
        if not t.measured_s:
            return
        self.roofline.setdefault(t.kind, RooflineHistogram()).observe(t.measured_s, t.floor_s)
        for r in t.requests:
            if not r.finished:
                r.metrics.steps.append((t.kind, t.tokens, t.measured_s, t.floor_s))

    def on_finished(self, r) -> None:
        self.recent.append(r.metrics.summary() | {"finish_reason": r.finish_reason})

    def recent_tokens(self) -> int:
        _, p, g = self._mark
        return self.prompt_tokens - p + self.generation_tokens - g

    def snapshot(self) -> dict:
        e = self._engine
        return {
            "running": e.scheduler.num_running,
            "waiting": e.scheduler.num_waiting,
            "kv_usage": e.allocator.usage(),
            "prefix_hit_rate": e.allocator.hit_rate(),
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "steps": self.steps,
            "preemptions": e.scheduler.num_preemptions,
            "forks": e.scheduler.num_forks,  # choices of a group started on another's prompt pages
            "host_share": self.host_s / self.busy_s if self.busy_s else 0.0,
            "grammar_syncs": self.grammar_syncs,
            "spec_syncs": self.spec_syncs,
            "mask_s": e.runner.mask_s,  # host time computing structured-output masks
            "mask_rows": e.runner.mask_rows,
            "finished": dict(self.finished),
            # floor / measured of every step of the kind since start, its measured and floor seconds
            "roofline": {k: {"fraction": h.fraction, "steps": h.count, "measured_s": h.measured_s,
                             "floor_s": h.floor_s} for k, h in self.roofline.items() if h.count},
            # speculative decoding (`jaxinfer.engine.speculative.SpecStats`); absent when off
            **({"spec": e.speculator.stats.snapshot()} if e.speculator is not None else {}),
        }

    def _spec_since_mark(self) -> str:
        """vLLM's speculative-decoding line, since the previous one: mean acceptance length, accepted and
        drafted tokens, acceptance rate, and the acceptance rate per draft position."""
        spec = self._engine.speculator
        if spec is None:
            return ""
        st = spec.stats
        d0, t0, a0, pos0 = self._spec_mark or (0, 0, 0, [0] * len(st.accepted_per_pos))
        self._spec_mark = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos))
        drafts, drafted, accepted = st.num_drafts - d0, st.num_draft_tokens - t0, st.num_accepted_tokens - a0
        if not drafts:
            return ", SpecDecoding: no drafts"
        per_pos = ", ".join(f"{(b - a) / drafts:.3f}" for a, b in zip(pos0, st.accepted_per_pos))
        return (f", SpecDecoding: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted: {accepted} tokens, "
                f"Drafted: {drafted} tokens, Acceptance rate: {100 * accepted / max(drafted, 1):.1f}%, "
                f"Per-position acceptance rate: {per_pos}")

    def _roofline_since_mark(self) -> str:
        parts = []
        for kind, h in self.roofline.items():
            m0, f0 = self._roofline_mark.get(kind, (0.0, 0.0))
            self._roofline_mark[kind] = (h.measured_s, h.floor_s)
            if h.measured_s > m0:
                parts.append(f"{kind} {(h.floor_s - f0) / (h.measured_s - m0):.2f}")
        return f", Step floor/measured: {', '.join(parts)}" if parts else ""

    def line(self) -> str:
        """One log line; throughputs are averaged since the previous call."""
        now = time.perf_counter()
        t0, p0, g0 = self._mark
        dt = max(now - t0, 1e-9)
        self._mark = (now, self.prompt_tokens, self.generation_tokens)
        s = self.snapshot()
        return (
            f"Avg prompt throughput: {(self.prompt_tokens - p0) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(self.generation_tokens - g0) / dt:.1f} tokens/s, "
            f"Running: {s['running']} reqs, Waiting: {s['waiting']} reqs, "
            f"KV cache usage: {100 * s['kv_usage']:.1f}%, "
            f"Prefix cache hit rate: {100 * s['prefix_hit_rate']:.1f}%"
            + self._spec_since_mark()
            + self._roofline_since_mark()
        )
