"""The measured life of a request: timings and token counts, and their readable account.

All times are `time.perf_counter()` seconds. Durations are derived, so a
finished request can report queue wait, prefill, time to first token (TTFT),
every inter-token gap (ITL), time per output token (TPOT) and end-to-end.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional

from jaxinfer.stats import percentile


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    tokenize_s: float = 0.0
    template_tokens: int = 0  # prompt tokens added by the chat template
    user_tokens: int = 0  # prompt tokens of the user's own text
    prompt_tokens: int = 0
    cached_tokens: int = 0
    scheduled_time: Optional[float] = None  # left the queue
    prefill_chunks: list = field(default_factory=list)  # dispatch time of each prefill chunk
    prefill_done_time: Optional[float] = None
    first_token_time: Optional[float] = None
    token_times: list = field(default_factory=list)  # when each output token reached the host
    finished_time: Optional[float] = None
    decode_steps: int = 0
    output_tokens: int = 0
    # each step program the request had rows in, timed against its physical floor
    # (`jaxinfer.engine.roofline`): (kind "prefill" | "decode", the step's tokens, measured s, floor s)
    steps: list = field(default_factory=list)
    # speculative decoding (`jaxinfer.engine.speculative`): verify segments with drafts, their draft tokens,
    # and the drafts accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    # -- derived -------------------------------------------------------------

    @property
    def queue_s(self) -> Optional[float]:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def prefill_s(self) -> Optional[float]:
        if self.prefill_done_time is None or self.scheduled_time is None:
            return None
        return self.prefill_done_time - self.scheduled_time

    @property
    def ttft_s(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itl_s(self) -> list:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> Optional[float]:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_s(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def summary(self) -> dict:
        itl = self.itl_s
        return {
            "prompt_tokens": self.prompt_tokens,
            "template_tokens": self.template_tokens,
            "user_tokens": self.user_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "tokenize_s": self.tokenize_s,
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "prefill_chunks": len(self.prefill_chunks),
            "ttft_s": self.ttft_s,
            "decode_steps": self.decode_steps,
            "tpot_s": self.tpot_s,
            "itl_mean_s": statistics.fmean(itl) if itl else None,
            "itl_p50_s": percentile(itl, 50),
            "itl_p99_s": percentile(itl, 99),
            "itl_max_s": max(itl) if itl else None,
            "e2e_s": self.e2e_s,
            **roofline_summary(self.steps),
            **({"spec_drafts": self.spec_drafts, "spec_draft_tokens": self.spec_draft_tokens,
                "spec_accepted_tokens": self.spec_accepted_tokens} if self.spec_drafts else {}),
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(self.summary())
        return d

    def trace(self) -> str:
        """A readable account of the request's life (``jaxinfer generate --trace``)."""
        return format_trace(self.summary())


def format_trace(s: dict, where: str = "") -> str:
    """The request timeline ``generate --trace`` prints, from `RequestMetrics.summary` keys.

    One format for a request run here and one run by a server (whose timings arrive as the
    same keys); `where` labels the total (e.g. "server side").
    """

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    out, cached, e2e = s.get("output_tokens", 0), s.get("cached_tokens", 0), s.get("e2e_s")
    return "\n".join([
        "── request trace ──",
        f"prompt tokens     {s.get('prompt_tokens', 0)} ({s.get('user_tokens', 0)} user + "
        f"{s.get('template_tokens', 0)} template" + (f", {cached} cached" if cached else "") + ")",
        f"tokenize          {ms(s.get('tokenize_s'))}",
        f"queue wait        {ms(s.get('queue_s'))}",
        f"prefill           {ms(s.get('prefill_s'))} in {s.get('prefill_chunks', 0)} chunk(s)",
        f"time to 1st token {ms(s.get('ttft_s'))}",
        f"decode steps      {s.get('decode_steps', 0)}, mean step {ms(s.get('tpot_s'))} (TPOT)",
        f"inter-token gap   mean {ms(s.get('itl_mean_s'))}, p50 {ms(s.get('itl_p50_s'))}, "
        f"p99 {ms(s.get('itl_p99_s'))}, max {ms(s.get('itl_max_s'))}",
        f"output tokens     {out}" + (f" ({out / e2e:.1f} tok/s end to end)" if e2e else ""),
    ] + spec_trace_lines(s) + [
        f"total             {ms(e2e)}" + (f" ({where})" if where else ""),
    ] + roofline_trace_lines(s))


def spec_trace_lines(s: dict) -> list:
    """The trace's speculative-decoding line (none without drafts)."""
    n, d, a = s.get("spec_drafts"), s.get("spec_draft_tokens", 0), s.get("spec_accepted_tokens", 0)
    if not n:
        return []
    return [f"speculative       {n} verifies, {a} of {d} draft tokens accepted ({a / d:.0%}), "
            f"mean {1 + a / n:.2f} tokens a verify"]


