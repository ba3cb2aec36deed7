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
        f"total             {ms(e2e)}" + (f" ({where})" if where else ""),
    ])