# -- each step against its physical floor (`jaxinfer.engine.roofline`) ------------------------------

# a ragged step's kind: its rows all prompt chunks, all decode rows, or both
ROOFLINE_KINDS = ("prefill", "decode", "mixed")
# upper bounds of the `floor / measured` histogram (Prometheus ``step_roofline_fraction``)
ROOFLINE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def roofline_summary(steps: list) -> dict:
    """`RequestMetrics.steps` summed by kind: ``{kind}_step_s`` (measured) and ``{kind}_floor_s``
    totals, ``{kind}_roofline`` (floor / measured over them), the number of steps, and the prefill
    chunks one by one as ``prefill_step_list`` [(tokens, measured s, floor s)]. Empty without steps."""
    out: dict = {}
    for kind in ROOFLINE_KINDS:
        mine = [st for st in steps if st[0] == kind and st[2]]
        if not mine:
            continue
        measured, floor = sum(st[2] for st in mine), sum(st[3] for st in mine)
        out[f"{kind}_step_s"] = measured
        out[f"{kind}_floor_s"] = floor
        out[f"{kind}_roofline"] = floor / measured
        out[f"{kind}_roofline_steps"] = len(mine)
        out[f"{kind}_roofline_min"] = min(st[3] / st[2] for st in mine)
        if kind == "prefill":
            out["prefill_step_list"] = [(st[1], st[2], st[3]) for st in mine]
    return out


def roofline_trace_lines(s: dict) -> list:
    """The trace's lines for each step against its floor (none where the summary has no steps)."""
    lines = []
    for tokens, measured, floor in s.get("prefill_step_list") or ():
        lines.append(f"prefill step      {tokens} tok: {measured * 1e3:.1f} ms, floor {floor * 1e3:.1f} ms "
                     f"({floor / measured:.2f} of it)")
    n = s.get("decode_roofline_steps")
    if n:
        m, f = s["decode_step_s"], s["decode_floor_s"]
        lines.append(f"decode steps      mean {m / n * 1e3:.1f} ms, floor {f / n * 1e3:.1f} ms "
                     f"({s['decode_roofline']:.2f} of it; worst step {s['decode_roofline_min']:.2f})")
    if lines:
        lines.insert(0, "── steps vs their physical floor (floor / measured: 1 = the machine's limit) ──")
    return lines


class RooflineHistogram:
    """Floor / measured of each step program of one kind: cumulative counts over `ROOFLINE_BUCKETS`
    (Prometheus' layout), and the measured and floor seconds summed."""

    def __init__(self):
        self.counts = [0] * len(ROOFLINE_BUCKETS)  # per bucket, not cumulative
        self.over = 0  # above the last bucket (a floor the step beat: should not happen)
        self.count = 0
        self.sum = 0.0  # of the fractions
        self.measured_s = 0.0
        self.floor_s = 0.0

    def observe(self, measured_s: float, floor_s: float) -> None:
        frac = floor_s / measured_s
        for i, le in enumerate(ROOFLINE_BUCKETS):
            if frac <= le:
                self.counts[i] += 1
                break
        else:
            self.over += 1
        self.count += 1
        self.sum += frac
        self.measured_s += measured_s
        self.floor_s += floor_s

    @property
    def fraction(self) -> Optional[float]:
        """Floor over measured time of every step observed (time-weighted); None before any."""
        return self.floor_s / self.measured_s if self.measured_s else None

    def buckets(self) -> list:
        """[(upper bound as text, cumulative count)], "+Inf" last."""
        out, total = [], 0
        for le, c in zip(ROOFLINE_BUCKETS, self.counts):
            total += c
            out.append((repr(float(le)), total))
        out.append(("+Inf", total + self.over))
        return out


class RooflineCollector:
    """A Prometheus collector of ``<prefix>step_roofline_fraction{kind}``, the floor / measured of
    each step program, read from ``histograms()`` ({kind: `RooflineHistogram`}) at scrape time.
    Register it on a server's registry: ``registry.register(RooflineCollector(lambda:
    engine.stats.roofline, prefix, label_names, label_values))``."""

    def __init__(self, histograms, prefix: str = "jaxinfer:", label_names=(), label_values=()):
        self._histograms = histograms
        self._prefix = prefix
        self._names = list(label_names)
        self._values = list(label_values)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily

        fam = HistogramMetricFamily(
            self._prefix + "step_roofline_fraction",
            "Each step program's physical floor over its measured device time (1 = the machine's limit).",
            labels=self._names + ["kind"])
        for kind, h in sorted((self._histograms() or {}).items()):
            fam.add_metric(self._values + [kind], h.buckets(), h.sum)
        yield fam
